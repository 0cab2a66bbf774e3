"""One file per MODEL_TYPE: its block (a thin adapter that applies siamesenorm.nn's update rule to OLMo's
sublayers and norms), its name, display name, colour, knobs and their validation, in ``VARIANT``.

The registry is derived from the files: every module here whose name does not start with an underscore (and is
not ``spec``) must define ``VARIANT``. Adding a variant is one new file (plus its tests). A variant file may also
live outside the package, in a folder named by the ``SIAMESENORM_VARIANTS`` environment variable (several joined
with ``os.pathsep``): it is imported as ``siamesenorm.variants.<name>`` (so ``from ._base import TopologyBlock``
works there too) and registered like the package's own.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pkgutil
from pathlib import Path
from typing import Dict

from .spec import Knob, Variant

__all__ = ["VARIANTS", "KNOBS", "KNOB_OWNERS", "TABLE_ORDER", "Variant", "Knob"]


#: The environment variable naming folders of variant files kept outside the package.
EXTRA_VARIANTS_VARIABLE = "SIAMESENORM_VARIANTS"

#: Modules a variant file kept outside the package may have imported before the package was grouped by concern
#: (docs/architecture.md), and where each lives now: such a file gets one line saying which import to change.
MOVED_MODULES = {
    "siamesenorm.config": "siamesenorm.models.config", "siamesenorm.model": "siamesenorm.models.build",
    "siamesenorm.registry": "siamesenorm.models.registry", "siamesenorm.catalog": "siamesenorm.models.names",
    "siamesenorm.loss": "siamesenorm.nn.loss", "siamesenorm.records": "siamesenorm.run.records",
    "siamesenorm.stability": "siamesenorm.run.stability", "siamesenorm.runconfig": "siamesenorm.run.recipe",
    "siamesenorm.train": "siamesenorm.ai2_olmo.train", "siamesenorm.trainer": "siamesenorm.ai2_olmo.trainer",
    "siamesenorm.figures": "siamesenorm.analysis.figures", "siamesenorm.tables": "siamesenorm.analysis.tables",
    "siamesenorm.analysis": "siamesenorm.analysis.probes", "siamesenorm.hf": "siamesenorm.export.hf",
}


def _add_extra_folders() -> None:
    """Put the folders of ``SIAMESENORM_VARIANTS`` on this package's search path (after its own folder)."""
    own = {info.name for info in pkgutil.iter_modules(__path__[:1])}
    for folder in filter(None, os.environ.get(EXTRA_VARIANTS_VARIABLE, "").split(os.pathsep)):
        if not Path(folder).is_dir():
            raise ImportError(f"{EXTRA_VARIANTS_VARIABLE} names {folder}, which is not a folder; point it at the "
                              "folder holding your variant files, or unset it")
        clash = sorted(own & {p.stem for p in Path(folder).glob("*.py")})
        if clash:
            raise ImportError(f"{Path(folder) / (clash[0] + '.py')} has the name of a variant of the package; "
                              "rename the file (a MODEL_TYPE is its file name)")
        if str(Path(folder).resolve()) not in __path__:
            __path__.append(str(Path(folder).resolve()))


def _discover() -> Dict[str, Variant]:
    found = []
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_") or info.name == "spec":
            continue
        try:
            module = importlib.import_module(f"{__name__}.{info.name}")
        except ModuleNotFoundError as err:
            if err.name not in MOVED_MODULES:
                raise
            raise ImportError(f"{Path(info.module_finder.path) / (info.name + '.py')} imports {err.name}, which is "
                              f"now {MOVED_MODULES[err.name]} (the package is grouped by concern: "
                              "docs/architecture.md); change that import") from None
        variant = getattr(module, "VARIANT", None)
        if not isinstance(variant, Variant) or variant.name != info.name:
            raise ImportError(
                f"{module.__file__} must define VARIANT = Variant(name={info.name!r}, ...)")
        found.append(variant)
    for attr in ("order", "table_row"):
        placed = [getattr(v, attr) for v in found if getattr(v, attr) is not None]
        if len(placed) != len(set(placed)):
            twice = sorted({p for p in placed if placed.count(p) > 1})
            raise ImportError(f"siamesenorm/variants: two VARIANTs share {attr} {twice[0]:g}; each needs its own "
                              f"{attr} (or none: then it goes after the placed ones)")
    found.sort(key=lambda v: _position(v, "order"))
    used = {v.colour for v in found if v.colour}
    spare = [c for c in SPARE_COLOURS if c not in used]
    resolved = []
    for v in found:  # the defaults: the MODEL_TYPE as its display name, a colour no other variant uses
        colour = v.colour or (spare.pop(0) if spare else "tab:gray")
        resolved.append(dataclasses.replace(v, display_name=v.display_name or v.name, colour=colour))
    return {v.name: v for v in resolved}


def _position(variant: Variant, attr: str):
    """Sort key: the placed ones by their number, then the unplaced ones by name."""
    value = getattr(variant, attr)
    return (value is None, value if value is not None else 0, variant.name)


#: Colours for variants that name none (figures: dashed, as every non-tab: colour).
SPARE_COLOURS = ("teal", "darkgoldenrod", "slateblue", "olivedrab", "firebrick", "indigo", "darkcyan", "sienna")


#: MODEL_TYPE -> Variant, in the documented order (display names and colours filled in).
_add_extra_folders()
VARIANTS: Dict[str, Variant] = _discover()
#: The MODEL_TYPEs in the tables' row order.
TABLE_ORDER = tuple(v.name for v in sorted(VARIANTS.values(), key=lambda v: _position(v, "table_row")))

#: Every knob by name (a knob shared by several variants, e.g. SiameseNorm's, is one Knob object).
KNOBS: Dict[str, Knob] = {}
#: Which MODEL_TYPEs read each knob (the run record lists a changed knob only for these).
KNOB_OWNERS: Dict[str, tuple] = {}
for _v in VARIANTS.values():
    for _k in _v.knobs:
        if KNOBS.setdefault(_k.name, _k) != _k:
            raise ImportError(f"knob {_k.name} is declared twice with different values ({_v.name}.py)")
        KNOB_OWNERS[_k.name] = KNOB_OWNERS.get(_k.name, ()) + (_v.name,)
