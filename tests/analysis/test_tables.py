"""make_tables: the paper's Table 1 layout from run records, cell for cell."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from siamesenorm.analysis.tables import build_table, format_lr, format_tokens, to_csv, to_latex, to_markdown
from siamesenorm.run.records import read_record, write_record

ROOT = Path(__file__).resolve().parents[2]
LABELS = ("arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "openbook_qa", "basic_arithmetic")


def rec(model_type, lr, ppl, accs=None, status="finished", spikes=0, knobs=None, tokens=100_000_000_000, t=1.0):
    return {"model_type": model_type, "learning_rate": lr, "token_budget": tokens, "status": status,
            "val_perplexity": ppl, "loss_spikes": spikes, "variant_knobs": knobs or {}, "updated": t,
            "downstream": dict(zip(LABELS, accs)) if accs else {}}


A = [0.60, 0.30, 0.50, 0.70, 0.55, 0.35, 0.28]
B = [0.62, 0.29, 0.52, 0.70, 0.56, 0.36, 0.396]
RECORDS = [
    rec("hybrid_pre", 1e-3, 10.43, B),
    rec("pre", 1e-3, 10.84, A),
    rec("post", 1e-3, 55.0, status="diverged"),
    rec("residual", 1e-3, 11.2, A, spikes=3),
    rec("hybrid_pre", 1e-3, 10.68, A, knobs={"siamese_depth_scaling": False}),
    rec("pre", 4e-4, 11.5, A, status="stopped"),
    rec("post", 4e-4, 11.5),
]

EXPECTED_MD = """\
| Setting | Method | PPL | ARC-E | ARC-C | HellaSwag | PIQA | WinoGrande | OBQA | Arithmetic | Avg |
| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
| lr 4e-4, 100B tokens | Pre-Norm | **11.50†** | **60.0** | **30.0** | **50.0** | **70.0** | **55.0** | **35.0** | **28.0** | **46.9** |
|  | Post-Norm | **11.50** | - | - | - | - | - | - | - | - |
| lr 1e-3, 100B tokens | Pre-Norm | 10.84 | 60.0 | **30.0** | 50.0 | **70.0** | 55.0 | 35.0 | 28.0 | 46.9 |
|  | Post-Norm | diverge | - | - | - | - | - | - | - | - |
|  | ResiDual | 11.20* | 60.0 | **30.0** | 50.0 | **70.0** | 55.0 | 35.0 | 28.0 | 46.9 |
|  | SiameseNorm | **10.43** | **62.0** | 29.0 | **52.0** | **70.0** | **56.0** | **36.0** | **39.6** | **49.2** |
|  | SiameseNorm (w/o depth-wise scaling) | 10.68 | 60.0 | **30.0** | 50.0 | **70.0** | 55.0 | 35.0 | 28.0 | 46.9 |
"""

EXPECTED_CSV = """\
Setting,Method,PPL,ARC-E,ARC-C,HellaSwag,PIQA,WinoGrande,OBQA,Arithmetic,Avg
"lr 4e-4, 100B tokens",Pre-Norm,11.50†,60.0,30.0,50.0,70.0,55.0,35.0,28.0,46.9
"lr 4e-4, 100B tokens",Post-Norm,11.50,-,-,-,-,-,-,-,-
"lr 1e-3, 100B tokens",Pre-Norm,10.84,60.0,30.0,50.0,70.0,55.0,35.0,28.0,46.9
"lr 1e-3, 100B tokens",Post-Norm,diverge,-,-,-,-,-,-,-,-
"lr 1e-3, 100B tokens",ResiDual,11.20*,60.0,30.0,50.0,70.0,55.0,35.0,28.0,46.9
"lr 1e-3, 100B tokens",SiameseNorm,10.43,62.0,29.0,52.0,70.0,56.0,36.0,39.6,49.2
"lr 1e-3, 100B tokens",SiameseNorm (w/o depth-wise scaling),10.68,60.0,30.0,50.0,70.0,55.0,35.0,28.0,46.9
"""


def test_markdown_cell_for_cell():
    assert to_markdown(build_table(RECORDS, warn=None)) == EXPECTED_MD


def test_csv_cell_for_cell():
    assert to_csv(build_table(RECORDS, warn=None)) == EXPECTED_CSV


def test_latex_marks_best_spikes_and_divergence():
    tex = to_latex(build_table(RECORDS, warn=None))
    assert tex.startswith(r"\begin{tabular}{llrrrrrrrrr}") and tex.rstrip().endswith(r"\end{tabular}")
    assert r"\textbf{10.43}" in tex and r"11.20$^{*}$" in tex and "diverge" in tex
    assert r"\multirow{5}{*}{lr 4e-4, 100B tokens}" not in tex and r"\multirow{5}{*}{lr 1e-3, 100B tokens}" in tex
    assert tex.count(r"\midrule") == 2


def test_newest_record_of_a_method_and_setting_wins(capsys):
    old, new = rec("pre", 1e-3, 12.0, t=1.0), rec("pre", 1e-3, 11.0, t=2.0)
    for order in ([old, new], [new, old]):
        table = build_table(order, warn=sys.stderr)
        assert [r.texts[0] for r in table.rows] == ["11.00"]
    assert "two records of Pre-Norm" in capsys.readouterr().err


def test_number_formats():
    assert [format_lr(x) for x in (4e-4, 1e-3, 2e-3, 2.5e-3, 0.03)] == ["4e-4", "1e-3", "2e-3", "2.5e-3", "3e-2"]
    assert format_tokens(100_000_000_000) == "100B tokens" and format_tokens(350e9) == "350B tokens"
    assert format_tokens(614_400) == "614K tokens"


@pytest.mark.slow
def test_script_reads_run_folders_and_writes_three_formats(tmp_path):
    for i, r in enumerate(RECORDS):
        write_record(tmp_path / "runs" / f"run{i}", r)
    assert read_record(tmp_path / "runs" / "run0")["model_type"] == "hybrid_pre"
    out = tmp_path / "tables"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tables.py"), str(tmp_path / "runs"),
                           "--format", "all", "--output", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (out / "table1.md").read_text() == EXPECTED_MD
    assert (out / "table1.csv").read_text() == EXPECTED_CSV
    assert r"\textbf" in (out / "table1.tex").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("content,needle", [("{not json", "not a JSON run record"),
                                            (json.dumps({"model_type": "pre"}), "lacks learning_rate, status")])
def test_bad_record_is_named_with_what_is_wrong(tmp_path, content, needle):
    (tmp_path / "run.json").write_text(content)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tables.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and needle in proc.stderr and str(tmp_path / "run.json") in proc.stderr


@pytest.mark.slow
def test_no_records_says_where_they_come_from(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tables.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "save_folder" in proc.stderr


def test_different_recipes_are_never_merged_and_seeds_are_aggregated():
    def r(model_type, ppl, recipe, seed, config, status="finished", spikes=0):
        return {**rec(model_type, 1e-2, ppl, status=status, spikes=spikes, tokens=4_096_000), "recipe_hash": recipe,
                "seed": seed, "config": config}

    records = [
        r("pre", 60.0, "aaaaaa111111", 1, "configs/study-cpu.yaml"),
        r("pre", 62.0, "aaaaaa111111", 2, "configs/study-cpu.yaml"),
        r("pre", 64.0, "aaaaaa111111", 3, "configs/study-cpu.yaml", spikes=1),
        r("hybrid_pre", 50.0, "aaaaaa111111", 1, "configs/study-cpu.yaml"),
        r("hybrid_pre", 52.0, "aaaaaa111111", 2, "configs/study-cpu.yaml"),
        r("hybrid_pre", 99.0, "aaaaaa111111", 3, "configs/study-cpu.yaml", status="diverged"),
        r("pre", 30.0, "bbbbbb222222", 1, "configs/tiny-cpu.yaml"),  # same lr and budget, another experiment
    ]
    table = build_table(records, warn=None)
    assert table.settings == ["lr 1e-2, 4.1M tokens, study-cpu [aaaaaa]", "lr 1e-2, 4.1M tokens, tiny-cpu [bbbbbb]"]
    study = {row.method: row.texts[0] for _, row in table.rows_of(table.settings[0])}
    assert study == {"Pre-Norm": "62.00 ± 2.00 (n=3)*", "SiameseNorm": "51.00 ± 1.41 (n=2), 1/3 diverge"}
    assert [row.texts[0] for _, row in table.rows_of(table.settings[1])] == ["30.00"]
    best = [table.rows[i].method for (i, j) in table.best if j == 0]
    assert sorted(best) == ["Pre-Norm", "SiameseNorm"]  # one best per setting: 51.00 in the study, 30.00 alone


def test_crashed_stopped_running_and_too_short_runs_are_marked_and_empty_columns_dropped():
    guard = {"grace_steps": 30, "converge_window": 20}
    crashed = {**rec("pre", 1e-2, None, status="stopped"), "error": "RuntimeError: CUDA error", "seed": 1}
    killed = {**rec("post", 1e-2, None, status="stopped"), "error": "Terminated: killed by SIGTERM"}
    running = rec("hc", 1e-2, None, status="running")
    smoke = {**rec("hybrid_pre", 1e-2, 300.0), "converged": False, "step": 20, "stability": guard}
    failed = {**rec("post_pre", 1e-2, 540.0), "converged": False, "step": 300, "stability": guard}
    seeds = [{**crashed, "seed": 2}, {**crashed, "seed": 3, "updated": 2.0}]
    table = build_table([crashed, killed, running, smoke, failed], warn=None)
    cells = {row.method: row.texts[0] for row in table.rows}
    from siamesenorm.analysis.tables import METHOD_NAMES

    expected = {"pre": "crashed", "post": "stopped", "hc": "running", "hybrid_pre": "too short", "post_pre": "diverge"}
    assert cells == {METHOD_NAMES[mt]: text for mt, text in expected.items()}, cells
    md = to_markdown(table)
    assert md.splitlines()[0] == "| Setting | Method | PPL |"  # no downstream values anywhere: no empty columns
    assert to_csv(table).splitlines()[0] == "Setting,Method,PPL" and "{llr}" in to_latex(table)
    assert build_table(seeds, warn=None).rows[0].texts[0] == "crashed"  # every seed crashed: said so
    full = to_markdown(build_table(RECORDS, warn=None)).splitlines()[0]
    assert full.count("|") == 12  # with downstream values: all nine columns


def _evaluated(record, max_batches, batch_size=8, t=3.0, **changes):
    """``record`` as evaluate.py writes it: an ``evaluation`` field (a subset with ``max_batches``), newer."""
    return {**record, **changes, "updated": t, "path": "eval/evaluation.json",
            "evaluation": {"source": "runs/x", "tasks": [], "tokens": [], "max_batches": max_batches,
                           "batch_size": batch_size}}


def test_a_subset_evaluation_never_replaces_the_runs_own_numbers_and_is_marked(capsys):
    from siamesenorm.analysis.tables import LEGEND, subset_note

    run = {**rec("hybrid_pre", 1e-3, 88.28), "path": "runs/x/run.json"}
    subset = _evaluated(run, 2, val_perplexity=85.96)
    table = build_table([run, subset], warn=sys.stderr)
    assert [r.texts[0] for r in table.rows] == ["88.28"]  # the run's own, though the subset record is newer
    assert "using runs/x/run.json (a full evaluation, not a subset), not eval/evaluation.json" in \
        capsys.readouterr().err
    # alone beside another method's run: marked, its source named, its size under the table, never bold
    table = build_table([subset, {**rec("pre", 1e-3, 90.0), "path": "runs/y/run.json"}], warn=None)
    rows = {r.method: r for r in table.rows}
    assert rows["SiameseNorm [evaluate.py]"].texts[0] == "85.96‡" and rows["Pre-Norm"].texts[0] == "90.00"
    assert not any(table.best.values())  # the lower perplexity is a subset's: nothing can be called best
    assert "‡" in to_markdown(table) and "16 examples" in subset_note(table) and "‡" in LEGEND


def test_bold_only_where_the_sample_can_tell():
    a = [0.625, 0.30, 0.50, 0.70, 0.55, 0.35, 0.28]
    b = [0.500, 0.30, 0.50, 0.70, 0.55, 0.35, 0.28]
    def bold(table, column):
        siamese = next(i for i, r in enumerate(table.rows) if r.method.startswith("SiameseNorm"))
        return bool(table.best.get((siamese, column)))

    full = build_table([rec("hybrid_pre", 1e-3, 10.0, a), rec("pre", 1e-3, 10.5, b)], warn=None)
    assert bold(full, 1) and bold(full, 0)  # full task sets: bold as the paper does
    sixteen = build_table([_evaluated(rec("hybrid_pre", 1e-3, 10.0, a), 2),
                           _evaluated(rec("pre", 1e-3, 10.5, b), 2)], warn=None)
    assert not bold(sixteen, 1)  # 62.5 against 50.0 over 16 examples: within two standard errors
    many = build_table([_evaluated(rec("hybrid_pre", 1e-3, 10.0, a), 200),
                        _evaluated(rec("pre", 1e-3, 10.5, b), 200)], warn=None)
    assert bold(many, 1)  # the same lead over 1,600 examples is clear
    assert not bold(many, 0)  # a subset's perplexity is never bold
