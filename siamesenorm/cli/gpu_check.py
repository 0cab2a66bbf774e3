"""The GPU check: each seed MODEL_TYPE trained on one GPU (bf16, FSDP, compiled blocks), stopped and resumed,
generation, export and the preflight's timed run, the fused kernels checked at the toy size and at the recipes'
width, and the step times of pre, post_pre, hybrid_pre, hc and mhc fused off and on, eager and compiled, at the
1.3B width, as a Markdown report. Logic: siamesenorm/cluster/gpucheck.py.
On a GPU machine without a package index, run scripts/gpu_check.sh (it installs from a wheelhouse first).

  python scripts/gpu_check.py --report results/gpu/report.md
  python scripts/gpu_check.py --recipe configs/tiny-cpu.yaml --variants pre hybrid_pre --steps 4   # on a CPU
"""

import argparse
import sys

SEED = ["pre", "post", "hybrid", "hc", "post_pre", "hybrid_pre"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="configs/small-150M.yaml", help="the recipe trained (default: the 150M)")
    parser.add_argument("--variants", nargs="+", default=SEED, help="MODEL_TYPEs trained (default: the six seed "
                        "variants); the last one is also generated from and exported")
    parser.add_argument("--exact", nargs="*", default=["pre", "hybrid_pre"],
                        help="MODEL_TYPEs also stopped halfway and resumed, losses compared (default pre hybrid_pre)")
    parser.add_argument("--steps", type=int, default=50, help="training steps a run (default 50)")
    parser.add_argument("--global-batch", type=int, default=64,
                        help="sequences a step (default 64; 0: the recipe's)")
    parser.add_argument("--timed-steps", type=int, default=5, help="steps of the preflight's timed run (default 5)")
    parser.add_argument("--kernel-sizes", nargs="+", default=["48:2x5", "2048:3x67", "2048:3x67:bf16"],
                        metavar="D:R1xR2[:bf16]",
                        help="the fused kernels' check at each feature width D and R1 x R2 rows, fp64 inputs or "
                        "bf16 (default: the toy size, one in the recipes' range with several programs and partial "
                        "tail blocks, and that one in bf16)")
    parser.add_argument("--timing-types", nargs="*", default=["pre", "post_pre", "hybrid_pre", "hc", "mhc"],
                        help="MODEL_TYPEs timed against pre, fused off and on, eager and compiled (none: skipped)")
    parser.add_argument("--timing-args", default="--recipe configs/OLMo-1B-2e-3.yaml --layers 4 --batch 4 --seq 2048 "
                        "--repeats 5 --steps-per-timing 2",
                        help="scripts/benchmark.py's arguments for the timing (default: the 1.3B width, 4 layers)")
    parser.add_argument("--work", default="/tmp/siamesenorm-gpu-check", help="data, runs and exports go here")
    parser.add_argument("--report", default="results/gpu/report.md", help="the Markdown report (a .json beside it)")
    args, overrides = parser.parse_known_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the resume check stops halfway)")

    import json
    import shlex
    from pathlib import Path

    from siamesenorm.cluster.gpucheck import CheckSettings, run_check, to_markdown

    sizes = []
    for text in args.kernel_sizes:
        try:
            d, rows, *kind = text.split(":")
            if kind not in ([], ["bf16"]):
                raise ValueError(text)
            sizes.append((int(d), tuple(int(r) for r in rows.split("x")), *kind))
        except ValueError:
            parser.error(f"--kernel-sizes {text!r}: write D:R1xR2 or D:R1xR2:bf16, e.g. 2048:3x67:bf16")
    settings = CheckSettings(recipe=args.recipe, variants=args.variants, exact_variants=args.exact or [],
                             steps=args.steps, global_batch=args.global_batch or None, overrides=overrides,
                             work=args.work, timed_steps=args.timed_steps, kernel_sizes=sizes,
                             timing_types=args.timing_types or None, timing_args=shlex.split(args.timing_args))
    result = run_check(settings)
    report = Path(args.report)
    report.parent.mkdir(parents=True, exist_ok=True)
    command = "python scripts/gpu_check.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                 else sys.argv[1:]))
    report.write_text(to_markdown(result, command))
    report.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {report} ({len(result['failures'])} failure(s))")
    return 1 if result["failures"] else 0
