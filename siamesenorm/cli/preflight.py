"""Before launching a recipe: will it fit, how long will it take, is everything in place. Logic: siamesenorm/cluster/preflight.py.

  MODEL_TYPE=hybrid_pre python scripts/preflight.py configs/OLMo-1B-hybrid-2e-3.yaml --gpu a100-40gb
  MODEL_TYPE=hybrid_pre python scripts/preflight.py configs/OLMo-1B-hybrid-2e-3.yaml --nodes 4 --gpu h100-80gb
  python scripts/preflight.py configs/tiny-cpu.yaml --gpus-per-node 1 --timed-steps 3    # a timed run on a CPU too

Exit status: 0 when nothing failed (warnings allowed), 1 when a check failed (each says what to change), 2 for bad
arguments.
"""

import argparse
import sys

GPUS = ["a100-40gb", "a100-80gb", "h100-80gb", "h200"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="the recipe (configs/*.yaml); MODEL_TYPE as for scripts/train.py")
    parser.add_argument("--nodes", type=int, default=1, help="nodes the run launches on (default 1)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs a node (default 8)")
    parser.add_argument("--gpu", choices=GPUS + ["auto"], default="auto",
                        help="the GPU the estimates are for; auto: this machine's, or every listed type without one")
    parser.add_argument("--timed-steps", type=int, default=None,
                        help="steps of the timed run on this machine's device (default 5 on a GPU, 0 on a CPU)")
    parser.add_argument("--json", help="also write the checks and estimates here")
    args, overrides = parser.parse_known_args(argv)
    if args.nodes < 1 or args.gpus_per_node < 1:
        parser.error("--nodes and --gpus-per-node must be >= 1")

    import dataclasses
    import json
    import logging

    import torch

    from siamesenorm.cluster.preflight import detect_gpu, preflight, to_markdown
    from siamesenorm.models.config import resolve_model_type
    from siamesenorm.run.recipe import RunError, load_config

    logging.disable(logging.WARNING)  # OLMo's and torch's start-up chatter; the table says what matters
    try:
        cfg = load_config(args.config, overrides)
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model_type, source = resolve_model_type(cfg.model)
    gpu = detect_gpu() if args.gpu == "auto" else args.gpu
    timed = args.timed_steps if args.timed_steps is not None else (5 if torch.cuda.is_available() else 0)
    print(f"preflight: {args.config}, MODEL_TYPE={model_type} ({source}), {args.nodes} node(s) x "
          f"{args.gpus_per_node} GPU(s), estimates for {gpu or 'every GPU type'}", flush=True)
    checks, estimates = preflight(cfg, model_type, args.nodes, args.gpus_per_node, gpu, timed)
    print(to_markdown(checks, estimates))
    if args.json:
        from pathlib import Path

        Path(args.json).write_text(json.dumps({"checks": [dataclasses.asdict(c) for c in checks],
                                               "estimates": estimates}, indent=1, default=str) + "\n")
    failed = [c.name for c in checks if c.status == "FAIL"]
    print(f"\n{'FAILED: ' + ', '.join(failed) if failed else 'ready: no check failed'}")
    return 1 if failed else 0
