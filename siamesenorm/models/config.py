"""The model config with our MODEL_TYPE field and the variants' knobs, and the one rule that picks the model type.

Selection order (first that is set wins): an explicit ``model_type`` argument, the ``MODEL_TYPE`` environment
variable, the config's ``model_type`` field, then ``pre``.

``SiameseModelConfig`` is OLMo's ModelConfig plus ``model_type`` plus every knob declared by a variant file
(siamesenorm/variants/*.py): a knob is a field under ``model:`` in the YAML configs.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Optional

from olmo.config import BlockType, ModelConfig

from siamesenorm.nn.topologies import DEPTH_SCALING_FORMS, NORM_POSITIONS, SINKHORN_ORDERS
from siamesenorm.variants import KNOB_OWNERS, KNOBS, VARIANTS
from siamesenorm.variants._base import RECOMPUTE_DEFAULT, depth_scale
from siamesenorm.variants.spec import UNSET, fail, knob

__all__ = [
    "MODEL_TYPES",
    "DEPTH_SCALING_FORMS",
    "NORM_POSITIONS",
    "SINKHORN_ORDERS",
    "LEGACY_KNOBS",
    "KNOB_OWNERS",
    "SiameseModelConfig",
    "resolve_model_type",
    "validate_model_config",
    "as_siamese_config",
    "depth_scale",
    "knob",
]

ENV_VAR = "MODEL_TYPE"
DEFAULT_MODEL_TYPE = "pre"

#: Every valid MODEL_TYPE, in the order the docs list them (siamesenorm/variants: one file each).
MODEL_TYPES: tuple[str, ...] = tuple(VARIANTS)

#: Knobs that were added (or whose default changed) after checkpoints had been written, with the value an older
#: checkpoint's model was built with. A saved config.yaml that lacks one of these fields loads with this value.
LEGACY_KNOBS: dict[str, object] = {k.name: k.legacy for k in KNOBS.values() if k.legacy is not UNSET}


def _post_init(self):
    if self.model_type is not None:
        validate_model_config(self, self.model_type)


def _knob_field(k):
    return k.name, k.field_type(), dataclasses.field(default=k.default,
                                                     metadata={"doc": k.doc, "owners": KNOB_OWNERS[k.name]})


_MODEL_TYPE_DOC = "One of MODEL_TYPES. The MODEL_TYPE environment variable overrides it; None means pre."
_FUSED_DOC = ("Each residual add and the norms after it as one op each way (siamesenorm/nn/fused.py: a Triton "
              "kernel on CUDA, the same arithmetic in torch elsewhere): hybrid_pre, post_pre (LN^X before the "
              "sublayer) and, for a fair comparison, pre; HybridNorm's per-head Q/K/V norms as one op (hybrid, "
              "hybrid_star, hybrid_pre); mhc's Sinkhorn as one op; hc's and mhc's stream mixing with the depth "
              "connection as one op; needs RMS norms without bias; other variants ignore it.")
_RECOMPUTE_DOC = ("Recompute every block's norms (pre's too) and hc/mhc's stream mixing in backward instead of saving "
                  "their intermediates: less activation memory, the norms run twice (exact either way).")
SiameseModelConfig = dataclasses.make_dataclass(
    "SiameseModelConfig",
    [("model_type", Optional[str], dataclasses.field(default=None, metadata={"doc": _MODEL_TYPE_DOC})),
     ("recompute_cheap", bool, dataclasses.field(default=RECOMPUTE_DEFAULT, metadata={"doc": _RECOMPUTE_DOC})),
     ("fused_streams", bool, dataclasses.field(default=False, metadata={"doc": _FUSED_DOC}))]
    + [_knob_field(k) for k in KNOBS.values()],
    bases=(ModelConfig,),
    namespace={"__post_init__": _post_init, "__module__": __name__},
)
SiameseModelConfig.__doc__ = (
    "OLMo's ModelConfig plus the model type and the variants' knobs (defaults: the official code):\n\n"
    + "\n".join(f"    {k.name} ({', '.join(KNOB_OWNERS[k.name])}; default {k.default!r}): {k.doc}"
                for k in KNOBS.values()))


def fused_streams_problem(config: ModelConfig) -> Optional[str]:
    """Why ``model.fused_streams`` cannot run with ``config`` (the fused ops compute RMSNorm without bias in OLMo's
    sequential block), or None."""
    norm = getattr(config.layer_norm_type, "value", config.layer_norm_type)
    bias = config.bias_for_layer_norm if config.bias_for_layer_norm is not None else config.include_bias
    block_type = getattr(config.block_type, "value", config.block_type)
    got = [f"layer_norm_type: {norm}"] if norm != "rms" else []
    got += ["a norm bias (bias_for_layer_norm / include_bias)"] if bias else []
    got += [f"block_type: {block_type}"] if block_type != "sequential" else []
    got += ["norm_after: true"] if config.norm_after else []
    if not got:
        return None
    return (f"model.fused_streams needs RMS norms without bias in OLMo's sequential block (got {', '.join(got)}); "
            "set layer_norm_type: rms, no norm bias, block_type: sequential, norm_after: false, or turn "
            "model.fused_streams off.")


def validate_model_config(config: ModelConfig, model_type: str) -> None:
    """Fail with one sentence that says what to change when the config cannot build ``model_type``."""
    if model_type not in VARIANTS:
        close = difflib.get_close_matches(str(model_type).lower(), MODEL_TYPES, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        fail(f"Unknown MODEL_TYPE {model_type!r}; {hint}valid values are: {', '.join(MODEL_TYPES)}")
    if getattr(config, "fused_streams", False):
        problem = fused_streams_problem(config)
        if problem:
            fail(problem)
    if model_type == "pre":
        return
    block_type = getattr(config, "block_type", BlockType.sequential)
    if block_type != BlockType.sequential:
        fail(f"MODEL_TYPE {model_type} is built on OLMo's sequential block; set model.block_type to 'sequential'.")
    if getattr(config, "norm_after", False):
        fail(f"MODEL_TYPE {model_type} places its norms itself; set model.norm_after to false "
             "(use MODEL_TYPE=post for Post-Norm).")
    for declared in VARIANTS[model_type].knobs:  # the checks declared on the knobs, then the variant's own
        problem = declared.check(knob(config, declared.name))
        if problem:
            fail(problem)
    validate = VARIANTS[model_type].validate
    if validate is not None:
        validate(config, model_type)


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
