#!/usr/bin/env bash
# Where engine and trainer part, component by component, and what each batch-invariant piece buys
# (tools/parity_doctor.py --ablate), in BI and default mode on one GPU, for the tiny recipe's model
# widened to hidden 2048 (dense, as examples/bi_vs_default.sh: there the stock kernels disagree
# with the engine) or the tiny hybrid recipe's GDN model; writes OUTPUT_JSON (default
# runs/parity_doctor_MODEL.json; the published files are results/parity_doctor_MODEL_h100.json).
# Usage: bash examples/parity_doctor.sh dense|hybrid [OUTPUT_JSON] [extra flags...]
# (a second argument that starts with -- is a flag: the default output is kept)
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash examples/parity_doctor.sh dense|hybrid [OUTPUT_JSON] [extra flags...]"
model=${1:-}
case $model in
  dense) flags=(--recipe examples/recipes/tiny_sort.yaml --hidden-size 2048 --ffn-hidden-size 5632
                --num-attention-heads 16 --num-query-groups 4) ;;
  hybrid) flags=(--recipe examples/recipes/tiny_sort_hybrid.yaml) ;;
  *) echo "examples/parity_doctor.sh: error: MODEL must be dense or hybrid, got '$model'; $usage" >&2; exit 2 ;;
esac
shift
out=runs/parity_doctor_$model.json
if [[ $# -gt 0 && $1 != --* ]]; then out=$1; shift; fi
mkdir -p "$(dirname "$out")"
# longer than the recipe's 64 tokens: prompts of up to 128 tokens, completions of up to 64
python tools/parity_doctor.py "${flags[@]}" --seq-length 256 --max-position-embeddings 256 \
  --inference-max-seq-length 256 --batch-invariant-mode --flash-attention-version 4 \
  --parity-modes bi default --parity-requests 16 --ablate --json "$out" "$@"
