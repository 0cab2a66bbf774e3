"""The GPU check: the paths only a GPU runs, in minutes, with a Markdown report.

On the shipped Austen corpus tokenized with the recipe's tokenizer: the preflight of the recipe with its timed run
(tokens/s, MFU, peak memory on this GPU); each seed MODEL_TYPE trained for ``steps`` steps through scripts/train.py
under torchrun (FSDP on one GPU, bf16, compiled blocks as the recipe sets them); for some of them the same run
stopped halfway and resumed, losses compared step by step; generation from a checkpoint, HF export and generation
from the export. Every step is run even when an earlier one failed; the report says what failed and how.
``scripts/gpu_check.sh`` installs the project from a wheelhouse first; tests/cluster/test_gpucheck.py runs the same code on
the CPU with the tiny recipe.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
SEED_VARIANTS = ("pre", "post", "hybrid", "hc", "post_pre", "hybrid_pre")
PROMPT = "It is a truth universally acknowledged"


@dataclass
class CheckSettings:
    recipe: str = "configs/small-150M.yaml"
    variants: Sequence[str] = SEED_VARIANTS
    exact_variants: Sequence[str] = ("pre", "hybrid_pre")  # also stopped halfway and resumed
    steps: int = 50
    global_batch: Optional[int] = 64  # sequences a step (None: the recipe's); 64 x 1024 tokens keeps the check short
    overrides: List[str] = field(default_factory=list)  # more --key=value for every run
    work: str = "/tmp/siamesenorm-gpu-check"
    timed_steps: int = 5
    timeout_s: int = 900  # one training launch
    # the fused kernels' check at each (d, rows): the toy size, and a size in the recipes' range where every
    # kernel runs several programs with partial tail blocks and the feature loops several chunks
    # (d, rows[, "bf16"]): bf16 inputs against the fp32-inside references, to 3e-2 of each tensor's largest value
    kernel_sizes: Sequence = ((48, (2, 5)), (2048, (3, 67)), (2048, (3, 67), "bf16"))
    # the cost model's claims timed: these MODEL_TYPEs at the 1.3B width, a few layers, bf16, fused off and on,
    # eager and compiled, each against pre of the same setting (scripts/benchmark.py); None: skipped
    timing_types: Optional[Sequence[str]] = ("pre", "post_pre", "hybrid_pre", "hc", "mhc")
    timing_args: Sequence[str] = ("--recipe", "configs/OLMo-1B-2e-3.yaml", "--layers", "4", "--batch", "4",
                                  "--seq", "2048", "--repeats", "5", "--steps-per-timing", "2")


def _environment() -> Dict[str, str]:
    import numpy
    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
           "transformers": transformers.__version__, "cuda": str(torch.version.cuda),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    try:
        from importlib.metadata import version

        env["ai2-olmo"] = version("ai2-olmo")
    except Exception:  # noqa: BLE001  (a report line, not a failure)
        env["ai2-olmo"] = "?"
    return env


def _prepare_data(cfg, work: Path) -> Path:
    """The shipped Austen corpus in the recipe's tokenizer (resumable; a rerun reuses it)."""
    from siamesenorm.run.data import PrepareSettings, prepare

    out = work / "data" / Path(str(cfg.tokenizer.identifier)).stem
    settings = PrepareSettings([str(ROOT / "data" / "austen.jsonl.gz")], tokenizer=str(cfg.tokenizer.identifier),
                               docs_per_unit=50)
    prepare(settings, out, progress=False)
    return out


def _rows(folder: Path) -> List[Dict]:
    try:
        return [r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    except OSError:
        return []


def _train(s: CheckSettings, model_type: str, folder: Path, data: Path, extra: Sequence[str] = ()) -> Dict:
    args = [s.recipe, f"--save_folder={folder}", f"--max_duration={s.steps}", f"--save_interval={max(1, s.steps // 2)}",
            "--save_interval_unsharded=null", "--try_load_latest_save", f"--data.paths=[{data}/train/*.npy]", "--evaluators=[]", "--wandb=null",
            "--distributed_strategy=fsdp", "--fsdp.use_orig_params=true", "--console_log_interval=1",
            f"--eval_interval={10 * s.steps}"]
    if s.global_batch:
        args.append(f"--global_train_batch_size={s.global_batch}")
    args += [*s.overrides, *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           str(ROOT / "scripts" / "train.py"), *args]
    env = {**os.environ, "MODEL_TYPE": model_type, "PYTHONUNBUFFERED": "1"}
    started = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=s.timeout_s)
        code, tail = proc.returncode, (proc.stdout + proc.stderr)[-2500:]
    except subprocess.TimeoutExpired:
        code, tail = "timeout", f"no end after {s.timeout_s} s"
    rows = _rows(folder)
    speeds = [r["tokens_per_second_per_device"] for r in rows[len(rows) // 2:] if r.get("tokens_per_second_per_device")]
    out = {"code": code, "seconds": time.time() - started, "losses": {r["step"]: r["loss"] for r in rows},
           "tokens_per_s": statistics.median(speeds) if speeds else None}  # the second half: compiled, warm
    if code != 0:
        out["error"] = tail
    return out


def _run_tool(args: Sequence[str], timeout: int = 600) -> Dict:
    try:
        proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        return {"code": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr[-2000:]}
    except subprocess.TimeoutExpired:
        return {"code": "timeout", "stdout": "", "stderr": f"no end after {timeout} s"}


def run_check(s: CheckSettings, progress=lambda m: print(m, file=sys.stderr, flush=True)) -> Dict:
    """Every step of the check; returns the results the report is made of."""
    import torch

    from siamesenorm.cluster.preflight import preflight
    from siamesenorm.nn import fused
    from siamesenorm.run.recipe import load_config

    work = Path(s.work)
    work.mkdir(parents=True, exist_ok=True)
    result: Dict = {"settings": dataclasses.asdict(s), "environment": _environment(), "failures": []}
    cfg = load_config(str(ROOT / s.recipe), list(s.overrides))
    progress("preparing the Austen corpus in the recipe's tokenizer")
    data = _prepare_data(cfg, work)

    progress("preflight with a timed run")
    try:
        pf_cfg = load_config(str(ROOT / s.recipe), [*s.overrides, f"--data.paths=[{data}/train/*.npy]",
                                                    f"--save_folder={work / 'preflight'}", f"--max_duration={s.steps}"]
                             + ([f"--global_train_batch_size={s.global_batch}"] if s.global_batch else []))
        checks, est = preflight(pf_cfg, s.variants[-1], nodes=1, gpus_per_node=1, gpu=None, timed_steps=s.timed_steps)
        result["preflight"] = {"checks": [dataclasses.asdict(c) for c in checks], "timed_run": est.get("timed_run"),
                               "memory_model_peak_gib": est.get("memory", {}).get("peak")}
    except Exception as e:  # noqa: BLE001  (each step reports, the check goes on)
        result["failures"].append(f"preflight: {type(e).__name__}: {e}")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    result["fused_sizes"] = []
    for d, rows, *kind in s.kernel_sizes:
        bf16 = "bf16" in kind
        progress(f"the fused kernels (model.fused_streams) against their reference, d {d}, rows {rows}"
                 + (", bf16" if bf16 else ""))
        try:
            start = time.time()
            seen: list = []
            bad = fused.check(device, d=d, rows=tuple(rows), seen=seen,
                              **({"dtype": torch.bfloat16, "tol": 3e-2} if bf16 else
                                 {"tol": fused.AT_SIZE_FP64_TOL} if d >= 1024 else {}))
            entry = {"device": device, "kernels": "triton" if fused.available(torch.zeros(1, device=device))
                     else "torch", "mismatches": len(bad), "combinations": len(seen), "seconds": time.time() - start,
                     "d": d, "rows": list(rows), "dtype": "bf16" if bf16 else "fp64"}
            result["fused_sizes"].append(entry)
            result.setdefault("fused", entry)  # the first size, as earlier reports had it
            if bad:
                result["failures"].append(f"fused ops at d {d}: {len(bad)} flag combinations disagree, e.g. {bad[0]}")
        except Exception as e:  # noqa: BLE001
            result["failures"].append(f"fused ops at d {d}: {type(e).__name__}: {e}")

    if s.timing_types:
        timing = result["timing"] = {}
        for fused_on in ("off", "on"):
            progress(f"timing {', '.join(s.timing_types)}, fused {fused_on}, eager and compiled")
            out = work / f"timing-fused-{fused_on}.json"
            r = _run_tool(["scripts/benchmark.py", "--modes", "eager", "compiled", *s.timing_args,  # theirs win
                           "--model-types", *s.timing_types, "--fused", fused_on, "--json", str(out)],
                          timeout=s.timeout_s)
            timing[fused_on] = {"code": r["code"], "table": r["stdout"][-4000:]}
            if r["code"] != 0:
                result["failures"].append(f"timing, fused {fused_on}: exit {r['code']}: "
                                          f"{r['stderr'].strip().splitlines()[-1:]}")

    runs = result["runs"] = {}
    for mt in s.variants:
        progress(f"training {mt} for {s.steps} steps")
        runs[mt] = _train(s, mt, work / "runs" / mt, data, ["--save_overwrite"])
        if runs[mt]["code"] != 0:
            result["failures"].append(f"train {mt}: exit {runs[mt]['code']}")
    resumes = result["resume"] = {}
    for mt in s.exact_variants:
        progress(f"{mt}: stopped at step {s.steps // 2}, resumed")
        folder = work / "runs" / f"{mt}-resumed"
        first = _train(s, mt, folder, data, ["--save_overwrite", f"--stop_at={s.steps // 2}"])
        second = _train(s, mt, folder, data)
        whole, parts = runs.get(mt, {}).get("losses", {}), second["losses"]
        common = sorted(set(whole) & set(parts))
        diff = max((abs(whole[k] - parts[k]) for k in common), default=None)
        resumes[mt] = {"codes": [first["code"], second["code"]], "steps_compared": len(common), "max_abs_diff": diff,
                       "exact": diff == 0.0 and len(common) == s.steps}
        if not resumes[mt]["exact"]:
            result["failures"].append(f"resume {mt}: " + (f"loss differs by up to {diff:.3g}" if diff else
                                                          f"exits {first['code']}, {second['code']}"))

    mt = s.variants[-1]
    progress(f"generation and export of {mt}")
    run_folder, export = work / "runs" / mt, work / f"export-{mt}"
    gen = _run_tool(["scripts/generate.py", str(run_folder), "--prompt", PROMPT, "--max-new-tokens", "16"])
    exp = _run_tool(["scripts/export_hf.py", str(run_folder), str(export), "--overwrite"])
    gen_export = _run_tool(["scripts/generate.py", str(export), "--prompt", PROMPT, "--max-new-tokens", "16"])
    result["generation"] = {"checkpoint": gen, "export": exp, "from_export": gen_export,
                            "same_text": gen["code"] == 0 and gen_export["code"] == 0
                            and gen["stdout"].strip() == gen_export["stdout"].strip()}
    for name, r in (("generate", gen), ("export", exp), ("generate from export", gen_export)):
        if r["code"] != 0:
            result["failures"].append(f"{name}: exit {r['code']}: {r['stderr'].strip().splitlines()[-1:]}")
    return result


def to_markdown(result: Dict, command: str) -> str:
    s, env = result["settings"], result["environment"]
    lines = ["# GPU check", "", f"Command: `{command}`", "",
             "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()), "",
             f"Recipe {s['recipe']}, {s['steps']} steps a run, "
             f"{s['global_batch'] or 'the recipe'}'s sequences a step, FSDP on one device, data: the shipped "
             "Austen corpus in the recipe's tokenizer.", ""]
    pf = result.get("preflight")
    if pf:
        lines += ["## Preflight", "", "| check | status | detail |", "| --- | --- | --- |"]
        lines += [f"| {c['name']} | {c['status']} | {c['detail']} |" for c in pf["checks"]]
        run = pf.get("timed_run") or {}
        if "tokens_per_s" in run:
            lines += ["", f"Timed run ({run['device']}, microbatch {run['microbatch']} x {run['seq_len']}, "
                      f"{run['precision']}, {'compiled' if run['compiled'] else 'eager'}): "
                      f"{run['tokens_per_s']:,.0f} tokens/s"
                      + (f", MFU {100 * run['mfu']:.1f}%" if run.get("mfu") else "")
                      + (f", peak {run['peak_gib']:.2f} GiB (memory model, FSDP over 1: "
                         f"{pf['memory_model_peak_gib']:.2f} GiB)" if run.get("peak_gib") else "")]
    for fz in result.get("fused_sizes") or ([result["fused"]] if result.get("fused") else []):
        size = (f", d {fz['d']}, rows {' x '.join(map(str, fz['rows']))}, {fz.get('dtype', 'fp64')} inputs"
                if "d" in fz else "")
        lines += ["", f"Fused ops (model.fused_streams) on {fz['device']}, {fz['kernels']} path{size}: "
                  f"{fz['mismatches']} of {fz['combinations']} flag combinations disagree with the reference, "
                  f"forward and backward ({fz['seconds']:.0f} s)."]
    if result.get("timing"):
        lines += ["", "## Step time against pre (scripts/benchmark.py, one process, interleaved)", "",
                  "Arguments: `" + " ".join(s.get("timing_args") or []) + "`."]
        for fused_on, r in result["timing"].items():
            lines += ["", f"Fused {fused_on} (exit {r['code']}):", "", "```", r["table"].strip(), "```"]
    lines += ["", "## Training", "", "| MODEL_TYPE | exit | first loss | last loss | tokens/s (median, second half) "
              "| wall s |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for mt, r in result.get("runs", {}).items():
        losses = r["losses"]
        first = f"{losses[min(losses)]:.4f}" if losses else "-"
        last = f"{losses[max(losses)]:.4f} (step {max(losses)})" if losses else "-"
        tps = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-"
        lines.append(f"| {mt} | {r['code']} | {first} | {last} | {tps} | {r['seconds']:.0f} |")
    if result.get("resume"):
        lines += ["", "## Stop halfway and resume", "", "| MODEL_TYPE | exits | steps compared | max abs loss "
                  "difference | exact |", "| --- | --- | ---: | ---: | --- |"]
        for mt, r in result["resume"].items():
            diff = "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.3g}"
            lines.append(f"| {mt} | {r['codes'][0]}, {r['codes'][1]} | {r['steps_compared']} | {diff} | "
                         f"{'yes' if r['exact'] else 'no'} |")
    gen = result.get("generation")
    if gen:
        lines += ["", "## Generation and export", "",
                  f"- from the checkpoint (exit {gen['checkpoint']['code']}): "
                  f"`{' '.join(gen['checkpoint']['stdout'].split())[:300]}`",
                  f"- export (exit {gen['export']['code']}); from the export (exit {gen['from_export']['code']}): "
                  f"`{' '.join(gen['from_export']['stdout'].split())[:300]}`",
                  f"- same text: {'yes' if gen['same_text'] else 'no'}"]
    lines += ["", "## Failures", ""] + ([f"- {f}" for f in result["failures"]] or ["none"])
    errors = [(mt, r["error"]) for mt, r in result.get("runs", {}).items() if r.get("error")]
    for mt, tail in errors[:2]:
        lines += ["", f"<details><summary>{mt}: the end of its output</summary>", "", "```", tail, "```", "</details>"]
    return "\n".join(lines) + "\n"
