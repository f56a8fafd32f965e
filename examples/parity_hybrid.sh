#!/usr/bin/env bash
# Engine-vs-trainer logprob parity of a hybrid GDN model (pattern G-G-G-*- twice: 6 GDN and
# 2 attention mixers, each followed by an MLP; hidden 1024, bf16) on one GPU, BI and default mode;
# writes OUTPUT_JSON (default runs/parity_hybrid.json; the published file is results/parity_hybrid_h200.json).
# Usage: bash examples/parity_hybrid.sh [OUTPUT_JSON] [extra Megatron/parity flags...]
# (a first argument that starts with -- is a flag: the default output is kept)
set -euo pipefail
cd "$(dirname "$0")/.."
out=runs/parity_hybrid.json
if [[ $# -gt 0 && $1 != --* ]]; then out=$1; shift; fi
mkdir -p "$(dirname "$out")"
python tools/check_parity.py \
  --hybrid-layer-pattern G-G-G-*-G-G-G-*- --hidden-size 1024 --ffn-hidden-size 2816 \
  --num-attention-heads 8 --group-query-attention --num-query-groups 2 \
  --linear-num-key-heads 4 --linear-num-value-heads 8 --linear-key-head-dim 128 \
  --linear-value-head-dim 128 --linear-conv-kernel-dim 4 \
  --swiglu --untie-embeddings-and-output-weights --disable-bias-linear --bf16 \
  --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 1 \
  --flash-attention-version 4 --seed 1234 --inference-max-seq-length 1024 \
  --parity-modes bi default --parity-requests 32 --parity-prompt-lengths 1 500 \
  --parity-max-new-tokens 1 256 --parity-orders 2 --parity-output "$out" "$@"
