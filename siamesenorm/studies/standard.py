"""The reporting standard the study's verdicts are judged by (after the standard of "Most Transformer
Modifications Still Do Not Transfer at 1-3B", arXiv 2605.20798, at CPU scale):

1. each configuration (a MODEL_TYPE with its knobs, at one shape and schedule) at its **best learning rate** from
   the sweep: the rate with the lowest mean validation PPL over the seeds that every eligible rate ran (the sweep's
   seeds; all of a rate's seeds where the rates share none), a rate where any seed diverged being out. Seeds added
   later at the chosen rate (to reach three) do not take part in the choice: they would otherwise compare that rate
   by another sample than the others, and a rate whose added seeds came out worse would lose the choice to a rate
   with one seed, which then carries no verdict;
2. **at least three seeds** at that rate, or no verdict ("not judged: n seeds");
3. the **seed noise floor**: each configuration's seed sd at its best rate, and their pooled sd;
4. every comparison against Pre-Norm at the same shape and schedule (``pre``, each at its own best rate) by
   **Welch's t** on the seeds' PPLs (two-sided), the p-values **Holm-corrected** for the number of comparisons
   made; a verdict "beyond the noise floor" (corrected p < ``ALPHA``) or "within it";
5. **learning-rate tolerance**: at every rate above the best that the sweep ran (the issue asks 2x and 4x; the
   grid's own steps are about 3x), the mean PPL there and its rise over the best rate's on the seeds both ran
   (how much a design loses when its rate is set too high), how many seeds diverged, how many finished without converging (the record's
   ``converged``: final loss not below the unigram loss) and the mean count of loss spikes.

Cells come from one or more sweeps' results folders (``studies/*/results``); a configuration's key is the cell
name without its ``-lr...-s...`` tail, so cells of the same configuration in several folders are pooled (a
(configuration, rate, seed) found twice is counted once, the later folder's, and listed under ``duplicates``).
The t-distribution's tail is computed here (a regularized incomplete beta by its continued fraction), so the
standard needs nothing beyond the standard library; tests/studies/test_standard.py checks it against scipy where
scipy is installed.
"""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from siamesenorm.analysis.figures import colour, method_label, pyplot, readable_log, save
from siamesenorm.studies.lr_grid import load_cells

__all__ = ["welch", "holm", "student_t_sf", "standard_report", "to_markdown", "figure", "method_of", "display_name",
           "ALPHA", "MIN_SEEDS"]

ALPHA = 0.05
MIN_SEEDS = 3
_TAIL = re.compile(r"-lr([0-9.e+-]+)-s(\d+)$")
#: Parts of a cell name that are not the method's (its shape and schedule): a comparison is made within them.
SHAPE_KEYS = ("n_layers", "d_model")


# ---- statistics ------------------------------------------------------------------------------------------------------
def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz), x < (a + 1) / (a + b + 2)."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def regularized_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def student_t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with ``df`` degrees of freedom (df need not be whole: Welch's)."""
    tail = 0.5 * regularized_beta(df / 2.0, 0.5, df / (df + t * t))
    return tail if t >= 0 else 1.0 - tail


def welch(a: Sequence[float], b: Sequence[float]) -> Dict:
    """Welch's t-test of mean(a) - mean(b) (two-sided): t, Welch-Satterthwaite df, p, the difference and its sd."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError("Welch's t needs at least two values a side")
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    diff = statistics.mean(a) - statistics.mean(b)
    se = math.sqrt(va + vb)
    if se == 0.0:
        return {"difference": diff, "se": 0.0, "t": math.copysign(math.inf, diff) if diff else 0.0, "df": None,
                "p": 0.0 if diff else 1.0}
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    t = diff / se
    return {"difference": diff, "se": se, "t": t, "df": df, "p": min(1.0, 2.0 * student_t_sf(abs(t), df))}


def holm(p_values: Sequence[float]) -> List[float]:
    """Holm-Bonferroni adjusted p-values, in the order given (step-down: the i-th smallest times (m - i + 1),
    made monotone, capped at 1)."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


# ---- cells -> configurations -----------------------------------------------------------------------------------------
def _split(name: str) -> Tuple[str, float, int]:
    match = _TAIL.search(name)
    if not match:
        raise ValueError(f"cell {name!r}: its name does not end in -lr<rate>-s<seed> (not a sweep's cell)")
    return name[:match.start()], float(match.group(1)), int(match.group(2))


def _parts(key: str) -> Tuple[str, List[str]]:
    """(MODEL_TYPE, the key's "name=value" parts): "pre-d_model=128-n_layers=4" -> ("pre", [...])."""
    method, *parts = re.split(r"-(?=[A-Za-z_][A-Za-z0-9_.]*=)", key)
    return method, parts


def method_of(key: str) -> str:
    """The MODEL_TYPE of a configuration's key ("keel-d_model=128-n_layers=4" -> "keel")."""
    return _parts(key)[0]


def display_name(reference: str) -> str:
    """How the report names the reference: Pre-Norm, or the MODEL_TYPE."""
    return "Pre-Norm" if reference == "pre" else reference


def baseline_key(key: str, variant_knobs: Iterable[str], reference: str = "pre") -> str:
    """The configuration a configuration is compared against: ``reference`` (Pre-Norm unless asked otherwise) with
    its shape and schedule parts (every part that is not one of its variant knobs)."""
    _, parts = _parts(key)
    kept = [p for p in parts if p.split("=", 1)[0] not in set(variant_knobs)]
    return "-".join([reference] + kept)


def _collect(folders: Sequence[str | Path]) -> Tuple[Dict[str, Dict[float, Dict[int, Dict]]], List[Dict], Dict]:
    grid: Dict[str, Dict[float, Dict[int, Dict]]] = {}
    duplicates, knobs_of = [], {}
    for folder in folders:
        for cell in load_cells(folder):
            key, lr, seed = _split(cell["name"])
            rec = cell["record"]
            entry = {"ppl": None if rec["status"] == "diverged" else rec.get("val_perplexity"),
                     "diverged": rec["status"] == "diverged", "loss_spikes": rec.get("loss_spikes") or 0,
                     "stuck": rec.get("converged") is False, "folder": str(folder)}
            if entry["ppl"] is None and not entry["diverged"]:
                continue  # finished without a validation PPL: not a study cell
            seeds = grid.setdefault(key, {}).setdefault(lr, {})
            if seed in seeds:
                duplicates.append({"cell": f"{key} lr {lr:g} seed {seed}", "folders": [seeds[seed]["folder"], str(folder)],
                                   "ppl": [seeds[seed]["ppl"], entry["ppl"]]})
            seeds[seed] = entry
            knobs_of[key] = sorted((rec.get("variant_knobs") or {}).keys())
    return grid, duplicates, knobs_of


def _rate_summary(seeds: Dict[int, Dict]) -> Dict:
    values = [s["ppl"] for s in seeds.values() if not s["diverged"]]
    diverged = sum(s["diverged"] for s in seeds.values())
    return {"seeds": sorted(seeds), "ppl": [seeds[k]["ppl"] for k in sorted(seeds)], "diverged": diverged,
            "not_converged": sum(s["stuck"] for s in seeds.values()),
            "mean": statistics.mean(values) if values and not diverged else None,
            "sd": statistics.stdev(values) if len(values) > 1 and not diverged else None,
            "loss_spikes": statistics.mean(s["loss_spikes"] for s in seeds.values())}


def _increase(higher: Dict[int, Dict], best: Dict[int, Dict]) -> Optional[float]:
    shared = sorted(set(higher) & set(best))
    if not shared or any(higher[k]["diverged"] or best[k]["diverged"] for k in shared):
        return None
    return statistics.mean(higher[k]["ppl"] - best[k]["ppl"] for k in shared)


def standard_report(folders: Sequence[str | Path], alpha: float = ALPHA, min_seeds: int = MIN_SEEDS,
                    reference: str = "pre") -> Dict:
    """Every configuration's best rate, seeds, noise and tolerance, and every comparison with Pre-Norm under the
    standard (module docstring). ``reference``: another MODEL_TYPE to compare every configuration with instead, by
    the same rules (e.g. ``hybrid_pre``: does SiameseNorm's lead hold against each other design, Pre-Norm included;
    a configuration of that MODEL_TYPE with knobs is compared with its plain form at the same shape)."""
    grid, duplicates, knobs_of = _collect(folders)
    configurations = {}
    for key, rates in sorted(grid.items()):
        summaries = {lr: _rate_summary(seeds) for lr, seeds in sorted(rates.items())}
        eligible = {lr: s for lr, s in summaries.items() if s["mean"] is not None}
        shared = set.intersection(*(set(s["seeds"]) for s in eligible.values())) if eligible else set()
        # the mean over the seeds every eligible rate ran (all of a rate's seeds where they share none)
        chosen_on = {lr: statistics.mean(rates[lr][k]["ppl"] for k in shared) if shared else s["mean"]
                     for lr, s in eligible.items()}
        best = min(chosen_on, key=chosen_on.get) if eligible else None
        tolerance = [] if best is None else [
            {"lr": lr, "multiple": lr / best, "seeds": len(s["seeds"]), "diverged": s["diverged"],
             "not_converged": s["not_converged"], "loss_spikes": s["loss_spikes"], "mean": s["mean"],
             # PPL above the best rate's on the same seeds (None where a seed diverged or the rates share none)
             "increase": _increase(rates[lr], rates[best])} for lr, s in summaries.items() if lr > best]
        configurations[key] = {"rates": {f"{lr:g}": s for lr, s in summaries.items()},
                               "best_lr": best, "best": summaries.get(best), "tolerance": tolerance,
                               "chosen_on_seeds": sorted(shared) if shared else "all",
                               "baseline": baseline_key(key, knobs_of.get(key, ()), reference)}
    judged = [c["best"]["sd"] for c in configurations.values()
              if c["best"] and len(c["best"]["seeds"]) >= min_seeds and c["best"]["sd"] is not None]
    floor = math.sqrt(statistics.mean(sd * sd for sd in judged)) if judged else None

    comparisons = []
    for key, conf in configurations.items():
        base = configurations.get(conf["baseline"])
        if key == conf["baseline"] or not key or (reference == "pre" and method_of(key) == "pre"):
            continue
        row = {"configuration": key, "baseline": conf["baseline"], "lr": conf["best_lr"],
               "baseline_lr": base["best_lr"] if base else None}
        if base is None or conf["best"] is None or base["best"] is None:
            row["verdict"] = "not judged: " + (f"no {display_name(reference)} cells at this shape" if base is None else
                                               "every rate diverged" if conf["best"] is None else
                                               f"every {display_name(reference)} rate diverged")
        else:
            a, b = conf["best"], base["best"]
            row.update(n=len(a["seeds"]), baseline_n=len(b["seeds"]), mean=a["mean"], baseline_mean=b["mean"],
                       difference=a["mean"] - b["mean"])
            fewest = min(row["n"], row["baseline_n"])
            if fewest < min_seeds:
                row["verdict"] = f"not judged: {_seeds(fewest)} (the standard asks {min_seeds})"
                if fewest >= 2:
                    row.update(welch(a["ppl"], b["ppl"]))
            else:
                row.update(welch(a["ppl"], b["ppl"]))
        comparisons.append(row)
    tested = [r for r in comparisons if "verdict" not in r]  # every configuration with enough seeds a side
    for row, adjusted in zip(tested, holm([r["p"] for r in tested])):
        row["p_holm"] = adjusted
        better = "lower" if row["difference"] < 0 else "higher"
        row["verdict"] = (f"beyond the noise floor ({better} PPL)" if adjusted < alpha else "within the noise floor")
    return {"folders": [str(f) for f in folders], "reference": reference, "alpha": alpha, "min_seeds": min_seeds,
            "comparisons_tested": len(tested), "noise_floor_pooled_sd": floor, "configurations": configurations,
            "comparisons": comparisons, "duplicates": duplicates}


# ---- the page --------------------------------------------------------------------------------------------------------
def _seeds(n: int) -> str:
    """"1 seed", "3 seeds": the count as the tables write it."""
    return f"{n} seed{'s' * (n != 1)}"


def _num(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _signed(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:+.2f}"


def _lr(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:g}"


def _p(value: Optional[float]) -> str:
    return "-" if value is None else (f"{value:.3f}" if value >= 1e-3 else f"{value:.1e}")


def _shape_of(key: str) -> Tuple[str, Tuple[int, int]]:
    """(the key without its shape parts, (n_layers, d_model) or (0, 0) for the recipe's own shape)."""
    method, parts = _parts(key)
    shape = dict(p.split("=", 1) for p in parts if p.split("=", 1)[0] in SHAPE_KEYS)
    rest = [p for p in parts if p.split("=", 1)[0] not in SHAPE_KEYS]
    size = (int(shape.get("n_layers", 0)), int(shape.get("d_model", 0))) if shape else (0, 0)
    return "-".join([method] + rest), size


def shape_table(report: Dict) -> str:
    """The headline: one row per design (its configuration less the shape), one column per shape (the recipe's
    first, then by depth), each cell the design's PPL at its best rate against the reference's at that shape, the
    difference, Holm's p and the verdict. Only designs judged at one shape at least; the rest are in the full
    table."""
    against = display_name(report.get("reference", "pre"))
    cells: Dict[str, Dict[Tuple[int, int], Dict]] = {}
    for row in report["comparisons"]:
        design, size = _shape_of(row["configuration"])
        cells.setdefault(design, {})[size] = row
    judged = {d: by for d, by in cells.items() if any("p_holm" in r for r in by.values())}
    sizes = sorted({size for by in judged.values() for size in by})
    name = {size: "the recipe's shape" if size == (0, 0) else f"{size[0]} x {size[1]}" for size in sizes}
    confs = report["configurations"]
    lines = ["| design (best lr at the shape) | " + " | ".join(name[s] for s in sizes) + " |",
             "| --- |" + " --- |" * len(sizes)]
    for design, by in judged.items():
        out = []
        for size in sizes:
            row = by.get(size)
            if row is None:
                out.append("not run")
                continue
            best = confs[row["configuration"]]["best"] or {}
            if "p_holm" not in row:
                n = len(best.get("seeds", []))
                out.append(f"{_num(best.get('mean'))} ({_seeds(n)}): not judged" if best else
                           row["verdict"])
                continue
            word = ("**beyond, better**" if row["difference"] < 0 else "**beyond, worse**") \
                if row["p_holm"] < report["alpha"] else "within"
            out.append(f"{_num(row['mean'])} vs {_num(row['baseline_mean'])}: {_signed(row['difference'])}, "
                       f"Holm {_p(row['p_holm'])}, {word}")
        lrs = {size: _lr(row["lr"]) for size, row in by.items() if row.get("lr") is not None}
        rate = (next(iter(lrs.values())) if len(set(lrs.values())) == 1 else
                "; ".join(f"{lr} at {name.get(size, size)}" for size, lr in sorted(lrs.items())))
        lines.append(f"| {design} ({rate}) | " + " | ".join(out) + " |")
    return (f"Each design at its best rate against {against} at its own, by shape (PPL over {report['min_seeds']}+ "
            f"seeds a side, mean; the difference; Holm's p over the {report['comparisons_tested']} comparisons; "
            f"beyond the noise floor or within it):\n\n" + "\n".join(lines) + "\n")


def _at_recipe_schedule(key: str) -> bool:
    """A configuration on the recipe's own schedule and settings: no setting (``scheduler.t_warmup``) or length part
    in its key; its shape may differ."""
    return not any("." in p.split("=", 1)[0] or p.startswith("max_duration") for p in _parts(key)[1])


def _at_recipe_shape(key: str) -> bool:
    """A configuration at the recipe's own shape and schedule: no shape, setting or length part in its key."""
    return _at_recipe_schedule(key) and not any(p.split("=", 1)[0] in SHAPE_KEYS for p in _parts(key)[1])


def rates_table(report: Dict) -> str:
    """The learning-rate sweep at each shape where one ran: every configuration on the recipe's schedule run at two
    rates or more at that shape, its validation PPL at each rate (one seed: its PPL; more: mean ± sd and the count),
    the best rate (chosen at that shape, on the seeds every rate ran there) in bold. The recipe's shape first, then
    the others by depth, one table each."""
    by_size: Dict[Tuple[int, int], Dict[str, Dict]] = {}
    for key, conf in report["configurations"].items():
        if _at_recipe_schedule(key) and len(conf["rates"]) >= 2:
            design, size = _shape_of(key)
            by_size.setdefault(size, {})[design] = conf
    parts = []
    for size in sorted(by_size):
        rows = by_size[size]
        rates = sorted({float(lr) for c in rows.values() for lr in c["rates"]})
        lines = ["| configuration | " + " | ".join(f"{lr:g}" for lr in rates) + " | best rate |",
                 "| --- |" + " ---: |" * len(rates) + " --- |"]
        for design, conf in rows.items():
            cells = []
            for lr in rates:
                s = conf["rates"].get(f"{lr:g}")
                if s is None:
                    cells.append("")
                    continue
                cell = (f"{s['diverged']}/{len(s['seeds'])} diverged" if s["mean"] is None else _num(s["mean"])
                        if len(s["seeds"]) == 1 else f"{_num(s['mean'])} ± {_num(s['sd'])} ({len(s['seeds'])})")
                cells.append(f"**{cell}**" if lr == conf["best_lr"] else cell)
            lines.append(f"| {design} | " + " | ".join(cells) + f" | {_lr(conf['best_lr'])} |")
        where = "At the recipe's shape" if size == (0, 0) else f"At {size[0]} x {size[1]} (n_layers x d_model)"
        parts.append(f"{where}:\n\n" + "\n".join(lines) + "\n")
    return ("Validation PPL at each rate the sweep ran, at each shape where it ran two rates or more (one seed: its "
            "PPL; more: mean ± sd (seeds)); bold: the best rate at that shape, chosen on the seeds every rate ran "
            "there.\n\n" + "\n".join(parts))


def tolerance_table(report: Dict, multiples: Sequence[float] = (2.0, 4.0)) -> str:
    """Learning-rate tolerance at the issue's multiples of each best rate, for every configuration at the recipe's
    own shape and schedule with the standard's seeds at its best rate: the PPL there and its rise over the best
    rate's on the same seeds, and the seeds that diverged or did not converge and the loss spikes at every rate above
    the best."""
    lines = ["| configuration | best rate: PPL (seeds) | " + " | ".join(f"{m:g}x: PPL (rise)" for m in multiples)
             + " | above the best, every rate: diverged, not converged, loss spikes |",
             "| --- | --- |" + " --- |" * len(multiples) + " --- |"]
    for key, conf in report["configurations"].items():
        best = conf["best"]
        if not _at_recipe_shape(key) or not best or len(best["seeds"]) < report["min_seeds"]:
            continue
        out = []
        for m in multiples:
            hit = [t for t in conf["tolerance"] if abs(t["multiple"] - m) < 1e-6]
            out.append(f"{hit[0]['lr']:g}: {_num(hit[0]['mean'])} ({_signed(hit[0]['increase'])})" if hit
                       else f"{conf['best_lr'] * m:g}: not run")
        above = conf["tolerance"]
        tally = (f"{sum(t['diverged'] for t in above)}/{sum(t['seeds'] for t in above)}, "
                 f"{sum(t['not_converged'] for t in above)}/{sum(t['seeds'] for t in above)}, "
                 f"{sum(t['loss_spikes'] * t['seeds'] for t in above):g}") if above else "no higher rate run"
        lines.append(f"| {key} | {_lr(conf['best_lr'])}: {_num(best['mean'])} ({len(best['seeds'])}) | "
                     + " | ".join(out) + f" | {tally} |")
    return ("Each configuration at the recipe's shape with the standard's seeds at its best rate (PPL: their mean), "
            f"at {' and '.join(f'{m:g}x' for m in multiples)} that rate: the PPL there (mean over the seeds run) and "
            "its rise over the best rate's PPL on the same seeds:\n\n" + "\n".join(lines) + "\n")


def page_markers(reference: str = "pre", table: str = "verdicts by shape", tag: str = "") -> Tuple[str, str]:
    """The two comments between which ``--page`` writes a table into a study's page: the verdicts by shape against
    ``reference``, or (``table="tolerance"`` or ``"rates"``, with the report against Pre-Norm) the tolerance table or
    the learning-rate sweep; ``tag`` (from ``--tag``) names another set of folders' tables on the same page (e.g.
    "pooled")."""
    name = (table if table in ("tolerance", "rates") else f"{table} against {reference}") + (f" ({tag})" if tag else "")
    return (f"<!-- {name}: written by scripts/study_report.py --page, not by hand -->", f"<!-- end of the {name} -->")


def _replace_between(text: str, begin: str, end: str, body: str, where: str) -> str:
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"{where}: needs the lines {begin!r} and, below it, {end!r} once each, where the table "
                         "should go; add them and rerun")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{body}{end}{tail}"


def update_page(text: str, report: Dict, where: str = "the page", tag: str = "") -> str:
    """``text`` with the shape table between its markers replaced by this report's, and, against Pre-Norm, the
    tolerance and rate-sweep tables between theirs where the page has them; ValueError (one line) when the shape
    table's markers are missing, so that nothing is written."""
    reference = report.get("reference", "pre")
    text = _replace_between(text, *page_markers(reference, tag=tag), shape_table(report), where)
    for table, write in (("tolerance", tolerance_table), ("rates", rates_table)):
        begin, end = page_markers(table=table, tag=tag)
        if reference == "pre" and begin in text:
            text = _replace_between(text, begin, end, write(report), where)
    return text


def to_markdown(report: Dict) -> str:
    """The verdicts by shape, the verdict table and the learning-rate tolerance table."""
    against = display_name(report.get("reference", "pre"))
    lines = [shape_table(report), f"Verdicts: Welch's t on the seeds' validation PPL at each configuration's best rate against {against} at "
             f"its own, Holm-corrected over the {report['comparisons_tested']} comparisons tested, alpha "
             f"{report['alpha']}; fewer than {report['min_seeds']} seeds a side: not judged. Seed noise floor "
             f"(pooled sd at the best rates, configurations with {report['min_seeds']}+ seeds): "
             f"{_num(report['noise_floor_pooled_sd'])} PPL.", "",
             f"| configuration | best lr | seeds | PPL mean ± sd | {against} (lr, seeds, PPL) | difference | t (df) | p | "
             "p Holm | verdict |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    confs = report["configurations"]
    for row in report["comparisons"]:
        conf = confs[row["configuration"]]
        best = conf["best"] or {}
        base = confs.get(row["baseline"], {}).get("best") or {}
        t = "-" if row.get("t") is None else f"{row['t']:.2f} ({_num(row.get('df'), 1)})"
        lines.append(f"| {row['configuration']} | {_lr(row['lr'])} | {len(best.get('seeds', []))} | "
                     f"{_num(best.get('mean'))} ± {_num(best.get('sd'))} | {_lr(row.get('baseline_lr'))}, "
                     f"{len(base.get('seeds', []))}, {_num(base.get('mean'))} | {_num(row.get('difference'))} | {t} | "
                     f"{_p(row.get('p'))} | {_p(row.get('p_holm'))} | {row['verdict']} |")
    lines += ["", "Learning-rate tolerance above each configuration's best rate: the mean PPL there and how far above "
                  "the best rate's it is on the same seeds, seeds that diverged (the guard stopped them), seeds that "
                  "finished without converging (final loss not below the unigram loss), each of the seeds run, and "
                  "the mean count of loss spikes a run:", "",
              "| configuration | best lr | above the best: lr (x best): PPL (+ over the best), diverged, not converged, "
              "spikes |", "| --- | --- | --- |"]
    for key, conf in confs.items():
        cells = "; ".join(f"{t['lr']:g} (x{t['multiple']:.1f}): {_num(t.get('mean'))} ({_signed(t.get('increase'))}), "
                          f"{t['diverged']}/{t['seeds']}, {t['not_converged']}/{t['seeds']}, {t['loss_spikes']:.1f}"
                          for t in conf["tolerance"]) or "no higher rate run"
        lines.append(f"| {key} | {_lr(conf['best_lr'])} | {cells} |")
    return "\n".join(lines) + "\n"


# ---- the figure -------------------------------------------------------------------------------------------------------
def figure(report: Dict, out: str | Path, fmt: str = "png") -> Path:
    """Validation PPL against learning rate for every configuration at the recipe's own shape and schedule (no
    shape or setting part in its key), mean over seeds with the seeds' range; a rate where a seed diverged is left
    out. Configurations with knobs get a dashed line in their MODEL_TYPE's colour."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for key, conf in report["configurations"].items():
        method, parts = _parts(key)
        if not _at_recipe_shape(key):
            continue
        points = [(float(lr), s) for lr, s in conf["rates"].items() if s["mean"] is not None]
        if not points:
            continue
        points.sort()
        lrs = [lr for lr, _ in points]
        means = [s["mean"] for _, s in points]
        low = [m - min(v for v in s["ppl"] if v is not None) for m, (_, s) in zip(means, points)]
        high = [max(v for v in s["ppl"] if v is not None) - m for m, (_, s) in zip(means, points)]
        label = method_label(method) + (f" ({', '.join(parts)})" if parts else "")
        ax.errorbar(lrs, means, yerr=[low, high], marker="o", ms=4, capsize=2, color=colour(method),
                    linestyle="--" if parts else "-", label=label)
    ax.set_xlabel("learning rate")
    ax.set_ylabel("validation PPL")
    readable_log(ax, "x")
    readable_log(ax, "y")
    ax.legend(fontsize=7, ncol=2)
    return save(fig, Path(out) / f"standard-lr.{fmt}",
                caption="Validation PPL against learning rate at the recipe's shape (mean over seeds, bars: the "
                        "seeds' range; a rate where a seed diverged is left out). "
                        f"Folders: {', '.join(report['folders'])}.")
