"""Write a SLURM batch script for a multi-node run: one torchrun per node, c10d rendezvous on the first node.
Logic: siamesenorm/cluster/slurm.py; an example: scripts/slurm/OLMo-1B-hybrid-2e-3-4x8.sbatch.

  python scripts/slurm/make_sbatch.py --nodes 4 --gpus-per-node 8 --model-type hybrid_pre \\
      configs/OLMo-1B-hybrid-2e-3.yaml --save_folder=runs/OLMo-1B-hybrid-2e-3-hybrid_pre > job.sbatch
  sbatch job.sbatch          # again after a failure or the time limit: resumes from the latest checkpoint
"""

import argparse
import sys
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="the recipe (configs/*.yaml); overrides (--key=value) follow it")
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the job (default 1)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs a node, one process each (default 8)")
    parser.add_argument("--cpus-per-node", type=int, default=64,
                        help="CPU cores a node (default 64); OMP_NUM_THREADS is this over the GPUs")
    parser.add_argument("--time", default="7-00:00:00", help="the job's time limit (SLURM's format)")
    parser.add_argument("--partition", default=None, help="the SLURM partition (default: the cluster's)")
    parser.add_argument("--job-name", default="siamesenorm", help="the job's name in squeue and the log's name")
    parser.add_argument("--model-type", default=None, help="MODEL_TYPE written into the script (it wins over the "
                        "environment's at submission, which is named in a warning line if it differs)")
    parser.add_argument("--output", "-o", default=None, help="write here instead of standard output")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not o.startswith("--")]
    if bad:
        parser.error(f"unexpected argument {bad[0]!r}: overrides are --key=value after the config")
    if args.nodes < 1 or args.gpus_per_node < 1:
        parser.error("--nodes and --gpus-per-node must be >= 1")
    if not Path(args.config).is_file():
        parser.error(f"config file {args.config} not found; pick one from configs/")
    if args.model_type is not None:
        from siamesenorm.models.config import MODEL_TYPES

        if args.model_type not in MODEL_TYPES:
            parser.error(f"unknown --model-type {args.model_type!r}; use one of {', '.join(MODEL_TYPES)}")
    from siamesenorm.cluster.slurm import sbatch_script

    try:
        text = sbatch_script(args.config, overrides, args.nodes, args.gpus_per_node, args.time, args.cpus_per_node,
                             args.partition, args.job_name, args.model_type)
    except ValueError as e:
        parser.error(str(e))
    if args.output:
        Path(args.output).write_text(text)
        Path(args.output).chmod(0o755)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
