"""The GPU check: each seed MODEL_TYPE trained on one GPU (bf16, FSDP, compiled blocks), stopped and resumed,

Logic: siamesenorm/cli/gpu_check.py; the same command: python -m siamesenorm gpu-check.
"""

import sys

from siamesenorm.cli.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
