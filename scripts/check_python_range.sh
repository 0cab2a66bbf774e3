#!/usr/bin/env bash
# Does every pinned dependency resolve to wheels on each Python version? Resolves (pip --dry-run, metadata only,
# nothing installed) pyproject.toml's dependencies for Linux x86_64 on Python 3.10-3.13 and prints ok / fails per
# version; requires-python should admit exactly the versions that print ok. Needs network access to PyPI.
#   bash scripts/check_python_range.sh
set -uo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
if [ -n "${1:-}" ]; then echo "error: unexpected argument $1; usage: bash scripts/check_python_range.sh" >&2; exit 2; fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
mapfile -t DEPS < <("$PY" -c "import tomllib,sys; [print(d) for d in tomllib.load(open(sys.argv[1],'rb'))['project']['dependencies']]" "$ROOT/pyproject.toml")
PLATFORMS=(--platform linux_x86_64 --platform manylinux1_x86_64 --platform manylinux2014_x86_64)
for glibc in $(seq 5 39); do PLATFORMS+=(--platform "manylinux_2_${glibc}_x86_64"); done
for version in 3.10 3.11 3.12 3.13; do
  out="$("$PY" -m pip install --dry-run --quiet --ignore-installed --only-binary=:all: --python-version "$version" \
        "${PLATFORMS[@]}" --target "$(mktemp -d)" "${DEPS[@]}" 2>&1)"
  if [ $? -eq 0 ]; then
    echo "Python $version: ok"
  else
    echo "Python $version: fails: $(echo "$out" | grep -m1 -E 'ERROR|error' )"
  fi
done
