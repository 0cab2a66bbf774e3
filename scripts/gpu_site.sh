# Sourced by scripts/gpu_check.sh and scripts/gpu_quick_check.sh (not run alone): install_wheels WHEELS installs
# the wheelhouse into a fresh private folder (mktemp: mode 0700, a name no other user can guess or plant a
# sitecustomize.py in beforehand), removed when the calling script ends however it ends, and puts this checkout's
# code first on PYTHONPATH, the wheels' packages next. Uses $PY (the Python that holds torch).
install_wheels() {
    local wheels=$1
    ls "$wheels"/*.whl >/dev/null 2>&1 || { echo "error: no wheels in $wheels: fill it with bash scripts/gpu_wheelhouse.sh on a machine with PyPI" >&2; exit 2; }
    SITE="$(mktemp -d "${TMPDIR:-/tmp}/siamesenorm-site.XXXXXXXX")"
    trap 'rm -rf "$SITE"' EXIT
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$wheels"/*.whl || exit 2
    export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
}
