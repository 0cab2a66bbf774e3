"""A run's save folder across attempts: what a rerun of the same command does, and what a resume must match.

The decision (``plan_run``), made before anything is written:

* ``--load_path=X``: load X (a checkpoint of this run or of another).
* ``--save_overwrite``: start over; every artefact of the earlier run in the folder is deleted first.
* a complete checkpoint in the folder and ``try_load_latest_save``: resume from the latest (``stepN`` folders only;
  OLMo writes ``stepN-tmp`` and renames it when complete). Without ``try_load_latest_save`` the run is refused,
  naming both options.
* an earlier attempt that died before its first checkpoint (config.yaml, no checkpoint, record not finished):
  start fresh in place, its leftovers deleted.
* a finished run without a checkpoint: refused (rerunning it would silently replace its results).
* otherwise a fresh run.

* a finished run whose latest checkpoint is at its last step, rerun with the same max_duration: nothing to do
  (``done``); a larger max_duration continues it.

Resuming compares the checkpoint's model with the run's (``check_resume_model``) and truncates metrics.jsonl to
the restored step, so no step appears twice.

One run per folder: ``hold_run_folder`` takes an exclusive lock (``.run.lock``, flock, released by the kernel when
the process ends however it ends) before anything in the folder is read or changed, and writes its owner (host,
pid, start time) into it; a second process gets one line naming the owner. A lock file with an owner but no lock
held is a run that died: it is taken over and said so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any, Optional

from olmo.exceptions import OLMoConfigurationError
from olmo.util import find_latest_checkpoint
from omegaconf import OmegaConf as om

from siamesenorm.models.config import SiameseModelConfig, resolve_model_type
from siamesenorm.run.checkpoints import UnsafeCheckpoint, check_saved_yaml, load_saved_config
from siamesenorm.run.console import attach_run_log
from siamesenorm.run.recipe import RunError, SiameseTrainConfig, manifest_entry
from siamesenorm.run.records import RECORD_NAME
from siamesenorm.run.safeload import refusal_inside

log = logging.getLogger(__name__)

__all__ = ["hold_run_folder", "LOCK_NAME", "plan_run", "clear_run_folder", "settle_run_folder",
           "resolve_run_model_type", "check_resume_model", "check_same_data", "data_fingerprint", "read_record",
           "truncate_metrics", "RUN_ARTEFACTS"]

#: What a training run writes into its save folder; only these are deleted when a run starts over.
FINGERPRINT_NAME = "data-fingerprint.json"
RUN_ARTEFACTS = ("config.yaml", RECORD_NAME, FINGERPRINT_NAME, "metrics.jsonl", "console.log", "train_data",
                 "data-indices", "wandb",
                 "step*", "latest*",
                 "work", "dataset-cache")  # OLMo-core's work folder and its dataset's index cache


LOCK_NAME = ".run.lock"


@contextlib.contextmanager
def hold_run_folder(folder: str | Path):
    """Hold ``folder`` for this process (module docstring); RunError naming the owner if another process holds it.
    A start refused inside (a config or checkpoint error, before training) leaves no owner behind, and no folder
    when the folder did not exist before and holds nothing but the lock."""
    folder = Path(folder)
    existed = folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    refused = False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _lock_owner(fd)
            raise RunError(f"{folder} is in use by another run ({owner}): wait for it to end or stop it, or use "
                           "another save_folder.") from None
        stale = _lock_owner(fd, default="")
        if stale:
            log.info("%s: taking over the lock of a run that ended without releasing it (%s)", folder, stale)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                  "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        try:
            yield
        except (OLMoConfigurationError, UnsafeCheckpoint):  # a refusal: a clean end, not a run that died
            refused = True
            raise
        except BaseException as err:  # a checkpoint refused inside OLMo-core's loader is a refusal too
            refused = refusal_inside(err) is not None
            raise
        finally:
            if refused or not sys.exc_info()[0]:
                os.ftruncate(fd, 0)  # a clean end leaves no owner behind
    finally:
        os.close(fd)  # releases the lock
        if refused and not existed and [p.name for p in folder.iterdir()] == [LOCK_NAME]:
            (folder / LOCK_NAME).unlink()
            folder.rmdir()


def _lock_owner(fd: int, default: str = "owner unknown") -> str:
    try:
        owner = json.loads(os.pread(fd, 4096, 0) or b"null")
        return f"host {owner['host']}, pid {owner['pid']}, since {owner['started']}"
    except (ValueError, TypeError, KeyError, OSError):
        return default


def _is_local(path: Optional[str]) -> bool:
    return path is not None and "://" not in str(path)


def plan_run(cfg: SiameseTrainConfig) -> tuple[Optional[str], str]:
    """(checkpoint to load or None, what happens: "load", "resume", "done", "overwrite", "restart" or "fresh")."""
    folder = Path(cfg.save_folder)
    if cfg.load_path is not None:
        inside = _is_local(cfg.load_path) and Path(cfg.load_path).resolve().parent == folder.resolve()
        if cfg.save_overwrite and inside:
            raise RunError(f"--save_overwrite would delete {cfg.load_path}, the checkpoint --load_path names; "
                           "drop one of the two.")
        return str(cfg.load_path), "load"
    if cfg.save_overwrite:
        return None, "overwrite"
    latest = find_latest_checkpoint(folder) if folder.is_dir() else None
    if latest is None and cfg.try_load_latest_save and cfg.remote_save_folder:
        latest = find_latest_checkpoint(cfg.remote_save_folder)
    if latest is not None:
        if cfg.try_load_latest_save:
            record = _read_json(folder / RECORD_NAME)
            if (record.get("status") == "finished" and record.get("step") is not None
                    and record.get("step") >= record.get("max_steps", float("inf"))
                    and record.get("max_duration") == str(cfg.max_duration)
                    and Path(str(latest)).name.startswith(f"step{record['step']}")):
                return str(latest), "done"
            return str(latest), "resume"
        raise RunError(f"{folder} holds the checkpoint {Path(str(latest)).name} of an earlier run: pass "
                       "--try_load_latest_save to resume it, or --save_overwrite to start over (deletes it).")
    if (folder / "config.yaml").is_file():
        record = _read_json(folder / RECORD_NAME)
        if record.get("status") == "finished":
            raise RunError(f"{folder} holds a finished run (no checkpoint to resume): pass --save_overwrite to "
                           "train it again, or use another save_folder.")
        return None, "restart"
    return None, "fresh"


def clear_run_folder(folder: str | Path) -> list[str]:
    """Delete the artefacts of an earlier run in ``folder`` (nothing else); return what was deleted."""
    folder = Path(folder)
    removed = []
    for pattern in RUN_ARTEFACTS:
        for path in sorted(folder.glob(pattern)):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path.name)
    return removed


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def saved_config_path(load_path: str) -> Path:
    """The config a checkpoint was trained with: ai2-olmo writes ``config.yaml`` into each checkpoint; an OLMo-core
    checkpoint (``model_and_optim/``, no config.yaml) is judged by its run folder's ``config.yaml``."""
    path = Path(load_path)
    if not (path / "config.yaml").is_file() and (path / "model_and_optim").is_dir():
        return path.parent / "config.yaml"
    return path / "config.yaml"


def checkpoint_model_type(load_path: str) -> Optional[str]:
    cfg_path = saved_config_path(load_path)
    if not cfg_path.is_file():
        return None
    check_saved_yaml(cfg_path)
    raw = om.to_container(om.load(str(cfg_path)), resolve=False) or {}
    return (raw.get("model") or {}).get("model_type")


def resolve_run_model_type(cfg: SiameseTrainConfig, load_path: Optional[str]) -> tuple[str, str]:
    """(MODEL_TYPE, where it came from) for this run; on resume the checkpoint's, a contradicting choice fails."""
    chosen, source = resolve_model_type(cfg.model)
    if load_path is None:
        return chosen, source
    saved = checkpoint_model_type(load_path)
    if saved is None:
        return chosen, source
    if source != "default" and chosen != saved:
        raise RunError(
            f"MODEL_TYPE={chosen} (from {source}) contradicts the checkpoint {load_path}, which was trained as "
            f"MODEL_TYPE={saved}; set MODEL_TYPE={saved} (or unset it) to resume, or use a new save_folder."
        )
    return saved, f"checkpoint {load_path}"


#: Model fields that do not define the trained model: where and how it was first initialised, how attention is run.
_RUNTIME_MODEL_FIELDS = {"init_device", "init_fn", "init_std", "init_cutoff_factor", "precision", "flash_attention",
                         "model_type"}


def _plain(value: Any) -> Any:
    value = getattr(value, "value", value)  # enums compare by their config string
    return list(value) if isinstance(value, (list, tuple)) else value


def _override_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


def check_resume_model(cfg: SiameseTrainConfig, load_path: str) -> None:
    """Refuse, before any step, to resume a checkpoint whose model differs from this run's in any field that
    defines it (sizes, norms, the variant knobs); MODEL_TYPE is settled by resolve_run_model_type. A checkpoint
    written before a knob existed is compared with the knob's old meaning (config.LEGACY_KNOBS)."""
    saved_yaml = saved_config_path(load_path)
    if not saved_yaml.is_file():
        return
    saved = load_saved_config(saved_yaml).model
    changed = []
    for f in dataclasses.fields(SiameseModelConfig):
        if f.name in _RUNTIME_MODEL_FIELDS:
            continue
        old, new = _plain(getattr(saved, f.name)), _plain(getattr(cfg.model, f.name))
        if old != new:
            changed.append((f.name, old, new))
    if changed:
        what = "; ".join(f"model.{name} was {old!r}, now {new!r}" for name, old, new in changed)
        fix = " ".join(f"--model.{name}={_override_value(old)}" for name, old, _ in changed)
        raise RunError(
            f"cannot resume {load_path}: it was trained as a different model ({what}); "
            f"pass {fix} to resume it, or use a new save_folder."
        )


def truncate_metrics(path: Path, step: int) -> int:
    """Drop the rows of metrics.jsonl after ``step`` (the restored checkpoint's), so a resumed run logs each step
    once. Returns how many rows were dropped."""
    if not path.is_file():
        return 0
    rows = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    steps = [_row_step(row) for row in rows]
    kept = [row for row, row_step in zip(rows, steps) if row_step is not None and row_step <= step]
    unreadable = sum(1 for row, row_step in zip(rows, steps) if row.strip() and row_step is None)
    if unreadable:
        log.warning("%s: dropped %d unreadable line(s) (cut by a kill, or not JSON)", path, unreadable)
    if len(kept) != len(rows):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(row + "\n" for row in kept))
        tmp.replace(path)
    return len(rows) - len(kept)


def _row_step(row: str) -> Optional[int]:
    """The step of a metrics.jsonl row; None for a line that is not a JSON object (cut, or garbage)."""
    try:
        value = json.loads(row)
    except ValueError:
        return None
    return int(value.get("step", 0)) if isinstance(value, dict) else None


def read_record(folder: Path) -> dict:
    """The run record of ``folder``; {} with one warning when it is cut or corrupt (the checkpoint is what resumes)."""
    path = folder / RECORD_NAME
    if not path.is_file():
        return {}
    record = _read_json(path)
    if not record:
        log.warning("%s is unreadable (cut or corrupt): it is written again from this attempt; the loss spikes "
                    "it listed before are not carried over", path)
    return record


def settle_run_folder(cfg: SiameseTrainConfig, action: str, load_path: Optional[str]) -> Path:
    """Rank 0, before anything is written: clear the folder for a fresh start (``action``, from plan_run), create it,
    attach console.log and save config.yaml. Returns console.log's path."""
    folder = Path(cfg.save_folder)
    if action in ("overwrite", "restart"):
        removed = clear_run_folder(folder)
        if removed:
            why = "--save_overwrite" if action == "overwrite" else "the earlier attempt died before its first checkpoint"
            log.info("starting over in %s (%s): removed %s", folder, why, ", ".join(removed))
    if action == "resume":
        log.info("resuming %s from %s", folder, load_path)
    folder.mkdir(parents=True, exist_ok=True)
    console_log = attach_run_log(folder)
    if action != "resume" or not (folder / FINGERPRINT_NAME).is_file():
        (folder / FINGERPRINT_NAME).write_text(json.dumps(data_fingerprint(cfg), indent=1) + "\n")
    if action != "resume":
        cfg.save(folder / "config.yaml")
    return console_log


#: A token file up to this size is hashed whole; a larger one by its size, its first and last MiB and
#: ``SAMPLED_BLOCKS`` blocks of 64 KiB spread evenly through it (reads about 6 MiB of a file of any size).
FULL_HASH_BYTES = 64 * 2**20
SAMPLED_BLOCKS = 64


def file_sample_digest(path: Path) -> str:
    """A sha256 of the file's own bytes: all of them up to FULL_HASH_BYTES, else size + head + tail + evenly spaced
    blocks. A file rewritten in place with the same size changes it unless every changed byte falls between the
    sampled blocks of a file larger than 64 MiB."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= FULL_HASH_BYTES:
            for chunk in iter(lambda: f.read(2**20), b""):
                digest.update(chunk)
            return "whole:" + digest.hexdigest()
        offsets = [0, size - 2**20] + [size * (i + 1) // (SAMPLED_BLOCKS + 1) for i in range(SAMPLED_BLOCKS)]
        for offset in offsets:
            f.seek(offset)
            digest.update(f.read(2**20 if offset in (0, size - 2**20) else 2**16))
    return "sampled:" + digest.hexdigest()


def data_fingerprint(cfg: SiameseTrainConfig) -> list:
    """What identifies the training token files: each one's path, size, its manifest's sha256 (or a hash of its
    first and last MiB) and ``file_sample_digest`` of its own bytes (so a file changed in place, same size, with
    its manifest left as it was, is seen)."""
    out = []
    for name in [str(p) for p in cfg.data.paths or []]:
        if "://" in name:
            out.append({"path": name})
            continue
        path = Path(name)
        size = path.stat().st_size
        meta = manifest_entry(path)
        if meta is not None and meta.get("sha256"):
            digest = meta["sha256"]
        else:
            with open(path, "rb") as f:
                head = f.read(2**20)
                f.seek(max(0, size - 2**20))
                digest = "ends:" + hashlib.sha256(head + f.read(2**20)).hexdigest()
        out.append({"path": name, "bytes": size, "sha256": digest, "content": file_sample_digest(path)})
    return out


def _same_file(old: Optional[dict], new: Optional[dict]) -> bool:
    """Two fingerprint rows agree on every field both have (a run started before ``content`` existed compares
    without it)."""
    if old is None or new is None:
        return old is new
    return all(old[k] == new[k] for k in set(old) & set(new))


def check_same_data(cfg: SiameseTrainConfig) -> None:
    """On resume: the token files must be the ones the run started with (its data-fingerprint.json), unless
    ``resume_on_new_data``."""
    saved = Path(cfg.save_folder) / FINGERPRINT_NAME
    if not saved.is_file():
        return
    before = {row.get("path"): row for row in (_read_json_list(saved))}
    now = {row["path"]: row for row in data_fingerprint(cfg)}
    changed = [p for p in sorted(set(before) | set(now)) if not _same_file(before.get(p), now.get(p))]
    if not changed:
        return
    what = changed[0]
    old, new = before.get(what), now.get(what)
    if old is None or new is None:
        detail = "not in the run's data before" if old is None else "no longer in the run's data"
    elif old.get("bytes") != new.get("bytes"):
        detail = f"{old.get('bytes', 0):,d} bytes then, {new.get('bytes', 0):,d} now"
    else:
        detail = "same size, other content"
    if cfg.resume_on_new_data:
        log.warning("resuming on other token files than the run started with (%s: %s; resume_on_new_data)", what,
                    detail)
        saved.write_text(json.dumps(data_fingerprint(cfg), indent=1) + "\n")
        return
    raise RunError(f"the token files differ from the ones this run started with ({len(changed)} file(s); {what}: "
                   f"{detail}): restore them, or pass --resume_on_new_data to continue on the new data.")


def _read_json_list(path: Path) -> list:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [row for row in value if isinstance(row, dict)] if isinstance(value, list) else []
