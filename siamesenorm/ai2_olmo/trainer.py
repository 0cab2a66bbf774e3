"""OLMo's Trainer with what this project adds, and the pieces around it: process group, model wrapping, optimizer.

``SiameseTrainer`` keeps OLMo's training step and adds: one all-reduce of the loss so every rank runs the
divergence guard on the same number, a metrics file, the run record, CPU-safe RNG state, and a close that works
with the pinned wandb.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import random
import shutil
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from olmo import optim as olmo_optim
from olmo.config import DistributedStrategy, OptimizerType, ShardedCheckpointerType
from olmo.model import LayerNormBase, OLMoBlock
from olmo.optim import AdamW, LionW
from olmo.torch_util import get_global_rank
from olmo.train import Trainer
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.nn.parallel import DistributedDataParallel as DDP

from siamesenorm.nn.loss import chunked_cross_entropy_loss
from siamesenorm.run.console import eval_line, step_line
from siamesenorm.run.lifecycle import NoSpace, no_space_in, run_record
from siamesenorm.run.process import allow_recompiles, pin_cpu_threads
from siamesenorm.run.recipe import RunError, SiameseTrainConfig
from siamesenorm.run.records import write_record
from siamesenorm.run.stability import Diverged, StabilityMonitor
from siamesenorm.variants.prores import set_training_step

log = logging.getLogger(__name__)

__all__ = ["SiameseTrainer", "init_distributed", "cpu_adjustments", "wrap_model", "optimizer_param_groups",
           "build_optimizer_with_coefficients", "compile_blocks"]


@dataclass
class SiameseTrainer(Trainer):
    """OLMo's Trainer plus a metrics file, the divergence guard, the run record; CPU-safe RNG state. The guard's
    state is part of the trainer state a checkpoint keeps (``stability``), so a resumed run continues it."""

    monitor: Optional[StabilityMonitor] = None
    record_info: Optional[Dict[str, Any]] = None  # the run's fixed facts; None: no run record (unit tests)
    last_eval_metrics: Dict[str, float] = field(default_factory=dict)
    last_train_metrics: Dict[str, float] = field(default_factory=dict)
    last_eval_step: Optional[int] = None
    #: Whether the last restored checkpoint carried the guard's state (older checkpoints do not).
    restored_stability: bool = False
    #: This process got SIGTERM (set by the handler: siamesenorm.run.lifecycle.stop_after_step_on_sigterm).
    sigterm_received: bool = False
    #: Some rank got SIGTERM: every rank saves a checkpoint after this step and stops (the same step on all).
    stop_requested: bool = False
    _cancel_interval: Optional[int] = None

    def __post_init__(self):
        super().__post_init__()
        chunk = getattr(self.cfg, "loss_chunk_tokens", None)
        if chunk:
            self.loss_fn = functools.partial(chunked_cross_entropy_loss, chunk_tokens=int(chunk))

    # ---- checkpoints ---------------------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint_type=None):
        """OLMo's save; a full disk (or a file-size limit) becomes NoSpace, with the half-written folder removed so
        the last good checkpoint is what a rerun resumes."""
        try:
            return super().save_checkpoint(*(() if checkpoint_type is None else (checkpoint_type,)))
        except (OSError, RuntimeError) as err:
            if no_space_in(err) is None:
                raise
            for partial in Path(self.cfg.save_folder).glob("step*-tmp"):
                shutil.rmtree(partial, ignore_errors=True)
            raise NoSpace(f"no space left while saving the checkpoint of step {self.global_step} in "
                          f"{self.cfg.save_folder} ({str(err).splitlines()[0][:120]}); the last good checkpoint "
                          "stays: free space and rerun the same command to resume from it") from None

    def trainer_state_dict(self) -> Dict[str, Any]:
        """OLMo's trainer state (on CPU with an empty CUDA RNG state, which OLMo reads unconditionally) plus the
        divergence guard's state."""
        if torch.cuda.is_available():
            state = super().trainer_state_dict()
        else:
            real = torch.cuda.get_rng_state
            torch.cuda.get_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)  # type: ignore[assignment]
            try:
                state = super().trainer_state_dict()
            finally:
                torch.cuda.get_rng_state = real  # type: ignore[assignment]
        if self.monitor is not None:
            state["stability"] = self.monitor.state_dict()
        return state

    def load_trainer_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_trainer_state_dict(state_dict)
        loaded = state_dict.get("stability")
        self.restored_stability = bool(self.monitor is not None and loaded is not None
                                       and self.monitor.load_state_dict(loaded))
        if self.monitor is not None and loaded is not None and not self.restored_stability:
            log.warning("the checkpoint's divergence-guard state is malformed; the guard starts afresh")

    # ---- stability ----------------------------------------------------------------------------------------------
    def train_step(self, batch: Dict[str, Any], reduce_global_loss: bool = True) -> Dict[str, float]:
        """OLMo's step on the local loss, then the global mean loss on every rank and the guard on it.

        OLMo reduces the loss to rank 0 on logging steps only; here one all-reduce of one number per step gives
        every rank the global mean (it replaces OLMo's reduce), so every rank takes the same decision. The
        gradient norm is already global (computed from synchronised gradients). A local NaN raises in OLMo's
        step on that rank only; it is turned into a NaN that the all-reduce spreads to every rank."""
        set_training_step(self.model, self.global_step - 1)  # step-dependent variants (ProRes), before the forward
        try:
            metrics = super().train_step(batch, reduce_global_loss=False)
        except ValueError as err:
            if "nan loss" not in str(err):
                raise
            metrics = {"train/CrossEntropyLoss": float("nan")}
        except OverflowError:  # OLMo's exp(loss) for the perplexity metric, loss > 709 nats
            metrics = {"train/CrossEntropyLoss": self.cur_train_loss}
        loss = metrics["train/CrossEntropyLoss"]
        signalled = 1.0 if self.sigterm_received else 0.0
        if dist.is_initialized() and dist.get_world_size() > 1:  # the SIGTERM flags ride on the same all-reduce
            total = torch.tensor([loss, signalled], dtype=torch.float64, device=self.device)
            dist.all_reduce(total)
            loss, signalled = float(total[0]) / dist.get_world_size(), float(total[1])
        if signalled and not self.stop_requested:
            self.request_stop()
        self.cur_train_loss = loss
        self.min_train_loss = min(self.min_train_loss, loss)
        metrics["train/CrossEntropyLoss"] = loss
        if "train/Perplexity" in metrics:
            metrics["train/Perplexity"] = math.exp(min(loss, 700.0))
        grad_norm = metrics.get("optim/total_grad_norm")
        if self.monitor is not None:
            try:
                self.monitor.update(self.global_step, loss, grad_norm)
            except Diverged as diverged:
                log.warning("divergence guard: stopping at step %d: %s", diverged.step, diverged.reason)  # every rank
                self.cur_train_loss = loss
                self.write_metrics({"step": self.global_step, "tokens": self.global_train_tokens_seen, "loss": loss,
                                    "grad_norm": grad_norm, "diverged": diverged.reason, "time": time.time()})
                raise
            metrics["stability/loss_spikes"] = self.monitor.spike_count
            metrics["stability/grad_spikes"] = len(self.monitor.grad_spikes)
        return metrics

    # ---- a SIGTERM: save after this step and stop ----------------------------------------------------------------
    def request_stop(self) -> None:
        """Make OLMo's loop check for a cancel after the current step (``check_if_cancelled`` then says yes): it
        saves a checkpoint (sharded under FSDP at once, unsharded as its final save under DDP), skips the eval and
        stops. Called on every rank in the same step (the flags are all-reduced in ``train_step``)."""
        self.stop_requested = True
        self._cancel_interval = self.cfg.canceled_check_interval
        self.cfg.canceled_check_interval = 1  # read by fit's loop right after train_step

    def check_if_cancelled(self):
        if self.stop_requested:
            if self._cancel_interval is not None:
                self.cfg.canceled_check_interval = self._cancel_interval
                self._cancel_interval = None
            log.warning("SIGTERM: saving a checkpoint at step %d, then stopping (rerun the same command to resume "
                        "from it; a second SIGTERM stops at once)", self.global_step)
            return True, 0
        return super().check_if_cancelled()

    # ---- the run record -----------------------------------------------------------------------------------------
    def run_record(self, status: str, **extra: Any) -> Dict[str, Any]:
        return run_record(self.record_info, status, step=self.global_step, tokens_seen=self.global_train_tokens_seen,
                          max_steps=self.max_steps, tokens_per_batch=self.tokens_per_batch,
                          loss=self.cur_train_loss, monitor=self.monitor, eval_metrics=self.last_eval_metrics,
                          eval_step=self.last_eval_step, **extra)

    def save_record(self, status: str, **extra: Any) -> None:
        if self.record_info is not None and get_global_rank() == 0:
            write_record(self.cfg.save_folder, self.run_record(status, **extra))

    @property
    def metrics_path(self) -> Path:
        return Path(self.cfg.metrics_file or Path(self.cfg.save_folder) / "metrics.jsonl")

    def write_metrics(self, record: Dict[str, Any]) -> None:
        if get_global_rank() != 0:
            return
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def _clock(self) -> tuple[float, Optional[float]]:
        """(seconds since this process logged its first step's line, the estimated seconds to max_steps at the
        rate since then: evaluations and checkpoints included; None until a second line)."""
        now = time.time()
        if getattr(self, "_clock_start", None) is None:
            self._clock_start = (now, self.global_step)
        started, first_step = self._clock_start
        done = self.global_step - first_step
        eta = (now - started) / done * max(0, self.max_steps - self.global_step) if done > 0 else None
        return now - started, eta

    def log_metrics_to_console(self, prefix: str, metrics: Dict[str, float]):
        """One console line per logged step or evaluation (console.py) instead of OLMo's line per metric."""
        if prefix.startswith("[step="):
            log.info(step_line(self.global_step, self.max_steps, metrics, *self._clock()))
        elif prefix == "Pre-train system metrics":
            pass
        else:
            log.info(eval_line(prefix, self.global_step, metrics))
        if prefix.startswith("[step="):
            self.last_train_metrics = dict(metrics)
            self.write_metrics(
                {
                    "step": self.global_step,
                    "tokens": self.global_train_tokens_seen,
                    "loss": metrics.get("train/CrossEntropyLoss"),
                    "lr": metrics.get("optim/learning_rate_group0"),
                    "grad_norm": metrics.get("optim/total_grad_norm"),
                    "tokens_per_second_per_device": metrics.get("throughput/device/tokens_per_second"),
                    "loss_spikes": metrics.get("stability/loss_spikes"),
                    "grad_spikes": metrics.get("stability/grad_spikes"),
                    "time": time.time(),
                }
            )

    def eval(self) -> Dict[str, Any]:
        metrics = super().eval()
        self.last_eval_metrics = {k: float(v) for k, v in metrics.items()}
        self.last_eval_step = self.global_step
        self.write_metrics({"step": self.global_step, "tokens": self.global_train_tokens_seen, "eval": self.last_eval_metrics})
        self.save_record("running")
        return metrics

    def close(self, exit_code: int = 0) -> None:
        """OLMo's close calls ``wandb.finish(exit_code=..., quiet=True)``, and wandb >= 0.19 no longer takes
        ``quiet``: finish the run here first, so OLMo's close finds no run."""
        import wandb

        if wandb.run is not None:
            wandb.finish(exit_code=exit_code)
        super().close(exit_code)

    def restore_rng_state(self, rng_state: Dict[str, Any]) -> None:
        random.setstate(rng_state["python"])
        np.random.set_state(rng_state["numpy"])
        torch.set_rng_state(rng_state["torch"])
        if torch.cuda.is_available() and rng_state.get("cuda") is not None and rng_state["cuda"].numel():
            torch.cuda.set_rng_state(rng_state["cuda"])


def compile_blocks(model: torch.nn.Module, options: Dict[str, Any]) -> int:
    """``torch.compile`` each transformer block in place with the config's ``compile:`` options (mode, fullgraph,
    backend, dynamic), as OLMo compiles per block; embedding, final norm and loss stay eager. Returns the count."""
    blocks = [m for m in model.modules() if isinstance(m, OLMoBlock)]
    allow_recompiles(len(blocks))
    for block in blocks:
        block.compile(**{k: v for k, v in options.items() if v is not None})
    return len(blocks)


# ---- distributed set-up -------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> torch.device:
    """Join torchrun's process group (NCCL on GPUs, gloo on CPUs); a plain ``python`` launch is a group of one."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", GROUP_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if torch.cuda.is_available():
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(f"cuda:{local_rank}")
        device, backend = torch.device("cuda"), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        pin_cpu_threads()
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=30))
    return device


def cpu_adjustments(cfg: SiameseTrainConfig) -> None:
    """What ai2-olmo 0.6.0 needs to train on a CPU with torch 2.13 (each item is in docs/training.md)."""
    if cfg.distributed_strategy == DistributedStrategy.fsdp:
        if cfg.sharded_checkpointer != ShardedCheckpointerType.torch_legacy:
            log.warning("CPU: sharded_checkpointer %s does not work here; using torch_legacy", cfg.sharded_checkpointer)
            cfg.sharded_checkpointer = ShardedCheckpointerType.torch_legacy
        if cfg.save_interval_unsharded is not None:
            log.warning("CPU: unsharded FSDP checkpoints crash torch with 2+ processes; saving sharded ones only")
            cfg.save_interval_unsharded = None
        if cfg.force_save_unsharded:
            raise RunError("force_save_unsharded: unsharded FSDP checkpoints crash torch on CPU with 2+ processes; "
                           "unshard later with scripts/analyze.py, or run it on GPUs.")
    if cfg.precision in ("amp_bf16", "amp_fp16") and cfg.distributed_strategy == DistributedStrategy.ddp:
        log.warning("CPU: OLMo's autocast is CUDA-only; DDP on CPU trains in fp32")


# ---- model and optimizer ---------------------------------------------------------------------------------------
def optimizer_param_groups(cfg: SiameseTrainConfig, model: torch.nn.Module) -> List[Dict[str, Any]]:
    """OLMo's parameter groups (its ``get_param_groups``: decay on Linear weights, none on biases, norms and
    embeddings unless the config says so) plus the topologies' free coefficients, which OLMo's grouping does not
    know (hybrid_pre's gamma, hc's alpha / beta, mhc's projections and biases). A coefficient goes to the
    weight-decay group when its module lists it in ``weight_decay_params`` (hc's dynamic projections, HC paper
    section 4), otherwise to the no-decay group: mixing weights initialised away from zero, treated like norm
    scales."""
    known = (nn.Linear, nn.Embedding, nn.LayerNorm, LayerNormBase)
    coefficients, decayed = {}, set()
    for mn, m in model.named_modules():
        if isinstance(m, known):
            continue
        for pn, p in m.named_parameters(recurse=False):
            if p.requires_grad:
                name = f"{mn}.{pn}" if mn else pn
                coefficients[name] = p
                if pn in getattr(m, "weight_decay_params", ()):
                    decayed.add(name)
    for p in coefficients.values():  # hidden from OLMo's grouping, which refuses parameters it cannot place
        p.requires_grad_(False)
    try:
        groups = olmo_optim.get_param_groups(cfg, model)
    finally:
        for p in coefficients.values():
            p.requires_grad_(True)
    for decay in (False, True):
        names = sorted(n for n in coefficients if (n in decayed) == decay)
        if not names:
            continue
        group = next((g for g in groups if (g.get("weight_decay") != 0.0) == decay), None)
        if group is None:
            template = {k: v for k, v in groups[0].items() if k not in ("params", "param_names", "weight_decay")}
            group = {**template, "params": [], "param_names": [], **({} if decay else {"weight_decay": 0.0})}
            groups.append(group)
        group["params"] = group["params"] + [coefficients[n] for n in names]
        group["param_names"] = group["param_names"] + names
    return groups


def build_optimizer_with_coefficients(cfg: SiameseTrainConfig, model: torch.nn.Module):
    """The optimizer OLMo's ``build_optimizer`` makes, over ``optimizer_param_groups``."""
    o = cfg.optimizer
    common = dict(lr=o.learning_rate, betas=o.betas, weight_decay=o.weight_decay,
                  record_update_metrics=o.record_update_metrics, selective_updates=o.selective_updates)
    groups = optimizer_param_groups(cfg, model)
    if o.name == OptimizerType.adamw:
        return AdamW(groups, eps=o.eps, **common)
    if o.name == OptimizerType.lionw:
        return LionW(groups, **common)
    raise RunError(f"optimizer.name {o.name} is not supported; use adamw or lionw.")


def wrap_model(cfg: SiameseTrainConfig, olmo_model, device: torch.device, local_rank: int):
    if cfg.distributed_strategy == DistributedStrategy.ddp:
        find_unused = bool(cfg.ddp and cfg.ddp.find_unused_params)
        return DDP(olmo_model, find_unused_parameters=find_unused)
    if cfg.distributed_strategy == DistributedStrategy.fsdp:
        return FSDP(
            olmo_model,
            sharding_strategy=cfg.fsdp.sharding_strategy,
            mixed_precision=cfg.fsdp_precision,
            auto_wrap_policy=olmo_model.get_fsdp_wrap_policy(cfg.fsdp.wrapping_strategy),
            use_orig_params=cfg.fsdp.use_orig_params,
            limit_all_gathers=True,
            device_id=torch.device("cpu") if device.type == "cpu" else local_rank,  # an int fails on CPU
            sync_module_states=device.type == "cuda",  # rank 0's init everywhere (CPU ranks seed alike)
        )
    raise RunError(f"distributed_strategy must be ddp or fsdp (got {cfg.distributed_strategy}).")


