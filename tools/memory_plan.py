r"""The GPU memory an RL run will take, before it runs (megatron_rl_bi/memory.py): weights,
gradients, optimizer, KV cache, activations, the LM head, by phase, the predicted peak, and the
levers that would lower it. Takes pretrain_rl.py's flags (a recipe, --hf-checkpoint, ...) and the
GPUs to plan for; no GPU is needed; the run's flags as it would be launched (the recipe's
checkpoint intervals need their directories, though a plan writes nothing there). With
--rl-generator-ranks: a trainer's plan (no engine), a generator's (the weights and the engine),
and the two together on one GPU; --plan-gpus is then the trainers' GPUs.

  python tools/memory_plan.py --plan-gpus 1 --plan-gpu-memory-gib 139.8 \
      --recipe examples/recipes/qwen3_math_dapo.yaml --hf-checkpoint /ckpt/Qwen3-4B \
      --save runs/qwen3_4b/checkpoints --save-hf runs/qwen3_4b/hf
  python tools/memory_plan.py ... --plan-output results/memory_plan_NAME.json   # also as JSON
"""

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rl_bi.config import parse_rl_args  # noqa: E402
from megatron_rl_bi.config.from_args import levers_from_args, memory_run_from_args  # noqa: E402
from megatron_rl_bi.envs.tokenizer import build_tokenizer  # noqa: E402
from megatron_rl_bi.memory import GIB, format_plan, plan_memory  # noqa: E402
from megatron_rl_bi.reporting.provenance import provenance  # noqa: E402

H200_GIB = 139.8  # what torch reports as the H200's total memory


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     add_help=False)
    parser.add_argument("--plan-gpus", type=int, default=1,
                        help="the trainers' data-parallel GPUs (TP = 1); with --rl-generator-ranks, a "
                             "generator process is planned besides")
    parser.add_argument("--plan-gpu-memory-gib", type=float, default=None,
                        help="memory of one GPU, as torch reports it (default: this machine's GPU, "
                             f"else an H200's {H200_GIB})")
    parser.add_argument("--plan-output", default=None, help="also write the plan as JSON")
    return parser


def this_gpu_gib() -> float | None:
    """The memory of this machine's first GPU, as torch reports it; None without one."""
    return torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else None


def vocab_size(args) -> int:
    """The model's vocabulary before Megatron's padding: --vocab-size, else the tokenizer's."""
    return args.vocab_size or build_tokenizer(args.rl_tokenizer, chat_template=False).vocab_size


def main() -> None:
    parser = build_parser()
    own, rest = parser.parse_known_args()
    if {"-h", "--help"} & set(rest):
        parser.print_help()
        print("\nEvery other flag is pretrain_rl.py's: python pretrain_rl.py --help")
        return
    if own.plan_gpu_memory_gib is None:
        own.plan_gpu_memory_gib = this_gpu_gib() or H200_GIB
    try:
        if own.plan_gpus < 1 or own.plan_gpu_memory_gib <= 0:
            raise ValueError("--plan-gpus must be >= 1 and --plan-gpu-memory-gib > 0")
        args = parse_rl_args(rest)
        run = memory_run_from_args(args, vocab_size(args), own.plan_gpus, int(own.plan_gpu_memory_gib * GIB))
    except ValueError as exc:
        raise SystemExit(f"memory_plan.py: error: {exc}") from None
    plan = plan_memory(run, levers_from_args(args))
    record = {**provenance(), "argv": rest, "gpus": own.plan_gpus, "plan_gib": plan.summary(),
              "suggestions": plan.suggestions}
    if args.rl_generator_ranks:
        generator = plan_memory(dataclasses.replace(run, role="generator"), levers_from_args(args))
        print(f"--plan-gpus {own.plan_gpus}: the trainers' GPUs; each generator rank (--rl-generator-ranks) "
              "is planned apart, below")
        print(f"a trainer ({own.plan_gpus} data-parallel):\n{format_plan(plan)}\n\na generator:\n{format_plan(generator)}")
        together = (plan.peak_bytes + generator.peak_bytes + plan.outside_torch_bytes
                    + generator.outside_torch_bytes) / GIB  # two processes, each with its own beyond torch
        print(f"\na trainer and a generator on one GPU: {together:.2f} GiB, beyond torch included, of "
              f"{own.plan_gpu_memory_gib:.1f} GiB ({'fits' if together <= own.plan_gpu_memory_gib else 'does NOT fit'})")
        record.update(generator_plan_gib=generator.summary(), generator_suggestions=generator.suggestions)
    else:
        print(format_plan(plan))
    if own.plan_output:
        with open(own.plan_output, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
