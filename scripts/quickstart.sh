#!/usr/bin/env bash
# The embedded default: install, tokenize the shipped Austen corpus, train the tiny CPU recipe (300 steps, a few
# minutes on 2 cores), then say where the results are and what to run next.
#   Usage: bash scripts/quickstart.sh [MODEL_TYPE]      (default: $MODEL_TYPE if set, else pre)
set -euo pipefail
case "${1:-}" in
  -h|--help) sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  -*) echo "error: unknown option $1; usage: bash scripts/quickstart.sh [MODEL_TYPE]" >&2; exit 2 ;;
esac
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/setup_env.sh
if [ -n "${1:-}" ]; then export MODEL_TYPE="$1"; fi
NAME="${MODEL_TYPE:-pre}"
if [ "$NAME" = hybrid_pre ]; then OTHER=pre; OTHER_WHAT="Pre-Norm"; else OTHER=hybrid_pre; OTHER_WHAT="SiameseNorm"; fi
DATA=data/prepared/austen-2k
if [ ! -f "$DATA/manifest.json" ]; then
  python scripts/prepare_data.py data/austen.jsonl.gz --tokenizer data/tokenizer-austen-2k.json \
    --docs-per-unit 50 --output "$DATA"
fi
RUN="runs/quickstart-$NAME"
python scripts/train.py configs/tiny-cpu.yaml --save_folder="$RUN" --save_overwrite
# The Next: lines run as printed in a new shell: the environment's python by its path (relative to the repository
# when the environment is inside it), since a new shell has not activated it.
PY="$VENV/bin/python"
case "$PY" in "$ROOT"/*) PY="${PY#"$ROOT"/}" ;; esac
cat <<NEXT

Results in $RUN/: run.json (the record: status, final loss, validation perplexity), metrics.jsonl (loss and
gradient norm per step), console.log (this output), config.yaml, latest-unsharded/ (the trained model).
Next (from the repository root, in any shell; or 'source $VENV/bin/activate' once and type python):
  $PY scripts/generate.py $RUN --prompt "It is a truth universally acknowledged"
  $PY scripts/export_hf.py $RUN exports/quickstart-$NAME      # a Hugging Face transformers folder
  $PY scripts/analyze.py loss-curves $RUN --output analysis/quickstart-$NAME
  bash scripts/quickstart.sh $OTHER                                # the same run with $OTHER_WHAT
  $PY scripts/make_tables.py runs/                              # Table 1 from every run under runs/
NEXT
