"""Training stability (divergence guard, loss-spike counter) and the per-run record that make_tables reads.

The divergence guard, checked after every optimizer step on the global loss and gradient norm:
  * a non-finite loss or gradient norm stops the run at that step (Adam's state is poisoned; it cannot recover);
  * after ``grace_steps`` (default: the scheduler's warmup), a loss above ``max_loss`` (default ln(vocab_size), the
    loss of a uniform guess) for ``patience`` consecutive steps stops the run at the last of them;
  * failure to converge: a run converged when the mean loss of its last ``converge_window`` (20) steps is below
    ``unigram_loss - converge_margin`` (0.1 nats). By default this is judged at the end of the budget: the run
    finishes, and its record says ``converged: false`` (make_tables prints "diverge", as the paper marks runs
    that failed to converge). With ``converge_steps`` set, it is judged at that step and a run that has not
    converged stops there (status ``diverged``, ``divergence_kind: not_converged``): that saves compute on dead
    runs but can cut off a run that leaves the plateau late (the tiny recipe's SiameseNorm at lr 0.1 sat at loss
    6.20 for 100 steps, then reached 5.0; docs/training.md).
    ``unigram_loss`` is the entropy (nats) of the training data's token frequencies, the loss of a model that
    ignores its context (siamesenorm.train computes it from the token files when the config leaves it None), so
    the rule catches a run stuck on the unigram plateau although its loss stays under ``max_loss``.
A stopped run writes its record with status ``diverged`` (``divergence_kind`` says which rule: ``diverged`` or
``not_converged``; the paper's "diverge" covers both) and every rank exits with EXIT_DIVERGED.

The loss-spike rule (the paper's "*"): losses of the grace period never enter the baseline. After it, once
``spike_window`` losses have been seen, step t starts a spike when loss_t > spike_factor * median(the last
spike_window losses before t). Consecutive steps above the threshold are one spike; a spike ends at the first
step back below it. Spike steps do not enter the window, so one long excursion does not raise its own baseline.
Gradient-norm spikes follow the same rule on the gradient norm with ``grad_spike_factor`` (5): counted and
recorded (``grad_spikes``), not marked in the table (the paper's "*" is about the loss).

The run record, ``{save_folder}/run.json``, is written when training starts (status ``running``), rewritten at
every evaluation and at the end: ``finished`` (the token budget was reached), ``diverged`` or ``stopped`` (ended
earlier: stop_at, cancellation, an error or an interrupt).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Deque, Dict, List, Optional

__all__ = [
    "EXIT_DIVERGED",
    "RECORD_NAME",
    "StabilityConfig",
    "StabilityMonitor",
    "Diverged",
    "config_hash",
    "recipe_hash",
    "write_record",
    "read_record",
    "DOWNSTREAM_LABELS",
]

#: Exit status of scripts/train.py (every rank) when the divergence guard stops a run. 1 is any crash, 2 a config
#: error. torchrun itself exits 1 whenever a worker fails; scripts/launch.py maps the record back to this code.
EXIT_DIVERGED = 3
RECORD_NAME = "run.json"
RECORD_VERSION = 1

#: OLMo downstream evaluator labels of the paper's Table 1, in its column order.
DOWNSTREAM_LABELS = (
    "arc_easy",
    "arc_challenge",
    "hellaswag",
    "piqa",
    "winogrande",
    "openbook_qa",
    "basic_arithmetic",
)


@dataclass
class StabilityConfig:
    """``stability:`` in a training config. Defaults are for LM pretraining; the rule is in the module docstring."""

    enabled: bool = True
    max_loss: Optional[float] = None
    """Loss bound after grace_steps; None = ln(model.vocab_size)."""
    grace_steps: Optional[int] = None
    """Steps before the loss bound and the spike rule apply; None = scheduler.t_warmup."""
    patience: int = 10
    """Consecutive steps above max_loss that stop the run (non-finite values stop it at once)."""
    spike_window: int = 50
    spike_factor: float = 1.2
    grad_spike_factor: float = 5.0
    """A gradient-norm spike: above this factor times the median of the last spike_window gradient norms."""
    unigram_loss: Optional[float] = None
    """The training data's unigram entropy in nats; None = computed from the token files at start."""
    converge_steps: Optional[int] = None
    """Stop a run that has not converged at this step; None = judge at the end without stopping; 0 = never judge."""
    converge_margin: float = 0.1
    converge_window: int = 20


def stability_problem(cfg: StabilityConfig) -> Optional[str]:
    """The first setting of ``stability:`` the rules cannot run with, as one sentence; None when all are valid."""
    for name, value, ok, rule in (
        ("patience", cfg.patience, cfg.patience >= 1, ">= 1"),
        ("spike_window", cfg.spike_window, cfg.spike_window >= 1, ">= 1"),
        ("spike_factor", cfg.spike_factor, cfg.spike_factor > 1.0, "> 1"),
        ("grad_spike_factor", cfg.grad_spike_factor, cfg.grad_spike_factor > 1.0, "> 1"),
        ("converge_window", cfg.converge_window, cfg.converge_window >= 1, ">= 1"),
    ):
        if not ok:
            return f"stability.{name} must be {rule} (got {value})."
    return None


class Diverged(RuntimeError):
    def __init__(self, step: int, reason: str, kind: str = "diverged"):
        super().__init__(f"divergence at step {step}: {reason}")
        self.step, self.reason, self.kind = step, reason, kind


class StabilityMonitor:
    """Pure bookkeeping: feed it (step, loss, grad_norm) after each step; it raises Diverged and counts spikes.
    Every rank feeds it the same values, so every rank takes the same decision."""

    def __init__(self, cfg: StabilityConfig, vocab_size: int, warmup_steps: int,
                 unigram_loss: Optional[float] = None):
        problem = stability_problem(cfg)
        if problem:
            raise ValueError(problem)
        self.cfg = cfg
        self.max_loss = cfg.max_loss if cfg.max_loss is not None else math.log(vocab_size)
        self.grace_steps = cfg.grace_steps if cfg.grace_steps is not None else warmup_steps
        self.unigram_loss = cfg.unigram_loss if cfg.unigram_loss is not None else unigram_loss
        self.converge_steps = cfg.converge_steps  # None: judged at the end by convergence(), without stopping
        self.window: Deque[float] = deque(maxlen=cfg.spike_window)
        self.grad_window: Deque[float] = deque(maxlen=cfg.spike_window)
        self.recent: Deque[float] = deque(maxlen=cfg.converge_window)
        self.above_bound = 0
        self.in_spike = False
        self.in_grad_spike = False
        self.spikes: List[Dict[str, float]] = []
        self.grad_spikes: List[Dict[str, float]] = []

    @property
    def spike_count(self) -> int:
        return len(self.spikes)

    def restore(self, spikes: List[Dict[str, float]], grad_spikes: Optional[List[Dict[str, float]]] = None) -> None:
        """Continue the spike counts of a resumed run whose checkpoint predates ``state_dict`` (from its run
        record; the windows start empty)."""
        self.spikes = list(spikes)
        self.grad_spikes = list(grad_spikes or [])

    #: The state a checkpoint keeps (the trainer state's ``stability``): windows, counters and the spikes so far.
    _WINDOWS = ("window", "grad_window", "recent")
    _FLAGS = ("in_spike", "in_grad_spike")

    def state_dict(self) -> Dict[str, Any]:
        """Everything the rule has seen, as plain lists and numbers: a resumed run takes the same decisions as
        the uninterrupted one would have (its windows, its consecutive-steps counter, an open spike)."""
        return {**{name: list(getattr(self, name)) for name in self._WINDOWS},
                **{name: bool(getattr(self, name)) for name in self._FLAGS},
                "above_bound": int(self.above_bound),
                "spikes": [dict(s) for s in self.spikes], "grad_spikes": [dict(s) for s in self.grad_spikes]}

    def load_state_dict(self, state: Any) -> bool:
        """Take a checkpoint's ``state_dict``; a malformed one (a checkpoint is untrusted) is ignored: False."""
        def numbers(values, limit=None):
            ok = isinstance(values, list) and all(isinstance(v, (int, float)) for v in values)
            return ok and (limit is None or len(values) <= limit)

        def spike_list(values):
            return isinstance(values, list) and all(
                isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, (int, float)) for k, x in v.items())
                for v in values)

        windows_ok = isinstance(state, dict) and all(numbers(state.get(name), getattr(self, name).maxlen)
                                                     for name in self._WINDOWS)
        if not (windows_ok and all(isinstance(state.get(f), bool) for f in self._FLAGS)
                and isinstance(state.get("above_bound"), int)
                and spike_list(state.get("spikes")) and spike_list(state.get("grad_spikes"))):
            return False
        for name in self._WINDOWS:
            getattr(self, name).clear()
            getattr(self, name).extend(float(v) for v in state[name])
        for name in self._FLAGS:
            setattr(self, name, state[name])
        self.above_bound = state["above_bound"]
        self.spikes, self.grad_spikes = list(state["spikes"]), list(state["grad_spikes"])
        return True

    def update(self, step: int, loss: float, grad_norm: Optional[float]) -> None:
        if not self.cfg.enabled:
            return
        if not math.isfinite(loss):
            raise Diverged(step, f"non-finite loss ({loss})")
        if grad_norm is not None and not math.isfinite(grad_norm):
            raise Diverged(step, f"non-finite gradient norm ({grad_norm})")
        self.recent.append(loss)
        self._check_convergence(step)
        if step <= self.grace_steps:
            return
        self.above_bound = self.above_bound + 1 if loss > self.max_loss else 0
        if self.above_bound >= self.cfg.patience:
            raise Diverged(
                step, f"loss {loss:.4f} above the bound {self.max_loss:.4f} for {self.above_bound} consecutive steps"
            )
        self.in_spike = self._spike(step, loss, self.window, self.cfg.spike_factor, self.spikes, self.in_spike,
                                    "loss")
        if grad_norm is not None:
            self.in_grad_spike = self._spike(step, grad_norm, self.grad_window, self.cfg.grad_spike_factor,
                                             self.grad_spikes, self.in_grad_spike, "grad_norm")

    def convergence(self) -> Dict[str, Any]:
        """Whether the recent losses are below the unigram level (None when it is unknown or nothing was seen)."""
        if self.unigram_loss is None or not self.recent or self.converge_steps == 0:
            return {"converged": None}
        mean = sum(self.recent) / len(self.recent)
        return {"converged": mean < self.unigram_loss - self.cfg.converge_margin, "final_mean_loss": mean,
                "unigram_loss": self.unigram_loss, "window": len(self.recent)}

    def _check_convergence(self, step: int) -> None:
        if not self.converge_steps or step != self.converge_steps:
            return
        verdict = self.convergence()
        if verdict["converged"] is False:
            raise Diverged(
                step,
                f"failed to converge: mean loss {verdict['final_mean_loss']:.4f} over the last {verdict['window']} "
                f"steps is not below the training data's unigram loss {self.unigram_loss:.4f} minus "
                f"{self.cfg.converge_margin}",
                kind="not_converged",
            )

    def _spike(self, step, value, window, factor, found, in_spike, name) -> bool:
        """One step of the spike rule on ``value``; returns whether a spike is in progress."""
        if len(window) < window.maxlen:
            window.append(value)
            return False
        baseline = statistics.median(window)
        if value > factor * baseline:
            if not in_spike:
                found.append({"step": step, name: value, "baseline": baseline})
            return True
        window.append(value)
        return False


# ---- the run record ---------------------------------------------------------------------------------------------
#: SiameseModelConfig's own fields (model_type and the variant knobs) pick the cell, not the recipe; so does the
#: initialisation, which the paper chose per method (the OLMo-1B-hybrid-* recipes differ from OLMo-1B-* only there).
#: (A function: the configs import OLMo, which this module leaves to the commands that need it.)
@functools.lru_cache(maxsize=1)
def _variant_fields() -> frozenset:
    from olmo.config import ModelConfig

    from .config import SiameseModelConfig

    return frozenset({f.name for f in dataclasses.fields(SiameseModelConfig)} - {
        f.name for f in dataclasses.fields(ModelConfig)} | {"precision", "init_device", "init_fn", "init_std",
                                                           "init_cutoff_factor"})
#: Config fields that name, place or schedule a run without changing what is trained: left out of config_hash.
_NOT_HASHED = (
    "run_name",
    "save_folder",
    "remote_save_folder",
    "save_overwrite",
    "load_path",
    "try_load_latest_save",
    "stop_at",
    "stop_after",
    "wandb",
    "metrics_file",
    "console_log_interval",
    "save_interval",
    "save_interval_unsharded",
    "save_interval_ephemeral",
    "save_num_checkpoints_to_keep",
    "save_num_unsharded_checkpoints_to_keep",
    "dry_run",
)


#: What else varies between the cells of one sweep: left out of recipe_hash, so the cells of one recipe share it.
_CELL_FIELDS = ("seed", "optimizer", "model")


def recipe_hash(cfg) -> str:
    """sha256 (first 12 hex digits) of the config without what varies between the cells of a sweep (seed, learning
    rate, MODEL_TYPE and its knobs): runs of one recipe share it, runs of different recipes never do."""
    values = cfg.asdict(exclude=list(_NOT_HASHED) + list(_CELL_FIELDS))
    optimizer = {k: v for k, v in cfg.asdict()["optimizer"].items() if k != "learning_rate"}
    model = {k: v for k, v in cfg.asdict()["model"].items() if k not in _variant_fields()}
    text = json.dumps({**values, "optimizer": optimizer, "model": model}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def config_hash(cfg) -> str:
    """sha256 (first 16 hex digits) of the resolved config, model_type included, without the fields above."""
    values = cfg.asdict(exclude=list(_NOT_HASHED))
    text = json.dumps(values, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def variant_knobs(model_cfg, model_type: Optional[str] = None) -> Dict[str, Any]:
    """The variant knobs of SiameseModelConfig that differ from their defaults (ablations such as no depth
    scaling); with ``model_type``, only the knobs that type reads."""
    from olmo.config import ModelConfig

    from .config import KNOB_OWNERS, SiameseModelConfig

    own = {f.name: f for f in dataclasses.fields(SiameseModelConfig)}
    olmo = {f.name for f in dataclasses.fields(ModelConfig)}
    return {
        name: getattr(model_cfg, name)
        for name, f in own.items()
        if name not in olmo and name != "model_type" and getattr(model_cfg, name) != f.default
        and (model_type is None or model_type in KNOB_OWNERS.get(name, (model_type,)))
    }


#: OLMo's downstream metrics that are accuracies (ICLMetric's metric_type); ce_loss and bpb are not.
_ACCURACY_METRICS = ("len_norm", "pmi_dc", "acc", "f1")


def split_eval_metrics(metrics: Dict[str, float]) -> tuple[Dict[str, float], Dict[str, float]]:
    """OLMo's eval metric names -> ({lm label: perplexity}, {downstream label: accuracy in [0, 1]})."""
    perplexity, downstream = {}, {}
    for key, value in metrics.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "eval" and parts[2] == "Perplexity":
            perplexity[parts[1]] = float(value)
        elif len(parts) == 3 and parts[:2] == ["eval", "downstream"]:
            # "<task>_<metric>", the metric being one of OLMo's accuracy-like ICL metrics (len_norm has a "_")
            metric = next((m for m in _ACCURACY_METRICS if parts[2].endswith("_" + m)), None)
            if metric and len(parts[2]) > len(metric) + 1:
                downstream[parts[2][: -len(metric) - 1]] = float(value)
    return perplexity, downstream


def write_record(folder: str | Path, record: Dict[str, Any]) -> Path:
    """Atomically (temporary file, then rename) write ``run.json`` in ``folder``."""
    path = Path(folder) / RECORD_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{RECORD_NAME}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**record, "version": RECORD_VERSION, "updated": time.time()}, indent=2) + "\n")
    tmp.replace(path)
    return path


def read_record(path: str | Path) -> Dict[str, Any]:
    """A run record from a run.json file or the run folder holding one."""
    path = Path(path)
    if path.is_dir():
        path = path / RECORD_NAME
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no run record (runs write {RECORD_NAME} into their save_folder).") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a JSON run record ({e}).") from None
    missing = [k for k in ("model_type", "learning_rate", "status") if k not in record]
    if missing:
        raise ValueError(f"{path}: run record lacks {', '.join(missing)}.")
    record.setdefault("path", str(path))
    saved_config = path.parent / "config.yaml"
    if "recipe_hash" not in record and saved_config.is_file():  # a record written before recipe_hash existed
        from .checkpoints import load_saved_config

        cfg = load_saved_config(saved_config)
        record["recipe_hash"] = recipe_hash(cfg)
        record.setdefault("seed", cfg.seed)
    return record
