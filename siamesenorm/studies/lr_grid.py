"""The CPU study's report: from the sweep's results folder to the table, the figures and the seven claims' numbers.

Every number studies/cpu-lr-grid/README.md quotes comes from ``report(results)``; ``python scripts/study_report.py`` writes
it as JSON and Markdown next to the figures, so the page can be regenerated as cells finish.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from siamesenorm.analysis.figures import (
    LAYER_AXIS,
    LEGEND_PT,
    SPARSE,
    colour,
    integer_ticks,
    linestyle,
    mark_events,
    marks_caption,
    method_label,
    moving_average,
    pyplot,
    readable_log,
    run_events,
    save,
    stream_label,
)
from siamesenorm.analysis.tables import METHOD_NAMES, build_table, format_lr, method_name, to_markdown
from siamesenorm.run.records import RECORD_NAME, check_record, load_json_file, metrics_file, read_metrics_rows

__all__ = ["load_cells", "report", "figures"]

def load_cells(results: str | Path) -> List[Dict]:
    """Every finished or diverged cell: its record, metrics rows and analyses. ValueError (one line, naming the
    file and field) for a record, metrics line or analysis that is not what a run writes, or for a folder that
    holds no cell at all."""
    if not any(Path(results).glob(f"*/{RECORD_NAME}")):
        raise ValueError(f"{results}: no cell folders with a {RECORD_NAME}; not a sweep's results folder (the "
                         "plan's results:, e.g. studies/cpu-lr-grid/results).")
    cells = []
    for record_path in sorted(Path(results).glob(f"*/{RECORD_NAME}")):
        record = check_record(load_json_file(record_path, "run record"), record_path)
        if record.get("status") not in ("finished", "diverged"):
            continue
        folder = record_path.parent
        metrics = metrics_file(folder)
        rows = read_metrics_rows(metrics) if metrics else []
        file = folder / "analysis.json"
        analyses = load_json_file(file, "record of analyses") if file.is_file() else {}
        if not isinstance(analyses, dict):
            raise ValueError(f"{file}: a JSON {type(analyses).__name__}, not an analysis record (an object).")
        cells.append({"name": folder.name, "record": record, "rows": rows, "analysis": analyses,
                      "path": str(record_path)})
    return cells


def _key(cell: Dict) -> str:
    return method_name(cell["record"])


def _ppl(cell: Dict) -> Optional[float]:
    rec = cell["record"]
    return None if rec["status"] == "diverged" else rec.get("val_perplexity")


def _post_warmup(cell: Dict, key: str) -> List[float]:
    warmup = cell["record"].get("stability", {}).get("grace_steps") or 0
    return [r[key] for r in cell["rows"] if key in r and r[key] is not None and r.get("step", 0) > warmup]


def report(results: str | Path) -> Dict:
    """The table and, per claim, the numbers it is judged on (no verdicts: studies/cpu-lr-grid/README.md states them)."""
    cells = load_cells(results)
    by = {}
    for c in cells:
        by.setdefault((_key(c), c["record"]["learning_rate"]), []).append(c)
    lrs = sorted({c["record"]["learning_rate"] for c in cells})
    methods = sorted({_key(c) for c in cells}, key=lambda m: list(METHOD_NAMES.values()).index(m)
                     if m in METHOD_NAMES.values() else 99)

    def cell_summary(method: str, lr: float) -> Optional[Dict]:
        group = by.get((method, lr))
        if not group:
            return None
        ppls = [_ppl(c) for c in group]
        alive = [p for p in ppls if p is not None]
        grads = [g for c in group for g in _post_warmup(c, "grad_norm")]
        return {
            "seeds": len(group),
            "diverged": sum(p is None for p in ppls),
            "divergence_kinds": [c["record"].get("divergence_kind") for c in group if c["record"]["status"] == "diverged"],
            "ppl_mean": statistics.mean(alive) if alive else None,
            "ppl_sd": statistics.stdev(alive) if len(alive) > 1 else None,
            "loss_spikes": sum(c["record"].get("loss_spikes", 0) for c in group),
            "grad_spikes": sum(len(c["record"].get("grad_spikes") or []) for c in group),
            "grad_norm_median_after_warmup": statistics.median(grads) if grads else None,
            "grad_norm_max_after_warmup": max(grads) if grads else None,
        }

    grid = {m: {format_lr(lr): cell_summary(m, lr) for lr in lrs} for m in methods}
    analyses = {}
    for c in cells:
        a = c["analysis"]
        if not a:
            continue
        analyses[c["name"]] = {
            "magnitudes": a.get("magnitudes", {}).get("rms"),
            "fusion_weights": a.get("lens", {}).get("fusion_weights"),
            "lens_match": a.get("lens", {}).get("match"),
            "lens_match_where_disagree": a.get("lens", {}).get("match_where_streams_disagree"),
            "depth_full": a.get("depth", {}).get("perplexity"),
            "depth_without_last_k": a.get("depth", {}).get("without_last_k"),
            "stream_ratios": a.get("stream_ratios", {}).get("ratio_x_over_y"),
        }
    best = {}
    for m in methods:
        options = [(s["ppl_mean"], lr) for lr, s in grid[m].items() if s and s["ppl_mean"] is not None]
        best[m] = min(options) if options else None
    table = to_markdown(build_table([c["record"] for c in cells], warn=None)) if cells else ""
    return {"cells": len(cells), "learning_rates": [format_lr(lr) for lr in lrs], "grid": grid,
            "best_cell": best, "analyses": analyses, "table": table}


def figures(results: str | Path, out: str | Path, fmt: str = "png", smooth: int = 20) -> List[Path]:
    """Training loss, validation loss and gradient norms per learning rate (figures 2b/4 and 5), hidden-state
    magnitudes at the middle rate (figure 2a) and stream ratios (figure 6); conventions: siamesenorm/analysis/figures.py."""
    plt = pyplot()
    cells = load_cells(results)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    lrs = sorted({c["record"]["learning_rate"] for c in cells})
    plain = [c for c in cells if not c["record"].get("variant_knobs")]
    first_seed = {}
    for c in plain:  # one run per (method, lr) in the curves: the lowest seed
        k = (c["record"]["model_type"], c["record"]["learning_rate"])
        if k not in first_seed or c["record"].get("seed", 0) < first_seed[k]["record"].get("seed", 0):
            first_seed[k] = c
    seed_one = list(first_seed.values())
    panels = (("loss", "training loss (nats)", smooth, "loss"), ("val_loss", "validation loss (nats)", 1, "val-loss"),
              ("grad_norm", "gradient norm", smooth, "grad-norms"))
    for key, ylabel, window, name in panels:
        drawn = {"stopped": False, "spikes": False}
        fig, axes = plt.subplots(1, len(lrs), figsize=(3.6 * len(lrs), 3.6), sharey=True, squeeze=False)
        for ax, lr in zip(axes[0], lrs):
            for c in (c for c in seed_one if c["record"]["learning_rate"] == lr):
                if key == "val_loss":
                    rows = [(r["step"], v) for r in c["rows"] if isinstance(r.get("eval"), dict)
                            for k, v in r["eval"].items() if k.endswith("/CrossEntropyLoss")]
                else:
                    rows = [(r["step"], r[key]) for r in c["rows"] if r.get(key) is not None]
                if not rows:
                    continue
                xs, ys = moving_average([x for x, _ in rows], [y for _, y in rows], window)
                mt = c["record"]["model_type"]
                ax.plot(xs, ys, lw=1, color=colour(mt), ls=linestyle(mt), label=method_label(mt),
                        marker="o" if len(xs) <= SPARSE else None, ms=3)
                if key != "val_loss":
                    got = mark_events(ax, xs, [None if math.isnan(y) else float(y) for y in ys],
                                      run_events(c["record"]), colour(mt))
                    drawn = {k: drawn[k] or got[k] for k in drawn}
            ax.set(title=f"lr {format_lr(lr)}", xlabel="step")
        axes[0][0].set_ylabel(ylabel)
        if key == "grad_norm":
            for ax in axes[0]:
                readable_log(ax)
        handles = {}
        for ax in axes[0]:
            for h, label in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(label, h)
        if not handles:  # nothing to draw (e.g. no evaluations logged)
            plt.close(fig)
            continue
        order = [method_label(mt) for mt in METHOD_NAMES]  # the same legend order in every figure
        handles = dict(sorted(handles.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 99))
        rows_of_legend = math.ceil(len(handles) / 7)
        fig.legend(list(handles.values()), list(handles), fontsize=LEGEND_PT, loc="upper center",
                   ncol=min(7, len(handles)), bbox_to_anchor=(0.5, 1.0))
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.07 * rows_of_legend))
        how = (f"trailing mean over {window} logged steps (the first steps: the mean so far)" if window > 1
               else "each evaluation, unsmoothed")
        written.append(save(fig, out / f"study-{name}.{fmt}",
                            f"{ylabel}: {how}; seed 1 of each cell.{marks_caption(drawn)}", layout=False))
    middle = lrs[len(lrs) // 2 - 1] if lrs else None
    mags = [c for c in seed_one
            if c["record"]["learning_rate"] == middle and c["analysis"].get("magnitudes", {}).get("applies")]
    if mags:
        mags.sort(key=lambda c: list(METHOD_NAMES).index(c["record"]["model_type"]))
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        for c in mags:
            mt = c["record"]["model_type"]
            streams = list(c["analysis"]["magnitudes"]["rms"].items())
            for i, (stream, values) in enumerate(streams):
                label = method_label(mt) + ("" if len(streams) == 1 else f": {stream_label(stream)}")
                ax.plot(range(len(values)), values, color=colour(mt), ls=("-", "--", ":", "-.")[i % 4], marker="o",
                        ms=3, label=label)
        ax.set(xlabel=LAYER_AXIS, ylabel="hidden-state RMS",
               title=f"Hidden-state magnitude after training, lr {format_lr(middle)}")
        integer_ticks(ax)
        readable_log(ax)
        ax.legend(fontsize=6)
        written.append(save(fig, out / f"study-magnitudes.{fmt}", "RMS over tokens and features after each layer, "
                            "on 32 validation sequences; the final checkpoint of each run."))
    ratios = [c for c in seed_one if c["analysis"].get("stream_ratios", {}).get("applies")
              and c["record"]["model_type"] == "hybrid_pre"]
    if ratios:
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        shades = plt.get_cmap("Greens")(np.linspace(0.45, 1.0, len(ratios)))
        for c, shade in zip(sorted(ratios, key=lambda c: c["record"]["learning_rate"]), shades):
            r = c["analysis"]["stream_ratios"]
            for sub, ls in (("attention", "-"), ("mlp", "--")):
                ax.plot(r["layers"], [math.nan if v is None else v for v in r["ratio_x_over_y"][sub]], ls=ls,
                        marker="o", ms=3, color=shade, label=f"lr {format_lr(c['record']['learning_rate'])}, {sub}")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set(xlabel="layer", ylabel="input scale X / Y", title="SiameseNorm: X / Y input-scale ratio per layer")
        integer_ticks(ax)
        ax.legend(fontsize=6)
        written.append(save(fig, out / f"study-stream-ratios.{fmt}", "Learned scale of the bounded stream's input "
                            "over the Pre-Norm stream's, per sublayer (paper figure 6); darker: higher lr."))
    return written
