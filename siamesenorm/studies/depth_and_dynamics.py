"""The CPU study's second part: the paper v2's claims at small scale, from studies/cpu-depth-dynamics/sweep.yaml.

``report(results)`` gives every number studies/cpu-depth-dynamics/README.md quotes; ``figures`` draws PPL against depth, the
fusion weights and logit lens over training, and the massive activations per layer. Cells are read with
study.load_cells; each cell's shape and schedule come from its saved config.yaml (ours, written by the run).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Dict, List, Optional

import yaml

from siamesenorm.analysis.figures import (
    LAYER_AXIS,
    LEGEND_PT,
    colour,
    integer_ticks,
    method_label,
    pyplot,
    readable_log,
    save,
    stream_label,
)
from siamesenorm.analysis.tables import METHOD_NAMES, format_lr
from siamesenorm.studies.lr_grid import load_cells

__all__ = ["cell_setting", "report", "figures"]

BASE_DEPTH = 16  # configs/study-cpu.yaml


def cell_setting(cell: Dict, results: Path) -> Dict:
    """model type, depth, width, warmup, steps, seed, lr and knobs of a cell (from its config.yaml)."""
    config = yaml.safe_load((results / cell["name"] / "config.yaml").read_text())
    rec, model = cell["record"], config["model"]
    return {"model_type": rec["model_type"], "depth": config["model"]["n_layers"], "width": config["model"]["d_model"],
            "warmup": config["scheduler"]["t_warmup"], "steps": int(str(config["max_duration"])),
            "seed": rec.get("seed"), "lr": rec["learning_rate"], "knobs": rec.get("variant_knobs") or {},
            "non_embedding": rec.get("parameters", 0) - 2 * model["embedding_size"] * model["d_model"]}


def _ppl(cell: Dict) -> Optional[float]:
    return None if cell["record"]["status"] == "diverged" else cell["record"].get("val_perplexity")


def _spread(values: List[Optional[float]]) -> Dict:
    alive = [v for v in values if v is not None]
    return {"n": len(values), "diverged": sum(v is None for v in values), "values": values,
            "mean": statistics.mean(alive) if alive else None,
            "sd": statistics.stdev(alive) if len(alive) > 1 else None}


def _quarter_pruned(cell: Dict) -> Optional[Dict]:
    depth = cell["analysis"].get("depth") or {}
    if not depth.get("applies"):
        return None
    n = depth["layers"]
    k = max(1, n // 4)
    return {"removed": k, "full": depth["perplexity"], "pruned": depth["without_last_k"][k],
            "ratio": depth["without_last_k"][k] / depth["perplexity"]}


def report(results: str | Path, earlier: Optional[str | Path] = None, base_depth: int = BASE_DEPTH,
           base_warmup: int = 100, base_steps: int = 1000, lr: float = 1e-2) -> Dict:
    """Per part of the sweep, the numbers its verdict rests on. ``earlier``: the first study's results, whose seed-1
    cells join the seed groups (post_pre at 3e-2). The base_* and lr: the study recipe's (configs/study-cpu.yaml)."""
    results = Path(results)
    cells = [(c, cell_setting(c, results)) for c in load_cells(results)]
    base = [(c, s) for c, s in cells if s["warmup"] == base_warmup and s["steps"] == base_steps and not s["knobs"]]

    depth: Dict[str, Dict] = {}
    for c, s in base:
        if s["lr"] != lr:
            continue
        row = depth.setdefault(s["model_type"], {}).setdefault(str(s["depth"]), {
            "width": s["width"], "non_embedding": s["non_embedding"], "ppl": [], "quarter_pruned": []})
        row["ppl"].append(_ppl(c))
        row["quarter_pruned"].append(_quarter_pruned(c))
    for per_depth in depth.values():
        for row in per_depth.values():
            row["ppl"] = _spread(row["ppl"])

    seeds: Dict[str, Dict] = {}
    extra = []
    if earlier is not None and Path(earlier).is_dir():
        wanted = ("post_pre", 3e-2, 1)  # the seed-1 cell of post_pre at 3e-2 ran in the first study
        extra = [c for c in load_cells(earlier) if not c["record"].get("variant_knobs")
                 and (c["record"]["model_type"], c["record"]["learning_rate"], c["record"].get("seed")) == wanted]
    for c, s in base + [(c, {"model_type": "post_pre", "lr": 3e-2, "depth": base_depth}) for c in extra]:
        if s["depth"] == base_depth:
            seeds.setdefault(f"{s['model_type']} lr {format_lr(s['lr'])}", []).append(_ppl(c))
    seeds = {k: _spread(v) for k, v in seeds.items()}

    warmup: Dict[str, Dict] = {}
    for c, s in cells:
        if s["depth"] != base_depth or s["steps"] != base_steps or s["lr"] != lr or s["seed"] != 1:
            continue
        label = s["model_type"] + ("" if not s["knobs"] else " " + " ".join(f"{k}={v}" for k, v in s["knobs"].items()))
        rec = c["record"]
        warmup.setdefault(label, {})[str(s["warmup"])] = {
            "status": rec["status"], "ppl": _ppl(c), "loss_spikes": rec.get("loss_spikes", 0),
            "divergence": rec.get("divergence"), "diverged_at_step": rec.get("diverged_at_step")}

    over_time = {}
    for c, _ in cells:
        steps_file = results / c["name"] / "analysis-steps.json"
        if not steps_file.is_file():
            continue
        per_step = json.loads(steps_file.read_text())
        over_time[c["name"]] = {
            step: {"fusion_weights": (a.get("lens") or {}).get("fusion_weights"),
                   "lens_match": (a.get("lens") or {}).get("match"),
                   "lens_match_where_disagree": (a.get("lens") or {}).get("match_where_streams_disagree"),
                   "perplexity": (a.get("depth") or {}).get("perplexity")}
            for step, a in sorted(per_step.items(), key=lambda kv: int(kv[0]))}

    massive = {}
    for c, s in base:
        m = c["analysis"].get("massive") or {}
        if not m.get("applies") or s["depth"] != base_depth or s["seed"] != 1 or s["lr"] != lr:
            continue
        massive[s["model_type"]] = {
            stream: {"max_ratio": max(v["ratio"][1:]), "at_layer": 1 + v["ratio"][1:].index(max(v["ratio"][1:])),
                     "max_value": max(t[0] for t in v["top"][1:]), "ratio": v["ratio"], "top": [t[0] for t in v["top"]]}
            for stream, v in m["massive"].items()}
    return {"cells": len(cells), "depth": depth, "seeds": seeds, "warmup": warmup, "over_time": over_time,
            "massive": massive}


def figures(summary: Dict, out: str | Path, fmt: str = "png") -> List[Path]:
    """PPL against depth (mean and each seed), fusion weights and lens agreement over training, massive activations
    (largest |h| / median |h|) per layer; conventions: siamesenorm/analysis/figures.py."""
    plt = pyplot()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    order = list(METHOD_NAMES)
    if summary["depth"]:
        fig, ax = plt.subplots(figsize=(5.2, 3.8))
        for mt in sorted(summary["depth"], key=order.index):
            rows = sorted(summary["depth"][mt].items(), key=lambda kv: int(kv[0]))
            xs = [int(d) for d, r in rows if r["ppl"]["mean"] is not None]
            ax.plot(xs, [r["ppl"]["mean"] for _, r in rows if r["ppl"]["mean"] is not None], marker="o", ms=4,
                    color=colour(mt), label=method_label(mt))
            for d, r in rows:
                alive = [v for v in r["ppl"]["values"] if v is not None]
                ax.scatter([int(d)] * len(alive), alive, s=10, color=colour(mt), alpha=0.5)
        ax.set(xlabel="layers (about 0.66M non-embedding parameters at every depth)",
               ylabel="validation perplexity", title="Depth at fixed parameters, lr 1e-2")
        readable_log(ax, "x")
        ax.set_xticks([4, 8, 16, 32, 64], labels=["4", "8", "16", "32", "64"])
        ax.legend(fontsize=LEGEND_PT)
        written.append(save(fig, out / f"v2-depth.{fmt}", "line: mean over seeds; dots: each seed."))
    for name, steps in summary["over_time"].items():
        fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
        xs = [int(s) for s in steps]
        streams = list(next(iter(steps.values()))["fusion_weights"] or {})
        for i, stream in enumerate(streams):
            ls = ("-", "--")[i % 2]
            left.plot(xs, [steps[s]["fusion_weights"][stream] for s in steps], ls=ls, marker="o", ms=4,
                      color="tab:green", label=stream_label(stream))
            right.plot(xs, [steps[s]["lens_match"][stream] for s in steps], ls=ls, marker="o", ms=4,
                       color="tab:green", label=stream_label(stream))
        left.set(xlabel="step", ylabel="output fusion weight", title="Fusion weights over training")
        right.set(xlabel="step", ylabel="agreement with the model's prediction", title="Logit lens per stream")
        for ax in (left, right):
            ax.legend(fontsize=LEGEND_PT)
        written.append(save(fig, out / f"v2-over-time-{name}.{fmt}", "Each point: the checkpoint at that step."))
    if summary["massive"]:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for mt in sorted(summary["massive"], key=order.index):
            for i, (stream, v) in enumerate(summary["massive"][mt].items()):
                label = method_label(mt) + ("" if len(summary["massive"][mt]) == 1 else f": {stream_label(stream)}")
                ax.plot(range(len(v["ratio"])), v["ratio"], color=colour(mt), ls=("-", "--")[i % 2], marker="o",
                        ms=3, label=label)
        ax.set(xlabel=LAYER_AXIS, ylabel="largest |h| / median |h|",
               title="Massive activations, lr 1e-2, depth 16")
        integer_ticks(ax)
        readable_log(ax)
        ax.legend(fontsize=LEGEND_PT)
        written.append(save(fig, out / f"v2-massive.{fmt}", "On 32 validation sequences, final checkpoints."))
    return written
