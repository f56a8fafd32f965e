#!/usr/bin/env bash
# Engine-vs-trainer logprob parity of a dense GPT (4 layers, hidden 2048, GQA 16/4, vocab 32000,
# bf16) on one GPU, in BI and default mode; writes results/parity_dense_<gpu>.json.
# Usage: bash examples/parity_dense.sh [OUTPUT_JSON] [extra Megatron/parity flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/parity_dense_h200.json}; shift || true
python tools/check_parity.py \
  --num-layers 4 --hidden-size 2048 --ffn-hidden-size 5632 \
  --num-attention-heads 16 --group-query-attention --num-query-groups 4 \
  --swiglu --untie-embeddings-and-output-weights --disable-bias-linear --bf16 \
  --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 1 \
  --flash-attention-version 4 --seed 1234 --inference-max-seq-length 1024 \
  --parity-modes bi default --parity-requests 32 --parity-prompt-lengths 1 500 \
  --parity-max-new-tokens 1 256 --parity-orders 2 --parity-output "$out" "$@"
