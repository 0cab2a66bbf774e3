"""What each MODEL_TYPE costs against Pre-Norm: step time, tokens/s, activation memory, parameters, FLOPs per

Logic: siamesenorm/cli/benchmark.py; the same command: python -m siamesenorm benchmark.
"""

import sys

from siamesenorm.cli.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
