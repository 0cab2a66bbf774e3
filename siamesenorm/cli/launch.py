"""torchrun, with the run's outcome as the exit status: 0 finished, 3 diverged (the divergence guard stopped it),
otherwise torchrun's own status. torchrun itself exits 1 whenever a worker fails, so a sweep could not tell a
diverged run from a crash without this.

  python scripts/launch.py --nproc_per_node 8 configs/OLMo-1B-2e-3.yaml --save_folder=runs/OLMo-1B-2e-3-post
  (MODEL_TYPE and every other environment variable pass through; arguments before the .yaml go to torchrun)
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from siamesenorm.run.records import RECORD_NAME
from siamesenorm.run.stability import EXIT_DIVERGED

ROOT = Path(__file__).resolve().parents[2]

USAGE = "usage: python scripts/launch.py [torchrun options] CONFIG.yaml [--key=value ...]"
HELP = f"""{USAGE}

Runs scripts/train.py under torchrun and exits with the run's outcome: 0 when it finished, {EXIT_DIVERGED} when the
divergence guard stopped it, otherwise torchrun's own status (1 for a crash, 143 after SIGTERM).

  torchrun options   everything before the .yaml, passed to torchrun as is (--nproc_per_node 8, --nnodes 2, ...)
  CONFIG.yaml        the recipe (configs/*.yaml)
  --key=value ...    overrides after the .yaml, passed to scripts/train.py (see: python scripts/train.py --help)

MODEL_TYPE and every other environment variable pass through to the workers.
  MODEL_TYPE=hybrid_pre python scripts/launch.py --nproc_per_node 8 configs/OLMo-1B-hybrid-2e-3.yaml \\
      --save_folder=runs/OLMo-1B-hybrid_pre"""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    split = next((i for i, a in enumerate(argv) if a.endswith((".yaml", ".yml"))), None)
    if split is None and any(a in ("-h", "--help") for a in argv):
        print(HELP)
        return 0
    if split is None:
        print(f"{USAGE}\nerror: no CONFIG.yaml among the arguments; see --help", file=sys.stderr)
        return 2
    torchrun_args, config, overrides = argv[:split], argv[split], argv[split + 1 :]
    from siamesenorm.run.recipe_keys import unknown_key  # a typo: one line before torchrun starts any worker

    typo = unknown_key(config, overrides)
    if typo:
        print(f"error: {typo}", file=sys.stderr)
        return 2
    from siamesenorm.run.lifecycle import QUIET_DIVERGENCE  # after --help: it imports torch and OLMo

    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args, str(ROOT / "scripts" / "train.py"), config,
           *overrides]
    started = time.time()
    code = subprocess.call(cmd, env={**os.environ, QUIET_DIVERGENCE: "1"})
    from siamesenorm.run.recipe import load_config

    options = [o for o in overrides if o.startswith("--") and o != "--dry-run"]
    record = Path(load_config(config, options).save_folder) / RECORD_NAME
    outcome = json.loads(record.read_text()) if record.is_file() else {}
    if outcome.get("status") == "diverged" and outcome.get("updated", 0) >= started:  # this launch's record
        print(f"launch: the run diverged at step {outcome.get('diverged_at_step')}: {outcome.get('divergence')} "
              f"(record: {record}); exit status {EXIT_DIVERGED}", file=sys.stderr)
        return EXIT_DIVERGED
    return code
