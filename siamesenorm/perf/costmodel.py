"""A device-independent cost model of one training step: what every aten op of the model reads, writes and
computes, counted on fake tensors (no memory, no data: the 1.3B recipe at its real microbatch in seconds on a CPU).

For one microbatch, forward and backward (the loss included, in fp32 as autocast runs it), per step and per layer:

- ``matmul_flops``: 2 x M x N x K of every matrix product (mm, addmm, bmm, baddbmm, and our ``rms_project`` ops,
  which are products inside); fused attention (SDPA) as its two products, 4 B H T^2 d forward and twice that
  backward, the causal mask not subtracted;
- ``bytes``: every op's tensor inputs plus outputs (what an unfused kernel reads and writes in HBM), the products'
  operands and results included (``matmul_bytes``: those of the mm / bmm products, which inductor also leaves
  to extern kernels: the compiled count reads the same bytes from its graph); an allocation
  (``empty``, ``new_empty``, ...) moves nothing and launches nothing, a fill (``zeros``, ``fill_``, ...) writes its
  output and reads nothing;
- ``kernels``: how many ops launch a kernel (views, which move nothing, are not counted);
- ``matmul_excess_s``: per device, the time by which memory-bound products (a product whose operands and result
  take longer to move than its FLOPs to compute: hc's and mhc's (tokens x n d) @ (n d x few) coefficients, a
  per-token stream sum as a bmm with N = 1) exceed their FLOP time: each product is charged max(FLOPs / peak,
  bytes / bandwidth), a roofline per op.

The model is built of fake tensors (torch's FakeTensorMode: shapes and dtypes, no storage) and run under CPU autocast
to bf16, as the recipes' ``precision: amp_bf16`` runs on a GPU: matmuls in bf16, OLMo's norms and the loss in fp32.
The estimated time on a device is ``matmul_flops / (peak x MATMUL_EFFICIENCY) + (bytes - matmul_bytes) /
(bandwidth x BANDWIDTH_EFFICIENCY) + matmul_excess_s``: the other ops' bytes at the bandwidth, each product at the
larger of its FLOP time and its byte time, with the devices' figures in ``DEVICES``; ratios to ``pre`` are what to
read (the efficiencies cancel to first order).

Eager counts what an unfused run launches. Compiled (``compiled_layer_cost``) reads what inductor itself fuses: a
middle block is compiled alone, as ``compile:`` compiles each block, and every kernel of its forward and backward
graphs is taken from inductor's scheduler with the buffers it reads and writes in memory. Inductor's CPU backend
lowers it here (no GPU, no Triton on these machines): the graph, its decompositions and the scheduler's fusion rules
are the ones its GPU backend uses, its code generator is not, so read compiled figures as what inductor's fusion
leaves to move, not as a Triton kernel's exact traffic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from olmo.exceptions import OLMoConfigurationError
from olmo.train import cross_entropy_loss
from torch.utils._python_dispatch import TorchDispatchMode

from siamesenorm.models.build import build_model
from siamesenorm.nn.loss import chunked_cross_entropy_loss

__all__ = ["DEVICES", "MATMUL_EFFICIENCY", "BANDWIDTH_EFFICIENCY", "Cost", "count", "step_cost", "bytes_above", "above_pre_markdown", "estimate_seconds",
           "total", "table", "to_markdown", "compiled_layer_cost", "with_compiled_blocks", "product_excess"]

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
#: Allocations: no kernel, no bytes (their input is only a shape and dtype template).
_ALLOCATIONS = {"empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided", "empty_permuted"}
#: Fills: one kernel writing its output, reading nothing (an in-place fill's "input" is the tensor it overwrites).
_FILLS = {"zeros", "zeros_like", "new_zeros", "ones", "ones_like", "new_ones", "full", "full_like", "new_full",
          "zero_", "fill_", "fill", "scalar_tensor"}
_MATMUL = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.baddbmm.default}
#: Our fused ops that are matrix products inside (siamesenorm/nn/fused.py ``rms_project``: x (..., N) against an
#: (N, K) matrix, each way): their FLOPs, 2 x rows x N x K, charged by the roofline as the products they replace.
#: The width ops (``hc_width``, ``mhc_width``) hold the same projection and the branch input's weighted sum of the
#: streams (a product of N = n, 2 FLOPs an element of h; backward two: the weights' and the streams' gradients).
_CUSTOM_PRODUCTS = {"project_forward": lambda x, wp, *_: 2 * x.numel() * wp.shape[-1],
                    "project_backward_x": lambda x, wp, *_: 2 * x.numel() * wp.shape[-1],
                    "project_backward_w": lambda x, rstd, dlog: 2 * x.numel() * dlog.shape[-1],
                    "width_forward": lambda h, wp, *_: 2 * h.numel() * (wp.shape[-1] + 1),
                    "width_backward": lambda h, wp, *_: 2 * h.numel() * (wp.shape[-1] + 2)}


def product_excess(flops: int, nbytes: int) -> Dict[str, float]:
    """Per device, the seconds by which one product's bytes at the bandwidth exceed its FLOPs at the matmul rate
    (0 for a compute-bound product): what the roofline max(FLOP time, byte time) adds to the FLOP time."""
    return {d: max(0.0, nbytes / (spec["gbps"] * 1e9 * BANDWIDTH_EFFICIENCY)
                   - flops / (spec["tflops"] * 1e12 * MATMUL_EFFICIENCY)) for d, spec in DEVICES.items()}


@dataclass
class Cost:
    matmul_flops: int = 0
    bytes: int = 0
    kernels: int = 0
    matmul_bytes: int = 0  # of ``bytes``: the mm / bmm products' operands and results
    matmul_excess_s: Dict[str, float] = field(default_factory=lambda: {d: 0.0 for d in DEVICES})
    by_op: Dict[str, list] = field(default_factory=dict)  # op name -> [kernels, bytes, flops]
    excess_by_op: Dict[str, Dict[str, float]] = field(default_factory=dict)  # product name -> device -> seconds
    kernel_list: List[Tuple[str, int]] = field(default_factory=list)  # (label, bytes) of each kernel, in order

    def add(self, name: str, flops: int, nbytes: int, product: bool = False, label: Optional[str] = None) -> None:
        """One kernel; ``product``: a matrix product, charged by the roofline (fused attention keeps the sum of its
        FLOP time and byte time, as before: compute-bound at the recipes' sequence lengths, its bytes a small term).
        ``label``: what ``kernel_list`` calls it (default ``name``; an inductor kernel, the ops fused into it)."""
        self.kernel_list.append((label or name, nbytes))
        self.matmul_flops += flops
        self.bytes += nbytes
        self.kernels += 1
        if product:
            self.matmul_bytes += nbytes
            row_excess = self.excess_by_op.setdefault(name, {d: 0.0 for d in DEVICES})
            for device, seconds in product_excess(flops, nbytes).items():
                self.matmul_excess_s[device] += seconds
                row_excess[device] += seconds
        row = self.by_op.setdefault(name, [0, 0, 0])
        row[0] += 1
        row[1] += nbytes
        row[2] += flops

    def __sub__(self, other: "Cost") -> "Cost":
        return Cost(self.matmul_flops - other.matmul_flops, self.bytes - other.bytes, self.kernels - other.kernels,
                    self.matmul_bytes - other.matmul_bytes,
                    {d: self.matmul_excess_s[d] - other.matmul_excess_s[d] for d in self.matmul_excess_s})

    def scaled(self, factor: float) -> "Cost":
        return Cost(int(self.matmul_flops * factor), int(self.bytes * factor), int(round(self.kernels * factor)),
                    int(self.matmul_bytes * factor), {d: v * factor for d, v in self.matmul_excess_s.items()})

    def summary(self) -> Dict:
        return {"matmul_flops": self.matmul_flops, "bytes": self.bytes, "kernels": self.kernels,
                "matmul_bytes": self.matmul_bytes, "matmul_excess_s": dict(self.matmul_excess_s)}


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
        if func.is_view or name in _NOT_KERNELS or name in _ALLOCATIONS or not any(True for _ in _tensors(out)):
            return out  # aliases, allocations, and queries (sizes, devices) that move no data
        if func in _MATMUL:  # operands (and addmm's bias) read, the result written; roofline per product
            a, b = (args[1], args[2]) if func in (torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default) \
                else (args[0], args[1])
            flops = 2 * a.numel() * b.shape[-1]  # (..., M, K) @ (..., K, N): 2 M N K per batch
            self.cost.add(name, flops, _nbytes(args) + _nbytes(out), product=True)
        elif name.startswith("_scaled_dot_product"):  # one fused kernel: its products, and q, k, v, o (and grads)
            q, k = args[0], args[1]
            products = 4 * q.numel() * k.shape[-2]  # Q K^T and P V, 2 B H Tq Tk d each
            self.cost.add(name, 2 * products if name.endswith("backward") else products,
                          _nbytes(args) + _nbytes(out))
        elif name in _CUSTOM_PRODUCTS:
            self.cost.add(name, _CUSTOM_PRODUCTS[name](*args), _nbytes(args) + _nbytes(out), product=True)
        elif name in _FILLS:
            self.cost.add(name, 0, _nbytes(out))
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
    """{"step": {forward, backward}, "layer": {forward, backward}, "by_op"} for one microbatch, eager: the whole
    model, and one layer: a middle block (a 3-layer model less a 2-layer one: the first block widens the embedding
    and the last fuses the streams, so a middle block is what the other layers cost); with fewer than 3 layers, the
    whole model less a one-layer model, over the layers between; where no such smaller model can be built (Block
    AttnRes, whose blocks must divide the layers), the step's average layer (``layer_is_average``)."""
    seq_len = seq_len or model_cfg.max_sequence_length
    n = model_cfg.n_layers
    full = _fake_count(model_cfg, model_type, n, microbatch, seq_len, autocast)
    try:
        return _with_layer(full, model_cfg, model_type, n, microbatch, seq_len, autocast)
    except OLMoConfigurationError:  # no 3- or 2-layer model of this config (Block AttnRes: N blocks need N | layers)
        layer = {k: v.scaled(1.0 / n) for k, v in full.items()}
        return {"step": {k: v.summary() for k, v in full.items()}, "layer": {k: v.summary() for k, v in layer.items()},
                "by_op": {k: v.by_op for k, v in full.items()},
                "layer_by_op": {k: _by_op_difference(v.by_op, {}, 1.0 / n) for k, v in full.items()},
                "layer_excess_by_op": {k: _excess_difference(v.excess_by_op, {}, 1.0 / n) for k, v in full.items()},
                "layer_is_average": True}


def _by_op_difference(a: Dict[str, list], b: Dict[str, list], scale: float = 1.0) -> Dict[str, list]:
    """{op: [kernels, bytes, flops]} of ``a`` less ``b``, times ``scale``; ops that cancel are left out."""
    out = {}
    for op in sorted(set(a) | set(b)):
        row = [(x - y) * scale for x, y in zip(a.get(op, [0, 0, 0]), b.get(op, [0, 0, 0]))]
        if any(row):
            out[op] = row
    return out


def _excess_difference(a: Dict[str, Dict[str, float]], b: Dict[str, Dict[str, float]],
                       scale: float = 1.0) -> Dict[str, Dict[str, float]]:
    """{product name: {device: roofline excess seconds}} of ``a`` less ``b``, times ``scale``."""
    return {op: {d: (a.get(op, {}).get(d, 0.0) - b.get(op, {}).get(d, 0.0)) * scale for d in DEVICES}
            for op in sorted(set(a) | set(b))}


def _with_layer(full, model_cfg, model_type, n, microbatch, seq_len, autocast) -> Dict[str, Dict]:
    if n >= 3:
        three = full if n == 3 else _fake_count(model_cfg, model_type, 3, microbatch, seq_len, autocast)
        base = _fake_count(model_cfg, model_type, 2, microbatch, seq_len, autocast)
    elif n == 2:
        three, base = full, _fake_count(model_cfg, model_type, 1, microbatch, seq_len, autocast)
    else:
        three, base = full, {k: Cost() for k in full}
    layer = {k: three[k] - base[k] for k in full}
    return {"step": {k: v.summary() for k, v in full.items()}, "layer": {k: v.summary() for k, v in layer.items()},
            "by_op": {k: v.by_op for k, v in full.items()},
            "layer_by_op": {k: _by_op_difference(three[k].by_op, base[k].by_op) for k in full},
            "layer_excess_by_op": {k: _excess_difference(three[k].excess_by_op, base[k].excess_by_op) for k in full}}


def bytes_above(layer_by_op: Dict[str, Dict[str, list]], base_by_op: Dict[str, Dict[str, list]],
                pass_bytes: int) -> Dict:
    """Where one eager layer of a variant moves more bytes than a layer of the base (pre): per op, forward and
    backward summed, the extra bytes and kernels, largest first, and each in ``pass_bytes`` units (one read or write
    of a (B, T, d) tensor in bf16: the unit the floor is stated in). Ops the base moves more of come out negative."""
    ops: Dict[str, list] = {}
    for phase in ("forward", "backward"):
        for op, (kernels, nbytes, _) in _by_op_difference(layer_by_op.get(phase, {}),
                                                          base_by_op.get(phase, {})).items():
            row = ops.setdefault(op, [0, 0])
            row[0] += kernels
            row[1] += nbytes
    rows = sorted(({"op": op, "kernels": k, "bytes": b, "passes": b / pass_bytes} for op, (k, b) in ops.items()
                   if b or k), key=lambda r: -abs(r["bytes"]))
    extra = sum(r["bytes"] for r in rows)
    return {"bytes": extra, "passes": extra / pass_bytes, "kernels": sum(r["kernels"] for r in rows), "ops": rows}


def with_compiled_blocks(eager: Dict, compiled_layer: Dict[str, Dict[str, int]], n_layers: int) -> Dict:
    """A step's and a layer's cost with every block compiled: each of the ``n_layers`` blocks costs the compiled
    middle block's bytes and kernels instead of the eager one's (the first block's widening and the last block's
    stream fusion, outside a middle block, stay counted eager, as do the embedding, final norm and loss, which
    ``compile:`` leaves eager); matmul FLOPs are unchanged."""
    layer, step = {}, {}
    for phase in ("forward", "backward"):
        e_layer, c_layer = eager["layer"][phase], compiled_layer[phase]
        # the products inductor left to extern kernels, their bytes as it scheduled them (a product it lowered
        # into a fused kernel is in that kernel's bytes, moved at the bandwidth there)
        layer[phase] = {"matmul_flops": e_layer["matmul_flops"], "bytes": c_layer["bytes"],
                        "kernels": c_layer["kernels"], "matmul_bytes": c_layer.get("matmul_bytes", 0),
                        "matmul_excess_s": _compiled_excess(eager, phase, c_layer)}
        step[phase] = {k: eager["step"][phase].get(k, 0) + n_layers * (layer[phase][k] - e_layer.get(k, 0))
                       for k in ("matmul_flops", "bytes", "kernels", "matmul_bytes")}
        step[phase]["matmul_excess_s"] = {
            d: v + n_layers * (layer[phase]["matmul_excess_s"].get(d, 0.0) - e_layer.get("matmul_excess_s", {}).get(d, 0.0))
            for d, v in eager["step"][phase].get("matmul_excess_s", {}).items()}
    return {"step": step, "layer": layer}


def _compiled_excess(eager: Dict, phase: str, c_layer: Dict) -> Dict[str, float]:
    """The compiled layer's roofline excess: each eager product kind's (mm, bmm, ``rms_project``'s ops) in the
    share of its kernels that inductor left extern (``extern_products``); a product it lowered into one of its own
    kernels has its bytes counted there, at the bandwidth, and no excess on top. Where one kind mixes compute-bound
    and memory-bound products (mm: the weights' and hc's coefficients'), the share is of the kind's whole excess.
    Without the per-kind counts (an older result), the eager layer's excess whole: an upper bound."""
    whole = dict(eager["layer"][phase].get("matmul_excess_s", {}))
    by_op, extern = eager.get("layer_excess_by_op", {}).get(phase), c_layer.get("extern_products")
    if by_op is None or extern is None:
        return whole
    counts = eager.get("layer_by_op", {}).get(phase, {})
    out = {d: 0.0 for d in whole}
    for name, seconds in by_op.items():
        launched = counts.get(name, [0])[0]
        kept = min(1.0, extern.get(name, 0) / launched) if launched > 0 else 0.0
        for d in out:
            out[d] += seconds.get(d, 0.0) * kept
    return out


def estimate_seconds(cost: Dict[str, int], device: str) -> float:
    """Time of ``cost`` (one pass) on ``device`` by the model in the module docstring."""
    spec = DEVICES[device]
    return (cost["matmul_flops"] / (spec["tflops"] * 1e12 * MATMUL_EFFICIENCY)
            + (cost["bytes"] - cost.get("matmul_bytes", 0)) / (spec["gbps"] * 1e9 * BANDWIDTH_EFFICIENCY)
            + cost.get("matmul_excess_s", {}).get(device, 0.0))


def total(costs: Dict[str, Dict]) -> Dict:
    """Forward plus backward."""
    out = {}
    for k, v in costs["forward"].items():
        other = costs.get("backward", {}).get(k)
        if isinstance(v, dict):
            out[k] = {d: v[d] + (other or {}).get(d, 0.0) for d in v}
        else:
            out[k] = v + (other or 0)
    return out


def table(model_cfg, model_types, microbatch: int, seq_len: Optional[int] = None,
          autocast: Optional[torch.dtype] = torch.bfloat16, compiled: bool = False, progress=None) -> Dict:
    """Every model type's step and layer costs, eager (and with compiled blocks when ``compiled``), and its estimated
    step time on each device as a ratio to pre's of the same mode. ``progress(model_type)`` is called before each."""
    types = ["pre"] + [t for t in model_types if t != "pre"]
    modes = ("eager", "compiled") if compiled else ("eager",)
    costs = {}
    for mt in types:
        if progress is not None:
            progress(mt)
        eager = step_cost(model_cfg, mt, microbatch, seq_len, autocast)
        costs[mt] = {"eager": eager}
        if compiled:
            costs[mt]["compiled"] = with_compiled_blocks(
                eager, compiled_layer_cost(model_cfg, mt, microbatch, seq_len), model_cfg.n_layers)
    rows = {}
    for mt, by_mode in costs.items():
        rows[mt] = {}
        for mode in modes:
            c, base = by_mode[mode], costs["pre"][mode]
            step, layer = total(c["step"]), total(c["layer"])
            rows[mt][mode] = {
                "step": c["step"], "layer": c["layer"],
                "layer_bytes_ratio": layer["bytes"] / total(base["layer"])["bytes"],
                "layer_kernels_ratio": layer["kernels"] / total(base["layer"])["kernels"],
                "time_ratio": {d: estimate_seconds(step, d) / estimate_seconds(total(base["step"]), d)
                               for d in DEVICES}}
        pass_bytes = microbatch * (seq_len or model_cfg.max_sequence_length) * model_cfg.d_model * 2
        rows[mt]["eager"]["above_pre"] = bytes_above(by_mode["eager"]["layer_by_op"],
                                                     costs["pre"]["eager"]["layer_by_op"], pass_bytes)
    return {"microbatch": microbatch, "seq_len": seq_len or model_cfg.max_sequence_length,
            "precision": str(autocast) if autocast is not None else "fp32", "n_layers": model_cfg.n_layers,
            "d_model": model_cfg.d_model, "recompute": bool(model_cfg.recompute_cheap),
            "fused": bool(model_cfg.fused_streams), "modes": list(modes), "rows": rows, "devices": DEVICES,
            "efficiency": {"matmul": MATMUL_EFFICIENCY, "bandwidth": BANDWIDTH_EFFICIENCY}}


def to_markdown(result: Dict, mode: str = "eager") -> str:
    devices = list(result["devices"])
    head = ("| MODEL_TYPE | layer matmul TFLOP | layer GB moved | layer kernels | step GB | "
            + " | ".join(f"time vs pre, {d}" for d in devices) + " |")
    lines = [head, "| --- |" + " ---: |" * (4 + len(devices))]
    for mt, by_mode in result["rows"].items():
        r = by_mode[mode]
        layer, step = total(r["layer"]), total(r["step"])
        lines.append(f"| {mt} | {layer['matmul_flops'] / 1e12:.2f} | {layer['bytes'] / 1e9:.1f} | {layer['kernels']} | "
                     f"{step['bytes'] / 1e9:.0f} | " + " | ".join(f"{r['time_ratio'][d]:.3f}" for d in devices) + " |")
    return "\n".join(lines)


def combined_markdown(results: List[Dict], devices: Sequence[str] = ("h100-80gb", "a100-80gb")) -> str:
    """One table of step time against pre from several ``table`` results (the JSON files of ``--cost-model``): a
    column per mode (eager, compiled), fused flag and device, each against the ``pre`` of its own result, mode and
    flag; where two results hold the same column for a MODEL_TYPE, the first given wins. Rows in the order first
    seen; an empty cell where no result counted that MODEL_TYPE so."""
    columns: List[Tuple[str, bool]] = []
    cells: Dict[Tuple[str, str, bool], Dict[str, float]] = {}
    order: List[str] = []
    for result in results:
        fused = bool(result.get("fused"))
        for mode in result["modes"]:
            if (mode, fused) not in columns:
                columns.append((mode, fused))
            for mt, by_mode in result["rows"].items():
                if mt not in order:
                    order.append(mt)
                if mode in by_mode:
                    cells.setdefault((mt, mode, fused), by_mode[mode]["time_ratio"])
    columns.sort(key=lambda c: (c[1], c[0] != "eager"))
    names = [f"{mode}{' + fused' if fused else ''}, {d}" for mode, fused in columns for d in devices]
    lines = ["| MODEL_TYPE | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]
    for mt in order:
        row = [f"{cells[(mt, mode, fused)][d]:.3f}" if (mt, mode, fused) in cells else ""
               for mode, fused in columns for d in devices]
        lines.append(f"| {mt} | " + " | ".join(row) + " |")
    return "\n".join(lines)


# ---- compiled blocks ---------------------------------------------------------------------------------------------
#: Extern kernels that are matrix products (their FLOPs are the eager count's; their bytes are not non-matmul traffic).
_EXTERN_MATMULS = ("mm", "addmm", "bmm", "baddbmm")


def _scheduled_cost(nodes) -> Cost:
    """Cost of one compiled graph from inductor's scheduler: every fused kernel's reads and writes (the buffers it
    takes from and leaves in memory, not what stays in registers), extern kernels as eager ops, no-op nodes free."""
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode

    cost = Cost()
    for node in nodes:
        if isinstance(node, NopKernelSchedulerNode):
            continue
        if isinstance(node, ExternKernelSchedulerNode):
            kernel = getattr(node.node, "python_kernel_name", None) or ""
            if not kernel:
                continue  # MultiOutput and the like: views of an extern kernel's result, no launch
            name = kernel.rsplit(".", 1)[-1] if not kernel.endswith(".default") else kernel.rsplit(".", 2)[-2]
            if name in _EXTERN_MATMULS or name in _CUSTOM_PRODUCTS:  # its operands and result; its FLOPs (and
                # roofline) are the eager count's
                nbytes = node.get_read_write_buffers_sizes()
                cost.add(name, 0, nbytes)
                cost.matmul_bytes += nbytes
                continue
            cost.add(name, 0, node.get_read_write_buffers_sizes())
        else:
            cost.add("fused", 0, node.get_read_write_buffers_sizes(), label=_fused_label(node))
    return cost


def _fused_label(node) -> str:
    """An inductor kernel named by the ops fused into it: "fused(add, mean, mul, ...)" (aten's and our ops' short
    names, from the FX nodes each scheduler node was lowered from)."""
    names = set()
    for part in node.get_nodes():
        for origin in getattr(part.node, "origins", None) or ():
            target = str(getattr(origin, "target", ""))
            names.add(target.split(".")[-2] if target.endswith((".default", ".Tensor", ".Scalar", ".dim", ".int",
                                                                     ".dim_IntList", ".Tensor_Scalar")) else target)
    names.discard("")
    return "fused(" + ", ".join(sorted(names)) + ")"


@contextlib.contextmanager
def _recording_inductor_graphs(graphs: list):
    """Within: every graph inductor lowers appends (is_backward, its Cost) to ``graphs``. Inductor's
    FX-graph and AOT-autograd caches are off, so every compile is lowered and seen."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V

    original = GraphLowering.codegen

    def codegen(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        with V.set_graph_handler(self):  # the buffers' sizes are looked up in the graph being lowered
            graphs.append((bool(getattr(self, "is_backward", False)), _scheduled_cost(self.scheduler.nodes)))
        return out

    GraphLowering.codegen = codegen
    try:
        # caches off (a cached graph is not lowered); scalar C++ kernels: the same fusion, compiled faster
        with inductor_config.patch(fx_graph_cache=False, compile_threads=1, **{"cpp.simdlen": 1}), \
                functorch_config.patch(enable_autograd_cache=False):
            yield graphs
    finally:
        GraphLowering.codegen = original


def _compiled_middle_block(model_cfg, model_type: str, tokens: int, index: int = 1) -> Dict[str, Cost]:
    """{"forward", "backward"} Cost of one middle block (layer 1 of 3: the first block widens the embedding into the
    streams and the last fuses them; ``index`` 0 or 2 for those) compiled alone by inductor, as ``compile:`` compiles
    each block, and run forward and backward on one sequence of ``tokens`` tokens at the recipe's width, bf16
    parameters under CPU autocast to bf16 (the parameters' values do not matter: only the graphs are read)."""
    import torch._dynamo

    cfg = dataclasses.replace(model_cfg, n_layers=3, init_device="cpu", max_sequence_length=max(tokens, 1))
    block = build_model(cfg, model_type, init_params=False).transformer.blocks[index]
    with torch.no_grad():
        for param in block.parameters():
            param.data = torch.randn(param.shape, dtype=torch.bfloat16) * 0.02 + (1 if param.ndim == 1 else 0)
    torch._dynamo.reset()
    block.compile(fullgraph=True, dynamic=False)
    width = cfg.d_model * getattr(block, "n_streams", 1)
    x = torch.randn(1, tokens, width, dtype=torch.bfloat16, requires_grad=True)
    graphs: list = []
    with _recording_inductor_graphs(graphs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = block(x)[0]
        out.backward(torch.randn_like(out))
    torch._dynamo.reset()
    if [backward for backward, _ in graphs] != [False, True]:
        raise RuntimeError(f"{model_type}: expected one forward and one backward graph from the compiled block, got "
                           f"{[('backward' if b else 'forward') for b, _ in graphs]} (a graph break?)")
    return {("backward" if backward else "forward"): cost for backward, cost in graphs}


def compiled_layer_cost(model_cfg, model_type: str, microbatch: int, seq_len: Optional[int] = None,
                        sample_tokens=(64, 128)) -> Dict[str, Dict[str, int]]:
    """{"forward", "backward"} cost of one middle layer with the block compiled by inductor, at ``microbatch`` x
    ``seq_len`` tokens: inductor's own fusion of the block's forward and backward graphs, read from its scheduler
    (each fused kernel's read and write buffers), lowered by inductor's CPU backend on two small token counts and
    carried linearly to the real count (every non-matmul buffer of a block is per token or per feature; the two
    samples' kernel counts must agree, so the fusion does not change with size). Matmul FLOPs are not recounted:
    they are the eager count's."""
    seq_len = seq_len or model_cfg.max_sequence_length
    real = microbatch * seq_len
    t1, t2 = sample_tokens
    a, b = (_compiled_middle_block(model_cfg, model_type, t) for t in (t1, t2))
    result = {}
    for phase in ("forward", "backward"):
        if a[phase].kernels != b[phase].kernels:
            raise RuntimeError(f"{model_type} {phase}: inductor fused {t1} and {t2} tokens into different kernel counts "
                               f"({a[phase].kernels}, {b[phase].kernels}); carry from larger samples")
        per_token = (b[phase].bytes - a[phase].bytes) / (t2 - t1)
        products = (b[phase].matmul_bytes - a[phase].matmul_bytes) / (t2 - t1)
        result[phase] = {"matmul_flops": 0, "bytes": int(round(a[phase].bytes + per_token * (real - t1))),
                         "kernels": a[phase].kernels,
                         "matmul_bytes": int(round(a[phase].matmul_bytes + products * (real - t1))),
                         "extern_products": {name: row[0] for name, row in a[phase].by_op.items()
                                             if name in _EXTERN_MATMULS or name in _CUSTOM_PRODUCTS}}
    return result


# ---- memory per GPU ------------------------------------------------------------------------------------------------
#: Left free of a GPU's memory for the CUDA context, NCCL buffers and the caching allocator's fragmentation.
MEMORY_HEADROOM = 0.10


def _fake_saved_bytes(model_cfg, model_type: str, n_layers: int, microbatch: int, seq_len: int,
                      recompute: bool, loss_chunk_tokens: Optional[int]) -> int:
    """Bytes autograd keeps for backward after one forward and loss (bf16 parameters, bf16 autocast, fake tensors):
    distinct storages, the parameters' left out, as OLMo's trainer computes the loss (the shifted logits copied)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = dataclasses.replace(model_cfg, n_layers=n_layers, init_device="cpu", recompute_cheap=recompute)
    with FakeTensorMode(allow_non_fake_inputs=False):
        model = build_model(cfg, model_type, init_params=False)
        for param in model.parameters():
            param.data = param.data.to(torch.bfloat16)
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        kept: Dict[int, torch.Tensor] = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage._cdata not in params:
                kept.setdefault(storage._cdata, t)  # held, so that no freed storage's address is reused
            return t

        ids = torch.zeros(microbatch, seq_len, dtype=torch.long)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids).logits
            flat = logits[:, :-1].contiguous().view(-1, logits.shape[-1])
            labels = ids[:, 1:].reshape(-1)
            if loss_chunk_tokens:
                chunked_cross_entropy_loss(flat, labels, reduction="sum", chunk_tokens=loss_chunk_tokens)
            else:
                cross_entropy_loss(flat, labels, reduction="sum")
        return sum(t.untyped_storage().nbytes() for t in kept.values())


def memory_per_gpu(model_cfg, model_type: str, microbatch: int, seq_len: Optional[int] = None, gpus: int = 8,
                   recompute: bool = True, loss_chunk_tokens: Optional[int] = None) -> Dict[str, float]:
    """GiB per GPU of one training step under FSDP full shard over ``gpus`` GPUs, bf16 mixed precision, AdamW,
    by parts (a model, not a measurement):

    - ``state``: fp32 parameters, gradients and AdamW's two moments, sharded: 16 bytes x parameters / gpus;
    - ``gathered``: bf16 parameters and gradients of the two largest FSDP units held whole at once (the unit being
      computed and the one prefetched): 4 bytes x their parameters;
    - ``activations``: what autograd keeps after the forward and loss (counted on fake tensors, eager, with
      ``recompute`` as model.recompute_cheap sets it), and ``activations_checkpointed`` with OLMo's
      ``activation_checkpointing: whole_layer`` (each block keeps its input; one block's activations are rebuilt
      at a time, the loss's kept as they are);
    - ``loss_backward``: the largest transient at the start of backward, the logits' gradient: fp32 gradient of
      the log-softmax, its input's and the bf16 logits' (10 bytes x tokens x vocabulary), or with
      ``loss_chunk_tokens`` the bf16 gradient plus one chunk's fp32 ones.
    """
    seq_len = seq_len or model_cfg.max_sequence_length
    n = model_cfg.n_layers
    tokens = microbatch * seq_len
    vocab = model_cfg.embedding_size or model_cfg.vocab_size
    saved = functools.partial(_fake_saved_bytes, model_cfg, model_type, microbatch=microbatch, seq_len=seq_len,
                              recompute=recompute, loss_chunk_tokens=loss_chunk_tokens)
    total = saved(n_layers=n)
    block = saved(n_layers=3) - saved(n_layers=2)  # one middle block
    outside = total - n * block  # embedding, loss and what the first and last blocks add
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = build_model(dataclasses.replace(model_cfg, init_device="cpu"), model_type, init_params=False)
        n_params = sum(p.numel() for p in model.parameters())
        units = sorted([sum(p.numel() for p in b.parameters()) for b in model.transformer.blocks]
                       + [model.transformer.wte.weight.numel()], reverse=True)
        streams = getattr(model.transformer.blocks[1 if n > 1 else 0], "n_streams", 1)
    block_input = tokens * model_cfg.d_model * streams * 2  # bf16
    gib = 1024 ** 3
    loss_backward = (tokens * vocab * 10 if not loss_chunk_tokens
                     else tokens * vocab * 2 + min(loss_chunk_tokens, tokens) * vocab * 8)
    parts = {"state": 16 * n_params / gpus, "gathered": 4 * sum(units[:2]), "activations": total,
             "activations_checkpointed": outside + n * block_input + block, "loss_backward": loss_backward}
    result = {k: v / gib for k, v in parts.items()}
    fixed = result["state"] + result["gathered"] + result["loss_backward"]
    result["peak"] = fixed + result["activations"]
    result["peak_checkpointed"] = fixed + result["activations_checkpointed"]
    result["parameters"] = n_params
    return result


def fits(peak_gib: float, device: str) -> bool:
    """Whether ``peak_gib`` fits ``device`` with MEMORY_HEADROOM left free."""
    return peak_gib <= DEVICES[device]["memory_gib"] * (1 - MEMORY_HEADROOM)


def memory_table(model_cfg, model_types, microbatch: int, seq_len: Optional[int] = None, gpus: int = 8,
                 loss_chunk_tokens: Optional[int] = None) -> Dict:
    """memory_per_gpu for every model type with recompute on and off, and which devices each peak fits."""
    types = ["pre"] + [t for t in model_types if t != "pre"]
    rows = {}
    for mt in types:
        rows[mt] = {("recompute" if on else "no_recompute"): memory_per_gpu(
            model_cfg, mt, microbatch, seq_len, gpus, recompute=on, loss_chunk_tokens=loss_chunk_tokens)
            for on in (True, False)}
    return {"microbatch": microbatch, "seq_len": seq_len or model_cfg.max_sequence_length, "gpus": gpus,
            "loss_chunk_tokens": loss_chunk_tokens, "headroom": MEMORY_HEADROOM, "rows": rows,
            "devices": {d: DEVICES[d]["memory_gib"] for d in DEVICES}}


def memory_markdown(result: Dict, devices=("a100-40gb", "a100-80gb", "h100-80gb")) -> str:
    def where(peak):
        return ", ".join(d for d in devices if fits(peak, d)) or "none"

    lines = ["| MODEL_TYPE | activations GiB, recompute on / off | peak GiB, recompute on / off | fits (recompute on) "
             "| fits (recompute off) | peak GiB, whole-layer checkpointing | fits (checkpointing) |",
             "| --- | ---: | ---: | --- | --- | ---: | --- |"]
    for mt, r in result["rows"].items():
        on, off = r["recompute"], r["no_recompute"]
        lines.append(f"| {mt} | {on['activations']:.1f} / {off['activations']:.1f} | {on['peak']:.1f} / "
                     f"{off['peak']:.1f} | {where(on['peak'])} | {where(off['peak'])} | "
                     f"{on['peak_checkpointed']:.1f} | {where(on['peak_checkpointed'])} |")
    return "\n".join(lines)


def above_pre_markdown(result: Dict, top: int = 6) -> str:
    """Per MODEL_TYPE, what one eager layer moves beyond pre's (bytes_above), its largest ops."""
    lines = ["| MODEL_TYPE | layer GB above pre | as (B, T, d) bf16 passes | kernels above pre | largest ops (GB, passes) |",
             "| --- | ---: | ---: | ---: | --- |"]
    for mt, by_mode in result["rows"].items():
        above = by_mode["eager"].get("above_pre")
        if mt == "pre" or above is None:
            continue
        ops = ", ".join(f"{r['op']} {r['bytes'] / 1e9:+.2f} ({r['passes']:+.0f})" for r in above["ops"][:top])
        lines.append(f"| {mt} | {above['bytes'] / 1e9:+.2f} | {above['passes']:+.1f} | {above['kernels']:+.0f} | "
                     f"{ops} |")
    return "\n".join(lines)
