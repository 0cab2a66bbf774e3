"""One run's life, whichever framework trains it: the start, the record and the end, shared by both adapters.

Both training paths (siamesenorm/ai2_olmo/train.py, siamesenorm/olmo_core/train.py) go through the same steps here;
each framework only says how to build its trainer and how to read its progress.

* ``open_run``: every check before anything is written (values, the batch split over the processes, the token
  files), then the save folder is held (one run per folder, run/folder.py's lock), the rerun rule decided
  (``plan_run``: resume, restart, start over, load, or nothing to do), the MODEL_TYPE settled against the
  checkpoint's and the model compared with it, and the token files compared with the run's fingerprint on a resume.
* ``record_info`` / ``run_record``: the run record (run.json, run/records.py) with the same fields on both paths.
* ``train_to_the_end``: how a run ends, as its record's status and the exit status:

  ===========================  ===========  =================================================================
  how it ended                  status       exit status
  ===========================  ===========  =================================================================
  the last step                 finished     0
  stop_at before the last       stopped      0 (asked for)
  the divergence guard          diverged     3 (``EXIT_DIVERGED``; 0 under scripts/launch.py, which maps it)
  SIGTERM (preemption)          stopped      143 (128 + 15): ``Terminated`` reaches the command line
  SIGINT (Ctrl-C)               stopped      130: ``KeyboardInterrupt`` reaches the command line
  a full disk while saving      stopped      2, one line (``NoSpace``); the last good checkpoint resumes
  any other error               stopped      the error propagates (a traceback: a bug to report)
  ===========================  ===========  =================================================================

  A run stopped by SIGTERM saves a checkpoint first on both paths, so the rerun resumes where it stopped: OLMo-core
  when it is cancelled (SIGTERM, SIGINT); the ai2-olmo path (``stop_after_step_on_sigterm``) at the end of the step
  the signal arrives in, every rank at the same step, through OLMo 0.6.0's own cancel path (a second SIGTERM stops
  at once; Ctrl-C stops at once there, and its last periodic checkpoint resumes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import math
import os
import shutil
import signal
import threading
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np

from siamesenorm.models.config import validate_model_config
from siamesenorm.run.folder import (
    check_resume_model,
    check_same_data,
    hold_run_folder,
    plan_run,
    resolve_run_model_type,
)
from siamesenorm.run.recipe import RunError, check_batch_split, check_data, validate_run
from siamesenorm.run.records import RECORD_NAME, config_hash, recipe_hash, split_eval_metrics, variant_knobs
from siamesenorm.run.safeload import errors_within
from siamesenorm.run.stability import EXIT_DIVERGED, Diverged

log = logging.getLogger(__name__)

__all__ = ["Terminated", "raise_on_sigterm", "stop_after_step_on_sigterm", "NoSpace", "no_space_in", "Plan", "prepare", "open_run",
           "record_info", "run_record", "describe_run", "warmup_steps", "train_to_the_end", "QUIET_DIVERGENCE",
           "is_lead"]

#: Set by scripts/launch.py: a diverged run exits 0 (launch.py turns the record into the exit status).
QUIET_DIVERGENCE = "SIAMESENORM_DIVERGED_EXIT_0"


class Terminated(BaseException):
    """The process got SIGTERM (a scheduler's preemption, torchrun stopping its workers)."""

    def __init__(self, signum: int):
        super().__init__(f"killed by {signal.Signals(signum).name}")
        self.signum = signum


def _raise_terminated(signum, frame):
    raise Terminated(signum)


@contextlib.contextmanager
def raise_on_sigterm() -> Iterator[None]:
    """SIGTERM raises ``Terminated`` in the main thread while inside (for a framework with no handler of its own)."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def stop_after_step_on_sigterm(request: Callable[[], None]) -> Iterator[None]:
    """While inside (the main thread): the first SIGTERM calls ``request()`` and nothing else (the trainer finishes
    its step, saves a checkpoint and stops: a scheduler's grace period is spent saving, not lost), a second one
    raises ``Terminated`` at once, wherever the run is."""
    seen: List[int] = []

    def handler(signum, frame):
        if seen:
            raise Terminated(signum)
        seen.append(signum)
        request()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGTERM and SIGINT ignored while inside, in the main thread: a run already ending writes its record whole
    even when a second signal arrives (a launcher forwarding the SIGTERM its worker also got from its own parent's
    death, seen as a "running" record under load); the process ends right after anyway."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class NoSpace(RunError):
    """A checkpoint could not be written: the disk (or a quota, or a file-size limit) is full."""


def _is_no_space(err: BaseException) -> bool:
    if isinstance(err, OSError):
        return err.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
    text = str(err)  # torch's zip writer reports a failed write as a RuntimeError
    return any(s in text for s in ("file write failed", "failed writing", "No space left", "unexpected pos"))


def no_space_in(err: BaseException) -> Optional[BaseException]:
    """The full-disk error inside ``err`` (itself, or what it wraps: torch.distributed.checkpoint and OLMo-core
    wrap the writer's OSError), or None. The OSError itself when there is one (its message names the cause)."""
    found = [e for e in errors_within(err) if _is_no_space(e)]
    return next((e for e in found if isinstance(e, OSError)), found[0] if found else None)


def is_lead() -> bool:
    """Rank 0 of the launch (before any process group exists: torchrun's RANK)."""
    return os.environ.get("RANK", "0") == "0"


# ---- the start ------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Plan:
    """What a start does: the MODEL_TYPE (and where it came from), the checkpoint it loads, the action."""

    model_type: str
    source: str
    load_path: Optional[str]
    action: str  # "fresh", "restart", "overwrite", "resume", "load" or "done" (run/folder.py, plan_run)


def prepare(cfg, olmo_core: bool = False) -> Plan:
    """Every check of the config and the save folder before anything is written. The data: ``check_data``."""
    validate_run(cfg, olmo_core=olmo_core)
    load_path, action = plan_run(cfg)
    model_type, source = resolve_run_model_type(cfg, load_path)
    validate_model_config(cfg.model, model_type)
    cfg.model.model_type = model_type
    if load_path is not None and "://" not in load_path:
        check_resume_model(cfg, load_path)
    return Plan(model_type, source, load_path, action)


@contextlib.contextmanager
def open_run(cfg, world_size: int, olmo_core: bool = False,
             before_lock: Optional[Callable[[], None]] = None) -> Iterator[Plan]:
    """The checks a start makes, in the order that writes nothing until all pass (module docstring), while holding
    the save folder (rank 0 holds it; the other ranks follow). Yields the Plan; for ``done`` the caller says so
    and returns (``say_done``). ``before_lock``: rank 0's warnings once the values are known to be valid."""
    validate_run(cfg, olmo_core=olmo_core)  # a bad value is refused before the folder is even locked
    check_batch_split(cfg, world_size)  # before any process group or model
    check_data(cfg)  # the data do not depend on the folder: a missing file is said before the folder is touched
    if before_lock is not None and is_lead():
        before_lock()
    with hold_run_folder(cfg.save_folder) if is_lead() else contextlib.nullcontext():
        plan = prepare(cfg, olmo_core=olmo_core)
        if plan.action == "resume":
            check_same_data(cfg)
        yield plan


def say_done(cfg, plan: Plan) -> None:
    log.info("%s already finished: its checkpoint %s is at the last step of max_duration=%s; nothing to do "
             "(pass a larger --max_duration to continue it, or --save_overwrite to train it again)",
             cfg.save_folder, Path(plan.load_path or "").name, cfg.max_duration)


def warmup_steps(cfg) -> int:
    """The scheduler's warmup in optimizer steps (OLMo counts it in steps or in tokens)."""
    warmup = float(cfg.scheduler.t_warmup)
    if str(getattr(cfg.scheduler.units, "value", cfg.scheduler.units)) == "tokens":
        warmup /= cfg.global_train_batch_size * cfg.model.max_sequence_length
    return int(math.ceil(warmup))


def describe_run(cfg, plan: Plan, n_params: int, console_log: Path, framework: str) -> List[str]:
    """The lines a run prints once before its first step: what trains, on what, and where its files go."""
    how = {"default": "the default; set MODEL_TYPE=... to choose"}.get(plan.source, f"from {plan.source}")
    tokens_per_step = cfg.global_train_batch_size * cfg.model.max_sequence_length
    folder = Path(cfg.save_folder)
    start = {"resume": f"resuming from {plan.load_path}",
             "load": f"starting from the weights in {plan.load_path}"}.get(plan.action, "starting from step 0")
    paths = [str(p) for p in (cfg.data.paths or [])] + [
        str(p) for group in (cfg.data.datasets or {}).values() for p in group]
    data = f"{len(paths)} token file(s)"
    if paths and all("://" not in p for p in paths):
        tokens = sum(os.path.getsize(p) for p in paths) // np.dtype(str(cfg.data.memmap_dtype)).itemsize
        data += f" in {os.path.commonpath(paths) if len(paths) > 1 else paths[0]} ({tokens:,d} tokens)"
    duration = str(cfg.max_duration)
    duration = f"{duration} steps" if duration.isdigit() else duration
    return [
        f"MODEL_TYPE={plan.model_type} ({how}); {n_params:,d} parameters; {cfg.model.n_layers} layers x d_model "
        f"{cfg.model.d_model}; trained by {framework}",
        f"data: {data}; {tokens_per_step:,d} tokens a step; {duration}, {start}",
        f"run folder: {folder} (config.yaml, {RECORD_NAME}, metrics.jsonl, {console_log.name}, checkpoints)",
    ]


# ---- the record -----------------------------------------------------------------------------------------------------
def record_info(cfg, config_path: str, plan: Plan, n_params: int, monitor, world_size: int,
                framework: str) -> Dict[str, Any]:
    """What a run record says about the run itself (``run_record`` adds its progress and results)."""
    return {
        "run_name": cfg.run_name,
        "config": str(config_path),
        "save_folder": str(cfg.save_folder),
        "framework": framework,
        "model_type": plan.model_type,
        "model_type_source": plan.source,
        "variant_knobs": variant_knobs(cfg.model, plan.model_type),
        "config_hash": config_hash(cfg),
        "recipe_hash": recipe_hash(cfg),
        "seed": cfg.seed,
        "learning_rate": float(cfg.optimizer.learning_rate),
        "max_duration": str(cfg.max_duration),
        "parameters": n_params,
        "world_size": world_size,
        "stability": {  # the settings in force, defaults resolved
            **dataclasses.asdict(cfg.stability),
            "max_loss": monitor.max_loss,
            "grace_steps": monitor.grace_steps,
            "unigram_loss": monitor.unigram_loss,
            "converge_steps": monitor.converge_steps,
        },
    }


def run_record(info: Optional[Dict[str, Any]], status: str, *, step: int, tokens_seen: int, max_steps: int,
               tokens_per_batch: int, loss: Optional[float], monitor, eval_metrics: Dict[str, float],
               eval_step: Optional[int], **extra: Any) -> Dict[str, Any]:
    """The run record (run.json) at this point of the run: the fixed facts, the status and the progress."""
    perplexity, downstream = split_eval_metrics(eval_metrics)
    record = {
        **(info or {}),
        "status": status,
        "step": step,
        "tokens_seen": tokens_seen,
        "max_steps": max_steps,
        "token_budget": max_steps * tokens_per_batch,
        "final_train_loss": loss if loss is not None and math.isfinite(loss) else None,
        "loss_spikes": monitor.spike_count if monitor else 0,
        "spikes": monitor.spikes if monitor else [],
        "grad_spikes": monitor.grad_spikes if monitor else [],
        "perplexity": perplexity,
        "val_perplexity": next(iter(perplexity.values()), None),
        "downstream": downstream,
        "eval_step": eval_step,
    }
    record.update(extra)
    return record


def resumed_attempts(previous: Dict[str, Any], step: int) -> List[Dict[str, Any]]:
    """The record's ``attempts`` after a resume at ``step``: the earlier ones and this one."""
    return previous.get("attempts", []) + [
        {"resumed_at_step": step, "previous_status": previous.get("status"), "previous_error": previous.get("error")}]


# ---- the end --------------------------------------------------------------------------------------------------------
def train_to_the_end(fit: Callable[[], None], save_record: Callable[..., None], finished: Callable[[], bool],
                     convergence: Callable[[], Dict[str, Any]], record_path: Path, lead: bool) -> int:
    """Run ``fit`` and turn how it ended into the record's status and the exit status (module docstring's table).
    ``save_record(status, **extra)`` writes run.json (rank 0 only inside); ``finished()``: the last step was
    reached."""
    save_record("running")
    try:
        fit()
    except Diverged as diverged:
        save_record("diverged", diverged_at_step=diverged.step, divergence=diverged.reason,
                    divergence_kind=diverged.kind)
        if lead:
            log.warning("diverged at step %d: %s; record: %s", diverged.step, diverged.reason, record_path)
        # under scripts/launch.py the workers end normally and launch.py turns the record into the exit status,
        # so torchrun does not print a worker-failure report for an outcome that is a result
        return 0 if os.environ.get(QUIET_DIVERGENCE) == "1" else EXIT_DIVERGED
    except BaseException as err:  # an error, an interrupt or a signal: the record says the run ended early
        full = err if isinstance(err, NoSpace) else no_space_in(err)
        if full is None:
            with _signals_held():
                save_record("stopped", error=f"{type(err).__name__}: {err}"[:500])
            raise
        folder = Path(record_path).parent
        message = str(err) if isinstance(err, NoSpace) else (
            f"no space left while saving a checkpoint in {folder} ({str(full).splitlines()[0][:120]}); the last "
            "good checkpoint stays: free space and rerun the same command to resume from it")
        if lead:
            for partial in folder.glob("step*-tmp"):  # the half-written checkpoint: the last good one resumes
                shutil.rmtree(partial, ignore_errors=True)
        try:
            with _signals_held():
                save_record("stopped", error=message[:500])
        except OSError:  # the record cannot be written either; the line below still says what happened
            pass
        raise RunError(message) from None
    save_record("finished" if finished() else "stopped", **convergence())
    return 0
