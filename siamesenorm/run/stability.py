"""Training stability: the divergence guard and the loss-spike counter (their verdicts land in the run record,
siamesenorm/run/records.py).

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
    ignores its context (siamesenorm.ai2_olmo.train computes it from the token files when the config leaves it None), so
    the rule catches a run stuck on the unigram plateau although its loss stays under ``max_loss``.
A stopped run writes its record with status ``diverged`` (``divergence_kind`` says which rule: ``diverged`` or
``not_converged``; the paper's "diverge" covers both) and every rank exits with EXIT_DIVERGED.

The loss-spike rule (the paper's "*"): losses of the grace period never enter the baseline. After it, once
``spike_window`` losses have been seen, step t starts a spike when loss_t > spike_factor * median(the last
spike_window losses before t). Consecutive steps above the threshold are one spike; a spike ends at the first
step back below it. Spike steps do not enter the window, so one long excursion does not raise its own baseline.
Gradient-norm spikes follow the same rule on the gradient norm with ``grad_spike_factor`` (5): counted and
recorded (``grad_spikes``), not marked in the table (the paper's "*" is about the loss).

The guard's state (its windows, counter and open spike) is part of the trainer state a checkpoint keeps
(``StabilityMonitor.state_dict``), so a resumed run takes the decisions the uninterrupted one would have.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional

__all__ = ["EXIT_DIVERGED", "StabilityConfig", "stability_problem", "Diverged", "StabilityMonitor"]

#: Exit status of scripts/train.py (every rank) when the divergence guard stops a run. 1 is any crash, 2 a config
#: error. torchrun itself exits 1 whenever a worker fails; scripts/launch.py maps the record back to this code.
EXIT_DIVERGED = 3


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
