r"""Where engine and trainer part, component by component; and, with --ablate, what each
batch-invariant piece buys.

  python tools/parity_doctor.py --recipe examples/recipes/tiny_sort.yaml --batch-invariant-mode \
      --flash-attention-version 4 --parity-modes bi default --ablate --json results/doctor.json

Takes pretrain_rl.py's flags (a run's own command line works as is: its model, --hf-checkpoint,
--pretrained-checkpoint, or the latest checkpoint under --load) and the `--parity-*` request
flags. For each kernel mode (and, with --ablate, BI mode with each piece of bi.PIECES left off
alone) it builds the model with the same weights, generates random-token requests with the
engine, recomputes them with the trainer, and prints each component's diff (parity/doctor.py):
rows that differ, prefill and decode rows apart, max and mean |diff|, and the first component
where the two sides part. The engine runs eagerly and schedules in legacy mode: hooks do not run
inside CUDA graphs (in BI mode graphs give the eager bits: tests/gpu/test_cuda_graphs.py).
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rl_bi import bi  # noqa: E402
from megatron_rl_bi.attention.flash import OTHER_FLASH_VERSION, flash_varlen_function  # noqa: E402
from megatron_rl_bi.checkpoints.hf import read_hf_model  # noqa: E402
from megatron_rl_bi.checkpoints.megatron import latest_checkpoint, load_pretrained_weights  # noqa: E402
from megatron_rl_bi.config import installed_kernel_problem, parse_rl_args, raise_if_invalid  # noqa: E402
from megatron_rl_bi.config.from_args import build_policy, engine_config_from_args, model_vocab_size  # noqa: E402
from megatron_rl_bi.config.parity_args import add_parity_request_args, check_parity_requests  # noqa: E402
from megatron_rl_bi.distributed import initialize_distributed  # noqa: E402
from megatron_rl_bi.envs.tokenizer import build_tokenizer  # noqa: E402
from megatron_rl_bi.inference import Generator, Sampling  # noqa: E402
from megatron_rl_bi.models.build import build_model, cpu_state_dict  # noqa: E402
from megatron_rl_bi.parity.doctor import ablation_table, diagnose, format_ablation, format_report  # noqa: E402
from megatron_rl_bi.parity.harness import random_requests  # noqa: E402
from megatron_rl_bi.reporting.provenance import provenance  # noqa: E402

ENGINE_OVERRIDES = {"cuda_graph_impl": ("none", "--cuda-graph-impl none"),
                    "inference_dynamic_batching_async_sched_mode": ("legacy",
                                                                     "--inference-dynamic-batching-async-sched-mode legacy")}


def add_doctor_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = add_parity_request_args(parser, "megatron_rl_bi: parity doctor (tools/parity_doctor.py)")
    group.add_argument("--ablate", action="store_true",
                       help="also run BI mode with each batch-invariant piece left off alone, and the "
                       "comparison without the engine-reported mask: the ablation table")
    # every component of every row is kept on the host on both sides: few, short requests
    parser.set_defaults(parity_requests=8, parity_prompt_lengths=None, parity_max_new_tokens=None)
    return parser


def fit_request_lengths(args: argparse.Namespace) -> None:
    """Lengths not given: prompts of up to 128 tokens and budgets of up to 64, within what the
    model and the engine allow (a run's flags then work as they are)."""
    limit = min(args.max_position_embeddings, args.inference_max_seq_length)
    if args.parity_prompt_lengths is None:
        args.parity_prompt_lengths = [1, max(1, min(128, limit // 2))]
    if args.parity_max_new_tokens is None:
        args.parity_max_new_tokens = [1, max(1, min(64, limit - args.parity_prompt_lengths[1]))]


def doctor_problems(args: argparse.Namespace) -> list[str]:
    """What the doctor cannot diagnose, each naming its flag."""
    parallel = {"--tensor-model-parallel-size": args.tensor_model_parallel_size,
                "--pipeline-model-parallel-size": args.pipeline_model_parallel_size,
                "--context-parallel-size": args.context_parallel_size,
                "--expert-model-parallel-size": args.expert_model_parallel_size}
    return [f"{flag} {size}: the doctor runs one GPU" for flag, size in parallel.items() if size != 1]


def run_engine_eagerly(args: argparse.Namespace) -> None:
    """CUDA graphs off and legacy scheduling, said on the console when the flags asked otherwise."""
    for dest, (value, flag) in ENGINE_OVERRIDES.items():
        if getattr(args, dest) != value:
            print(f"[doctor] running with {flag} (hooks see no graph replay, and read the step's "
                  "bookkeeping as the forward starts)", flush=True)
            setattr(args, dest, value)


def piece_problem(args: argparse.Namespace, piece: str) -> str | None:
    """Why a piece's ablation cannot run for this model, else None."""
    if piece == "te_norm" and args.transformer_impl != "transformer_engine":
        return f"--transformer-impl {args.transformer_impl}: no TE norms"
    if piece == "gdn_recurrent" and "G" not in (args.hybrid_layer_pattern or ""):
        return "no GDN layers"
    if piece in ("attention_split", "flash_version") and args.hybrid_layer_pattern and "*" not in args.hybrid_layer_pattern:
        return "no attention layers"
    if piece == "flash_version":
        other = OTHER_FLASH_VERSION[args.flash_attention_version]
        try:
            flash_varlen_function(other)
        except ImportError as exc:
            return f"FlashAttention-{other} is not installed ({exc})"
    return None


def runs_of(args: argparse.Namespace) -> list[tuple[str, bool, tuple[str, ...]]]:
    """(name, BI on, pieces off) of every run: the modes asked, then each ablation."""
    runs = [(mode, mode == "bi", ()) for mode in args.parity_modes]
    if args.ablate:
        if "bi" not in args.parity_modes:
            runs.append(("bi", True, ()))
        runs += [(f"bi without {piece}", True, (piece,)) for piece in bi.PIECES if not piece_problem(args, piece)]
    return runs


def read_inputs(argv: list[str] | None = None) -> tuple[argparse.Namespace, int, object]:
    """Flags, tokenizer (the model's vocabulary) and HF config, each checked before any GPU work."""
    args = parse_rl_args(argv, extra_args_provider=add_doctor_args, program="parity_doctor.py")
    fit_request_lengths(args)
    check_parity_requests(args)
    raise_if_invalid(doctor_problems(args))
    tokenizer = build_tokenizer(args.rl_tokenizer, chat_template=not args.rl_no_chat_template)
    return args, model_vocab_size(args, tokenizer), read_hf_model(args.hf_checkpoint) if args.hf_checkpoint else None


def starting_model(args: argparse.Namespace, vocab_size: int, hf_model) -> torch.nn.Module:
    """The run's weights: --hf-checkpoint or --pretrained-checkpoint, then the latest checkpoint
    under --load where there is one."""
    model = build_policy(args, vocab_size, hf_model)
    path = latest_checkpoint(args.load) if args.load else None
    if path:
        load_pretrained_weights(path, model, flag="--load")
        print(f"[doctor] weights of {path}", flush=True)
    return model


def diagnose_runs(args: argparse.Namespace, vocab_size: int, hf_model) -> dict[str, dict]:
    """Every run of `runs_of`, the same weights and requests in each; their reports by name."""
    prompts, budgets = random_requests(args.parity_requests, tuple(args.parity_prompt_lengths),
                                       tuple(args.parity_max_new_tokens), vocab_size, args.seed)
    engine_config = engine_config_from_args(args, prompt_logprobs=True, temperature=args.parity_temperature)
    sampling = Sampling(temperature=args.parity_temperature, seed=args.seed)
    reports, weights = {}, None
    for name, on, without in runs_of(args):
        with bi.batch_invariant(on, without):
            if weights is None:
                model = starting_model(args, vocab_size, hf_model)
                weights = cpu_state_dict(model)
            else:
                model = build_model(args, vocab_size)
                model.load_state_dict(weights)
            generator = Generator(model, engine_config)
            reports[name] = diagnose(model, generator, prompts, budgets, sampling, args.parity_micro_batch_tokens)
        print(format_report(f"[doctor] {name}", reports[name]), flush=True)
        del generator, model
        torch.cuda.empty_cache()
    return reports


def main() -> None:
    try:
        args, vocab_size, hf_model = read_inputs()
        kernel_problem = installed_kernel_problem(args)
    except ValueError as exc:  # bad input: the message names it, a traceback would bury it
        raise SystemExit(f"parity_doctor.py: error: {exc}") from None
    if kernel_problem:
        raise SystemExit(f"parity_doctor.py: error: {kernel_problem}")
    run_engine_eagerly(args)
    initialize_distributed(args.seed, cuda_graphs=False)
    reports = diagnose_runs(args, vocab_size, hf_model)
    result = {**provenance(), "flags": sys.argv[1:], "runs": reports}
    if args.ablate:
        result["ablation"] = ablation_table(reports, bi.PIECES, {p: piece_problem(args, p) for p in bi.PIECES})
        print(format_ablation(result["ablation"]), flush=True)
    if args.parity_output:
        with open(args.parity_output, "w") as f:
            json.dump(result, f, indent=2)
        print(f"[doctor] wrote {args.parity_output}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
