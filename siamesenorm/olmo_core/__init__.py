"""Every MODEL_TYPE as an OLMo-core transformer block (PyPI ``ai2-olmo-core``, package ``olmo_core``).

ai2-olmo 0.6.0 (the main path, the paper's base) pins ``ai2-olmo-core==0.1.0``, and both releases are the import
package ``olmo_core``, so pip cannot install OLMo-core 3 beside ai2-olmo by a dependency list: ``bash
scripts/setup_env.sh`` installs it in a second step without that pin (pyproject.toml, ``[tool.siamesenorm]``).
ai2-olmo imports ``olmo_core`` only for its ``olmo_core`` sharded checkpointer, which no recipe here uses
(``torch_legacy``); everything else of the main path is unaffected.

- ``siamesenorm.olmo_core.blocks``: the blocks, one small class per MODEL_TYPE over OLMo-core's own attention,
  feed-forward and norms, whose forward applies the update rules of ``siamesenorm.nn`` (the same functions the
  ai2-olmo adapters call); ``pre`` is OLMo-core's own ``TransformerBlock``.
Importing this package imports nothing of OLMo-core (``--help`` stays fast); ``blocks`` and ``config`` check the
installed release first (``require_olmo_core``: one line when it is not OLMo-core 3).

- ``siamesenorm.olmo_core.train``: training from one of our recipes with OLMo-core's Trainer
  (scripts/train_olmo_core.py).
- ``siamesenorm.olmo_core.config``: ``SiameseBlockConfig`` (OLMo-core's block config plus ``model_type`` and the
  variant knobs; OLMo-core builds the block from it as it builds its own block types) and ``transformer_config``,
  which turns one of our model configs (a recipe's ``model:``) into OLMo-core's ``TransformerConfig``;
  ``olmo_to_core_state`` / ``core_to_olmo_state`` map weights between the two by name.
"""

from __future__ import annotations

import logging

REQUIRED = "3."
# OLMo-core logs a warning at import on every machine without NVIDIA's transformer_engine (CPUs, most GPU nodes);
# its TE attention backend still raises with its own message when a config asks for it.
logging.getLogger("olmo_core.nn.attention.te_attn_api").setLevel(logging.ERROR)


def require_olmo_core() -> None:
    """One line when the installed ``olmo_core`` is not OLMo-core 3 (e.g. ai2-olmo's pinned 0.1.0)."""
    try:
        from olmo_core.version import VERSION
    except ImportError as e:  # 0.1.0 has no nn package; a missing install has no olmo_core at all
        raise ImportError("the OLMo-core path needs ai2-olmo-core 3 (package olmo_core), which is not installed here; "
                          "run `bash scripts/setup_env.sh` (it installs the pin of pyproject.toml's "
                          "[tool.siamesenorm] olmo-core)") from e
    if not VERSION.startswith(REQUIRED):
        raise ImportError(f"the OLMo-core path needs ai2-olmo-core 3, this environment has {VERSION} (ai2-olmo 0.6.0 "
                          "pins 0.1.0); run `bash scripts/setup_env.sh`, which installs 3.0.0 in a second step")

