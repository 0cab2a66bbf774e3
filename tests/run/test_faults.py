"""Faults and second processes: one run per save folder, a sweep that leaves no orphan, a finished run
that a rerun leaves alone, a full disk, token files changed under a run, cut records. Tiny runs of the tiny recipe."""

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cluster import TRAIN, checkpointed_mixln, data, env, error_line, metric_steps, record, train  # noqa: F401
from test_training import ROOT, SMALL, TINY, learnable_tokens

from siamesenorm.run.records import read_metrics_rows


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
@pytest.mark.slow
def test_a_second_run_on_a_busy_folder_is_one_line_and_changes_nothing(tmp_path, data):  # noqa: F811
    folder = tmp_path / "run"
    args = [f"--data.paths=[{data}]", f"--save_folder={folder}", "--max_duration=100000", "--save_interval_unsharded=5"]
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


@pytest.mark.slow
def test_a_sigterm_saves_the_step_it_stops_at_and_the_rerun_resumes_there(tmp_path, data):  # noqa: F811
    """A preemption (SIGTERM) with no periodic checkpoint due for a thousand steps: the run finishes its step, saves
    a checkpoint of it, says so, and exits 143 with a stopped record; the same command resumes from that step (not
    from step 0), and the metrics run on with no step twice."""
    folder = tmp_path / "run"
    args = [f"--data.paths=[{data}]", f"--save_folder={folder}", "--max_duration=100000", "--save_interval_unsharded=1000"]
    first = subprocess.Popen([*TRAIN, str(TINY), *SMALL, *args], cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: max(metric_steps(folder) or [0]) >= 4, "the run's step 4")
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 143, err[-3000:]
    stopped_at = max(metric_steps(folder))
    assert stopped_at >= 4 and (folder / f"step{stopped_at}-unsharded").is_dir(), sorted(p.name for p in folder.iterdir())
    assert f"SIGTERM: saving a checkpoint at step {stopped_at}, then stopping" in err
    assert err.strip().splitlines()[-1].startswith("stopped: killed by SIGTERM; rerun the same command")
    assert record(folder)["status"] == "stopped" and record(folder)["step"] == stopped_at
    assert record(folder)["error"] == "Terminated: killed by SIGTERM"
    end = stopped_at + 2
    resumed = train([*args, "--try_load_latest_save", f"--max_duration={end}"])
    assert f"step{stopped_at}-unsharded" in resumed.stderr, resumed.stderr[-2000:]  # the checkpoint it resumed
    assert metric_steps(folder) == list(range(1, end + 1))
    assert record(folder)["attempts"][-1]["resumed_at_step"] == stopped_at


@pytest.mark.slow
def test_a_stale_lock_is_taken_over_and_said(tmp_path, data):  # noqa: F811
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / ".run.lock").write_text(json.dumps({"host": "node7", "pid": 4242, "started": "2026-01-01 00:00:00"}))
    proc = train([f"--data.paths=[{data}]", f"--save_folder={folder}", "--max_duration=2"])
    assert "taking over the lock of a run that ended without releasing it (host node7, pid 4242" in proc.stderr
    assert (folder / ".run.lock").read_text() == ""  # a clean end leaves no owner


# ---- a finished run, rerun ------------------------------------------------------------------------------------------
@pytest.mark.slow
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
@pytest.mark.slow
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
    rows = read_metrics_rows(tmp_path / "results" / "pre-lr0.01-s1" / "metrics.jsonl.gz")  # kept compressed
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 41))


@pytest.mark.slow
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
    assert "pre-lr0.01-s1: stopped by the signal; it resumes" in out and "error" not in out + err, out + err
    assert not alive(child) and record(run)["status"] == "stopped"
    assert not (tmp_path / "runs" / "post-lr0.01-s1").exists()  # no new cell started after the signal


# ---- a full disk -----------------------------------------------------------------------------------------------------
def _file_size_limit(limit: int):
    def apply():  # in the child: a write past ``limit`` bytes fails with EFBIG, as a full disk fails with ENOSPC
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_one_line_and_the_last_good_checkpoint_resumes(tmp_path, data):  # noqa: F811
    folder = tmp_path / "run"
    args = [f"--data.paths=[{data}]", f"--save_folder={folder}", "--max_duration=8", "--save_interval_unsharded=4",
            "--try_load_latest_save"]
    train([f"--data.paths=[{data}]", f"--save_folder={folder}", "--max_duration=4",
           "--save_interval_unsharded=4"])  # a good checkpoint at step 4
    proc = subprocess.run([*TRAIN, str(TINY), *SMALL, *args], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300,
                          preexec_fn=_file_size_limit(150_000))  # model.pt fits, optim.pt does not
    line = error_line(proc)
    assert "no space left while saving the checkpoint of step 8" in line and "the last good checkpoint stays" in line
    stopped = record(folder)
    assert stopped["status"] == "stopped" and stopped["error"].startswith("no space left")
    assert sorted(p.name for p in folder.glob("step*")) == ["step4-unsharded"]  # no half-written folder left
    train(args)  # space again: the same command resumes from step 4 and finishes
    assert record(folder)["status"] == "finished" and metric_steps(folder) == list(range(1, 9))


# ---- token files changed under a run --------------------------------------------------------------------------------
@pytest.mark.slow
def test_resume_on_other_token_files_is_refused_unless_asked(tmp_path):
    data = learnable_tokens(tmp_path / "train.npy", n_tokens=32 * 8 * 30)
    folder = tmp_path / "run"
    args = [f"--data.paths=[{data}]", f"--save_folder={folder}", "--save_interval_unsharded=4",
            "--try_load_latest_save"]
    train([*args, "--max_duration=4"])
    learnable_tokens(data, n_tokens=32 * 8 * 10, seed=3)  # re-prepared to a third of its size
    line = error_line(train([*args, "--max_duration=8"], check=False))
    assert "the token files differ from the ones this run started with" in line
    assert f"{data}: 15,360 bytes then, 5,120 now" in line and "--resume_on_new_data" in line
    assert metric_steps(folder) == [1, 2, 3, 4]
    dry = train([*args, "--max_duration=8", "--dry-run"], check=False)
    assert "the token files differ" in error_line(dry)
    train([*args, "--max_duration=8", "--resume_on_new_data"])
    assert metric_steps(folder) == list(range(1, 9))


# ---- cut or corrupt files in the run folder -------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("damage", ["cut metrics line", "binary metrics", "cut record"])
def test_a_cut_or_corrupt_metrics_file_or_record_does_not_stop_the_resume(tmp_path, data, damage):  # noqa: F811
    folder = tmp_path / "run"
    args = [f"--data.paths=[{data}]", f"--save_folder={folder}", "--save_interval_unsharded=4",
            "--try_load_latest_save"]
    train([*args, "--max_duration=6"])
    assert record(folder)["status"] == "finished"
    metrics = folder / "metrics.jsonl"
    if damage == "cut metrics line":
        metrics.write_bytes(metrics.read_bytes() + b'{"step": 7, "loss": 3.')
    elif damage == "binary metrics":
        metrics.write_bytes(metrics.read_bytes() + b"\x89PNG\r\n\x1a\n\x00\xff\xfe garbage\n")
    else:
        (folder / "run.json").write_text((folder / "run.json").read_text()[:40])
    proc = train([*args, "--max_duration=8"])
    assert "Traceback" not in proc.stderr
    said = "unreadable (cut or corrupt)" if damage == "cut record" else "unreadable line(s)"
    assert said in proc.stderr
    assert metric_steps(folder) == list(range(1, 9)) and record(folder)["status"] == "finished"


# ---- bad input at the command line: one line each -------------------------------------------------------------------
@pytest.mark.slow
def test_a_nan_typo_never_becomes_a_divergence_in_the_tables(tmp_path, data):  # noqa: F811
    """A config typo is refused before step 1 (exit 2), so no record says the method diverged."""
    folder = tmp_path / "run"
    line = error_line(train([f"--data.paths=[{data}]", f"--save_folder={folder}", "--model.init_std=inf"], check=False))
    assert "model.init_std is inf" in line
    assert not (folder / "run.json").exists()


@pytest.mark.slow
def test_config_through_process_substitution_is_read(tmp_path, data):  # noqa: F811
    proc = subprocess.run(["bash", "-c", f'"{sys.executable}" "{ROOT / "scripts" / "train.py"}" <(cat "{TINY}") '
                           + " ".join(SMALL) + f" --data.paths=[{data}] --save_folder={tmp_path / 'run'} --dry-run"],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "a real start would: fresh" in proc.stdout


@pytest.mark.slow
def test_an_empty_token_file_is_one_line(tmp_path):
    empty = tmp_path / "empty.npy"
    empty.write_bytes(b"")
    line = error_line(train([f"--data.paths=[{empty}]", f"--save_folder={tmp_path / 'run'}", "--dry-run"],
                            check=False))
    assert f"{empty} is empty: it holds no tokens" in line


@pytest.mark.parametrize("kind", ["cut", "not gzip"])
def test_a_cut_or_false_gzip_corpus_is_one_line_and_keeps_what_was_prepared(tmp_path, kind):
    good = ROOT / "data" / "austen.jsonl.gz"
    bad = tmp_path / "corpus.jsonl.gz"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2] if kind == "cut" else b'{"text": "plain"}\n' * 50)
    out = tmp_path / "prepared"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_data.py"), str(bad), "--tokenizer",
                           str(ROOT / "data" / "tokenizer-austen-2k.json"), "--output", str(out)],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    line = error_line(proc)
    assert f"{bad}: not a whole gzip file" in line
    assert not list(out.rglob("*.npy.tmp*"))  # nothing half-written left


@pytest.mark.slow
def test_make_tables_output_that_is_a_file_is_one_line(tmp_path):
    results = ROOT / "studies" / "cpu-lr-grid" / "results"
    target = tmp_path / "table.md"
    target.write_text("keep me\n")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tables.py"), str(results), "--output",
                           str(target)], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert f"--output {target} is a file; name a folder" in error_line(proc)
    assert target.read_text() == "keep me\n"


# ---- a cluster's first minutes (one-line checks) ---------------------------------------------------------------------
@pytest.mark.slow
def test_a_corpus_smaller_than_one_global_batch_is_one_line_before_the_model(tmp_path):
    small = learnable_tokens(tmp_path / "small.npy", n_tokens=32 * 5)  # 5 sequences of SMALL's 32 tokens
    for dry in ([], ["--dry-run"]):
        line = error_line(train([f"--data.paths=[{small}]", f"--save_folder={tmp_path / 'run'}", *dry], check=False))
        assert "the training data hold 5 sequences of 32 tokens, fewer than one global batch (8)" in line


@pytest.mark.slow
def test_the_per_process_batch_error_is_said_once_with_the_fix(tmp_path, data):  # noqa: F811
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "scripts" / "train.py"), str(TINY), *SMALL, f"--data.paths=[{data}]",
           f"--save_folder={tmp_path / 'run'}", "--device_train_microbatch_size=8"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-3000:]
    assert "the per-process batch (8 sequences over 2 processes = 4) must be a multiple of " \
           "device_train_microbatch_size (8): pass --device_train_microbatch_size=4." in lines[0]
    assert not (tmp_path / "run").exists()  # refused before the folder was touched


def test_an_override_of_one_list_item_is_one_line(tmp_path):
    from siamesenorm.ai2_olmo.train import main
    from siamesenorm.run.recipe import RunError

    with pytest.raises(RunError) as err:  # the recipe's own evaluators (SMALL would empty the list)
        main(str(TINY), ["--evaluators.0.data.datasets.x=[a]", f"--save_folder={tmp_path}/run"], dry=True)
    assert "cannot apply --evaluators.0.data.datasets.x=[a]" in str(err.value) and "\n" not in str(err.value)
    assert "override a list as a whole" in str(err.value)


@pytest.mark.slow
def test_a_token_file_rewritten_in_place_with_its_manifest_kept_is_seen_on_resume(tmp_path, austen_prepared):
    """The manifest's sha256 is what the file claims; the fingerprint hashes the file's own bytes as well."""
    prepared = tmp_path / "prepared"
    shutil.copytree(austen_prepared, prepared)
    folder = tmp_path / "run"
    args = [f"--data.paths=[{prepared}/train/*.npy]", f"--save_folder={folder}", "--save_interval_unsharded=4",
            "--try_load_latest_save", "--model.vocab_size=2048", "--model.embedding_size=2048"]
    train([*args, "--max_duration=4"])
    target = sorted((prepared / "train").glob("*.npy"))[0]
    before = (prepared / "manifest.json").read_text()
    raw = bytearray(target.read_bytes())
    raw[-64:] = bytes(reversed(raw[-64:]))  # the same size, the same tokens in another order at its end
    raw[-4096:-4032] = bytes(reversed(raw[-4096:-4032]))
    target.write_bytes(bytes(raw))
    assert (prepared / "manifest.json").read_text() == before
    line = error_line(train([*args, "--max_duration=8"], check=False))
    assert "the token files differ from the ones this run started with" in line
    assert f"{target}: same size, other content" in line
    assert metric_steps(folder) == [1, 2, 3, 4]


@pytest.mark.slow
def test_ctrl_c_is_one_line_exit_130_and_a_stopped_record(tmp_path, data):  # noqa: F811
    folder = tmp_path / "run"
    proc = subprocess.Popen([*TRAIN, str(TINY), *SMALL, f"--data.paths=[{data}]", f"--save_folder={folder}",
                             "--max_duration=100000"], cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while time.time() < deadline and not ((folder / "metrics.jsonl").is_file() and len(metric_steps(folder)) >= 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("stopped: interrupted (Ctrl-C); rerun the same command to resume from "
                                            "the latest checkpoint")
    assert record(folder)["status"] == "stopped"


@pytest.mark.slow
def test_a_refused_start_leaves_no_folder_and_no_owner(tmp_path, data):  # noqa: F811
    folder = tmp_path / "new"
    refused = train([f"--data.paths=[{data}]", f"--save_folder={folder}", "--max_duration=2"], check=False,
                    MODEL_TYPE="nonsense_type")
    assert refused.returncode == 2 and "Unknown MODEL_TYPE 'nonsense_type'" in error_line(refused)
    assert not folder.exists()  # no empty folder with a lock file in it
    args = [f"--data.paths=[{data}]", f"--save_folder={folder}", "--save_interval_unsharded=2"]
    train([*args, "--max_duration=2"])
    refused = train([*args, "--max_duration=4", "--try_load_latest_save=false"], check=False)
    assert refused.returncode == 2 and "holds the checkpoint step2-unsharded" in error_line(refused)
    resumed = train([*args, "--max_duration=4"])  # the recipe resumes; no stale owner from the refused start
    assert "taking over the lock" not in resumed.stderr and metric_steps(folder) == [1, 2, 3, 4]
