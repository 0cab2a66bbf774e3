"""Defaults that follow the official code (docs/fidelity.md), the readings kept as knobs, and old checkpoints
keeping the meaning they were trained with."""

import logging
import math
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from omegaconf import OmegaConf as om
from test_variants import ids, randomize

from siamesenorm import build_model
from siamesenorm.models.config import LEGACY_KNOBS, SiameseModelConfig

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_the_official_codes():
    cfg = SiameseModelConfig()
    assert cfg.siamese_depth_scaling_form == "inv_sqrt_2layer"  # OLMo_model_hybrid_pre.py line 761
    assert cfg.post_pre_x_norm_position == "before_sublayer"  # deit-model-siamesenorm.py lines 216-227
    assert cfg.post_norm_position == "after_addition"  # paper eq. 2 (no official OLMo Post-Norm to follow)
    assert cfg.mhc_sinkhorn_order == "columns_first"  # mHC paper T_r(T_c(.))
    assert cfg.hc_scale_output_init and cfg.hc_decay_dynamic  # HC paper section 4
    model = build_model(tiny_config(), "hybrid_pre")
    assert [b.depth_scale for b in model.transformer.blocks] == pytest.approx([2**0.5, 2.0, 6**0.5])


def official_deit_block_forward(block, x, y, c):
    """deit-model-siamesenorm.py Block.forward, its names mapped onto ours (post_norm1 -> attn_norm_x, pre_norm1 ->
    attn_norm_y, input_norm1 -> attn_norm, and the same for 2 -> ff_*); attention and MLP are OLMo's."""
    x = block.attn_norm_x(x)
    z = block.attention_branch(block.attn_norm(x + block.attn_norm_y(y)), None, None, False, None, None)[0]
    x, y = x + z / c, y + z
    x = block.ff_norm_x(x)
    z = block.mlp_branch(block.ff_norm(x + block.ff_norm_y(y)))
    return x + z / c, y + z


def test_post_pre_default_is_the_official_deit_block():
    """Block by block in the official file's form, and its head final_norm(pre_norm(x) + post_norm(y))."""
    model = randomize(build_model(tiny_config(), "post_pre"))
    tokens = ids()
    with torch.no_grad():
        x = model.transformer.wte(tokens)
        y = x.clone()  # forward_features: y = x.clone(), no norm on either
        for i, block in enumerate(model.transformer.blocks):
            x, y = official_deit_block_forward(block, x, y, ((i + 1) * 2) ** 0.5)
        last = model.transformer.blocks[-1]
        h = model.transformer.ln_f(last.out_norm_x(x) + last.out_norm_y(y))
        want = h @ model.transformer.wte.weight.T  # tiny_config ties the output layer
        torch.testing.assert_close(model(tokens).logits, want, rtol=1e-5, atol=1e-5)
        text = randomize(build_model(tiny_config(post_pre_x_norm_position="after_addition"), "post_pre"))
        text.load_state_dict(model.state_dict())
        assert (text(tokens).logits - want).abs().max() > 1e-2  # the paper-text reading is a different model


@pytest.mark.parametrize("n", [2, 4])
def test_hc_output_weights_start_scaled_for_n_streams(n):
    torch.manual_seed(5)
    pre = build_model(tiny_config(), "pre")
    torch.manual_seed(5)
    hc = build_model(tiny_config(hc_expansion_rate=n), "hc")
    torch.manual_seed(5)
    unscaled = build_model(tiny_config(hc_expansion_rate=n, hc_scale_output_init=False), "hc")
    for p_block, h_block, u_block in zip(pre.transformer.blocks, hc.transformer.blocks, unscaled.transformer.blocks):
        for name in ("attn_out", "ff_out"):
            want = getattr(p_block, name).weight
            torch.testing.assert_close(getattr(h_block, name).weight, want / math.sqrt(n), rtol=0, atol=0)
            torch.testing.assert_close(getattr(u_block, name).weight, want, rtol=0, atol=0)
        torch.testing.assert_close(h_block.att_proj.weight, p_block.att_proj.weight, rtol=0, atol=0)


def optimizer_groups(model_cfg_overrides, model_type):
    from siamesenorm.ai2_olmo.train import load_config
    from siamesenorm.ai2_olmo.trainer import build_optimizer_with_coefficients

    cfg = load_config(str(ROOT / "configs" / "tiny-cpu.yaml"))
    model = build_model(tiny_config(**model_cfg_overrides), model_type)
    optim = build_optimizer_with_coefficients(cfg, model)
    decayed = {n for g in optim.param_groups if g["weight_decay"] > 0 for n in g["param_names"]}
    not_decayed = {n for g in optim.param_groups if g["weight_decay"] == 0 for n in g["param_names"]}
    assert decayed.isdisjoint(not_decayed)
    assert decayed | not_decayed == {n for n, _ in model.named_parameters()}
    return decayed, not_decayed


def test_hc_weight_decay_on_dynamic_projections_only():
    decayed, not_decayed = optimizer_groups({}, "hc")
    hc_params = {n for n in decayed | not_decayed if "_hc." in n}
    dynamic = {n for n in hc_params if n.endswith(("dynamic_alpha_fn", "dynamic_beta_fn"))}
    assert dynamic and dynamic <= decayed
    assert (hc_params - dynamic) <= not_decayed  # static alpha/beta, dynamic scales, the connection norms
    assert any(n.endswith("static_alpha") for n in not_decayed)
    decayed, _ = optimizer_groups({"hc_decay_dynamic": False}, "hc")
    assert not any("_hc." in n for n in decayed)


def test_gamma_and_mhc_coefficients_not_decayed():
    for model_type, marker in (("hybrid_pre", "gamma"), ("mhc", "_mhc.")):
        decayed, not_decayed = optimizer_groups({}, model_type)
        assert any(marker in n for n in not_decayed) and not any(marker in n for n in decayed)


def saved_config(tmp_path, model_type, drop=(), **changes):
    """A run folder's config.yaml as our training writes it, with ``drop`` fields removed (an older checkpoint)."""
    from siamesenorm.ai2_olmo.train import load_config

    cfg = load_config(str(ROOT / "configs" / "tiny-cpu.yaml"))
    cfg.model.model_type = model_type
    for k, v in changes.items():
        setattr(cfg.model, k, v)
    folder = tmp_path / "step10"
    folder.mkdir(parents=True)
    cfg.save(folder / "config.yaml")
    raw = om.load(str(folder / "config.yaml"))
    for name in drop:
        del raw.model[name]
    om.save(raw, str(folder / "config.yaml"))
    return folder


def test_checkpoint_without_new_knobs_loads_with_old_meaning(tmp_path, caplog):
    from siamesenorm.run.checkpoints import load_saved_config

    folder = saved_config(tmp_path, "post_pre", drop=list(LEGACY_KNOBS))
    with caplog.at_level(logging.INFO, logger="siamesenorm.run.checkpoints"):
        cfg = load_saved_config(folder / "config.yaml")
    for name, old in LEGACY_KNOBS.items():
        assert getattr(cfg.model, name) == old, name
    assert "predates model.post_pre_x_norm_position" in caplog.text
    # a checkpoint that has the fields keeps its own values, whatever the defaults are now
    folder = saved_config(tmp_path / "new", "post_pre", post_pre_x_norm_position="before_sublayer")
    assert load_saved_config(folder / "config.yaml").model.post_pre_x_norm_position == "before_sublayer"


def test_old_post_pre_checkpoint_rebuilds_as_the_model_it_was(tmp_path):
    """Weights saved from an after_addition model (the old default) give the same logits after loading."""
    from siamesenorm.run.checkpoints import load_saved_config

    old = randomize(build_model(tiny_config(post_pre_x_norm_position="after_addition",
                                            siamese_depth_scaling_form="inv_sqrt_layer"), "post_pre"))
    folder = saved_config(tmp_path, "post_pre", drop=list(LEGACY_KNOBS))
    cfg = load_saved_config(folder / "config.yaml")
    rebuilt_cfg = tiny_config(**{k: getattr(cfg.model, k) for k in LEGACY_KNOBS})
    rebuilt = build_model(rebuilt_cfg, "post_pre")
    rebuilt.load_state_dict(old.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids()).logits, old(ids()).logits, rtol=0, atol=0)


def test_resume_with_a_different_knob_is_refused_naming_each_field(tmp_path):
    from siamesenorm.ai2_olmo.train import RunError, check_resume_model, load_config

    folder = saved_config(tmp_path, "mixln", mixln_post_fraction=0.5)
    cfg = load_config(str(ROOT / "configs" / "tiny-cpu.yaml"), ["--model.d_model=64"])
    with pytest.raises(RunError) as err:
        check_resume_model(cfg, str(folder))
    message = str(err.value)
    assert "model.mixln_post_fraction was 0.5, now 0.25" in message
    assert "model.d_model was 128, now 64" in message
    assert "pass --model.d_model=128 --model.mixln_post_fraction=0.5 to resume" in message
    assert "\n" not in message
    same = load_config(str(ROOT / "configs" / "tiny-cpu.yaml"), ["--model.mixln_post_fraction=0.5"])
    check_resume_model(same, str(folder))  # identical model: no error


def test_recipes_state_the_siamese_knobs():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        model = om.load(str(path)).model
        for name in ("siamese_depth_scaling", "siamese_depth_scaling_form", "siamese_normalized_input",
                     "post_pre_x_norm_position", "post_norm_position"):
            assert name in model, f"{path.name} does not state model.{name}"
        assert model.siamese_depth_scaling_form == "inv_sqrt_2layer", path.name
        assert model.post_pre_x_norm_position == "before_sublayer", path.name
