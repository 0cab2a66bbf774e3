"""torchrun, with the run's outcome as the exit status: 0 finished, 3 diverged (the divergence guard stopped it),

Logic: siamesenorm/cli/launch.py; the same command: python -m siamesenorm launch.
"""

import sys

from siamesenorm.cli.launch import main

if __name__ == "__main__":
    sys.exit(main())
