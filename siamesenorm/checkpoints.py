"""Read the config and the model weights of an OLMo checkpoint folder written by our training runs."""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import pickle
import pickletools
import zipfile
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
    from torch.distributed._shard.sharding_spec import (
        ChunkShardingSpec,
        DevicePlacementSpec,
        EnumerableShardingSpec,
    )
    from torch.distributed.remote_device import _remote_device

    # the sharding specs are plain dataclasses; which one a shard holds depends on how FSDP split the parameter
    return (ShardedTensor, ShardedTensor.ProcessGroupState, Shard, ShardMetadata, ShardedTensorMetadata,
            TensorProperties, MEM_FORMAT_ENCODING, _remote_device, ChunkShardingSpec, EnumerableShardingSpec,
            DevicePlacementSpec)


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


def pickle_globals(path: str | Path) -> set[str]:
    """Every global (``module.name``) the pickle inside a torch checkpoint file refers to, read statically with
    pickletools: nothing is unpickled, nothing runs."""
    names: set[str] = set()
    with zipfile.ZipFile(path) as archive:
        for member in (m for m in archive.namelist() if m.endswith("data.pkl")):
            strings: list[str] = []
            for opcode, arg, _ in pickletools.genops(archive.read(member)):
                if opcode.name == "GLOBAL":
                    names.add(arg.replace(" ", "."))
                elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                    names.add(f"{strings[-2]}.{strings[-1]}")
                elif isinstance(arg, str):
                    strings.append(arg)
    return {"builtins." + n[len("__builtin__."):] if n.startswith("__builtin__.") else n for n in names}


def _allowed_names() -> set[str]:
    from torch import _weights_only_unpickler as wou

    return set(wou._get_allowed_globals()) | set(wou._get_user_allowed_globals())


def find_unsafe_file(folder: str | Path) -> Optional[tuple[Path, str]]:
    """(file, reason) for the first ``*.pt`` in ``folder`` that refers to a global outside what torch.load with
    weights_only=True accepts plus this project's allow-list, else None. Read statically (pickle_globals)."""
    allow_checkpoint_types()
    allowed = _allowed_names()
    for path in sorted(Path(folder).glob("*.pt")):
        try:
            outside = sorted(pickle_globals(path) - allowed)
        except zipfile.BadZipFile:
            return path, "not a torch checkpoint file (not a zip archive)"
        if outside:
            return path, f"refers to {', '.join(outside[:3])}"
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


@contextlib.contextmanager
def _unrestricted_torch_load():
    """torch.load without weights_only inside the block, for files already checked by find_unsafe_file."""
    previous = os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = previous


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
        # OLMo unshards FSDP's shards in one process by patching how torch rebuilds a ShardedTensor, which torch's
        # weights_only unpickler bypasses. The shards were checked above: every global they refer to is on the
        # allow-list, so they are loaded with weights_only=False for this call only.
        with _unrestricted_torch_load():
            model_state, _, _ = TorchLegacyShardedCheckpointer(cfg).unshard_checkpoint(
                folder, load_optimizer_state=False, load_trainer_state=False
            )
        return model_state
    raise FileNotFoundError(f"{folder} holds neither model.pt nor rank*.pt: not an OLMo checkpoint folder.")


def checkpoint_folder(path: str | Path) -> Path:
    """A checkpoint folder (config.yaml + model.pt or rank*.pt) from itself or from a run folder (its latest)."""
    folder = Path(path)
    if (folder / "config.yaml").is_file() and ((folder / "model.pt").is_file() or list(folder.glob("rank*.pt"))):
        return folder
    from olmo.util import find_latest_checkpoint

    latest = find_latest_checkpoint(folder) if folder.is_dir() else None
    if latest is None:
        raise FileNotFoundError(f"{folder}: no OLMo checkpoint here or in its step*/ folders; train with save_interval set.")
    return Path(latest)


def load_model(path: str | Path):
    """(model in eval mode on CPU, its SiameseTrainConfig) from a checkpoint or run folder."""
    from .model import build_model

    folder = checkpoint_folder(path)
    cfg = load_saved_config(folder / "config.yaml")
    cfg.model.init_device = "cpu"
    model = build_model(cfg.model, cfg.model.model_type or "pre", init_params=False)
    model.load_state_dict(load_model_state(folder))
    return model.eval(), cfg
