#!/usr/bin/env bash
# Install (once) and run the test suite on CPU. With no arguments: every test under tests/. Arguments are passed
# to pytest and replace that default when they name tests (bash scripts/test.sh tests/test_tables.py -x).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/setup_env.sh
targets=(tests)
for arg in "$@"; do
  case "$arg" in
    tests*|*.py|*::*) targets=() ;;
  esac
done
python -m pytest -q -p no:cacheprovider "$@" "${targets[@]}"
