"""Read the config and the model weights of an OLMo checkpoint folder written by our training runs."""

from __future__ import annotations

import logging
import pathlib
import pickle
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch
from omegaconf import OmegaConf as om

from .config import LEGACY_KNOBS

log = logging.getLogger(__name__)

__all__ = ["load_model_state", "load_saved_config", "legacy_overrides", "allow_checkpoint_types", "UnsafeCheckpoint",
           "find_unsafe_file"]


class UnsafeCheckpoint(RuntimeError):
    """A checkpoint file holds an object outside the allow-list; nothing in it was executed."""


def _sharded_tensor_types() -> tuple:
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        MEM_FORMAT_ENCODING,
        ShardedTensorMetadata,
        TensorProperties,
    )
    from torch.distributed._shard.sharded_tensor.shard import Shard
    from torch.distributed.remote_device import _remote_device

    return (ShardedTensor, ShardedTensor.ProcessGroupState, Shard, ShardMetadata, ShardedTensorMetadata,
            TensorProperties, MEM_FORMAT_ENCODING, _remote_device)


def _checkpoint_getattr(obj, name: str):
    """The only attribute look-ups a checkpoint may make while unpickling: an enum member of the sharded-tensor
    metadata and ShardedTensor's ProcessGroupState (both written by pickling FSDP's torch_legacy shards)."""
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import MEM_FORMAT_ENCODING

    if obj is MEM_FORMAT_ENCODING and name in MEM_FORMAT_ENCODING.__members__:
        return MEM_FORMAT_ENCODING[name]
    if obj is ShardedTensor and name == "ProcessGroupState":
        return ShardedTensor.ProcessGroupState
    raise pickle.UnpicklingError(f"attribute {name!r} of {obj!r} is not on the checkpoint allow-list")


def allow_checkpoint_types() -> None:
    """Let torch.load with weights_only=True (torch's default) read what OLMo's trainer writes, and nothing more:
    the trainer state's paths and numpy RNG state, and FSDP's sharded tensors. Idempotent."""
    torch.serialization.add_safe_globals(
        [
            pathlib.PosixPath,
            np.core.multiarray._reconstruct,
            np.ndarray,
            np.dtype,
            type(np.dtype(np.uint32)),
            *_sharded_tensor_types(),
            (_checkpoint_getattr, "builtins.getattr"),
        ]
    )


def find_unsafe_file(folder: str | Path) -> Optional[tuple[Path, str]]:
    """(file, reason) for the first ``*.pt`` in ``folder`` that torch.load refuses with weights_only=True, else
    None. Tensors are memory-mapped, not read, so this is cheap even for large checkpoints."""
    allow_checkpoint_types()
    for path in sorted(Path(folder).glob("*.pt")):
        try:
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as err:
            detail = next((line.strip() for line in str(err).splitlines() if "WeightsUnpickler error" in line),
                          str(err).splitlines()[0])
            return path, detail.replace("WeightsUnpickler error: ", "")
        except RuntimeError:  # e.g. a sharded tensor that needs a process group: its types passed the allow-list
            continue
    return None


def refuse_unsafe(folder: str | Path) -> None:
    """Raise UnsafeCheckpoint naming the offending file, if there is one."""
    found = find_unsafe_file(folder)
    if found is not None:
        path, detail = found
        raise UnsafeCheckpoint(
            f"refusing to load {path}: it holds an object outside the checkpoint allow-list ({detail[:200]}); "
            "nothing in it was run. Use checkpoints written by this project's training, or convert the file "
            "where you trust it."
        )


def legacy_overrides(config_yaml: str | Path) -> List[str]:
    """``--model.FIELD=VALUE`` for every LEGACY_KNOBS field that a saved config.yaml lacks: a checkpoint written
    before the field existed (or before its default changed) loads as the model it was trained as."""
    raw = om.to_container(om.load(str(config_yaml)))
    model = (raw or {}).get("model") or {}
    missing = [(k, v) for k, v in LEGACY_KNOBS.items() if k not in model]
    for name, value in missing:
        log.info("%s predates model.%s: loading it with its old meaning %s=%s", config_yaml, name, name, value)
    return [f"--model.{name}={str(value).lower() if isinstance(value, bool) else value}" for name, value in missing]


def load_saved_config(config_yaml: str | Path, overrides: Optional[List[str]] = None):
    """A run's or checkpoint's saved config.yaml as a SiameseTrainConfig, older knobs filled with their old meaning."""
    from .runconfig import load_config

    return load_config(str(config_yaml), legacy_overrides(config_yaml) + list(overrides or []))


def load_model_state(checkpoint_dir: str | Path) -> Dict[str, torch.Tensor]:
    """Full (unsharded) model state dict of an unsharded (``stepN-unsharded/model.pt``) or a torch_legacy sharded
    checkpoint (``stepN/rank*.pt``, unsharded here in one process)."""
    folder = Path(checkpoint_dir)
    allow_checkpoint_types()
    refuse_unsafe(folder)
    if (folder / "model.pt").is_file():
        return torch.load(folder / "model.pt", map_location="cpu", weights_only=True)
    if list(folder.glob("rank*.pt")):
        from olmo.checkpoint import TorchLegacyShardedCheckpointer

        cfg = load_saved_config(folder / "config.yaml")
        model_state, _, _ = TorchLegacyShardedCheckpointer(cfg).unshard_checkpoint(
            folder, load_optimizer_state=False, load_trainer_state=False
        )
        return model_state
    raise FileNotFoundError(f"{folder} holds neither model.pt nor rank*.pt: not an OLMo checkpoint folder.")
