"""SiameseNorm and its baselines as blocks of ai2-olmo 0.6.0, chosen by MODEL_TYPE; and, in ``siamesenorm.nn``,
the same residual topologies in plain PyTorch for any model.

Importing the package installs the hook into OLMo's block factory (``olmo.model.OLMoBlock.build``). Without
ai2-olmo installed only ``siamesenorm.nn`` is available.
"""

from .console import silence_known_warnings

silence_known_warnings()  # before OLMo's import, which emits OmegaConf deprecation warnings

try:
    import olmo  # noqa: F401
except ImportError:  # siamesenorm.nn needs torch alone
    __all__ = []
else:
    from .config import MODEL_TYPES, SiameseModelConfig, resolve_model_type, validate_model_config
    from .model import build_model, num_params_from_config
    from .registry import BLOCKS, install_hook

    install_hook()

    __all__ = [
        "MODEL_TYPES",
        "BLOCKS",
        "SiameseModelConfig",
        "build_model",
        "num_params_from_config",
        "resolve_model_type",
        "validate_model_config",
    ]
