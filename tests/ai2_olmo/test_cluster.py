"""The cluster path: wandb, preemption and rerun, safe checkpoint loading, resume checks, data checks,
and one-line errors. Runs are plain ``python scripts/train.py`` (a process group of one) unless torchrun matters."""

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_training import ROOT, SMALL, TINY, learnable_tokens

TRAIN = [sys.executable, str(ROOT / "scripts" / "train.py")]


def env(**extra):
    e = {k: v for k, v in os.environ.items() if k not in ("MODEL_TYPE", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return e


def train(args, check=True, **extra_env):
    proc = subprocess.run([*TRAIN, str(TINY), *SMALL, *map(str, args)], cwd=ROOT, env=env(**extra_env),
                          capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"train failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc


def metric_steps(folder: Path):
    return [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


def record(folder: Path) -> dict:
    return json.loads((folder / "run.json").read_text())


def error_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return learnable_tokens(tmp_path_factory.mktemp("data") / "train.npy")


@pytest.fixture(scope="module")
def checkpointed_mixln(tmp_path_factory, data):
    """A finished 4-step mixln run (mixln_post_fraction 0.5) with unsharded checkpoints at steps 2 and 4."""
    folder = tmp_path_factory.mktemp("mixln") / "run"
    train([f"--data.paths=[{data}]", f"--save_folder={folder}", "--max_duration=4", "--save_interval_unsharded=2",
           "--save_num_unsharded_checkpoints_to_keep=2", "--model.mixln_post_fraction=0.5"], MODEL_TYPE="mixln")
    return folder


# ---- 1. wandb ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_wandb_offline_through_launch_exits_0_with_one_run_folder(tmp_path, data):
    folder = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "launch.py"), "--standalone", "--nproc_per_node=1", str(TINY), *SMALL,
         f"--data.paths=[{data}]", f"--save_folder={folder}", "--max_duration=3", "--wandb.project=test",
         "--no_pre_train_checkpoint=false", "--save_num_unsharded_checkpoints_to_keep=2"],
        cwd=ROOT, env=env(WANDB_MODE="offline"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "quiet" not in proc.stderr
    runs = list((folder / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and not (folder / "wandb" / "wandb").exists()
    assert record(folder)["status"] == "finished"
    assert (folder / "data-indices" / "rank0.tsv.gz").is_file()  # save_data_indices (OLMo's default) honoured
    assert (folder / "step0-unsharded" / "model.pt").is_file()  # no_pre_train_checkpoint=false: saved and reloaded


# ---- 2, 6. kill, rerun, resume under torch's weights_only default; metrics never twice ----------------------------
def start_and_kill_at(args, folder: Path, step: int, sig: int = signal.SIGTERM) -> tuple[int, str]:
    """Start a run, send it ``sig`` (a preemption's SIGTERM, or SIGKILL: a machine gone) once it has logged ``step``;
    (exit status, its stderr)."""
    log = folder.parent / f"{folder.name}-killed.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen([*TRAIN, str(TINY), *SMALL, *map(str, args)], cwd=ROOT, env=env(),
                                stdout=subprocess.DEVNULL, stderr=stderr)
        deadline = time.time() + 240
        while time.time() < deadline:
            try:
                if (folder / "metrics.jsonl").is_file() and max(metric_steps(folder) or [0]) >= step:
                    break
            except ValueError:  # a line being written
                pass
            if proc.poll() is not None:
                raise AssertionError(f"run ended before step {step}: {log.read_text()[-3000:]}")
            time.sleep(0.05)
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
    return code, log.read_text()


@pytest.mark.slow
def test_killed_run_is_recorded_and_a_rerun_resumes_without_duplicate_steps(tmp_path, data):
    folder = tmp_path / "run"
    args = [f"--data.paths=[{data}]", f"--save_folder={folder}", "--max_duration=400", "--save_interval_unsharded=5",
            "--try_load_latest_save"]
    code, stderr = start_and_kill_at(args, folder, 8)
    assert code == 128 + signal.SIGTERM and "stopped: killed by SIGTERM; rerun the same command" in stderr
    assert "Traceback" not in stderr
    killed = record(folder)
    assert killed["status"] == "stopped" and "SIGTERM" in killed["error"], killed
    assert max(metric_steps(folder)) == killed["step"] >= 8  # it stopped after the step it had logged
    train([*args, "--max_duration=12"], TORCH_FORCE_WEIGHTS_ONLY_LOAD="1")  # every torch.load as weights_only
    steps = metric_steps(folder)
    assert steps == list(range(1, 13)), steps
    done = record(folder)
    assert done["status"] == "finished" and done["attempts"][0]["previous_status"] == "stopped"
    # from the checkpoint the SIGTERM saved at the step it stopped at, not the last periodic one (every 5 steps)
    assert done["attempts"][0]["resumed_at_step"] == killed["step"]


@pytest.mark.slow
def test_rerun_after_a_failed_start_starts_fresh(tmp_path, data):
    folder = tmp_path / "run"
    args = [f"--data.paths=[{data}]", f"--save_folder={folder}", "--max_duration=400", "--save_interval_unsharded=1000"]
    start_and_kill_at(args, folder, 3, signal.SIGKILL)  # gone before any checkpoint (a SIGTERM would save one)
    assert not list(folder.glob("step*"))
    proc = train([*args, "--max_duration=5"])  # the same command, no flag needed
    assert "the earlier attempt died before its first checkpoint" in proc.stderr
    assert metric_steps(folder) == [1, 2, 3, 4, 5]
    assert record(folder)["status"] == "finished" and "attempts" not in record(folder)


@pytest.mark.slow
def test_save_overwrite_leaves_no_trace_of_the_old_run(tmp_path, data):
    folder = tmp_path / "run"
    base = [f"--data.paths=[{data}]", f"--save_folder={folder}", "--save_interval_unsharded=3"]
    train([*base, "--max_duration=6"])
    assert (folder / "step6-unsharded").is_dir()
    refused = train([*base, "--max_duration=6", "--try_load_latest_save=false"], check=False)
    assert "--try_load_latest_save to resume it, or --save_overwrite" in error_line(refused)
    train([*base, "--max_duration=2", "--save_overwrite"])
    assert sorted(p.name for p in folder.glob("step*")) == ["step2-unsharded"]
    assert metric_steps(folder) == [1, 2]
    assert record(folder)["max_steps"] == 2


# ---- 3. untrusted checkpoints ------------------------------------------------------------------------------------
class Payload:
    marker = None

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def poisoned_copy(source: Path, tmp_path: Path, file: str) -> tuple[Path, Path]:
    folder = tmp_path / "poisoned" / "step4-unsharded"
    shutil.copytree(source, folder)
    marker = tmp_path / "payload-ran"
    Payload.marker = marker
    state = torch.load(folder / file, weights_only=True) if file == "model.pt" else {}
    torch.save({"payload": Payload(), **state}, folder / file)
    return folder, marker


@pytest.mark.slow
@pytest.mark.parametrize("file", ["model.pt", "train.pt"])
def test_crafted_pickle_payload_is_refused_and_never_runs(tmp_path, checkpointed_mixln, file):
    folder, marker = poisoned_copy(checkpointed_mixln / "step4-unsharded", tmp_path, file)
    if file == "model.pt":
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "analyze.py"), "magnitudes", str(folder),
                               "--text", str(ROOT / "data" / "austen.jsonl.gz"), "--output", str(tmp_path / "out")],
                              cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
        line = error_line(proc)
        assert f"refusing to load {folder / file}" in line
    proc = train([f"--data.paths=[{learnable_tokens(tmp_path / 'd.npy')}]", f"--save_folder={tmp_path / 'new'}",
                  f"--load_path={folder}", "--model.mixln_post_fraction=0.5", "--max_duration=6"], check=False,
                 MODEL_TYPE="mixln")
    assert f"refusing to load {folder / file}" in error_line(proc)
    assert not marker.exists(), "the payload ran"
    assert "[step=" not in proc.stdout + proc.stderr


# ---- 4. resume with another knob or size ---------------------------------------------------------------------------
@pytest.mark.slow
def test_resume_with_another_knob_or_size_stops_before_any_step(checkpointed_mixln, data):
    base = [f"--data.paths=[{data}]", f"--save_folder={checkpointed_mixln}", "--try_load_latest_save",
            "--max_duration=6"]
    proc = train(base, check=False, MODEL_TYPE="mixln")  # the 0.5 override not repeated
    line = error_line(proc)
    assert "model.mixln_post_fraction was 0.5, now 0.25" in line and "--model.mixln_post_fraction=0.5" in line
    proc = train([*base, "--model.mixln_post_fraction=0.5", "--model.d_model=64"], check=False, MODEL_TYPE="mixln")
    assert "model.d_model was 32, now 64" in error_line(proc)
    assert metric_steps(checkpointed_mixln) == [1, 2, 3, 4]  # nothing trained, nothing logged


# ---- 8. token files against their manifest -------------------------------------------------------------------------
@pytest.mark.slow
def test_token_id_beyond_vocab_is_one_line_naming_the_file(tmp_path):
    bad = tmp_path / "bad.npy"
    tokens = np.asarray(np.arange(4096) % 60, dtype=np.uint16)
    tokens[1234] = 70  # model.vocab_size is 64
    tokens.tofile(bad)
    line = error_line(train([f"--data.paths=[{bad}]", f"--save_folder={tmp_path / 'run'}", "--dry-run"], check=False))
    assert f"{bad} holds token id 70, but model.vocab_size is 64" in line
    assert not (tmp_path / "run").exists()


def test_truncated_or_misread_token_files_are_refused_against_the_manifest(tmp_path):
    from siamesenorm.run.data import PrepareSettings, prepare
    from siamesenorm.run.recipe import RunError, check_token_files

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": f"Line {i}: it is a truth universally acknowledged."}) + "\n"
                           for i in range(40)))
    out = tmp_path / "prepared"
    prepare(PrepareSettings([str(src)], tokenizer=str(ROOT / "data" / "tokenizer-austen-2k.json"), docs_per_unit=10,
                            val_fraction=0.0), out, progress=False)
    files = sorted(str(p) for p in (out / "train").glob("*.npy"))
    check_token_files(files, "uint16", 2048, verify_sha256=True)  # as written: accepted
    with pytest.raises(RunError, match="holds uint16 tokens .* set data.memmap_dtype=uint16"):
        check_token_files(files, "uint32", 2048)
    with pytest.raises(RunError, match="holds token id .* model.vocab_size is 100"):
        check_token_files(files, "uint16", 100)
    with open(files[1], "r+b") as f:
        f.truncate(Path(files[1]).stat().st_size - 2)
    with pytest.raises(RunError, match=f"{files[1]} has .* bytes, its manifest says"):
        check_token_files(files, "uint16", 2048)


# ---- 9. bad values: one line each, from --dry-run --------------------------------------------------------------------
@pytest.mark.parametrize("overrides,expected", [
    (["--model.n_heads=3", "--model.d_model=128"], "model.d_model (128) must be a positive multiple of model.n_heads (3)"),
    (["--optimizer.learning_rate=-1e-3"], "optimizer.learning_rate must be a positive number"),
    (["--stability.patience=0"], "stability.patience must be >= 1"),
    (["--max_duration", "2"], "write --max_duration=2"),
    (["--no_such_field=1"], "Key 'no_such_field' not in 'SiameseTrainConfig'"),
    (["--compile.fullgraph=true", "--distributed_strategy=fsdp", "--fsdp.use_orig_params=false"],
     "compile: with FSDP needs fsdp.use_orig_params: true"),
    # each was accepted, or a traceback, before the boundary checks
    (["--scheduler.t_warmup=-5"], "scheduler.t_warmup must be >= 0 (got -5)"),
    (["--scheduler.alpha_f=nan"], "scheduler.alpha_f is nan: every number in the config must be finite"),
    (["--scheduler.alpha_f=1.5"], "scheduler.alpha_f must be in [0, 1] (got 1.5)"),
    (["--max_grad_norm=nan"], "max_grad_norm is nan"),
    (["--max_grad_norm=-1"], "max_grad_norm must be > 0, or null"),
    (["--model.init_std=inf"], "model.init_std is inf"),
    (["--optimizer.eps=nan"], "optimizer.eps is nan"),
    (["--optimizer.eps=0"], "optimizer.eps must be > 0"),
    (["--optimizer.betas=[nan,0.95]"], "optimizer.betas.0 is nan"),
    (["--optimizer.betas=[0.9,1.5]"], "optimizer.betas must be two numbers in [0, 1)"),
    (["--stability.max_loss=nan"], "stability.max_loss is nan"),
    (["--optimizer.learning_rate=null"], "Incompatible value 'None' for field of type 'float' (at optimizer.learning_rate)"),
])
def test_bad_values_are_one_line_from_dry_run(tmp_path, data, overrides, expected):
    from siamesenorm.ai2_olmo.train import main
    from siamesenorm.run.recipe import RunError

    with pytest.raises(RunError) as err:
        main(str(TINY), [*SMALL, f"--data.paths=[{data}]", f"--save_folder={tmp_path}/run", *overrides], dry=True)
    assert expected in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_yaml_error_and_data_folder_are_one_line(tmp_path, data):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text(TINY.read_text().replace("d_model: 128", "d_model: [128"))
    proc = subprocess.run([*TRAIN, str(bad_yaml), "--dry-run"], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=300)
    assert "is not valid YAML at line" in error_line(proc)
    proc = train([f"--data.paths=[{data.parent}]", f"--save_folder={tmp_path / 'run'}", "--dry-run"], check=False)
    assert f"{data.parent} is a folder" in error_line(proc)


@pytest.mark.slow
def test_dry_run_says_what_a_real_start_would_do(checkpointed_mixln, data):
    proc = train([f"--data.paths=[{data}]", f"--save_folder={checkpointed_mixln}", "--try_load_latest_save",
                  "--model.mixln_post_fraction=0.5", "--dry-run"], MODEL_TYPE="mixln")
    assert f"a real start would: resume from {checkpointed_mixln / 'step4-unsharded'}" in proc.stdout


# ---- 10. OLMo training fields -----------------------------------------------------------------------------------------
def test_force_save_unsharded_with_fsdp_on_cpu_is_refused_in_one_line():
    from olmo.config import DistributedStrategy

    from siamesenorm.ai2_olmo.trainer import cpu_adjustments
    from siamesenorm.run.recipe import RunError, load_config

    cfg = load_config(str(TINY), ["--force_save_unsharded=true"])
    cfg.distributed_strategy = DistributedStrategy.fsdp
    with pytest.raises(RunError, match="force_save_unsharded"):
        cpu_adjustments(cfg)


def test_the_payload_runs_when_unpickled_without_checks():
    """The payload class above really executes under an unrestricted load (so the refusal tests can fail)."""
    marker = Path(os.environ.get("TMPDIR", "/tmp")) / f"payload-check-{os.getpid()}"
    Payload.marker = marker
    data = pickle.dumps(Payload())
    pickle.loads(data)
    assert marker.exists()
    marker.unlink()
