"""Write a SLURM batch script for a multi-node run: one torchrun per node, c10d rendezvous on the first node.

Logic: siamesenorm/cli/make_sbatch.py; the same command: python -m siamesenorm make-sbatch.
"""

import sys

from siamesenorm.cli.make_sbatch import main

if __name__ == "__main__":
    sys.exit(main())
