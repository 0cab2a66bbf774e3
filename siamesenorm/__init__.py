"""SiameseNorm and its baselines as blocks of ai2-olmo 0.6.0, chosen by MODEL_TYPE.

Importing the package installs the hook into OLMo's block factory (``olmo.model.OLMoBlock.build``).
"""

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
