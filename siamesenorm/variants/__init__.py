"""One file per MODEL_TYPE: its block (a thin adapter that applies siamesenorm.nn's update rule to OLMo's
sublayers and norms), its name, display name, colour, knobs and their validation, in ``VARIANT``.

The registry is derived from the files: every module here whose name does not start with an underscore (and is
not ``spec``) must define ``VARIANT``. Adding a variant is one new file (plus its tests).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Dict

from .spec import Knob, Variant

__all__ = ["VARIANTS", "KNOBS", "KNOB_OWNERS", "Variant", "Knob"]


def _discover() -> Dict[str, Variant]:
    found = []
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_") or info.name == "spec":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        variant = getattr(module, "VARIANT", None)
        if not isinstance(variant, Variant) or variant.name != info.name:
            raise ImportError(
                f"siamesenorm/variants/{info.name}.py must define VARIANT = Variant(name={info.name!r}, ...)")
        found.append(variant)
    found.sort(key=lambda v: v.order)
    expected = list(range(len(found)))
    if [v.order for v in found] != expected or sorted(v.table_row for v in found) != expected:
        raise ImportError("siamesenorm/variants: each VARIANT needs its own order and table_row, 0 .. n-1 with no gap")
    return {v.name: v for v in found}


#: MODEL_TYPE -> Variant, in the documented order.
VARIANTS: Dict[str, Variant] = _discover()

#: Every knob by name (a knob shared by several variants, e.g. SiameseNorm's, is one Knob object).
KNOBS: Dict[str, Knob] = {}
#: Which MODEL_TYPEs read each knob (the run record lists a changed knob only for these).
KNOB_OWNERS: Dict[str, tuple] = {}
for _v in VARIANTS.values():
    for _k in _v.knobs:
        if KNOBS.setdefault(_k.name, _k) != _k:
            raise ImportError(f"knob {_k.name} is declared twice with different values ({_v.name}.py)")
        KNOB_OWNERS[_k.name] = KNOB_OWNERS.get(_k.name, ()) + (_v.name,)
