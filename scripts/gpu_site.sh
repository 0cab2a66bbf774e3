# Sourced by scripts/gpu_check.sh, gpu_quick_check.sh and gpu_field_check.sh (not run alone): install_wheels
# WHEELS installs the wheelhouse into a fresh private folder (mktemp: mode 0700, a name no other user can guess or
# plant a sitecustomize.py in beforehand), removed when the calling script ends however it ends, and puts this
# checkout's code first on PYTHONPATH, the wheels' packages next. Uses $PY (the Python that holds torch).
# stage NAME LIMIT COMMAND... runs one stage of a lease under its own time limit (output in $DIR/NAME.log, exit
# code and seconds appended to $DIR/stages.txt), so a lease cut short keeps the stages that finished; "$PY" -c
# "$KERNEL_CHECK" OUT checks this project's kernels on the GPU against their references at d 2048
# (siamesenorm.nn.fused.check) into OUT (JSON).
install_wheels() {
    local wheels=$1
    ls "$wheels"/*.whl >/dev/null 2>&1 || { echo "error: no wheels in $wheels: fill it with bash scripts/gpu_wheelhouse.sh on a machine with PyPI" >&2; exit 2; }
    SITE="$(mktemp -d "${TMPDIR:-/tmp}/siamesenorm-site.XXXXXXXX")"
    trap 'rm -rf "$SITE"' EXIT
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$wheels"/*.whl || exit 2
    export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
}

stage() {  # stage NAME LIMIT COMMAND...: its output to NAME.log, its exit code and seconds to stages.txt
    local name=$1 limit=$2 start=$SECONDS; shift 2
    local command="$*"
    echo "== $name (limit ${limit} s): ${command:0:240}"
    timeout -k 10 "$limit" "$@" > "$DIR/$name.log" 2>&1
    local code=$?
    echo "$name exit $code after $((SECONDS - start)) s" | tee -a "$DIR/stages.txt"
    tail -n 12 "$DIR/$name.log"
}
KERNEL_CHECK=$(cat <<'EOF'
import json, os, sys, time
import torch
from siamesenorm.nn import fused
out, results = sys.argv[1], []
# bf16, every combination; then fp64 inputs, one combination an op with every part on (fused.SIZE_CASES): the fp64
# pass over every combination did not fit the first lease's stage (Triton compiles each combination anew)
# (CHECK_D, default 2048: a smaller width for a dry run of a lease's script on a CPU, the torch path checked)
device, D = ("cuda" if torch.cuda.is_available() else "cpu"), int(os.environ.get("CHECK_D", 2048))
for d, rows, dtype, tol, select in ((D, (3, 67), torch.bfloat16, 3e-2, None),
                                    (D, (3, 67), torch.float64, fused.AT_SIZE_FP64_TOL, fused.SIZE_CASES)):
    start, seen = time.time(), []
    bad = fused.check(device, d=d, rows=rows, seen=seen, dtype=dtype, tol=tol, select=select)
    kernels = "triton" if fused.available(torch.zeros(1, device=device)) else "torch"
    results.append({"d": d, "rows": list(rows), "dtype": str(dtype), "tol": tol, "kernels": kernels,
                    "combinations": len(seen), "mismatches": [str(b) for b in bad[:5]], "n_mismatches": len(bad),
                    "seconds": round(time.time() - start, 1)})
    print(results[-1], flush=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
EOF
)
