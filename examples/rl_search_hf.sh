#!/usr/bin/env bash
# A published architecture with random weights on the search environment, in Search-R1's shape:
# 8 prompts x 8 samples, turns of up to 512 new tokens within a 4,096-token conversation, up to 4
# turns, BI mode, engine CUDA graphs, one GPU, the KV cache half of the memory free while
# generating (64 conversations of 4,096 tokens of Qwen3-0.6B take ~30 GB). The prompts and the
# corpus are the lookup task's.
# Random weights never write a tag: every turn after the first follows the environment's "no
# action" reminder, so the run checks parity over multi-turn conversations at this size, not
# learning (the tiny lookup recipe is the learning run).
# Usage: bash examples/rl_search_hf.sh qwen3-0.6b|qwen3.5-2b [STEPS] [extra flags]
# Writes runs/PRESET_search/: hf/, metrics.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
preset=$1; steps=${2:-5}; shift $(( $# < 2 ? $# : 2 ))
run=runs/${preset}_search
python tools/random_hf_checkpoint.py "$preset" "$run"
rm -f "$run/metrics.jsonl"
torchrun --nproc-per-node 1 pretrain_rl.py --hf-checkpoint "$run/hf" --bf16 --flash-attention-version 4 \
  --transformer-impl local --batch-invariant-mode \
  --cuda-graph-impl local --inference-cuda-graph-scope block --decode-only-cuda-graphs \
  --rl-task lookup --rl-env search --rl-max-turns 4 --rl-max-new-tokens 512 --rl-max-context-tokens 4096 \
  --inference-max-seq-length 4096 --rl-kv-cache-memory-fraction 0.5 \
  --grpo-prompts-per-step 8 --grpo-group-size 8 --lr 1e-6 \
  --train-iters "$steps" --rl-metrics-jsonl "$run/metrics.jsonl" "$@"
