"""The paper's analyses (sections 2 and 5) on our checkpoints and runs. Each returns a JSON-ready dict; plotting is
in ``plot_*``; scripts/analyze.py is the command line.

| tool          | paper        | needs                                   |
| ------------- | ------------ | --------------------------------------- |
| magnitudes    | figure 2a    | a model and evaluation tokens           |
| grad_norms    | figure 5     | run folders (metrics.jsonl)             |
| stream_ratios | figure 6     | a post_pre / hybrid_pre model           |
| lens          | section 5.2  | a multi-stream model and tokens         |
| depth         | introduction | a model and tokens (layer pruning)      |
| massive       | v1 limits    | a model and tokens (Sun et al. 2024)    |
| loss_curves   | figs 2b,4,8  | run folders (metrics.jsonl)             |

A tool that does not apply to a model (stream ratios of a single-stream model) raises NotApplicable with the
reason; the command line reports it and writes ``{"applies": false, "reason": ...}``.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from olmo.model import OLMo

from siamesenorm.analysis.figures import plot, run_events  # noqa: F401  (analysis.plot: the figure for a tool's result)
from siamesenorm.analysis.tables import format_lr, method_name
from siamesenorm.models.build import build_model
from siamesenorm.run.checkpoints import checkpoint_folder, load_model  # noqa: F401  (re-exported: analysis.load_model)
from siamesenorm.run.data import PrepareSettings, Skips, is_validation, iter_documents, load_tokenizer
from siamesenorm.run.recipe import expand_paths, load_config
from siamesenorm.run.records import RECORD_NAME, check_record, load_json_file, metrics_file, read_metrics_rows
from siamesenorm.variants._base import TopologyBlock

__all__ = [
    "NotApplicable",
    "load_model",
    "fresh_model",
    "eval_tokens",
    "perplexity",
    "hidden_magnitudes",
    "layer_streams",
    "massive_activations",
    "stream_ratios",
    "fusion_and_lens",
    "lens_agreement",
    "depth_probe",
    "read_metrics",
    "grad_norm_curves",
    "loss_curves",
]


class NotApplicable(Exception):
    """The tool does not apply to this model; the message says why."""


# ---- models and data ------------------------------------------------------------------------------------------------
def fresh_model(config_path: str, model_type: str, seed: int = 0):
    """A freshly initialised model of a recipe (the initial state of the magnitudes figure)."""
    cfg = load_config(config_path)
    cfg.model.init_device = "cpu"
    torch.manual_seed(seed)
    return build_model(cfg.model, model_type).eval(), cfg


def eval_tokens(cfg, tokens: Optional[str] = None, text: Optional[str] = None, max_sequences: int = 32,
                val_fraction: float = 0.05) -> torch.Tensor:
    """(N, max_sequence_length) token ids for evaluation, cut from consecutive tokens like OLMo's memmap dataset:
    - ``tokens``: OLMo memmap token files (globs allowed), dtype from the run's data.memmap_dtype;
    - ``text``: .txt / .jsonl[.gz] documents; only those scripts/prepare_data.py would hold out for validation
      (same hash rule and val_fraction) are used, tokenized with the run's tokenizer, EOS after each;
    - neither: the run's first lm evaluator's token files (its validation split)."""
    seq = cfg.model.max_sequence_length
    if text is not None:
        tok = load_tokenizer(cfg.tokenizer.identifier)
        ids: List[int] = []
        for doc in iter_documents(PrepareSettings(inputs=[text]), Skips()):
            if is_validation(doc, val_fraction):
                ids.extend(tok.encode(doc).ids + [cfg.model.eos_token_id])
            if len(ids) >= seq * max_sequences:
                break
        flat = np.asarray(ids, dtype=np.int64)
    else:
        if tokens is None:
            lm = [e for e in cfg.evaluators if str(e.type) == "lm"]
            if not lm:
                raise FileNotFoundError("the run has no lm evaluator: pass --tokens or --text.")
            paths = [p for group in (lm[0].data.datasets or {}).values() for p in group] or list(lm[0].data.paths)
            dtype = lm[0].data.memmap_dtype
        else:
            paths, dtype = [tokens], cfg.data.memmap_dtype

        files = expand_paths([str(p) for p in paths])
        if not files or not all(Path(f).is_file() for f in files):
            raise FileNotFoundError(f"no token files at {paths}: prepare data with scripts/prepare_data.py.")
        # like OLMo's MemMapDataset: each file is cut into whole sequences on its own, its remainder dropped
        chunks = []
        for f in files:
            arr = np.memmap(f, dtype=np.dtype(dtype), mode="r")
            chunks.append(np.asarray(arr[: len(arr) // seq * seq], dtype=np.int64))
        flat = np.concatenate(chunks)
    n = min(max_sequences, len(flat) // seq)
    if n == 0:
        raise ValueError(f"fewer than {seq} evaluation tokens: pass more data.")
    return torch.from_numpy(flat[: n * seq].reshape(n, seq).copy())


@torch.no_grad()
def perplexity(model: OLMo, batch: torch.Tensor, batch_size: int = 8) -> float:
    """exp(mean next-token cross-entropy over every predicted token of the batch)."""
    total, count = 0.0, 0
    for chunk in batch.split(batch_size):
        logits = model(chunk).logits[:, :-1].float()
        total += F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").item()
        count += chunk[:, 1:].numel()
    return math.exp(total / count)


def stream_names(model: OLMo) -> List[str]:
    return list(getattr(_blocks(model)[-1], "stream_names", ("residual",)))


def _blocks(model: OLMo) -> List[torch.nn.Module]:
    if hasattr(model.transformer, "blocks"):
        return list(model.transformer.blocks)
    return [b for group in model.transformer.block_groups for b in group]


@contextlib.contextmanager
def _captured_streams(model: OLMo):
    """Collect each block's input, the last block's output, and (multi-stream) its streams before fusion."""
    blocks = _blocks(model)
    inputs: List[torch.Tensor] = []
    outputs: List[torch.Tensor] = []
    handles = [b.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach())) for b in blocks]
    handles.append(blocks[-1].register_forward_hook(lambda m, args, out: outputs.append(out[0].detach())))
    last = blocks[-1]
    with last.capturing_streams() if isinstance(last, TopologyBlock) else contextlib.nullcontext([]) as captured:
        try:
            yield inputs, outputs, captured
        finally:
            for h in handles:
                h.remove()


# ---- figure 2a: hidden-state magnitude per layer and stream ---------------------------------------------------------
@torch.no_grad()
def layer_streams(model: OLMo, batch: torch.Tensor) -> tuple[List[str], List[List[torch.Tensor]]]:
    """(stream names, per layer the list of each stream's hidden state (B, T, d)): layer 0 is the embedding (copied
    into every stream), layer l the state after block l (the last one before the output fusion)."""
    names = stream_names(model)
    n_blocks = len(_blocks(model))
    with _captured_streams(model) as (inputs, outputs, final):
        model(batch)
    per_layer: List[List[torch.Tensor]] = [[inputs[0]] * len(names)]
    blocks = _blocks(model)
    for i in range(1, n_blocks):
        state = getattr(blocks[i], "state_streams", None)  # attnres: its sources' sum; others: the stacked streams
        per_layer.append(state(inputs[i]) if state else list(inputs[i].chunk(len(names), dim=-1)))
    per_layer.append(final[0] if final else [outputs[0]])
    return names, per_layer


def hidden_magnitudes(model: OLMo, batch: torch.Tensor) -> Dict:
    """RMS (over features, averaged over tokens and the batch) of every stream after each layer; layer 0 is the
    embedding (copied into every stream). A bounded (normalised) stream stays at its norm's scale; a Pre-Norm
    stream grows with depth."""
    names, per_layer = layer_streams(model, batch)
    rms = {name: [float(layer[j].float().pow(2).mean(-1).sqrt().mean()) for layer in per_layer]
           for j, name in enumerate(names)}
    return {"model_type": model.config.model_type, "layers": list(range(len(per_layer))), "streams": names,
            "rms": rms, "note": "layer 0 = embedding; layer l = after block l; RMS over features, mean over tokens"}


# ---- massive activations (Sun et al. 2024; the paper's stated limitation) ------------------------------------------
def massive_activations(model: OLMo, batch: torch.Tensor, top: int = 3) -> Dict:
    """Per layer and stream: the ``top`` largest activation magnitudes |h| over every token and feature, the median
    |h|, and the ratio of the largest to the median, as Sun et al. ("Massive Activations in Large Language Models",
    2024) report them (their criterion for a massive activation: |h| > 100 and about 1,000 x the median). Where
    they sit: the feature and the position (in the sequence) of the largest one."""
    names, per_layer = layer_streams(model, batch)
    out: Dict[str, Dict[str, List]] = {}
    for j, name in enumerate(names):
        rows = {"top": [], "median": [], "ratio": [], "feature": [], "position": []}
        for layer in per_layer:
            mag = layer[j].float().abs()
            values, where = mag.flatten().topk(min(top, mag.numel()))
            median = float(mag.median())
            rows["top"].append([float(v) for v in values])
            rows["median"].append(median)
            rows["ratio"].append(float(values[0]) / median if median > 0 else math.inf)
            rows["feature"].append(int(where[0] % mag.shape[-1]))
            rows["position"].append(int(where[0] // mag.shape[-1] % mag.shape[-2]))
        out[name] = rows
    return {"model_type": model.config.model_type, "layers": list(range(len(per_layer))), "streams": names,
            "massive": out, "note": "layer 0 = embedding; layer l = after block l; top |h| over all tokens and "
                                    "features; ratio = top / median |h|"}


# ---- figure 6: ratio of the two streams' input norm scales ----------------------------------------------------------
def _scale(p) -> Optional[float]:
    if p is None:
        return None
    weight = p if isinstance(p, torch.Tensor) else getattr(p, "weight", None)
    return None if weight is None else float(weight.detach().float().abs().mean())


def stream_ratios(model: OLMo) -> Dict:
    """Per layer and sublayer: mean |scale X enters with| / mean |scale Y enters with| (post_pre, hybrid_pre)."""
    blocks = _blocks(model)
    if not hasattr(blocks[0], "input_scales"):
        raise NotApplicable(
            f"stream ratios compare the two streams that feed every sublayer (post_pre, hybrid_pre); "
            f"MODEL_TYPE={model.config.model_type} has no such pair."
        )
    if not model.config.layer_norm_with_affine:
        raise NotApplicable("stream ratios read learned norm scales; this model's norms have none.")
    out: Dict[str, List[Optional[float]]] = {"attention": [], "mlp": []}
    scales: Dict[str, List] = {"attention": [], "mlp": []}
    for i, block in enumerate(blocks):
        for sub, (sx, sy) in block.input_scales(blocks[i - 1] if i > 0 else None).items():
            x, y = _scale(sx), _scale(sy)
            scales[sub].append([x, y])
            out[sub].append(None if x is None or not y else x / y)
    return {"model_type": model.config.model_type, "layers": list(range(1, len(blocks) + 1)), "ratio_x_over_y": out,
            "scales_x_y": scales, "streams": stream_names(model),
            "note": "layer l = block l (1-based; 0 would be the embedding, which has no sublayers)"}


# ---- section 5.2: fusion weights and logit lens ---------------------------------------------------------------------
def head_logits(model: OLMo, hidden: torch.Tensor) -> torch.Tensor:
    """OLMo's output head on a pre-final-norm state: ln_f, then the (tied or separate) output projection."""
    x = model.transformer.ln_f(hidden)
    if model.config.weight_tying:
        logits = F.linear(x, model.transformer.wte.weight, None)
    else:
        logits = model.transformer.ff_out(x)
    if model.config.scale_logits:
        logits = logits * (1 / math.sqrt(model.config.d_model))
    return logits


@torch.no_grad()
def lens_agreement(model: OLMo, contributions: Sequence[torch.Tensor], names: Sequence[str]) -> Dict:
    """How often each stream's own prediction (the head applied to its contribution alone) is the model's
    (the head applied to the sum), over all positions and over those where the streams disagree."""
    vocab = model.config.vocab_size
    final = head_logits(model, sum(contributions[1:], contributions[0]))[..., :vocab].argmax(-1)
    own = [head_logits(model, c)[..., :vocab].argmax(-1) for c in contributions]
    disagree = torch.zeros_like(final, dtype=torch.bool)
    for o in own[1:]:
        disagree |= o != own[0]
    result = {"positions": int(final.numel()), "disagreeing_positions": int(disagree.sum()), "match": {},
              "match_where_streams_disagree": {}}
    for name, o in zip(names, own):
        same = o == final
        result["match"][name] = float(same.float().mean())
        result["match_where_streams_disagree"][name] = float(same[disagree].float().mean()) if disagree.any() else None
    return result


@torch.no_grad()
def fusion_and_lens(model: OLMo, batch: torch.Tensor) -> Dict:
    blocks = _blocks(model)
    last = blocks[-1]
    names = stream_names(model)
    if not isinstance(last, TopologyBlock) or len(names) < 2:
        raise NotApplicable(
            f"fusion weights and the per-stream logit lens need several streams; MODEL_TYPE="
            f"{model.config.model_type} has one."
        )
    with _captured_streams(model) as (_, _, final):
        model(batch)
    contributions = last.contributions(final[0])
    return {"model_type": model.config.model_type, "streams": names,
            "fusion_weights": dict(zip(names, last.fusion_weights())),
            **lens_agreement(model, contributions, names)}


# ---- the effective-depth probe ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def layers_removed(model: OLMo, removed: Sequence[int]):
    """Within the block, the listed blocks are skipped: their sublayers contribute nothing (see TopologyBlock.skip;
    OLMo's own Pre-Norm block becomes the identity)."""
    blocks = _blocks(model)
    saved = {}
    for i in removed:
        block = blocks[i]
        saved[i] = block.forward
        skip = block.skip if isinstance(block, TopologyBlock) else (lambda x: x)
        block.forward = lambda x, *args, _skip=skip, **kwargs: (_skip(x), None)
    try:
        yield
    finally:
        for i, fwd in saved.items():
            blocks[i].forward = fwd


def depth_probe(model: OLMo, batch: torch.Tensor, max_k: Optional[int] = None) -> Dict:
    n = len(_blocks(model))
    max_k = n - 1 if max_k is None else min(max_k, n - 1)
    full = perplexity(model, batch)
    single = []
    for i in range(n):
        with layers_removed(model, [i]):
            single.append(perplexity(model, batch))
    last_k = [full]
    for k in range(1, max_k + 1):
        with layers_removed(model, range(n - k, n)):
            last_k.append(perplexity(model, batch))
    return {"model_type": model.config.model_type, "layers": n, "perplexity": full,
            "without_layer": single, "without_last_k": last_k,
            "note": "without_layer[l - 1]: layer l (block l, 1-based) removed; without_last_k[k]: the last k layers "
                    "removed; without_last_k[0] is the full model"}


# ---- figures 2b, 4, 5, 8: curves from metrics.jsonl ------------------------------------------------------------------
def read_metrics(run: str | Path) -> List[Dict]:
    """The metrics rows of a run folder (metrics.jsonl, or a study's metrics.jsonl.gz) or of a metrics file."""
    path = Path(run)
    found = metrics_file(path) if path.is_dir() else (path if path.is_file() else None)
    if found is None:
        raise FileNotFoundError(f"{path}: no metrics file (runs write metrics.jsonl into their save_folder).")
    return read_metrics_rows(found)


def run_label(run: str | Path) -> str:
    folder = Path(run) if Path(run).is_dir() else Path(run).parent
    record = folder / RECORD_NAME
    if record.is_file():
        rec = check_record(load_json_file(record, "run record"), record)
        lr = rec.get("learning_rate")
        return f"{method_name(rec)}, lr {format_lr(lr) if lr is not None else '?'}"
    return folder.name


def _curve(runs: Sequence[str | Path], key: str) -> Dict:
    """Per run: the logged steps and values of ``key``, the validation loss at each evaluation, the MODEL_TYPE (for
    its colour) and what the figure marks (the guard stopped it; its loss spikes), from metrics.jsonl and run.json."""
    curves = {}
    for run in runs:
        rows = read_metrics(run)
        logged = [r for r in rows if key in r and "step" in r]
        evals = [(r["step"], next((v for k, v in r["eval"].items() if k.endswith("/CrossEntropyLoss")), None))
                 for r in rows if isinstance(r.get("eval"), dict)]
        folder = Path(run) if Path(run).is_dir() else Path(run).parent
        file = folder / RECORD_NAME
        record = check_record(load_json_file(file, "run record"), file) if file.is_file() else {}
        label = run_label(run)
        if label in curves:
            label = f"{label} ({Path(run).name})"
        curves[label] = {"run": str(run), "model_type": record.get("model_type"), **run_events(record),
                         "steps": [r["step"] for r in logged], key: [r[key] for r in logged],
                         "val_steps": [s for s, v in evals if v is not None],
                         "val_loss": [v for s, v in evals if v is not None]}
    return {"metric": key, "runs": curves}


def grad_norm_curves(runs: Sequence[str | Path]) -> Dict:
    return _curve(runs, "grad_norm")


def loss_curves(runs: Sequence[str | Path]) -> Dict:
    return _curve(runs, "loss")

