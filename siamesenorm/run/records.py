"""The per-run record that make_tables reads (``run.json``), and the hashes and labels that group runs into cells.

The run record, ``{save_folder}/run.json``, is written when training starts (status ``running``), rewritten at
every evaluation and at the end: ``finished`` (the token budget was reached), ``diverged`` or ``stopped`` (ended
earlier: stop_at, cancellation, an error or an interrupt).
The divergence guard whose verdicts it records is siamesenorm/run/stability.py.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Dict, Optional

__all__ = [
    "RECORD_NAME",
    "load_json_file",
    "check_record",
    "check_metrics_row",
    "config_hash",
    "recipe_hash",
    "write_record",
    "read_record",
    "DOWNSTREAM_LABELS",
    "METRICS_NAME",
    "METRICS_COMPRESSED",
    "metrics_file",
    "read_metrics_rows",
    "compress_metrics",
]

RECORD_NAME = "run.json"
#: A run writes its metrics as JSON lines; a study's results keep them gzip-compressed (the readers take either).
METRICS_NAME = "metrics.jsonl"
METRICS_COMPRESSED = METRICS_NAME + ".gz"
#: A metrics file from elsewhere is read to at most this many bytes (decompressed): a bound, not a size any run
#: here approaches (the longest study run's file is under 1 MB).
MAX_METRICS_BYTES = 1 << 30
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


# ---- the run record ---------------------------------------------------------------------------------------------
#: SiameseModelConfig's own fields (model_type and the variant knobs) pick the cell, not the recipe; so does the
#: initialisation, which the paper chose per method (the OLMo-1B-hybrid-* recipes differ from OLMo-1B-* only there).
#: (A function: the configs import OLMo, which this module leaves to the commands that need it.)
@functools.lru_cache(maxsize=1)
def _variant_fields() -> frozenset:
    from olmo.config import ModelConfig

    from siamesenorm.models.config import SiameseModelConfig

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

    from siamesenorm.models.config import KNOB_OWNERS, SiameseModelConfig

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


# ---- reading records from elsewhere ----------------------------------------------------------------------------------
MAX_JSON_FILE_BYTES = 64 * 2**20
MAX_NESTING = 32
_NUMBER = (int, float)
#: What the tools (make_tables, analyze, study_report, sweep, evaluate) read from a record, and what each must be
#: when present (None is always allowed). A dict's values: numbers (perplexity, downstream) or anything plain.
RECORD_TYPES: Dict[str, tuple] = {
    "model_type": (str,), "status": (str,), "learning_rate": _NUMBER, "val_perplexity": _NUMBER,
    "perplexity": (dict,), "downstream": (dict,), "spikes": (list,), "grad_spikes": (list,), "seed": (int,),
    "step": (int,), "final_train_loss": _NUMBER, "final_mean_loss": _NUMBER, "loss_spikes": (int,),
    "variant_knobs": (dict,), "recipe_hash": (str,), "config_hash": (str,), "parameters": (int,),
    "tokens_seen": (int,), "eval_step": (int,), "converged": (bool,), "world_size": (int,), "attempts": (list,),
    "max_steps": (int,), "token_budget": (int,), "unigram_loss": _NUMBER, "run_name": (str,), "stability": (dict,),
    "evaluation": (dict,), "max_batches": (int,), "examples": (dict,), "framework": (str,)}
_NUMBER_TABLES = ("perplexity", "downstream")


def _kind(value) -> str:
    return "true/false" if isinstance(value, bool) else type(value).__name__


def _nesting(value) -> int:
    """The depth of nested lists and dicts in ``value`` (iteratively: no recursion for a hostile file)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth > MAX_NESTING:
                return depth
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def load_json_file(path: Path, what: str) -> Any:
    """A JSON file from a run folder: at most MAX_JSON_FILE_BYTES, nested at most MAX_NESTING deep; ValueError
    naming the file otherwise."""
    size = path.stat().st_size
    if size > MAX_JSON_FILE_BYTES:
        raise ValueError(f"{path}: {size:,d} bytes, more than a {what} holds.")
    try:
        value = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{path}: not a JSON {what} ({type(e).__name__}).") from None
    if _nesting(value) > MAX_NESTING:
        raise ValueError(f"{path}: nested deeper than {MAX_NESTING} levels; not a {what}.")
    return value


def check_record(record: Any, path: Path) -> Dict[str, Any]:
    """``record`` if it is an object whose known fields (RECORD_TYPES) have their types; ValueError naming the file
    and the first field that does not."""
    if not isinstance(record, dict):
        raise ValueError(f"{path}: a JSON {_kind(record)}, not a run record (an object).")
    for name, types in RECORD_TYPES.items():
        value = record.get(name)
        if value is None:
            continue
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            raise ValueError(f"{path}: field {name} is {_kind(value)} {str(value)[:40]!r}; a record holds "
                             f"{' or '.join(t.__name__ for t in types)} there.")
    for name in _NUMBER_TABLES:
        for key, value in (record.get(name) or {}).items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, _NUMBER)):
                raise ValueError(f"{path}: field {name}.{key} is {_kind(value)}; a record holds numbers there.")
    return record


def check_metrics_row(row: Any, where: str) -> Dict[str, Any]:
    """A metrics.jsonl line: an object whose ``step`` is an integer and whose other values are numbers (or, for
    ``eval``, an object of numbers); ValueError naming the file and line otherwise."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a JSON {_kind(row)}, not a metrics line (an object).")
    for key, value in row.items():
        if key == "eval" and isinstance(value, dict):
            bad = [k for k, v in value.items() if v is not None and (isinstance(v, bool) or not isinstance(v, _NUMBER))]
        else:
            bad = [] if value is None or (not isinstance(value, bool) and isinstance(value, _NUMBER)) else [key]
            if key == "step" and not (isinstance(value, int) and not isinstance(value, bool)):
                bad = ["step"]
        if bad:
            raise ValueError(f"{where}: field {bad[0]} is not a number; not a metrics line of this project.")
    return row


def read_record(path: str | Path) -> Dict[str, Any]:
    """A run record from a run.json file or the run folder holding one."""
    path = Path(path)
    if path.is_dir():
        path = path / RECORD_NAME
    try:
        record = check_record(load_json_file(path, "run record"), path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no run record (runs write {RECORD_NAME} into their save_folder).") from None
    missing = [k for k in ("model_type", "learning_rate", "status") if k not in record]
    if missing:
        raise ValueError(f"{path}: run record lacks {', '.join(missing)}.")
    record.setdefault("path", str(path))
    saved_config = path.parent / "config.yaml"
    if "recipe_hash" not in record and saved_config.is_file():  # a record written before recipe_hash existed
        from siamesenorm.run.checkpoints import load_saved_config

        cfg = load_saved_config(saved_config)
        record["recipe_hash"] = recipe_hash(cfg)
        record.setdefault("seed", cfg.seed)
    return record


def metrics_file(folder: str | Path) -> Optional[Path]:
    """The run folder's metrics file: metrics.jsonl as the run writes it, else a study's metrics.jsonl.gz; None."""
    for name in (METRICS_NAME, METRICS_COMPRESSED):
        if (Path(folder) / name).is_file():
            return Path(folder) / name
    return None


def read_metrics_rows(path: str | Path) -> list:
    """Every row of a metrics file (.jsonl or .jsonl.gz), each checked as a metrics line; ValueError naming the
    file and line for a cut line, a line of the wrong shape, or more than MAX_METRICS_BYTES of text."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    rows, read = [], 0
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                read += len(line)
                if read > MAX_METRICS_BYTES:
                    raise ValueError(f"{path}: more than {MAX_METRICS_BYTES:,d} bytes of metrics; not a metrics file "
                                     "of this project.")
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except (json.JSONDecodeError, RecursionError):
                    raise ValueError(f"{path}:{n}: not JSON; a metrics line was cut (the run may still be "
                                     "writing).") from None
                rows.append(check_metrics_row(row, f"{path}:{n}"))
    except (OSError, EOFError, UnicodeDecodeError) as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise ValueError(f"{path}: not a readable metrics file ({type(err).__name__}: {err}).") from None
    return rows


def compress_metrics(source: str | Path, target: str | Path) -> Path:
    """``source`` (metrics.jsonl) gzip-compressed into ``target``, the same bytes for the same input (no name or
    time in the header), written to a temporary file first so a kill leaves no half file."""
    target = Path(target)
    partial = target.with_name(target.name + ".partial")
    with open(source, "rb") as f, open(partial, "wb") as raw:
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz:
            while chunk := f.read(1 << 20):
                gz.write(chunk)
    os.replace(partial, target)
    return target
