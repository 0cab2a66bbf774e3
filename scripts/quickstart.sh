#!/usr/bin/env bash
# The embedded default: install, tokenize the shipped Austen corpus, train the tiny CPU recipe, print the final
# training loss and validation perplexity.  Usage: bash scripts/quickstart.sh [MODEL_TYPE]   (default: pre)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/setup_env.sh
export MODEL_TYPE="${1:-${MODEL_TYPE:-pre}}"
DATA=data/prepared/austen-2k
if [ ! -f "$DATA/manifest.json" ]; then
  python scripts/prepare_data.py data/austen.jsonl.gz --tokenizer data/tokenizer-austen-2k.json \
    --docs-per-unit 50 --output "$DATA"
fi
RUN="runs/quickstart-$MODEL_TYPE"
echo "Training MODEL_TYPE=$MODEL_TYPE with configs/tiny-cpu.yaml into $RUN ..."
mkdir -p runs
set +e
python scripts/train.py configs/tiny-cpu.yaml --save_folder="$RUN" --save_overwrite 2>&1 | tee "$RUN.log" \
  | grep --line-buffered -E "siamesenorm.train: MODEL_TYPE=[a-z_]* \\(|step=[0-9]*00/|eval/.*Perplexity|final training loss|error"
code=${PIPESTATUS[0]}
set -e
if [ "$code" -ne 0 ]; then
  echo "training failed (exit $code); the last lines of $RUN.log:" >&2
  tail -n 30 "$RUN.log" >&2
  exit "$code"
fi
