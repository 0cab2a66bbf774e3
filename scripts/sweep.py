"""Run a sweep plan (methods x learning rates x seeds over one recipe), a few processes at a time; rerunning it

Logic: siamesenorm/cli/sweep.py; the same command: python -m siamesenorm sweep.
"""

import sys

from siamesenorm.cli.sweep import main

if __name__ == "__main__":
    sys.exit(main())
