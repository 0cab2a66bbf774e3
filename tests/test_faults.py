"""Faults and second processes (issue 20): one run per save folder, a sweep that leaves no orphan, a finished run
that a rerun leaves alone, a full disk, token files changed under a run, cut records. Tiny runs of the tiny recipe."""

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cluster import TRAIN, checkpointed_mixln, data, env, error_line, metric_steps, record, train  # noqa: F401
from test_training import ROOT, SMALL, TINY, learnable_tokens


def wait_for(condition, what: str, timeout: float = 240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if condition():
                return
        except (ValueError, OSError):  # a file being written
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"


# ---- one run per save folder ---------------------------------------------------------------------------------------
def test_a_second_run_on_a_busy_folder_is_one_line_and_changes_nothing(tmp_path, data):  # noqa: F811
    folder = tmp_path / "run"
    args = [f"--data.paths=[{data}]", f"--save_folder={folder}", "--max_duration=2000", "--save_interval_unsharded=5"]
    first = subprocess.Popen([*TRAIN, str(TINY), *SMALL, *args], cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: max(metric_steps(folder) or [0]) >= 3, "the first run's step 3")
        before = {name: (folder / name).read_bytes() for name in ("config.yaml",)}
        for extra in ([], ["--save_overwrite"], ["--try_load_latest_save"]):
            line = error_line(train([*args, *extra], check=False))
            assert f"{folder} is in use by another run (host " in line and f"pid {first.pid}," in line, line
        assert {name: (folder / name).read_bytes() for name in before} == before
        assert record(folder)["status"] == "running"
        steps = metric_steps(folder)
        assert steps == list(range(1, len(steps) + 1))  # one writer: no step twice, none out of order
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=60)
    # the lock went with the process: the same command now resumes
    end = max(metric_steps(folder)) + 3
    resumed = train([*args, "--try_load_latest_save", f"--max_duration={end}"])
    assert "is in use" not in resumed.stderr and metric_steps(folder) == list(range(1, end + 1))


def test_a_stale_lock_is_taken_over_and_said(tmp_path, data):  # noqa: F811
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / ".run.lock").write_text(json.dumps({"host": "node7", "pid": 4242, "started": "2026-01-01 00:00:00"}))
    proc = train([f"--data.paths=[{data}]", f"--save_folder={folder}", "--max_duration=2"])
    assert "taking over the lock of a run that ended without releasing it (host node7, pid 4242" in proc.stderr
    assert (folder / ".run.lock").read_text() == ""  # a clean end leaves no owner


# ---- a finished run, rerun ------------------------------------------------------------------------------------------
def test_rerunning_a_finished_run_does_nothing_and_says_so(checkpointed_mixln, data):  # noqa: F811
    before = record(checkpointed_mixln)
    args = [f"--data.paths=[{data}]", f"--save_folder={checkpointed_mixln}", "--max_duration=4",
            "--save_interval_unsharded=2", "--save_num_unsharded_checkpoints_to_keep=2",
            "--model.mixln_post_fraction=0.5", "--try_load_latest_save"]
    proc = train(args, MODEL_TYPE="mixln")
    assert "already finished" in proc.stderr and "nothing to do" in proc.stderr
    assert metric_steps(checkpointed_mixln) == [1, 2, 3, 4]
    assert record(checkpointed_mixln) == before
    dry = train([*args, "--dry-run"], MODEL_TYPE="mixln")
    assert "a real start would: nothing, the run already finished" in dry.stdout


# ---- the sweep and its children -------------------------------------------------------------------------------------
def test_a_killed_sweep_leaves_no_orphan_and_its_rerun_finishes_the_cell_exactly(tmp_path):
    data = learnable_tokens(tmp_path / "train.npy")
    plan = tmp_path / "plan.yaml"
    plan.write_text(json.dumps({
        "recipe": str(TINY), "runs": str(tmp_path / "runs"), "results": str(tmp_path / "results"),
        "overrides": [*SMALL, f"--data.paths=[{data}]", "--max_duration=40", "--save_interval_unsharded=5"],
        "analysis_sequences": 2, "analysis_tokens": str(data),
        "groups": [{"methods": ["pre"], "learning_rates": [1e-2], "seeds": [1]}],
    }))
    cmd = [sys.executable, str(ROOT / "scripts" / "sweep.py"), str(plan), "--parallel", "1"]
    run = tmp_path / "runs" / "pre-lr0.01-s1"
    sweep = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: max(metric_steps(run) or [0]) >= 7, "the cell's step 7")
    child = json.loads((run / ".run.lock").read_text())["pid"]
    assert child != sweep.pid and alive(child)
    sweep.kill()  # SIGKILL: the sweep cannot pass anything on itself
    sweep.wait(timeout=30)
    wait_for(lambda: not alive(child), "the training process to end with its sweep", timeout=60)
    assert record(run)["status"] == "stopped" and "SIGTERM" in record(run)["error"]
    rerun = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr[-3000:]
    done = json.loads((tmp_path / "results" / "pre-lr0.01-s1" / "run.json").read_text())
    assert done["status"] == "finished" and done["step"] == done["max_steps"] == 40
    rows = [json.loads(line) for line in (tmp_path / "results" / "pre-lr0.01-s1" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 41))


def test_sigterm_to_a_sweep_reaches_its_training_process(tmp_path):
    data = learnable_tokens(tmp_path / "train.npy")
    plan = tmp_path / "plan.yaml"
    plan.write_text(json.dumps({
        "recipe": str(TINY), "runs": str(tmp_path / "runs"), "results": str(tmp_path / "results"),
        "overrides": [*SMALL, f"--data.paths=[{data}]", "--max_duration=2000"], "analysis_tokens": str(data),
        "groups": [{"methods": ["pre", "post"], "learning_rates": [1e-2], "seeds": [1]}],
    }))
    run = tmp_path / "runs" / "pre-lr0.01-s1"
    sweep = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "sweep.py"), str(plan), "--parallel", "1"],
                             cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: max(metric_steps(run) or [0]) >= 2, "the first cell's step 2")
    child = json.loads((run / ".run.lock").read_text())["pid"]
    sweep.send_signal(signal.SIGTERM)
    out, err = sweep.communicate(timeout=120)
    assert sweep.returncode == 143 and "stopping the running cells" in err
    assert not alive(child) and record(run)["status"] == "stopped"
    assert not (tmp_path / "runs" / "post-lr0.01-s1").exists()  # no new cell started after the signal
