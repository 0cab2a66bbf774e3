"""Real training runs through OLMo's Trainer, launched by torchrun with 2 gloo processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny-cpu.yaml"

# A model small enough for a few seconds of training; data it can learn: short repeated arithmetic patterns.
SMALL = [
    "--model.d_model=32",
    "--model.n_heads=2",
    "--model.n_layers=2",
    "--model.vocab_size=64",
    "--model.embedding_size=64",
    "--model.max_sequence_length=32",
    "--global_train_batch_size=8",
    "--device_train_microbatch_size=4",
    "--optimizer.learning_rate=1e-2",
    "--scheduler.t_warmup=2",
    "--console_log_interval=1",
    "--eval_interval=1000",
    "--evaluators=[]",
]


def learnable_tokens(path: Path, n_tokens=32 * 8 * 40, vocab=64, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n_tokens:
        start, step = rng.integers(2, vocab), rng.integers(1, 4)
        out.extend(int(2 + (start + step * i) % (vocab - 2)) for i in range(16))
    path.parent.mkdir(parents=True, exist_ok=True)
    np.asarray(out[:n_tokens], dtype=np.uint16).tofile(path)
    return path


def torchrun(args, env_extra=None, nproc=2, check=True):
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL_TYPE", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env_extra or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "scripts" / "train.py")] + [str(a) for a in args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def losses(folder: Path):
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def final_weights(folder: Path, strategy: str, step: int):
    from siamesenorm.run.checkpoints import load_model_state

    return load_model_state(folder / (f"step{step}-unsharded" if strategy == "ddp" else f"step{step}"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy,model_type", [("ddp", "hybrid_pre"), ("fsdp", "hc")])
def test_torchrun_train_save_resume_is_exact(tmp_path, strategy, model_type):
    data = learnable_tokens(tmp_path / "data" / "train.npy")
    common = SMALL + [
        f"--data.paths=[{data}]",
        f"--distributed_strategy={strategy}",
        "--max_duration=16",
        "--save_interval=8",
        "--save_interval_unsharded=8",
    ]
    env = {"MODEL_TYPE": model_type}
    whole, split = tmp_path / "whole", tmp_path / "split"
    torchrun([TINY, *common, f"--save_folder={whole}"], env)
    torchrun([TINY, *common, f"--save_folder={split}", "--stop_at=8"], env)
    assert max(losses(split)) == 8
    resumed = torchrun([TINY, *common, f"--save_folder={split}", "--try_load_latest_save"], env)
    assert "Resuming from" in resumed.stdout + resumed.stderr

    full, parts = losses(whole), losses(split)
    assert sorted(full) == list(range(1, 17)) and sorted(parts) == list(range(1, 17))
    assert full[16] < full[1] - 0.5, f"loss did not fall: {full}"
    assert [parts[s] for s in range(1, 17)] == [full[s] for s in range(1, 17)]  # exactly, step by step

    a, b = final_weights(whole, strategy, 16), final_weights(split, strategy, 16)
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        assert torch.equal(a[name], b[name]), name
    saved = (split / "step16" if strategy == "fsdp" else split / "step16-unsharded") / "config.yaml"
    assert f"model_type: {model_type}" in saved.read_text()
    if strategy == "ddp":  # (FSDP's legacy shards hold the same trainer state, beside sharded tensors)
        from siamesenorm.run.safeload import load as safe_load

        guard = safe_load(split / "step16-unsharded" / "train.pt")["stability"]  # the guard's state rides along:
        assert guard["recent"] == pytest.approx([full[s] for s in range(1, 17)], rel=1e-6)  # steps 1-8 from step8


@pytest.mark.slow
@pytest.mark.parametrize("strategy,model_type,extra", [
    ("ddp", "deepnorm", []), ("ddp", "residual", []), ("ddp", "mixln", []), ("ddp", "peri", []), ("fsdp", "mhc", []),
    ("ddp", "hybrid_star", []), ("ddp", "pre_embednorm", []),
    # the fused ops (stream updates, head norms with RoPE, qkv_rope) through OLMo's trainer, FSDP and DDP
    ("fsdp", "hybrid_pre", ["--model.fused_streams=true"]), ("ddp", "pre", ["--model.fused_streams=true"])])
def test_added_variants_train_through_olmos_trainer(tmp_path, strategy, model_type, extra):
    """Two processes, every parameter used (DDP would fail otherwise), the loss falls, the record says finished."""
    data = learnable_tokens(tmp_path / "train.npy")
    args = [TINY, *SMALL, f"--data.paths=[{data}]", f"--distributed_strategy={strategy}", "--max_duration=12",
            f"--save_folder={tmp_path / 'run'}", "--model.mixln_post_fraction=0.5", *extra]
    torchrun(args, {"MODEL_TYPE": model_type})
    curve = losses(tmp_path / "run")
    assert sorted(curve) == list(range(1, 13)) and curve[12] < curve[1] - 0.3, curve
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["status"] == "finished" and record["model_type"] == model_type
    if extra:  # the flag reached the model OLMo's trainer built and saved
        assert "fused_streams: true" in (tmp_path / "run" / "config.yaml").read_text()


@pytest.mark.slow
def test_resume_with_contradicting_model_type_fails_before_any_step(tmp_path):
    data = learnable_tokens(tmp_path / "train.npy")
    args = [TINY, *SMALL, f"--data.paths=[{data}]", "--max_duration=2", "--save_interval_unsharded=2",
            f"--save_folder={tmp_path / 'run'}"]
    torchrun(args, {"MODEL_TYPE": "post_pre"}, nproc=1)
    proc = torchrun([*args, "--try_load_latest_save"], {"MODEL_TYPE": "hc"}, nproc=1, check=False)
    assert proc.returncode != 0
    assert "MODEL_TYPE=hc (from environment variable MODEL_TYPE) contradicts the checkpoint" in proc.stderr
    assert "trained as MODEL_TYPE=post_pre" in proc.stderr
    assert "[step=" not in proc.stdout + proc.stderr
    # without MODEL_TYPE the checkpoint's type is taken and training continues
    ok = torchrun([*args, "--try_load_latest_save", "--max_duration=3"], nproc=1)
    assert "MODEL_TYPE=post_pre" in ok.stdout + ok.stderr


@pytest.mark.slow
def test_missing_data_path_says_how_to_prepare(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train.py"), str(TINY), f"--data.paths=[{tmp_path}/none/*.npy]",
         f"--save_folder={tmp_path / 'run'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert "no data at" in proc.stderr and "scripts/prepare_data.py" in proc.stderr
    assert not (tmp_path / "run").exists()  # failed before writing anything


@pytest.mark.slow
def test_dry_run_prints_config_and_parameter_count(austen_prepared):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train.py"), str(TINY), "--dry-run"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "MODEL_TYPE": "hybrid_pre"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "model_type: hybrid_pre" in proc.stdout
    from siamesenorm import num_params_from_config
    from siamesenorm.ai2_olmo.train import load_config

    n = num_params_from_config(load_config(str(TINY)).model, "hybrid_pre")
    assert f"MODEL_TYPE=hybrid_pre  parameters: {n:,d}" in proc.stdout


def test_in_loop_downstream_evaluation_runs_on_cpu(tmp_path, monkeypatch):
    """OLMo's packaged ARC-Easy through our Trainer's eval(), a few batches, OLMo tokenizer, no network."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from olmo.config import EvaluatorConfig, EvaluatorType
    from olmo.eval import build_evaluators

    from siamesenorm import build_model
    from siamesenorm.ai2_olmo.train import load_config
    from siamesenorm.ai2_olmo.trainer import SiameseTrainer

    cfg = load_config(str(TINY), [
        "--model.d_model=32", "--model.n_heads=2", "--model.n_layers=2", "--model.vocab_size=50280",
        "--model.embedding_size=50304", "--model.eos_token_id=50279", "--model.max_sequence_length=512",
        "--tokenizer.identifier=tokenizers/allenai_gpt-neox-olmo-dolma-v1_5.json", "--device_eval_batch_size=4",
        f"--save_folder={tmp_path}",
    ])
    cfg.evaluators = [EvaluatorConfig(label="arc_easy", type=EvaluatorType.downstream, subset_num_batches=2)]
    evaluators = build_evaluators(cfg, torch.device("cpu"))
    model = build_model(cfg.model, "hybrid_pre").eval()
    optim = torch.optim.SGD(model.parameters(), lr=0.0)  # eval() zeroes gradients first
    trainer = SiameseTrainer(cfg=cfg, model=model, dist_model=model, optim=optim, scheduler=None,
                             train_loader=None, device=torch.device("cpu"), evaluators=evaluators)
    metrics = trainer.eval()
    acc = metrics["eval/downstream/arc_easy_acc"]
    assert 0.0 <= acc <= 1.0
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["eval"]["eval/downstream/arc_easy_acc"] == pytest.approx(float(acc))
