"""What a training run prints, on either path: a few lines that say what runs, then one line per logged step, then
a closing summary; the same lines go to ``console.log`` in the run folder.

OLMo's Trainer prints every metric on its own line and narrates its internals (evaluation batches, each part of a
checkpoint, data-order files); OLMo-core's narrates its set-up (about 270 lines: the model, the data, each
callback). Those narration lines are dropped from the console (``QuietOlmo``), while warnings and errors from
either framework always pass, and so do the few OLMo-core INFO lines a user acts on (``_CORE_KEPT``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import warnings
from pathlib import Path
from typing import Dict, Iterator, Optional

CONSOLE_LOG = "console.log"

#: OLMo INFO messages that narrate internals; dropped from the console and the console log.
_OLMO_NARRATION = (
    "[eval_step=",
    "Running evaluation for",
    "Saving global data order indices",
    "Global data order indices saved",
    "Initializing model parameters",
    "Saving model state",
    "Saving optim state",
    "Saving trainer state",
    "Saving config",
    "Loading model state",
    "Loading optimizer state",
    "Loading trainer state",
    "Saving final unsharded model checkpoint",
    "Saving final checkpoint",
    "Saving unsharded checkpoint",
    "Saving sharded checkpoint",
)

#: OLMo-core warnings that say nothing a user can act on: its set-up reporting that it kept the one thread we
#: pinned (naming the 8 it would have set), and a fresh start having no checkpoint to load.
_CORE_NOISE = (
    "Will skip setting env var 'OMP_NUM_THREADS'",
    "No checkpoint found in save folder",
    "Training failed due to",  # the error itself reaches the command, which says it once (one line or a traceback)
)
#: OLMo-core INFO messages that pass; its other INFO lines are narration.
_CORE_KEPT = (
    "Loading checkpoint from",
    "Saving checkpoint for step",
    "Run canceled",
    "Training for",
)

_FORMAT = "%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s"


def silence_known_warnings() -> None:
    """Warnings that our pins produce on every run and that no user can act on: OmegaConf 2.4's deprecation of
    ``register_new_resolver`` (called by ai2-olmo 0.6.0 at import) and OLMo's CUDA autocast on a CPU (OLMo always
    enters ``torch.autocast("cuda")``, which torch disables with a warning when there is no GPU)."""
    warnings.filterwarnings("ignore", message=r"register_new_resolver\(\) is deprecated")
    warnings.filterwarnings("ignore", message=r"CUDA is not available or torch_xla is imported\. Disabling autocast")
    # torch.distributed.checkpoint saving from one process without a process group (OLMo-core on one CPU)
    warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")


class QuietOlmo(logging.Filter):
    """Drops OLMo's INFO narration (``_OLMO_NARRATION``), OLMo-core's INFO lines but ``_CORE_KEPT`` and its
    ``_CORE_NOISE``; everything else passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("olmo"):
            return True
        message = record.getMessage()
        if record.name.startswith("olmo_core") and message.startswith(_CORE_NOISE):
            return False
        if record.levelno > logging.INFO:
            return True
        if record.name.startswith("olmo_core"):
            return message.startswith(_CORE_KEPT)
        return not message.startswith(_OLMO_NARRATION)


def setup_logging() -> None:
    """Console logging for a command: INFO on rank 0, warnings on the other ranks, OLMo's narration dropped."""
    rank = int(os.environ.get("RANK", "0"))
    silence_known_warnings()
    logging.captureWarnings(True)  # a warning that does reach the console also reaches console.log
    root = logging.getLogger()
    if not any(isinstance(f, QuietOlmo) for h in root.handlers for f in h.filters):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT.format(rank=rank)))
        handler.addFilter(QuietOlmo())
        root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    # datasets announces at import which torch it found (INFO); OLMo imports it, now after this setup
    logging.getLogger("datasets").setLevel(logging.WARNING)


@contextlib.contextmanager
def keep_our_console() -> Iterator[None]:
    """OLMo-core's environment set-up replaces the root logger's handlers with its own (``basicConfig(force=True)``,
    a line per record with host and rank): put ours back, with our format and ``QuietOlmo``."""
    root = logging.getLogger()
    before = list(root.handlers)
    try:
        yield
    finally:
        for handler in list(root.handlers):
            if handler not in before:
                root.removeHandler(handler)
        for handler in before:
            if handler not in root.handlers:
                root.addHandler(handler)
        setup_logging()


def attach_run_log(folder: Path) -> Path:
    """Append every console line of this process from now on to ``folder/console.log`` (a resumed run appends;
    ranks other than 0 write ``console-rank{N}.log``, warnings only) until ``detach_run_logs``. Returns the file."""
    rank = int(os.environ.get("RANK", "0"))
    path = Path(folder) / (CONSOLE_LOG if rank == 0 else f"console-rank{rank}.log")
    detach_run_logs()
    handler = logging.FileHandler(path, mode="a")
    handler.setFormatter(logging.Formatter(_FORMAT.format(rank=rank)))
    handler.addFilter(QuietOlmo())
    handler.siamesenorm_run_log = True  # type: ignore[attr-defined]
    logging.getLogger().addHandler(handler)
    return path


def detach_run_logs() -> None:
    """Stop copying the console to a run folder (the run ended; the next run in this process gets its own)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "siamesenorm_run_log", False):
            root.removeHandler(h)
            h.close()


def _num(value: Optional[float], digits: int = 4) -> str:
    if value is None:
        return "-"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}f}"


def duration(seconds: float) -> str:
    """1:02:03 style (hours:minutes:seconds), days spelled out past 48 hours."""
    seconds = int(round(seconds))
    if seconds >= 48 * 3600:
        return f"{seconds / 86400:.1f} days"
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def step_line(step: int, max_steps: int, metrics: Dict[str, float], elapsed: Optional[float] = None,
              eta: Optional[float] = None) -> str:
    """One line for a logged training step: loss, gradient norm, learning rate, throughput, spike counts, time
    since this process started training and the estimated time to the last step."""
    parts = [f"step {step}/{max_steps}", f"loss {_num(metrics.get('train/CrossEntropyLoss'))}"]
    if "optim/total_grad_norm" in metrics:
        parts.append(f"grad_norm {_num(metrics['optim/total_grad_norm'], 3)}")
    lr = metrics.get("optim/learning_rate_group0")
    if lr is not None:
        parts.append(f"lr {lr:.2e}")
    tps = metrics.get("throughput/device/tokens_per_second")
    if tps is not None:
        parts.append(f"{tps:,.0f} tok/s")
    spikes = [f"{kind} {int(metrics[key])}" for kind, key in (("loss", "stability/loss_spikes"),
                                                              ("grad", "stability/grad_spikes")) if key in metrics]
    if spikes and any(not s.endswith(" 0") for s in spikes):
        parts.append("spikes " + ", ".join(spikes))
    if elapsed is not None:
        parts.append(f"{duration(elapsed)} elapsed" + (f", eta {duration(eta)}" if eta is not None else ""))
    return " | ".join(parts)


def eval_line(label: str, step: int, metrics: Dict[str, float]) -> str:
    """One line for an evaluator's result: each metric's short name and value."""
    shown = []
    for key, value in metrics.items():
        name = key.split("/")[-1]
        shown.append(f"{name} {_num(float(value), 2 if 'Perplexity' in name else 4)}")
    return f"eval {label} at step {step}: " + " | ".join(shown)


def closing_line(loss: Optional[float], eval_metrics: Dict[str, float], step: int, max_steps: int,
                 record: Path) -> str:
    """The run's last line: its final training loss, each evaluator's perplexity, where it stopped, its record."""
    parts = [f"final training loss: {_num(loss)}"]
    for key, value in eval_metrics.items():
        if key.endswith("/Perplexity"):
            parts.append(f"{key.split('/')[1]} perplexity: {value:.2f}")
    parts.append(f"step {step} of {max_steps}" + ("" if step >= max_steps else " (stopped early)"))
    parts.append(f"record: {record}")
    return " | ".join(parts)
