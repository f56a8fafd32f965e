#!/usr/bin/env bash
# A published architecture with random weights as an agent, in Search-R1's shape: 8 prompts x 8
# samples, turns of up to 512 new tokens within a 4,096-token conversation, up to 4 turns, BI
# mode, engine CUDA graphs, one GPU, the KV cache half of the memory free while generating (64
# conversations of 4,096 tokens of Qwen3-0.6B take ~30 GB).
#   search: the lookup task's prompts, searched in its corpus (or through a retrieval server:
#           --rl-search-url http://HOST:PORT/retrieve, tools/retrieval_server.py)
#   terminal: the shipped terminal tasks (examples/tasks/terminal_tiny.jsonl), each conversation's
#           commands run in the sandbox over its task's files, scored by the task's tests
# Random weights write no tag: every turn after the first follows the environment's "no action"
# reminder, so the run checks parity over multi-turn conversations at this size, not learning
# (the tiny lookup and terminal recipes are the learning runs).
# Usage: bash examples/rl_agent_hf.sh search|terminal qwen3-0.6b|qwen3.5-2b [STEPS] [extra flags]
# Writes runs/PRESET_ENV/: hf/, metrics.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
env=${1:-}; preset=${2:-}; steps=${3:-5}; shift $(( $# < 3 ? $# : 3 ))
case "$env" in
  search) task_flags=(--rl-task lookup --rl-env search) ;;
  terminal) task_flags=(--rl-task terminal --rl-env terminal --rl-dataset examples/tasks/terminal_tiny.jsonl) ;;
  *) echo "rl_agent_hf.sh: the first argument is the environment, search or terminal; got '$env'" >&2; exit 2 ;;
esac
[[ $steps =~ ^[0-9]+$ ]] || { echo "rl_agent_hf.sh: STEPS must be a number, got '$steps'" >&2; exit 2; }
run=runs/${preset}_$env
python tools/random_hf_checkpoint.py "$preset" "$run"
rm -f "$run/metrics.jsonl"
torchrun --standalone --nproc-per-node 1 pretrain_rl.py --hf-checkpoint "$run/hf" --bf16 --flash-attention-version 4 \
  --transformer-impl local --batch-invariant-mode \
  --cuda-graph-impl local --inference-cuda-graph-scope block --decode-only-cuda-graphs \
  "${task_flags[@]}" --rl-max-turns 4 --rl-max-new-tokens 512 --rl-max-context-tokens 4096 \
  --inference-max-seq-length 4096 --rl-kv-cache-memory-fraction 0.5 \
  --grpo-prompts-per-step 8 --grpo-group-size 8 --lr 1e-6 \
  --train-iters "$steps" --rl-metrics-jsonl "$run/metrics.jsonl" "$@"
