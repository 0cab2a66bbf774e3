"""The paper's Table 1 from run records (run.json): rows are methods, grouped by learning-rate setting; columns are
validation perplexity, the seven downstream accuracies and their average.

Cell rules:
  * PPL: the last validation perplexity (2 decimals); accuracies in percent (1 decimal); Avg: the mean of the seven
    accuracies, only when all seven exist; "-" where a value does not exist;
  * a diverged run, or one that finished without converging (``converged: false``): "diverge" in PPL and "-" in
    every other column; a run too short to judge (fewer steps than the guard's grace period plus one convergence
    window): "too short"; a run with no perplexity yet: "crashed" (an error stopped it), "stopped" (a signal) or
    "running";
  * columns without a value in any row are left out (PPL always stays);
  * "*" after PPL: the run had loss spikes (stability.py has the rule); "†" after PPL: the run has not finished
    (status running or stopped), its values are its latest;
  * "‡" after a value: an evaluation on a subset (``evaluate.py --max-batches``), its size in the legend line;
  * bold: the best value of each column within a setting (lowest PPL, highest accuracy), ties all bold,
    comparing the values as printed; diverged and missing cells never count; and only where the sample can tell:
    never a subset's perplexity, and an accuracy only when its lead over the runner-up exceeds two binomial
    standard errors at the examples scored (a subset: at most its batches x batch size; a full task set: as the
    paper bolds). CSV has no bold;
  * a record of evaluate.py and the run's own record of the same run: the full evaluation is used, not a subset
    (else the newest), and make_tables says which; when a table mixes run records and evaluate.py records, each
    evaluate.py row says so after its method.
A setting is (recipe, learning rate, token budget). The recipe is the record's ``recipe_hash`` (the config without
seed, learning rate, MODEL_TYPE, its knobs and the initialisation), so runs of different experiments are never
merged; when the records hold more than one recipe, each setting's label names its recipe (config file and hash).
Several records of the same method and setting with different seeds: the cell shows the mean and the sample
standard deviation over the seeds that did not diverge, "± s (n=k)", and how many diverged; the same seed twice:
the newest record is used.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from siamesenorm.run.records import DOWNSTREAM_LABELS
from siamesenorm.variants import TABLE_ORDER, VARIANTS

__all__ = ["COLUMNS", "METHOD_NAMES", "Table", "build_table", "to_markdown", "to_csv", "to_latex", "method_name",
           "subset_note", "subset_size"]

COLUMNS = ("PPL", "ARC-E", "ARC-C", "HellaSwag", "PIQA", "WinoGrande", "OBQA", "Arithmetic", "Avg")

#: MODEL_TYPE -> the name the paper's tables use (each variant file's display_name); the order is the row order.
METHOD_NAMES = {name: VARIANTS[name].display_name for name in TABLE_ORDER}

_KNOB_NAMES = {
    ("siamese_depth_scaling", False): "w/o depth-wise scaling",
    ("siamese_normalized_input", False): "w/o normalized input",
}

DIVERGE, MISSING, SPIKE, UNFINISHED, SUBSET = "diverge", "-", "*", "†", "‡"
CRASHED, STOPPED, RUNNING, TOO_SHORT = "crashed", "stopped", "running", "too short"


def _too_short(record: Dict) -> bool:
    """A run that ended before its loss could be judged (the grace period plus one convergence window): a smoke
    test, not a divergence."""
    stability = record.get("stability") or {}
    need = (stability.get("grace_steps") or 0) + (stability.get("converge_window") or 0)
    return record.get("status") != "diverged" and (record.get("step") or 0) < need


def _no_result(record: Dict) -> str:
    """What a record without a perplexity is: crashed (an error stopped it), stopped (a signal), running."""
    if record.get("status") == "running":
        return RUNNING
    error = str(record.get("error") or "")
    return STOPPED if ("SIGTERM" in error or "SIGINT" in error or "KeyboardInterrupt" in error) else CRASHED


def subset_size(record: Dict) -> Optional[int]:
    """The most examples a task of this record was scored on when it is a subset evaluation (evaluate.py with
    --max-batches: batches x batch size), else None (a full evaluation)."""
    how = record.get("evaluation")
    if not isinstance(how, dict) or how.get("max_batches") is None:
        return None
    return int(how["max_batches"]) * int(how.get("batch_size") or 1)


def method_name(record: Dict) -> str:
    name = METHOD_NAMES.get(record["model_type"], record["model_type"])
    knobs = record.get("variant_knobs") or {}
    parts = [_KNOB_NAMES.get((k, v), f"{k}={v}") for k, v in sorted(knobs.items())]
    return f"{name} ({', '.join(parts)})" if parts else name


def _sort_key(record: Dict) -> Tuple:
    order = list(METHOD_NAMES)
    mt = record["model_type"]
    return (order.index(mt) if mt in order else len(order), sorted((record.get("variant_knobs") or {}).items()))


def format_lr(lr: float) -> str:
    mantissa, exponent = f"{lr:e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"


def format_tokens(n: Optional[int]) -> str:
    if not n:
        return "? tokens"
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.3g}{unit} tokens"
    return f"{n} tokens"


def setting_label(lr: float, tokens: Optional[int]) -> str:
    return f"lr {format_lr(lr)}, {format_tokens(tokens)}"


@dataclass
class Row:
    setting: str
    method: str
    values: List[Optional[float]]  # one per column; None: missing
    texts: List[str]  # the cells as printed, without bold
    diverged: bool
    examples: Optional[int] = None  # a subset evaluation: the most examples a column was scored on


@dataclass
class Table:
    settings: List[str]
    rows: List[Row]
    best: Dict[Tuple[int, int], bool]  # (row index, column index) -> bold

    def rows_of(self, setting: str) -> List[Tuple[int, Row]]:
        return [(i, r) for i, r in enumerate(self.rows) if r.setting == setting]


def _row(record: Dict, setting: str) -> Row:
    method = method_name(record)
    blank = [MISSING] * (len(COLUMNS) - 1)
    if record.get("converged") is False and _too_short(record):
        return Row(setting, method, [None] * len(COLUMNS), [TOO_SHORT] + blank, False)
    if record.get("status") == "diverged" or record.get("converged") is False:
        return Row(setting, method, [None] * len(COLUMNS), [DIVERGE] + blank, True)
    ppl = record.get("val_perplexity")
    if ppl is None and record.get("status") in ("running", "stopped"):
        return Row(setting, method, [None] * len(COLUMNS), [_no_result(record)] + blank, False)
    downstream = record.get("downstream") or {}
    accs = [downstream.get(label) for label in DOWNSTREAM_LABELS]
    accs = [None if a is None else 100.0 * a for a in accs]
    avg = sum(accs) / len(accs) if all(a is not None for a in accs) else None
    # rounded as printed, so "best" compares what the reader sees
    values = [None if v is None else round(v, 2 if j == 0 else 1) for j, v in enumerate([ppl, *accs, avg])]
    texts = [MISSING if v is None else (f"{v:.2f}" if j == 0 else f"{v:.1f}") for j, v in enumerate(values)]
    if ppl is not None:
        if record.get("loss_spikes", 0) > 0:
            texts[0] += SPIKE
        if record.get("status") in ("running", "stopped"):
            texts[0] += UNFINISHED
    examples = subset_size(record)
    if examples is not None:
        texts = [t if t == MISSING else t + SUBSET for t in texts]
    return Row(setting, method, values, texts, False, examples)


def _recipe_name(record: Dict) -> str:
    stem = Path(str(record.get("config") or "?")).stem
    return f"{stem} [{record.get('recipe_hash', '?')[:6]}]"


def _aggregate(records: List[Dict], setting: str) -> Row:
    """One row from the seeds of one method in one setting (a single record: its own row)."""
    if len(records) == 1:
        return _row(records[0], setting)
    rows = [_row(r, setting) for r in records]
    alive = [r for r in rows if not r.diverged]
    if not alive:
        return rows[0]
    if all(r.values[0] is None for r in alive):  # no seed has a result yet: say why (crashed, running, ...)
        return alive[0]
    values, texts = [], []
    for j in range(len(COLUMNS)):
        column = [r.values[j] for r in alive if r.values[j] is not None]
        if not column:
            values.append(None)
            texts.append(MISSING)
            continue
        mean = sum(column) / len(column)
        spread = statistics.stdev(column) if len(column) > 1 else 0.0
        digits = 2 if j == 0 else 1
        values.append(round(mean, digits))
        texts.append(f"{mean:.{digits}f} ± {spread:.{digits}f}" + (f" (n={len(column)})" if j == 0 else ""))
    finished = [rec for rec, row in zip(records, rows) if not row.diverged]
    if texts[0] != MISSING:
        texts[0] += SPIKE if any(rec.get("loss_spikes", 0) > 0 for rec in finished) else ""
        texts[0] += UNFINISHED if any(rec.get("status") in ("running", "stopped") for rec in finished) else ""
    diverged = len(rows) - len(alive)
    if diverged:
        texts[0] += f", {diverged}/{len(rows)} diverge"
    sizes = [r.examples for r in alive if r.examples is not None]
    examples = min(sizes) if sizes else None
    if examples is not None:
        texts = [t if t == MISSING else t + SUBSET for t in texts]
    return Row(setting, rows[0].method, values, texts, False, examples)


def _preferred(a: Dict, b: Dict) -> tuple:
    """(used, dropped) of two records of one run: a full evaluation over a subset, else the newer."""
    if (subset_size(a) is None) != (subset_size(b) is None):
        return (a, b) if subset_size(a) is None else (b, a)
    older, newer = sorted((a, b), key=lambda r: r.get("updated", 0))
    return newer, older


def _clear_lead(best: float, runner_up: Optional[float], examples: Optional[int], column: int) -> bool:
    """Whether an accuracy's lead (in %) exceeds two binomial standard errors at ``examples`` (None: a full task
    set, bolded as the paper does; perplexity: only a full evaluation is bolded)."""
    if examples is None:
        return True
    if column == 0:
        return False
    if runner_up is None:
        return False
    p = min(max(best / 100.0, 1e-9), 1 - 1e-9)
    return (best - runner_up) / 100.0 > 2 * math.sqrt(p * (1 - p) / examples)


def build_table(records: Iterable[Dict], warn=sys.stderr) -> Table:
    newest: Dict[Tuple, Dict] = {}
    for rec in records:
        key = (rec.get("recipe_hash"), float(rec["learning_rate"]), rec.get("token_budget"), method_name(rec),
               rec.get("seed"))
        if key in newest:
            used, dropped = _preferred(newest[key], rec)
            if warn is not None:
                why = (" (a full evaluation, not a subset)" if (subset_size(used) is None) != (subset_size(dropped)
                                                                                              is None) else "")
                print(f"make_tables: two records of {key[3]} at {setting_label(*key[1:3])} (seed {key[4]}): using "
                      f"{used.get('path', '?')}{why}, not {dropped.get('path', '?')}", file=warn)
            rec = used
        newest[key] = rec
    mixed = len({isinstance(r.get("evaluation"), dict) for r in newest.values()}) > 1
    several_recipes = len({k[0] for k in newest}) > 1
    setting_keys = sorted({(k[2] or 0, k[1], str(k[0])) for k in newest})  # by token budget, learning rate, recipe
    settings, rows = [], []
    for tokens, lr, recipe in setting_keys:
        group = [r for k, r in newest.items() if k[1] == lr and (k[2] or 0) == tokens and str(k[0]) == recipe]
        label = setting_label(lr, tokens or None)
        if several_recipes:
            label += f", {_recipe_name(group[0])}"
        settings.append(label)
        by_method: Dict[str, List[Dict]] = {}
        for r in sorted(group, key=_sort_key):
            source = " [evaluate.py]" if mixed and isinstance(r.get("evaluation"), dict) else ""
            by_method.setdefault(method_name(r) + source, []).append(r)
        for method, members in by_method.items():
            row = _aggregate(members, label)
            row.method = method
            rows.append(row)
    best: Dict[Tuple[int, int], bool] = {}
    table = Table(settings, rows, best)
    for label in settings:
        members = table.rows_of(label)
        for j in range(len(COLUMNS)):
            vals = [(i, r.values[j]) for i, r in members if r.values[j] is not None and not r.diverged]
            if not vals:
                continue
            target = (min if j == 0 else max)(v for _, v in vals)
            others = sorted((v for _, v in vals if not math.isclose(v, target, rel_tol=0, abs_tol=1e-12)),
                            reverse=j != 0)
            for i, v in vals:
                if math.isclose(v, target, rel_tol=0, abs_tol=1e-12) and _clear_lead(
                        v, others[0] if others else None, table.rows[i].examples, j):
                    best[(i, j)] = True
    return table


# ---- renderers ------------------------------------------------------------------------------------------------------
def shown_columns(table: Table) -> List[int]:
    """The columns with a value in some row (PPL always): a table of runs without downstream evaluation does not
    print seven empty columns."""
    return [j for j in range(len(COLUMNS)) if j == 0 or any(r.values[j] is not None for r in table.rows)]


def to_markdown(table: Table) -> str:
    cols = shown_columns(table)
    lines = ["| Setting | Method | " + " | ".join(COLUMNS[j] for j in cols) + " |",
             "| --- | --- |" + " ---: |" * len(cols)]
    for label in table.settings:
        for k, (i, row) in enumerate(table.rows_of(label)):
            cells = [f"**{row.texts[j]}**" if table.best.get((i, j)) else row.texts[j] for j in cols]
            lines.append(f"| {label if k == 0 else ''} | {row.method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def to_csv(table: Table) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    cols = shown_columns(table)
    writer.writerow(["Setting", "Method", *(COLUMNS[j] for j in cols)])
    for row in table.rows:
        writer.writerow([row.setting, row.method, *(row.texts[j] for j in cols)])
    return out.getvalue()


_LATEX_ESCAPES = {"&": r"\&", "%": r"\%", "_": r"\_", "#": r"\#", "$": r"\$", "{": r"\{", "}": r"\}"}


def _tex(text: str) -> str:
    text = "".join(_LATEX_ESCAPES.get(c, c) for c in text)
    return text.replace(SPIKE, r"$^{*}$").replace(UNFINISHED, r"$^{\dagger}$").replace(SUBSET, r"$^{\ddagger}$")


def to_latex(table: Table) -> str:
    """A booktabs table (needs \\usepackage{booktabs,multirow})."""
    cols = shown_columns(table)
    lines = [
        r"\begin{tabular}{ll" + "r" * len(cols) + "}",
        r"\toprule",
        "Setting & Method & " + " & ".join(COLUMNS[j] for j in cols) + r" \\",
    ]
    for label in table.settings:
        members = table.rows_of(label)
        lines.append(r"\midrule")
        for k, (i, row) in enumerate(members):
            cells = [r"\textbf{" + _tex(row.texts[j]) + "}" if table.best.get((i, j)) else _tex(row.texts[j])
                     for j in cols]
            first = rf"\multirow{{{len(members)}}}{{*}}{{{_tex(label)}}}" if k == 0 else ""
            lines.append(f"{first} & {_tex(row.method)} & " + " & ".join(cells) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


LEGEND = (
    'diverge: the divergence guard stopped the run (diverged or failed to converge); *: loss spikes during training; '
    "†: not finished (latest values); crashed / stopped / running: no evaluation yet (an error, a signal, still "
    "training); too short: ended before its loss could be judged (warmup plus one convergence window); "
    "a ± b (n=k): mean and standard deviation over k seeds; ‡: scored on a subset (evaluate.py --max-batches: at "
    "most batches x batch size examples a task); "
    "bold: best in its setting, where the sample can tell (not a subset's perplexity; an accuracy leading the "
    "runner-up by more than two binomial standard errors at the examples scored). PPL: validation perplexity; "
    "accuracies in %."
)


def subset_note(table: Table) -> Optional[str]:
    """One line naming the subset sizes in the table, or None."""
    sizes = sorted({r.examples for r in table.rows if r.examples is not None})
    if not sizes:
        return None
    return (f"‡ subset evaluation: at most {', '.join(map(str, sizes))} examples a task (and as many sequences of "
            "validation text), not the run's full evaluation.")


def render(table: Table, fmt: str) -> str:
    return {"markdown": to_markdown, "csv": to_csv, "latex": to_latex}[fmt](table)


def formats() -> Sequence[str]:
    return ("markdown", "csv", "latex")
