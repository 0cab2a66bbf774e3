"""SiameseNorm and its baselines as blocks of ai2-olmo 0.6.0, chosen by MODEL_TYPE; and, in ``siamesenorm.nn``,
the same residual topologies in plain PyTorch for any model.

Importing the package is cheap (no torch, no OLMo): it arranges for OLMo's block factory
(``olmo.model.OLMoBlock.build``) to honour MODEL_TYPE as soon as OLMo is imported (siamesenorm/_hook.py), and
the names below load on first use. Without ai2-olmo installed only ``siamesenorm.nn`` is available.
"""

import importlib

from ._hook import install as _install_hook
from .console import silence_known_warnings

silence_known_warnings()  # before OLMo's import, which emits OmegaConf deprecation warnings
_install_hook()

#: public name -> the module that defines it (imported on first use: PEP 562)
_LAZY = {"MODEL_TYPES": "config", "SiameseModelConfig": "config", "resolve_model_type": "config",
         "validate_model_config": "config", "build_model": "model", "num_params_from_config": "model",
         "BLOCKS": "registry"}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'siamesenorm' has no attribute {name!r}")
