"""build_model, and the parameter count of the model a config builds."""

from __future__ import annotations

import logging
import os
from typing import Optional

from olmo.config import ModelConfig
from olmo.model import OLMo

from siamesenorm.models.config import as_siamese_config, resolve_model_type
from siamesenorm.models.registry import forced_model_type
from siamesenorm.variants._base import set_recompute
from siamesenorm.variants.spec import fail

__all__ = ["build_model", "num_params_from_config"]

log = logging.getLogger(__name__)


def build_model(model_config: ModelConfig, model_type: Optional[str] = None, init_params: bool = True) -> OLMo:
    """An ``olmo.model.OLMo`` whose blocks are ``model_type``'s.

    ``model_type`` None means: the MODEL_TYPE environment variable, else ``model_config.model_type``, else pre.
    The returned model's ``config.model_type`` names the type it was built with.
    """
    resolved, source = resolve_model_type(model_config, model_type)
    if "SIAMESENORM_RECOMPUTE" in os.environ:  # the old switch: refuse it rather than ignore it
        fail("SIAMESENORM_RECOMPUTE is gone; unset it and set model.recompute_cheap to true or false in the config "
             "(or --model.recompute_cheap=false).")
    config = as_siamese_config(model_config, model_type=resolved)  # validates (the config's __post_init__)
    if getattr(model_config, "model_type", None) not in (None, resolved):
        log.warning("MODEL_TYPE=%s (from %s) overrides model.model_type=%s", resolved, source, model_config.model_type)
    log.debug("MODEL_TYPE=%s (from %s)", resolved, source)
    with forced_model_type(resolved):
        model = OLMo(config, init_params=init_params)
    set_recompute(model, config.recompute_cheap)  # pre's norms (OLMo's block); the variants' blocks read the field
    return model


def num_params_from_config(model_config: ModelConfig, model_type: Optional[str] = None) -> int:
    """Total parameters of ``build_model(model_config, model_type)``: the model built on the meta device (no
    memory, no init), counted."""
    resolved, _ = resolve_model_type(model_config, model_type)
    config = as_siamese_config(model_config, model_type=resolved, init_device="meta")
    with forced_model_type(resolved):
        return OLMo(config, init_params=False).num_params()
