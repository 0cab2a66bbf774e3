"""Every recipe in configs/ loads and builds for every MODEL_TYPE; the 1.3B size is the one the docs state."""

import re
from pathlib import Path

import pytest
import torch
from olmo.model import OLMo

from siamesenorm import MODEL_TYPES, build_model, num_params_from_config
from siamesenorm.ai2_olmo.train import load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_recipes_exist():
    names = {p.stem for p in CONFIGS}
    for tag in ("4e-4", "1e-3", "2e-3", "2e-3-350B"):
        assert f"OLMo-1B-{tag}" in names and f"OLMo-1B-hybrid-{tag}" in names
    assert {"small-20M", "small-60M", "small-150M", "tiny-cpu"} <= names


def _one_recipe_per_model() -> list:
    """The first recipe of each distinct model section (with its MoE section): the learning-rate and token-budget
    recipes of one size build the same model, and building it once per MODEL_TYPE is enough."""
    seen: dict = {}
    for path in CONFIGS:
        cfg = load_config(str(path))
        seen.setdefault(repr(cfg.model) + repr(cfg.moe), path)
    return list(seen.values())


def test_every_recipe_leaves_the_model_type_to_model_type():
    for path in CONFIGS:
        assert load_config(str(path)).model.model_type is None, path.name  # recipes leave the choice to MODEL_TYPE


@pytest.mark.slow
@pytest.mark.parametrize("path", _one_recipe_per_model(), ids=lambda p: p.stem)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_recipe_builds_for_every_model_type(path, model_type):
    cfg = load_config(str(path))
    if cfg.moe is not None:  # an MoE recipe: the OLMo-core path's (tests/olmo_core/test_olmo_core_moe.py checks its sizes)
        core_config = pytest.importorskip("siamesenorm.olmo_core.config")
        from siamesenorm.olmo_core.blocks import CORE_MOE_BLOCKS

        model = core_config.transformer_config(cfg.model, model_type, moe=cfg.moe).build(init_device="meta")
        assert {type(b) for b in model.blocks.values()} == {CORE_MOE_BLOCKS[model_type]}
        return
    # GPU recipes (20M and up) are built on the meta device: initialising 150M parameters on a CPU for every
    # MODEL_TYPE took minutes and checks nothing the tiny models' init tests do not; the CPU recipes run a forward
    big = cfg.model.d_model > 256
    cfg.model.init_device = "meta" if big else "cpu"
    model = build_model(cfg.model, model_type, init_params=not big)
    assert isinstance(model, OLMo) and model.config.model_type == model_type
    assert model.num_params() == num_params_from_config(cfg.model, model_type)
    if not big:
        with torch.no_grad():
            out = model(torch.zeros(1, 8, dtype=torch.long)).logits
        assert torch.isfinite(out).all()


def documented_count(model_type: str) -> int:
    text = (ROOT / "docs" / "training.md").read_text()
    match = re.search(rf"^\| {model_type} \| ([0-9,]+) \|", text, re.M)
    assert match, f"docs/training.md has no parameter row for {model_type}"
    return int(match.group(1).replace(",", ""))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_13b_parameter_count_matches_docs(model_type):
    cfg = load_config(str(ROOT / "configs" / "OLMo-1B-2e-3.yaml"))
    cfg.model.init_device = "meta"
    model = build_model(cfg.model, model_type, init_params=False)
    assert model.num_params() == documented_count(model_type)
    if model_type == "pre":
        assert 1.25e9 < model.num_params() < 1.35e9  # "1.3B"


def test_paper_learning_rates_and_token_budgets():
    for tag, lr, tokens in [("4e-4", 4e-4, "100e9T"), ("1e-3", 1e-3, "100e9T"), ("2e-3", 2e-3, "100e9T"),
                            ("2e-3-350B", 2e-3, "350e9T")]:
        for prefix in ("OLMo-1B", "OLMo-1B-hybrid"):
            cfg = load_config(str(ROOT / "configs" / f"{prefix}-{tag}.yaml"))
            assert cfg.optimizer.learning_rate == pytest.approx(lr) and cfg.max_duration == tokens
            labels = {e.label for e in cfg.evaluators}
            assert {"arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "openbook_qa",
                    "basic_arithmetic"} <= labels


V2_DEPTH = sorted((ROOT / "configs" / "v2-depth").glob("*.yaml"))


@pytest.mark.parametrize("path", V2_DEPTH, ids=lambda p: p.stem)
def test_v2_depth_recipes_hold_about_390m_parameters_at_v2s_shapes(path):
    """The paper v2's depth sweep: its four (layers, d_model) shapes, 12B tokens, lr 1e-3; about 390M parameters for
    every MODEL_TYPE (built on the meta device: no weights allocated)."""
    cfg = load_config(str(path))
    shape = (cfg.model.n_layers, cfg.model.d_model)
    assert shape in {(10, 1280), (17, 1024), (33, 768), (80, 512)} and path.stem == f"OLMo-390M-L{shape[0]}"
    assert cfg.model.d_model // cfg.model.n_heads == 128  # OLMo-1B's head size
    assert cfg.optimizer.learning_rate == pytest.approx(1e-3) and cfg.max_duration == "12e9T"
    assert cfg.scheduler.t_warmup == 2000 and cfg.model.model_type is None
    for model_type in MODEL_TYPES:
        n = num_params_from_config(cfg.model, model_type)
        assert 3.8e8 < n < 4.0e8, (model_type, n)


def test_v2_depth_sweep_has_its_four_shapes():
    assert [p.stem for p in V2_DEPTH] == ["OLMo-390M-L10", "OLMo-390M-L17", "OLMo-390M-L33", "OLMo-390M-L80"]


def test_hybridnorm_recipes_decay_norm_scales_as_hybridnorms_official_recipe():
    """HybridNorm's OLMo recipe sets optimizer.decay_norm_and_bias: true (docs/fidelity.md); OLMo-1B's is false."""
    for path in CONFIGS:
        if path.stem.startswith("OLMo-1B"):
            cfg = load_config(str(path))
            assert cfg.optimizer.decay_norm_and_bias == path.stem.startswith("OLMo-1B-hybrid"), path.stem
