"""The device-independent cost model: counts against a hand count, and the properties it must show."""

import dataclasses

import pytest
import torch
from conftest import tiny_config

from siamesenorm.perf import costmodel


def hand_matmul_flops(cfg, batch: int, seq: int) -> int:
    """Forward matrix products of an OLMo Pre-Norm model, written out: per layer the fused QKV, the attention output,
    SwiGLU's input (both halves) and output projections, attention's two products; then the output layer."""
    d, r, v = cfg.d_model, cfg.mlp_ratio, cfg.embedding_size
    per_token_layer = 2 * (3 * d * d + d * d + d * r * d + (r * d // 2) * d)
    attention = 4 * seq * d  # Q K^T and P V per token, every position (the causal mask is not subtracted)
    return batch * seq * (cfg.n_layers * (per_token_layer + attention) + 2 * d * v)


@pytest.mark.parametrize("n_layers", [1, 3])
def test_matmul_flops_equal_a_hand_count_and_backward_is_twice_forward(n_layers):
    cfg = tiny_config(n_layers=n_layers, weight_tying=False)
    costs = costmodel.step_cost(cfg, "pre", microbatch=2, seq_len=16, autocast=None)
    assert costs["step"]["forward"]["matmul_flops"] == hand_matmul_flops(cfg, 2, 16)
    assert costs["step"]["backward"]["matmul_flops"] == 2 * costs["step"]["forward"]["matmul_flops"]
    if n_layers > 1:  # one layer: the model less a one-layer model, over the layers between
        one = hand_matmul_flops(dataclasses.replace(cfg, n_layers=2), 2, 16) - hand_matmul_flops(
            dataclasses.replace(cfg, n_layers=1), 2, 16)
        assert costs["layer"]["forward"]["matmul_flops"] == one


def test_an_elementwise_op_is_one_kernel_reading_and_writing_its_tensors():
    a, b = torch.ones(10, 7), torch.ones(10, 7)
    with costmodel._Counter() as counter:
        c = a + b
        c.view(70).t()  # views move nothing
    assert counter.cost.kernels == 1 and counter.cost.bytes == 3 * 70 * 4 and counter.cost.matmul_flops == 0


def test_products_are_charged_their_operands_and_result_at_the_larger_of_flop_and_byte_time():
    """A roofline per product: a skinny fp32 product (hc/mhc's coefficients: tokens x n d times n d x few) is charged
    its bytes' time, a square bf16 one its FLOPs' time; both count their operands and result as bytes moved."""
    skinny_a, skinny_b = torch.ones(4096, 1024), torch.ones(1024, 24)
    square = torch.ones(2048, 2048, dtype=torch.bfloat16)
    with costmodel._Counter() as skinny:
        skinny_a @ skinny_b
    with costmodel._Counter() as big:
        square @ square
    moved = (4096 * 1024 + 1024 * 24 + 4096 * 24) * 4
    assert skinny.cost.bytes == skinny.cost.matmul_bytes == moved
    assert big.cost.bytes == big.cost.matmul_bytes == 3 * 2048 * 2048 * 2
    for device, spec in costmodel.DEVICES.items():
        byte_time = moved / (spec["gbps"] * 1e9 * costmodel.BANDWIDTH_EFFICIENCY)
        flop_time = 2 * 4096 * 1024 * 24 / (spec["tflops"] * 1e12 * costmodel.MATMUL_EFFICIENCY)
        assert byte_time > flop_time
        assert costmodel.estimate_seconds(skinny.cost.summary(), device) == pytest.approx(byte_time, rel=1e-9)
        square_flops = 2 * 2048 ** 3 / (spec["tflops"] * 1e12 * costmodel.MATMUL_EFFICIENCY)
        assert big.cost.matmul_excess_s[device] == 0.0
        assert costmodel.estimate_seconds(big.cost.summary(), device) == pytest.approx(square_flops, rel=1e-9)


def test_rms_project_is_charged_as_the_products_it_replaces():
    """Our coefficient projection (one op each way, three kernels) is charged like the eager products it replaces:
    the same FLOPs (2 rows N K forward; dx and dW the same each), its inputs and outputs as bytes, the roofline."""
    from siamesenorm.nn import fused

    x, wp = torch.ones(4096, 1024, dtype=torch.bfloat16, requires_grad=True), torch.ones(1024, 24, requires_grad=True)
    with costmodel._Counter() as fwd:
        logits = fused.rms_project(x, wp)
    with costmodel._Counter() as bwd:
        logits.sum().backward()
    flops = 2 * 4096 * 1024 * 24
    assert fwd.cost.by_op["project_forward"] == [1, 4096 * 1024 * 2 + 1024 * 24 * 4 + 4096 * 24 * 4 + 4096 * 4, flops]
    assert bwd.cost.by_op["project_backward_x"][0] == bwd.cost.by_op["project_backward_w"][0] == 1
    assert bwd.cost.by_op["project_backward_x"][2] == bwd.cost.by_op["project_backward_w"][2] == flops
    assert fwd.cost.matmul_flops == flops and fwd.cost.matmul_bytes == fwd.cost.by_op["project_forward"][1]
    assert all(fwd.cost.excess_by_op["project_forward"][d] > 0 for d in costmodel.DEVICES)  # memory-bound


def test_compiled_excess_keeps_only_the_products_inductor_left_extern():
    """The compiled layer's roofline excess: a product kind inductor lowered into its own kernels (bytes counted
    there, at the bandwidth) adds none; one left extern keeps its eager excess, in the share of its kernels left;
    an eager result without the per-kind counts keeps its excess whole (an upper bound)."""
    devices = list(costmodel.DEVICES)
    eager = {"layer": {"forward": {"matmul_excess_s": {d: 3.0 for d in devices}}},
             "layer_by_op": {"forward": {"bmm": [4, 0, 0], "mm": [8, 0, 0]}},
             "layer_excess_by_op": {"forward": {"bmm": {d: 1.0 for d in devices}, "mm": {d: 2.0 for d in devices}}}}
    excess = costmodel._compiled_excess
    assert excess(eager, "forward", {"extern_products": {"mm": 8}}) == {d: 2.0 for d in devices}
    assert excess(eager, "forward", {"extern_products": {"mm": 8, "bmm": 4}}) == {d: 3.0 for d in devices}
    assert excess(eager, "forward", {"extern_products": {"mm": 4, "bmm": 1}}) == {d: 1.25 for d in devices}
    assert excess(eager, "forward", {}) == {d: 3.0 for d in devices}


def test_allocations_are_free_and_fills_write_only_their_output():
    x = torch.ones(64, 32)
    with costmodel._Counter() as counter:
        x.new_empty(0)
        torch.empty_like(x)
        torch.zeros_like(x)
    assert counter.cost.kernels == 1 and counter.cost.bytes == 64 * 32 * 4


def test_siamesenorm_moves_more_bytes_but_computes_the_same_products_as_pre():
    cfg = tiny_config(n_layers=4, d_model=64, weight_tying=False)
    result = costmodel.table(cfg, ["hybrid_pre", "hc"], microbatch=2, seq_len=32)
    assert result["modes"] == ["eager"]
    rows = {mt: r["eager"] for mt, r in result["rows"].items()}
    pre, siamese = rows["pre"], rows["hybrid_pre"]
    layer = {mt: costmodel.total(r["layer"]) for mt, r in rows.items()}
    assert layer["hybrid_pre"]["matmul_flops"] == pytest.approx(layer["pre"]["matmul_flops"], rel=0.01)
    assert siamese["layer_bytes_ratio"] > 1.2 and siamese["layer_kernels_ratio"] > 1.2
    assert rows["hc"]["layer_kernels_ratio"] > 1.2
    assert pre["time_ratio"] == {d: 1.0 for d in costmodel.DEVICES}
    assert all(r > 1.0 for r in siamese["time_ratio"].values())


def test_fake_tensors_hold_no_memory_at_the_13b_width():
    """The 1.3B recipe's layer at its real microbatch is counted without allocating it (about 2 GB a layer of bf16
    activations otherwise)."""
    import resource

    from siamesenorm.run.recipe import load_config

    cfg = load_config("configs/OLMo-1B-2e-3.yaml").model
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    costs = costmodel.step_cost(dataclasses.replace(cfg, n_layers=2), "pre", microbatch=8)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    layer = costmodel.total(costs["layer"])
    assert 6.5e12 < layer["matmul_flops"] < 7.5e12  # 8 x 2048 tokens through one 2048-wide layer, forward + backward
    assert grown_mb < 1500, grown_mb


@pytest.fixture
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["pre", "hybrid_pre", "mhc"])
def test_compiled_blocks_move_fewer_bytes_in_fewer_kernels_than_eager(model_type, _fresh_dynamo):
    """Inductor's fusion, read from its scheduler: a compiled middle block moves fewer non-matmul bytes and launches
    fewer kernels than the same block eager, forward and backward; the samples are carried linearly to the size
    asked (both sample sizes gave the same kernels, or compiled_layer_cost would have raised)."""
    # mhc: 4 Sinkhorn iterations, not 20 (inductor unrolls each; the property is the same, the compile 4x shorter)
    extra = {"mhc_sinkhorn_iterations": 4} if model_type == "mhc" else {}
    cfg = tiny_config(n_layers=3, d_model=64, n_heads=4, weight_tying=False, **extra)
    eager = costmodel.step_cost(cfg, model_type, microbatch=2, seq_len=64)["layer"]
    compiled = costmodel.compiled_layer_cost(cfg, model_type, microbatch=2, seq_len=64, sample_tokens=(32, 64))
    for phase in ("forward", "backward"):
        assert 0 < compiled[phase]["bytes"] < eager[phase]["bytes"], (phase, compiled, eager)
        assert 0 < compiled[phase]["kernels"] < eager[phase]["kernels"], (phase, compiled, eager)
        # the products inductor leaves to extern kernels move what the eager ones move; at this width it lowers
        # some of mhc's small products into its own kernels (their bytes then count there)
        extern, products = compiled[phase]["matmul_bytes"], eager[phase]["matmul_bytes"]
        assert (extern == pytest.approx(products, rel=1e-6)) if model_type != "mhc" else 0 < extern < products
    both = costmodel.with_compiled_blocks({"layer": eager, "step": eager}, compiled, n_layers=1)
    assert both["step"]["forward"]["bytes"] == compiled["forward"]["bytes"]  # one block: the step is the block
    assert both["layer"]["forward"]["matmul_flops"] == eager["forward"]["matmul_flops"]


@pytest.mark.slow
def test_compiled_fused_connections_keep_their_ops(_fresh_dynamo):
    """``MIX_IN_OP_COMPILED``: under torch.compile hc's and mhc's fused connections still mix in ``stream_mix`` (one
    op each way, extern to inductor); both project in their width op
    (``hc_width`` / ``mhc_width``: the projection, the branch input and its norm), with ``rms_project``'s dW kernel.
    The kernel listing (``Cost.kernel_list``, results/cost-model/connection_kernels_compiled.py) is every kernel the
    totals count, inductor's named by the ops fused into them."""
    ops = {}
    for model_type in ("hc", "mhc"):
        cfg = tiny_config(n_layers=3, d_model=64, n_heads=4, weight_tying=False, fused_streams=True,
                          mhc_sinkhorn_iterations=4)
        block = costmodel._compiled_middle_block(cfg, model_type, 32)
        ops[model_type] = {phase: set(cost.by_op) for phase, cost in block.items()}
        for cost in block.values():
            assert len(cost.kernel_list) == cost.kernels and sum(b for _, b in cost.kernel_list) == cost.bytes
            fused_labels = [label for label, _ in cost.kernel_list if label.startswith("fused(")]
            assert len(fused_labels) == cost.by_op["fused"][0] and all(label != "fused()" for label in fused_labels)
    for m in ops:
        assert {"stream_mix_forward"} <= ops[m]["forward"] and {"stream_mix_backward"} <= ops[m]["backward"], ops
    for m in ops:
        assert "width_forward" in ops[m]["forward"] and "width_backward" in ops[m]["backward"], ops
        assert not any(op.startswith("project_") and op != "project_backward_w" for phase in ops[m].values()
                       for op in phase), ops  # dW's kernel is the projection's; the rest is in the width ops


def test_fake_activation_count_equals_the_real_tensors_saved():
    """The memory model's activations (fake tensors, no memory) are what autograd keeps with real tensors: the same
    model, bf16 parameters, bf16 autocast, OLMo's loss."""
    from olmo.train import cross_entropy_loss

    from siamesenorm.models.build import build_model
    from siamesenorm.perf.benchmark import activation_bytes

    cfg = tiny_config(n_layers=2, d_model=32, weight_tying=False)
    for model_type in ("pre", "hybrid_pre"):
        fake = costmodel._fake_saved_bytes(cfg, model_type, 2, microbatch=2, seq_len=16, recompute=True,
                                           loss_chunk_tokens=None)
        model = build_model(dataclasses.replace(cfg, init_device="cpu"), model_type)
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
        ids = torch.randint(0, cfg.vocab_size, (2, 16))

        def loss():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(ids).logits
                flat = logits[:, :-1].contiguous().view(-1, logits.shape[-1])
                return cross_entropy_loss(flat, ids[:, 1:].reshape(-1), reduction="sum")[0]

        assert fake == activation_bytes(model, loss), model_type


def test_memory_model_parts_at_the_13b_recipe():
    """The 1.3B recipe at its microbatch on 8 GPUs: the sharded state is 16 bytes a parameter over 8; recompute
    keeps less than saving; whole-layer checkpointing less still; the chunked loss cuts the loss's share by more
    than the fp32 logits (16384 tokens x 50304 x 4 bytes = 3.1 GiB)."""
    from siamesenorm.run.recipe import load_config

    cfg = load_config("configs/OLMo-1B-2e-3.yaml").model
    on = costmodel.memory_per_gpu(cfg, "hybrid_pre", 8, 2048, recompute=True)
    off = costmodel.memory_per_gpu(cfg, "hybrid_pre", 8, 2048, recompute=False)
    chunked = costmodel.memory_per_gpu(cfg, "hybrid_pre", 8, 2048, recompute=True, loss_chunk_tokens=4096)
    assert on["state"] == pytest.approx(16 * on["parameters"] / 8 / 1024 ** 3)
    assert on["activations_checkpointed"] < on["activations"] < off["activations"]
    assert on["peak"] == pytest.approx(on["state"] + on["gathered"] + on["loss_backward"] + on["activations"])
    assert on["peak"] - chunked["peak"] > 3.1
    assert costmodel.fits(on["peak"], "a100-80gb") and not costmodel.fits(on["peak"], "a100-40gb")


def test_bytes_above_pre_are_the_layer_difference_split_by_op():
    cfg = tiny_config(n_layers=3)
    result = costmodel.table(cfg, ["pre", "hybrid_pre", "hc"], microbatch=2, seq_len=16)
    pass_bytes = 2 * 16 * cfg.d_model * 2
    pre_layer = costmodel.total(result["rows"]["pre"]["eager"]["layer"])
    for mt in ("hybrid_pre", "hc"):
        above = result["rows"][mt]["eager"]["above_pre"]
        layer = costmodel.total(result["rows"][mt]["eager"]["layer"])
        # the ops' shares add up to the layer totals' difference, bytes and kernels
        assert sum(r["bytes"] for r in above["ops"]) == above["bytes"] == layer["bytes"] - pre_layer["bytes"]
        assert above["kernels"] == layer["kernels"] - pre_layer["kernels"]
        assert above["bytes"] > 0 and above["passes"] == above["bytes"] / pass_bytes
        assert [abs(r["bytes"]) for r in above["ops"]] == sorted((abs(r["bytes"]) for r in above["ops"]), reverse=True)
    assert result["rows"]["pre"]["eager"]["above_pre"] == {"bytes": 0, "passes": 0.0, "kernels": 0, "ops": []}
    assert {r["op"] for r in result["rows"]["hc"]["eager"]["above_pre"]["ops"]} & {"mm", "bmm"}  # its coefficients
    text = costmodel.above_pre_markdown(result)
    assert "| hybrid_pre |" in text and "| pre |" not in text


def test_the_combined_table_puts_each_mode_and_flag_in_its_own_columns_first_file_winning(tmp_path):
    """``--cost-table``: one row a MODEL_TYPE, a column per (mode, fused flag, device) the files hold; where two
    files hold the same figure the first wins; a MODEL_TYPE a file did not count gets an empty cell; a file that
    is not a cost-model JSON is refused in one line."""
    from siamesenorm.cli.benchmark import main

    def ratios(h100):
        return {"time_ratio": {"h100-80gb": h100, "a100-80gb": h100 / 2}}

    unfused = {"fused": False, "modes": ["eager", "compiled"],
               "rows": {"pre": {"eager": ratios(1.0), "compiled": ratios(1.0)},
                        "keel": {"eager": ratios(1.5), "compiled": ratios(1.25)}}}
    fused = {"fused": True, "modes": ["eager"], "rows": {"pre": {"eager": ratios(1.0)}, "hc": {"eager": ratios(1.125)}}}
    fused_again = {"fused": True, "modes": ["eager"], "rows": {"hc": {"eager": ratios(9.0)}}}
    lines = costmodel.combined_markdown([unfused, fused, fused_again]).splitlines()
    assert lines[0] == ("| MODEL_TYPE | eager, h100-80gb | eager, a100-80gb | compiled, h100-80gb | compiled, a100-80gb "
                        "| eager + fused, h100-80gb | eager + fused, a100-80gb |")
    rows = {line.split(" | ")[0][2:]: line for line in lines[2:]}
    assert list(rows) == ["pre", "keel", "hc"]
    assert rows["keel"] == "| keel | 1.500 | 0.750 | 1.250 | 0.625 |  |  |"
    assert rows["hc"] == "| hc |  |  |  |  | 1.125 | 0.562 |"  # the first file's figure, not 9.0
    bad = tmp_path / "notes.json"
    bad.write_text('{"rows": {}}')
    assert main(["--cost-table", str(bad)]) == 2
