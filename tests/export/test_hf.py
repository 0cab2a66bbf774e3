"""Hugging Face export and generation (siamesenorm/export/hf.py): for every MODEL_TYPE a run trained through OLMo's Trainer
exports to a folder that transformers' Auto classes load, with OLMo's logits and OLMo's greedy tokens."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import HIDE_SIAMESENORM_AND_OLMO

from siamesenorm.models.config import MODEL_TYPES

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny-cpu.yaml"
SMALL = ["--model.d_model=32", "--model.n_heads=2", "--model.n_layers=2", "--model.max_sequence_length=32",
         "--global_train_batch_size=4", "--device_train_microbatch_size=4", "--max_duration=2",
         "--scheduler.t_warmup=1", "--eval_interval=1000", "--evaluators=[]", "--console_log_interval=1",
         "--no_pre_train_checkpoint=true"]


def trained_run(tmp_path: Path, model_type: str, monkeypatch) -> Path:
    from siamesenorm.ai2_olmo.train import main

    monkeypatch.chdir(ROOT)  # the recipe's data and tokenizer paths are relative to the repository
    monkeypatch.setenv("MODEL_TYPE", model_type)
    run = tmp_path / f"run-{model_type}"
    assert main(str(TINY), SMALL + [f"--save_folder={run}"]) == 0
    return run


def greedy_olmo(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding with OLMo's own forward, every position recomputed (no cache): the reference."""
    out = ids
    for _ in range(n):
        logits = model(out).logits[:, -1]
        out = torch.cat([out, logits.argmax(-1, keepdim=True)], dim=1)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_export_loads_with_auto_classes_and_matches_olmo(tmp_path, monkeypatch, austen_prepared, model_type):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from siamesenorm.export.hf import export
    from siamesenorm.run.checkpoints import load_model

    run = trained_run(tmp_path, model_type, monkeypatch)
    out = tmp_path / "export"
    export(run, out, format="siamesenorm")  # every MODEL_TYPE, pre too (whose default is a Llama folder)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "siamesenorm_olmo" and config["olmo"]["model_type"] == model_type
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_siamesenorm.SiameseOlmoForCausalLM"
    assert (out / "model.safetensors").is_file() and (out / "modeling_siamesenorm.py").is_file()

    hf_model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    olmo_model, cfg = load_model(run)
    assert {k for k in hf_model.state_dict()} == {f"model.{k}" for k in olmo_model.state_dict()}

    ids = tokenizer("It is a truth universally acknowledged, that", return_tensors="pt").input_ids
    from siamesenorm.run.data import load_tokenizer
    assert ids[0].tolist() == load_tokenizer(str(cfg.tokenizer.identifier)).encode(
        "It is a truth universally acknowledged, that").ids  # the run's own tokenizer, not a re-made one
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, olmo_model(ids).logits, rtol=0, atol=1e-6)
        reference = greedy_olmo(olmo_model, ids, 8)
        cached = hf_model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=True,
                                   pad_token_id=tokenizer.pad_token_id, eos_token_id=None)
        uncached = hf_model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=False,
                                     pad_token_id=tokenizer.pad_token_id, eos_token_id=None)
    assert cached.tolist() == reference.tolist()
    assert uncached.tolist() == reference.tolist()


def test_export_refuses_to_overwrite_what_is_not_an_export(tmp_path, monkeypatch, austen_prepared):
    from siamesenorm.export.hf import export

    run = trained_run(tmp_path, "pre", monkeypatch)
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty"):
        export(run, out)
    with pytest.raises(FileExistsError, match="not an earlier export"):
        export(run, out, overwrite=True)
    assert (out / "notes.txt").read_text() == "keep me"
    fresh = tmp_path / "fresh"
    export(run, fresh)
    export(run, fresh, overwrite=True)  # an earlier export is replaced when asked
    assert (fresh / "config.json").is_file()


@pytest.mark.slow
def test_generate_script_from_run_and_from_export_agree(tmp_path, monkeypatch, austen_prepared):
    from siamesenorm.export.hf import export

    run = trained_run(tmp_path, "hybrid_pre", monkeypatch)
    export(run, tmp_path / "export")
    outputs = []
    for source in (run, tmp_path / "export"):
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), str(source), "--prompt", "Emma",
                               "--max-new-tokens", "6"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs.append(proc.stdout)
    assert outputs[0] == outputs[1] and outputs[0].startswith("Emma")
    sampled = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), str(run), "--prompt", "Emma",
                              "--max-new-tokens", "6", "--sample", "--num-samples", "2", "--seed", "3"],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert sampled.stdout.count("---") == 2


# Loads an export in a Python where neither siamesenorm nor olmo can be imported: transformers alone.
_TRANSFORMERS_ONLY = HIDE_SIAMESENORM_AND_OLMO + """
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, ids, trust = sys.argv[1], json.loads(sys.argv[2]), sys.argv[4] == "trust"
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=trust).eval()
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust)  # as the README writes it
with torch.no_grad():
    ids = torch.tensor([ids])
    logits = model(ids).logits
    greedy = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
torch.save({"logits": logits, "greedy": greedy, "class": type(model).__name__, "text": tokenizer.decode(greedy[0]),
            "hidden": [m for m in sys.modules if m.split(".")[0] in ("siamesenorm", "olmo")]}, sys.argv[3])
"""


def load_alone(folder: Path, ids: list, tmp_path: Path, trust: bool = False) -> dict:
    """Load ``folder`` in a Python where siamesenorm and olmo cannot be imported; its logits, greedy tokens, text."""
    result = tmp_path / "result.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "hf-modules")
    proc = subprocess.run([sys.executable, "-c", _TRANSFORMERS_ONLY, str(folder), json.dumps(ids), str(result),
                           "trust" if trust else "no"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[y/N]" not in proc.stderr + proc.stdout  # no interactive question on the README's lines
    return torch.load(result)


@pytest.mark.slow
def test_a_trained_hybrid_pre_export_loads_with_transformers_alone(tmp_path, monkeypatch, austen_prepared):
    from siamesenorm.export.hf import export
    from siamesenorm.run.checkpoints import load_model

    run = trained_run(tmp_path, "hybrid_pre", monkeypatch)
    out = tmp_path / "hybrid_pre-export"
    export(run, out)
    olmo_model, _ = load_model(run)
    ids = [5, 17, 99, 3, 250, 1024, 7, 42]
    got = load_alone(out, ids, tmp_path, trust=True)
    assert got["class"] == "SiameseOlmoForCausalLM" and got["hidden"] == []
    with torch.no_grad():
        reference = olmo_model(torch.tensor([ids])).logits
    assert (got["logits"] - reference).abs().max().item() <= 1e-6
    assert got["greedy"].tolist() == greedy_olmo(olmo_model, torch.tensor([ids]), 8).tolist()
    assert isinstance(got["text"], str) and got["text"]


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_pre_exports_as_a_llama_that_transformers_alone_loads_with_olmos_logits(tmp_path, monkeypatch,
                                                                               austen_prepared, tied):
    from siamesenorm.export.hf import export
    from siamesenorm.run.checkpoints import load_model

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("MODEL_TYPE", "pre")
    run = tmp_path / "run-pre"
    from siamesenorm.ai2_olmo.train import main

    assert main(str(TINY), SMALL + [f"--save_folder={run}", f"--model.weight_tying={str(tied).lower()}"]) == 0
    out = tmp_path / "llama"
    export(run, out)  # the default for pre
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert "auto_map" not in config and config["tie_word_embeddings"] is tied

    olmo_model, _ = load_model(run)
    ids = [5, 17, 99, 3, 250, 1024, 7, 42]
    got = load_alone(out, ids, tmp_path)
    assert got["class"] == "LlamaForCausalLM" and got["hidden"] == []
    with torch.no_grad():
        reference = olmo_model(torch.tensor([ids])).logits
        greedy = greedy_olmo(olmo_model, torch.tensor([ids]), 8)
    assert got["logits"].shape == reference.shape
    assert (got["logits"] - reference).abs().max().item() <= 1e-5
    assert got["greedy"].tolist() == greedy.tolist()


def test_llama_format_is_refused_in_one_line_where_it_would_not_be_exact(tmp_path, monkeypatch, austen_prepared):
    from siamesenorm.export.hf import export, llama_refusal

    run = trained_run(tmp_path, "hybrid_pre", monkeypatch)
    with pytest.raises(ValueError, match="MODEL_TYPE hybrid_pre is not a Llama .* --format siamesenorm"):
        export(run, tmp_path / "x", format="llama")
    assert not (tmp_path / "x").exists()
    export(run, tmp_path / "auto")  # auto: not a Llama, so the siamesenorm folder
    assert json.loads((tmp_path / "auto" / "config.json").read_text())["model_type"] == "siamesenorm_olmo"
    base = {"model_type": "pre", "layer_norm_type": "rms", "layer_norm_with_affine": True, "include_bias": False,
            "activation_type": "swiglu", "rope": True}
    assert llama_refusal(base) is None
    for change in ({"attention_layer_norm": True}, {"include_bias": True}, {"layer_norm_type": "default"},
                   {"clip_qkv": 8.0}, {"activation_type": "gelu"}, {"rope": False}):
        line = llama_refusal({**base, **change})
        assert line and f"model.{next(iter(change))}=" in line and "\n" not in line
