"""Train any MODEL_TYPE with OLMo-core's own machinery, from one of our recipes.

``python scripts/train_olmo_core.py RECIPE.yaml [--key=value ...]`` (or under ``torchrun``) reads the same recipe
files as the ai2-olmo path (``load_config``: the same overrides and checks before step 1) and builds OLMo-core's
components from them: the model from ``transformer_config`` (``MODEL_TYPE`` selects the block), OLMo-core's
``NumpyFSLDataset`` over the recipe's token files, its ``TransformerTrainModule`` (AdamW, cosine schedule with
warmup, gradient clipping, z-loss; FSDP over the data-parallel processes when launched with more than one), and its
``Trainer`` with its checkpointer: rerunning the same command resumes from the latest checkpoint in
``save_folder`` (OLMo-core's ``load_strategy: if_available``). Each step's loss lands in ``metrics.jsonl``.

What it maps (and what it does not) is in docs/training.md, "The OLMo-core path".
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.nn as nn
from olmo_core.config import DType
from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
from olmo_core.distributed.parallel import DataParallelType
from olmo_core.distributed.utils import get_rank
from olmo_core.nn.moe import MoERouter
from olmo_core.nn.moe.mlp import MoEMLPBase
from olmo_core.optim import AdamWConfig, CosWithWarmup, OptimGroupOverride
from olmo_core.train import Duration, TrainerConfig, prepare_training_environment, teardown_training_environment
from olmo_core.train.callbacks import Callback, CheckpointerCallback
from olmo_core.train.train_module import TransformerDataParallelConfig, TransformerTrainModuleConfig

from siamesenorm.olmo_core.config import enum_value, transformer_config  # checks the OLMo-core release first
from siamesenorm.run.folder import FINGERPRINT_NAME, check_same_data, data_fingerprint
from siamesenorm.run.process import pin_cpu_threads
from siamesenorm.run.recipe import RunError, check_batch_split, check_data, load_config, validate_run
from siamesenorm.run.safeload import checked_olmo_core_loads

log = logging.getLogger(__name__)

__all__ = ["main", "build_components", "MetricsFileCallback", "no_decay_names", "keep_data_fingerprint"]


@dataclass
class MetricsFileCallback(Callback):
    """Appends each step's metrics to ``<save_folder>/metrics.jsonl`` (rank 0), one JSON object per line, and on a
    resume drops the lines of steps after the checkpoint (they are trained again)."""

    path: Optional[str] = None

    def pre_train(self):
        if self.path is None or get_rank() != 0:
            return
        file = Path(self.path)
        if file.is_file():
            kept = [line for line in file.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= self.trainer.global_step]
            file.write_text("".join(line + "\n" for line in kept))

    def log_metrics(self, step: int, metrics: Dict[str, float]):
        if self.path is None or get_rank() != 0:
            return
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


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
    loader = NumpyDataLoaderConfig(global_batch_size=cfg.global_train_batch_size * seq, seed=cfg.seed,
                                   num_workers=cfg.data.num_workers or 0)
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
        save_async=None if torch.cuda.is_available() else False))
    trainer = trainer.with_callback("metrics_file", MetricsFileCallback(path=str(Path(save_folder) / "metrics.jsonl")))
    return model_config, train_module, data, loader, trainer


def keep_data_fingerprint(cfg) -> None:
    """As on the ai2-olmo path: a run that resumes (a checkpoint in save_folder) must see the token files it
    started with (``check_same_data``: size and the files' own bytes; ``--resume_on_new_data`` to continue on
    others); a fresh run writes their fingerprint (rank 0)."""
    folder = Path(cfg.save_folder)
    if any(folder.glob("step*/model_and_optim/.metadata")):
        check_same_data(cfg)
    elif get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / FINGERPRINT_NAME).write_text(json.dumps(data_fingerprint(cfg), indent=1) + "\n")


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


def main(recipe: str, overrides: List[str]) -> None:
    """Train from ``recipe`` with ``overrides`` (``--key=value``) through OLMo-core's Trainer."""
    cfg = load_config(recipe, overrides)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # CPU: gloo only, and no async bookkeeping (on a gloo-only group its metric reduction never returned here)
    backend = ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo") if world_size > 1 else None
    pin_cpu_threads()  # before OLMo-core's set-up, which would set OMP_NUM_THREADS=8 on any machine
    prepare_training_environment(seed=cfg.seed, backend=backend)
    try:
        model_config, train_module_config, data_config, loader_config, trainer_config = build_components(cfg, world_size)
        keep_data_fingerprint(cfg)
        model = model_config.build(init_device="meta")
        train_module = train_module_config.build(model)
        dataset = data_config.build()
        loader = loader_config.build(dataset, dp_process_group=train_module.dp_process_group)
        with checked_olmo_core_loads():  # a checkpoint from elsewhere (or planted in save_folder) runs nothing
            trainer = trainer_config.build(train_module, loader)
            trainer.fit()
    finally:
        teardown_training_environment()
