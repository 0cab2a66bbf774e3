"""The paper's section-3 reductions, numerically, and Pre-Norm being OLMo's own block bit for bit."""

import dataclasses

import pytest
import torch
from conftest import tiny_config
from olmo.config import ModelConfig
from olmo.model import OLMo, OLMoSequentialBlock
from reference import Ref
from test_variants import ids, randomize

from siamesenorm import build_model
from siamesenorm.models.config import as_siamese_config


def copy_shared(src, dst, rename=None):
    """Copy every parameter of src into dst (names mapped by ``rename``); return dst's names left untouched."""
    rename = rename or {}
    dst_params = dict(dst.named_parameters())
    with torch.no_grad():
        for name, p in src.named_parameters():
            for old, new in rename.items():
                name = name.replace(old, new)
            dst_params.pop(name).copy_(p)
    return dst_params


def zero_(params, *suffixes):
    with torch.no_grad():
        for name, p in params.items():
            if name.endswith(suffixes):
                p.zero_()


def test_pre_is_olmo_stock_block_bit_identical():
    ours_cfg = tiny_config()
    stock = OLMo(ModelConfig(**{f.name: getattr(ours_cfg, f.name) for f in dataclasses.fields(ModelConfig)}))
    ours = build_model(tiny_config(), "pre")
    assert all(type(b) is OLMoSequentialBlock for b in ours.transformer.blocks)
    ours.load_state_dict(randomize(stock).state_dict())
    x = ids()
    out_stock, out_ours = stock(x).logits, ours(x).logits
    assert torch.equal(out_stock, out_ours)
    out_stock.square().mean().backward()
    out_ours.square().mean().backward()
    for (name, a), (_, b) in zip(stock.named_parameters(), ours.named_parameters()):
        assert torch.equal(a.grad, b.grad), name


POSITIONS = ["before_sublayer", "after_addition"]


@pytest.mark.parametrize("position", POSITIONS)
def test_post_pre_with_bounded_stream_zeroed_is_pre_norm(position):
    """LN^X scales = 0 (out_norm_x included). Needs: RMSNorm, normalized input on, LN^Y scales 1 (their init) and an
    eps far below the embedding's mean square, so that LN^in(X_0 + LN^Y(X_0)) = LN^in(X_0) at layer 0 (after_addition;
    before_sublayer zeroes X_0 itself). Depth scaling is then moot (X is zeroed at every sublayer); it is switched
    off to state it. Holds for both placements of LN^X."""
    cfg = dict(layer_norm_eps=1e-12, siamese_normalized_input=True, siamese_depth_scaling=False,
               post_pre_x_norm_position=position)
    pre = randomize(build_model(tiny_config(**cfg), "pre"))
    siamese = build_model(tiny_config(**cfg), "post_pre")
    left = copy_shared(pre, siamese)  # pre's attn_norm / ff_norm become LN^in: same names
    assert set(left) == {n for n in left if n.endswith(("_norm_x.weight", "_norm_y.weight"))}
    zero_(left, "attn_norm_x.weight", "ff_norm_x.weight", "out_norm_x.weight")
    x = ids()
    torch.testing.assert_close(siamese(x).logits, pre(x).logits, rtol=1e-4, atol=1e-5)
    # and the reduction is not trivially true: with LN^X left at its init the outputs differ
    with torch.no_grad():
        for p in left.values():
            p.fill_(1.0)
    assert not torch.allclose(siamese(x).logits, pre(x).logits, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("position", POSITIONS)
def test_post_pre_with_pre_norm_stream_zeroed_is_post_norm(position):
    """LN^Y scales = 0, depth-wise scaling off, normalized input off (section 3's plain equations). The Post-Norm it
    reduces to has LN^X's placement: paper eq. 2 for after_addition, the HybridNorm fork's for before_sublayer."""
    cfg = dict(siamese_normalized_input=False, siamese_depth_scaling=False, post_pre_x_norm_position=position,
               post_norm_position=position)
    post = randomize(build_model(tiny_config(**cfg), "post"))
    siamese = build_model(tiny_config(**cfg), "post_pre")
    left = copy_shared(post, siamese, rename={"attn_norm.": "attn_norm_x.", "ff_norm.": "ff_norm_x."})
    zero_(left, "attn_norm_y.weight", "ff_norm_y.weight", "out_norm_y.weight")
    x = ids()
    torch.testing.assert_close(siamese(x).logits, post(x).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n", [1, 2])
def test_hc_at_init_is_pre_norm(n):
    """One stream: exactly Pre-Norm. Two streams: equal streams summed at the end, which ln_f (RMSNorm, tiny
    eps) maps to the same logits."""
    cfg = dict(hc_expansion_rate=n, layer_norm_eps=1e-12)
    pre = randomize(build_model(tiny_config(**cfg), "pre"))
    hc = build_model(tiny_config(**cfg), "hc")
    left = copy_shared(pre, hc)
    assert all("_hc." in name for name in left)
    x = ids()
    torch.testing.assert_close(hc(x).logits, pre(x).logits, rtol=1e-5, atol=1e-6)


def test_hybrid_qkv_norms_are_per_head_and_before_rope():
    model = randomize(build_model(tiny_config(), "hybrid"))  # head-norm scales random: order matters
    ref, x = Ref(model), ids()
    with torch.no_grad():
        got = model(x).logits
        right_order = ref.hybrid(x, norm_then_rope=True)
        swapped = ref.hybrid(x, norm_then_rope=False)
    torch.testing.assert_close(got, right_order, rtol=1e-4, atol=1e-4)
    assert (got - swapped).abs().max() > 1e-2, "RoPE-then-norm gives the same logits: the test could not tell"
    block = model.transformer.blocks[0]
    assert block.q_head_norm.normalized_shape == (model.config.d_model // model.config.n_heads,)
    assert not hasattr(block, "attn_norm")  # HybridNorm has no attention-input norm


def test_depth_scale_forms():
    from siamesenorm.models.config import depth_scale

    paper = tiny_config(siamese_depth_scaling_form="inv_sqrt_layer")
    code = tiny_config(siamese_depth_scaling_form="inv_sqrt_2layer")
    assert [depth_scale(paper, i) for i in range(3)] == pytest.approx([1.0, 2**0.5, 3**0.5])
    assert [depth_scale(code, i) for i in range(3)] == pytest.approx([2**0.5, 2.0, 6**0.5])
    assert depth_scale(tiny_config(siamese_depth_scaling=False), 5) == 1.0
    model = build_model(as_siamese_config(paper), "hybrid_pre")
    assert [b.depth_scale for b in model.transformer.blocks] == pytest.approx([1.0, 2**0.5, 3**0.5])
