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

import dataclasses
import gzip
import logging
import os
import pickle
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional

import torch
import torch.distributed as dist
from olmo.config import CheckpointType
from olmo.optim import BoltOnWarmupScheduler, build_scheduler
from olmo.torch_util import barrier, get_global_rank, get_local_rank, get_world_size, seed_all
from omegaconf import OmegaConf as om

from siamesenorm.models.build import build_model, num_params_from_config
from siamesenorm.models.config import MODEL_TYPES, resolve_model_type
from siamesenorm.run.checkpoints import allow_checkpoint_types
from siamesenorm.run.console import closing_line, detach_run_logs
from siamesenorm.run.folder import check_resume_model, check_same_data, read_record, settle_run_folder, truncate_metrics
from siamesenorm.run.lifecycle import (
    QUIET_DIVERGENCE,
    Plan,
    Terminated,
    describe_run,
    open_run,
    prepare,
    raise_on_sigterm,
    record_info,
    resumed_attempts,
    say_done,
    stop_after_step_on_sigterm,
    train_to_the_end,
    warmup_steps,
)
from siamesenorm.run.recipe import (
    RunError,
    SiameseTrainConfig,
    check_batch_split,
    check_data,
    expand_paths,
    load_config,
    unigram_loss,
)
from siamesenorm.run.records import RECORD_NAME
from siamesenorm.run.safeload import UnsafeCheckpoint, checked_loads
from siamesenorm.run.stability import StabilityMonitor

if TYPE_CHECKING:
    from siamesenorm.ai2_olmo.trainer import SiameseTrainer

log = logging.getLogger(__name__)

__all__ = ["SiameseTrainConfig", "load_config", "main", "RunError", "check_resume_model", "expand_paths",
           "Terminated", "QUIET_DIVERGENCE", "warmup_steps"]

#: What the run record's ``framework`` says for a run of this path.
FRAMEWORK = "ai2-olmo 0.6.0"


def dry_run(cfg: SiameseTrainConfig, plan: Plan) -> None:
    model_cfg = dataclasses.replace(cfg.model, init_device="meta")
    build_model(model_cfg, plan.model_type, init_params=False)  # the blocks build: every knob is valid together
    print(om.to_yaml(om.structured(cfg)))
    n = num_params_from_config(cfg.model, plan.model_type)
    n_emb = (cfg.model.embedding_size or cfg.model.vocab_size) * cfg.model.d_model
    print(f"MODEL_TYPE={plan.model_type}  parameters: {n:,d} ({n - n_emb:,d} without the input embedding)")
    if plan.action == "done":
        print(f"a real start would: nothing, the run already finished ({plan.load_path} is at its last step)")
    else:
        print(f"a real start would: {plan.action}" + (f" from {plan.load_path}" if plan.load_path else ""))


# ---- the run ------------------------------------------------------------------------------------------------------
def main(config_path: str, overrides: Optional[List[str]] = None, dry: bool = False) -> int:
    cfg = load_config(config_path, overrides)
    if not any(o.startswith(("--run_name=", "--run_name")) for o in overrides or []):
        cfg.run_name = Path(cfg.save_folder).name  # one name per run folder, not the recipe's for every run
    if dry or cfg.dry_run:  # the config, the parameters and the plan first, then the data as a real start checks it
        plan = prepare(cfg)
        dry_run(cfg, plan)
        check_data(cfg)
        if plan.action == "resume":
            check_same_data(cfg)
        return 0
    with open_run(cfg, int(os.environ.get("WORLD_SIZE", "1")),
                  before_lock=lambda: warn_gpu_recipe_on_cpu(cfg, config_path)) as plan:
        if plan.action == "done":
            say_done(cfg, plan)
            return 0
        launched = {k: os.environ.get(k) for k in _GROUP_ENV}
        try:
            return train(cfg, config_path, plan)
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


_GROUP_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def _end_own_group(previous: Dict[str, Optional[str]]) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def train(cfg: SiameseTrainConfig, config_path: str, plan: Plan) -> int:
    """Set up the process group, the run folder, wandb, data, model and optimizer; then ``run``."""
    # OLMo's Trainer and its evaluators (torchmetrics, which imports transformers and scipy when they are installed,
    # and wandb) are imported here, once every check has passed: a refused start is said about 5 s of CPU sooner
    from siamesenorm.ai2_olmo.trainer import (
        SiameseTrainer,
        build_optimizer_with_coefficients,
        compile_blocks,
        cpu_adjustments,
        init_distributed,
        wrap_model,
    )

    model_type, load_path, action = plan.model_type, plan.load_path, plan.action
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
        for line in describe_run(cfg, plan, olmo_model.num_params(), console_log, FRAMEWORK):
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
    with raise_on_sigterm():
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
            record_info=record_info(cfg, config_path, plan, olmo_model.num_params(), monitor, get_world_size(),
                                    FRAMEWORK),
        ) as trainer:
            return run(trainer, cfg, load_path, action, BoltOnWarmupScheduler)


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
    from olmo.data import build_train_dataloader
    from olmo.eval import build_evaluators

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


def run(trainer: SiameseTrainer, cfg: SiameseTrainConfig, load_path: Optional[str], action: str, bolt_on) -> int:
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
        trainer.record_info["attempts"] = resumed_attempts(previous, trainer.global_step)
    def fit() -> None:
        # a SIGTERM while training: OLMo's loop saves a checkpoint after the step and stops (SiameseTrainer's
        # check_if_cancelled); a second one, or one outside this block, stops at once (raise_on_sigterm)
        with stop_after_step_on_sigterm(lambda: setattr(trainer, "sigterm_received", True)):
            trainer.fit()
        if trainer.stop_requested and trainer.global_step < trainer.max_steps:
            raise Terminated(signal.SIGTERM)

    code = train_to_the_end(fit, trainer.save_record, lambda: trainer.global_step >= trainer.max_steps,
                            trainer.monitor.convergence, folder / RECORD_NAME, get_global_rank() == 0)
    if get_global_rank() == 0 and code == 0 and trainer.monitor is not None:
        report(trainer)
    return code


def report(trainer: SiameseTrainer) -> None:
    log.info(closing_line(trainer.cur_train_loss, trainer.last_eval_metrics, trainer.global_step, trainer.max_steps,
                          Path(trainer.cfg.save_folder) / RECORD_NAME))
