"""Every figure the project draws: the analysis tools' (scripts/analyze.py) and the CPU study's (scripts/study_report.py).

Conventions, the same in every figure: one colour and one display name per method (``COLOURS``,
tables.METHOD_NAMES), the paper's stream names (``STREAM_NAMES``), integer ticks on layer axes, log axes labelled
at 1-2-5 steps ("log scale" said on the axis), losses in nats, a cross where the guard stopped a run (diverged or
failed to converge) and small triangles at its loss spikes, markers on sparse series (a point per value when a
series has at most SPARSE points), legends readable at column width (LEGEND_PT), a line style as well as a colour
per method (the methods whose colours are darker shades of palette colours are dashed), and PNG, PDF or SVG
output. Nothing is written into the image below the axes: the caption (what is smoothed and how, which marks are
drawn) goes to a sidecar ``<name>.caption.txt`` beside the figure, for the document that shows it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, Optional, Sequence

import numpy as np

from siamesenorm.analysis.tables import METHOD_NAMES
from siamesenorm.variants import VARIANTS

__all__ = ["COLOURS", "STREAM_NAMES", "FORMATS", "colour", "method_label", "stream_label", "pyplot", "plot",
           "moving_average", "integer_ticks", "readable_log", "mark_events", "save"]

FORMATS = ("png", "pdf", "svg")

#: One colour per method in every figure (each variant file's colour).
COLOURS = {v.name: v.colour for v in VARIANTS.values()}

#: The streams' names in the paper (section 3) for the blocks' internal names (each variant file's stream_labels).
STREAM_NAMES = {"residual": "residual stream"}
for _variant in VARIANTS.values():
    STREAM_NAMES.update(_variant.stream_labels)

_LINESTYLES = ("-", "--", ":", "-.")
#: A series with at most this many points gets a marker at each.
SPARSE = 30
#: Legend font size (points): readable when a figure is scaled to a paper's column.
LEGEND_PT = 9


def linestyle(model_type: str, repeat: int = 0) -> str:
    """The method's own line style: solid for the ten tab: palette colours, dashed for the rest (darker shades of
    palette colours: darkred beside red, navy beside blue), shifted for a second run of the method in one panel."""
    base = 0 if colour(model_type).startswith("tab:") else 1
    return _LINESTYLES[(base + repeat) % len(_LINESTYLES)]


def colour(model_type: str) -> str:
    return COLOURS.get(model_type, "tab:gray")


def method_label(model_type: str) -> str:
    return METHOD_NAMES.get(model_type, model_type)


def stream_label(name: str) -> str:
    if name.startswith("stream_"):
        return f"stream {name.split('_', 1)[1]}"
    return STREAM_NAMES.get(name, name)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def moving_average(xs: Sequence[float], ys: Sequence[Optional[float]], window: int) -> tuple[list, np.ndarray]:
    """Trailing mean over ``window`` logged values (None counts as missing; x is the window's last step); the
    first steps, before a whole window exists, are the mean of what there is so far, so no step is dropped."""
    values = np.array([np.nan if v is None else v for v in ys], dtype=float)
    if window <= 1 or not len(values):
        return list(xs), values
    present = ~np.isnan(values)
    sums = np.concatenate([[0.0], np.cumsum(np.where(present, values, 0.0))])
    counts = np.concatenate([[0], np.cumsum(present)])
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(0, ends - window)
    n = counts[ends] - counts[starts]
    with np.errstate(invalid="ignore", divide="ignore"):
        means = np.where(n > 0, (sums[ends] - sums[starts]) / np.maximum(n, 1), np.nan)
    return list(xs), means


def integer_ticks(ax, axis: str = "x") -> None:
    from matplotlib.ticker import MaxNLocator

    getattr(ax, f"{axis}axis").set_major_locator(MaxNLocator(integer=True))


#: The words every log axis's label ends with (a reader cannot tell a log axis from its ticks alone).
LOG_SCALE = "(log scale)"

#: How every figure numbers layers: 0 is the embedding (before any block), layer l the output of block l (1-based).
LAYER_AXIS = "layer (0 = embedding, l = after block l)"


def readable_log(ax, axis: str = "y") -> None:
    """Make ``axis`` logarithmic, labelled at 1, 2 and 5 times each power of ten in plain numbers (not only at
    10^k), its label ending in "(log scale)" (panels beside it that share the axis carry no label of their own).
    Call it after the label is set."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    getattr(ax, f"set_{axis}scale")("log")
    label = getattr(ax, f"get_{axis}label")()
    if label and LOG_SCALE not in label:
        getattr(ax, f"set_{axis}label")(f"{label} {LOG_SCALE}")
    target = getattr(ax, f"{axis}axis")
    target.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    target.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    target.set_minor_formatter(NullFormatter())


def mark_events(ax, xs: Sequence[float], ys: Sequence[float], events: Dict, colour_: str) -> Dict[str, bool]:
    """A cross at the last point of a run the guard stopped; triangles at its loss spikes (steps within xs).
    Returns which of the two it drew (a caption names only what is drawn)."""
    ys = list(ys)
    if not xs:
        return {"stopped": False, "spikes": False}
    drawn = {"stopped": False, "spikes": False}
    if events.get("stopped"):
        finite = [(x, y) for x, y in zip(xs, ys) if y is not None and math.isfinite(y)]
        if finite:
            ax.plot(*finite[-1], marker="x", color=colour_, ms=9, mew=2, zorder=5)
            drawn["stopped"] = True
    lookup = dict(zip(xs, ys))
    spike_points = [(s, lookup[s]) for s in events.get("spike_steps", []) if lookup.get(s) is not None]
    if spike_points:
        ax.plot(*zip(*spike_points), ls="none", marker="^", color=colour_, ms=4, zorder=4)
        drawn["spikes"] = True
    return drawn


def caption_path(path: str | Path) -> Path:
    """Where a figure's caption is written: ``<name>.caption.txt`` beside it."""
    path = Path(path)
    return path.with_name(f"{path.stem}.caption.txt")


def save(fig, path: str | Path, caption: Optional[str] = None, layout: bool = True) -> Path:
    """Tight layout (unless the caller laid it out), saved in the format its suffix names, closed; the caption,
    if any, to the sidecar caption_path(path), never into the image."""
    path = Path(path)
    if path.suffix.lstrip(".") not in FORMATS:
        raise ValueError(f"{path}: figures are written as {', '.join(FORMATS)}")
    plt = pyplot()
    if layout:
        fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    if caption:
        caption_path(path).write_text(caption.strip() + "\n")
    return path


def _legend(ax, **kwargs) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=LEGEND_PT, **kwargs)


# ---- the analysis tools' figures (scripts/analyze.py) ----------------------------------------------------------------
def plot(tool: str, result: Dict, path: str | Path, smooth: int = 1) -> Path:
    """The figure for one analysis tool's result (the JSON it writes), saved to ``path`` (.png, .pdf or .svg)."""
    plt = pyplot()
    if tool == "magnitudes":
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        models = result["models"] if "models" in result else {method_label(result["model_type"]): result}
        _magnitudes(ax, models)
        ax.set(title="Hidden-state magnitude by layer")
        return save(fig, path, "RMS over tokens and features of each stream after each layer; one model per colour, "
                               "one stream per line style.")
    if tool == "stream-ratios":
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for sub, ls in (("attention", "-"), ("mlp", "--")):
            values = [math.nan if v is None else v for v in result["ratio_x_over_y"][sub]]
            ax.plot(range(1, len(values) + 1), values, ls=ls, marker="o", ms=3,  # block l is layer l
                    color=colour(result["model_type"]), label=f"{sub} sublayer")
        ax.axhline(1.0, color="grey", lw=0.5)
        integer_ticks(ax)
        ax.set(xlabel="layer (block l)", ylabel="input scale X / Y",
               title=f"Stream input-scale ratio, {method_label(result['model_type'])}")
        _legend(ax)
        return save(fig, path, "Learned scale of the bounded stream's input over the Pre-Norm stream's, per sublayer "
                               "(paper figure 6).")
    if tool == "lens":
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        names = result["streams"]
        x = np.arange(len(names))
        ax.bar(x - 0.2, [result["match"][n] for n in names], 0.4, label="all positions", color="0.55")
        ax.bar(x + 0.2, [result["match_where_streams_disagree"][n] or 0.0 for n in names], 0.4,
               label="where the streams disagree", color=colour(result["model_type"]))
        ax.set_xticks(x, [f"{stream_label(n)}\nfusion weight {result['fusion_weights'][n]:.2f}" for n in names],
                      fontsize=8)
        ax.set(ylabel="top-1 agrees with the model", ylim=(0, 1),
               title=f"Logit lens on each stream, {method_label(result['model_type'])}")
        _legend(ax)
        return save(fig, path, "Each stream's contribution decoded alone through the output head; share of tokens "
                               "whose top-1 matches the full model's.")
    if tool == "depth":
        fig, (left, right) = plt.subplots(1, 2, figsize=(9.0, 3.8), sharey=True)
        c = colour(result["model_type"])
        n = result["layers"]
        left.plot(range(1, n + 1), result["without_layer"], marker="o", ms=4, color=c)  # block l is layer l
        left.set(xlabel="layer removed (block l)", ylabel="validation perplexity", title="one layer removed")
        right.plot(range(len(result["without_last_k"])), result["without_last_k"], marker="s", ms=4, color=c)
        right.set(xlabel="k (last k layers removed; 0 = full model)", title="last k layers removed")
        for ax in (left, right):
            ax.axhline(result["perplexity"], color="grey", lw=0.7, ls="--", label="full model")
            integer_ticks(ax)
            readable_log(ax)
        _legend(left)
        fig.suptitle(f"Depth probe, {method_label(result['model_type'])}", fontsize=10)
        return save(fig, path, "Perplexity on the evaluation tokens with blocks skipped (identity in their place).")
    if tool in ("grad-norms", "loss-curves"):
        key = result["metric"]
        with_val = key == "loss" and any(c.get("val_steps") for c in result["runs"].values())
        fig, axes = plt.subplots(1, 2 if with_val else 1, figsize=(10.0 if with_val else 6.4, 4.2), squeeze=False)
        drawn = _curves(axes[0][0], result["runs"], key, smooth)
        axes[0][0].set(xlabel="step", ylabel="gradient norm" if key == "grad_norm" else "training loss (nats)")
        if key == "grad_norm":
            readable_log(axes[0][0])
        if with_val:
            _curves(axes[0][1], result["runs"], "val_loss", 1, steps_key="val_steps")
            axes[0][1].set(xlabel="step", ylabel="validation loss (nats)")
            _legend(axes[0][1])
        _legend(axes[0][0])
        what = "gradient norm" if key == "grad_norm" else "training loss"
        caption = (f"{what}: trailing mean over {smooth} logged steps (the first steps: the mean so far)"
                   if smooth > 1 else f"{what}: as logged, unsmoothed") + \
            ("; validation loss: each evaluation, unsmoothed" if with_val else "") + "." + marks_caption(drawn)
        return save(fig, path, caption)
    raise ValueError(f"no plot for {tool}")


def _magnitudes(ax, models: Dict[str, Dict]) -> None:
    for label, result in models.items():
        c = colour(result["model_type"])
        streams = list(result["rms"].items())
        for i, (stream, values) in enumerate(streams):
            name = label if len(streams) == 1 else f"{label}: {stream_label(stream)}"
            ax.plot(result["layers"], values, marker="o", ms=3, color=c, ls=_LINESTYLES[i % len(_LINESTYLES)],
                    label=name)
    ax.set(xlabel=LAYER_AXIS, ylabel="hidden-state RMS")
    integer_ticks(ax)
    readable_log(ax)
    _legend(ax)


def marks_caption(drawn: Dict[str, bool]) -> str:
    """The caption's words for the marks actually drawn (nothing when none is)."""
    words = [w for key, w in (("stopped", "x: the guard stopped the run"), ("spikes", "triangles: loss spikes"))
             if drawn.get(key)]
    return (" " + "; ".join(words) + ".") if words else ""


def _curves(ax, runs: Dict[str, Dict], key: str, smooth: int, steps_key: str = "steps") -> Dict[str, bool]:
    """Each run's curve (its method's colour and line style, markers when sparse); returns the marks drawn."""
    seen: Dict[str, int] = {}
    drawn = {"stopped": False, "spikes": False}
    for label, curve in runs.items():
        mt = curve.get("model_type") or ""
        style = linestyle(mt, seen.get(mt, 0))
        seen[mt] = seen.get(mt, 0) + 1
        xs, ys = moving_average(curve[steps_key], curve[key], smooth)
        c = colour(mt)
        sparse = {"marker": "o", "ms": 3} if len(xs) <= SPARSE else {}
        ax.plot(xs, ys, lw=1, color=c, ls=style, label=label, **sparse)
        if steps_key == "steps":
            got = mark_events(ax, xs, [None if math.isnan(y) else float(y) for y in ys], curve, c)
            drawn = {k: drawn[k] or got[k] for k in drawn}
    return drawn


def run_events(record: Dict) -> Dict:
    """What the curve figures mark for a run: whether the guard stopped it, and its loss-spike steps."""
    return {"stopped": record.get("status") == "diverged" or record.get("converged") is False,
            "spike_steps": [s["step"] for s in record.get("spikes", [])]}
