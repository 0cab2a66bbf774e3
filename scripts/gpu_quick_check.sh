#!/usr/bin/env bash
# The GPU check's cost-model half, for a lease of minutes (one GPU, torch, no package index; about 9 minutes on
# an H200 before the tuning stage, about 12 with it by estimate, the start not counted), the figures the cost
# model's targets are stated in first: the step times of pre, post_pre, hybrid_pre, hc and mhc at the 1.3B width
# (4 layers, batch 4 x 2048, bf16 autocast as the recipe trains), eager fused on; the same five compiled, fused
# on; this project's kernels under candidate launch sizes (scripts/benchmark.py --tune-kernels); where each eager
# step's device time goes (torch.profiler: --profile); eager fused off; the fused kernels against their
# references at the recipes' width in bf16 (siamesenorm.nn.fused.check). Each stage has its own time limit and
# writes into OUTDIR as it ends, so a lease cut short still returns the stages that finished. The training half
# (the seed variants under torchrun, resume, export) is scripts/gpu_check.sh.
#
#   bash scripts/gpu_quick_check.sh [WHEELHOUSE] [OUTDIR]    # defaults: wheelhouse/, results/gpu/quick
#
# Stage limits (seconds) by environment: T_EAGER (each eager timing, 120), T_COMPILED (260), T_TUNE (240),
# T_PROFILE (90), T_KERNELS (150). On one H100 (2026-11-27) the timings took 65 (eager, fused on), 198 (compiled)
# and 40 s (eager, fused off), the profile about 60, and the bf16 kernel check did not end in 100 s; the tuning
# stage had not run. OUTDIR holds 15 files: tar it where a lease returns fewer.
set -uo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
cd "$(dirname "$0")/.."
WHEELS="${1:-wheelhouse}"
DIR="${2:-results/gpu/quick}"
PY="${PYTHON:-python3}"
mkdir -p "$DIR"
source scripts/gpu_site.sh
install_wheels "$WHEELS"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch, numpy, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'numpy', numpy.__version__, 'triton', triton.__version__)"
} > "$DIR/environment.txt" 2>&1
cat "$DIR/environment.txt"
ARGS=(--recipe configs/OLMo-1B-2e-3.yaml --layers 4 --batch 4 --seq 2048 --repeats 5 --steps-per-timing 2
      --model-types pre post_pre hybrid_pre hc mhc)
eager() {
    stage "eager-fused-$1" "${T_EAGER:-120}" "$PY" scripts/benchmark.py "${ARGS[@]}" --modes eager \
        --fused "$1" --json "$DIR/eager-fused-$1.json"
}
eager on
stage compiled-fused-on "${T_COMPILED:-260}" "$PY" scripts/benchmark.py "${ARGS[@]}" --modes compiled --fused on \
    --json "$DIR/compiled-fused-on.json"
stage tune-kernels "${T_TUNE:-240}" "$PY" scripts/benchmark.py --recipe configs/OLMo-1B-2e-3.yaml --layers 2 \
    --batch 4 --seq 2048 --steps-per-timing 2 --model-types hybrid_pre hc mhc --tune-kernels \
    --json "$DIR/tune-kernels.json"
stage profile-eager "${T_PROFILE:-90}" "$PY" scripts/benchmark.py "${ARGS[@]}" --modes eager --fused on --profile \
    --json "$DIR/profile-eager.json"
eager off
stage kernels "${T_KERNELS:-150}" "$PY" -c "$KERNEL_CHECK" "$DIR/kernels.json"
