"""MODEL_TYPE in OLMo's block factory, without importing OLMo until something else does.

``import siamesenorm`` must be cheap (every script's ``--help``), yet any OLMo model built after it must honour
MODEL_TYPE. So ``install()`` patches ``olmo.model.OLMoBlock.build`` at once if ``olmo.model`` is loaded, and
otherwise the moment it loads (a finder on ``sys.meta_path`` that wraps that one module's loader). The patch is a
trampoline: the first block built imports siamesenorm.models.registry, whose ``hooked_build`` picks the block; OLMo's
own factory is kept in ``ORIGINAL`` for ``pre``. Nothing here imports torch or OLMo.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from types import ModuleType

__all__ = ["install", "patch_factory", "ORIGINAL"]

#: "build": OLMo's own OLMoBlock.build (the function), saved before the patch.
ORIGINAL: dict = {}


def _trampoline(cls, layer_id, config, cache):
    from siamesenorm.models.registry import hooked_build

    return hooked_build(ORIGINAL["build"], cls, layer_id, config, cache)


def patch_factory(olmo_model: ModuleType) -> None:
    """Point ``olmo_model.OLMoBlock.build`` at siamesenorm's factory. Idempotent; a no-op on an OLMo source tree
    patched with changes.patch (its factory already delegates to siamesenorm.models.registry.block_for)."""
    if getattr(olmo_model, "SIAMESENORM_PATCHED", False):
        return
    current = olmo_model.OLMoBlock.build.__func__
    if current is _trampoline or getattr(current, "siamesenorm_factory", False):
        return
    ORIGINAL.setdefault("build", current)
    olmo_model.OLMoBlock.build = classmethod(_trampoline)


class _PatchOnLoad(importlib.abc.MetaPathFinder):
    """Finds nothing itself; for ``olmo.model`` it returns the real spec with a loader that patches after loading."""

    def find_spec(self, name, path=None, target=None):
        if name != "olmo.model":
            return None
        sys.meta_path.remove(self)  # once, and not while looking up the real spec
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            load = spec.loader.exec_module

            def exec_module(module, load=load):
                load(module)
                patch_factory(module)

            spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if "olmo.model" in sys.modules:
        patch_factory(sys.modules["olmo.model"])
    elif not any(isinstance(f, _PatchOnLoad) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnLoad())
