#!/usr/bin/env bash
# A reference recipe at its real size (8 prompts x 16 samples, 8,192-token cap) on random weights
# of the published configuration, one GPU unless NPROC says more: the recipe as a user runs it,
# with the sizing reward (random weights answer every prompt wrong, and DAPO's dynamic sampling
# would drop every group) and the memory plan of the same flags beside the run's step records.
# Usage: [NPROC=N] bash examples/rl_at_size.sh qwen3-4b|qwen3.5-9b [STEPS [LAYERS]] [extra flags]
#   LAYERS (a number; leave it out for the published depth): the preset's widths at fewer layers
#   (tools/random_hf_checkpoint.py --num-hidden-layers)
#   NPROC: processes (GPUs), 1 by default; e.g. NPROC=2 with --rl-generator-ranks 1 --refit-method nccl
#   for a trainer GPU and a generator GPU, or with --use-distributed-optimizer for data parallelism
#   MODE: bi (the default) or default (no --batch-invariant-mode: the same run in the kernels'
#   own mode, e.g. with --moe-enable-routing-replay to measure how often routing differs)
# Writes runs/PRESET[_LAYERSl]_8k[_default]/: hf/, memory_plan.json, metrics.jsonl, run.log.
set -euo pipefail
cd "$(dirname "$0")/.."
preset=$1; steps=${2:-3}; shift $(( $# < 2 ? $# : 2 ))
layers=""; if [[ ${1:-} =~ ^[0-9]+$ ]]; then layers=$1; shift; fi  # LAYERS only as a number: flags may follow STEPS
[[ $steps =~ ^[0-9]+$ ]] || { echo "rl_at_size.sh: STEPS must be a number, got '$steps'" >&2; exit 2; }
case "$preset" in
  qwen3.5-*) recipe=examples/recipes/qwen35_math_dapo.yaml ;;
  qwen3-*) recipe=examples/recipes/qwen3_math_dapo.yaml ;;
  *) echo "rl_at_size.sh: unknown preset $preset (qwen3-4b, qwen3.5-9b, ...)" >&2; exit 2 ;;
esac
case "${MODE:-bi}" in
  bi) mode_flags=(--batch-invariant-mode); suffix="" ;;
  default) mode_flags=(); suffix=_default ;;
  *) echo "rl_at_size.sh: MODE must be bi or default, got '$MODE'" >&2; exit 2 ;;
esac
run=runs/${preset}${layers:+_${layers}l}_8k$suffix
python tools/random_hf_checkpoint.py "$preset" "$run" ${layers:+--num-hidden-layers "$layers"}
flags=(--recipe "$recipe" --hf-checkpoint "$run/hf" --rl-dataset "$run/math.jsonl"
       "${mode_flags[@]}" --flash-attention-version 4
       --rl-reward-fn examples/reward_fns/number_share.py:number_share
       --train-iters "$steps" --save-interval 0 --save-hf-interval 0 "$@")
generators=0 previous=""  # the plan's GPUs are the trainers': NPROC less --rl-generator-ranks
for arg in "$@"; do [ "$previous" = --rl-generator-ranks ] && generators=$arg; previous=$arg; done
python tools/memory_plan.py --plan-gpus $(( ${NPROC:-1} - generators )) --plan-output "$run/memory_plan.json" \
  "${flags[@]}"
rm -f "$run/metrics.jsonl"
torchrun --standalone --nproc-per-node "${NPROC:-1}" pretrain_rl.py "${flags[@]}" --rl-metrics-jsonl "$run/metrics.jsonl" 2>&1 \
  | tee "$run/run.log"
