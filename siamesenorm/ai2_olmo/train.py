"""Training through ai2-olmo 0.6.0's own ``olmo.train.Trainer``, for every MODEL_TYPE, on GPUs (NCCL) and CPUs (gloo).

``main`` orchestrates what OLMo's own scripts/train.py does (the ai2-olmo wheel does not ship it), plus:
- the model is built with ``siamesenorm.build_model`` (MODEL_TYPE env var > config field), and the resolved type is
  written into the config that every checkpoint saves;
- every check of run/recipe.py's validate_run and the token files before step 1 (``--dry-run`` runs the same checks);
- the save folder's lifecycle (run/folder.py): a rerun of the same command resumes, restarts a failed start, or says
  what to pass; a resume must match the checkpoint's model;
- checkpoints load with torch's weights_only=True and an allow-list (checkpoints.py);
- a divergence guard, a loss-spike counter (stability.py), a metrics file and a run record (records.py); a record
  whose status says how the run ended, signals included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import logging
import math
import os
import pickle
import signal
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from olmo.config import CheckpointType
from olmo.data import build_train_dataloader
from olmo.eval import build_evaluators
from olmo.optim import BoltOnWarmupScheduler, build_scheduler
from olmo.torch_util import barrier, get_global_rank, get_local_rank, get_world_size, seed_all
from omegaconf import OmegaConf as om

from siamesenorm.ai2_olmo.trainer import (
    NoSpace,
    SiameseTrainer,
    build_optimizer_with_coefficients,
    compile_blocks,
    cpu_adjustments,
    init_distributed,
    optimizer_param_groups,
    wrap_model,
)
from siamesenorm.models.build import build_model, num_params_from_config
from siamesenorm.models.config import MODEL_TYPES, resolve_model_type, validate_model_config
from siamesenorm.run.checkpoints import allow_checkpoint_types
from siamesenorm.run.console import detach_run_logs
from siamesenorm.run.folder import (
    check_resume_model,
    check_same_data,
    hold_run_folder,
    plan_run,
    read_record,
    resolve_run_model_type,
    settle_run_folder,
    truncate_metrics,
)
from siamesenorm.run.recipe import (
    RunError,
    SiameseTrainConfig,
    check_batch_split,
    check_data,
    expand_paths,
    load_config,
    unigram_loss,
    validate_run,
)
from siamesenorm.run.records import RECORD_NAME, config_hash, recipe_hash, variant_knobs
from siamesenorm.run.safeload import UnsafeCheckpoint, checked_loads
from siamesenorm.run.stability import EXIT_DIVERGED, Diverged, StabilityMonitor

log = logging.getLogger(__name__)

__all__ = ["SiameseTrainConfig", "load_config", "main", "SiameseTrainer", "RunError", "check_resume_model",
           "build_optimizer_with_coefficients", "optimizer_param_groups", "expand_paths",
           "Terminated"]


class Terminated(BaseException):
    """The process got SIGTERM (a scheduler's preemption, torchrun stopping its workers)."""

    def __init__(self, signum: int):
        super().__init__(f"killed by {signal.Signals(signum).name}")
        self.signum = signum


def _raise_terminated(signum, frame):
    raise Terminated(signum)


# ---- checks shared by a real start and a dry run --------------------------------------------------------------
def prepare(cfg: SiameseTrainConfig) -> tuple[str, str, Optional[str], str]:
    """Every check of the config and the save folder before anything is written: (model_type, its source,
    checkpoint to load, what happens). The data are checked by ``check_data``."""
    validate_run(cfg)
    load_path, action = plan_run(cfg)
    model_type, source = resolve_run_model_type(cfg, load_path)
    validate_model_config(cfg.model, model_type)
    cfg.model.model_type = model_type
    if load_path is not None and "://" not in load_path:
        check_resume_model(cfg, load_path)
    return model_type, source, load_path, action


def dry_run(cfg: SiameseTrainConfig, model_type: str, action: str, load_path: Optional[str]) -> None:
    model_cfg = dataclasses.replace(cfg.model, init_device="meta")
    build_model(model_cfg, model_type, init_params=False)  # the blocks build: every knob is valid together
    print(om.to_yaml(om.structured(cfg)))
    n = num_params_from_config(cfg.model, model_type)
    n_emb = (cfg.model.embedding_size or cfg.model.vocab_size) * cfg.model.d_model
    print(f"MODEL_TYPE={model_type}  parameters: {n:,d} ({n - n_emb:,d} without the input embedding)")
    if action == "done":
        print(f"a real start would: nothing, the run already finished ({load_path} is at its last step)")
    else:
        print(f"a real start would: {action}" + (f" from {load_path}" if load_path else ""))


# ---- the run ------------------------------------------------------------------------------------------------------
def main(config_path: str, overrides: Optional[List[str]] = None, dry: bool = False) -> int:
    cfg = load_config(config_path, overrides)
    if not any(o.startswith(("--run_name=", "--run_name")) for o in overrides or []):
        cfg.run_name = Path(cfg.save_folder).name  # one name per run folder, not the recipe's for every run
    if dry or cfg.dry_run:  # the config, the parameters and the plan first, then the data as a real start checks it
        model_type, source, load_path, action = prepare(cfg)
        dry_run(cfg, model_type, action, load_path)
        check_data(cfg)
        if action == "resume":
            check_same_data(cfg)
        return 0
    validate_run(cfg)  # a bad value is refused before the folder is even locked
    check_batch_split(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # before any process group or model
    check_data(cfg)  # the data do not depend on the folder: a missing file is said before the folder is touched
    lead = os.environ.get("RANK", "0") == "0"
    if lead:
        warn_gpu_recipe_on_cpu(cfg, config_path)  # the folder's lock is rank 0's; the other ranks follow it
    with hold_run_folder(cfg.save_folder) if lead else contextlib.nullcontext():
        model_type, source, load_path, action = prepare(cfg)
        if action == "done":
            log.info("%s already finished: its checkpoint %s is at the last step of max_duration=%s; nothing to do "
                     "(pass a larger --max_duration to continue it, or --save_overwrite to train it again)",
                     cfg.save_folder, Path(load_path).name, cfg.max_duration)
            return 0
        if action == "resume":
            check_same_data(cfg)
        launched = {k: os.environ.get(k) for k in _GROUP_ENV}
        try:
            return train(cfg, config_path, model_type, source, load_path, action)
        finally:
            detach_run_logs()
            if launched["RANK"] is None:  # not under torchrun: undo the group of one made here, so that a later
                _end_own_group(launched)   # run in this process (or a child it launches) starts clean


#: Parameters above which a recipe is taken for a GPU one when there is no GPU (the CPU recipes are 1-30M).
GPU_RECIPE_PARAMETERS = 100_000_000


def warn_gpu_recipe_on_cpu(cfg: SiameseTrainConfig, config_path: str) -> None:
    """One warning line before minutes of silent model building: a GPU-sized recipe on a machine without CUDA."""
    if torch.cuda.is_available():
        return
    model_type = resolve_model_type(cfg.model)[0]
    n = num_params_from_config(cfg.model, model_type if model_type in MODEL_TYPES else "pre")  # a bad one: said later
    if n >= GPU_RECIPE_PARAMETERS:
        log.warning("no GPU here: %s is a GPU recipe (%s parameters; precision %s, %s); on this CPU building the "
                    "model alone takes minutes and a step far longer. Check a launch first with: python "
                    "scripts/preflight.py %s", config_path, f"{n:,d}", cfg.precision, cfg.distributed_strategy,
                    config_path)


QUIET_DIVERGENCE = "SIAMESENORM_DIVERGED_EXIT_0"
_GROUP_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def _end_own_group(previous: Dict[str, Optional[str]]) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def train(cfg: SiameseTrainConfig, config_path: str, model_type: str, source: str, load_path: Optional[str],
          action: str) -> int:
    """Set up the process group, the run folder, wandb, data, model and optimizer; then ``run``."""
    device = init_distributed()
    allow_checkpoint_types()  # torch.load keeps weights_only=True; OLMo's trainer state needs these types

    check_batch_split(cfg, get_world_size())
    if device.type == "cpu":
        cpu_adjustments(cfg)
    resuming = action in ("resume", "load")
    if action == "resume":  # OLMo's train script: a resumed run restores its data order, trainer and optimizer
        cfg.restore_dataloader, cfg.reset_trainer_state, cfg.reset_optimizer_state = True, False, False

    cfg.model.precision = cfg.precision
    cfg.device_train_batch_size = cfg.global_train_batch_size // get_world_size()
    cfg.device_train_grad_accum = cfg.device_train_batch_size // cfg.device_train_microbatch_size
    if cfg.model.init_device in (None, "meta"):
        # Built and initialised on the device, then wrapped: DDP cannot start from meta tensors, and re-initialising
        # FSDP's flattened shards would break the initialisers that index a parameter (hc's static alpha).
        cfg.model.init_device = device.type

    console_log = settle_run_folder(cfg, action, load_path) if get_global_rank() == 0 else None
    barrier()
    init_wandb(cfg, model_type)
    barrier()
    seed_all(cfg.seed)
    train_loader, evaluators, indices_file = build_data(cfg, device, resuming)
    barrier()

    olmo_model = build_model(cfg.model, model_type)
    if get_global_rank() == 0:
        for line in describe_run(cfg, model_type, source, olmo_model.num_params(), action, load_path, console_log):
            log.info(line)
    olmo_model.set_activation_checkpointing(cfg.activation_checkpointing)
    if cfg.compile is not None:
        n = compile_blocks(olmo_model, cfg.compile.asdict())
        log.info("compile: %d blocks compiled with %s (the first steps are slow while they compile)", n,
                 {k: v for k, v in cfg.compile.asdict().items() if v is not None})
    dist_model = wrap_model(cfg, olmo_model, device, get_local_rank())

    optim = build_optimizer_with_coefficients(cfg, dist_model)
    scheduler = build_scheduler(cfg)
    unigram = None
    if cfg.stability.unigram_loss is None and cfg.data.paths:
        unigram = unigram_loss([str(p) for p in cfg.data.paths], str(cfg.data.memmap_dtype), cfg.model.vocab_size)
    monitor = StabilityMonitor(cfg.stability, cfg.model.vocab_size, warmup_steps(cfg), unigram)
    previous_handler = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
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
            indices_file=indices_file,
            monitor=monitor,
            record_info=record_info(cfg, config_path, model_type, source, olmo_model.num_params(), monitor),
        ) as trainer:
            return run(trainer, cfg, config_path, model_type, source, load_path, action, BoltOnWarmupScheduler)
    finally:
        signal.signal(signal.SIGTERM, previous_handler)


def init_wandb(cfg: SiameseTrainConfig, model_type: str) -> None:
    """wandb in the run folder (offline unless WANDB_MODE says otherwise), on the ranks the config names."""
    if cfg.wandb is None or (get_global_rank() != 0 and cfg.wandb.rank_zero_only):
        return
    import wandb

    wandb.init(
        dir=cfg.save_folder,  # wandb writes {dir}/wandb/<run>: one folder per run inside the save folder
        mode=os.environ.get("WANDB_MODE", "offline"),  # online only when the user asks for it
        project=cfg.wandb.project,
        entity=cfg.wandb.entity,
        group=cfg.wandb.group,
        name=cfg.wandb.name or f"{Path(cfg.save_folder).name}-{model_type}",
        tags=list(cfg.wandb.tags or []) + [model_type],
        config=cfg.asdict(exclude=["wandb"]),
    )


def build_data(cfg: SiameseTrainConfig, device, resuming: bool):
    """(OLMo's train loader, its evaluators, the data-indices file or None), as OLMo's train script builds them."""
    overwrite = cfg.save_overwrite
    cfg.save_overwrite = True  # the folder is settled; OLMo refuses an existing train_data/ folder otherwise
    train_loader = build_train_dataloader(cfg)
    cfg.save_overwrite = overwrite
    # OLMo loads the tokenizer even for no evaluators, which fails when a test model's vocabulary differs.
    evaluators = build_evaluators(cfg, device) if cfg.evaluators else []
    indices_file = None
    if cfg.save_data_indices:  # as OLMo's train script: the data indices each rank trains on
        indices_path = Path(cfg.save_folder) / "data-indices" / f"rank{get_global_rank()}.tsv.gz"
        indices_path.parent.mkdir(parents=True, exist_ok=True)
        indices_file = gzip.open(indices_path, "at" if resuming else "wt")
    return train_loader, evaluators, indices_file


def run(trainer: SiameseTrainer, cfg: SiameseTrainConfig, config_path: str, model_type: str, source: str,
        load_path: Optional[str], action: str, bolt_on) -> int:
    """Restore, set up the guard and the record, train; the record says how it ended."""
    folder = Path(cfg.save_folder)
    previous = read_record(folder)
    if load_path is None and not cfg.no_pre_train_checkpoint:
        # OLMo's train script: save a checkpoint before training and load it back, so a full disk or a broken
        # checkpointer fails now rather than hours in.
        kind = CheckpointType.unsharded if str(cfg.distributed_strategy) == "ddp" else CheckpointType.sharded
        path, cache = trainer.save_checkpoint(checkpoint_type=kind)
        with checked_loads():
            trainer.restore_checkpoint(path, checkpoint_type=kind, local_cache=cache)
    if load_path is not None:
        log.info("Resuming from %s", load_path)
        try:
            with checked_loads():  # every file OLMo opens: checked, then read with weights_only=True
                trainer.restore_checkpoint(
                    load_path,
                    load_optimizer_state=not cfg.reset_optimizer_state,
                    load_trainer_state=not cfg.reset_trainer_state,
                    sharded_checkpointer=cfg.load_path_sharded_checkpointer,
                )
        except UnsafeCheckpoint as err:
            raise RunError(str(err)) from None
        except pickle.UnpicklingError as err:  # torch's weights_only reader refused what our check let through
            raise RunError(f"cannot load {load_path}: {str(err).splitlines()[0]}") from None
        if cfg.reset_optimizer_state and not cfg.reset_trainer_state:  # as OLMo's script: warm up again
            trainer.scheduler = bolt_on.wrap(trainer.scheduler, trainer.global_step,
                                             int(trainer.global_step + cfg.scheduler.t_warmup))
        if get_global_rank() == 0 and not cfg.reset_trainer_state:
            dropped = truncate_metrics(trainer.metrics_path, trainer.global_step)
            if dropped:
                log.info("metrics: dropped %d rows logged after step %d by the interrupted attempt",
                         dropped, trainer.global_step)
    if action == "resume" and trainer.global_step >= trainer.max_steps:  # e.g. the record was lost: the checkpoint says
        log.info("%s is already at step %d of %d: nothing to train (pass a larger --max_duration to continue it)",
                 load_path, trainer.global_step, trainer.max_steps)
        return 0
    if cfg.force_save_unsharded and str(cfg.distributed_strategy) != "ddp":
        path, _ = trainer.save_checkpoint(checkpoint_type=CheckpointType.unsharded)
        log.info("unsharded checkpoint saved to %s", path)
    if cfg.stop_at is None and cfg.stop_after is None:
        cfg.stop_at = trainer.max_steps  # OLMo would otherwise run 10 steps past max_duration
    if action == "resume" and previous:
        if not trainer.restored_stability:  # a checkpoint from before the guard's state was kept: the record's spikes
            trainer.monitor.restore([s for s in previous.get("spikes", []) if s["step"] <= trainer.global_step],
                                    [s for s in previous.get("grad_spikes", []) if s["step"] <= trainer.global_step])
        trainer.record_info["attempts"] = previous.get("attempts", []) + [
            {"resumed_at_step": trainer.global_step, "previous_status": previous.get("status"),
             "previous_error": previous.get("error")}
        ]
    trainer.save_record("running")
    record_path = folder / RECORD_NAME
    try:
        trainer.fit()
    except Diverged as diverged:
        trainer.save_record("diverged", diverged_at_step=diverged.step, divergence=diverged.reason,
                            divergence_kind=diverged.kind)
        if get_global_rank() == 0:
            log.warning("diverged at step %d: %s; record: %s", diverged.step, diverged.reason, record_path)
        # under scripts/launch.py the workers end normally and launch.py turns the record into the exit status,
        # so torchrun does not print a worker-failure report for an outcome that is a result
        return 0 if os.environ.get(QUIET_DIVERGENCE) == "1" else EXIT_DIVERGED
    except NoSpace as err:
        try:
            trainer.save_record("stopped", error=str(err)[:500])
        except OSError:  # the record cannot be written either; the message below still says what happened
            pass
        raise RunError(str(err)) from None
    except BaseException as err:  # an error, an interrupt or a signal: the record says the run ended early
        trainer.save_record("stopped", error=f"{type(err).__name__}: {err}"[:500])
        raise
    trainer.save_record("finished" if trainer.global_step >= trainer.max_steps else "stopped",
                        **trainer.monitor.convergence())
    if get_global_rank() == 0:
        report(trainer)
    return 0


def describe_run(cfg: SiameseTrainConfig, model_type: str, source: str, n_params: int, action: str,
                 load_path: Optional[str], console_log: Path) -> List[str]:
    """The lines a run prints once before its first step: what trains, on what, and where its files go."""
    how = {"default": "the default; set MODEL_TYPE=... to choose"}.get(source, f"from {source}")
    tokens_per_step = cfg.global_train_batch_size * cfg.model.max_sequence_length
    folder = Path(cfg.save_folder)
    start = {"resume": f"resuming from {load_path}", "load": f"starting from the weights in {load_path}"}.get(
        action, "starting from step 0")
    paths = [str(p) for p in (cfg.data.paths or [])] + [
        str(p) for group in (cfg.data.datasets or {}).values() for p in group]
    data = f"{len(paths)} token file(s)"
    if paths and all("://" not in p for p in paths):
        tokens = sum(os.path.getsize(p) for p in paths) // np.dtype(str(cfg.data.memmap_dtype)).itemsize
        data += f" in {os.path.commonpath(paths) if len(paths) > 1 else paths[0]} ({tokens:,d} tokens)"
    duration = str(cfg.max_duration)
    duration = f"{duration} steps" if duration.isdigit() else duration
    return [
        f"MODEL_TYPE={model_type} ({how}); {n_params:,d} parameters; {cfg.model.n_layers} layers x d_model "
        f"{cfg.model.d_model}",
        f"data: {data}; {tokens_per_step:,d} tokens a step; {duration}, {start}",
        f"run folder: {folder} (config.yaml, {RECORD_NAME}, metrics.jsonl, {console_log.name}, checkpoints)",
    ]


def warmup_steps(cfg: SiameseTrainConfig) -> int:
    """The scheduler's warmup in optimizer steps (OLMo counts it in steps or in tokens)."""
    warmup = float(cfg.scheduler.t_warmup)
    if str(cfg.scheduler.units) == "tokens":
        warmup /= cfg.global_train_batch_size * cfg.model.max_sequence_length
    return int(math.ceil(warmup))


def record_info(cfg: SiameseTrainConfig, config_path: str, model_type: str, source: str, n_params: int,
                monitor: StabilityMonitor) -> Dict:
    """What a run record says about the run itself (siamesenorm/run/records.py adds its progress and results)."""
    return {
        "run_name": cfg.run_name,
        "config": str(config_path),
        "save_folder": str(cfg.save_folder),
        "model_type": model_type,
        "model_type_source": source,
        "variant_knobs": variant_knobs(cfg.model, model_type),
        "config_hash": config_hash(cfg),
        "recipe_hash": recipe_hash(cfg),
        "seed": cfg.seed,
        "learning_rate": float(cfg.optimizer.learning_rate),
        "max_duration": str(cfg.max_duration),
        "parameters": n_params,
        "world_size": get_world_size(),
        "stability": {  # the settings in force, defaults resolved
            **dataclasses.asdict(cfg.stability),
            "max_loss": monitor.max_loss,
            "grace_steps": monitor.grace_steps,
            "unigram_loss": monitor.unigram_loss,
            "converge_steps": monitor.converge_steps,
        },
    }


def report(trainer: SiameseTrainer) -> None:
    loss = trainer.cur_train_loss
    line = f"final training loss: {loss:.4f}"
    ppl = {k: v for k, v in trainer.last_eval_metrics.items() if k.endswith("/Perplexity")}
    for key, value in ppl.items():
        line += f" | {key.split('/')[1]} perplexity: {value:.2f}"
    log.info(line)

