"""Read the model weights and the config of an OLMo checkpoint folder written by our training runs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict

import torch


def load_model_state(checkpoint_dir: str | Path) -> Dict[str, torch.Tensor]:
    """Full (unsharded) model state dict of an unsharded (``stepN-unsharded/model.pt``) or a torch_legacy sharded
    checkpoint (``stepN/rank*.pt``, unsharded here in one process)."""
    folder = Path(checkpoint_dir)
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # our own checkpoints hold paths, numpy types
    if (folder / "model.pt").is_file():
        return torch.load(folder / "model.pt", map_location="cpu")
    if list(folder.glob("rank*.pt")):
        from olmo.checkpoint import TorchLegacyShardedCheckpointer

        from .train import load_config

        cfg = load_config(str(folder / "config.yaml"))
        model_state, _, _ = TorchLegacyShardedCheckpointer(cfg).unshard_checkpoint(
            folder, load_optimizer_state=False, load_trainer_state=False
        )
        return model_state
    raise FileNotFoundError(f"{folder} holds neither model.pt nor rank*.pt: not an OLMo checkpoint folder.")
