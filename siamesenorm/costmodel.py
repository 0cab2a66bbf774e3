"""A device-independent cost model of one training step (issue 21): what every aten op of the model reads, writes and
computes, counted on fake tensors (no memory, no data: the 1.3B recipe at its real microbatch in seconds on a CPU).

For one microbatch, forward and backward (the loss included, in fp32 as autocast runs it), per step and per layer:

- ``matmul_flops``: 2 x M x N x K of every matrix product (mm, addmm, bmm, baddbmm); fused attention (SDPA) as its
  two products, 4 B H T^2 d forward and twice that backward, the causal mask not subtracted;
- ``bytes``: every other op's tensor inputs plus outputs (what an unfused kernel reads and writes in HBM);
- ``kernels``: how many ops launch a kernel (views, which move nothing, are not counted).

The model is built of fake tensors (torch's FakeTensorMode: shapes and dtypes, no storage) and run under CPU autocast
to bf16, as the recipes' ``precision: amp_bf16`` runs on a GPU: matmuls in bf16, OLMo's norms and the loss in fp32.
The estimated time on a device is ``matmul_flops / (peak x MATMUL_EFFICIENCY) + bytes / (bandwidth x
BANDWIDTH_EFFICIENCY)``, with the devices' figures in ``DEVICES``; ratios to ``pre`` are what to read (the
efficiencies cancel to first order). Eager only:
it counts what an unfused run launches, the upper bound a compiled run improves on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DEVICES", "MATMUL_EFFICIENCY", "BANDWIDTH_EFFICIENCY", "Cost", "count", "step_cost", "estimate_seconds",
           "total", "table", "to_markdown"]

#: bf16 dense matmul peak (TFLOP/s) and HBM bandwidth (GB/s) from the vendors' data sheets (SXM parts).
DEVICES = {
    "a100-40gb": {"tflops": 312.0, "gbps": 1555.0, "memory_gib": 40},
    "a100-80gb": {"tflops": 312.0, "gbps": 2039.0, "memory_gib": 80},
    "h100-80gb": {"tflops": 989.0, "gbps": 3350.0, "memory_gib": 80},
    "h200": {"tflops": 989.0, "gbps": 4800.0, "memory_gib": 141},
}
MATMUL_EFFICIENCY = 0.55  # of peak, for large bf16 GEMMs
BANDWIDTH_EFFICIENCY = 0.80  # of HBM bandwidth, for elementwise and reduction kernels

_NOT_KERNELS = {"detach", "lift_fresh", "_unsafe_view", "alias"}
_MATMUL = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.baddbmm.default}


@dataclass
class Cost:
    matmul_flops: int = 0
    bytes: int = 0
    kernels: int = 0
    by_op: Dict[str, list] = field(default_factory=dict)  # op name -> [kernels, bytes, flops]

    def add(self, name: str, flops: int, nbytes: int) -> None:
        self.matmul_flops += flops
        self.bytes += nbytes
        self.kernels += 1
        row = self.by_op.setdefault(name, [0, 0, 0])
        row[0] += 1
        row[1] += nbytes
        row[2] += flops

    def __sub__(self, other: "Cost") -> "Cost":
        return Cost(self.matmul_flops - other.matmul_flops, self.bytes - other.bytes, self.kernels - other.kernels)

    def scaled(self, factor: float) -> "Cost":
        return Cost(int(self.matmul_flops * factor), int(self.bytes * factor), int(round(self.kernels * factor)))

    def summary(self) -> Dict[str, int]:
        return {"matmul_flops": self.matmul_flops, "bytes": self.bytes, "kernels": self.kernels}


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _nbytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.cost = Cost()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name in _NOT_KERNELS or not any(True for _ in _tensors(out)):
            return out  # aliases, and queries (sizes, devices) that move no data
        if func in _MATMUL:
            a, b = (args[1], args[2]) if func in (torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default) \
                else (args[0], args[1])
            flops = 2 * a.numel() * b.shape[-1]  # (..., M, K) @ (..., K, N): 2 M N K per batch
            self.cost.add(name, flops, 0)
        elif name.startswith("_scaled_dot_product"):  # one fused kernel: its products, and q, k, v, o (and grads)
            q, k = args[0], args[1]
            products = 4 * q.numel() * k.shape[-2]  # Q K^T and P V, 2 B H Tq Tk d each
            self.cost.add(name, 2 * products if name.endswith("backward") else products,
                          _nbytes(args) + _nbytes(out))
        else:
            self.cost.add(name, 0, _nbytes(args) + _nbytes(kwargs or {}) + _nbytes(out))
        return out


def count(model: torch.nn.Module, input_ids: torch.Tensor, backward: bool = True,
          autocast: Optional[torch.dtype] = torch.bfloat16) -> Dict[str, Cost]:
    """{"forward": Cost, "backward": Cost} of one microbatch: OLMo's loss on the shifted tokens, under CPU autocast
    to ``autocast`` (None: none) as the recipes' amp_bf16 runs it. ``model`` and ``input_ids`` may be fake tensors."""
    with _Counter() as fwd, torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        logits = model(input_ids).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten())
    result = {"forward": fwd.cost}
    if backward:
        with _Counter() as bwd:
            loss.backward()
        result["backward"] = bwd.cost
    return result


def _fake_count(model_cfg, model_type: str, n_layers: int, microbatch: int, seq_len: int,
                autocast: Optional[torch.dtype]) -> Dict[str, Cost]:
    """count() on a model of fake tensors: shapes and dtypes only, no memory, no arithmetic."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .model import build_model

    cfg = dataclasses.replace(model_cfg, n_layers=n_layers, init_device="cpu")
    with FakeTensorMode(allow_non_fake_inputs=False):
        model = build_model(cfg, model_type, init_params=False)
        if autocast is not None:  # FSDP's mixed precision hands the blocks bf16 parameters: no per-step weight casts
            for param in model.parameters():
                param.data = param.data.to(autocast)
        ids = torch.zeros(microbatch, seq_len, dtype=torch.long)
        return count(model, ids, autocast=autocast)


def step_cost(model_cfg, model_type: str, microbatch: int, seq_len: Optional[int] = None,
              autocast: Optional[torch.dtype] = torch.bfloat16) -> Dict[str, Dict]:
    """{"step": {forward, backward}, "layer": {forward, backward}, "by_op"} for one microbatch: the whole model, and
    one layer (the whole model less a one-layer model, over the layers between: their mean where layers differ)."""
    seq_len = seq_len or model_cfg.max_sequence_length
    n = model_cfg.n_layers
    full = _fake_count(model_cfg, model_type, n, microbatch, seq_len, autocast)
    if n > 1:
        shorter = _fake_count(model_cfg, model_type, 1, microbatch, seq_len, autocast)
        layer = {k: (full[k] - shorter[k]).scaled(1 / (n - 1)) for k in full}
    else:
        layer = full
    return {"step": {k: v.summary() for k, v in full.items()}, "layer": {k: v.summary() for k, v in layer.items()},
            "by_op": {k: v.by_op for k, v in full.items()}}


def estimate_seconds(cost: Dict[str, int], device: str) -> float:
    """Time of ``cost`` (one pass) on ``device`` by the model in the module docstring."""
    spec = DEVICES[device]
    return (cost["matmul_flops"] / (spec["tflops"] * 1e12 * MATMUL_EFFICIENCY)
            + cost["bytes"] / (spec["gbps"] * 1e9 * BANDWIDTH_EFFICIENCY))


def total(costs: Dict[str, Dict[str, int]]) -> Dict[str, int]:
    """Forward plus backward."""
    return {k: costs["forward"][k] + costs.get("backward", {}).get(k, 0) for k in costs["forward"]}


def table(model_cfg, model_types, microbatch: int, seq_len: Optional[int] = None,
          autocast: Optional[torch.dtype] = torch.bfloat16) -> Dict:
    """Every model type's step and layer costs, and its estimated step time on each device as a ratio to pre's."""
    types = ["pre"] + [t for t in model_types if t != "pre"]
    costs = {mt: step_cost(model_cfg, mt, microbatch, seq_len, autocast) for mt in types}
    rows = {}
    for mt, c in costs.items():
        step, layer = total(c["step"]), total(c["layer"])
        rows[mt] = {"step": c["step"], "layer": c["layer"],
                    "layer_bytes_ratio": layer["bytes"] / total(costs["pre"]["layer"])["bytes"],
                    "layer_kernels_ratio": layer["kernels"] / total(costs["pre"]["layer"])["kernels"],
                    "time_ratio": {d: estimate_seconds(step, d) / estimate_seconds(total(costs["pre"]["step"]), d)
                                   for d in DEVICES}}
    return {"microbatch": microbatch, "seq_len": seq_len or model_cfg.max_sequence_length,
            "precision": str(autocast) if autocast is not None else "fp32", "n_layers": model_cfg.n_layers,
            "d_model": model_cfg.d_model, "rows": rows, "devices": DEVICES,
            "efficiency": {"matmul": MATMUL_EFFICIENCY, "bandwidth": BANDWIDTH_EFFICIENCY}}


def to_markdown(result: Dict) -> str:
    devices = list(result["devices"])
    head = ("| MODEL_TYPE | layer matmul TFLOP | layer GB moved | layer kernels | step GB | "
            + " | ".join(f"time vs pre, {d}" for d in devices) + " |")
    lines = [head, "| --- |" + " ---: |" * (4 + len(devices))]
    for mt, r in result["rows"].items():
        layer, step = total(r["layer"]), total(r["step"])
        lines.append(f"| {mt} | {layer['matmul_flops'] / 1e12:.2f} | {layer['bytes'] / 1e9:.1f} | {layer['kernels']} | "
                     f"{step['bytes'] / 1e9:.0f} | " + " | ".join(f"{r['time_ratio'][d]:.3f}" for d in devices) + " |")
    return "\n".join(lines)
