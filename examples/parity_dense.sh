#!/usr/bin/env bash
# Engine-vs-trainer logprob parity of a dense GPT (4 layers, hidden 2048, GQA 16/4, vocab 32000,
# bf16) on one GPU, in BI and default mode; writes OUTPUT_JSON
# (default runs/parity_dense.json; the published file is results/parity_dense_h200.json).
# Usage: bash examples/parity_dense.sh [OUTPUT_JSON] [extra Megatron/parity flags...]
# (a first argument that starts with -- is a flag: the default output is kept)
set -euo pipefail
cd "$(dirname "$0")/.."
out=runs/parity_dense.json
if [[ $# -gt 0 && $1 != --* ]]; then out=$1; shift; fi
mkdir -p "$(dirname "$out")"
python tools/check_parity.py \
  --num-layers 4 --hidden-size 2048 --ffn-hidden-size 5632 \
  --num-attention-heads 16 --group-query-attention --num-query-groups 4 \
  --swiglu --untie-embeddings-and-output-weights --disable-bias-linear --bf16 \
  --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 1 \
  --flash-attention-version 4 --seed 1234 --inference-max-seq-length 1024 \
  --parity-modes bi default --parity-requests 32 --parity-prompt-lengths 1 500 \
  --parity-max-new-tokens 1 256 --parity-orders 2 --parity-output "$out" "$@"
