#!/usr/bin/env bash
# The main job: the built-in tiny model learns letter sorting with GRPO, BI mode, one GPU,
# no download. Metrics: runs/tiny_sort/metrics.jsonl; plot: runs/tiny_sort/curves.png.
# Usage: bash examples/rl_tiny.sh [extra flags, e.g. --flash-attention-version 3]
set -euo pipefail
cd "$(dirname "$0")/.."
rm -f runs/tiny_sort/metrics.jsonl
torchrun --standalone --nproc-per-node "${NPROC:-1}" pretrain_rl.py --recipe examples/recipes/tiny_sort.yaml \
  --batch-invariant-mode --flash-attention-version 4 "$@"
python tools/plot_metrics.py runs/tiny_sort/metrics.jsonl runs/tiny_sort/curves.png
