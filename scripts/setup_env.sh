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
  # A pin of [tool.siamesenorm] into a folder of its own under $VENV, without dependencies; the tests put that folder
  # on the path where they need it (pyproject.toml says why each is not in the environment itself).
  install_beside() {  # KEY PACKAGE WHAT
    local pin
    pin="$("$VENV/bin/python" -c "import sys, tomllib; print(tomllib.load(open(sys.argv[1], 'rb'))['tool']['siamesenorm'][sys.argv[2]])" "$ROOT/pyproject.toml" "$1")"
    echo "[setup] $pin into $VENV/$1, $3"
    rm -rf "${VENV:?}/$1"
    "$VENV/bin/python" -m pip install --progress-bar off --no-deps --target "$VENV/$1" "$pin" 2>&1 \
      | grep --line-buffered -E "^(Successfully installed|ERROR: (Could|No matching))" | sed -u 's/^/[setup] /' || true
    test -d "$VENV/$1/$2" || { echo "[setup] $pin did not install; see pip's messages above" >&2; exit 1; }
  }
  install_beside triton-interpreter triton "for the tests of the fused kernels in Triton's interpreter"
  install_beside transformers-newest transformers "for the tests of exports under the newest transformers"
  "$VENV/bin/python" -c "import siamesenorm, olmo, transformers, siamesenorm.olmo_core.config" \
    || { echo "[setup] the install failed; see pip's messages above" >&2; exit 1; }
  echo "$WANT" > "$STAMP"
  echo "[setup] done"
fi
export PATH="$VENV/bin:$PATH"
