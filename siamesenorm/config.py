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
    "NORM_POSITIONS",
    "SINKHORN_ORDERS",
    "LEGACY_KNOBS",
    "SiameseModelConfig",
    "resolve_model_type",
    "validate_model_config",
    "as_siamese_config",
    "depth_scale",
    "knob",
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

#: Where a Post-Norm-style norm sits (post, and post_pre's bounded stream X):
#: "after_addition": X <- LN(X + F(X)); X_0 = embedding; the last block's output is normalised (paper eq. 2 and
#:     section 3's text);
#: "before_sublayer": X <- LN(X); X <- X + F(X); X_0 = LN(embedding); the last block's output is not normalised
#:     (the official DeiT/DiT SiameseNorm Block and the HybridNorm fork's Post-Norm switch).
NORM_POSITIONS: tuple[str, ...] = ("after_addition", "before_sublayer")

#: mhc's Sinkhorn-Knopp order within one iteration: "columns_first" is the mHC paper's T_r(T_c(.)) (rows end exact),
#: "rows_first" normalises rows then columns (columns end exact; this project's first version).
SINKHORN_ORDERS: tuple[str, ...] = ("columns_first", "rows_first")

#: Knobs that were added (or whose default changed) after checkpoints had been written, with the value an older
#: checkpoint's model was built with. A saved config.yaml that lacks one of these fields loads with this value.
LEGACY_KNOBS: dict[str, object] = {
    "siamese_depth_scaling_form": "inv_sqrt_layer",
    "post_norm_position": "after_addition",
    "post_pre_x_norm_position": "after_addition",
    "hc_scale_output_init": False,
    "hc_decay_dynamic": False,
    "mhc_sinkhorn_order": "rows_first",
}

#: Which MODEL_TYPEs read each knob (the run record lists a changed knob only for these).
KNOB_OWNERS: dict[str, tuple[str, ...]] = {
    "hc_expansion_rate": ("hc",),
    "hc_scale_output_init": ("hc",),
    "hc_decay_dynamic": ("hc",),
    "siamese_depth_scaling": ("post_pre", "hybrid_pre"),
    "siamese_depth_scaling_form": ("post_pre", "hybrid_pre"),
    "siamese_normalized_input": ("post_pre", "hybrid_pre"),
    "post_pre_x_norm_position": ("post_pre",),
    "post_norm_position": ("post",),
    "mixln_post_fraction": ("mixln",),
    "mhc_expansion_rate": ("mhc",),
    "mhc_sinkhorn_iterations": ("mhc",),
    "mhc_sinkhorn_order": ("mhc",),
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

    siamese_depth_scaling_form: str = "inv_sqrt_2layer"
    """post_pre / hybrid_pre: which c(l), see DEPTH_SCALING_FORMS. Default: the official code's sqrt(2(l+1));
    "inv_sqrt_layer" is the paper's text (section 4.2)."""

    siamese_normalized_input: bool = True
    """post_pre / hybrid_pre: apply an extra norm to the fused input of each sublayer (section 4.2)."""

    post_norm_position: str = "after_addition"
    """post: where the norm sits, see NORM_POSITIONS. Default: paper eq. 2 (classic Post-LN);
    "before_sublayer" is the HybridNorm OLMo fork's Post-Norm switch."""

    post_pre_x_norm_position: str = "before_sublayer"
    """post_pre: where LN^X of the bounded stream sits, see NORM_POSITIONS. Default: the official DeiT/DiT
    SiameseNorm Block (LN^X at the start of each sublayer); "after_addition" is the paper's section-3 text."""

    hc_scale_output_init: bool = True
    """hc: divide the init of the attention and MLP output weights (attn_out, ff_out) by sqrt(n) (HC paper
    section 4), since every sublayer's output is written into all n streams."""

    hc_decay_dynamic: bool = True
    """hc: apply weight decay to the dynamic projections (dynamic_alpha_fn, dynamic_beta_fn) and none to the static
    connection weights and the dynamic scales (HC paper section 4). False: no decay on any HC coefficient."""

    mixln_post_fraction: float = 0.25
    """mixln: the first floor(fraction * n_layers) layers are Post-LN, the rest Pre-LN (Mix-LN's 0.25)."""

    mhc_expansion_rate: int = 4
    """mhc: number of residual streams n (the mHC paper's 4)."""

    mhc_sinkhorn_iterations: int = 20
    """mhc: Sinkhorn-Knopp iterations that make each residual mixing matrix doubly stochastic."""

    mhc_sinkhorn_order: str = "columns_first"
    """mhc: the order within one Sinkhorn iteration, see SINKHORN_ORDERS (default: the mHC paper's)."""

    def __post_init__(self):
        if self.model_type is not None:
            validate_model_config(self, self.model_type)


_KNOB_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SiameseModelConfig)}


def knob(config: ModelConfig, name: str):
    """A variant knob of ``config``, or its default when ``config`` is a stock OLMo ModelConfig without it."""
    return getattr(config, name, _KNOB_DEFAULTS[name])


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
        n = knob(config, "hc_expansion_rate")
        if not isinstance(n, int) or n < 1:
            _fail(f"model.hc_expansion_rate must be a whole number >= 1 (got {n!r}); the paper uses 2.")
    if model_type == "mixln":
        frac = knob(config, "mixln_post_fraction")
        if not isinstance(frac, (int, float)) or not 0.0 <= frac <= 1.0:
            _fail(f"model.mixln_post_fraction must be a number in [0, 1] (got {frac!r}); Mix-LN uses 0.25.")
    if model_type == "mhc":
        n = knob(config, "mhc_expansion_rate")
        if not isinstance(n, int) or n < 1:
            _fail(f"model.mhc_expansion_rate must be a whole number >= 1 (got {n!r}); mHC uses 4.")
        iters = knob(config, "mhc_sinkhorn_iterations")
        if not isinstance(iters, int) or iters < 1:
            _fail(f"model.mhc_sinkhorn_iterations must be a whole number >= 1 (got {iters!r}); mHC uses 20.")
        order = knob(config, "mhc_sinkhorn_order")
        if order not in SINKHORN_ORDERS:
            _fail(f"model.mhc_sinkhorn_order {order!r} is unknown; use one of: {', '.join(SINKHORN_ORDERS)}.")
    for knob_name, applies_to in (("post_norm_position", "post"), ("post_pre_x_norm_position", "post_pre")):
        position = knob(config, knob_name)
        if model_type == applies_to and position not in NORM_POSITIONS:
            _fail(f"model.{knob_name} {position!r} is unknown; use one of: {', '.join(NORM_POSITIONS)}.")
    if model_type in _OWN_EMBEDDING_NORM and getattr(config, "embedding_layer_norm", False):
        _fail(
            f"MODEL_TYPE {model_type} normalises the embedding itself; set model.embedding_layer_norm to false."
        )
    if model_type in _TWO_STREAM:
        form = knob(config, "siamese_depth_scaling_form")
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
    if not knob(config, "siamese_depth_scaling"):
        return 1.0
    form = knob(config, "siamese_depth_scaling_form")
    return float(DEPTH_SCALING_FORMS[form](layer_id))
