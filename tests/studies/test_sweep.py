"""The sweep driver on two tiny cells: runs them, keeps results and analyses, drops checkpoints, skips done cells."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_training import ROOT, SMALL, TINY, learnable_tokens

from siamesenorm.studies.standard import (
    page_markers,
    rates_table,
    shape_table,
    standard_report,
    to_markdown,
    tolerance_table,
)
from siamesenorm.studies.sweep import load_plan, status


@pytest.mark.slow
def test_sweep_runs_two_cells_then_skips_them(tmp_path):
    data = learnable_tokens(tmp_path / "train.npy")
    val = learnable_tokens(tmp_path / "val.npy", seed=1)
    plan = tmp_path / "plan.yaml"
    overrides = [*SMALL, f"--data.paths=[{data}]", "--max_duration=6", "--save_interval_unsharded=3"]
    plan.write_text(json.dumps({
        "recipe": str(TINY), "runs": str(tmp_path / "runs"), "results": str(tmp_path / "results"),
        "overrides": overrides, "analysis_sequences": 4, "analysis_tokens": str(val),
        "groups": [{"methods": ["pre", "hybrid_pre"], "learning_rates": [1e-2], "seeds": [1]}],
    }))
    cmd = [sys.executable, str(ROOT / "scripts" / "sweep.py"), str(plan)]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr[-3000:]
    assert "2 cells, 0 done, 2 to run" in first.stdout
    loaded = load_plan(plan)
    assert [c.name for c in loaded.cells] == ["pre-lr0.01-s1", "hybrid_pre-lr0.01-s1"]
    for cell in loaded.cells:
        assert status(loaded, cell) == "finished"
        out = tmp_path / "results" / cell.name
        record = json.loads((out / "run.json").read_text())
        assert record["model_type"] == cell.model_type and record["learning_rate"] == 1e-2 and record["seed"] == 1
        analyses = json.loads((out / "analysis.json").read_text())
        assert analyses["magnitudes"]["applies"] and analyses["depth"]["applies"]
        assert analyses["lens"]["applies"] == (cell.model_type == "hybrid_pre")
        kept = gzip.decompress((out / "metrics.jsonl.gz").read_bytes()).decode()  # kept compressed, same lines
        assert kept == (tmp_path / "runs" / cell.name / "metrics.jsonl").read_text() and len(kept.splitlines()) >= 6
        assert not (out / "metrics.jsonl").exists()
        assert not list((tmp_path / "runs" / cell.name).glob("step*"))  # checkpoints dropped after analysis
        assert not (tmp_path / "runs" / cell.name / "results-staged").exists()  # staged, then moved into place whole
    second = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0 and "2 cells, 2 done, 0 to run" in second.stdout
    # the study report reads the same results: one grid cell per method, the figures written
    report = subprocess.run([sys.executable, str(ROOT / "scripts" / "study_report.py"), str(tmp_path / "results"),
                             "--output", str(tmp_path / "report"), "--smooth", "2"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-3000:]
    summary = json.loads((tmp_path / "report" / "report.json").read_text())
    assert summary["cells"] == 2 and set(summary["grid"]) == {"Pre-Norm", "SiameseNorm"}
    kept = tmp_path / "results" / "pre-lr0.01-s1" / "metrics.jsonl.gz"
    rows = [json.loads(line) for line in gzip.decompress(kept.read_bytes()).decode().splitlines()]
    grads = sorted(r["grad_norm"] for r in rows if "grad_norm" in r and r["step"] > 2)  # after the 2 warmup steps
    assert summary["grid"]["Pre-Norm"]["1e-2"]["grad_norm_max_after_warmup"] == grads[-1]
    assert summary["grid"]["Pre-Norm"]["1e-2"]["seeds"] == 1
    assert summary["analyses"]["hybrid_pre-lr0.01-s1"]["fusion_weights"] is not None
    assert (tmp_path / "report" / "study-loss.png").stat().st_size > 0
    assert (tmp_path / "report" / "study-magnitudes.png").stat().st_size > 0


def test_a_sweep_without_its_data_says_so_once_and_starts_no_cell(tmp_path):
    """The recipe's token files missing (a fresh machine before scripts/prepare_data.py): one line naming the
    missing files and how to prepare them, exit 2, no cell started or marked; with the data in place the same
    command gets past the check (--only a name no cell has: nothing to train, exit 0)."""
    plan = tmp_path / "plan.yaml"
    missing = tmp_path / "nowhere" / "train" / "*.npy"
    spec = {"recipe": str(TINY), "runs": str(tmp_path / "runs"), "results": str(tmp_path / "results"),
            "overrides": [*SMALL, f"--data.paths=[{missing}]"],
            "groups": [{"methods": ["pre", "hybrid_pre"], "learning_rates": [1e-2], "seeds": [1, 2]}]}
    plan.write_text(json.dumps(spec))
    cmd = [sys.executable, str(ROOT / "scripts" / "sweep.py"), str(plan)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no data at" in lines[0] and "prepare_data.py" in lines[0], proc.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "results").exists()
    spec["overrides"] = [*SMALL, f"--data.paths=[{learnable_tokens(tmp_path / 'train.npy')}]"]
    plan.write_text(json.dumps(spec))
    proc = subprocess.run([*cmd, "--only", "no-such-cell"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "0 to run" in proc.stdout, proc.stdout + proc.stderr[-3000:]


def test_a_cell_another_sweep_finished_meanwhile_is_not_trained_again(tmp_path, monkeypatch):
    """Two sweeps of one plan (a second shell, a second session): each draws its list of cells to run when it
    starts; a cell the other one finished since is reported as such and its record left alone, not trained over."""
    from siamesenorm.studies import sweep

    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(json.dumps({
        "recipe": str(TINY), "runs": str(tmp_path / "runs"), "results": str(tmp_path / "results"),
        "groups": [{"methods": ["pre", "hybrid_pre"], "learning_rates": [1e-2], "seeds": [1]}]}))
    plan = load_plan(plan_file)
    first, second = plan.cells
    trained = []

    def fake_run_cell(plan, cell, keep_checkpoints=False):  # training the first, "another process" ends the second
        trained.append(cell.name)
        (Path(plan.results) / second.name).mkdir(parents=True)
        (Path(plan.results) / second.name / "run.json").write_text(json.dumps({"status": "finished", "mark": 1}))
        return "finished"

    monkeypatch.setattr(sweep, "run_cell", fake_run_cell)
    outcomes = sweep.run_plan(plan, parallel=1, echo=lambda line: None)
    assert trained == [first.name]
    assert outcomes == {first.name: "finished", second.name: "finished by another process"}
    assert json.loads((Path(plan.results) / second.name / "run.json").read_text())["mark"] == 1


@pytest.mark.slow
def test_v2_plan_groups_knobs_settings_and_checkpoints_over_time(tmp_path):
    """The second sweep's plan features on tiny cells: model shapes as knobs, a schedule setting, a cell analysed at
    several checkpoints; then the v2 report reads depth, warmup, over-time and massive-activation numbers."""
    from siamesenorm.studies import depth_and_dynamics

    data = learnable_tokens(tmp_path / "train.npy")
    plan = tmp_path / "plan.yaml"
    plan.write_text(json.dumps({
        "recipe": str(TINY), "runs": str(tmp_path / "runs"), "results": str(tmp_path / "results"),
        "overrides": [*SMALL, f"--data.paths=[{data}]", "--max_duration=6"], "analysis_sequences": 4,
        "analysis_tokens": str(data),
        "groups": [{"methods": ["pre"], "learning_rates": [1e-2], "seeds": [1], "knobs": {"n_layers": 4}},
                   {"methods": ["hybrid_pre"], "learning_rates": [1e-2], "seeds": [1],
                    "settings": {"max_duration": 8, "scheduler.t_warmup": 0}, "analyse_every": 4}],
    }))
    loaded = load_plan(plan)
    assert [c.name for c in loaded.cells] == ["pre-n_layers=4-lr0.01-s1",
                                              "hybrid_pre-max_duration=8-scheduler.t_warmup=0-lr0.01-s1"]
    assert "--scheduler.t_warmup=0" in loaded.cells[1].overrides() and "--model.n_layers=4" in loaded.cells[0].overrides()
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "sweep.py"), str(plan)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    for cell in loaded.cells:  # the trainer's console.log holds each line once; what the process printed is beside it
        steps = [line for line in (tmp_path / "runs" / cell.name / "console.log").read_text().splitlines()
                 if " | loss " in line]
        assert steps and len(steps) == len(set(steps)), steps
        assert " | loss " in (tmp_path / "runs" / cell.name / "sweep-output.log").read_text()
    steps = json.loads((tmp_path / "results" / loaded.cells[1].name / "analysis-steps.json").read_text())
    assert sorted(steps, key=int) == ["4", "8"] and all(a["lens"]["applies"] for a in steps.values())
    summary = depth_and_dynamics.report(tmp_path / "results", base_depth=2, base_warmup=2, base_steps=6)
    assert summary["depth"]["pre"]["4"]["width"] == 32 and summary["depth"]["pre"]["4"]["ppl"]["n"] == 1
    assert summary["depth"]["pre"]["4"]["quarter_pruned"][0]["removed"] == 1
    fusion = summary["over_time"][loaded.cells[1].name]
    assert list(fusion) == ["4", "8"] and set(fusion["8"]["fusion_weights"]) == {"x_hybrid", "y_pre"}
    massive = json.loads((tmp_path / "results" / loaded.cells[0].name / "analysis.json").read_text())["massive"]
    top = massive["massive"]["residual"]
    assert len(top["ratio"]) == 5 and all(r >= 1 for r in top["ratio"])  # embedding + 4 layers; max >= median
    assert all(t[0] >= t[-1] for t in top["top"])


def test_each_study_folder_holds_its_plan_results_figures_and_page():
    """studies/<study>/: the plan loads, its results: points into the folder, every committed cell is one of the
    plan's cells (with its record and compressed metrics), and the page names the figures it shows."""
    studies = sorted(p.parent for p in (ROOT / "studies").glob("*/sweep.yaml"))
    assert [s.name for s in studies] == ["cpu-2026-field", "cpu-depth-dynamics", "cpu-lr-grid"]
    for study in studies:
        plan = load_plan(str(study / "sweep.yaml"))
        assert Path(plan.results).resolve() == (study / "results").resolve(), plan.results
        committed = {p.name for p in (study / "results").iterdir() if p.is_dir()}
        assert committed and committed <= {c.name for c in plan.cells}, committed - {c.name for c in plan.cells}
        for cell in committed:
            assert (study / "results" / cell / "run.json").is_file()
            assert (study / "results" / cell / "metrics.jsonl.gz").is_file(), cell
        page = (study / "README.md").read_text()
        assert any(f.name in page for f in (study / "figures").glob("*.png")), study.name


FIELD_REPORT = ("python scripts/study_report.py studies/cpu-2026-field/results --standard --with "
                "studies/cpu-lr-grid/results studies/cpu-depth-dynamics/results --output studies/cpu-2026-field/figures "
                "--page studies/cpu-2026-field/README.md")


def test_the_field_study_page_and_figures_are_what_its_committed_records_give(monkeypatch):
    """studies/cpu-2026-field: figures/standard*.json and .md, and the verdicts-by-shape tables in its README, are
    the report over the committed records as they stand (against Pre-Norm and against SiameseNorm; the tolerance
    table; the study's and the replication's records pooled): a record committed without rerunning the report, or a
    table edited by hand, fails here."""
    monkeypatch.chdir(ROOT)
    study = Path("studies/cpu-2026-field")
    folders = [str(study / "results"), "studies/cpu-lr-grid/results", "studies/cpu-depth-dynamics/results"]
    page = (study / "README.md").read_text()
    for reference, stem in (("pre", "standard"), ("hybrid_pre", "standard-vs-hybrid_pre")):
        report = standard_report(folders, reference=reference)
        rerun = FIELD_REPORT + ("" if reference == "pre" else " --against hybrid_pre")
        committed = json.loads((study / "figures" / f"{stem}.json").read_text())
        assert committed == json.loads(json.dumps(report)), f"figures/{stem}.json is stale: rerun {rerun}"
        assert (study / "figures" / f"{stem}.md").read_text() == to_markdown(report), f"rerun {rerun}"
        begin, end = page_markers(reference)
        assert f"{begin}\n{shape_table(report)}{end}" in page, f"the README's table against {reference}: rerun {rerun}"
        if reference == "pre":
            for table, write in (("tolerance", tolerance_table), ("rates", rates_table)):
                begin, end = page_markers(table=table)
                assert f"{begin}\n{write(report)}{end}" in page, f"the README's {table} table: rerun {rerun}"
    # the study's records and the replication's pooled (six seeds a side where both ran): figures/pooled/
    report = standard_report(folders + [str(study / "replication")])
    rerun = (FIELD_REPORT.replace("cpu-depth-dynamics/results", "cpu-depth-dynamics/results studies/cpu-2026-field/"
                                  "replication").replace("figures", "figures/pooled") + " --tag pooled")
    committed = json.loads((study / "figures" / "pooled" / "standard.json").read_text())
    assert committed == json.loads(json.dumps(report)), f"figures/pooled/standard.json is stale: rerun {rerun}"
    begin, end = page_markers("pre", tag="pooled")
    assert f"{begin}\n{shape_table(report)}{end}" in page, f"the README's pooled table: rerun {rerun}"


def test_the_replication_plan_reruns_every_judged_configuration_with_seeds_the_study_did_not_use():
    """studies/cpu-2026-field/replicate.yaml: each configuration judged at depth 16 (figures/standard.json) and its
    Pre-Norm, at the best rates the study found, on at least three seeds none of which a committed record of that
    configuration used; Pre-Norm at every shape the plan runs; its results kept apart from the study's."""
    study = ROOT / "studies" / "cpu-2026-field"
    plan = load_plan(str(study / "replicate.yaml"))
    standard = json.loads((study / "figures" / "standard.json").read_text())
    judged = {}
    for c in standard["comparisons"]:
        if not c["verdict"].startswith("not judged") and "n_layers=" not in c["configuration"]:  # depth 16
            judged[c["configuration"]], judged[c["baseline"]] = c["lr"], c["baseline_lr"]
    assert len(judged) >= 9 and "pre" in judged, judged
    cells: dict = {}
    for cell in plan.cells:
        cells.setdefault((cell.name.rsplit("-lr", 1)[0], cell.learning_rate), set()).add(cell.seed)
    for configuration, lr in judged.items():
        seeds = cells.get((configuration, lr), set())
        used = {seed for rate in standard["configurations"][configuration]["rates"].values() for seed in rate["seeds"]}
        assert len(seeds) >= 3 and not seeds & used, (configuration, lr, seeds, used)
    shape = {cell: tuple((k, v) for k, v in cell.knobs if k in ("n_layers", "d_model")) for cell in plan.cells}
    assert set(shape.values()) == {shape[c] for c in plan.cells if c.model_type == "pre"}, shape
    assert Path(plan.results).resolve() != (study / "results").resolve()
    # its committed records (if any yet) are the plan's cells, each with its record and compressed metrics, and
    # none reuses a seed of the study's records of its configuration
    replicated = Path(plan.results)
    replicated = replicated if replicated.is_absolute() else ROOT / replicated
    names = {c.name: c for c in plan.cells}
    for folder in (replicated.iterdir() if replicated.is_dir() else ()):
        assert folder.name in names, folder.name
        assert (folder / "run.json").is_file() and (folder / "metrics.jsonl.gz").is_file(), folder.name
        record = json.loads((folder / "run.json").read_text())
        assert record["seed"] == names[folder.name].seed and record["seed"] >= 4, folder.name


@pytest.mark.slow
def test_a_sweep_with_framework_olmo_core_trains_its_cells_on_olmo_core(tmp_path, austen_prepared):
    """``framework: olmo_core``: each cell is trained by scripts/train_olmo_core.py, its record and results kept as
    on the ai2-olmo path, analysed from OLMo-core checkpoints over time; an unknown framework is one line."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(json.dumps({
        "recipe": str(TINY), "runs": str(tmp_path / "runs"), "results": str(tmp_path / "results"),
        "overrides": ["--max_duration=4", "--device_train_microbatch_size=8", "--evaluators=[]"],
        "analysis_sequences": 4, "analysis_tokens": str(austen_prepared / "val" / "*.npy"), "framework": "olmo_core",
        "groups": [{"methods": ["hybrid_pre"], "learning_rates": [1e-2], "seeds": [1], "analyse_every": 2}],
    }))
    loaded = load_plan(plan)
    assert loaded.framework == "olmo_core" and "--save_interval=2" in loaded.cells[0].overrides("olmo_core")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "sweep.py"), str(plan)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = tmp_path / "results" / loaded.cells[0].name
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "finished" and record["framework"].startswith("OLMo-core")
    steps = json.loads((out / "analysis-steps.json").read_text())
    assert sorted(steps, key=int) == ["2", "4"] and all(a["lens"]["applies"] for a in steps.values())
    assert json.loads((out / "analysis.json").read_text())["magnitudes"]["applies"]
    plan.write_text(plan.read_text().replace('"olmo_core"', '"olmo-core"'))
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "sweep.py"), str(plan)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "framework must be one of ai2_olmo, olmo_core (got 'olmo-core')" in bad.stderr


def test_a_sigterm_delivered_to_a_worker_thread_stops_the_sweep_at_once(tmp_path, monkeypatch):
    """The kernel may hand a process's SIGTERM to any of its threads; Python runs the handler in the main thread
    only. The sweep's main thread must not sleep through it in one long wait for a cell: a SIGTERM sent to the
    worker thread training a (here: pretend) hour-long cell stops the sweep within seconds, not when the cell ends."""
    import signal
    import threading
    import time

    from siamesenorm.studies import sweep

    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(json.dumps({
        "recipe": str(TINY), "runs": str(tmp_path / "runs"), "results": str(tmp_path / "results"),
        "groups": [{"methods": ["pre", "hybrid_pre"], "learning_rates": [1e-2], "seeds": [1]}]}))
    plan = load_plan(plan_file)
    monkeypatch.setattr(sweep, "_stopping", threading.Event())
    workers = []

    def long_cell(plan, cell, keep_checkpoints=False):  # a training child would get SIGTERM from stop_children
        workers.append(threading.get_ident())
        for _ in range(1200):  # 60 s unless the sweep stops
            if sweep.stopping():
                return "stopped"
            time.sleep(0.05)
        return "finished"

    monkeypatch.setattr(sweep, "run_cell", long_cell)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sweep.stop_children(signum))
    try:
        def send():
            while not workers:
                time.sleep(0.05)
            signal.pthread_kill(workers[0], signal.SIGTERM)

        threading.Thread(target=send, daemon=True).start()
        t0 = time.time()
        outcomes = sweep.run_plan(plan, parallel=1, echo=lambda line: None)
        took = time.time() - t0
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert took < 10, took  # before: the full 60 s of the cell
    assert outcomes == {plan.cells[0].name: "stopped"}  # the second cell never started


def test_a_cell_the_sweep_stops_before_its_trainer_starts_is_stopped_not_an_error(tmp_path, monkeypatch):
    """The sweep's SIGTERM can reach a training process in its first second, before the trainer has put in its
    handler (seen: a cell started as the sweep was stopped, killed by the signal, no record written). That cell lost
    nothing and resumes on the next run: it is reported stopped, not as an error of the cell."""
    import threading
    import time

    from siamesenorm.studies import sweep

    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(json.dumps({
        "recipe": str(TINY), "runs": str(tmp_path / "runs"), "results": str(tmp_path / "results"),
        "groups": [{"methods": ["pre"], "learning_rates": [1e-2], "seeds": [1]}]}))
    plan = load_plan(plan_file)
    starting = tmp_path / "starting.py"  # a trainer still importing: no handler, no record
    starting.write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setitem(sweep.FRAMEWORKS, plan.framework, (str(starting), "step*"))
    monkeypatch.setattr(sweep, "_stopping", threading.Event())

    def stop_once_started():
        while not sweep._children:
            time.sleep(0.02)
        sweep.stop_children()

    threading.Thread(target=stop_once_started, daemon=True).start()
    t0 = time.time()
    with pytest.raises(sweep.CellStopped):
        sweep.run_cell(plan, plan.cells[0])
    assert time.time() - t0 < 30
    assert not (tmp_path / "results" / plan.cells[0].name).exists()
    # a training process that dies of something else during a stop is still an error, with its exit status
    crashing = tmp_path / "crashing.py"
    crashing.write_text("import sys\nsys.exit(3)\n")
    monkeypatch.setitem(sweep.FRAMEWORKS, plan.framework, (str(crashing), "step*"))
    monkeypatch.setattr(sweep, "_run_child", lambda cmd, env, out: subprocess.call(cmd, env=env, stdout=out))
    with pytest.raises(RuntimeError, match="training exited 3"):
        sweep.run_cell(plan, plan.cells[0])


def test_a_sweep_stopped_while_it_analyses_a_cell_stops_at_once_and_analyses_it_on_the_next_run(tmp_path, monkeypatch):
    """A cell's analyses run after its training (15 min for an mHC cell of 64 layers): a SIGTERM then must stop
    them as it stops training, within seconds, leave no results folder, and the next run must analyse the cell."""
    import threading
    import time

    from siamesenorm.studies import sweep

    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(json.dumps({
        "recipe": str(TINY), "runs": str(tmp_path / "runs"), "results": str(tmp_path / "results"),
        "groups": [{"methods": ["pre"], "learning_rates": [1e-2], "seeds": [1]}]}))
    plan = load_plan(plan_file)
    cell = plan.cells[0]
    trained = tmp_path / "trained.py"  # a trainer whose run is at its last step: it writes a finished record
    trained.write_text("import json, sys\n"
                       "folder = [a.split('=', 1)[1] for a in sys.argv if a.startswith('--save_folder=')][0]\n"
                       "open(folder + '/run.json', 'w').write(json.dumps({'status': 'finished', 'step': 6}))\n")
    monkeypatch.setitem(sweep.FRAMEWORKS, plan.framework, (str(trained), "step*"))
    slow = tmp_path / "slow_analyses.py"
    slow.write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setattr(sweep, "analysis_command", lambda plan, cell, run_dir, stage: [sys.executable, str(slow)])
    monkeypatch.setattr(sweep, "_stopping", threading.Event())

    def stop_once_analysing():
        while not any(str(slow) in proc.args for proc in list(sweep._children)):
            time.sleep(0.02)
        sweep.stop_children()

    threading.Thread(target=stop_once_analysing, daemon=True).start()
    t0 = time.time()
    with pytest.raises(sweep.CellStopped):
        sweep.run_cell(plan, cell)
    assert time.time() - t0 < 30  # before: the analyses ran to their end in the sweep's own process
    assert status(plan, cell) is None and not (tmp_path / "results" / cell.name).exists()
    # the next run: the analyses run again and the results land whole; an analysis that fails is an error
    writes = tmp_path / "analyses.py"
    writes.write_text("import json, sys\nopen(sys.argv[1] + '/analysis.json', 'w').write(json.dumps({'done': 1}))\n")
    monkeypatch.setattr(sweep, "_stopping", threading.Event())
    monkeypatch.setattr(sweep, "analysis_command",
                        lambda plan, cell, run_dir, stage: [sys.executable, str(writes), str(stage)])
    assert sweep.run_cell(plan, cell) == "finished"
    assert json.loads((tmp_path / "results" / cell.name / "analysis.json").read_text()) == {"done": 1}
    assert status(plan, cell) == "finished"
    monkeypatch.setattr(sweep, "analysis_command", lambda plan, cell, run_dir, stage: [sys.executable, "-c", "1/0"])
    with pytest.raises(RuntimeError, match="its analyses exited 1"):
        sweep.run_cell(plan, cell)
