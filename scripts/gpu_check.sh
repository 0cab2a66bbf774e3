#!/usr/bin/env bash
# The GPU check on a machine with one GPU, torch and no package index (meant to end within 20 minutes on one
# H100/H200; not yet timed on one):
# installs this project and what the image lacks from a wheelhouse (filled by scripts/gpu_wheelhouse.sh where PyPI
# is reachable), then runs scripts/gpu_check.py and writes the report.
#
#   bash scripts/gpu_check.sh [WHEELHOUSE] [REPORT]     # defaults: wheelhouse/, results/gpu/report.md
#
# Relies on the image for: torch (CUDA), triton, numpy, pyarrow, transformers, safetensors, tokenizers,
# scikit-learn, matplotlib, torchmetrics, requests, rich, pyyaml, tqdm, filelock, fsspec, huggingface-hub.
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
cd "$(dirname "$0")/.."
WHEELS="${1:-wheelhouse}"
REPORT="${2:-results/gpu/report.md}"
PY="${PYTHON:-python3}"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'error: torch sees no CUDA GPU here')"
source scripts/gpu_site.sh
install_wheels "$WHEELS"
"$PY" scripts/gpu_check.py --report "$REPORT"
