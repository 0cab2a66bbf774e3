"""What each MODEL_TYPE costs against Pre-Norm: step time, tokens/s, activation memory, parameters, FLOPs per
token (and on CUDA peak memory and MFU), eager and with compiled blocks. Logic and method: siamesenorm/perf/benchmark.py.

  python scripts/benchmark.py                                   # pre vs hybrid_pre, the CPU default size
  python scripts/benchmark.py --model-types all --json bench.json
  python scripts/benchmark.py --recipe configs/OLMo-1B-2e-3.yaml --layers 2 --batch 1 --seq 512   # 1.3B width
  torchrun is not needed: one process, one device (a GPU when there is one)
"""

import argparse
import sys
from pathlib import Path

from siamesenorm.models.names import model_type_names

MODEL_TYPES = model_type_names()  # read from the variant files without importing them: --help stays fast


def _recipe(args):
    """The recipe with every ``--set`` applied, or None after the one line a recipe or ``--set`` the config refuses
    gets (the caller exits 2)."""
    from siamesenorm.run.recipe import load_config

    try:
        return load_config(args.recipe, [f"--{kv.lstrip('-')}" for kv in args.overrides])
    except Exception as e:
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="configs/tiny-cpu.yaml", help="the config whose model is measured")
    parser.add_argument("--model-types", nargs="+", default=["pre", "hybrid_pre"],
                        help=f"MODEL_TYPEs to measure, or all ({', '.join(MODEL_TYPES)}); pre is always included")
    parser.add_argument("--layers", type=int, default=None, help="cut the recipe to this many layers")
    parser.add_argument("--d-model", type=int, default=None, help="another width than the recipe's")
    parser.add_argument("--vocab", type=int, default=None,
                        help="another vocabulary size (a smaller one builds the 1.3B width fast; the embedding and "
                        "output layer are the same in every variant, so the block overhead shows more, not less)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 4; --cost-model: the "
                        "recipe's microbatch)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 256; --cost-model: the "
                        "recipe's)")
    parser.add_argument("--repeats", type=int, default=7, help="timings per variant, interleaved (default 7)")
    parser.add_argument("--steps-per-timing", type=int, default=2, help="training steps in one timing (default 2)")
    parser.add_argument("--modes", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"],
                        help="eager, compiled (each block with torch.compile, fullgraph) or both (default)")
    parser.add_argument("--group-size", type=int, default=0,
                        help="hold at most this many variants (plus pre) in memory at once; each group is timed "
                        "against its own pre (default 0: all at once; use 2-3 at the 1.3B width on a 24 GB machine)")
    parser.add_argument("--json", help="also write the full result (settings and every measurement) here")
    parser.add_argument("--breakdown", action="store_true",
                        help="instead of timing: where each variant's activation bytes go (eager, one forward), as "
                        "d_model-sized vectors per token and layer, by the module (or, inside a block's own code, "
                        "the function) that saved them")
    parser.add_argument("--cost-model", action="store_true",
                        help="instead of timing: the device-independent cost of one microbatch at the recipe's real "
                        "size (its device_train_microbatch_size and sequence unless --batch/--seq are given), "
                        "matmul FLOPs, bytes moved and kernels per layer and step, bf16 autocast, eager and (with --modes "
                        "compiled, the default) each block compiled by inductor (minutes a variant on 2 CPU cores), "
                        "and the estimated step time against pre on A100 / H100 / H200 (siamesenorm/perf/costmodel.py)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe field changed for every variant measured, pre included (timing, --profile, "
                        "--cost-model, --memory-model), as the training command's --KEY=VALUE (e.g. --set "
                        "model.siamese_mixing=dynamic --set model.attnres_blocks=8); repeatable")
    parser.add_argument("--memory-model", action="store_true",
                        help="instead of timing: GiB per GPU of one step of the recipe at its microbatch under FSDP "
                        "full shard (--gpus), bf16, by parts, recompute on and off and with whole-layer activation "
                        "checkpointing, and which of A100-40GB / A100-80GB / H100-80GB each fits "
                        "(siamesenorm/perf/costmodel.py memory_per_gpu: a model on fake tensors, seconds on a CPU)")
    parser.add_argument("--recompute", choices=["on", "off"], default=None,
                        help="model.recompute_cheap on or off for the timing, --breakdown and --cost-model "
                        "(default: the recipe's)")
    parser.add_argument("--fused", choices=["on", "off"], default=None,
                        help="model.fused_streams on or off (pre, hybrid_pre and post_pre: each residual add and the "
                        "norms after it as one op each way; hybrid, hybrid_star, hybrid_pre: the Q/K/V head norms as "
                        "one op; siamesenorm/nn/fused.py) for the timing, --breakdown and --cost-model (default: the "
                        "recipe's)")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default=None,
                        help="the timed steps' forward under bf16 autocast (as amp_bf16 trains) or in fp32 "
                        "(default: on a GPU the recipe's precision, on a CPU fp32)")
    parser.add_argument("--profile", action="store_true",
                        help="instead of the table: each variant's step under torch.profiler, one at a time: wall and "
                        "kernel time a step, kernels launched, how busy the device is, the top kernels by device time "
                        "(--json writes them all)")
    parser.add_argument("--tune-kernels", action="store_true",
                        help="instead of the table: this project's Triton kernels timed in each variant's eager, fused "
                        "step (torch.profiler) under each candidate launch size of siamesenorm/perf/benchmark.py "
                        "KERNEL_CANDIDATES, us a call (a GPU's: on a CPU the kernels are torch's; --json writes them)")
    parser.add_argument("--gpus", type=int, default=8, help="--memory-model: GPUs the state is sharded over (8)")
    parser.add_argument("--loss-chunk-tokens", type=int, default=None,
                        help="--memory-model: with the chunked loss (the config's loss_chunk_tokens)")
    parser.add_argument("--recompute-cost", action="store_true",
                        help="instead of the table: eager step time with recompute on and off, interleaved in one "
                        "process, as ratios to pre")
    parser.add_argument("--cost-table", nargs="+", metavar="JSON",
                        help="instead of counting: one table of step time against pre from --cost-model JSON files "
                        "(every mode and fused flag they hold, H100 and A100-80GB), the first file winning where "
                        "two hold the same figure")
    args = parser.parse_args(argv)
    if args.cost_table:
        import json

        from siamesenorm.perf import costmodel

        results = []
        for path in args.cost_table:
            try:
                result = json.loads(Path(path).read_text())
            except (OSError, ValueError) as e:
                result, why = None, f"{type(e).__name__}: {e}"
            else:
                why = "no modes and rows in it"
            if not (isinstance(result, dict) and {"modes", "rows"} <= result.keys()):
                print(f"error: {path}: not a --cost-model JSON file ({why})", file=sys.stderr)
                return 2
            results.append(result)
        print(costmodel.combined_markdown(results))
        return 0
    types = list(MODEL_TYPES) if args.model_types == ["all"] else args.model_types
    unknown = [t for t in types if t not in MODEL_TYPES]
    if unknown:
        parser.error(f"unknown MODEL_TYPE {unknown[0]!r}; valid: {', '.join(MODEL_TYPES)} or all")
    if args.memory_model:
        import json

        from siamesenorm.perf import costmodel

        cfg = _recipe(args)
        if cfg is None:
            return 2
        if args.fused is not None:
            cfg.model.fused_streams = args.fused == "on"
        result = costmodel.memory_table(cfg.model, types, args.batch or cfg.device_train_microbatch_size, args.seq,
                                        args.gpus, args.loss_chunk_tokens)
        print(f"{args.recipe}: microbatch {result['microbatch']} x {result['seq_len']}, FSDP full shard over "
              f"{args.gpus} GPUs, bf16, AdamW, fused streams {'on' if cfg.model.fused_streams else 'off'}, loss {'chunked ' + str(args.loss_chunk_tokens) if args.loss_chunk_tokens else 'OLMo'}"
              f"; fits = peak <= {1 - costmodel.MEMORY_HEADROOM:.0%} of the GPU's memory")
        print(costmodel.memory_markdown(result))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
            print(f"wrote {args.json}")
        return 0
    if args.cost_model:
        import dataclasses
        import json

        from siamesenorm.perf import costmodel

        cfg = _recipe(args)
        if cfg is None:
            return 2
        model_cfg = dataclasses.replace(cfg.model, **{k: v for k, v in (
            ("n_layers", args.layers), ("d_model", args.d_model),
            ("recompute_cheap", None if args.recompute is None else args.recompute == "on"),
            ("fused_streams", None if args.fused is None else args.fused == "on")) if v is not None})
        compiled = "compiled" in args.modes
        from olmo.exceptions import OLMoConfigurationError

        try:
            result = costmodel.table(model_cfg, types, args.batch or cfg.device_train_microbatch_size, args.seq,
                                     compiled=compiled,
                                     progress=lambda mt: print(f"counting {mt}", file=sys.stderr, flush=True))
        except OLMoConfigurationError as e:  # a --set the variant refuses: its one line
            print(f"error: {e}", file=sys.stderr)
            return 2
        for mode in result["modes"]:
            print(f"\n{args.recipe}: {model_cfg.n_layers} layers, d_model {model_cfg.d_model}, microbatch "
                  f"{result['microbatch']} x {result['seq_len']}, bf16 autocast, {mode}, recompute "
                  f"{'on' if model_cfg.recompute_cheap else 'off'}, fused streams "
                  f"{'on' if model_cfg.fused_streams else 'off'}, forward + backward; time: "
                  f"matmul at {costmodel.MATMUL_EFFICIENCY:.0%} of peak + bytes at "
                  f"{costmodel.BANDWIDTH_EFFICIENCY:.0%} of HBM bandwidth")
            print(costmodel.to_markdown(result, mode))
        print(f"\nWhere one eager layer moves more than pre's (forward + backward, by op; a pass is one read or write "
              f"of a {result['microbatch']} x {result['seq_len']} x {model_cfg.d_model} bf16 tensor):")
        print(costmodel.above_pre_markdown(result))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
            print(f"wrote {args.json}")
        return 0
    args.batch, args.seq = args.batch or 4, args.seq or 256
    if args.overrides and _recipe(args) is None:  # a --set the config refuses: its line before any model is built
        return 2
    from siamesenorm.perf.benchmark import (
        BenchSettings,
        breakdown,
        breakdown_markdown,
        profile,
        profile_markdown,
        recompute_cost,
        run,
        save,
        to_markdown,
        tune_kernels,
        tune_markdown,
    )

    settings = BenchSettings(recipe=args.recipe, model_types=types, layers=args.layers, d_model=args.d_model, vocab=args.vocab,
                             batch=args.batch, seq=args.seq, repeats=args.repeats,
                             steps_per_timing=args.steps_per_timing, modes=args.modes,
                             group_size=args.group_size,
                             recompute=None if args.recompute is None else args.recompute == "on",
                             fused=None if args.fused is None else args.fused == "on", precision=args.precision,
                             overrides=tuple(args.overrides))
    if args.recompute_cost:
        for mt, r in recompute_cost(settings).items():
            print(f"{mt:15s} recompute on {r['on']:.3f}  off {r['off']:.3f}  (step time / pre's, recompute on)")
        return 0
    if args.breakdown:
        print(breakdown_markdown(breakdown(settings)))
        return 0
    for wanted, measure, markdown in ((args.tune_kernels, tune_kernels, tune_markdown),
                                      (args.profile, profile, profile_markdown)):
        if wanted:
            result = measure(settings)
            print(markdown(result))
            if args.json:
                save(result, args.json)
                print(f"wrote {args.json}")
            return 0
    result = run(settings)
    s = result["settings"]
    print(f"{args.recipe}: {s['n_layers']} layers, d_model {s['d_model']}, vocabulary {s['vocab_size']}, {args.batch} x {args.seq} tokens a step, "
          f"{s['device_name']}, {s['threads']} thread(s), torch {s['torch']}, autocast {s['autocast']}; ratios against pre of the same mode")
    print(to_markdown(result))
    if args.json:
        save(result, args.json)
        print(f"wrote {args.json}")
    return 0
