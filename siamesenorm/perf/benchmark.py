"""What each MODEL_TYPE costs, as a ratio to Pre-Norm measured in the same process (scripts/benchmark.py).

For one recipe (its model; optionally fewer layers, another width, batch or sequence length) and a list of
MODEL_TYPEs, eager and with each block compiled (as training does with ``compile:`` in a config), it measures:

- step time: one training step (forward, backward, AdamW step, zero_grad) timed with ``torch.utils.benchmark``;
  the variants are interleaved and each is timed ``repeats`` times, and the median and the spread (min to max)
  are reported, so that a drift of the machine hits every variant alike; tokens/s = tokens per step / median;
- activation memory: the bytes of the distinct tensors autograd saves for backward in one forward
  (``torch.autograd.graph.saved_tensors_hooks``; storages counted once; parameters, which are saved too but are
  not activations, left out). With compiled blocks this counts what the compiled graphs save;
- parameters; FLOPs per token of forward + backward (``torch.utils.flop_counter``, the matmuls and attention);
- on CUDA also the peak allocated memory of a step and the model FLOPs utilisation against the device's peak.

Ratios divide by ``pre`` of the same mode (eager by eager, compiled by compiled).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import re
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch.autograd import DeviceType

from siamesenorm.models.build import build_model
from siamesenorm.nn import fused
from siamesenorm.perf.costmodel import estimate_seconds, total
from siamesenorm.run.process import allow_recompiles
from siamesenorm.run.recipe import load_config
from siamesenorm.variants._base import set_recompute

__all__ = ["BenchSettings", "autocast_dtype", "model_config", "activation_bytes", "activation_breakdown", "flops_per_token", "run",
           "to_markdown", "breakdown_markdown"]

#: Dense bf16 peak FLOP/s by device name (the vendors' datasheets, without sparsity), for MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "A10G": 125e12, "L4": 121e12, "V100": 125e12}


@dataclasses.dataclass
class BenchSettings:
    recipe: str = "configs/tiny-cpu.yaml"
    model_types: Sequence[str] = ("pre", "hybrid_pre")
    layers: Optional[int] = None
    d_model: Optional[int] = None
    vocab: Optional[int] = None
    batch: int = 4
    seq: int = 256
    repeats: int = 7
    steps_per_timing: int = 2
    modes: Sequence[str] = ("eager", "compiled")
    group_size: int = 0  # variants held in memory at once besides pre (0: all); each group has its own pre
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    seed: int = 0
    recompute: Optional[bool] = None  # model.recompute_cheap; None: the recipe's
    fused: Optional[bool] = None  # model.fused_streams; None: the recipe's
    # "bf16" (autocast, as OLMo's amp_bf16 trains) or "fp32"; None: on a GPU the recipe's precision, on a CPU fp32
    # (the CPU figures here were measured so, and a CPU trains the tiny recipes in fp32)
    precision: Optional[str] = None
    # recipe fields changed, as the training command's --KEY=VALUE without the dashes (e.g. model.siamese_mixing=
    # dynamic), applied to every variant timed, pre included
    overrides: Sequence[str] = ()


def autocast_dtype(settings: BenchSettings) -> Optional[torch.dtype]:
    """The dtype a timed step's forward autocasts to (None: none, fp32)."""
    precision = settings.precision
    if precision is None:
        precision = "fp32" if settings.device == "cpu" else \
            {"amp_bf16": "bf16"}.get(str(load_config(settings.recipe).precision), "fp32")
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision {precision!r}: use bf16 or fp32")
    return torch.bfloat16 if precision == "bf16" else None


def model_config(settings: BenchSettings):
    """The recipe's model config with the benchmark's cuts and overrides applied (fewer layers, another width, the
    sequence, ``overrides``)."""
    cfg = load_config(settings.recipe, [f"--{kv.lstrip('-')}" for kv in settings.overrides]).model
    if settings.layers is not None:
        cfg.n_layers = settings.layers
    if settings.d_model is not None:
        cfg.d_model = settings.d_model
    if settings.vocab is not None:
        cfg.vocab_size = cfg.embedding_size = settings.vocab
        cfg.eos_token_id, cfg.pad_token_id = 0, min(cfg.pad_token_id, settings.vocab - 1)
    if settings.recompute is not None:
        cfg.recompute_cheap = settings.recompute
    if settings.fused is not None:
        cfg.fused_streams = settings.fused
    cfg.max_sequence_length = max(cfg.max_sequence_length, settings.seq)
    cfg.init_device = settings.device
    cfg.flash_attention = False
    return cfg


def _parameter_storages(model: torch.nn.Module) -> set:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def activation_bytes(model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct non-parameter tensors autograd saves for backward while ``loss_fn()`` runs forward
    (storages counted once, at their full size); backward is run afterwards to free them."""
    params = _parameter_storages(model)
    seen: Dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr != 0:
            seen[ptr] = max(seen.get(ptr, 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn()
    total = sum(seen.values())
    loss.backward()
    model.zero_grad(set_to_none=True)
    return total


def activation_breakdown(model: torch.nn.Module, ids: torch.Tensor) -> Dict[str, float]:
    """Where the activation bytes of one forward go: the saved storages of ``activation_bytes``, each charged to
    the innermost module running when autograd saved it (block indices folded: ``blocks.*.att_proj``; "block"
    is the block's own forward, i.e. the topology's additions, scalings and stream mixing outside any
    submodule). Values are d_model-sized fp32 vectors per token and layer, so 1.0 = one (B, T, d) tensor in every
    layer."""
    params = _parameter_storages(model)
    names = {m: re.sub(r"\.\d+(?=\.|$)", ".*", n) for n, m in model.named_modules()}
    stack: List[str] = []
    seen: Dict[int, tuple] = {}

    def enter(module, args) -> None:
        stack.append(names[module])

    def leave(module, args, output) -> None:
        stack.pop()

    hooks = [m.register_forward_pre_hook(enter) for m in names] + [m.register_forward_hook(leave) for m in names]
    wrapped = [m for m in names if callable(getattr(m, "attention", None)) and hasattr(m, "att_proj")]
    for block in wrapped:  # attention is a method, not a module: mark it for the duration of its call
        block.attention = _marked(block.attention, names[block] + ".attention", stack)

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr != 0 and ptr not in seen:
            where = stack[-1] if stack else "(model)"
            if where == "transformer.blocks.*":  # the block's own code: name the function of ours that saved it
                where += " " + _our_caller()
            seen[ptr] = (where, storage.nbytes())
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = step_loss(model, ids)
    finally:
        for h in hooks:
            h.remove()
        for block in wrapped:
            del block.attention
    loss.backward()
    model.zero_grad(set_to_none=True)
    cfg = model.config
    unit = ids.numel() * cfg.d_model * 4 * cfg.n_layers
    out: Dict[str, float] = {}
    for where, nbytes in seen.values():
        key = "logits and loss" if where == "(model)" else where.replace("transformer.blocks.* ", "block: ")
        key = key.replace("transformer.blocks.*.", "").replace("transformer.", "")
        out[key] = out.get(key, 0.0) + nbytes / unit
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _our_caller() -> str:
    """The innermost function of this package's variants or core on the stack (what saved a tensor)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/siamesenorm/variants/" in path or "/siamesenorm/nn/" in path:
            return frame.f_code.co_name
        frame = frame.f_back
    return "?"


def _marked(method: Callable, name: str, stack: List[str]) -> Callable:
    def call(*args, **kwargs):
        stack.append(name)
        try:
            return method(*args, **kwargs)
        finally:
            stack.pop()

    return call


def flops_per_token(model: torch.nn.Module, ids: torch.Tensor) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        step_loss(model, ids).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / ids.numel()


def step_loss(model: torch.nn.Module, ids: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    with torch.autocast(ids.device.type, dtype=dtype, enabled=dtype is not None):
        logits = model(ids).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             ids[:, 1:].reshape(-1))


def peak_flops() -> Optional[float]:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


class _Variant:
    """One MODEL_TYPE in one mode: its model, optimizer, batch and a timer of one training step."""

    def __init__(self, model_type: str, mode: str, settings: BenchSettings, cfg):
        from torch.utils.benchmark import Timer

        torch.manual_seed(settings.seed)
        self.model_type, self.mode = model_type, mode
        self.model = build_model(dataclasses.replace(cfg), model_type).train()
        if mode == "compiled":
            allow_recompiles(len(self.model.transformer.blocks))
            for block in self.model.transformer.blocks:
                block.compile(fullgraph=True)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.dtype = autocast_dtype(settings)
        self.ids = torch.randint(0, cfg.vocab_size, (settings.batch, settings.seq), device=settings.device)
        self.step()  # the first step compiles (compiled mode) and allocates the optimizer state
        self.timer = Timer(stmt="step()", globals={"step": self._steps(settings.steps_per_timing)})
        self.times: List[float] = []
        self.settings = settings

    def step(self) -> None:
        step_loss(self.model, self.ids, self.dtype).backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        if self.ids.is_cuda:
            torch.cuda.synchronize()

    def _steps(self, n: int) -> Callable[[], None]:
        def run() -> None:
            for _ in range(n):
                self.step()

        return run

    def time_once(self) -> None:
        measured = self.timer.timeit(1)
        self.times.append(measured.median / self.settings.steps_per_timing)

    def result(self) -> Dict:
        s = self.settings
        out = {"model_type": self.model_type, "mode": self.mode,
               "parameters": sum(p.numel() for p in self.model.parameters()),
               "step_s_median": statistics.median(self.times), "step_s_min": min(self.times),
               "step_s_max": max(self.times), "repeats": len(self.times),
               "tokens_per_s": s.batch * s.seq / statistics.median(self.times),
               "activation_bytes": activation_bytes(self.model, lambda: step_loss(self.model, self.ids, self.dtype)),
               "flops_per_token": flops_per_token(self.model, self.ids) if self.mode == "eager" else None}
        if self.ids.is_cuda:
            torch.cuda.reset_peak_memory_stats()
            self.step()
            out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
        return out


def run(settings: BenchSettings, progress: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> Dict:
    """Measure every MODEL_TYPE in every mode; returns settings, rows (ratios to pre of the same mode included)."""
    cfg = model_config(settings)
    types = list(dict.fromkeys(["pre", *settings.model_types]))  # pre first: the ratios' denominator
    rows: List[Dict] = []
    others = types[1:]
    size = settings.group_size or len(others) or 1
    groups = [others[i:i + size] for i in range(0, len(others), size)] or [[]]
    for mode in settings.modes:
        for g, group in enumerate(groups):
            variants = []
            for mt in ["pre", *group]:
                started = time.time()
                variants.append(_Variant(mt, mode, settings, cfg))
                progress(f"[{mode}] built {mt} ({time.time() - started:.1f} s"
                         f"{', compiled' if mode == 'compiled' else ''})")
            for r in range(settings.repeats):  # interleaved: each repeat times every variant of the group once
                for v in variants:
                    v.time_once()
                progress(f"[{mode}] group {g + 1}/{len(groups)}: timing round {r + 1}/{settings.repeats}")
            measured = [v.result() for v in variants]
            base = measured[0]
            for row in measured:  # ratios against the pre timed alongside (the same group)
                row["step_time_ratio"] = row["step_s_median"] / base["step_s_median"]
                row["activation_ratio"] = row["activation_bytes"] / base["activation_bytes"]
                if "cuda_peak_bytes" in row:
                    row["cuda_peak_ratio"] = row["cuda_peak_bytes"] / base["cuda_peak_bytes"]
            rows.extend(measured if g == 0 else measured[1:])
            progress(f"[{mode}] measured {', '.join(v.model_type for v in variants)}")
            del variants
            gc.collect()
        if mode == "compiled":
            torch._dynamo.reset()
    peak = peak_flops()
    for mode in settings.modes:
        eager = {r["model_type"]: r for r in rows if r["mode"] == "eager"}
        for r in (r for r in rows if r["mode"] == mode):
            fpt = (eager.get(r["model_type"]) or {}).get("flops_per_token")
            r["flops_per_token"] = fpt
            r["flops_ratio"] = fpt / eager["pre"]["flops_per_token"] if fpt and "pre" in eager else None
            if peak and fpt:
                r["mfu"] = fpt * r["tokens_per_s"] / peak
    return {"settings": {**dataclasses.asdict(settings), "model_types": types, "n_layers": cfg.n_layers,
                         "d_model": cfg.d_model, "vocab_size": cfg.vocab_size,
                         "autocast": str(autocast_dtype(settings) or "none").replace("torch.", ""), "torch": torch.__version__, "threads": torch.get_num_threads(),
                         "device_name": torch.cuda.get_device_name() if settings.device == "cuda" else "cpu"},
            "rows": rows}


def to_markdown(result: Dict) -> str:
    rows = result["rows"]
    cuda = any("cuda_peak_bytes" in r for r in rows)
    head = ["MODEL_TYPE", "mode", "params", "step ms (min-max)", "x pre", "tokens/s", "activations MiB", "x pre",
            "GFLOPs/token", "x pre"] + (["peak MiB", "x pre", "MFU"] if cuda else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join([" --- "] * 2 + [" ---: "] * (len(head) - 2)) + "|"]
    for r in rows:
        cells = [r["model_type"], r["mode"], f"{r['parameters']:,d}",
                 f"{1e3 * r['step_s_median']:.1f} ({1e3 * r['step_s_min']:.1f}-{1e3 * r['step_s_max']:.1f})",
                 f"{r['step_time_ratio']:.3f}", f"{r['tokens_per_s']:,.0f}", f"{r['activation_bytes'] / 2**20:.1f}",
                 f"{r['activation_ratio']:.3f}",
                 "-" if r["flops_per_token"] is None else f"{r['flops_per_token'] / 1e9:.4f}",
                 "-" if r["flops_ratio"] is None else f"{r['flops_ratio']:.3f}"]
        if cuda:
            cells += [f"{r['cuda_peak_bytes'] / 2**20:.0f}", f"{r['cuda_peak_ratio']:.3f}",
                      "-" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def save(result: Dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


def breakdown(settings: BenchSettings) -> Dict[str, Dict[str, float]]:
    """``activation_breakdown`` of every MODEL_TYPE of ``settings`` (eager, one model at a time)."""
    cfg = model_config(settings)
    out = {}
    for mt in dict.fromkeys(["pre", *settings.model_types]):
        torch.manual_seed(settings.seed)
        model = build_model(dataclasses.replace(cfg), mt).train()
        ids = torch.randint(0, cfg.vocab_size, (settings.batch, settings.seq), device=settings.device)
        out[mt] = activation_breakdown(model, ids)
        del model
        gc.collect()
    return out


def breakdown_markdown(result: Dict[str, Dict[str, float]]) -> str:
    """One column per MODEL_TYPE, one row per place (d_model-sized vectors per token and layer)."""
    types = list(result)
    places = list(dict.fromkeys(k for mt in types for k in result[mt]))
    lines = ["| saved in | " + " | ".join(types) + " |", "| --- |" + " ---: |" * len(types)]
    for place in places:
        lines.append(f"| {place} | " + " | ".join(f"{result[mt].get(place, 0.0):.2f}" for mt in types) + " |")
    lines.append("| **total** | " + " | ".join(f"**{sum(result[mt].values()):.2f}**" for mt in types) + " |")
    return "\n".join(lines) + "\n"


def recompute_cost(settings: BenchSettings) -> Dict[str, Dict[str, float]]:
    """Step time with ``model.recompute_cheap`` on and off, eager, every variant and both settings interleaved in
    one process for ``repeats`` rounds: {model_type: {"on": x pre, "off": x pre}}, both divided by pre with
    recompute on (pre's two norms are recomputed too when on)."""
    from torch.utils.benchmark import Timer

    cfg = model_config(settings)
    steps = {mt: _Variant(mt, "eager", settings, cfg) for mt in dict.fromkeys(["pre", *settings.model_types])}
    times: Dict[tuple, List[float]] = {(mt, on): [] for mt in steps for on in (True, False)}
    for _ in range(settings.repeats):
        for mt, v in steps.items():
            for on in (True, False):
                set_recompute(v.model, on)
                timer = Timer(stmt="step()", globals={"step": v.step})
                times[(mt, on)].append(timer.timeit(1).median)
    base = statistics.median(times[("pre", True)])
    return {mt: {("on" if on else "off"): statistics.median(times[(mt, on)]) / base for on in (True, False)}
            for mt in steps}


def _annotation(avg) -> bool:
    return bool(getattr(avg, "is_user_annotation", False)) or avg.key.startswith(("Optimizer.", "ProfilerStep"))


def _device_time_us(avg) -> float:
    return float(getattr(avg, "self_device_time_total", None) or getattr(avg, "self_cuda_time_total", 0) or 0)


def profile(settings: BenchSettings, top: int = 25,
            progress: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> Dict:
    """Where each variant's step goes on the device (``torch.profiler``), one variant at a time after two warm
    steps, over ``steps_per_timing`` profiled steps: the step's wall time, the kernels' summed device time and
    their count per step (device time / wall time: how busy the launches keep the GPU), the optimizer step's device
    span (its annotation; forward + backward is the kernel time less it), and the ``top`` kernels by device time. On a CPU there are no device kernels: the kernel figures are then the CPU ops'."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cfg = model_config(settings)
    types = list(dict.fromkeys(["pre", *settings.model_types]))
    cuda = settings.device == "cuda"
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    n = settings.steps_per_timing
    rows = []
    for mode in settings.modes:
        for mt in types:
            v = _Variant(mt, mode, settings, cfg)
            v.step()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with torch_profile(activities=activities) as prof:
                started = time.perf_counter()
                for _ in range(n):
                    v.step()
                wall = (time.perf_counter() - started) / n
            # a user annotation's device span (the optimizer's "Optimizer.step#AdamW.step") covers kernels
            # counted on their own: left out, or the optimizer is counted twice
            everything = prof.key_averages()
            avgs = [a for a in everything if a.device_type == kind and not _annotation(a)]
            optimizer_ms = sum(_device_time_us(a) for a in everything
                               if a.device_type == kind and a.key.startswith("Optimizer.step")) / n / 1e3
            if cuda:
                timed = [(a.key, a.count / n, _device_time_us(a) / n / 1e3) for a in avgs]
            else:  # CPU: the leaf ops' self time
                timed = [(a.key, a.count / n, a.self_cpu_time_total / n / 1e3) for a in avgs]
            timed = [t for t in timed if t[2] > 0]
            timed.sort(key=lambda t: -t[2])
            busy = sum(t[2] for t in timed)
            rows.append({"model_type": mt, "mode": mode, "wall_ms": wall * 1e3, "kernel_ms": busy,
                         "optimizer_ms": optimizer_ms,
                         "kernels": sum(t[1] for t in timed), "busy": busy / (wall * 1e3),
                         "top": [{"name": k[:160], "per_step": c, "ms": ms} for k, c, ms in timed[:top]]})
            progress(f"[{mode}] profiled {mt}: {wall * 1e3:.1f} ms a step, kernels {busy:.1f} ms "
                     f"({rows[-1]['kernels']:.0f} launches)")
            del v, prof
            gc.collect()
        if mode == "compiled":
            torch._dynamo.reset()
    return {"settings": {**dataclasses.asdict(settings), "model_types": types, "n_layers": cfg.n_layers,
                         "d_model": cfg.d_model, "torch": torch.__version__,
                         "autocast": str(autocast_dtype(settings) or "none").replace("torch.", ""),
                         "device_name": torch.cuda.get_device_name() if cuda else "cpu"}, "rows": rows}


def profile_markdown(result: Dict) -> str:
    """Per variant: wall and kernel time a step, launches, busy fraction; then each variant's top kernels."""
    rows = result["rows"]
    base = {r["mode"]: r for r in rows if r["model_type"] == "pre"}
    out = ["| MODEL_TYPE | mode | wall ms | x pre | kernel ms | x pre | kernels a step | busy |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        b = base[r["mode"]]
        out.append(f"| {r['model_type']} | {r['mode']} | {r['wall_ms']:.1f} | {r['wall_ms'] / b['wall_ms']:.3f} | "
                   f"{r['kernel_ms']:.1f} | {r['kernel_ms'] / b['kernel_ms']:.3f} | {r['kernels']:.0f} | "
                   f"{r['busy']:.0%} |")
    for r in rows:
        out += ["", f"{r['model_type']} ({r['mode']}): top kernels by device time a step", "",
                "| kernel | a step | ms |", "| --- | ---: | ---: |"]
        out += [f"| `{t['name'][:100]}` | {t['per_step']:g} | {t['ms']:.2f} |" for t in r["top"]]
    return "\n".join(out)


def _forward_backward_ms(row: Dict) -> float:
    """A profiled row's forward + backward kernel time: the kernels less the optimizer's. Rows from before the
    profile left the optimizer's annotation out of the kernel sum carry it in their top kernels (counted twice)."""
    if "optimizer_ms" in row:
        return row["kernel_ms"] - row["optimizer_ms"]
    annotation = sum(t["ms"] for t in row["top"] if t["name"].startswith("Optimizer.step"))
    return row["kernel_ms"] - 2 * annotation


def against_cost_model(profiled: Dict, costs: Sequence[Dict], device: str) -> str:
    """Measured forward + backward kernel time (``profile``) beside the cost model's estimate of the same
    configuration on ``device`` (``costmodel`` results of ``--cost-model`` at the same layers, batch and sequence),
    as milliseconds and ratios to pre of the same mode."""
    predicted = {}
    for cost in costs:
        for mt, modes in cost["rows"].items():
            for mode, r in modes.items():
                predicted[(mt, mode)] = estimate_seconds(total(r["step"]), device) * 1e3
    rows = profiled["rows"]
    base = {r["mode"]: r for r in rows if r["model_type"] == "pre"}
    out = [f"| MODEL_TYPE | mode | step ms | x pre | forward + backward kernels ms | x pre | cost model ms ({device}) "
           "| x pre | measured / model |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        b, ms = base[r["mode"]], _forward_backward_ms(r)
        model = predicted.get((r["model_type"], r["mode"]))
        model_pre = predicted.get(("pre", r["mode"]))
        cells = [f"{model:.1f}", f"{model / model_pre:.3f}", f"{ms / model:.2f}"] if model and model_pre else ["-"] * 3
        out.append(f"| {r['model_type']} | {r['mode']} | {r['wall_ms']:.1f} | {r['wall_ms'] / b['wall_ms']:.3f} | "
                   f"{ms:.1f} | {ms / _forward_backward_ms(b):.3f} | " + " | ".join(cells) + " |")
    return "\n".join(out)


#: This project's Triton kernels (siamesenorm/nn/fused.py) by the custom op that launches them, as the cost
#: model names the op.
KERNEL_OPS = {"_forward_kernel": "stream_forward", "_backward_kernel": "stream_backward",
              "_head_forward_kernel": "head_norm_forward", "_head_backward_kernel": "head_norm_backward",
              "_project_forward_kernel": "project_forward", "_project_dx_kernel": "project_backward_x",
              "_project_dw_kernel": "project_backward_w", "_sinkhorn_forward_kernel": "sinkhorn_forward",
              "_sinkhorn_backward_kernel": "sinkhorn_backward", "_mix_forward_kernel": "stream_mix_forward",
              "_mix_backward_kernel": "stream_mix_backward", "_width_forward_kernel": "width_forward",
              "_width_backward_kernel": "width_backward", "_flat_width_forward_kernel": "width_forward",
              "_flat_width_backward_kernel": "width_backward"}


def kernel_bandwidth(profiled: Dict, by_op: Dict[str, Dict[str, Dict[str, list]]], gbps: float) -> str:
    """Each of this project's kernels in a profile's top list: its time a call, the bytes a call the cost model
    charges its op (the step's by_op, forward and backward together, per launch) and the bandwidth that makes,
    against ``gbps`` (the device's)."""
    out = ["| MODEL_TYPE | mode | kernel | calls a step | us a call | MB a call (cost model) | GB/s | of peak |",
           "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in profiled["rows"]:
        ops = by_op.get(r["model_type"], {})
        for t in r["top"]:
            op = KERNEL_OPS.get(t["name"])
            if op is None:
                continue
            counted = [ops.get(phase, {}).get(op, [0, 0]) for phase in ("forward", "backward")]
            launches, nbytes = sum(c[0] for c in counted), sum(c[1] for c in counted)
            if not launches:
                continue
            us = t["ms"] / t["per_step"] * 1e3
            rate = nbytes / launches / (us * 1e-6) / 1e9
            out.append(f"| {r['model_type']} | {r['mode']} | `{t['name']}` | {t['per_step']:g} | {us:.0f} | "
                       f"{nbytes / launches / 1e6:.0f} | {rate:.0f} | {rate / gbps:.0%} |")
    return "\n".join(out)


#: Launch sizes ``tune_kernels`` tries by default, one change at a time from siamesenorm/nn/fused.py's defaults:
#: more, smaller programs where the H100 profile showed kernels far below the bandwidth (the row-block backwards
#: then ran 128 programs of 64 rows at 8,192 tokens on 132 SMs; the coefficient projection, Sinkhorn's backward), and
#: the other way, so that a gain is seen as a trend, not one point. The row blocks and head warps sit at what the
#: H200 chose on 2026-11-28 (16 rows, 8 warps; 64 and 4 before): the candidates try each side of them.
KERNEL_CANDIDATES = ({}, {"_ROWS_PER_PROGRAM": 8}, {"_ROWS_PER_PROGRAM": 32}, {"_HEAD_WARPS": 4},
                     {"_HEAD_WARPS": 16}, {"_ROWS_PER_PROGRAM": 64, "_HEAD_WARPS": 4}, {"_PROJECT_BLOCK_R": 16}, {"_PROJECT_BLOCK_N": 128}, {"_PROJECT_DX_CHUNKS": 1},
                     {"_PROJECT_DX_CHUNKS": 16}, {"_PROJECT_DW_PROGRAMS": 1024}, {"_PROJECT_DW_PROGRAMS": 4096},
                     {"_SINKHORN_BLOCK_T": 16}, {"_SINKHORN_BLOCK_T": 16, "_SINKHORN_WARPS": 1},
                     {"_SINKHORN_BLOCK_T": 8, "_SINKHORN_WARPS": 1}, {"_MIX_BLOCK_T": 8}, {"_MIX_BLOCK_T": 32},
                     {"_WIDTH_BLOCK_T": 32}, {"_WIDTH_BLOCK_D": 128}, {"_WIDTH_BLOCK_D": 32})


def tune_kernels(settings: BenchSettings, candidates: Sequence[Dict[str, int]] = KERNEL_CANDIDATES,
                 progress: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> Dict:
    """This project's kernels (``KERNEL_OPS``) timed in each variant's eager step (``profile``) under each set of
    launch sizes in ``candidates`` (names from ``fused.TUNABLES``; {} is the defaults), one set at a time, the
    defaults restored after each: {"candidates": [...], "rows": {model_type: {kernel: [us a call per candidate]}}}."""
    for candidate in candidates:
        unknown = set(candidate) - set(fused.TUNABLES)
        if unknown:
            raise ValueError(f"not a launch size of siamesenorm/nn/fused.py: {sorted(unknown)}; "
                             f"tunable: {', '.join(fused.TUNABLES)}")
    eager = dataclasses.replace(settings, modes=["eager"], fused=True)
    rows: Dict[str, Dict[str, List[Optional[float]]]] = {}
    for i, candidate in enumerate(candidates):
        saved = {name: getattr(fused, name) for name in candidate}
        try:
            for name, value in candidate.items():
                setattr(fused, name, value)
            result = profile(eager, top=200, progress=lambda m: None)
        finally:
            for name, value in saved.items():
                setattr(fused, name, value)
        for r in result["rows"]:
            for t in r["top"]:
                if t["name"] in KERNEL_OPS:
                    times = rows.setdefault(r["model_type"], {}).setdefault(t["name"], [None] * len(candidates))
                    times[i] = t["ms"] / t["per_step"] * 1e3
        progress(f"[tune] {i + 1}/{len(candidates)}: {candidate or 'defaults'}")
    return {"settings": {**dataclasses.asdict(eager), "device_name": result["settings"]["device_name"]},
            "candidates": [dict(c) for c in candidates], "rows": rows}


def tune_markdown(result: Dict) -> str:
    """One row a (variant, kernel): us a call under each candidate, the fastest in bold."""
    names = [", ".join(f"{k.strip('_').lower()}={v}" for k, v in c.items()) or "defaults" for c in result["candidates"]]
    out = ["| MODEL_TYPE | kernel | " + " | ".join(names) + " |", "| --- | --- |" + " ---: |" * len(names)]
    for mt, kernels in result["rows"].items():
        for kernel, times in kernels.items():
            known = [t for t in times if t is not None]
            best = min(known) if known else None
            cells = ["-" if t is None else (f"**{t:.0f}**" if t == best else f"{t:.0f}") for t in times]
            out.append(f"| {mt} | `{kernel}` | " + " | ".join(cells) + " |")
    return "\n".join(out)
