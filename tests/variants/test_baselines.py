"""One property per added variant that a wrong implementation of its definition would break."""

import math

import pytest
import torch
from conftest import tiny_config
from olmo.exceptions import OLMoConfigurationError
from test_variants import ids, randomize

from siamesenorm import build_model
from siamesenorm.nn import sinkhorn
from siamesenorm.variants.deepnorm import deepnorm_alpha, deepnorm_beta
from siamesenorm.variants.mixln import mixln_post_layers


def shared_state(src, dst):
    """Copy every parameter ``dst`` shares by name with ``src``; return the names ``dst`` has that src lacks."""
    mine = dst.state_dict()
    theirs = {k: v for k, v in src.state_dict().items() if k in mine}
    dst.load_state_dict(theirs, strict=False)
    return set(mine) - set(theirs)


# ---- deepnorm ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_layers,alpha,beta", [(6, 12**0.25, 48**-0.25), (24, 48**0.25, 192**-0.25)])
def test_deepnorm_constants_follow_the_depth(n_layers, alpha, beta):
    assert deepnorm_alpha(n_layers) == pytest.approx(alpha) and deepnorm_beta(n_layers) == pytest.approx(beta)
    assert alpha > 1 > beta  # the residual is up-weighted, the init scaled down (a public copy inverted this)
    model = build_model(tiny_config(n_layers=n_layers, d_model=16, n_heads=2), "deepnorm")
    assert [b.residual_scale for b in model.transformer.blocks] == pytest.approx([alpha] * n_layers)


def test_deepnorm_init_scales_v_out_and_mlp_but_not_q_k():
    torch.manual_seed(5)
    post = build_model(tiny_config(n_layers=6), "post")
    torch.manual_seed(5)
    deep = build_model(tiny_config(n_layers=6), "deepnorm")
    beta, d = deepnorm_beta(6), post.config.d_model
    for bp, bd in zip(post.transformer.blocks, deep.transformer.blocks):
        wp, wd = bp.att_proj.weight, bd.att_proj.weight
        torch.testing.assert_close(wd[: 2 * d], wp[: 2 * d], rtol=0, atol=0)  # q, k untouched
        torch.testing.assert_close(wd[2 * d :], beta * wp[2 * d :])  # v scaled
        for name in ("attn_out", "ff_proj", "ff_out"):
            torch.testing.assert_close(getattr(bd, name).weight, beta * getattr(bp, name).weight, msg=name)


# ---- residual (ResiDual) -----------------------------------------------------------------------------------
def capture(model, names, pre=False):
    """Record the output (or, with pre=True, the first input) of every submodule whose name ends in one of names."""
    seen, handles = [], []
    for name, module in model.named_modules():
        if name.split(".")[-1] in names:
            if pre:
                handles.append(module.register_forward_pre_hook(lambda m, a, n=name: seen.append((n, a[0]))))
            else:
                handles.append(module.register_forward_hook(lambda m, a, out, n=name: seen.append((n, out))))
    return seen, handles


def test_residual_accumulator_receives_every_sublayer_output():
    model = randomize(build_model(tiny_config(n_layers=4), "residual"))
    outputs, h1 = capture(model, ("attn_out", "ff_out"))
    fused, h2 = capture(model, ("out_norm_dual",), pre=True)
    x = ids()
    with torch.no_grad():
        model(x)
    assert len(outputs) == 8 and len(fused) == 1
    embedding = model.transformer.wte(x)
    torch.testing.assert_close(fused[0][1], embedding + sum(o for _, o in outputs), rtol=1e-5, atol=1e-5)


def test_residual_accumulator_feeds_no_sublayer_input():
    """d(every later sublayer input) / d(accumulator) is exactly zero; d/d(main stream) is not."""
    model = randomize(build_model(tiny_config(n_layers=4), "residual"))
    blocks = model.transformer.blocks
    with torch.no_grad():
        state = blocks[0](model.transformer.wte(ids()))[0]  # (B, T, 2d) after block 0
    state.requires_grad_(True)
    inputs, handles = capture(model, ("att_proj", "ff_proj"), pre=True)
    h = state
    for block in blocks[1:]:
        h = block(h)[0]
    torch.manual_seed(0)
    probe = sum((t * torch.randn_like(t)).sum() for _, t in inputs)
    (grad,) = torch.autograd.grad(probe, state, retain_graph=True)
    main, accumulator = grad.chunk(2, dim=-1)
    assert len(inputs) == 6
    assert main.abs().max() > 1e-3
    assert torch.equal(accumulator, torch.zeros_like(accumulator))
    (out_grad,) = torch.autograd.grad(h.sum(), state)
    assert out_grad.chunk(2, dim=-1)[1].abs().max() > 1e-3  # ...but it does reach the output


# ---- mixln -------------------------------------------------------------------------------------------------
def test_mixln_post_layer_count():
    assert mixln_post_layers(tiny_config(n_layers=12)) == 3
    assert mixln_post_layers(tiny_config(n_layers=100, mixln_post_fraction=0.29)) == 29
    model = build_model(tiny_config(n_layers=12), "mixln")
    assert [b.is_post_ln for b in model.transformer.blocks] == [True] * 3 + [False] * 9


@pytest.mark.parametrize("fraction,equivalent", [(0.0, "pre"), (1.0, "post")])
def test_mixln_extremes_are_pre_and_post(fraction, equivalent):
    mix = randomize(build_model(tiny_config(mixln_post_fraction=fraction), "mixln"))
    other = build_model(tiny_config(), equivalent)
    assert not shared_state(mix, other)
    with torch.no_grad():
        torch.testing.assert_close(mix(ids()).logits, other(ids()).logits, rtol=0, atol=0)


# ---- peri --------------------------------------------------------------------------------------------------
def test_peri_each_update_is_its_output_norm_of_the_branch_output():
    model = randomize(build_model(tiny_config(), "peri"))
    branch, h1 = capture(model, ("attn_out", "ff_out"))
    ff_in, h2 = capture(model, ("ff_norm",), pre=True)
    block_in, h3 = capture(model, ("attn_norm",), pre=True)
    block_out = []
    for b in model.transformer.blocks:
        b.register_forward_hook(lambda m, a, out: block_out.append(out[0]))
    with torch.no_grad():
        model(ids())
        for i, block in enumerate(model.transformer.blocks):
            att, ff = branch[2 * i][1], branch[2 * i + 1][1]
            torch.testing.assert_close(ff_in[i][1] - block_in[i][1], block.attn_out_norm(att), rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(block_out[i] - ff_in[i][1], block.ff_out_norm(ff), rtol=1e-4, atol=1e-5)
    first = model.transformer.blocks[0]
    torch.testing.assert_close(block_in[0][1], first.emb_norm(model.transformer.wte(ids())))


# ---- mhc ---------------------------------------------------------------------------------------------------
def test_sinkhorn_is_doubly_stochastic():
    """The mHC paper's order T_r(T_c(.)) ends on rows (exact); columns are within the iterations' tolerance."""
    logits = torch.randn(50, 4, 4)
    m = sinkhorn(logits, 20)
    torch.testing.assert_close(m.sum(-1), torch.ones(50, 4), atol=1e-6, rtol=0)
    torch.testing.assert_close(m.sum(-2), torch.ones(50, 4), atol=1e-3, rtol=0)
    assert (m > 0).all()
    assert (sinkhorn(logits, 1).sum(-2) - 1).abs().max() > 1e-2  # one iteration is not enough: the test can fail
    one = sinkhorn(logits, 1)  # one columns-then-rows step: rows exact, columns not
    torch.testing.assert_close(one.sum(-1), torch.ones(50, 4), atol=1e-6, rtol=0)
    legacy = sinkhorn(logits, 1, "rows_first")  # the other order: columns exact, rows not
    torch.testing.assert_close(legacy.sum(-2), torch.ones(50, 4), atol=1e-6, rtol=0)
    assert (legacy.sum(-1) - 1).abs().max() > 1e-2


def test_mhc_mixing_stays_doubly_stochastic_after_training_steps():
    model = build_model(tiny_config(), "mhc")
    opt = torch.optim.AdamW(model.parameters(), lr=5e-2)
    before = model.transformer.blocks[1].attn_mhc.bias_res.detach().clone()
    for _ in range(3):
        opt.zero_grad()
        x = ids()
        torch.nn.functional.cross_entropy(model(x).logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
    assert not torch.equal(before, model.transformer.blocks[1].attn_mhc.bias_res)  # it did train
    block_inputs = []
    for b in model.transformer.blocks:
        b.register_forward_pre_hook(lambda m, a: block_inputs.append(a[0]))
    with torch.no_grad():
        model(ids())
        n = model.config.mhc_expansion_rate
        for block, h in zip(model.transformer.blocks[1:], block_inputs[1:]):
            for hc in (block.attn_mhc, block.ff_mhc):
                pre, post, res = hc.coefficients(h.unflatten(-1, (n, -1)))
                assert res.shape == (*h.shape[:2], n, n)
                torch.testing.assert_close(res.sum(-1), torch.ones(res.shape[:-1]), atol=1e-4, rtol=0)
                torch.testing.assert_close(res.sum(-2), torch.ones(res.shape[:-1]), atol=1e-4, rtol=0)
                assert ((pre > 0) & (pre < 1)).all() and ((post > 0) & (post < 2)).all()


def test_mhc_init_coefficients():
    block = build_model(tiny_config(), "mhc").transformer.blocks[0]
    with torch.no_grad():
        pre, post, res = block.attn_mhc.coefficients(torch.zeros(1, 1, 4, 32))
    torch.testing.assert_close(pre, torch.full_like(pre, 0.25))  # reads the mean
    torch.testing.assert_close(post, torch.ones_like(post))
    torch.testing.assert_close(res, torch.full_like(res, 0.25))  # uniform


def test_mhc_without_dynamic_gates_is_pre_norm():
    """With the initial biases and the dynamic gates at zero, all n streams stay equal, and mhc computes
    Pre-Norm with the same (randomised) block weights."""
    mhc = randomize(build_model(tiny_config(), "mhc"))
    pre = build_model(tiny_config(), "pre")
    assert not shared_state(mhc, pre)
    with torch.no_grad():
        for block in mhc.transformer.blocks:
            for hc in (block.attn_mhc, block.ff_mhc):
                hc.reset_parameters()
                hc.gates.zero_()
        torch.testing.assert_close(mhc(ids()).logits, pre(ids()).logits, rtol=1e-4, atol=1e-5)


# ---- hybrid_star -------------------------------------------------------------------------------------------
def test_hybrid_star_layer_zero_is_pre_norm_the_rest_hybrid():
    star = randomize(build_model(tiny_config(), "hybrid_star"))
    hybrid = build_model(tiny_config(), "hybrid")
    extra = shared_state(star, hybrid)
    assert extra == set() and "transformer.blocks.0.attn_norm.weight" in star.state_dict()
    assert "transformer.blocks.1.attn_norm.weight" not in star.state_dict()
    h = torch.randn(2, 6, 32)
    with torch.no_grad():
        s0, s1 = (star.transformer.blocks[i](h)[0] for i in (0, 1))
        h0, h1 = (hybrid.transformer.blocks[i](h)[0] for i in (0, 1))
        torch.testing.assert_close(s1, h1, rtol=0, atol=0)  # layer 1: HybridNorm
        assert (s0 - h0).abs().max() > 1e-2  # layer 0: not HybridNorm...
        b = star.transformer.blocks[0]  # ...but Pre-Norm with HybridNorm's Q/K/V norms
        x = h + b.attention_branch(b.attn_norm(h), None, None, False, None, None)[0]
        torch.testing.assert_close(s0, x + b.mlp_branch(b.ff_norm(x)))


# ---- pre_embednorm -----------------------------------------------------------------------------------------
def test_pre_embednorm_normalises_the_embedding_without_parameters():
    model = randomize(build_model(tiny_config(), "pre_embednorm"))
    pre = build_model(tiny_config(), "pre")
    assert model.num_params() == pre.num_params() and not shared_state(model, pre)
    seen, handles = capture(model, ("attn_norm",), pre=True)
    with torch.no_grad():
        with_norm = model(ids()).logits
        without = pre(ids()).logits
    e = model.transformer.wte(ids())
    torch.testing.assert_close(seen[0][1], e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + model.config.layer_norm_eps))
    rms = seen[0][1].pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), atol=1e-2, rtol=0)  # unit scale, up to eps
    assert (with_norm - without).abs().max() > 1e-3


# ---- config errors -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "model_type,overrides,needle",
    [
        ("mixln", {"mixln_post_fraction": 1.5}, "mixln_post_fraction"),
        ("mhc", {"mhc_expansion_rate": 0}, "mhc_expansion_rate"),
        ("mhc", {"mhc_sinkhorn_iterations": 0}, "mhc_sinkhorn_iterations"),
        ("peri", {"embedding_layer_norm": True}, "embedding_layer_norm"),
        ("pre_embednorm", {"embedding_layer_norm": True}, "embedding_layer_norm"),
        ("hybrid_star", {"attention_layer_norm": True}, "attention_layer_norm"),
    ],
)
def test_invalid_knobs_say_what_to_change(model_type, overrides, needle):
    with pytest.raises(OLMoConfigurationError, match=needle):
        tiny_config(model_type=model_type, **overrides)


def test_names_do_not_clash_with_seed_names():
    from siamesenorm import MODEL_TYPES

    assert MODEL_TYPES.count("post_pre") == 1 and "mixln" in MODEL_TYPES
    assert math.isclose(deepnorm_alpha(1), 2**0.25)
