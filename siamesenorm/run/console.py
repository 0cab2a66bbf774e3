"""What a training run prints: a few lines that say what runs, then one line per logged step; the same lines go
to ``console.log`` in the run folder.

OLMo's Trainer prints every metric on its own line and narrates its internals (evaluation batches, each part of a
checkpoint, data-order files); those narration lines are dropped from the console (``QuietOlmo``), while warnings
and errors from OLMo always pass.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from pathlib import Path
from typing import Dict, Optional

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

_FORMAT = "%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s"


def silence_known_warnings() -> None:
    """Warnings that our pins produce on every run and that no user can act on: OmegaConf 2.4's deprecation of
    ``register_new_resolver`` (called by ai2-olmo 0.6.0 at import) and OLMo's CUDA autocast on a CPU (OLMo always
    enters ``torch.autocast("cuda")``, which torch disables with a warning when there is no GPU)."""
    warnings.filterwarnings("ignore", message=r"register_new_resolver\(\) is deprecated")
    warnings.filterwarnings("ignore", message=r"CUDA is not available or torch_xla is imported\. Disabling autocast")


class QuietOlmo(logging.Filter):
    """Drops OLMo's INFO narration (``_OLMO_NARRATION``); everything else passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("olmo") or record.levelno > logging.INFO:
            return True
        message = record.getMessage()
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
