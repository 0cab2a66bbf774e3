"""Before launching a recipe: will it fit, how long will it take, is everything in place. Logic:
siamesenorm/cluster/preflight.py.

Logic: siamesenorm/cli/preflight.py; the same command: python -m siamesenorm preflight.
"""

import sys

from siamesenorm.cli.preflight import main

if __name__ == "__main__":
    sys.exit(main())
