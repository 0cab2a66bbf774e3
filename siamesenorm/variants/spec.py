"""What a variant file declares: ``VARIANT = Variant(...)``, with its knobs as ``Knob``s.

A knob becomes a field of ``model:`` in the YAML configs (siamesenorm.models.config builds SiameseModelConfig from every
variant's knobs). ``knob(config, name)`` reads one from any OLMo ModelConfig, falling back to its default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

from olmo.exceptions import OLMoConfigurationError

__all__ = ["Knob", "Variant", "knob", "fail", "UNSET"]

UNSET = object()


#: Every knob declared so far, by name (``knob`` reads defaults here; the registry, siamesenorm.variants.KNOBS, is
#: built from the variant files and refuses a name declared twice with different values).
DECLARED: Dict[str, "Knob"] = {}


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
    #: Declared checks, run for the knob's variants by siamesenorm.models.config.validate_model_config (``check``):
    #: the value must be one of ``choices``; or a number >= ``minimum`` (and <= ``maximum``), a whole number when
    #: the default is one.
    choices: Optional[Tuple[Any, ...]] = None
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    #: What the source uses, said when a check fails ("the paper uses 2").
    usual: str = ""

    def field_type(self):
        return self.type if self.type is not None else type(self.default)

    def __post_init__(self):
        DECLARED.setdefault(self.name, self)  # siamesenorm.variants checks that no name is declared twice apart

    def check(self, value: Any) -> Optional[str]:
        """The one sentence that says what to change when ``value`` fails a declared check, else None."""
        if self.choices is not None and value not in self.choices:
            return f"model.{self.name} {value!r} is unknown; use one of: {', '.join(map(str, self.choices))}."
        if self.minimum is None:
            return None
        whole = isinstance(self.default, int) and not isinstance(self.default, bool)
        number = not isinstance(value, bool) and isinstance(value, int if whole else (int, float))
        if number and value >= self.minimum and (self.maximum is None or value <= self.maximum):
            return None
        bounds = f">= {self.minimum:g}" if self.maximum is None else f"in [{self.minimum:g}, {self.maximum:g}]"
        usual = f"; {self.usual}" if self.usual else ""
        return f"model.{self.name} must be {'a whole number' if whole else 'a number'} {bounds} (got {value!r}){usual}."


@dataclass(frozen=True)
class Variant:
    """Everything about one MODEL_TYPE. ``block`` None means OLMo's own block (``pre``)."""

    name: str
    #: The name the paper's tables use ("": the MODEL_TYPE itself).
    display_name: str = ""
    #: Its colour in every figure (a matplotlib colour; "": the registry picks one no other variant uses).
    colour: str = ""
    block: Optional[type] = None
    #: The block built instead of ``block`` when ``model.fused_streams`` is on (``pre``: OLMo's weights, its
    #: residual add and next norm as one fused op); None: ``block`` reads the flag itself or ignores it.
    fused_block: Optional[type] = None
    #: Position in MODEL_TYPES (the order the docs and ``--help`` list the variants) and in the tables: any numbers,
    #: each used once; None (a new variant) places it after every placed one, by name.
    order: Optional[float] = None
    table_row: Optional[float] = None
    knobs: Tuple[Knob, ...] = ()
    #: ``validate(config)`` raises (via ``fail``) with one sentence saying what to change; the checks that every
    #: non-pre variant shares live in siamesenorm.models.config.validate_model_config.
    validate: Optional[Callable[[Any], None]] = None
    #: The paper's names for the internal stream names of ``block.stream_names`` (figures' legends).
    stream_labels: dict = field(default_factory=dict)


def fail(msg: str) -> None:
    raise OLMoConfigurationError(msg)


def knob(config: Any, name: str):
    """A variant knob of ``config``, or its default when ``config`` is a stock OLMo ModelConfig without it."""
    if hasattr(config, name):
        return getattr(config, name)
    return DECLARED[name].default
