"""The one registry: MODEL_TYPE string -> block class (derived from siamesenorm/variants/, one file per variant),
and the hook that puts it into OLMo's block factory.

``import siamesenorm`` replaces ``olmo.model.OLMoBlock.build`` when OLMo loads (siamesenorm/models/olmo_hook.py): a model
type other than ``pre`` builds our block; ``pre`` goes to OLMo's own factory. ``changes.patch`` adds the same
delegation to an OLMo source tree, calling ``block_for`` below.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from typing import Optional, Type

from olmo.config import ModelConfig
from olmo.model import BufferCache, OLMoBlock

from siamesenorm.models.config import resolve_model_type, validate_model_config
from siamesenorm.variants import VARIANTS
from siamesenorm.variants._base import RECOMPUTE_DEFAULT, TopologyBlock, set_recompute

__all__ = ["BLOCKS", "block_class", "block_for", "forced_model_type"]

log = logging.getLogger(__name__)

#: MODEL_TYPE -> block class, from the variant files. None: OLMo's own factory (OLMoSequentialBlock), i.e. stock
#: Pre-Norm.
BLOCKS: dict[str, Optional[Type[TopologyBlock]]] = {name: v.block for name, v in VARIANTS.items()}

_forced: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("siamesenorm_forced_model_type", default=None)


@contextlib.contextmanager
def forced_model_type(model_type: Optional[str]):
    """Within the block, every block built uses ``model_type`` whatever MODEL_TYPE or the config says."""
    token = _forced.set(model_type)
    try:
        yield
    finally:
        _forced.reset(token)


def block_class(model_type: str) -> Optional[Type[TopologyBlock]]:
    if model_type not in BLOCKS:
        validate_model_config(ModelConfig(), model_type)  # raises the one-line error listing valid names
    return BLOCKS[model_type]


def block_for(layer_id: int, config: ModelConfig, cache: BufferCache) -> Optional[OLMoBlock]:
    """Our block for this layer, or None when OLMo's own factory should build it (``pre``)."""
    model_type, source = resolve_model_type(config, _forced.get())
    if layer_id == 0:  # OLMo builds its blocks in order from one config: checked once, at the first
        validate_model_config(config, model_type)
        log.debug("Building OLMo blocks with MODEL_TYPE=%s (from %s)", model_type, source)
    cls = block_class(model_type)
    if getattr(config, "fused_streams", False) and VARIANTS[model_type].fused_block is not None:
        cls = VARIANTS[model_type].fused_block
    return None if cls is None else cls(layer_id, config, cache)


def hooked_build(olmo_build, cls, layer_id: int, config: ModelConfig, cache: BufferCache) -> OLMoBlock:
    """The block factory siamesenorm/models/olmo_hook.py's trampoline calls, with OLMo's own (``olmo_build``) for ``pre``."""
    block = block_for(layer_id, config, cache)
    if block is not None:
        return block
    block = olmo_build(cls, layer_id, config, cache)  # pre: OLMo's own block, its norms per model.recompute_cheap
    set_recompute(block, bool(getattr(config, "recompute_cheap", RECOMPUTE_DEFAULT)))
    return block


hooked_build.siamesenorm_factory = True  # type: ignore[attr-defined]
