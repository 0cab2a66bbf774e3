"""The training config: loading a recipe with overrides, and every check a run makes before its first step.

Each check fails with one line (a ``RunError``) that says what to change. ``validate_run`` is what both a real start
and ``--dry-run`` call, so a dry run refuses exactly what a real start would.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from glob import glob
from pathlib import Path
from typing import List, Optional

import numpy as np
from olmo.config import TrainConfig
from olmo.exceptions import OLMoConfigurationError
from olmo.util import clean_opt

from siamesenorm.models.config import SiameseModelConfig
from siamesenorm.run.recipe_paths import missing_recipe
from siamesenorm.run.stability import StabilityConfig, stability_problem

__all__ = ["SiameseTrainConfig", "MoESettings", "RunError", "load_config", "expand_paths", "check_data_paths",
           "validate_run", "check_data", "check_batch_split", "check_corpus_size", "check_token_files", "unigram_loss"]


@dataclass
class MoESettings:
    """``moe:`` in a recipe: every block's feed-forward becomes OLMo-core's mixture of experts (the OLMo-core path
    only, scripts/train_olmo_core.py; ai2-olmo 0.6.0 has no MoE block). The defaults are OLMoE-1B-7B's router
    and losses (OLMo-core's ``TransformerConfig.olmoe_1B_7B``: 64 experts, top 8, dropless, load-balancing loss
    0.01, router z-loss 0.001)."""

    num_experts: int = 64
    top_k: int = 8
    hidden_size: Optional[int] = None
    """Each expert's SwiGLU hidden size; null: d_model / 2 (OLMoE's proportion)."""
    shared_hidden_size: Optional[int] = None
    """A shared expert every token passes through, of this hidden size; null: none."""
    capacity_factor: Optional[float] = None
    """Each expert takes at most capacity_factor x its even share of the batch's slots (the rest are dropped);
    null: dropless."""
    lb_loss_weight: Optional[float] = 0.01
    z_loss_weight: Optional[float] = 0.001


@dataclass
class SiameseTrainConfig(TrainConfig):
    """OLMo's TrainConfig whose model section also takes model_type and the variant knobs."""

    model: SiameseModelConfig = field(default_factory=SiameseModelConfig)
    metrics_file: Optional[str] = None
    """JSON lines, one per logged step and per evaluation; default ``{save_folder}/metrics.jsonl``."""
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    """The divergence guard and the loss-spike rule (siamesenorm/run/stability.py)."""
    verify_data_sha256: bool = False
    """Before step 1, also check every token file's sha256 against its manifest (slow on large corpora)."""
    resume_on_new_data: bool = False
    """Resume even though the token files differ from the ones the run started with (data-fingerprint.json)."""
    moe: Optional[MoESettings] = None
    """A mixture-of-experts feed-forward in every block (the OLMo-core path only); null: dense."""
    loss_chunk_tokens: Optional[int] = None
    """The loss over this many tokens at a time, each chunk's fp32 logits recomputed in backward instead of kept
    (siamesenorm/nn/loss.py: the step's peak loses the full fp32 logits); null: OLMo's loss."""


class RunError(OLMoConfigurationError):
    """A problem with the run's inputs; the message says what to change."""


def _one_line(err: Exception) -> str:
    """omegaconf / OLMo errors span several lines (message, full_key, object_type): keep the message and the key."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    key = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("full_key:")), None)
    return lines[0] + (f" (at {key})" if key and key not in lines[0] else "") if lines else type(err).__name__


def load_config(path: str, overrides: Optional[List[str]] = None) -> SiameseTrainConfig:
    """Load a YAML recipe with ``--key=value`` overrides, as OLMo's CLI accepts them."""
    missing = missing_recipe(path)
    if missing:
        raise RunError(missing)
    if not Path(path).is_file():  # a pipe (process substitution, /dev/stdin): read once into a file OLMo can load
        text = Path(path).read_text()
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            f.write(text)
        path = f.name
    overrides = list(overrides or [])
    for i, option in enumerate(overrides):
        if option.startswith("--"):
            continue  # --key=value, or a bare --flag meaning true
        before = overrides[i - 1] if i else None
        if before is not None and before.startswith("--") and "=" not in before:
            raise RunError(f"write {before}={option} (with '=', no space): overrides are --key=value.")
        raise RunError(f"unexpected argument {option!r}: overrides are --key=value (no space around '=').")
    try:
        return SiameseTrainConfig.load(path, [clean_opt(o) for o in overrides], validate_paths=False)
    except OLMoConfigurationError as err:
        raise RunError(f"{path}: {_one_line(err)}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as err:
        if type(err).__module__.startswith("yaml"):
            raise
        given = " ".join(o for o in overrides if "." in o.split("=", 1)[0]) or "the overrides"
        raise RunError(f"{path}: cannot apply {given}: {_one_line(err)}; override a list as a whole "
                       "(--evaluators='[...]'), not one of its items.") from None
    except Exception as err:  # a YAML syntax error names its line and column
        if type(err).__module__.startswith("yaml"):
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise RunError(f"{path} is not valid YAML{where}: {getattr(err, 'problem', err)}.") from None
        raise


def expand_paths(paths: List[str]) -> List[str]:
    """Path patterns (``*``, ``?``, ``[``) expanded to the sorted files they match; other paths as given."""
    out: List[str] = []
    for p in paths:
        out.extend(sorted(glob(p)) if any(c in p for c in "*?[") else [p])
    return out


_HOW_TO_PREPARE = (
    "prepare data with scripts/prepare_data.py (docs/training.md, 'Data') and point data.paths "
    "(and the lm evaluators' paths) at the token files it writes"
)


# The shipped corpus as the recipes name it (configs/tiny-cpu.yaml, configs/study-cpu.yaml), and the command that
# prepares it exactly as scripts/quickstart.sh does (so that a fresh machine's sweep trains on the same tokens).
SHIPPED_CORPUS = "data/prepared/austen-2k"
PREPARE_SHIPPED_CORPUS = ("python scripts/prepare_data.py data/austen.jsonl.gz --tokenizer data/tokenizer-austen-2k.json "
                          f"--docs-per-unit 50 --output {SHIPPED_CORPUS}")


def _how_to_prepare(pattern: str) -> str:
    """What to run for missing token files: the exact command where they are the shipped corpus's, i.e. under
    data/prepared/austen-2k/ of the working directory, where that command writes them (an absolute path there
    counts; ../data/prepared/austen-2k/ does not)."""
    if Path(os.path.abspath(pattern)).is_relative_to(Path(os.path.abspath(SHIPPED_CORPUS))):
        return f"these are the shipped corpus's token files; prepare them with: {PREPARE_SHIPPED_CORPUS}"
    return _HOW_TO_PREPARE


def _data_sections(cfg: SiameseTrainConfig):
    sections = [("data.paths", cfg.data)]
    sections += [(f"evaluator {ev.label}", ev.data) for ev in cfg.evaluators if str(ev.type) == "lm"]
    return sections


def check_data_paths(cfg: SiameseTrainConfig) -> None:
    """Fail before anything starts when a training or evaluation data file is missing or is a folder; expand path
    globs (OLMo's memmap dataset takes file names only)."""
    if not (cfg.data.paths or cfg.data.datasets):
        raise RunError(f"the config names no training data (data.paths is empty): {_HOW_TO_PREPARE}.")
    for where, data in _data_sections(cfg):
        groups = [data.paths or []] + list((data.datasets or {}).values())
        for pattern in (p for group in groups for p in group):
            if "://" in str(pattern):
                continue
            found = expand_paths([str(pattern)])
            if not found or not all(Path(q).exists() for q in found):
                raise RunError(f"{where}: no data at {pattern!r}: {_how_to_prepare(str(pattern))}.")
            folder = next((q for q in found if Path(q).is_dir()), None)
            if folder is not None:
                raise RunError(f"{where}: {folder} is a folder; name its token files, e.g. {folder}/*.npy.")
        if data.paths:
            data.paths = expand_paths([str(p) for p in data.paths])
        if data.datasets:
            data.datasets = {k: expand_paths([str(p) for p in v]) for k, v in data.datasets.items()}


def manifest_for(path: Path) -> Optional[tuple[dict, str]]:
    """(manifest, the file's key in it) when ``path`` lies in a folder written by scripts/prepare_data.py."""
    for root in (path.parent.parent, path.parent):
        manifest = root / "manifest.json"
        if manifest.is_file():
            key = path.resolve().relative_to(root.resolve()).as_posix()
            return json.loads(manifest.read_text()), key
    return None


def manifest_entry(path: Path) -> Optional[dict]:
    """A token file's entry in the manifest of the prepared folder it lies in, or None."""
    try:
        found = manifest_for(path)
    except (OSError, ValueError):
        return None
    return None if found is None else found[0].get("files", {}).get(found[1])


def check_token_files(paths: List[str], memmap_dtype: str, vocab_size: int, verify_sha256: bool = False) -> None:
    """Every token file against what it must be before step 1: its dtype and size as its manifest records them
    (a truncated file or one read with the wrong dtype is refused), every token id < the model's vocab_size, and
    optionally its sha256. Files outside a prepared folder get the size and token-id checks only."""
    itemsize = np.dtype(memmap_dtype).itemsize
    for name in paths:
        path = Path(name)
        if "://" in name:
            continue
        size = path.stat().st_size
        found = manifest_for(path)
        meta = None
        if found is not None:
            manifest, key = found
            meta = manifest.get("files", {}).get(key)
            if meta is None:
                raise RunError(f"{path} is not listed in {path.parent.parent / 'manifest.json'}: a leftover file? "
                               "Rerun scripts/prepare_data.py or remove it.")
            if manifest.get("memmap_dtype") != memmap_dtype:
                raise RunError(f"{path} holds {manifest.get('memmap_dtype')} tokens (its manifest) but the config "
                               f"reads {memmap_dtype}: set data.memmap_dtype={manifest.get('memmap_dtype')}.")
            if size != meta["tokens"] * itemsize:
                raise RunError(f"{path} has {size:,d} bytes, its manifest says {meta['tokens']:,d} tokens of "
                               f"{memmap_dtype} ({meta['tokens'] * itemsize:,d} bytes): the file is truncated or "
                               "changed; rerun scripts/prepare_data.py.")
            if verify_sha256 and hashlib.sha256(path.read_bytes()).hexdigest() != meta["sha256"]:
                raise RunError(f"{path}: sha256 differs from its manifest; rerun scripts/prepare_data.py.")
        elif size == 0:
            raise RunError(f"{path} is empty: it holds no tokens; remove it from the data paths or re-prepare it.")
        elif size % itemsize:
            raise RunError(f"{path} has {size:,d} bytes, not a whole number of {memmap_dtype} tokens: check "
                           "data.memmap_dtype or the file.")
        max_id = meta.get("max_token_id") if meta else None
        if max_id is None and size:
            tokens = np.memmap(path, dtype=memmap_dtype, mode="r")
            max_id = max(int(tokens[i : i + 2**26].max()) for i in range(0, len(tokens), 2**26))
        if max_id is not None and max_id >= vocab_size:
            raise RunError(f"{path} holds token id {max_id}, but model.vocab_size is {vocab_size}: the data was "
                           "tokenized with another tokenizer, or set model.vocab_size (and embedding_size) above it.")


def unigram_loss(paths: List[str], memmap_dtype: str, vocab_size: int, max_tokens: int = 2**25) -> Optional[float]:
    """Entropy in nats of the token frequencies of ``paths`` (at most ``max_tokens`` tokens, spread evenly over the
    files): the loss of the best model that ignores context, the plateau a non-learning run sits on."""
    local = [p for p in paths if "://" not in p]
    if not local:
        return None
    counts = np.zeros(vocab_size, dtype=np.int64)
    per_file = max(1, max_tokens // len(local))
    for name in local:
        tokens = np.memmap(name, dtype=memmap_dtype, mode="r")[:per_file]
        counts += np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size)[:vocab_size]
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RunError(message)


def _numbers(value, where: str = ""):
    """(dotted key, value) for every number in a config tree."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _numbers(item, f"{where}.{i}")
    elif isinstance(value, float):
        yield where, value


def _check_moe(cfg: SiameseTrainConfig, olmo_core: bool) -> None:
    moe = cfg.moe
    _check(olmo_core, "moe: is set, and ai2-olmo 0.6.0 has no MoE block: train this recipe with "
                      "scripts/train_olmo_core.py (docs/training.md, 'The OLMo-core path'), or remove moe:.")
    _check(moe.num_experts >= 1 and 1 <= moe.top_k <= moe.num_experts,
           f"moe.top_k ({moe.top_k}) must be between 1 and moe.num_experts ({moe.num_experts}).")
    for key in ("hidden_size", "shared_hidden_size"):
        value = getattr(moe, key)
        _check(value is None or value >= 1, f"moe.{key} must be >= 1, or null (got {value}).")
    _check(moe.capacity_factor is None or moe.capacity_factor > 0,
           f"moe.capacity_factor must be > 0, or null for dropless (got {moe.capacity_factor}).")
    for key in ("lb_loss_weight", "z_loss_weight"):
        value = getattr(moe, key)
        _check(value is None or value >= 0, f"moe.{key} must be >= 0, or null for none (got {value}).")


def validate_run(cfg: SiameseTrainConfig, olmo_core: bool = False) -> None:
    """The values a run cannot start with, each as one line. Model-type specifics: config.validate_model_config.
    ``olmo_core``: the run trains on the OLMo-core path (which alone builds ``moe:``)."""
    for key, value in _numbers(cfg.asdict()):
        _check(math.isfinite(value), f"{key} is {value}: every number in the config must be finite; give it a real "
                                     "value (or null where the field allows it).")
    m = cfg.model
    _check(m.d_model > 0 and m.n_heads > 0 and m.d_model % m.n_heads == 0,
           f"model.d_model ({m.d_model}) must be a positive multiple of model.n_heads ({m.n_heads}).")
    _check(m.n_layers >= 1, f"model.n_layers must be >= 1 (got {m.n_layers}).")
    _check(m.vocab_size >= 1 and (m.embedding_size is None or m.embedding_size >= m.vocab_size),
           f"model.embedding_size ({m.embedding_size}) must be >= model.vocab_size ({m.vocab_size}).")
    lr = cfg.optimizer.learning_rate
    _check(isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0,
           f"optimizer.learning_rate must be a positive number (got {lr}).")
    _check(cfg.optimizer.weight_decay >= 0, f"optimizer.weight_decay must be >= 0 (got {cfg.optimizer.weight_decay}).")
    _check(cfg.optimizer.eps > 0, f"optimizer.eps must be > 0 (got {cfg.optimizer.eps}).")
    betas = tuple(cfg.optimizer.betas)
    _check(len(betas) == 2 and all(0 <= b < 1 for b in betas),
           f"optimizer.betas must be two numbers in [0, 1) (got {list(betas)}).")
    sch = cfg.scheduler
    _check(sch.t_warmup >= 0, f"scheduler.t_warmup must be >= 0 (got {sch.t_warmup}).")
    _check(sch.alpha_f is None or 0 <= sch.alpha_f <= 1, f"scheduler.alpha_f must be in [0, 1] (got {sch.alpha_f}).")
    _check(sch.t_max is None or sch.t_max > 0, f"scheduler.t_max must be > 0 (got {sch.t_max}).")
    _check(cfg.max_grad_norm is None or cfg.max_grad_norm > 0,
           f"max_grad_norm must be > 0, or null for no clipping (got {cfg.max_grad_norm}).")
    _check(m.init_std > 0, f"model.init_std must be > 0 (got {m.init_std}).")
    _check(cfg.loss_chunk_tokens is None or cfg.loss_chunk_tokens >= 1,
           f"loss_chunk_tokens must be >= 1, or null for OLMo's loss (got {cfg.loss_chunk_tokens}).")
    _check(cfg.loss_chunk_tokens is None or not cfg.fused_loss,
           "loss_chunk_tokens and fused_loss are two replacements of the loss; set one of them.")
    problem = stability_problem(cfg.stability)
    _check(problem is None, problem or "")
    if cfg.moe is not None:
        _check_moe(cfg, olmo_core)
    _check(cfg.global_train_batch_size >= 1 and cfg.device_train_microbatch_size >= 1,
           "global_train_batch_size and device_train_microbatch_size must be >= 1.")
    try:
        duration = str(cfg.max_duration)
        value = float(duration[:-2] if duration.endswith("ep") else duration.rstrip("T"))
        _check(value > 0, f"max_duration must be positive (got {cfg.max_duration}).")
    except ValueError:
        raise RunError(f"max_duration {cfg.max_duration!r} is not steps (300), tokens (2e9T) or epochs (1ep).") from None
    _check(cfg.save_folder is not None, "save_folder is not set; pass --save_folder=runs/NAME.")
    if cfg.compile is not None and str(cfg.distributed_strategy) == "fsdp":
        _check(cfg.fsdp.use_orig_params, "compile: with FSDP needs fsdp.use_orig_params: true (set it, or drop compile:).")


def check_batch_split(cfg: SiameseTrainConfig, world_size: int) -> None:
    _check(cfg.global_train_batch_size % world_size == 0,
           f"global_train_batch_size ({cfg.global_train_batch_size}) must be divisible by the number of processes "
           f"({world_size}).")
    per_device = cfg.global_train_batch_size // world_size
    micro = cfg.device_train_microbatch_size
    fit = max(m for m in range(1, min(micro, per_device) + 1) if per_device % m == 0)
    _check(per_device % micro == 0,
           f"the per-process batch ({cfg.global_train_batch_size} sequences over {world_size} processes = "
           f"{per_device}) must be a multiple of device_train_microbatch_size ({micro}): pass "
           f"--device_train_microbatch_size={fit}.")


def check_corpus_size(cfg: SiameseTrainConfig) -> None:
    """The training token files hold at least one global batch of sequences (OLMo divides by their count)."""
    paths = [str(p) for p in cfg.data.paths or []]
    if not paths or any("://" in p for p in paths):
        return
    seq, itemsize = cfg.model.max_sequence_length, np.dtype(str(cfg.data.memmap_dtype)).itemsize
    sequences = sum(Path(p).stat().st_size // itemsize // seq for p in paths)
    _check(sequences >= cfg.global_train_batch_size,
           f"the training data hold {sequences:,d} sequences of {seq} tokens, fewer than one global batch "
           f"({cfg.global_train_batch_size}): prepare more data (scripts/prepare_data.py) or lower "
           "global_train_batch_size.")


def check_data(cfg: SiameseTrainConfig) -> None:
    """The data paths exist and are files, every token file matches its manifest and the vocabulary, and they hold
    at least one global batch (nothing here depends on the run folder)."""
    check_data_paths(cfg)
    for _, data in [("data", cfg.data)] + [(ev.label, ev.data) for ev in cfg.evaluators if str(ev.type) == "lm"]:
        paths = list(data.paths or []) + [p for group in (data.datasets or {}).values() for p in group]
        check_token_files([str(p) for p in paths], str(data.memmap_dtype), cfg.model.vocab_size,
                          cfg.verify_data_sha256)
    check_corpus_size(cfg)  # after the files' own checks, which name the file at fault
