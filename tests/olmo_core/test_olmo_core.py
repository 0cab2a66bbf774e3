"""The OLMo-core path: every MODEL_TYPE as an OLMo-core 3 block gives the ai2-olmo model's logits and gradients.

The ai2-olmo model (siamesenorm.build_model) with weights moved off their init is mapped by name into the OLMo-core
model built from ``transformer_config`` (strict: no missing or unexpected key); fp32 logits must agree within
1e-5 (observed: 0.0, the same operations in the same order), and mapping back must give the same tensors.
"""

import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

from siamesenorm import build_model
from siamesenorm.models.config import MODEL_TYPES

olmo_core_config = pytest.importorskip("siamesenorm.olmo_core.config")
from siamesenorm.olmo_core import blocks as core_blocks  # noqa: E402
from siamesenorm.olmo_core import require_olmo_core  # noqa: E402

TOLERANCE = 1e-5
ROOT = Path(__file__).resolve().parents[2]


def _pair(model_type, **overrides):
    """(ai2-olmo model, OLMo-core model with the mapped weights, config)."""
    config = tiny_config(weight_tying=False, mixln_post_fraction=0.5, **overrides)
    torch.manual_seed(0)
    olmo = build_model(config, model_type=model_type)
    with torch.no_grad():
        for p in olmo.parameters():
            p.add_(0.05 * torch.randn_like(p))  # off the init: norm scales and connections take part
    core = olmo_core_config.transformer_config(config, model_type=model_type).build(init_device="cpu")
    missing, unexpected = core.load_state_dict(olmo_core_config.olmo_to_core_state(olmo.state_dict(), config),
                                               strict=False)
    assert (missing, unexpected) == ([], []), (missing, unexpected)
    return olmo.eval(), core.eval(), config


def _ids(config, batch=2, seq=24):
    return torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))


def _assert_same_logits(olmo, core, config):
    ids = _ids(config)
    with torch.no_grad():
        expected = olmo(ids).logits
        got = core(ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_every_model_type_gives_the_ai2_olmo_logits(model_type):
    olmo, core, config = _pair(model_type)
    expected_block = core_blocks.CORE_BLOCKS[model_type]
    assert all(type(b) is expected_block for b in core.blocks.values())
    _assert_same_logits(olmo, core, config)
    back = olmo_core_config.core_to_olmo_state(core.state_dict(), model_type)
    reference = olmo.state_dict()
    assert set(back) == set(reference)
    assert all(torch.equal(back[k], v) for k, v in reference.items())


def test_lns_gives_the_logits_of_olmo_cores_own_layernorm_scaled_block():
    """OLMo-core 3 ships LayerNorm Scaling as a block type (``default_scaled``: ``LayerNormScaledTransformerBlock``,
    each norm's output x 1/sqrt(1-based block index)); ``lns`` on both paths gives its logits from the same weights."""
    import dataclasses

    from olmo_core.nn.transformer.block import LayerNormScaledTransformerBlock
    from olmo_core.nn.transformer.config import TransformerBlockConfig, TransformerBlockType

    olmo, ours, config = _pair("lns")
    theirs_config = olmo_core_config.transformer_config(config, model_type="pre")
    own = {f.name: getattr(theirs_config.block, f.name) for f in dataclasses.fields(TransformerBlockConfig)}
    theirs_config.block = TransformerBlockConfig(**{**own, "name": TransformerBlockType.default_scaled})
    theirs = theirs_config.build(init_device="cpu")
    assert all(type(b) is LayerNormScaledTransformerBlock for b in theirs.blocks.values())
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    # their 1/sqrt(l) is a buffer in the state dict, ours a constant: only those are missing
    assert (missing, unexpected) == ([f"blocks.{i}.ln_scale" for i in range(config.n_layers)], [])
    _assert_same_logits(olmo, theirs.eval(), config)
    assert [float(b.ln_scale) for b in theirs.blocks.values()] == pytest.approx(
        [1 / (i + 1) ** 0.5 for i in range(config.n_layers)])


@pytest.mark.parametrize("model_type,overrides", [
    ("post_pre", dict(post_pre_x_norm_position="after_addition")),
    ("hybrid_pre", dict(siamese_depth_scaling=False)),
    ("hybrid_pre", dict(siamese_normalized_input=False, siamese_depth_scaling_form="inv_sqrt_layer")),
    ("post", dict(post_norm_position="before_sublayer")),
    ("hc", dict(hc_expansion_rate=3)),
    ("mhc", dict(mhc_expansion_rate=2, mhc_sinkhorn_order="rows_first", mhc_sinkhorn_iterations=3)),
    ("pre", dict(n_kv_heads=2, attention_layer_norm=True)),
    ("hybrid_pre", dict(n_kv_heads=2, attention_layer_norm_with_affine=False)),
    ("post_pre", dict(layer_norm_type="default", include_bias=True)),
    ("pre", dict(embedding_layer_norm=True, clip_qkv=0.5)),
    ("attnres", dict(attnres_blocks=1)),
    ("hybrid_pre", dict(siamese_mixing="dynamic")),
    ("post_pre", dict(siamese_mixing="static", post_pre_x_norm_position="after_addition")),
])
def test_knobs_and_olmo_options_give_the_same_logits(model_type, overrides):
    olmo, core, config = _pair(model_type, **overrides)
    _assert_same_logits(olmo, core, config)


def test_tied_weights_map_to_olmo_cores_tying():
    config = tiny_config(weight_tying=True)
    olmo = build_model(config, model_type="hybrid_pre")
    core = olmo_core_config.transformer_config(config, model_type="hybrid_pre").build(init_device="cpu")
    state = olmo_core_config.olmo_to_core_state(olmo.state_dict(), config)
    missing, unexpected = core.load_state_dict(state, strict=False)
    assert (missing, unexpected) == (["lm_head.w_out.weight"], [])  # the tied output weight is the embedding
    assert core.lm_head.w_out.weight is core.embeddings.weight
    with torch.no_grad():
        assert (core(_ids(config)) - olmo.eval()(_ids(config)).logits).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("model_type", ["hybrid_pre", "post_pre", "hc", "attnres"])
def test_gradients_agree(model_type):
    olmo, core, config = _pair(model_type)
    ids = _ids(config)
    olmo(ids).logits.logsumexp(-1).mean().backward()
    core(ids).logsumexp(-1).mean().backward()
    grads = olmo_core_config.olmo_to_core_state({k: p.grad for k, p in olmo.named_parameters()}, config)
    for name, p in core.named_parameters():
        assert torch.allclose(p.grad, grads[name], rtol=1e-4, atol=1e-6), name


def test_model_type_selection_and_config_round_trip(monkeypatch):
    from olmo_core.nn.transformer.config import TransformerConfig

    config = tiny_config()
    tc = olmo_core_config.transformer_config(config, model_type="post_pre")
    tc.block.model_type = None  # then MODEL_TYPE decides, else pre, as on the ai2-olmo path
    monkeypatch.setenv("MODEL_TYPE", "hc")
    assert type(tc.build(init_device="cpu").blocks["0"]) is core_blocks.CORE_BLOCKS["hc"]
    monkeypatch.delenv("MODEL_TYPE")
    assert type(tc.build(init_device="cpu").blocks["0"]) is core_blocks.CORE_BLOCKS["pre"]
    # OLMo-core's own config files keep our block config and its knobs
    tc.block.model_type = "post_pre"
    tc.block.knobs = {"post_pre_x_norm_position": "after_addition"}
    again = TransformerConfig.from_dict(tc.as_config_dict())
    assert type(again.block) is olmo_core_config.SiameseBlockConfig
    assert again.block.knobs == {"post_pre_x_norm_position": "after_addition"}
    monkeypatch.setenv("MODEL_TYPE", "hc")  # as on the ai2-olmo path, MODEL_TYPE wins over the config's field
    assert type(again.build(init_device="cpu").blocks["0"]) is core_blocks.CORE_BLOCKS["hc"]
    monkeypatch.delenv("MODEL_TYPE")
    block = again.build(init_device="cpu").blocks["1"]
    assert block.knob("post_pre_x_norm_position") == "after_addition"
    assert block.knob("siamese_depth_scaling") is True  # not given: the default


def test_bad_input_is_one_line(monkeypatch):
    config = tiny_config()
    tc = olmo_core_config.transformer_config(config, model_type="pre")
    tc.block.model_type = "hybrid_pr"
    with pytest.raises(ValueError, match="no OLMo-core block yet; the OLMo-core path has pre, post"):
        tc.build(init_device="cpu")
    with pytest.raises(ValueError, match="activation_type must be swiglu"):
        olmo_core_config.transformer_config(tiny_config(activation_type="gelu"), model_type="pre")
    from olmo.exceptions import OLMoConfigurationError

    with pytest.raises(OLMoConfigurationError, match="attention_layer_norm to false"):  # the ai2-olmo path's own check
        olmo_core_config.transformer_config(tiny_config(attention_layer_norm=True), model_type="hybrid_pre")
    monkeypatch.setitem(sys.modules, "olmo_core.version", types.SimpleNamespace(VERSION="0.1.0"))
    with pytest.raises(ImportError, match="needs ai2-olmo-core 3, this environment has 0.1.0"):
        require_olmo_core()


def test_parameter_counts_match_the_ai2_olmo_count_before_any_build():
    """OLMo-core logs ``num_params`` before it builds; ours counts the variant's parameters too, so the 1.3B
    recipe's count is the ai2-olmo path's (docs/training.md's table) for every MODEL_TYPE."""
    from siamesenorm import num_params_from_config
    from siamesenorm.run.recipe import load_config

    cfg = load_config("configs/OLMo-1B-1e-3.yaml", ["--save_folder=/tmp/unused-count"])
    for model_type in MODEL_TYPES:
        core = olmo_core_config.transformer_config(cfg.model, model_type)
        assert core.num_params == num_params_from_config(cfg.model, model_type), model_type
        assert core.num_active_params == core.num_params  # dense: every parameter is active


def _init_std_table(recipe: str, model_type: str, width: int = 256):
    """Per tensor: (ai2-olmo's std, OLMo-core's std, the std ai2-olmo's rule states, the cutoff in stds), the 1.3B
    recipe's init_fn and depth at a narrower width (the rules depend on depth and width only through the formula)."""
    from siamesenorm.run.recipe import load_config

    cfg = load_config(str(ROOT / "configs" / recipe), [f"--model.d_model={width}", "--model.n_heads=4",
                                                       "--model.mlp_hidden_size=null", "--model.vocab_size=512",
                                                       "--model.embedding_size=512", "--model.init_device=cpu"]).model
    torch.manual_seed(0)
    ai2 = olmo_core_config.olmo_to_core_state(build_model(cfg, model_type).state_dict(), cfg)
    core = olmo_core_config.transformer_config(cfg, model_type=model_type).build(init_device="cpu")
    core.init_weights(device=torch.device("cpu"))
    fields = olmo_core_config.olmo_init_fields(cfg)
    table = {}
    for name, p in core.named_parameters():
        spec = olmo_core_config.olmo_init_spec(name, p.shape[-1] if p.dim() == 2 else 0, fields)
        if spec is not None:
            table[name] = (float(ai2[name].float().std()), float(p.detach().std()), spec[0], spec[1],
                           float(p.detach().abs().max()))
    return table


@pytest.mark.parametrize("recipe,model_type", [("OLMo-1B-hybrid-2e-3.yaml", "hybrid_pre"),  # full_megatron
                                               ("OLMo-1B-2e-3.yaml", "pre"),  # mitchell
                                               ("OLMo-1B-2e-3.yaml", "post_pre")])
def test_the_olmo_core_model_starts_from_ai2_olmo_s_init_per_tensor(recipe, model_type):
    """Every matrix ai2-olmo initialises has the same distribution on the OLMo-core path (the issue found every
    matrix a plain normal at init_std there: full_megatron's outputs 2.8x wider, the head 1.58x narrower; mitchell's
    MLP outputs up to 10x off at layer 15): the measured std of each tensor on both paths within 3% of the rule's
    (a truncated normal at 3 stds has 0.987 of its std), and nothing beyond the cutoff."""
    table = _init_std_table(recipe, model_type)
    assert len(table) >= 16 * 7 + 1  # q, k, v, out, w1, w2, w3 in 16 blocks, the embedding
    for name, (ai2, core, rule, cutoff, largest) in table.items():
        expected = rule * (0.9866 if cutoff == 3.0 else 1.0)
        assert ai2 == pytest.approx(expected, rel=0.03), (name, "ai2-olmo", ai2, expected)
        assert core == pytest.approx(expected, rel=0.03), (name, "OLMo-core", core, expected)
        assert cutoff is None or largest <= cutoff * rule * (1 + 1e-6), (name, largest, cutoff * rule)
    out15 = [v for k, v in table.items() if k.startswith("blocks.15.") and k.endswith(("w2.weight", "w_out.weight"))]
    ins = [v for k, v in table.items() if k.endswith("w_q.weight")]
    assert all(o[1] < 0.7 * ins[0][1] for o in out15)  # the depth-scaled outputs really are narrower
