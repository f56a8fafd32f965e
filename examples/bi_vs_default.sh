#!/usr/bin/env bash
# Why BI matters: the same RL job in default and in BI mode, on the tiny recipe widened to hidden
# 2048 (at the recipe's own size stock kernels happen to give the engine's bits too), with TIS in
# default mode as the usual mitigation; both parity curves and rewards on one figure.
# Usage: bash examples/bi_vs_default.sh [STEPS] -> runs/bi_vs_default/{default,bi}.jsonl, .png
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-30}; out=runs/bi_vs_default
mkdir -p "$out"; rm -f "$out"/default.jsonl "$out"/bi.jsonl
wide=(--recipe examples/recipes/tiny_sort.yaml --hidden-size 2048 --ffn-hidden-size 5632
      --num-attention-heads 16 --num-query-groups 4 --rl-sft-warmup-steps 60 --rl-sft-lr 3e-4
      --lr 1e-4 --flash-attention-version 4 --train-iters "$steps"
      --save "$out/checkpoints" --save-interval 100000)
torchrun --standalone --nproc-per-node 1 pretrain_rl.py "${wide[@]}" --rl-metrics-jsonl "$out/default.jsonl" \
  --rl-inference-logprobs-is-correction --rl-importance-sampling-truncation-coef 2.0
torchrun --standalone --nproc-per-node 1 pretrain_rl.py "${wide[@]}" --rl-metrics-jsonl "$out/bi.jsonl" \
  --batch-invariant-mode
python tools/plot_metrics.py "$out/default.jsonl" "$out/bi_vs_default.png" --label default \
  --also "$out/bi.jsonl:BI" --title "trainer vs engine logprobs: default kernels vs batch-invariant"
