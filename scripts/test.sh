#!/usr/bin/env bash
# Install (once) and run the test suite on CPU. With no arguments: every test under tests/. Arguments are passed
# to pytest and replace that default when they name tests (bash scripts/test.sh tests/analysis/test_tables.py -x).
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  echo "usage: bash scripts/test.sh [pytest arguments]"
  echo "Sets up .venv once (scripts/setup_env.sh), then runs pytest on CPU: every test under tests/ by default;"
  echo "arguments that name tests replace that default (bash scripts/test.sh tests/analysis/test_tables.py -x), others are"
  echo "passed to pytest as they are (bash scripts/test.sh -k hybrid_pre). The whole suite runs in one pytest-xdist worker"
  echo "a core, at most 4 (-n 0: one process). pytest's own options: python -m pytest --help."
  exit 0
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/setup_env.sh
targets=(tests)
for arg in "$@"; do
  case "$arg" in
    tests*|*.py|*::*) targets=() ;;
  esac
done
report=()
if [ ${#targets[@]} -gt 0 ]; then
  report=(--durations=25)  # the whole suite: its 25 slowest tests at the end
  # ... in one pytest-xdist worker a core (at most 4; a test file stays on one worker, so its module fixtures are
  # built once), unless the arguments choose (-n 0: one process)
  workers=$(nproc 2>/dev/null || echo 1)
  if [ "$workers" -gt 4 ]; then workers=4; fi
  case " $* " in *" -n"*|*" --numprocesses"*|*" no:xdist "*) workers=1 ;; esac  # -n 0, -n0, -n=2, -p no:xdist
  # (in the order tests/conftest.py gives: the longest files first; xdist would otherwise sort by count of tests)
  if [ "$workers" -gt 1 ]; then report+=(-n "$workers" --dist loadfile --no-loadscope-reorder); fi
fi
python -m pytest -q -p no:cacheprovider ${report[@]+"${report[@]}"} "$@" ${targets[@]+"${targets[@]}"}
