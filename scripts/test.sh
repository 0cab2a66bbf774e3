#!/usr/bin/env bash
# Install (once) and run the whole test suite on CPU. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/setup_env.sh
python -m pytest -q -p no:cacheprovider "$@" tests
