#!/usr/bin/env bash
# Create .venv (or use $VENV) and install the project with its pinned dependencies, once per pyproject.toml change.
# Sourced by scripts/quickstart.sh and scripts/test.sh.
set -euo pipefail
if [ "${BASH_SOURCE[0]}" = "$0" ] && [ $# -gt 0 ]; then  # run, not sourced: only --help is an argument
  case "$1" in
    -h|--help)
      echo "usage: bash scripts/setup_env.sh"
      echo "Creates .venv (or \$VENV) with \$PYTHON (default python3) and installs this project with its pinned"
      echo "dependencies (pyproject.toml), again only when pyproject.toml changes; OLMo-core 3 for the OLMo-core path"
      echo "Triton for the kernel tests (in \$VENV/triton-interpreter) and the newest transformers for the export"
      echo "tests (in \$VENV/transformers-newest) come in steps of their own"
      echo "(pyproject.toml, [tool.siamesenorm], says why). scripts/quickstart.sh and scripts/test.sh source it;"
      echo "'source scripts/setup_env.sh' also puts the environment on PATH."
      exit 0 ;;
    *) echo "setup_env.sh: unknown argument '$1'; it takes none (see --help)" >&2; exit 2 ;;
  esac
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.siamesenorm-installed"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[setup] installing siamesenorm and its pinned dependencies into $VENV (a few minutes the first time;"
  echo "[setup] the list below is pip's progress, one line per package)"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip 2>&1 | grep -E "^(ERROR|error)" || true
  "$VENV/bin/python" -m pip install --progress-bar off -e "$ROOT[dev,olmo-core]" 2>&1 \
    | grep --line-buffered -E "^(Collecting|Successfully installed|ERROR|error)" | sed -u 's/^/[setup] /' || true
  # OLMo-core 3 beside ai2-olmo 0.6.0, whose pin of ai2-olmo-core 0.1.0 it replaces (pyproject.toml, [tool.siamesenorm])
  CORE_PIN="$("$VENV/bin/python" -c "import sys, tomllib; print(tomllib.load(open(sys.argv[1], 'rb'))['tool']['siamesenorm']['olmo-core'])" "$ROOT/pyproject.toml")"
  echo "[setup] $CORE_PIN for the OLMo-core path (without dependencies: it replaces ai2-olmo's pin of 0.1.0)"
  "$VENV/bin/python" -m pip install --progress-bar off --no-deps "$CORE_PIN" 2>&1 \
    | grep --line-buffered -E "^(Successfully installed|ERROR: (Could|No matching))" | sed -u 's/^/[setup] /' || true
  TRITON_PIN="$("$VENV/bin/python" -c "import sys, tomllib; print(tomllib.load(open(sys.argv[1], 'rb'))['tool']['siamesenorm']['triton-interpreter'])" "$ROOT/pyproject.toml")"
  echo "[setup] $TRITON_PIN into $VENV/triton-interpreter, for the tests of the fused kernels in Triton's interpreter"
  rm -rf "$VENV/triton-interpreter"
  "$VENV/bin/python" -m pip install --progress-bar off --no-deps --target "$VENV/triton-interpreter" "$TRITON_PIN" 2>&1 \
    | grep --line-buffered -E "^(Successfully installed|ERROR: (Could|No matching))" | sed -u 's/^/[setup] /' || true
  test -d "$VENV/triton-interpreter/triton" || { echo "[setup] $TRITON_PIN did not install; see pip's messages above" >&2; exit 1; }
  NEWEST_PIN="$("$VENV/bin/python" -c "import sys, tomllib; print(tomllib.load(open(sys.argv[1], 'rb'))['tool']['siamesenorm']['transformers-newest'])" "$ROOT/pyproject.toml")"
  echo "[setup] $NEWEST_PIN into $VENV/transformers-newest, for the tests of exports under the newest transformers"
  rm -rf "$VENV/transformers-newest"
  "$VENV/bin/python" -m pip install --progress-bar off --no-deps --target "$VENV/transformers-newest" "$NEWEST_PIN" 2>&1 \
    | grep --line-buffered -E "^(Successfully installed|ERROR: (Could|No matching))" | sed -u 's/^/[setup] /' || true
  test -d "$VENV/transformers-newest/transformers" || { echo "[setup] $NEWEST_PIN did not install; see pip's messages above" >&2; exit 1; }
  "$VENV/bin/python" -c "import siamesenorm, olmo, transformers, siamesenorm.olmo_core.config" \
    || { echo "[setup] the install failed; see pip's messages above" >&2; exit 1; }
  echo "$WANT" > "$STAMP"
  echo "[setup] done"
fi
export PATH="$VENV/bin:$PATH"
