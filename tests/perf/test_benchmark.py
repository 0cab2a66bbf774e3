"""The benchmark (siamesenorm/perf/benchmark.py): its activation counter on a module whose saved tensors are known, and
a CI-sized run of pre against hybrid_pre, eager and compiled."""

import pytest
import torch
from conftest import tiny_config

from siamesenorm import MODEL_TYPES, build_model
from siamesenorm.perf.benchmark import BenchSettings, activation_bytes, model_config, run, to_markdown


def test_activation_bytes_counts_saved_tensors_once_and_leaves_out_parameters():
    model = torch.nn.Linear(4, 8)
    x = torch.randn(2, 4)

    def loss():
        h = model(x).relu()  # addmm saves x (2x4) and the weight (a parameter); relu saves its output (2x8)
        return (h * h).sum()  # mul saves h, the storage relu already saved: counted once

    assert activation_bytes(model, loss) == (2 * 4 + 2 * 8) * 4
    assert model.weight.grad is None  # backward ran and the gradients were cleared


@pytest.mark.slow
def test_benchmark_reports_ratios_against_pre_in_both_modes():
    settings = BenchSettings(model_types=["hybrid_pre"], layers=1, d_model=32, batch=1, seq=16, repeats=2,
                             steps_per_timing=1, modes=["eager", "compiled"], device="cpu")
    result = run(settings, progress=lambda m: None)
    rows = {(r["model_type"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {("pre", "eager"), ("hybrid_pre", "eager"), ("pre", "compiled"), ("hybrid_pre", "compiled")}
    for mode in ("eager", "compiled"):
        pre, siamese = rows[("pre", mode)], rows[("hybrid_pre", mode)]
        assert pre["step_time_ratio"] == pre["activation_ratio"] == 1.0
        assert pre["activation_bytes"] > 0 and siamese["activation_bytes"] > 0
        assert siamese["activation_ratio"] == siamese["activation_bytes"] / pre["activation_bytes"]
        if mode == "eager":  # two streams save more than one (compiled, at this size, hybrid_pre saves less)
            assert siamese["activation_bytes"] > pre["activation_bytes"]
        assert siamese["parameters"] > pre["parameters"]
        assert siamese["step_s_min"] <= siamese["step_s_median"] <= siamese["step_s_max"]
        assert siamese["tokens_per_s"] == 16 / siamese["step_s_median"]
    # the same matmuls: FLOPs per token within a few percent (norms and stream sums are not counted)
    assert 1.0 <= rows[("hybrid_pre", "eager")]["flops_ratio"] < 1.05
    assert rows[("pre", "eager")]["flops_per_token"] > 6 * 32 * 32  # at least 6 x (attention + MLP weights)
    table = to_markdown(result)
    assert table.count("| hybrid_pre |") == 2 and "MFU" not in table  # no CUDA columns on a CPU


def _tiny_loss(model, ids):
    logits = model(ids).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_recomputing_norms_and_stream_mixing_is_exact(model_type, monkeypatch):
    """model.recompute_cheap reruns the same ops in backward: the loss and every gradient are bit-identical to saving
    them (pre's norms included)."""
    from siamesenorm.variants._base import set_recompute

    model = build_model(tiny_config(n_layers=3), model_type)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(2))
    results = {}
    for on in (False, True):
        set_recompute(model, on)
        model.zero_grad(set_to_none=True)
        loss = _tiny_loss(model, ids)
        loss.backward()
        results[on] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert torch.equal(results[True][0], results[False][0])
    assert results[True][1].keys() == results[False][1].keys()
    for name, grad in results[True][1].items():
        assert torch.equal(grad, results[False][1][name]), name


@pytest.mark.parametrize("model_type", ["pre", "hybrid_pre", "post_pre", "hc", "mhc"])
def test_recompute_is_a_config_field_that_cuts_activation_memory(model_type):
    """model.recompute_cheap, per run: on, every block keeps less for backward (pre's norms too, so that the
    comparison with pre is like for like); the field's default is on."""
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(3))
    saved = {}
    for on in (False, True):
        model = build_model(tiny_config(n_layers=3, d_model=64, recompute_cheap=on), model_type)
        saved[on] = activation_bytes(model, lambda: _tiny_loss(model, ids))
    assert saved[True] < (0.95 if model_type == "pre" else 0.85) * saved[False], saved
    assert tiny_config().recompute_cheap is True


def test_breakdown_charges_every_saved_byte_to_a_place():
    """The breakdown adds up to activation_bytes, pre's blocks save nothing outside OLMo's modules, and hc's depth
    connection shows up where its bytes are saved."""
    from siamesenorm.perf.benchmark import activation_breakdown, step_loss

    cfg = tiny_config()
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    for model_type in ("pre", "hc"):
        model = build_model(cfg, model_type).train()
        places = activation_breakdown(model, ids)
        total = activation_bytes(model, lambda: step_loss(model, ids))
        assert sum(places.values()) * ids.numel() * cfg.d_model * 4 * cfg.n_layers == pytest.approx(total)
        own = {k: v for k, v in places.items() if k.startswith("block:")}
        if model_type == "pre":
            assert own == {} and places["attn_norm"] > 0
        else:
            assert own["block: depth_connection"] > 0 and "attn_norm" not in places


def test_recompute_cost_times_both_settings_against_pre():
    from siamesenorm.perf.benchmark import recompute_cost

    settings = BenchSettings(model_types=["hybrid_pre"], layers=1, d_model=32, batch=1, seq=16, repeats=2,
                             device="cpu")
    result = recompute_cost(settings)
    assert set(result) == {"pre", "hybrid_pre"} and result["pre"]["on"] == 1.0
    assert all(v > 0 for r in result.values() for v in r.values())


def test_pre_built_by_olmos_own_factory_follows_the_field():
    """OLMo(config) directly (OLMo's scripts, the HF wrapper) builds pre's blocks through OLMo's factory; its two
    norms recompute exactly when model.recompute_cheap says so, and its state dict is OLMo's."""
    from olmo.model import OLMo

    from siamesenorm.models.config import as_siamese_config

    for on in (True, False):
        model = OLMo(as_siamese_config(tiny_config(recompute_cheap=on), model_type="pre"))
        block = model.transformer.blocks[0]
        assert type(block).__name__ == "OLMoSequentialBlock"
        assert ("forward" in block.attn_norm.__dict__) is on and ("forward" in block.ff_norm.__dict__) is on
        assert not any("forward" in k for k in model.state_dict())


class _Flagged(torch.nn.Module):
    """One forward code object that dynamo specialises on an attribute, as it does each variant's blocks."""

    def __init__(self, flag: int):
        super().__init__()
        self.flag = flag

    def forward(self, x):
        return x * self.flag if self.flag % 2 else x + self.flag


def test_allow_recompiles_lets_every_compiled_block_specialise_under_fullgraph():
    import torch._dynamo

    from siamesenorm.run.process import allow_recompiles

    x = torch.ones(3)
    torch._dynamo.reset()
    saved = torch._dynamo.config.recompile_limit
    try:
        torch._dynamo.config.recompile_limit = 8
        modules = [_Flagged(i) for i in range(12)]
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):  # the ninth specialisation, without the raise
            for m in modules:
                torch.compile(m, fullgraph=True, backend="eager")(x)
        torch._dynamo.reset()
        assert allow_recompiles(len(modules)) >= 8 + 2 * len(modules)
        outs = [torch.compile(m, fullgraph=True, backend="eager")(x) for m in modules]
        assert [float(o[0]) for o in outs] == [float(i if i % 2 else 1 + i) for i in range(12)]
    finally:
        torch._dynamo.config.recompile_limit = saved
        torch._dynamo.reset()


def test_a_timing_builds_its_variants_with_the_recipe_fields_set(capsys):
    """``--set`` reaches the timed models (stream mixing, Block AttnRes), not only the cost and memory models; a field
    the config refuses is one line before any model is built."""
    plain = model_config(BenchSettings(device="cpu"))
    mixed = model_config(BenchSettings(device="cpu", overrides=("model.siamese_mixing=dynamic",
                                                                "--model.attnres_blocks=2")))
    assert (plain.siamese_mixing, mixed.siamese_mixing) != ("dynamic", "dynamic") and mixed.siamese_mixing == "dynamic"
    assert mixed.attnres_blocks == 2 != plain.attnres_blocks
    from siamesenorm.cli.benchmark import main

    assert main(["--model-types", "hybrid_pre", "--set", "model.no_such_field=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "no_such_field" in err[0]


def test_precision_follows_the_recipe_on_a_gpu_and_is_fp32_on_a_cpu_unless_asked():
    from siamesenorm.perf.benchmark import autocast_dtype, step_loss

    assert autocast_dtype(BenchSettings(device="cpu")) is None
    assert autocast_dtype(BenchSettings(device="cpu", precision="bf16")) is torch.bfloat16
    assert autocast_dtype(BenchSettings(recipe="configs/OLMo-1B-2e-3.yaml", device="cuda")) is torch.bfloat16  # amp_bf16
    assert autocast_dtype(BenchSettings(recipe="configs/tiny-cpu.yaml", device="cuda")) is None  # fp32 recipe
    with pytest.raises(ValueError, match="bf16 or fp32"):
        autocast_dtype(BenchSettings(device="cpu", precision="fp16"))
    model = build_model(tiny_config(), "hybrid_pre").train()
    ids = torch.randint(0, 50, (1, 8))
    seen = []
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    linear.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    for dtype in (None, torch.bfloat16):
        step_loss(model, ids, dtype).backward()
    assert seen == [torch.float32, torch.bfloat16]  # the timed step's matmuls run in the precision asked for


def test_profile_times_each_variant_and_puts_its_kernels_in_order():
    from siamesenorm.perf.benchmark import against_cost_model, profile, profile_markdown

    settings = BenchSettings(model_types=["hybrid_pre"], layers=1, d_model=32, batch=1, seq=16, steps_per_timing=1,
                             modes=["eager"], device="cpu")
    result = profile(settings, top=5, progress=lambda m: None)
    rows = {r["model_type"]: r for r in result["rows"]}
    assert set(rows) == {"pre", "hybrid_pre"}
    for r in rows.values():
        ms = [t["ms"] for t in r["top"]]
        assert 0 < len(ms) <= 5 and ms == sorted(ms, reverse=True)
        assert r["kernel_ms"] >= sum(ms) and r["wall_ms"] > 0
        assert not any(t["name"].startswith("Optimizer.") for t in r["top"])  # the annotation is not a kernel
    # hybrid_pre's block runs more ops than pre's (the second stream's norm and add)
    assert rows["hybrid_pre"]["kernels"] > rows["pre"]["kernels"]
    assert profile_markdown(result).count("| hybrid_pre | eager |") == 1
    # beside a cost model whose hybrid_pre costs twice pre's: its model ratio is 2
    step = {"forward": {"matmul_flops": 0, "bytes": 10 ** 9, "kernels": 1}}
    costs = [{"rows": {"pre": {"eager": {"step": step}},
                       "hybrid_pre": {"eager": {"step": {"forward": {**step["forward"], "bytes": 2 * 10 ** 9}}}}}}]
    table = against_cost_model(result, costs, "h100-80gb")
    assert "| 2.000 |" in table.splitlines()[3] and "| 1.000 |" in table.splitlines()[2]


def test_the_committed_h100_profile_fits_its_kernels_inside_the_step():
    """The first H100 profile was written while the optimizer's annotation was summed as a kernel (kernel time
    above the step's wall time); read back, forward + backward plus the optimizer fit inside every step."""
    import json
    from pathlib import Path

    from siamesenorm.perf.benchmark import _forward_backward_ms

    for mode in ("eager", "compiled"):
        rows = json.loads(Path(f"results/gpu/h100-2026-11-27/profile-{mode}.json").read_text())["rows"]
        assert any(r["kernel_ms"] > r["wall_ms"] for r in rows)  # as written
        for r in rows:
            optimizer = next(t["ms"] for t in r["top"] if t["name"].startswith("Optimizer.step"))
            assert 10 < optimizer < 20
            assert 0 < _forward_backward_ms(r) + optimizer < r["wall_ms"]


def test_tune_kernels_times_each_candidate_and_restores_the_defaults(monkeypatch):
    from siamesenorm.nn import fused
    from siamesenorm.perf import benchmark

    default = fused._PROJECT_BLOCK_R
    seen = []

    def fake_profile(settings, top, progress):  # the projection's dx kernel: faster with smaller row blocks
        seen.append((fused._PROJECT_BLOCK_R, fused._SINKHORN_BLOCK_T, settings.fused, tuple(settings.modes)))
        us = {32: 600.0, 16: 300.0}.get(fused._PROJECT_BLOCK_R, 900.0)
        return {"settings": {"device_name": "cpu"}, "rows": [
            {"model_type": "mhc", "top": [{"name": "_project_dx_kernel", "per_step": 8, "ms": 8 * us / 1e3},
                                          {"name": "aten::mm", "per_step": 4, "ms": 1.0}]}]}

    monkeypatch.setattr(benchmark, "profile", fake_profile)
    settings = BenchSettings(model_types=["mhc"], modes=["compiled"], fused=False, device="cpu")
    result = benchmark.tune_kernels(settings, [{}, {"_PROJECT_BLOCK_R": 16}, {"_SINKHORN_BLOCK_T": 8}],
                                    progress=lambda m: None)
    assert seen == [(default, 64, True, ("eager",)), (16, 64, True, ("eager",)), (default, 8, True, ("eager",))]
    assert fused._PROJECT_BLOCK_R == default and fused._SINKHORN_BLOCK_T == 64  # restored
    assert result["rows"] == {"mhc": {"_project_dx_kernel": [600.0, 300.0, 600.0]}}  # ours only, us a call
    table = benchmark.tune_markdown(result)
    assert "| mhc | `_project_dx_kernel` | 600 | **300** | 600 |" in table and "project_block_r=16" in table
    with pytest.raises(ValueError, match="not a launch size.*_BLOCK_Q"):
        benchmark.tune_kernels(settings, [{"_BLOCK_Q": 1}])
    assert len(seen) == 3  # refused before any profile ran
