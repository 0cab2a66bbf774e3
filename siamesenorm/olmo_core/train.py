"""Train any MODEL_TYPE with OLMo-core's own machinery, from one of our recipes: the thin OLMo-core adapter of the run
layer (siamesenorm/run/lifecycle.py).

``python scripts/train_olmo_core.py RECIPE.yaml [--key=value ...]`` (or under ``torchrun``) reads the same recipe
files as the ai2-olmo path (``load_config``: the same overrides and checks before step 1) and builds OLMo-core's
components from them: the model from ``transformer_config`` (``MODEL_TYPE`` selects the block), OLMo-core's
``NumpyFSLDataset`` over the recipe's token files, its ``TransformerTrainModule`` (AdamW, the recipe's cosine
schedule with warmup, gradient clipping, z-loss; FSDP over the data-parallel processes when launched with more than
one), and its ``Trainer`` with its checkpointer.

What the run layer gives this path, as it gives the ai2-olmo one (``open_run``, ``train_to_the_end``): one run per
save folder, the rerun rules (resume, restart, nothing to do when finished, refuse another model or other token
files), the data checks and fingerprint, the run record (run.json) with the same fields and statuses, the
divergence guard (ours: ``RunCallback`` feeds it OLMo-core's reduced loss and gradient norm and cancels the run
through OLMo-core), one console line a step with the ETA and a closing summary, and the exit statuses of a signal
(OLMo-core saves a checkpoint when SIGTERM or SIGINT cancels the run; the record says ``stopped``; the exit status
is 143 or 130; the same command resumes).

What it maps (and what it does not) is in docs/training.md, "The OLMo-core path".
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from olmo_core.config import DType
from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
from olmo_core.distributed.parallel import DataParallelType
from olmo_core.distributed.utils import barrier, get_rank, get_world_size
from olmo_core.nn.moe import MoERouter
from olmo_core.nn.moe.mlp import MoEMLPBase
from olmo_core.optim import AdamWConfig, CosWithWarmup, OptimGroupOverride
from olmo_core.train import Duration, TrainerConfig, prepare_training_environment, teardown_training_environment
from olmo_core.train.callbacks import CheckpointerCallback, ConsoleLoggerCallback
from olmo_core.train.train_module import TransformerDataParallelConfig, TransformerTrainModuleConfig
from olmo_core.utils import setup_logging as setup_core_logging
from olmo_core.version import VERSION as OLMO_CORE_VERSION
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from siamesenorm.models.core_state import olmo_to_core_state
from siamesenorm.olmo_core.config import enum_value, transformer_config  # checks the OLMo-core release first
from siamesenorm.run.checkpoints import is_core_checkpoint, load_model_state
from siamesenorm.run.console import closing_line, detach_run_logs, keep_our_console, step_line
from siamesenorm.run.folder import read_record, settle_run_folder, truncate_metrics
from siamesenorm.run.lifecycle import (
    Plan,
    Terminated,
    describe_run,
    open_run,
    record_info,
    resumed_attempts,
    run_record,
    say_done,
    train_to_the_end,
    warmup_steps,
)
from siamesenorm.run.process import pin_cpu_threads
from siamesenorm.run.recipe import RunError, check_batch_split, check_data, load_config, unigram_loss, validate_run
from siamesenorm.run.records import METRICS_NAME, RECORD_NAME, write_record
from siamesenorm.run.safeload import checked_olmo_core_loads
from siamesenorm.run.stability import Diverged, StabilityMonitor
from siamesenorm.variants.prores import set_training_step

log = logging.getLogger(__name__)

__all__ = ["main", "build_components", "RunCallback", "no_decay_names", "FRAMEWORK"]

#: What the run record's ``framework`` says for a run of this path.
FRAMEWORK = f"OLMo-core {OLMO_CORE_VERSION}"
#: OLMo-core's metrics that a row carries under the shared names (loss, grad_norm, lr, tokens_per_second_per_device).
_SHOWN = ("train/CE loss", "optim/total grad norm", "optim/LR (group 0)", "throughput/device/TPS")
#: OLMo-core's own check of the reduced loss, raised before any callback sees a non-finite loss.
_NONFINITE = re.compile(r"(nan|-?inf) loss encountered at step (\d+)")


@dataclass
class RunCallback(ConsoleLoggerCallback):
    """The run layer inside OLMo-core's Trainer, in place of its console logger (rank 0 writes and prints).

    * each step's row in ``metrics.jsonl``, in the ai2-olmo path's fields (step, tokens, loss, lr, grad_norm,
      tokens_per_second_per_device, loss_spikes, grad_spikes, time) plus OLMo-core's other metrics of the step under
      their own names (the MoE's load-balancing and router losses, the other groups' lr); on a resume, rows after
      the checkpoint go;
    * the divergence guard on OLMo-core's reduced loss and gradient norm: a verdict cancels the run through
      OLMo-core (every rank stops at the next check) with the checkpointer switched off, so no diverged state is
      saved; its state is this callback's, which OLMo-core keeps in every checkpoint;
    * one console line a logged step (run/console.py's ``step_line``: loss, grad norm, lr, tokens/s, ETA);
    * which signal cancelled the run (OLMo-core's own handler cancels it; this one also notes the signal).
    """

    folder: Optional[str] = None
    monitor: Optional[StabilityMonitor] = None
    diverged: Optional[Diverged] = None
    signal_received: Optional[int] = None
    last_loss: Optional[float] = None
    restored_stability: bool = False
    _tps: Optional[float] = field(default=None, repr=False)
    _clock: Optional[tuple] = field(default=None, repr=False)

    def post_step(self):  # OLMo-core's progress marker lines: the step line below says it
        pass

    def pre_step(self, batch):
        """Step-dependent variants (ProRes's residual warmup) take the step before its forward."""
        set_training_step(self.trainer.train_module.model, self.trainer.global_step - 1)

    def pre_train(self):
        for signum in (signal.SIGTERM, signal.SIGINT):  # OLMo-core installed its handlers just before this
            signal.signal(signum, self._noting(signal.getsignal(signum)))
        optim = getattr(self.trainer.train_module, "optim", None)
        if self.trainer.global_step == 0 and not self.trainer.checkpoint_loaded and optim is not None:
            # The step-0 checkpoint (the checkpointer runs first) read the optimizer's state through torch's
            # get_optimizer_state_dict, which creates it with one zero-gradient step: AdamW's step count 1 with
            # empty moments, so the first real update would be 0.73 x lr (its bias correction one step off).
            # The run starts with the optimizer a fresh run has, as on the ai2-olmo path.
            optim.state.clear()
        if get_rank() == 0 and self.folder is not None and self.trainer.global_step > 0:
            dropped = truncate_metrics(Path(self.folder) / METRICS_NAME, self.trainer.global_step)
            if dropped:
                log.info("metrics: dropped %d rows logged after step %d by the interrupted attempt", dropped,
                         self.trainer.global_step)

    def _noting(self, handler):
        def note(signum, frame):
            self.signal_received = signum
            if callable(handler):
                handler(signum, frame)
        return note

    def log_metrics(self, step: int, metrics: Dict[str, float]):
        self._tps = metrics.get("throughput/device/TPS", self._tps)
        loss = metrics.get("train/CE loss")
        if loss is None:
            return
        grad_norm = metrics.get("optim/total grad norm")
        self.last_loss = float(loss)
        row: Dict[str, Any] = {"step": step, "tokens": step * self.trainer.tokens_per_batch, "loss": float(loss),
                               "lr": metrics.get("optim/LR (group 0)"), "grad_norm": grad_norm,
                               "tokens_per_second_per_device": self._tps}
        if self.monitor is not None and self.diverged is None:
            try:
                self.monitor.update(step, float(loss), grad_norm)
            except Diverged as diverged:
                self.stop_diverged(diverged)
                row["diverged"] = diverged.reason
            row.update(loss_spikes=self.monitor.spike_count, grad_spikes=len(self.monitor.grad_spikes))
        row["time"] = time.time()
        row.update({k: float(v) for k, v in metrics.items() if k not in _SHOWN})  # OLMo-core's own (MoE losses ...)
        if get_rank() != 0:
            return
        if self.folder is not None:
            with open(Path(self.folder) / METRICS_NAME, "a") as f:
                f.write(json.dumps(row) + "\n")
        shown = {"train/CrossEntropyLoss": loss, "optim/total_grad_norm": grad_norm,
                 "optim/learning_rate_group0": row["lr"], "throughput/device/tokens_per_second": self._tps}
        if self.monitor is not None:
            shown.update({"stability/loss_spikes": row["loss_spikes"], "stability/grad_spikes": row["grad_spikes"]})
        log.info(step_line(step, self.trainer.max_steps or 0, {k: v for k, v in shown.items() if v is not None},
                           *self._elapsed_and_eta(step)))

    def stop_diverged(self, diverged: Diverged) -> None:
        self.diverged = diverged
        self.trainer.callbacks["checkpointer"].enabled = False  # no diverged state to resume from
        self.trainer.cancel_run(f"divergence guard: {diverged.reason}")
        log.warning("divergence guard: stopping at step %d: %s", diverged.step, diverged.reason)

    def _elapsed_and_eta(self, step: int) -> tuple:
        now = time.time()
        if self._clock is None:
            self._clock = (now, step)
        started, first = self._clock
        done = step - first
        left = max(0, (self.trainer.max_steps or step) - step)
        return now - started, ((now - started) / done * left if done > 0 else None)

    def state_dict(self) -> Dict[str, Any]:
        return {"stability": self.monitor.state_dict()} if self.monitor is not None else {}

    def load_state_dict(self, state_dict: Dict[str, Any]):
        loaded = (state_dict or {}).get("stability")
        self.restored_stability = bool(self.monitor is not None and loaded is not None
                                       and self.monitor.load_state_dict(loaded))
        if self.monitor is not None and loaded is not None and not self.restored_stability:
            log.warning("the checkpoint's divergence-guard state is malformed; the guard starts afresh")

    def outcome(self) -> Optional[BaseException]:
        """How a ``fit`` that returned normally ended early, as the run layer's exception (None: it did not):
        the guard's verdict (on every rank, from the broadcast cancel reason), or the signal that cancelled it."""
        verdict = [None if self.diverged is None else (self.diverged.step, str(self.diverged.reason),
                                                        self.diverged.kind)]
        if dist.is_initialized() and dist.get_world_size() > 1:  # every rank returned from fit: a collective is safe
            dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            return Diverged(*verdict[0])
        if self.signal_received == signal.SIGTERM:
            return Terminated(signal.SIGTERM)
        if self.signal_received == signal.SIGINT:
            return KeyboardInterrupt()
        return None


def no_decay_names(model, cfg) -> List[str]:
    """The parameters that take no weight decay, as ai2-olmo's groups place them (siamesenorm/ai2_olmo/trainer.py): only
    the weights of linear layers decay (the embedding too with ``optimizer.decay_embeddings``, norms and biases with
    ``optimizer.decay_norm_and_bias``), plus the coefficients a topology lists in ``weight_decay_params`` (hc's
    dynamic projections). An MoE's expert matrices and its router's weight are linear weights, and decay."""
    decayed = set()
    for module_name, module in model.named_modules():
        prefix = module_name + "." if module_name else ""
        if isinstance(module, (MoEMLPBase, MoERouter)):
            decayed.update(prefix + n for n, p in module.named_parameters(recurse=False) if p.dim() >= 1 and
                           not n.endswith("bias"))
        elif isinstance(module, nn.Linear):
            decayed.add(prefix + "weight")
            if module.bias is not None and cfg.optimizer.decay_norm_and_bias:
                decayed.add(prefix + "bias")
        elif isinstance(module, nn.Embedding) and cfg.optimizer.decay_embeddings:
            decayed.add(prefix + "weight")
        elif "norm" in type(module).__name__.lower() and cfg.optimizer.decay_norm_and_bias:
            decayed.update(prefix + n for n, _ in module.named_parameters(recurse=False))
        decayed.update(prefix + n for n in getattr(module, "weight_decay_params", ()))
    return [name for name, _ in model.named_parameters() if name not in decayed]


def _duration(value) -> Duration:
    """OLMo's max_duration: steps (an integer), tokens ("2e12T") or epochs ("1ep"), as OLMo-core's Duration."""
    text = str(value).strip()
    if text.endswith("T"):
        return Duration.tokens(int(float(text[:-1])))
    if text.endswith("ep"):
        return Duration.epochs(int(text[:-2]))
    return Duration.steps(int(float(text)))


def build_components(cfg, world_size: int = 1):
    """(model config, train module config, dataset config, data loader config, trainer config) for a loaded recipe,
    after the checks a run of scripts/train.py makes before step 1 (values, batch split, token files against their
    manifests and the vocabulary, one global batch of data), each a one-line ``RunError``."""
    validate_run(cfg, olmo_core=True)
    check_batch_split(cfg, world_size)
    if cfg.evaluators:
        log.warning("the OLMo-core path runs no in-loop evaluators yet; %d in the recipe skipped",
                    len(cfg.evaluators))
        cfg.evaluators = []
    check_data(cfg)  # also expands data.paths to the token files
    model = cfg.model
    seq = model.max_sequence_length
    model_config = transformer_config(model, moe=cfg.moe)
    model_config.init_seed = cfg.seed
    save_folder = str(cfg.save_folder)
    data = NumpyFSLDatasetConfig(
        paths=[str(p) for p in cfg.data.paths], sequence_length=seq, work_dir=str(Path(save_folder) / "dataset-cache"),
        tokenizer=TokenizerConfig(vocab_size=model.vocab_size, eos_token_id=model.eos_token_id,
                                  pad_token_id=model.pad_token_id),
        dtype=str(cfg.data.memmap_dtype))
    # num_threads=0: instances are read by the loader itself (or its worker processes), never by OLMo-core's
    # default four daemon threads: a run that stops before its data ends (stop_at, SIGTERM, a divergence) would
    # leave them reading, and Python kills a daemon thread inside torch's C++ at exit with std::terminate (SIGABRT,
    # "terminate called without an active exception"): a finished run reported as a crash. Same batches either way.
    loader = NumpyDataLoaderConfig(global_batch_size=cfg.global_train_batch_size * seq, seed=cfg.seed,
                                   num_workers=cfg.data.num_workers or 0, num_threads=0)
    opt = cfg.optimizer
    no_decay = no_decay_names(model_config.build(init_device="meta"), cfg)
    optim = AdamWConfig(lr=opt.learning_rate, weight_decay=opt.weight_decay, betas=tuple(opt.betas), eps=opt.eps,
                        group_overrides=[OptimGroupOverride(params=no_decay, opts=dict(weight_decay=0.0))])
    scheduler = scheduler_config(cfg)
    train_module = TransformerTrainModuleConfig(
        rank_microbatch_size=cfg.device_train_microbatch_size * seq, max_sequence_length=seq, optim=optim,
        scheduler=scheduler, max_grad_norm=cfg.max_grad_norm, z_loss_multiplier=None,
        dp_config=TransformerDataParallelConfig(name=DataParallelType.fsdp) if world_size > 1 else None)
    precision = enum_value(cfg.precision)
    if precision not in ("fp32", "amp_bf16"):
        raise ValueError(f"precision {precision}: the OLMo-core path maps fp32 and amp_bf16 (bf16 autocast); "
                         "set --precision=amp_bf16 or fp32")
    train_module.autocast_precision = DType.bfloat16 if precision == "amp_bf16" else None
    fsdp_precision = enum_value(cfg.fsdp.precision)
    if train_module.dp_config is not None and fsdp_precision in ("mixed", "pure"):
        # OLMo's FSDP precision: bf16 parameters, reductions in fp32 ("mixed") or bf16 ("pure")
        train_module.dp_config.param_dtype = DType.bfloat16
        train_module.dp_config.reduce_dtype = DType.float32 if fsdp_precision == "mixed" else DType.bfloat16
    train_module.compile_model = cfg.compile is not None  # OLMo-core compiles block by block, as ours does
    if cfg.softmax_auxiliary_loss:
        train_module.z_loss_multiplier = cfg.auxiliary_loss_multiplier
    trainer = TrainerConfig(save_folder=save_folder, work_dir=str(Path(save_folder) / "work"),
                            max_duration=_duration(cfg.max_duration), metrics_collect_interval=1, cancel_check_interval=1,
                            hard_stop=Duration.steps(int(cfg.stop_at)) if cfg.stop_at is not None else None,
                            save_overwrite=bool(cfg.save_overwrite),
                            async_bookkeeping=None if torch.cuda.is_available() else False)
    # CPU: synchronous saves (an async save's collectives on a second gloo group could interleave with training's)
    trainer = trainer.with_callback("checkpointer", CheckpointerCallback(
        save_interval=int(cfg.save_interval), ephemeral_save_interval=None,
        pre_train_checkpoint=False if cfg.no_pre_train_checkpoint else None,  # the recipe's, as OLMo's train script
        save_async=None if torch.cuda.is_available() else False))
    return model_config, train_module, data, loader, trainer


def scheduler_config(cfg) -> CosWithWarmup:
    """The recipe's ``scheduler:`` as OLMo-core's scheduler, every field our recipes set: ai2-olmo's
    ``cosine_with_warmup`` (linear warmup from ``warmup_min_lr``, which ai2-olmo takes as 0.1 x lr when unset,
    then a cosine to ``alpha_f`` x lr at ``t_max`` or the run's end) is OLMo-core's ``CosWithWarmup`` with the same
    formula. Any other scheduler is refused in one line rather than trained as a cosine."""
    sched, lr = cfg.scheduler, cfg.optimizer.learning_rate
    name, units = enum_value(sched.name), enum_value(sched.units)
    if name != "cosine_with_warmup" or units != "steps":
        raise RunError(f"scheduler {name} in {units}: the OLMo-core path maps cosine_with_warmup in steps only "
                       "(the recipes' scheduler); use scripts/train.py for this one.")
    warmup_min_lr = sched.warmup_min_lr if sched.warmup_min_lr is not None else 0.1 * lr  # ai2-olmo's default
    return CosWithWarmup(warmup=int(sched.t_warmup), alpha_f=sched.alpha_f, warmup_min_lr=warmup_min_lr,
                         t_max=None if sched.t_max is None else int(sched.t_max))


def main(recipe: str, overrides: List[str]) -> int:
    """Train from ``recipe`` with ``overrides`` (``--key=value``) through OLMo-core's Trainer; the exit status."""
    cfg = load_config(recipe, overrides)
    if not any(o.startswith("--run_name") for o in overrides or []):
        cfg.run_name = Path(cfg.save_folder).name  # one name per run folder, as on the ai2-olmo path
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    with open_run(cfg, world_size, olmo_core=True) as plan:
        if plan.action == "done":
            say_done(cfg, plan)
            return 0
        # CPU: gloo only, and no async bookkeeping (on a gloo-only group its metric reduction never returned here)
        backend = ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo") if world_size > 1 else None
        pin_cpu_threads()  # before OLMo-core's set-up, which would set OMP_NUM_THREADS=8 on any machine
        with keep_our_console():  # OLMo-core configures logging once (its handlers replace ours): then ours again
            setup_core_logging()
        prepare_training_environment(seed=cfg.seed, backend=backend)  # logs through our handlers
        try:
            return train(cfg, recipe, plan)
        finally:
            detach_run_logs()
            teardown_training_environment()


def train(cfg, recipe: str, plan: Plan) -> int:
    """Settle the folder, build OLMo-core's components and the run layer's callback, then train to the end."""
    lead = get_rank() == 0
    console_log = settle_run_folder(cfg, plan.action, plan.load_path) if lead else None
    barrier()
    previous = read_record(Path(cfg.save_folder)) if plan.action == "resume" else {}
    model_config, train_module_config, data_config, loader_config, trainer_config = build_components(
        cfg, get_world_size())
    start_weights = None
    if plan.action == "load" and is_core_checkpoint(plan.load_path):
        trainer_config.load_path = str(plan.load_path)  # OLMo-core restores its own checkpoint
    elif plan.action == "load":  # an ai2-olmo checkpoint: its weights, renamed, start this run (a fresh optimizer)
        start_weights = olmo_to_core_state(load_model_state(plan.load_path, plan.model_type), cfg.model)
    unigram = None
    if cfg.stability.unigram_loss is None and cfg.data.paths:
        unigram = unigram_loss([str(p) for p in cfg.data.paths], str(cfg.data.memmap_dtype), cfg.model.vocab_size)
    monitor = StabilityMonitor(cfg.stability, cfg.model.vocab_size, warmup_steps(cfg), unigram)
    callback = RunCallback(folder=str(cfg.save_folder), monitor=monitor if cfg.stability.enabled else None)
    trainer_config = trainer_config.with_callback("console_logger", callback)
    model = model_config.build(init_device="meta")
    n_params = sum(p.numel() for p in model.parameters())
    train_module = train_module_config.build(model)
    if start_weights is not None:  # after OLMo-core's init, so the loaded weights are what trains
        set_model_state_dict(train_module.model, start_weights, options=StateDictOptions(full_state_dict=True))
        log.info("starting from the weights of %s (ai2-olmo checkpoint; the optimizer starts fresh)", plan.load_path)
    dataset = data_config.build()
    loader = loader_config.build(dataset, dp_process_group=train_module.dp_process_group)
    if lead:
        for line in describe_run(cfg, plan, n_params, console_log, FRAMEWORK):
            log.info(line)
    info = record_info(cfg, recipe, plan, n_params, monitor, get_world_size(), FRAMEWORK)
    with checked_olmo_core_loads():  # a checkpoint from elsewhere (or planted in save_folder) runs nothing
        trainer = trainer_config.build(train_module, loader)

        def save_record(status: str, **extra: Any) -> None:
            if lead:
                write_record(cfg.save_folder, run_record(
                    info, status, step=trainer.global_step, tokens_seen=trainer.global_train_tokens_seen,
                    max_steps=trainer.max_steps or 0, tokens_per_batch=trainer.tokens_per_batch,
                    loss=callback.last_loss, monitor=callback.monitor, eval_metrics={}, eval_step=None, **extra))

        def fit() -> None:
            try:
                trainer.fit()
            except RuntimeError as err:  # OLMo-core's own check of a non-finite loss: the guard's first rule
                found = _nonfinite_loss(err)
                if found is None:
                    raise
                raise found from None
            ended = callback.outcome()
            if ended is not None:
                raise ended

        if plan.action == "resume" and previous:
            info["attempts"] = resumed_attempts(previous, _checkpoint_step(plan.load_path))
        code = train_to_the_end(fit, save_record, lambda: trainer.global_step >= (trainer.max_steps or 0),
                                monitor.convergence, Path(cfg.save_folder) / RECORD_NAME, lead)
    if lead and code == 0:
        log.info(closing_line(callback.last_loss, {}, trainer.global_step, trainer.max_steps or 0,
                              Path(cfg.save_folder) / RECORD_NAME))
    return code


def _checkpoint_step(path: Optional[str]) -> int:
    match = re.search(r"step(\d+)", Path(path or "").name)
    return int(match.group(1)) if match else 0


def _nonfinite_loss(err: BaseException) -> Optional[Diverged]:
    """OLMo-core's "nan loss encountered at step N" (raised by its metric reduction, or wrapped as "An error
    occurred" when that ran in a bookkeeping thread) as the guard's verdict."""
    while err is not None:
        match = _NONFINITE.search(str(err))
        if match:
            return Diverged(int(match.group(2)), f"non-finite loss ({match.group(1)})", "diverged")
        err = err.__cause__ or err.__context__
    return None
