"""SiameseNorm and its baselines as blocks of ai2-olmo 0.6.0, chosen by MODEL_TYPE; and, in ``siamesenorm.nn``,
the same residual topologies in plain PyTorch for any model.

Importing the package is cheap (no torch, no OLMo): it arranges for OLMo's block factory
(``olmo.model.OLMoBlock.build``) to honour MODEL_TYPE as soon as OLMo is imported (siamesenorm/models/olmo_hook.py), and
the names below load on first use. Without ai2-olmo installed only ``siamesenorm.nn`` is available.
"""

import importlib

from siamesenorm.models.olmo_hook import install as _install_hook
from siamesenorm.run.console import silence_known_warnings

silence_known_warnings()  # before OLMo's import, which emits OmegaConf deprecation warnings
_install_hook()

#: public name -> the module that defines it (imported on first use: PEP 562)
_LAZY = {"MODEL_TYPES": "models.config", "SiameseModelConfig": "models.config",
         "resolve_model_type": "models.config", "validate_model_config": "models.config",
         "build_model": "models.build", "num_params_from_config": "models.build", "BLOCKS": "models.registry"}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'siamesenorm' has no attribute {name!r}")
