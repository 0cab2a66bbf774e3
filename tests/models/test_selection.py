"""How MODEL_TYPE is chosen, what a bad choice says, and the config knobs' validation."""

import logging

import pytest
from conftest import tiny_config
from olmo.config import ModelConfig
from olmo.exceptions import OLMoConfigurationError
from olmo.model import OLMo, OLMoSequentialBlock

import siamesenorm
from siamesenorm import MODEL_TYPES, build_model
from siamesenorm.variants.hc import HyperConnectionBlock
from siamesenorm.variants.hybrid_pre import SiameseHybridPreBlock
from siamesenorm.variants.post import PostNormBlock


def block_types(model):
    return {type(b) for b in model.transformer.blocks}


def test_public_names():
    assert siamesenorm.MODEL_TYPES[:6] == ("pre", "post", "hybrid", "hc", "post_pre", "hybrid_pre")  # the seeds first
    assert len(set(siamesenorm.MODEL_TYPES)) == len(siamesenorm.MODEL_TYPES) >= 13
    assert isinstance(build_model(tiny_config()), OLMo)


def test_default_is_pre():
    assert block_types(build_model(tiny_config())) == {OLMoSequentialBlock}
    assert build_model(tiny_config()).config.model_type == "pre"


def test_config_field_selects(monkeypatch):
    model = build_model(tiny_config(model_type="hc"))
    assert block_types(model) == {HyperConnectionBlock}


def test_environment_beats_config_field_and_is_logged(monkeypatch, caplog):
    monkeypatch.setenv("MODEL_TYPE", "hybrid_pre")
    with caplog.at_level(logging.INFO, logger="siamesenorm"):
        model = build_model(tiny_config(model_type="post"))
    assert block_types(model) == {SiameseHybridPreBlock}
    assert model.config.model_type == "hybrid_pre"  # what gets saved with checkpoints
    assert "MODEL_TYPE=hybrid_pre (from environment variable MODEL_TYPE)" in caplog.text
    assert "overrides model.model_type=post" in caplog.text


def test_argument_beats_environment(monkeypatch):
    monkeypatch.setenv("MODEL_TYPE", "hc")
    assert block_types(build_model(tiny_config(), "post")) == {PostNormBlock}


def test_olmo_factory_itself_honours_model_type(monkeypatch):
    """The hook is in OLMo's block factory: plain olmo.model.OLMo(config) builds the chosen blocks."""
    plain = ModelConfig(d_model=32, n_heads=4, n_layers=2, vocab_size=96, embedding_size=128, init_device="cpu")
    assert block_types(OLMo(plain)) == {OLMoSequentialBlock}
    monkeypatch.setenv("MODEL_TYPE", "post")
    assert block_types(OLMo(plain)) == {PostNormBlock}


@pytest.mark.parametrize("where", ["argument", "environment", "config"])
def test_unknown_name_fails_with_one_line_listing_valid_ones(monkeypatch, where):
    with pytest.raises(OLMoConfigurationError) as err:
        if where == "argument":
            build_model(tiny_config(), "siamese")
        elif where == "environment":
            monkeypatch.setenv("MODEL_TYPE", "siamese")
            build_model(tiny_config())
        else:
            tiny_config(model_type="siamese")
    message = str(err.value)
    assert "\n" not in message and "'siamese'" in message
    assert all(name in message for name in MODEL_TYPES)


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (dict(model_type="hybrid", attention_layer_norm=True), "attention_layer_norm to false"),
        (dict(model_type="hybrid_pre", attention_layer_norm=True), "attention_layer_norm to false"),
        (dict(model_type="hc", hc_expansion_rate=0), "hc_expansion_rate must be a whole number >= 1"),
        (dict(model_type="post_pre", siamese_depth_scaling_form="log"), "siamese_depth_scaling_form 'log' is unknown"),
        (dict(model_type="post", norm_after=True), "set model.norm_after to false"),
        (dict(model_type="post_pre", block_type="llama"), "set model.block_type to 'sequential'"),
        (dict(model_type="hybrid_pre", layer_norm_with_affine=False), "layer_norm_with_affine to true"),
    ],
)
def test_invalid_combinations_fail_when_config_is_built(overrides, needle):
    with pytest.raises(OLMoConfigurationError, match=needle):
        tiny_config(**overrides)


def test_invalid_combination_from_environment_fails_at_build(monkeypatch):
    cfg = tiny_config(attention_layer_norm=True)  # fine for pre
    monkeypatch.setenv("MODEL_TYPE", "hybrid")
    with pytest.raises(OLMoConfigurationError, match="attention_layer_norm"):
        build_model(cfg)
