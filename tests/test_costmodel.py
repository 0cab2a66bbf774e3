"""The device-independent cost model (issue 21): counts against a hand count, and the properties it must show."""

import dataclasses

import pytest
import torch
from conftest import tiny_config

from siamesenorm import costmodel


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


def test_siamesenorm_moves_more_bytes_but_computes_the_same_products_as_pre():
    cfg = tiny_config(n_layers=4, d_model=64, weight_tying=False)
    result = costmodel.table(cfg, ["hybrid_pre", "hc"], microbatch=2, seq_len=32)
    pre, siamese = result["rows"]["pre"], result["rows"]["hybrid_pre"]
    layer = {mt: costmodel.total(r["layer"]) for mt, r in result["rows"].items()}
    assert layer["hybrid_pre"]["matmul_flops"] == pytest.approx(layer["pre"]["matmul_flops"], rel=0.01)
    assert siamese["layer_bytes_ratio"] > 1.2 and siamese["layer_kernels_ratio"] > 1.2
    assert result["rows"]["hc"]["layer_kernels_ratio"] > 1.2
    assert pre["time_ratio"] == {d: 1.0 for d in costmodel.DEVICES}
    assert all(r > 1.0 for r in siamese["time_ratio"].values())


def test_fake_tensors_hold_no_memory_at_the_13b_width():
    """The 1.3B recipe's layer at its real microbatch is counted without allocating it (about 2 GB a layer of bf16
    activations otherwise)."""
    import resource

    from siamesenorm.runconfig import load_config

    cfg = load_config("configs/OLMo-1B-2e-3.yaml").model
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    costs = costmodel.step_cost(dataclasses.replace(cfg, n_layers=2), "pre", microbatch=8)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    layer = costmodel.total(costs["layer"])
    assert 6.5e12 < layer["matmul_flops"] < 7.5e12  # 8 x 2048 tokens through one 2048-wide layer, forward + backward
    assert grown_mb < 1500, grown_mb
