"""Training through ai2-olmo 0.6.0's own ``olmo.train.Trainer``, for every MODEL_TYPE, on GPUs (NCCL) and CPUs (gloo).

This follows the structure of OLMo's own scripts/train.py (which the ai2-olmo wheel does not ship) and adds:
- the model is built with ``siamesenorm.build_model`` (MODEL_TYPE env var > config field), and the resolved
  type is written into the config that every checkpoint saves;
- resuming takes the type from the checkpoint and refuses a contradicting MODEL_TYPE before any step;
- a clear error for missing data; a dry run; a JSON-lines metrics file per run; wandb offline by default;
- the CPU fixes listed in docs/training.md (torch 2.13 + ai2-olmo 0.6.0), done here, never in the package;
- a divergence guard and loss-spike counter after every step, and a run record (run.json) per run
  (siamesenorm/records.py has the rules).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from glob import glob
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf as om

from olmo.config import (
    DistributedStrategy,
    ShardedCheckpointerType,
    TrainConfig,
)
from olmo.exceptions import OLMoConfigurationError
from olmo.train import Trainer
from olmo.util import clean_opt, find_latest_checkpoint

from .config import SiameseModelConfig, resolve_model_type, validate_model_config
from .model import build_model, num_params_from_config
from .records import (
    EXIT_DIVERGED,
    RECORD_NAME,
    Diverged,
    StabilityConfig,
    StabilityMonitor,
    config_hash,
    split_eval_metrics,
    variant_knobs,
    write_record,
)

log = logging.getLogger(__name__)

__all__ = ["SiameseTrainConfig", "load_config", "main", "SiameseTrainer"]


@dataclass
class SiameseTrainConfig(TrainConfig):
    """OLMo's TrainConfig whose model section also takes model_type and the variant knobs."""

    model: SiameseModelConfig = field(default_factory=SiameseModelConfig)
    metrics_file: Optional[str] = None
    """JSON lines, one per logged step and per evaluation; default ``{save_folder}/metrics.jsonl``."""
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    """The divergence guard and the loss-spike rule (siamesenorm/records.py)."""


class RunError(OLMoConfigurationError):
    """A problem with the run's inputs; the message says what to change."""


# ---- configuration --------------------------------------------------------------------------------------------
def load_config(path: str, overrides: Optional[List[str]] = None) -> SiameseTrainConfig:
    """Load a YAML recipe with ``--key=value`` overrides, as OLMo's CLI accepts them."""
    if not Path(path).is_file():
        raise RunError(f"config file {path} not found; pick one from configs/ (docs/training.md lists them).")
    overrides = [clean_opt(o) for o in (overrides or [])]
    return SiameseTrainConfig.load(path, overrides, validate_paths=False)


def expand_paths(paths: List[str]) -> List[str]:
    """Path patterns (``*``, ``?``, ``[``) expanded to the sorted files they match; other paths as given."""
    out: List[str] = []
    for p in paths:
        out.extend(sorted(glob(p)) if any(c in p for c in "*?[") else [p])
    return out


def check_data_paths(cfg: SiameseTrainConfig) -> None:
    """Fail before anything starts when a training or evaluation data file is missing; expand path globs
    (OLMo's memmap dataset takes file names only)."""
    how = (
        "prepare data with scripts/prepare_data.py (docs/training.md, 'Data') and point data.paths "
        "(and the lm evaluators' paths) at the token files it writes"
    )
    sections = [("data.paths", cfg.data)]
    sections += [(f"evaluator {ev.label}", ev.data) for ev in cfg.evaluators if str(ev.type) == "lm"]
    if not (cfg.data.paths or cfg.data.datasets):
        raise RunError(f"the config names no training data (data.paths is empty): {how}.")
    for where, data in sections:
        groups = [data.paths or []] + list((data.datasets or {}).values())
        for pattern in (p for group in groups for p in group):
            found = expand_paths([str(pattern)])
            if "://" not in str(pattern) and (not found or not all(Path(q).exists() for q in found)):
                raise RunError(f"{where}: no data at {pattern!r}: {how}.")
        if data.paths:
            data.paths = expand_paths([str(p) for p in data.paths])
        if data.datasets:
            data.datasets = {k: expand_paths([str(p) for p in v]) for k, v in data.datasets.items()}


def checkpoint_model_type(load_path: str) -> Optional[str]:
    cfg_path = Path(load_path) / "config.yaml"
    if not cfg_path.is_file():
        return None
    raw = om.load(str(cfg_path))
    return raw.get("model", {}).get("model_type")


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


def find_resume_path(cfg: SiameseTrainConfig) -> Optional[str]:
    if cfg.load_path is not None:
        return str(cfg.load_path)
    if cfg.try_load_latest_save and cfg.save_folder and Path(cfg.save_folder).is_dir():
        latest = find_latest_checkpoint(cfg.save_folder)
        return None if latest is None else str(latest)
    return None


# ---- the trainer ------------------------------------------------------------------------------------------------
class SiameseTrainer(Trainer):
    """OLMo's Trainer plus a metrics file, the divergence guard, the run record; CPU-safe RNG state."""

    last_eval_metrics: Dict[str, float] = {}
    last_train_metrics: Dict[str, float] = {}
    last_eval_step: Optional[int] = None
    monitor: Optional[StabilityMonitor] = None
    record_info: Optional[Dict[str, Any]] = None  # the run's fixed facts; None: no run record (unit tests)

    # ---- stability ----------------------------------------------------------------------------------------------
    def train_step(self, batch: Dict[str, Any], reduce_global_loss: bool = True) -> Dict[str, float]:
        """OLMo's step on the local loss, then the global mean loss on every rank and the guard on it.

        OLMo reduces the loss to rank 0 on logging steps only; here one all-reduce of one number per step gives
        every rank the global mean (it replaces OLMo's reduce), so every rank takes the same decision. The
        gradient norm is already global (computed from synchronised gradients). A local NaN raises in OLMo's
        step on that rank only; it is turned into a NaN that the all-reduce spreads to every rank."""
        try:
            metrics = super().train_step(batch, reduce_global_loss=False)
        except ValueError as err:
            if "nan loss" not in str(err):
                raise
            metrics = {"train/CrossEntropyLoss": float("nan")}
        except OverflowError:  # OLMo's exp(loss) for the perplexity metric, loss > 709 nats
            metrics = {"train/CrossEntropyLoss": self.cur_train_loss}
        loss = metrics["train/CrossEntropyLoss"]
        if dist.is_initialized() and dist.get_world_size() > 1:
            total = torch.tensor([loss], dtype=torch.float64, device=self.device)
            dist.all_reduce(total)
            loss = float(total) / dist.get_world_size()
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
        return metrics

    # ---- the run record -----------------------------------------------------------------------------------------
    def run_record(self, status: str, **extra: Any) -> Dict[str, Any]:
        perplexity, downstream = split_eval_metrics(self.last_eval_metrics)
        record = {
            **(self.record_info or {}),
            "status": status,
            "step": self.global_step,
            "tokens_seen": self.global_train_tokens_seen,
            "max_steps": self.max_steps,
            "token_budget": self.max_steps * self.tokens_per_batch,
            "final_train_loss": self.cur_train_loss if math.isfinite(self.cur_train_loss) else None,
            "loss_spikes": self.monitor.spike_count if self.monitor else 0,
            "spikes": self.monitor.spikes if self.monitor else [],
            "perplexity": perplexity,
            "val_perplexity": next(iter(perplexity.values()), None),
            "downstream": downstream,
            "eval_step": self.last_eval_step,
        }
        record.update(extra)
        return record

    def save_record(self, status: str, **extra: Any) -> None:
        from olmo.torch_util import get_global_rank

        if self.record_info is not None and get_global_rank() == 0:
            write_record(self.cfg.save_folder, self.run_record(status, **extra))

    @property
    def metrics_path(self) -> Path:
        return Path(self.cfg.metrics_file or Path(self.cfg.save_folder) / "metrics.jsonl")

    def write_metrics(self, record: Dict[str, Any]) -> None:
        from olmo.torch_util import get_global_rank

        if get_global_rank() != 0:
            return
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def log_metrics_to_console(self, prefix: str, metrics: Dict[str, float]):
        super().log_metrics_to_console(prefix, metrics)
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

    def trainer_state_dict(self) -> Dict[str, Any]:
        if torch.cuda.is_available():
            return super().trainer_state_dict()
        real = torch.cuda.get_rng_state
        torch.cuda.get_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)  # type: ignore[assignment]
        try:
            return super().trainer_state_dict()
        finally:
            torch.cuda.get_rng_state = real  # type: ignore[assignment]

    def restore_rng_state(self, rng_state: Dict[str, Any]) -> None:
        random.setstate(rng_state["python"])
        np.random.set_state(rng_state["numpy"])
        torch.set_rng_state(rng_state["torch"])
        if torch.cuda.is_available() and rng_state.get("cuda") is not None and rng_state["cuda"].numel():
            torch.cuda.set_rng_state(rng_state["cuda"])


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
        if "OMP_NUM_THREADS" not in os.environ:
            # ai2-olmo on CPU: small models ran far slower with 2 intra-op threads than with 1 (docs/training.md).
            torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=30))
    return device


def cpu_adjustments(cfg: SiameseTrainConfig) -> None:
    """What ai2-olmo 0.6.0 needs to train on a CPU with torch 2.13 (each item is in docs/training.md)."""
    # torch >= 2.6 loads with weights_only=True; OLMo's own checkpoints hold paths and numpy objects.
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    if cfg.distributed_strategy == DistributedStrategy.fsdp:
        if cfg.sharded_checkpointer != ShardedCheckpointerType.torch_legacy:
            log.warning("CPU: sharded_checkpointer %s does not work here; using torch_legacy", cfg.sharded_checkpointer)
            cfg.sharded_checkpointer = ShardedCheckpointerType.torch_legacy
        if cfg.save_interval_unsharded is not None:
            log.warning("CPU: unsharded FSDP checkpoints crash torch with 2+ processes; saving sharded ones only")
            cfg.save_interval_unsharded = None
    if cfg.precision in ("amp_bf16", "amp_fp16") and cfg.distributed_strategy == DistributedStrategy.ddp:
        log.warning("CPU: OLMo's autocast is CUDA-only; DDP on CPU trains in fp32")


# ---- the run ------------------------------------------------------------------------------------------------------
def dry_run(cfg: SiameseTrainConfig, model_type: str) -> None:
    cfg.model.model_type = model_type
    print(om.to_yaml(om.structured(cfg)))
    n = num_params_from_config(cfg.model, model_type)
    n_emb = (cfg.model.embedding_size or cfg.model.vocab_size) * cfg.model.d_model
    print(f"MODEL_TYPE={model_type}  parameters: {n:,d} ({n - n_emb:,d} without the input embedding)")


def main(config_path: str, overrides: Optional[List[str]] = None, dry: bool = False) -> int:
    cfg = load_config(config_path, overrides)
    load_path = find_resume_path(cfg)
    model_type, source = resolve_run_model_type(cfg, load_path)
    log.info("MODEL_TYPE=%s (from %s)", model_type, source)
    validate_model_config(cfg.model, model_type)
    cfg.model.model_type = model_type
    if dry or cfg.dry_run:
        dry_run(cfg, model_type)
        return 0
    check_data_paths(cfg)

    device = init_distributed()
    from olmo.data import build_train_dataloader
    from olmo.eval import build_evaluators
    from olmo.optim import build_scheduler
    from olmo.torch_util import barrier, get_global_rank, get_local_rank, get_world_size, seed_all

    if device.type == "cpu":
        cpu_adjustments(cfg)
    resuming_here = load_path is not None and Path(load_path).resolve().parent == Path(cfg.save_folder).resolve()

    cfg.model.precision = cfg.precision
    cfg.device_train_batch_size = cfg.global_train_batch_size // get_world_size()
    cfg.device_train_grad_accum = cfg.device_train_batch_size // cfg.device_train_microbatch_size
    if cfg.model.init_device in (None, "meta"):
        # Built and initialised on the device, then wrapped: DDP cannot start from meta tensors, and re-initialising
        # FSDP's flattened shards would break the initialisers that index a parameter (hc's static alpha).
        cfg.model.init_device = device.type

    if get_global_rank() == 0:
        log.info("MODEL_TYPE=%s; configuration:\n%s", model_type, om.to_yaml(om.structured(cfg)))
        if not resuming_here:
            save_path = Path(cfg.save_folder) / "config.yaml"
            if save_path.is_file() and not cfg.save_overwrite:
                raise RunError(f"{save_path} exists: pass --save_overwrite, or resume with --try_load_latest_save.")
            save_path.parent.mkdir(parents=True, exist_ok=True)
            cfg.save(save_path)
    barrier()

    if cfg.wandb is not None and (get_global_rank() == 0 or not cfg.wandb.rank_zero_only):
        import wandb

        wandb_dir = Path(cfg.save_folder) / "wandb"
        wandb_dir.mkdir(parents=True, exist_ok=True)
        wandb.init(
            dir=wandb_dir,
            mode=os.environ.get("WANDB_MODE", "offline"),  # online only when the user asks for it
            project=cfg.wandb.project,
            entity=cfg.wandb.entity,
            group=cfg.wandb.group,
            name=cfg.wandb.name or f"{Path(cfg.save_folder).name}-{model_type}",
            tags=list(cfg.wandb.tags or []) + [model_type],
            config=cfg.asdict(exclude=["wandb"]),
        )
    barrier()

    seed_all(cfg.seed)
    overwrite = cfg.save_overwrite
    cfg.save_overwrite = overwrite or resuming_here  # OLMo refuses an existing train_data/ folder otherwise
    train_loader = build_train_dataloader(cfg)
    cfg.save_overwrite = overwrite
    # OLMo loads the tokenizer even for no evaluators, which fails when a test model's vocabulary differs.
    evaluators = build_evaluators(cfg, device) if cfg.evaluators else []
    barrier()

    olmo_model = build_model(cfg.model, model_type)
    log.info("Total number of parameters: %s", f"{olmo_model.num_params():,d}")
    olmo_model.set_activation_checkpointing(cfg.activation_checkpointing)
    dist_model = wrap_model(cfg, olmo_model, device, get_local_rank())

    optim = build_optimizer_with_coefficients(cfg, dist_model)
    scheduler = build_scheduler(cfg)
    with SiameseTrainer(
        cfg=cfg,
        epoch=cfg.epoch,
        model=olmo_model,
        dist_model=dist_model,
        optim=optim,
        scheduler=scheduler,
        train_loader=train_loader,
        device=device,
        evaluators=evaluators,
    ) as trainer:
        if load_path is not None:
            log.info("Resuming from %s", load_path)
            trainer.restore_checkpoint(
                load_path,
                load_optimizer_state=not cfg.reset_optimizer_state,
                load_trainer_state=not cfg.reset_trainer_state,
                sharded_checkpointer=cfg.load_path_sharded_checkpointer,
            )
        if cfg.stop_at is None and cfg.stop_after is None:
            cfg.stop_at = trainer.max_steps  # OLMo would otherwise run 10 steps past max_duration
        trainer.monitor = StabilityMonitor(cfg.stability, cfg.model.vocab_size, warmup_steps(cfg))
        trainer.record_info = record_info(cfg, config_path, model_type, source, olmo_model.num_params(), trainer.monitor)
        previous = Path(cfg.save_folder) / RECORD_NAME
        if load_path is not None and previous.is_file():
            trainer.monitor.restore(json.loads(previous.read_text()).get("spikes", []))
        trainer.save_record("running")
        try:
            trainer.fit()
        except Diverged as diverged:
            trainer.save_record("diverged", diverged_at_step=diverged.step, divergence=diverged.reason)
            if get_global_rank() == 0:
                print(f"diverged at step {diverged.step}: {diverged.reason}; record: {previous}", flush=True)
            return EXIT_DIVERGED
        except BaseException as err:  # an error or an interrupt: the record says the run ended early
            trainer.save_record("stopped", error=f"{type(err).__name__}: {err}"[:500])
            raise
        trainer.save_record("finished" if trainer.global_step >= trainer.max_steps else "stopped")
        if get_global_rank() == 0:
            report(trainer)
    return 0


def warmup_steps(cfg: SiameseTrainConfig) -> int:
    """The scheduler's warmup in optimizer steps (OLMo counts it in steps or in tokens)."""
    warmup = float(cfg.scheduler.t_warmup)
    if str(cfg.scheduler.units) == "tokens":
        warmup /= cfg.global_train_batch_size * cfg.model.max_sequence_length
    return int(math.ceil(warmup))


def record_info(cfg: SiameseTrainConfig, config_path: str, model_type: str, source: str, n_params: int,
                monitor: StabilityMonitor) -> Dict:
    """What a run record says about the run itself (siamesenorm/records.py adds its progress and results)."""
    from olmo.torch_util import get_world_size

    return {
        "run_name": cfg.run_name,
        "config": str(config_path),
        "save_folder": str(cfg.save_folder),
        "model_type": model_type,
        "model_type_source": source,
        "variant_knobs": variant_knobs(cfg.model),
        "config_hash": config_hash(cfg),
        "learning_rate": float(cfg.optimizer.learning_rate),
        "max_duration": str(cfg.max_duration),
        "parameters": n_params,
        "world_size": get_world_size(),
        "stability": {  # the settings in force, defaults resolved
            **dataclasses.asdict(cfg.stability),
            "max_loss": monitor.max_loss,
            "grace_steps": monitor.grace_steps,
        },
    }


def build_optimizer_with_coefficients(cfg: SiameseTrainConfig, model: torch.nn.Module):
    """OLMo's optimizer, with the topologies' free coefficients (hybrid_pre's gamma, hc's alpha/beta) in the
    no-weight-decay group: OLMo's grouping only knows Linear, Embedding and norm parameters and would refuse them.
    They are mixing weights initialised away from zero, so they are treated like norm scales."""
    from unittest import mock

    import torch.nn as nn
    from olmo import optim as olmo_optim
    from olmo.model import LayerNormBase

    known = (nn.Linear, nn.Embedding, nn.LayerNorm, LayerNormBase)
    coefficients = {
        f"{mn}.{pn}" if mn else pn: p
        for mn, m in model.named_modules()
        if not isinstance(m, known)
        for pn, p in m.named_parameters(recurse=False)
        if p.requires_grad
    }

    olmo_groups = olmo_optim.get_param_groups

    def param_groups(cfg, model):
        for p in coefficients.values():
            p.requires_grad_(False)
        try:
            groups = olmo_groups(cfg, model)
        finally:
            for p in coefficients.values():
                p.requires_grad_(True)
        if coefficients:
            no_decay = [g for g in groups if g.get("weight_decay") == 0.0]
            if not no_decay:
                groups.append({**{k: v for k, v in groups[0].items() if k not in ("params", "param_names")},
                               "params": [], "param_names": [], "weight_decay": 0.0})
                no_decay = groups[-1:]
            names = sorted(coefficients)
            no_decay[0]["params"] = no_decay[0]["params"] + [coefficients[n] for n in names]
            no_decay[0]["param_names"] = no_decay[0]["param_names"] + names
        return groups

    with mock.patch.object(olmo_optim, "get_param_groups", param_groups):
        return olmo_optim.build_optimizer(cfg, model)


def wrap_model(cfg: SiameseTrainConfig, olmo_model, device: torch.device, local_rank: int):
    if cfg.distributed_strategy == DistributedStrategy.ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        find_unused = bool(cfg.ddp and cfg.ddp.find_unused_params)
        return DDP(olmo_model, find_unused_parameters=find_unused)
    if cfg.distributed_strategy == DistributedStrategy.fsdp:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

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


def report(trainer: SiameseTrainer) -> None:
    loss = trainer.cur_train_loss
    line = f"final training loss: {loss:.4f}"
    ppl = {k: v for k, v in trainer.last_eval_metrics.items() if k.endswith("/Perplexity")}
    for key, value in ppl.items():
        line += f" | {key.split('/')[1]} perplexity: {value:.2f}"
    print(line, flush=True)
