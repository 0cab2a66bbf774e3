"""Several nodes, on one machine: a generated SLURM batch script run as two "nodes" of one process each (a stand-in
srun and scontrol from tests/fake_slurm; torchrun's c10d rendezvous on localhost), one node killed, the job
resubmitted; and plain torchrun with --nnodes=2 as docs/training.md shows it."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_training import SMALL, TINY, learnable_tokens, losses, torchrun

ROOT = Path(__file__).resolve().parents[2]
FAKE_SLURM = Path(__file__).resolve().parents[1] / "fake_slurm"


def _args(data: Path, folder: Path):
    return SMALL + [f"--data.paths=[{data}]", "--distributed_strategy=fsdp", "--max_duration=40", "--save_interval=4",
                    f"--save_folder={folder}", "--try_load_latest_save"]


def _env(job_id: int, **extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PATH=f"{FAKE_SLURM}{os.pathsep}{env.get('PATH', '')}", SLURM_NNODES="2", SLURM_JOB_ID=str(job_id),
               SLURM_JOB_NODELIST="node[1-2]", SLURM_SUBMIT_DIR=str(ROOT), PYTHON=sys.executable, OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", MODEL_TYPE="hybrid_pre", RDZV_PORT=str(29000 + os.getpid() % 500 + job_id % 7),
               **extra)
    return env


def _steps(folder: Path):
    try:
        return [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()
                if '"loss"' in line]
    except (OSError, ValueError, KeyError):
        return []


def test_generated_sbatch_line_is_one_torchrun_per_node_with_c10d_rendezvous():
    from siamesenorm.cluster.slurm import sbatch_script

    text = sbatch_script("configs/OLMo-1B-hybrid-2e-3.yaml", ["--save_folder=runs/x y", "--max_duration=1e9T"],
                         nodes=4, gpus_per_node=8, partition="gpu", model_type="hybrid_pre")
    assert "#SBATCH --nodes=4" in text and "#SBATCH --gpus-per-node=8" in text and "#SBATCH --partition=gpu" in text
    assert "--nnodes=4 --nproc_per_node=8" in text and "--rdzv_backend=c10d" in text
    assert "srun --ntasks-per-node=1 --kill-on-bad-exit=1" in text
    # the overrides reach the nodes as separate words, spaces kept
    out = subprocess.run(["bash", "-c", text.split("ARGS=", 1)[1].split("\n", 1)[0].join(
        ["ARGS=", '\nprintf "%s\\n" "${ARGS[@]}"'])], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["configs/OLMo-1B-hybrid-2e-3.yaml", "--save_folder=runs/x y", "--max_duration=1e9T"]
    example = ROOT / "scripts" / "slurm" / "OLMo-1B-hybrid-2e-3-4x8.sbatch"
    assert example.read_text() == sbatch_script(
        "configs/OLMo-1B-hybrid-2e-3.yaml", ["--save_folder=runs/OLMo-1B-hybrid-2e-3-hybrid_pre"], nodes=4,
        gpus_per_node=8, model_type="hybrid_pre"), "regenerate it with scripts/slurm/make_sbatch.py (its docstring)"


@pytest.mark.slow
def test_two_nodes_killed_one_stops_the_job_and_a_resubmission_ends_as_an_uninterrupted_run(tmp_path):
    from siamesenorm.cluster.slurm import sbatch_script

    data = learnable_tokens(tmp_path / "data" / "train.npy")
    reference = tmp_path / "reference"
    torchrun([TINY, *_args(data, reference)], {"MODEL_TYPE": "hybrid_pre"})  # one node, two processes

    folder = tmp_path / "two-nodes"
    script = tmp_path / "job.sbatch"
    script.write_text(sbatch_script(str(TINY), _args(data, folder), nodes=2, gpus_per_node=1, cpus_per_node=2))
    pids = tmp_path / "pids"
    log = (tmp_path / "job1.log").open("w")
    job = subprocess.Popen(["bash", str(script)], env=_env(101, FAKE_SRUN_PIDS=str(pids)), stdout=log,
                           stderr=subprocess.STDOUT)
    deadline = time.time() + 240
    while time.time() < deadline and max(_steps(folder), default=0) < 6 and job.poll() is None:
        time.sleep(0.05)
    assert job.poll() is None and max(_steps(folder), default=0) >= 6, (tmp_path / "job1.log").read_text()[-3000:]
    node1 = int(pids.read_text().split()[1])
    os.killpg(node1, signal.SIGKILL)  # the second node is gone: power, network, OOM killer
    code = job.wait(timeout=120)
    assert code != 0  # the whole job stopped
    record = json.loads((folder / "run.json").read_text())
    assert record["status"] != "finished" and max(_steps(folder)) < 40, record

    log = (tmp_path / "job2.log").open("w")
    again = subprocess.run(["bash", str(script)], env=_env(102), stdout=log, stderr=subprocess.STDOUT, timeout=300)
    assert again.returncode == 0, (tmp_path / "job2.log").read_text()[-3000:]
    record = json.loads((folder / "run.json").read_text())
    resumed_at = record["attempts"][-1]["resumed_at_step"]
    # from a periodic checkpoint (every 4 steps), or from the one the surviving ranks saved on srun's SIGTERM
    # (the killed node's worker may outlive its process group long enough to take part)
    saved_on_sigterm = f"SIGTERM: saving a checkpoint at step {resumed_at}," in (tmp_path / "job1.log").read_text()
    assert record["status"] == "finished" and (resumed_at % 4 == 0 or saved_on_sigterm) and resumed_at >= 4, record
    full, parts = losses(reference), losses(folder)
    assert _steps(folder) == list(range(1, 41))  # no step twice, none missing
    assert [parts[s] for s in range(1, 41)] == [full[s] for s in range(1, 41)]  # exactly, step by step


@pytest.mark.slow
def test_torchrun_nnodes_2_on_localhost_as_the_docs_show(tmp_path):
    data = learnable_tokens(tmp_path / "data" / "train.npy")
    folder = tmp_path / "run"
    args = [str(TINY), *SMALL, f"--data.paths=[{data}]", "--max_duration=6", f"--save_folder={folder}"]
    port = 29700 + os.getpid() % 200
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", OLMO_SHARED_FS="1", MODEL_TYPE="post_pre")
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={r}",
                               "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=localhost:{port}",
                               "--rdzv_id=docs", str(ROOT / "scripts" / "train.py"), *args], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outputs = [n.communicate(timeout=300)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert _steps(folder) == list(range(1, 7))
    assert json.loads((folder / "run.json").read_text())["world_size"] == 2
