"""Read the config and the model weights of a checkpoint folder written by our training runs, on either path: an
ai2-olmo checkpoint (``stepN-unsharded/model.pt`` or ``stepN/rank*.pt``, each with its config.yaml) or an OLMo-core
one (``stepN/model_and_optim/``, a torch.distributed checkpoint; its config is the run folder's config.yaml). An
OLMo-core checkpoint's model is read in one process through the same checks as a resume (``checked_olmo_core_loads``)
and renamed to the ai2-olmo model's names (``core_to_olmo_state``): every tool that takes a checkpoint (export_hf,
evaluate, generate, analyze) takes either."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict, List, Optional

import torch
import yaml
from olmo.checkpoint import TorchLegacyShardedCheckpointer
from olmo.util import find_latest_checkpoint
from omegaconf import OmegaConf as om

from siamesenorm.models.build import build_model
from siamesenorm.models.config import LEGACY_KNOBS
from siamesenorm.models.core_state import core_to_olmo_state
from siamesenorm.run.recipe import load_config
from siamesenorm.run.safeload import (  # noqa: F401 (UnsafeCheckpoint, allow_checkpoint_types: re-exported)
    UnsafeCheckpoint,
    allow_checkpoint_types,
    checked_loads,
    checked_olmo_core_loads,
    load,
    sharded_tensors_in_one_process,
)

log = logging.getLogger(__name__)

__all__ = ["load_model_state", "load_saved_config", "legacy_overrides", "allow_checkpoint_types", "UnsafeCheckpoint",
           "check_saved_yaml", "is_core_checkpoint", "config_of", "load_core_model_state", "checkpoint_folder",
           "load_model"]


MAX_CONFIG_BYTES = 2**20


def check_saved_yaml(path: str | Path) -> None:
    """A checkpoint's config.yaml is data: at most MAX_CONFIG_BYTES, no YAML aliases (they can expand without bound),
    no omegaconf interpolation or resolver (``${oc.env:SECRET}`` would read this machine's environment)."""
    path = Path(path)
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise UnsafeCheckpoint(f"refusing to read {path}: {path.stat().st_size:,d} bytes, more than a config holds")
    text = path.read_text(errors="replace")
    try:
        if any(isinstance(e, yaml.AliasEvent) for e in yaml.parse(text, Loader=yaml.SafeLoader)):
            raise UnsafeCheckpoint(f"refusing to read {path}: it uses YAML aliases (*name), which a saved config "
                                   "never holds")
    except yaml.YAMLError as err:
        raise UnsafeCheckpoint(f"refusing to read {path}: not valid YAML ({str(err).splitlines()[0]})") from None
    stack = [((), om.to_container(om.create(yaml.safe_load(text) or {}), resolve=False))]
    while stack:
        where, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((where + (str(k),), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((where + (str(i),), v) for i, v in enumerate(value))
        elif isinstance(value, str) and "${" in value:
            raise UnsafeCheckpoint(f"refusing to read {path}: {'.'.join(where)} holds an omegaconf interpolation "
                                   f"({value[:60]!r}); a saved config holds plain values only")


def legacy_overrides(config_yaml: str | Path) -> List[str]:
    """``--model.FIELD=VALUE`` for every LEGACY_KNOBS field that a saved config.yaml lacks: a checkpoint written
    before the field existed (or before its default changed) loads as the model it was trained as."""
    check_saved_yaml(config_yaml)
    raw = om.to_container(om.load(str(config_yaml)), resolve=False)
    model = (raw or {}).get("model") or {}
    missing = [(k, v) for k, v in LEGACY_KNOBS.items() if k not in model]
    for name, value in missing:
        log.info("%s predates model.%s: loading it with its old meaning %s=%s", config_yaml, name, name, value)
    return [f"--model.{name}={str(value).lower() if isinstance(value, bool) else value}" for name, value in missing]


def load_saved_config(config_yaml: str | Path, overrides: Optional[List[str]] = None):
    """A run's or checkpoint's saved config.yaml as a SiameseTrainConfig, older knobs filled with their old meaning."""
    return load_config(str(config_yaml), legacy_overrides(config_yaml) + list(overrides or []))


def is_core_checkpoint(folder: str | Path) -> bool:
    """An OLMo-core checkpoint folder (``model_and_optim/.metadata``)."""
    return (Path(folder) / "model_and_optim" / ".metadata").is_file()


def config_of(folder: str | Path) -> Path:
    """The config.yaml a checkpoint folder was trained with (an OLMo-core checkpoint's: its run folder's)."""
    folder = Path(folder)
    return folder.parent / "config.yaml" if is_core_checkpoint(folder) else folder / "config.yaml"


def load_core_model_state(folder: str | Path, model_type: str) -> Dict[str, torch.Tensor]:
    """The model of an OLMo-core checkpoint, unsharded in this process, under the ai2-olmo model's names."""
    from olmo_core.distributed.checkpoint import get_checkpoint_metadata, load_keys

    path = Path(folder) / "model_and_optim"
    with checked_olmo_core_loads():  # the .metadata pickle and every item checked before torch reads it
        keys = [k for k in get_checkpoint_metadata(str(path)).state_dict_metadata if k.startswith("model.")]
        values = list(load_keys(str(path), keys))
    return core_to_olmo_state({k[len("model."):]: v for k, v in zip(keys, values)}, model_type)


def load_model_state(checkpoint_dir: str | Path, model_type: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """Full (unsharded) model state dict of an unsharded (``stepN-unsharded/model.pt``), a torch_legacy sharded
    (``stepN/rank*.pt``, unsharded here in one process) or an OLMo-core checkpoint (its model's MODEL_TYPE from
    ``model_type`` or the run's config)."""
    folder = Path(checkpoint_dir)
    if is_core_checkpoint(folder):
        if model_type is None:
            model_type = load_saved_config(config_of(folder)).model.model_type or "pre"
        return load_core_model_state(folder, model_type)
    if (folder / "model.pt").is_file():
        return load(folder / "model.pt", map_location="cpu")
    if list(folder.glob("rank*.pt")):
        cfg = load_saved_config(folder / "config.yaml")
        # OLMo unshards in one process; every rank file it opens is checked by safeload.load and read with
        # weights_only=True, its ShardedTensors keeping their saved state without a process group.
        with checked_loads(), sharded_tensors_in_one_process():
            model_state, _, _ = TorchLegacyShardedCheckpointer(cfg).unshard_checkpoint(
                folder, load_optimizer_state=False, load_trainer_state=False
            )
        return model_state
    raise FileNotFoundError(f"{folder} holds neither model.pt nor rank*.pt: not an OLMo checkpoint folder.")


def checkpoint_folder(path: str | Path) -> Path:
    """A checkpoint folder (config.yaml + model.pt or rank*.pt; or an OLMo-core checkpoint in a run folder with its
    config.yaml) from itself or from a run folder (its latest)."""
    folder = Path(path)
    if (folder / "config.yaml").is_file() and ((folder / "model.pt").is_file() or list(folder.glob("rank*.pt"))):
        return folder
    if is_core_checkpoint(folder) and config_of(folder).is_file():
        return folder

    latest = find_latest_checkpoint(folder) if folder.is_dir() else None
    if latest is None:
        raise FileNotFoundError(f"{folder}: no OLMo checkpoint here or in its step*/ folders; train with save_interval set.")
    return Path(latest)


def load_model(path: str | Path):
    """(model in eval mode on CPU, its SiameseTrainConfig) from a checkpoint or run folder."""
    folder = checkpoint_folder(path)
    cfg = load_saved_config(config_of(folder))
    cfg.model.init_device = "cpu"
    model = build_model(cfg.model, cfg.model.model_type or "pre", init_params=False)
    model.load_state_dict(load_model_state(folder, cfg.model.model_type or "pre"))
    return model.eval(), cfg
