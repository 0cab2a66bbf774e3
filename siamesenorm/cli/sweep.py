"""Run a sweep plan (methods x learning rates x seeds over one recipe), a few processes at a time; rerunning it
continues where it stopped. Logic and plan format: siamesenorm/studies/sweep.py.

  python scripts/sweep.py studies/cpu-lr-grid/sweep.yaml            # every cell not done yet, 2 at a time
  python scripts/sweep.py studies/cpu-lr-grid/sweep.yaml --list     # the cells and their status
"""

import argparse
import signal
import sys

from siamesenorm.studies import sweep
from siamesenorm.studies.sweep import PlanError, load_plan, run_plan, status, stop_children, stopping


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plan", help="the sweep plan (YAML), e.g. studies/cpu-lr-grid/sweep.yaml")
    parser.add_argument("--parallel", type=int, default=2, help="training processes at a time (one core each)")
    parser.add_argument("--only", nargs="*", help="run only these cells (names as --list prints them)")
    parser.add_argument("--list", action="store_true", help="print the cells and their status, run nothing")
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep each run's checkpoints after analysis")
    args = parser.parse_args(argv)
    try:
        plan = load_plan(args.plan)
    except OSError as err:
        print(f"error: cannot read the plan {args.plan}: {err}", file=sys.stderr)
        return 2
    except PlanError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.list:
        for cell in plan.cells:
            print(f"{cell.name:60s} {status(plan, cell) or 'to run'}")
        return 0
    try:
        if any(status(plan, cell) not in sweep.FINAL for cell in plan.cells):
            sweep.check_inputs(plan)
    except PlanError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    def stop(signum, frame):
        print(f"sweep: {signal.Signals(signum).name}: stopping the running cells (they resume on the next run)",
              file=sys.stderr, flush=True)
        stop_children(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    outcomes = run_plan(plan, args.parallel, args.only, args.keep_checkpoints)
    if stopping():
        return 143
    failed = [name for name, outcome in outcomes.items() if outcome.startswith("error")]
    return 1 if failed else 0
