"""How far from 1 the column sums of mHC's Sinkhorn output stay after k iterations, by where the logits start

Logic: siamesenorm/cli/sinkhorn_convergence.py; the same command: python -m siamesenorm sinkhorn-convergence.
"""

import sys

from siamesenorm.cli.sinkhorn_convergence import main

if __name__ == "__main__":
    sys.exit(main())
