"""torch.compile for every MODEL_TYPE: each block compiles with fullgraph=True (a graph break raises), gives eager's
loss and gradients within fp32 tolerance, and a run with ``compile:`` trains through OLMo's Trainer."""

import copy
import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from siamesenorm import MODEL_TYPES, build_model
from siamesenorm.trainer import compile_blocks

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _loss(model, ids):
    logits = model(ids).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_every_block_compiles_fullgraph_and_matches_eager(model_type):
    eager = build_model(tiny_config(n_layers=2), model_type)
    compiled = copy.deepcopy(eager)
    assert compile_blocks(compiled, {"fullgraph": True, "mode": None}) == 2
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # the second call runs the cached graph
        compiled.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        loss_c, loss_e = _loss(compiled, ids), _loss(eager, ids)
        loss_c.backward()
        loss_e.backward()
        torch.testing.assert_close(loss_c, loss_e, rtol=0, atol=1e-5)
        for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    # compiled in place, so the blocks keep their class and the state dict its parameter names
    assert all(type(b).__name__ != "OptimizedModule" for b in compiled.transformer.blocks)
    assert set(compiled.state_dict()) == set(eager.state_dict())


def test_a_run_with_compile_trains_through_the_trainer_like_eager(tmp_path, monkeypatch, austen_prepared):
    from siamesenorm.train import main

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("MODEL_TYPE", "hybrid_pre")
    small = ["--model.d_model=32", "--model.n_heads=2", "--model.n_layers=2", "--model.max_sequence_length=32",
             "--global_train_batch_size=4", "--device_train_microbatch_size=4", "--max_duration=3",
             "--scheduler.t_warmup=1", "--eval_interval=1000", "--evaluators=[]", "--console_log_interval=1",
             "--no_pre_train_checkpoint=true"]
    losses = {}
    for name, extra in (("eager", []), ("compiled", ["--compile.fullgraph=true"])):
        run = tmp_path / name
        assert main(str(ROOT / "configs" / "tiny-cpu.yaml"), small + extra + [f"--save_folder={run}"]) == 0
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in rows if "loss" in r]
    assert len(losses["compiled"]) == 3
    assert losses["compiled"] == pytest.approx(losses["eager"], abs=1e-4)
