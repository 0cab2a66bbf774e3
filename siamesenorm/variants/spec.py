"""What a variant file declares: ``VARIANT = Variant(...)``, with its knobs as ``Knob``s.

A knob becomes a field of ``model:`` in the YAML configs (siamesenorm.config builds SiameseModelConfig from every
variant's knobs). ``knob(config, name)`` reads one from any OLMo ModelConfig, falling back to its default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Tuple

__all__ = ["Knob", "Variant", "knob", "fail", "UNSET"]

UNSET = object()


@dataclass(frozen=True)
class Knob:
    """One model-config field a variant reads."""

    name: str
    default: Any
    doc: str
    #: The value a checkpoint written before this knob existed (or before its default changed) was built with;
    #: a saved config.yaml that lacks the field loads with it. UNSET: the knob predates every checkpoint.
    legacy: Any = UNSET
    #: The type of the config field (OmegaConf checks values against it).
    type: Any = None

    def field_type(self):
        return self.type if self.type is not None else type(self.default)


@dataclass(frozen=True)
class Variant:
    """Everything about one MODEL_TYPE. ``block`` None means OLMo's own block (``pre``)."""

    name: str
    #: The name the paper's tables use.
    display_name: str
    #: Its colour in every figure (a matplotlib colour).
    colour: str
    block: Optional[type]
    #: Position in MODEL_TYPES (the order the docs and ``--help`` list the variants) and row in the tables.
    order: int
    table_row: int
    knobs: Tuple[Knob, ...] = ()
    #: ``validate(config)`` raises (via ``fail``) with one sentence saying what to change; the checks that every
    #: non-pre variant shares live in siamesenorm.config.validate_model_config.
    validate: Optional[Callable[[Any], None]] = None
    #: The paper's names for the internal stream names of ``block.stream_names`` (figures' legends).
    stream_labels: dict = field(default_factory=dict)


def fail(msg: str) -> None:
    from olmo.exceptions import OLMoConfigurationError

    raise OLMoConfigurationError(msg)


def knob(config: Any, name: str):
    """A variant knob of ``config``, or its default when ``config`` is a stock OLMo ModelConfig without it."""
    if hasattr(config, name):
        return getattr(config, name)
    from . import KNOBS  # every variant file is imported by then (siamesenorm.variants imports them all)

    return KNOBS[name].default
