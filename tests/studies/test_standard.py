"""The reporting standard (siamesenorm/studies/standard.py): its statistics against known values and scipy, and its
verdicts on a results folder written here (which rate is best, who is judged, Holm's correction, tolerance)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from siamesenorm.studies.standard import (
    holm,
    page_markers,
    rates_table,
    shape_table,
    standard_report,
    student_t_sf,
    to_markdown,
    tolerance_table,
    update_page,
    welch,
)

ROOT = Path(__file__).resolve().parents[2]


def test_t_tail_matches_known_values_and_scipy():
    # closed forms: df 1 is Cauchy (P(T > t) = 1/2 - atan(t)/pi), df 2 has P(T > t) = (1 - t / sqrt(t^2 + 2)) / 2
    for t in (0.3, 1.0, 2.5, 7.0):
        assert student_t_sf(t, 1) == pytest.approx(0.5 - math.atan(t) / math.pi, abs=1e-12)
        assert student_t_sf(t, 2) == pytest.approx((1 - t / math.sqrt(t * t + 2)) / 2, abs=1e-12)
        assert student_t_sf(-t, 3.7) == pytest.approx(1 - student_t_sf(t, 3.7), abs=1e-12)
    stats = pytest.importorskip("scipy.stats")
    for t, df in ((0.1, 1.3), (2.2, 3.9), (4.5, 2.1), (11.0, 1.9), (1.7, 40.0)):
        assert student_t_sf(t, df) == pytest.approx(float(stats.t.sf(t, df)), rel=1e-9, abs=1e-14)
    a, b = [37.83, 37.76, 37.19], [38.53, 38.35, 39.00]
    ours = welch(a, b)
    theirs = stats.ttest_ind(a, b, equal_var=False)
    assert ours["t"] == pytest.approx(float(theirs.statistic), rel=1e-12)
    assert ours["p"] == pytest.approx(float(theirs.pvalue), rel=1e-9)


def test_holm_steps_down_and_stays_monotone():
    # m = 4: sorted p 0.01, 0.02, 0.03, 0.2 -> 0.04, 0.06, 0.06 (monotone), 0.2
    assert holm([0.03, 0.01, 0.2, 0.02]) == pytest.approx([0.06, 0.04, 0.2, 0.06])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
    assert holm([]) == []


def _cell(results, name, ppl, status="finished", spikes=0, knobs=None):
    folder = results / name
    folder.mkdir(parents=True)
    record = {"status": status, "model_type": name.split("-")[0], "val_perplexity": ppl, "loss_spikes": spikes,
              "learning_rate": float(name.split("-lr")[1].split("-s")[0]), "variant_knobs": knobs or {}}
    (folder / "run.json").write_text(json.dumps(record))


def test_verdicts_follow_the_standard(tmp_path):
    """A method better than Pre-Norm by far more than the seeds' spread is "beyond"; one as good is "within"; one
    with two seeds is not judged; the best rate is the lowest mean with no divergence; Holm counts two tests."""
    one, two = tmp_path / "part1", tmp_path / "part2"
    for seed, ppl in ((1, 40.1), (2, 39.8), (3, 40.3)):
        _cell(one, f"pre-lr0.01-s{seed}", ppl)
        _cell(one, f"pre-lr0.03-s{seed}", ppl + 2, spikes=seed)
        _cell(two, f"good-lr0.03-s{seed}", ppl - 3)
        _cell(two, f"good-lr0.01-s{seed}", ppl - 1)
        _cell(two, f"same-lr0.01-s{seed}", ppl + 0.1 * (-1) ** seed)
    _cell(two, "good-lr0.1-s1", None, status="diverged")
    _cell(two, "fragile-lr0.003-s1", 45.0)
    _cell(two, "fragile-lr0.01-s1", 30.0)
    _cell(two, "fragile-lr0.01-s2", None, status="diverged")  # a diverged seed rules the rate out
    _cell(two, "twoseeds-d_model=32-n_layers=8-lr0.01-s1", 38.0)
    _cell(two, "twoseeds-d_model=32-n_layers=8-lr0.01-s2", 38.2)
    _cell(one, "pre-d_model=32-n_layers=8-lr0.01-s1", 41.0)
    _cell(one, "pre-d_model=32-n_layers=8-lr0.01-s2", 41.5)
    _cell(two, "good-d_model=32-n_layers=8-lr0.01-s1", 36.0)
    _cell(two, "good-d_model=32-n_layers=8-lr0.01-s2", 36.5)
    report = standard_report([one, two])
    rows = {r["configuration"]: r for r in report["comparisons"]}
    assert report["configurations"]["good"]["best_lr"] == 0.03
    assert report["configurations"]["fragile"]["best_lr"] == 0.003
    assert report["comparisons_tested"] == 2  # good and same; the others lack seeds
    assert rows["good"]["verdict"] == "beyond the noise floor (lower PPL)"
    assert rows["good"]["p"] < rows["same"]["p"]
    assert rows["good"]["p_holm"] == pytest.approx(2 * rows["good"]["p"])  # the smallest of two, times 2
    assert rows["same"]["verdict"] == "within the noise floor"
    assert rows["twoseeds-d_model=32-n_layers=8"]["baseline"] == "pre-d_model=32-n_layers=8"
    assert rows["twoseeds-d_model=32-n_layers=8"]["verdict"].startswith("not judged: 2 seeds")
    assert rows["fragile"]["verdict"].startswith("not judged: 1 seed (")
    tolerance = report["configurations"]["good"]["tolerance"]
    assert [(t["multiple"], t["diverged"], t["seeds"]) for t in tolerance] == [(pytest.approx(1 / 0.3), 1, 1)]
    assert report["configurations"]["pre"]["tolerance"][0]["loss_spikes"] == pytest.approx(2.0)
    # the PPL at the higher rate and its rise over the best rate's on the same seeds; none where a seed diverged
    assert report["configurations"]["pre"]["tolerance"][0]["mean"] == pytest.approx(42.0667, abs=1e-3)
    assert report["configurations"]["pre"]["tolerance"][0]["increase"] == pytest.approx(2.0)
    assert tolerance[0]["mean"] is None and tolerance[0]["increase"] is None
    page = to_markdown(report)
    assert "| pre | 0.01 | 0.03 (x3.0): 42.07 (+2.00), 0/3, 0/3, 2.0 |" in page
    # the headline by shape: designs judged at one shape at least, the recipe's shape first, then by depth
    table = shape_table(report)
    assert table in page and page.index(table) < page.index("| configuration | best lr |")
    assert "| design (best lr at the shape) | the recipe's shape | 8 x 32 |" in table
    good = rows["good"]
    holm_p = f"{good['p_holm']:.3f}" if good["p_holm"] >= 1e-3 else f"{good['p_holm']:.1e}"
    assert (f"| good (0.03 at the recipe's shape; 0.01 at 8 x 32) | {good['mean']:.2f} vs {good['baseline_mean']:.2f}: {good['difference']:+.2f}, "
            f"Holm {holm_p}, **beyond, better** | 36.25 (2 seeds): not judged |") in table
    assert "| same (0.01) | " in table and ", within | not run |" in table
    assert "twoseeds" not in table and "fragile" not in table  # judged nowhere: the full table has them
    # tolerance at 2x and 4x: configurations at the recipe's shape with three seeds at their best rate
    tolerance_rows = tolerance_table(report).splitlines()
    assert "| pre | 0.01: 40.07 (3) | 0.02: not run | 0.04: not run | 0/3, 0/3, 6 |" in tolerance_rows
    assert "| good | 0.03: 37.07 (3) | 0.06: not run | 0.12: not run | 1/1, 0/1, 0 |" in tolerance_rows
    assert not any(r.startswith(("| fragile", "| twoseeds")) for r in tolerance_rows)
    # the rate sweep at the recipe's shape: configurations run at two rates or more, the best in bold
    rates = {r.split(" | ")[0][2:]: r.split(" | ")[1:] for r in rates_table(report).splitlines() if r.startswith("| ")}
    assert rates["configuration"] == ["0.003", "0.01", "0.03", "0.1", "best rate |"]
    assert rates["good"] == ["", "39.07 ± 0.25 (3)", "**37.07 ± 0.25 (3)**", "1/1 diverged", "0.03 |"]
    assert rates["fragile"] == ["**45.00**", "1/2 diverged", "", "", "0.003 |"]
    assert "same" not in rates and not any("n_layers" in k for k in rates)  # one rate; another shape
    assert "| good | 0.03 | 3 |" in page and "beyond the noise floor" in page
    assert report["configurations"]["good"]["chosen_on_seeds"] == [1, 2, 3]

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "study_report.py"), str(two), "--standard", "--with",
                           str(one), "--output", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "2 judged" in proc.stdout and (out / "standard.md").read_text() == page


def test_the_best_rate_is_chosen_on_the_seeds_every_rate_ran(tmp_path):
    """Seeds 2 and 3 added at the rate seed 1 chose, and worse than seed 1: the choice stays (made on seed 1, the
    seed both rates ran), so the configuration keeps its three seeds and a verdict; chosen on every seed's mean, the
    one-seed rate would win and the comparison would go unjudged."""
    for seed, ppl in ((1, 40.1), (2, 39.8), (3, 40.3)):
        _cell(tmp_path, f"pre-lr0.01-s{seed}", ppl)
    for seed, ppl in ((1, 37.5), (2, 39.6), (3, 39.7)):  # mean 38.93
        _cell(tmp_path, f"keel-lr0.03-s{seed}", ppl)
    _cell(tmp_path, "keel-lr0.01-s1", 38.7)  # above seed 1 at 3e-2, below the three seeds' mean
    report = standard_report([tmp_path])
    keel = report["configurations"]["keel"]
    assert keel["best_lr"] == 0.03 and keel["chosen_on_seeds"] == [1]
    row = next(r for r in report["comparisons"] if r["configuration"] == "keel")
    assert row["n"] == 3 and "p_holm" in row


def test_every_configuration_can_be_judged_against_another_reference(tmp_path):
    """``reference`` / ``--against``: the same standard with another MODEL_TYPE in Pre-Norm's place (does a lead
    hold against each other design?). Pre-Norm is then one of the compared configurations, the reference's own
    knob forms are compared with its plain form at their shape, a shape the reference never ran is not judged,
    and a MODEL_TYPE no cell ran is refused in one line."""
    for seed, ppl in ((1, 40.1), (2, 39.8), (3, 40.3)):
        _cell(tmp_path, f"pre-lr0.01-s{seed}", ppl)
        _cell(tmp_path, f"good-lr0.01-s{seed}", ppl - 3)
        _cell(tmp_path, f"rival-lr0.01-s{seed}", ppl - 3 + 0.1 * (-1) ** seed)
        _cell(tmp_path, f"good-mix=on-lr0.01-s{seed}", ppl - 2.9, knobs={"mix": "on"})
        _cell(tmp_path, f"pre-d_model=32-n_layers=8-lr0.01-s{seed}", ppl + 1)
    report = standard_report([tmp_path], reference="good")
    rows = {r["configuration"]: r for r in report["comparisons"]}
    assert set(rows) == {"pre", "rival", "good-mix=on", "pre-d_model=32-n_layers=8"}
    assert rows["pre"]["baseline"] == "good" and rows["pre"]["difference"] == pytest.approx(3.0)
    assert rows["pre"]["verdict"] == "beyond the noise floor (higher PPL)"
    assert rows["rival"]["verdict"] == "within the noise floor"
    assert rows["good-mix=on"]["baseline"] == "good"
    assert rows["pre-d_model=32-n_layers=8"]["verdict"] == "not judged: no good cells at this shape"
    assert report["comparisons_tested"] == 3
    assert "against good at its own" in to_markdown(report) and "| good (lr, seeds, PPL) |" in to_markdown(report)
    assert {r["configuration"] for r in standard_report([tmp_path])["comparisons"]} == {"good", "rival", "good-mix=on"}

    out = tmp_path / "out"
    script = [sys.executable, str(ROOT / "scripts" / "study_report.py"), str(tmp_path), "--standard", "--output", str(out)]
    proc = subprocess.run(script + ["--against", "good"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "3 judged" in proc.stdout and (out / "standard-vs-good.md").read_text() == to_markdown(report)
    assert not (out / "standard.md").exists()
    proc = subprocess.run(script + ["--against", "keel"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--against keel: no cell" in proc.stderr


def test_the_rate_sweep_table_has_one_table_per_shape_with_its_own_best_rate(tmp_path):
    """A rate sweep at another shape (the depth study's rate check) gets a table of its own after the recipe's shape,
    rows named by design (the shape in the heading), the best rate chosen at that shape; a shape run at one rate
    only, and a configuration on another schedule, get none."""
    for seed, ppl in ((1, 40.1), (2, 39.8), (3, 40.3)):
        _cell(tmp_path, f"pre-lr0.01-s{seed}", ppl)
        _cell(tmp_path, f"pre-lr0.03-s{seed}", ppl + 2)
    _cell(tmp_path, "pre-d_model=128-n_layers=4-lr0.01-s1", 40.7)
    _cell(tmp_path, "pre-d_model=128-n_layers=4-lr0.003-s1", 39.3)
    _cell(tmp_path, "pre-d_model=128-n_layers=4-lr0.003-s2", 39.4)
    _cell(tmp_path, "good-d_model=128-n_layers=4-lr0.01-s1", 34.5)
    _cell(tmp_path, "good-d_model=128-n_layers=4-lr0.03-s1", 38.2)
    _cell(tmp_path, "good-d_model=32-n_layers=64-lr0.01-s1", 47.0)  # one rate at 64 x 32: no table there
    _cell(tmp_path, "pre-scheduler.t_warmup=0-lr0.01-s1", 41.0)  # another schedule: no row anywhere
    _cell(tmp_path, "pre-scheduler.t_warmup=0-lr0.03-s1", 42.0)
    text = rates_table(standard_report([tmp_path]))
    assert "At 64 x 32" not in text and "t_warmup" not in text
    recipe, deep = text.split("At the recipe's shape:")[1].split("At 4 x 128 (n_layers x d_model):")
    assert [r.split(" | ")[0][2:] for r in recipe.splitlines() if r.startswith("| ")] == ["configuration", "---", "pre"]
    rows = {r.split(" | ")[0][2:]: r.split(" | ")[1:] for r in deep.splitlines() if r.startswith("| ")}
    assert rows["configuration"] == ["0.003", "0.01", "0.03", "best rate |"]
    assert rows["pre"] == ["**39.35 ± 0.07 (2)**", "40.70", "", "0.003 |"]  # chosen on seed 1, the one both ran
    assert rows["good"] == ["", "**34.50**", "38.20", "0.01 |"]


def test_the_page_gets_the_verdicts_by_shape_between_its_markers(tmp_path):
    """``--page``: the shape table is written between the page's two markers (the rest kept byte for byte, a rerun
    changes nothing); a page without the markers is refused in one line before anything is written."""
    results = tmp_path / "results"
    for seed, ppl in ((1, 40.1), (2, 39.8), (3, 40.3)):
        _cell(results, f"pre-lr0.01-s{seed}", ppl)
        _cell(results, f"good-lr0.01-s{seed}", ppl - 3)
    begin, end = page_markers("pre")
    tbegin, tend = page_markers(table="tolerance")
    page = tmp_path / "README.md"
    before, after = "# A study\n\nIntro.\n\n", f"\n\nMore text, kept.\n{tbegin}\nstale\n{tend}\nThe end.\n"
    page.write_text(f"{before}{begin}\nstale table\n{end}{after}")
    out = tmp_path / "figures"
    cmd = [sys.executable, str(ROOT / "scripts" / "study_report.py"), str(results), "--standard", "--output", str(out),
           "--page", str(page)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = standard_report([results])
    table = shape_table(report)
    after = after.replace("stale", tolerance_table(report).rstrip("\n"))
    assert page.read_text() == f"{before}{begin}\n{table}{end}{after}" and "stale" not in page.read_text()
    assert "| good (0.01) | 37.07 vs 40.07: -3.00" in table
    assert subprocess.run(cmd, capture_output=True, text=True, timeout=120).returncode == 0
    assert page.read_text() == f"{before}{begin}\n{table}{end}{after}"  # a rerun: the same page

    bare = tmp_path / "bare.md"
    bare.write_text("no markers here\n")
    proc = subprocess.run(cmd[:-1] + [str(bare)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "markers" not in proc.stdout
    assert begin in proc.stderr and bare.read_text() == "no markers here\n"
    for flags in (["--page", str(page)], ["--standard", "--tag", "pooled"]):  # a flag without the one it needs
        proc = subprocess.run(cmd[:3] + ["--output", str(out)] + flags, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "goes with" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_tagged_table_is_written_between_its_own_markers_only(tmp_path):
    """``--tag``: one page holds the tables of several sets of folders; a tagged report rewrites its own block and
    leaves the untagged one (and the tolerance table) as they were."""
    for seed, ppl in ((1, 40.1), (2, 39.8), (3, 40.3)):
        _cell(tmp_path, f"pre-lr0.01-s{seed}", ppl)
        _cell(tmp_path, f"good-lr0.01-s{seed}", ppl - 3)
    report = standard_report([tmp_path])
    (b, e), (tb, te), (pb, pe) = page_markers("pre"), page_markers(table="tolerance"), page_markers("pre", tag="pooled")
    assert len({b, tb, pb}) == 3 and "(pooled)" in pb and "(pooled)" in pe
    text = f"{b}\nmain\n{e}\n{tb}\ntol\n{te}\n{pb}\nold\n{pe}\n"
    out = update_page(text, report, tag="pooled")
    assert out == f"{b}\nmain\n{e}\n{tb}\ntol\n{te}\n{pb}\n{shape_table(report)}{pe}\n"
    with pytest.raises(ValueError, match="pooled"):
        update_page(f"{b}\nmain\n{e}\n", report, tag="pooled")
