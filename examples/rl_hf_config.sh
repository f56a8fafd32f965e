#!/usr/bin/env bash
# A published architecture with random weights, end to end on one GPU: written as a Hugging Face
# directory by transformers (tools/random_hf_checkpoint.py), imported with --hf-checkpoint, STEPS
# BI RL steps of 2 prompts x 4 samples at NEW_TOKENS new tokens, exported with --save-hf, and the
# export checked against transformers' own forward (tools/convert_hf.py verify).
# Usage: bash examples/rl_hf_config.sh qwen3-0.6b|qwen3.5-2b [STEPS] [NEW_TOKENS] [extra flags]
set -euo pipefail
cd "$(dirname "$0")/.."
preset=$1; steps=${2:-10}; new_tokens=${3:-1024}; shift $(( $# < 3 ? $# : 3 ))
run=runs/${preset}_config
python tools/random_hf_checkpoint.py "$preset" "$run"
common=(--bf16 --flash-attention-version 4 --transformer-impl local)
rm -f "$run/metrics.jsonl"
torchrun --standalone --nproc-per-node 1 pretrain_rl.py --hf-checkpoint "$run/hf" "${common[@]}" --batch-invariant-mode \
  --rl-task jsonl --rl-dataset "$run/math.jsonl" --rl-max-new-tokens "$new_tokens" \
  --grpo-prompts-per-step 2 --grpo-group-size 4 --grpo-entropy-term-weight 0.001 \
  --lr 1e-6 --train-iters "$steps" --inference-max-seq-length 2048 \
  --rl-metrics-jsonl "$run/metrics.jsonl" --save-hf "$run/export" "$@"
export_dir=$(ls -d "$run"/export/iter_* | tail -n 1)
# verified in the mode it trained in (BI); the report, with provenance, in $run/verify.json
python tools/convert_hf.py verify --hf-checkpoint "$export_dir" "${common[@]}" --batch-invariant-mode \
  --hf-verify-output "$run/verify.json"
