"""A GPU's measured kernel time beside the cost model's estimate of the same configuration.

Logic: siamesenorm/cli/gpu_compare.py; the same command: python -m siamesenorm gpu-compare.
"""

import sys

from siamesenorm.cli.gpu_compare import main

if __name__ == "__main__":
    sys.exit(main())
