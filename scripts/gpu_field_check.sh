#!/usr/bin/env bash
# The 2026-field designs on a GPU, for a lease of 15 minutes in two calls (one GPU, torch, no package
# index): step time, peak memory and MFU of keel, lns, prores and attnres (Full) beside pre, post_pre, hybrid_pre,
# hc and mhc, and of SiameseNorm with dynamic stream mixing (model.siamese_mixing=dynamic) beside pre, at the 1.3B
# width cut to 4 layers, batch 4 x 2048, bf16 autocast as the recipe trains, fused on; and this project's kernels
# against their references (the bf16 pass over every combination; pair_mix, the mixing's op, among them).
#
#   bash scripts/gpu_field_check.sh 1 [WHEELHOUSE] [OUTDIR]   # eager timings and the kernel check (about 5 min)
#   bash scripts/gpu_field_check.sh 2 [WHEELHOUSE] [OUTDIR]   # compiled timings (about 5 min)
#
# Defaults: wheelhouse/ (bash scripts/gpu_wheelhouse.sh --slim wheelhouse), results/gpu/field. Each stage has its
# own time limit (T_EAGER 120, T_MIX_EAGER 60, T_KERNELS 160: on the H200 the bf16 pass over 392 combinations did
# not end in 110; T_COMPILED 180, T_MIX_COMPILED 100 s) and writes into OUTDIR as it ends. RECIPE, LAYERS, BATCH,
# SEQ and REPEATS change the size; WHEELHOUSE "none" installs nothing (a dry run on a CPU with the project's
# environment: RECIPE=configs/tiny-cpu.yaml LAYERS=2 BATCH=1 SEQ=32 REPEATS=1 CHECK_D=64 PYTHON=.venv/bin/python
# bash scripts/gpu_field_check.sh 1 none /tmp/field).
set -uo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ] || [ -z "${1:-}" ]; then
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
    [ -n "${1:-}" ]; exit $?
fi
cd "$(dirname "$0")/.."
PART=$1
WHEELS="${2:-wheelhouse}"
DIR="${3:-results/gpu/field}"
PY="${PYTHON:-python3}"
mkdir -p "$DIR"
source scripts/gpu_site.sh
[ "$WHEELS" = none ] || install_wheels "$WHEELS"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
ARGS=(--recipe "${RECIPE:-configs/OLMo-1B-2e-3.yaml}" --layers "${LAYERS:-4}" --batch "${BATCH:-4}"
      --seq "${SEQ:-2048}" --repeats "${REPEATS:-5}" --steps-per-timing 2 --fused on)
FIELD=(--model-types post_pre hybrid_pre keel lns prores)
MIX=(--model-types hybrid_pre post_pre --set model.siamese_mixing=dynamic)
case "$PART" in
1)
    { command -v nvidia-smi >/dev/null &&
          nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      "$PY" -c "import torch, numpy
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'numpy', numpy.__version__)"
    } > "$DIR/environment.txt" 2>&1
    cat "$DIR/environment.txt"
    stage eager-field "${T_EAGER:-120}" "$PY" scripts/benchmark.py "${ARGS[@]}" "${FIELD[@]}" hc mhc attnres \
        --modes eager --json "$DIR/eager-field.json"
    stage eager-mixing "${T_MIX_EAGER:-60}" "$PY" scripts/benchmark.py "${ARGS[@]}" "${MIX[@]}" --modes eager \
        --json "$DIR/eager-mixing.json"
    stage kernels "${T_KERNELS:-160}" "$PY" -c "$KERNEL_CHECK" "$DIR/kernels.json"
    ;;
2)
    stage compiled-field "${T_COMPILED:-180}" "$PY" scripts/benchmark.py "${ARGS[@]}" "${FIELD[@]}" \
        --modes compiled --json "$DIR/compiled-field.json"
    stage compiled-mixing "${T_MIX_COMPILED:-100}" "$PY" scripts/benchmark.py "${ARGS[@]}" "${MIX[@]}" \
        --modes compiled --json "$DIR/compiled-mixing.json"
    ;;
*)
    echo "error: part $PART: use 1 (eager and kernels) or 2 (compiled)" >&2; exit 2 ;;
esac
