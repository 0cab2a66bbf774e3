"""scripts/preflight.py: each check fails when it should and names the fix; the memory and time estimates agree with
the cost model they come from; a timed run on the CPU."""

import dataclasses
import json
import runpy
from pathlib import Path

import numpy as np
import pytest

from siamesenorm.cluster.preflight import budget_tokens, largest_microbatch, preflight
from siamesenorm.perf import costmodel
from siamesenorm.run.recipe import load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
OLMO_1B = str(ROOT / "configs" / "OLMo-1B-hybrid-2e-3.yaml")


def _load(path, *overrides):
    return load_config(path, list(overrides))


def _status(checks):
    return {c.name: c.status for c in checks}


def _detail(checks, name):
    return next(c.detail for c in checks if c.name == name)


def test_tiny_recipe_on_its_data_passes_every_check(austen_prepared, tmp_path):
    cfg = _load(TINY, f"--save_folder={tmp_path / 'run'}")
    checks, est = preflight(cfg, "hybrid_pre", nodes=1, gpus_per_node=1, gpu="a100-40gb")
    status = _status(checks)
    assert "FAIL" not in status.values(), checks
    assert status["data"] == status["memory"] == status["disk"] == status["tokenizer"] == "ok"
    assert status["CUDA"] in ("skip", "ok")
    assert est["max_steps"] == 300 and est["budget_tokens"] == 300 * cfg.global_train_batch_size * 128
    assert est["corpus_tokens"] > 0 and "epoch(s) of the corpus" in _detail(checks, "epochs")
    assert est["parameters"] == costmodel.memory_per_gpu(cfg.model, "hybrid_pre", 16, gpus=1)["parameters"]
    assert est["fit"]["a100-40gb"]["fits"] and est["cost_model"]["a100-40gb"]["hours"] > 0


def test_budget_in_tokens_steps_and_epochs():
    cfg = _load(TINY, "--max_duration=100e9T")
    assert budget_tokens(cfg, None) == 100_000_000_000
    cfg = _load(TINY, "--max_duration=300")
    assert budget_tokens(cfg, None) == 300 * cfg.global_train_batch_size * cfg.model.max_sequence_length
    cfg = _load(TINY, "--max_duration=2ep")
    assert budget_tokens(cfg, 1000) == 2000 and budget_tokens(cfg, None) is None


def test_largest_microbatch_fits_when_counted_directly():
    cfg = _load(TINY).model
    at2 = costmodel.memory_per_gpu(cfg, "hc", 2, gpus=1)
    at4 = costmodel.memory_per_gpu(cfg, "hc", 4, gpus=1)
    at8 = costmodel.memory_per_gpu(cfg, "hc", 8, gpus=1)
    # scaled linearly from microbatch 2: what it says fits, fits when counted directly; within 1% of the boundary
    for capacity, expected in ((at4["peak"] * 0.99, 2), (at4["peak"] * 1.01, 4), ((at4["peak"] + at8["peak"]) / 2, 4),
                               (at8["peak"] * 1.01, 8)):
        m = largest_microbatch(at2, 2, 8, capacity, checkpointed=False)
        assert m == expected and {2: at2, 4: at4, 8: at8}[m]["peak"] <= capacity
    assert largest_microbatch(at2, 2, 8, at2["state"], checkpointed=False) == 0  # nothing fits
    assert largest_microbatch(at2, 2, 6, 1e9, checkpointed=False) == 6  # must divide the per-process batch


def test_corpus_smaller_than_one_global_batch_fails_in_one_line(tmp_path):
    data = tmp_path / "small.npy"
    np.arange(5 * 128, dtype=np.uint16).tofile(data)
    cfg = _load(TINY, f"--data.paths=[{data}]", f"--save_folder={tmp_path / 'run'}", "--evaluators=[]")
    checks, _ = preflight(cfg, "pre", nodes=1, gpus_per_node=1, gpu="h100-80gb")
    assert _status(checks)["data"] == "FAIL"
    assert "fewer than one global batch" in _detail(checks, "data") and "\n" not in _detail(checks, "data")


def test_disk_save_folder_flash_attn_and_wandb(austen_prepared, tmp_path, monkeypatch):
    import shutil

    cfg = _load(TINY, f"--save_folder={tmp_path / 'run'}", "--save_num_checkpoints_to_keep=3",
                "--save_interval=10", "--save_interval_unsharded=null", "--model.flash_attention=true")
    cfg.wandb = cfg.wandb or dataclasses.replace(load_config(OLMO_1B).wandb)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "flash_attn" else 1)
    checks, est = preflight(cfg, "pre", nodes=1, gpus_per_node=1, gpu="h100-80gb")
    status = _status(checks)
    assert status["disk"] == "FAIL" and "up to 4 on disk at once" in _detail(checks, "disk")  # keep 3 + 1 being written
    assert status["flash-attn"] == "FAIL" and "--model.flash_attention=false" in _detail(checks, "flash-attn")
    assert status["wandb"] == "warn" and "wandb login" in _detail(checks, "wandb")
    monkeypatch.setattr("os.access", lambda path, mode: False)
    checks, _ = preflight(cfg, "pre", nodes=1, gpus_per_node=1, gpu="h100-80gb")
    assert _status(checks)["save folder"] == "FAIL"


def test_olmo_1b_on_a100_40gb_does_not_fit_and_names_the_fix_on_4_nodes_of_h100_it_fits(tmp_path, capsys,
                                                                                       monkeypatch):
    monkeypatch.delenv("OLMO_SHARED_FS", raising=False)
    main = runpy.run_path(str(ROOT / "scripts" / "preflight.py"), run_name="preflight")["main"]
    out = tmp_path / "p.json"
    code = main([OLMO_1B, "--gpu", "a100-40gb", "--json", str(out), f"--save_folder={tmp_path / 'r'}"])
    text = capsys.readouterr().out
    assert code == 1 and "FAILED: " in text
    result = json.loads(out.read_text())
    memory = next(c for c in result["checks"] if c["name"] == "memory")
    assert memory["status"] == "FAIL"
    assert "--device_train_microbatch_size=4" in memory["detail"] and "--activation_checkpointing=whole_layer" in \
        memory["detail"]
    est = result["estimates"]
    assert est["parameters"] > 1.2e9 and est["max_steps"] == 23842 and est["sharded_over"] == 8
    code = main([OLMO_1B, "--nodes", "4", "--gpu", "h100-80gb", "--json", str(out),
                     f"--save_folder={tmp_path / 'r'}"])
    result = json.loads(out.read_text())
    checks = {c["name"]: c for c in result["checks"]}
    assert checks["memory"]["status"] == "ok" and checks["batch"]["status"] == "ok"
    assert checks["shared save folder"]["status"] == "warn"  # 4 nodes, OLMO_SHARED_FS unset
    est4 = result["estimates"]
    assert est4["gpus"] == 32 and est4["sharded_over"] == 32
    # 4x the GPUs: a quarter of the time, the states a quarter the size
    hours1, hours4 = est["cost_model"]["a100-40gb"]["hours"], est4["cost_model"]["h100-80gb"]["hours"]
    ratio = est["cost_model"]["a100-40gb"]["tokens_per_s_per_gpu"] / est4["cost_model"]["h100-80gb"]["tokens_per_s_per_gpu"]
    assert hours4 == pytest.approx(hours1 * ratio / 4, rel=1e-6)
    assert est4["memory"]["state"] == pytest.approx(est["memory"]["state"] / 4, rel=1e-6)


def test_batch_that_does_not_split_over_the_gpus_fails_naming_the_microbatch(austen_prepared, tmp_path):
    cfg = _load(TINY, f"--save_folder={tmp_path / 'run'}")  # 16 sequences a step, microbatch 16
    checks, _ = preflight(cfg, "pre", nodes=2, gpus_per_node=1, gpu="h100-80gb")
    assert _status(checks)["batch"] == "FAIL" and "--device_train_microbatch_size=8" in _detail(checks, "batch")


def test_timed_run_on_the_cpu(austen_prepared, tmp_path):
    cfg = _load(TINY, f"--save_folder={tmp_path / 'run'}", "--device_train_microbatch_size=2")
    checks, est = preflight(cfg, "hybrid_pre", nodes=1, gpus_per_node=1, gpu="h100-80gb", timed_steps=2)
    run = est["timed_run"]
    assert _status(checks)["timed run"] == "ok" and run["tokens_per_s"] > 0 and run["step_s"] > 0
    assert run["microbatch"] == 2 and run["seq_len"] == 128 and run["hours"] > 0
    assert run["flops_per_token"] > 6 * est["parameters"] * 0.5  # at least the matmuls of the weights


def test_a_mistyped_model_type_is_one_failed_check_with_did_you_mean(tmp_path):
    cfg = _load(TINY, f"--save_folder={tmp_path / 'run'}")
    checks, est = preflight(cfg, "hybrd_pre", nodes=1, gpus_per_node=1, gpu="h100-80gb")
    assert [c.status for c in checks] == ["FAIL"] and est == {}
    assert "did you mean 'hybrid_pre'" in checks[0].detail
