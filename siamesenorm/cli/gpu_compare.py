"""A GPU's measured kernel time beside the cost model's estimate of the same configuration, and this project's
kernels' bandwidth. Logic: siamesenorm/perf/benchmark.py (``against_cost_model``, ``kernel_bandwidth``).

  python scripts/gpu_compare.py results/gpu/h100-2026-11-27/profile-eager.json \\
      --cost-model results/gpu/h100-2026-11-27/cost-model-eager.json --device h100-80gb \\
      --by-op results/gpu/h100-2026-11-27/cost-model-by-op.json

The profile: scripts/benchmark.py --profile --json (on the GPU); the cost model: scripts/benchmark.py --cost-model
--json at the same --layers, --batch and --seq (on any machine).
"""

import argparse
import json
import sys

DEVICES = ("a100-40gb", "a100-80gb", "h100-80gb", "h200")  # siamesenorm.perf.costmodel.DEVICES (checked in main)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", nargs="+", help="scripts/benchmark.py --profile --json files")
    parser.add_argument("--cost-model", nargs="+", required=True, help="scripts/benchmark.py --cost-model --json files")
    parser.add_argument("--by-op", help="also this project's kernels' bandwidth: the cost model's by_op of each "
                        "MODEL_TYPE's step at the same configuration (a JSON {MODEL_TYPE: {forward, backward}})")
    parser.add_argument("--device", choices=DEVICES, default="h100-80gb", help="the cost model's device")
    args = parser.parse_args(argv)
    from siamesenorm.perf.benchmark import against_cost_model, kernel_bandwidth
    from siamesenorm.perf.costmodel import DEVICES as SPECS

    assert set(SPECS) == set(DEVICES), "siamesenorm.cli.gpu_compare.DEVICES is out of date"
    try:
        costs = [json.load(open(p)) for p in args.cost_model]
        by_op = json.load(open(args.by_op)) if args.by_op else None
        for path in args.profile:
            profiled = json.load(open(path))
            print(against_cost_model(profiled, costs, args.device))
            if by_op is not None:
                print()
                print(kernel_bandwidth(profiled, by_op, SPECS[args.device]["gbps"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: {type(e).__name__}: {e}: give scripts/benchmark.py --profile JSONs and --cost-model JSONs of "
              "the same configuration", file=sys.stderr)
        return 2
    return 0
