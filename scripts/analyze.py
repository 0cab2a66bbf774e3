"""The paper's analyses on checkpoints and runs; each tool writes <output>/<tool>.json and <output>/<tool>.png.

Logic: siamesenorm/cli/analyze.py; the same command: python -m siamesenorm analyze.
"""

import sys

from siamesenorm.cli.analyze import main

if __name__ == "__main__":
    sys.exit(main())
