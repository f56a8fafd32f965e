"""Cost of batch invariance on one GPU, as BI / default time ratios measured in one run: a packed
trainer forward+backward, and an engine generation, on the model built from the Megatron flags
given (e.g. the dense parity model of examples/parity_dense.sh).

  python bench/bi_overhead.py <Megatron model flags> --flash-attention-version 4 \
      --bench-output results/bench_bi_overhead_h200.json
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.report import seconds, write_report  # noqa: E402

from megatron_rl_bi import bi  # noqa: E402
from megatron_rl_bi.config import parse_args, validate_batch_invariance  # noqa: E402
from megatron_rl_bi.config.from_args import engine_config_from_args  # noqa: E402
from megatron_rl_bi.distributed import initialize_distributed  # noqa: E402
from megatron_rl_bi.inference import Generator, Sampling  # noqa: E402
from megatron_rl_bi.models.build import build_model, cpu_state_dict  # noqa: E402
from megatron_rl_bi.models.logprobs import forward_logprobs  # noqa: E402
from megatron_rl_bi.packing import pack_sequences  # noqa: E402
from megatron_rl_bi.parity.harness import random_requests  # noqa: E402
from megatron_rl_bi.reporting.provenance import provenance  # noqa: E402


def add_bench_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("bench")
    group.add_argument("--bench-train-tokens", type=int, default=16384)
    group.add_argument("--bench-requests", type=int, default=32)
    group.add_argument("--bench-new-tokens", type=int, default=128)
    group.add_argument("--bench-repeats", type=int, default=3)
    group.add_argument("--bench-vocab-size", type=int, default=32000)
    group.add_argument("--bench-output", default=None)
    return parser


def measure(args, batch_invariant: bool, weights) -> tuple[dict, dict]:
    """Seconds of a trainer forward+backward and of a generation in one kernel mode, and the
    model's weights (so the other mode runs the same ones)."""
    with bi.batch_invariant(batch_invariant):
        model = build_model(args, args.bench_vocab_size)
        if weights is not None:
            model.load_state_dict(weights)
        prompts, _ = random_requests(args.bench_requests, (64, 512), (1, 1), args.bench_vocab_size, 0)
        lengths = [512] * (args.bench_train_tokens // 512)
        batch = pack_sequences([prompts[i % len(prompts)][:1] * n
                                for i, n in enumerate(lengths)]).to("cuda")

        def train_step():
            model.train()
            logprobs, _ = forward_logprobs(model, batch)
            logprobs.sum().backward()
            model.zero_grad(set_to_none=True)

        generator = Generator(model, engine_config_from_args(args))
        sampling = Sampling(max_new_tokens=args.bench_new_tokens, seed=0)
        result = {
            "train_fwd_bwd_s": seconds(train_step, args.bench_repeats),
            "generate_s": seconds(lambda: generator.generate(prompts, sampling), args.bench_repeats),
        }
        state = cpu_state_dict(model)
    return result, state


def main() -> None:
    args = parse_args(extra_args_provider=add_bench_args)
    validate_batch_invariance(args, batch_invariant=True)
    initialize_distributed(args.seed)
    bi_result, weights = measure(args, True, None)
    torch.cuda.empty_cache()  # the BI model and its engine are gone with measure's frame
    default_result, _ = measure(args, False, weights)
    report = {
        **provenance(),
        "config": {k: str(v) for k, v in vars(args).items() if k.startswith(("bench_", "hidden",
                   "num_layers", "num_attention", "num_query", "ffn", "hybrid"))},
        "bi": bi_result,
        "default": default_result,
        "ratios_bi_over_default": {k: bi_result[k] / default_result[k] for k in bi_result},
    }
    write_report(report, report["ratios_bi_over_default"], args.bench_output)


if __name__ == "__main__":
    main()
