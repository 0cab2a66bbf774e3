"""The model config with our MODEL_TYPE field and variant knobs, and the one rule that picks the model type.

Selection order (first that is set wins): an explicit ``model_type`` argument, the ``MODEL_TYPE`` environment
variable, the config's ``model_type`` field, then ``pre``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from typing import Optional

from olmo.config import BlockType, ModelConfig
from olmo.exceptions import OLMoConfigurationError

__all__ = [
    "MODEL_TYPES",
    "DEPTH_SCALING_FORMS",
    "SiameseModelConfig",
    "resolve_model_type",
    "validate_model_config",
    "as_siamese_config",
    "depth_scale",
]

log = logging.getLogger(__name__)

ENV_VAR = "MODEL_TYPE"
DEFAULT_MODEL_TYPE = "pre"

#: Every valid MODEL_TYPE, in the order the docs list them. The registry maps each to one block class.
MODEL_TYPES: tuple[str, ...] = (
    # the paper's seed variants
    "pre",
    "post",
    "hybrid",
    "hc",
    "post_pre",
    "hybrid_pre",
    # the paper's other baselines and probes, and variants beyond it
    "deepnorm",
    "residual",
    "mixln",
    "peri",
    "mhc",
    "hybrid_star",
    "pre_embednorm",
)

#: Depth-wise scaling forms: the divisor c(l) of the residual update written into the bounded stream.
#: "inv_sqrt_layer" is the paper's text (section 4.2: 1/sqrt(l+1)); "inv_sqrt_2layer" is what the paper's
#: reference code computes (1/sqrt(2(l+1))). l is the 0-based layer index.
DEPTH_SCALING_FORMS: dict[str, "callable"] = {
    "inv_sqrt_layer": lambda layer_id: math.sqrt(layer_id + 1),
    "inv_sqrt_2layer": lambda layer_id: math.sqrt(2 * (layer_id + 1)),
}

_TWO_STREAM = ("post_pre", "hybrid_pre")
_HYBRID_ATTENTION = ("hybrid", "hybrid_pre", "hybrid_star")
#: Types trained with the configs/OLMo-1B-hybrid-* recipes (HybridNorm's init and warmup); the rest use OLMo-1B-*.
HYBRID_RECIPE_TYPES = _HYBRID_ATTENTION
_OWN_EMBEDDING_NORM = ("peri", "pre_embednorm")


@dataclass
class SiameseModelConfig(ModelConfig):
    """OLMo's ModelConfig plus the model type and the knobs of the variants (defaults are the paper's)."""

    model_type: Optional[str] = None
    """One of MODEL_TYPES. The MODEL_TYPE environment variable overrides it; None means pre."""

    hc_expansion_rate: int = 2
    """hc: number of residual streams n (the paper's baseline is DHCx2)."""

    siamese_depth_scaling: bool = True
    """post_pre / hybrid_pre: divide the update written into the bounded stream by c(l) (section 4.2)."""

    siamese_depth_scaling_form: str = "inv_sqrt_layer"
    """post_pre / hybrid_pre: which c(l), see DEPTH_SCALING_FORMS."""

    siamese_normalized_input: bool = True
    """post_pre / hybrid_pre: apply an extra norm to the fused input of each sublayer (section 4.2)."""

    mixln_post_fraction: float = 0.25
    """mixln: the first floor(fraction * n_layers) layers are Post-LN, the rest Pre-LN (Mix-LN's 0.25)."""

    mhc_expansion_rate: int = 4
    """mhc: number of residual streams n (the mHC paper's 4)."""

    mhc_sinkhorn_iterations: int = 20
    """mhc: Sinkhorn-Knopp iterations that make each residual mixing matrix doubly stochastic."""

    def __post_init__(self):
        if self.model_type is not None:
            validate_model_config(self, self.model_type)


def _fail(msg: str) -> None:
    raise OLMoConfigurationError(msg)


def validate_model_config(config: ModelConfig, model_type: str) -> None:
    """Fail with one sentence that says what to change when the config cannot build ``model_type``."""
    if model_type not in MODEL_TYPES:
        _fail(f"Unknown MODEL_TYPE {model_type!r}; valid values are: {', '.join(MODEL_TYPES)}")
    if model_type == "pre":
        return
    block_type = getattr(config, "block_type", BlockType.sequential)
    if block_type != BlockType.sequential:
        _fail(f"MODEL_TYPE {model_type} is built on OLMo's sequential block; set model.block_type to 'sequential'.")
    if getattr(config, "norm_after", False):
        _fail(
            f"MODEL_TYPE {model_type} places its norms itself; set model.norm_after to false "
            "(use MODEL_TYPE=post for Post-Norm)."
        )
    if model_type in _HYBRID_ATTENTION and config.attention_layer_norm:
        _fail(
            f"MODEL_TYPE {model_type} applies its own per-head Q/K/V norms; set model.attention_layer_norm to false."
        )
    if model_type == "hc":
        n = getattr(config, "hc_expansion_rate", 2)
        if not isinstance(n, int) or n < 1:
            _fail(f"model.hc_expansion_rate must be a whole number >= 1 (got {n!r}); the paper uses 2.")
    if model_type == "mixln":
        frac = getattr(config, "mixln_post_fraction", 0.25)
        if not isinstance(frac, (int, float)) or not 0.0 <= frac <= 1.0:
            _fail(f"model.mixln_post_fraction must be a number in [0, 1] (got {frac!r}); Mix-LN uses 0.25.")
    if model_type == "mhc":
        n = getattr(config, "mhc_expansion_rate", 4)
        if not isinstance(n, int) or n < 1:
            _fail(f"model.mhc_expansion_rate must be a whole number >= 1 (got {n!r}); mHC uses 4.")
        iters = getattr(config, "mhc_sinkhorn_iterations", 20)
        if not isinstance(iters, int) or iters < 1:
            _fail(f"model.mhc_sinkhorn_iterations must be a whole number >= 1 (got {iters!r}); mHC uses 20.")
    if model_type in _OWN_EMBEDDING_NORM and getattr(config, "embedding_layer_norm", False):
        _fail(
            f"MODEL_TYPE {model_type} normalises the embedding itself; set model.embedding_layer_norm to false."
        )
    if model_type in _TWO_STREAM:
        form = getattr(config, "siamese_depth_scaling_form", "inv_sqrt_layer")
        if form not in DEPTH_SCALING_FORMS:
            _fail(
                f"model.siamese_depth_scaling_form {form!r} is unknown; use one of: {', '.join(DEPTH_SCALING_FORMS)}."
            )
        if model_type == "hybrid_pre" and not config.layer_norm_with_affine:
            _fail(
                "MODEL_TYPE hybrid_pre learns its stream-mixing through norm scales; "
                "set model.layer_norm_with_affine to true."
            )


def resolve_model_type(config: Optional[ModelConfig] = None, model_type: Optional[str] = None) -> tuple[str, str]:
    """Return (model_type, where it came from). Does not validate."""
    if model_type is not None:
        return model_type, "argument"
    env = os.environ.get(ENV_VAR)
    if env:
        return env.strip(), f"environment variable {ENV_VAR}"
    field_value = getattr(config, "model_type", None) if config is not None else None
    if field_value:
        return field_value, "config field model.model_type"
    return DEFAULT_MODEL_TYPE, "default"


def as_siamese_config(config: ModelConfig, **changes) -> SiameseModelConfig:
    """A SiameseModelConfig copy of any OLMo ModelConfig (ours or stock), with ``changes`` applied."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(ModelConfig)}
    for f in dataclasses.fields(SiameseModelConfig):
        if f.name not in values and hasattr(config, f.name):
            values[f.name] = getattr(config, f.name)
    values.update(changes)
    return SiameseModelConfig(**values)


def depth_scale(config: ModelConfig, layer_id: int) -> float:
    """c(l): the bounded stream receives O / c(l). 1.0 when depth-wise scaling is off."""
    if not getattr(config, "siamese_depth_scaling", True):
        return 1.0
    form = getattr(config, "siamese_depth_scaling_form", "inv_sqrt_layer")
    return float(DEPTH_SCALING_FORMS[form](layer_id))
