r"""Engine vs trainer logprob parity for a model built from Megatron flags (dense GPT, or hybrid
GDN with --hybrid-layer-pattern); writes JSON.

  python tools/check_parity.py --flash-attention-version 4 --parity-modes bi default \
      --num-layers 4 --hidden-size 512 ... --parity-output results/parity_dense_h200.json

For each mode ('bi': the batch-invariance switch on; 'default': stock kernels) it builds the model
(the same weights in every mode), generates the requests with megatron-core's
DynamicInferenceEngine in two admission orders, recomputes every engine-reported logprob with a
packed trainer forward, and records the `bit_wise` metrics.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rl_bi import bi  # noqa: E402
from megatron_rl_bi.config import installed_kernel_problem, parse_args, print_arguments  # noqa: E402
from megatron_rl_bi.config.from_args import engine_config_from_args  # noqa: E402
from megatron_rl_bi.config.parity_args import add_parity_request_args, check_parity_requests  # noqa: E402
from megatron_rl_bi.distributed import initialize_distributed  # noqa: E402
from megatron_rl_bi.inference import Generator, Sampling  # noqa: E402
from megatron_rl_bi.launch import launch_check  # noqa: E402
from megatron_rl_bi.models.build import build_model, cpu_state_dict  # noqa: E402
from megatron_rl_bi.parity.harness import random_requests, run_parity  # noqa: E402
from megatron_rl_bi.reporting.provenance import provenance  # noqa: E402


def add_parity_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = add_parity_request_args(parser, "parity check")
    group.add_argument("--parity-vocab-size", type=int, default=32000,
                       help="vocabulary of the random-token requests (the model pads it)")
    group.add_argument("--parity-orders", type=int, default=2,
                       help="admission orders to generate the same requests in")
    return parser


def summarize(result: dict) -> dict:
    """The flat keys of the result file, from the pooled all-reported metrics."""
    metrics = result["all_reported"]
    return {
        "mean": metrics["bit_wise/logprob_diff/mean"],
        "abs_mean": metrics["bit_wise/logprob_diff/abs_mean"],
        "max": metrics["bit_wise/logprob_diff/max"],
        "ratio_tokens_different": metrics["bit_wise/ratio_tokens_different"],
        "tokens": metrics["bit_wise/tokens"],
        **result,
    }


def main() -> None:
    try:
        args = parse_args(extra_args_provider=add_parity_args)
        check_parity_requests(args)
        kernel_problem = installed_kernel_problem(args)
    except ValueError as exc:  # bad input: the message names it, a traceback would bury it
        raise SystemExit(f"check_parity.py: error: {exc}") from None
    print_arguments(args)
    if args.launch_check:
        launch_check(args.load, kernel_problem)
        return
    initialize_distributed(args.seed, cuda_graphs=args.cuda_graph_impl == "local")
    prompts, budgets = random_requests(
        args.parity_requests, tuple(args.parity_prompt_lengths),
        tuple(args.parity_max_new_tokens), args.parity_vocab_size, args.seed,
    )
    engine_config = engine_config_from_args(args, prompt_logprobs=True,
                                            temperature=args.parity_temperature)
    sampling = Sampling(temperature=args.parity_temperature, seed=args.seed)
    report = {**provenance(), "model": {}, "engine": vars(engine_config), "requests": {}}
    weights = None
    for mode in args.parity_modes:
        with bi.batch_invariant(mode == "bi"):
            model = build_model(args, args.parity_vocab_size)
            if weights is None:
                weights = cpu_state_dict(model)
            else:
                model.load_state_dict(weights)
            generator = Generator(model, engine_config)
            result = run_parity(model, generator, prompts, budgets, sampling,
                                args.parity_micro_batch_tokens, args.parity_orders)
        report[mode] = summarize(result)
        print(f"[parity] {mode}: " + json.dumps({k: report[mode][k] for k in
              ("abs_mean", "max", "ratio_tokens_different", "tokens")}), flush=True)
        del generator, model
        torch.cuda.empty_cache()
    report["model"] = {
        "num_layers": args.num_layers, "hybrid_layer_pattern": args.hybrid_layer_pattern,
        "hidden_size": args.hidden_size,
        "ffn_hidden_size": args.ffn_hidden_size, "num_attention_heads": args.num_attention_heads,
        "num_query_groups": args.num_query_groups, "vocab_size": args.padded_vocab_size,
        "params_dtype": str(args.params_dtype), "transformer_impl": args.transformer_impl,
        "flash_attention_version": args.flash_attention_version,
        "num_parameters": sum(v.numel() for v in weights.values() if torch.is_tensor(v)),
    }
    report["requests"] = {
        "count_per_order": len(prompts), "orders": args.parity_orders,
        "prompt_lengths": args.parity_prompt_lengths, "max_new_tokens": args.parity_max_new_tokens,
        "temperature": args.parity_temperature, "seed": args.seed,
    }
    if args.parity_output:
        os.makedirs(os.path.dirname(os.path.abspath(args.parity_output)), exist_ok=True)
        with open(args.parity_output, "w") as f:
            json.dump(report, f, indent=2)
        print(f"[parity] wrote {args.parity_output}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
