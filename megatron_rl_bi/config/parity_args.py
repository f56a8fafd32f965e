"""The parity tools' flags (`--parity-*`): the random requests both tools/check_parity.py and
tools/parity_doctor.py generate and recompute, the kernel modes and the JSON to write; and
their checks, made before any GPU work."""

import argparse
import os

from megatron_rl_bi.config.megatron_args import raise_if_invalid, validate_batch_invariance

MODES = ("bi", "default")


def add_parity_request_args(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """The group both parity tools share; the caller adds its own flags to it."""
    group = parser.add_argument_group(title)
    group.add_argument("--parity-modes", nargs="+", choices=MODES, default=list(MODES),
                       help="kernel modes to compare engine and trainer in")
    group.add_argument("--parity-requests", type=int, default=32, help="requests per order")
    group.add_argument("--parity-prompt-lengths", type=int, nargs=2, default=[1, 500],
                       metavar=("MIN", "MAX"), help="prompt lengths, uniformly mixed")
    group.add_argument("--parity-max-new-tokens", type=int, nargs=2, default=[1, 256],
                       metavar=("MIN", "MAX"), help="per-request decode budgets, uniformly mixed")
    group.add_argument("--parity-micro-batch-tokens", type=int, default=8192,
                       help="tokens per packed trainer forward")
    group.add_argument("--parity-temperature", type=float, default=1.0)
    group.add_argument("--parity-output", "--json", dest="parity_output", default=None,
                       help="JSON file to write")
    return group


def check_parity_requests(args: argparse.Namespace) -> None:
    """One ValueError naming every bad request flag (and --parity-orders / --parity-vocab-size
    where the tool has them); requests longer than the model or the engine allow."""
    errors = [f"{flag} {low} {high}: give 1 <= MIN <= MAX"
              for flag, (low, high) in (("--parity-prompt-lengths", args.parity_prompt_lengths),
                                        ("--parity-max-new-tokens", args.parity_max_new_tokens))
              if not 1 <= low <= high]
    counts = [("--parity-requests", args.parity_requests),
              ("--parity-micro-batch-tokens", args.parity_micro_batch_tokens)]
    counts += [(flag, getattr(args, dest)) for flag, dest in (("--parity-orders", "parity_orders"),
                                                              ("--parity-vocab-size", "parity_vocab_size"))
               if hasattr(args, dest)]
    errors += [f"{flag} must be >= 1" for flag, value in counts if value < 1]
    if args.parity_temperature <= 0:
        errors.append("--parity-temperature must be > 0")
    if args.parity_output and not os.path.isdir(os.path.dirname(os.path.abspath(args.parity_output))):
        errors.append(f"--parity-output {args.parity_output}: its directory does not exist")
    raise_if_invalid(errors)
    longest = args.parity_prompt_lengths[1] + args.parity_max_new_tokens[1]
    if longest > args.max_position_embeddings:
        raise ValueError(
            f"--parity-prompt-lengths/--parity-max-new-tokens allow {longest} tokens but "
            f"--max-position-embeddings is {args.max_position_embeddings}"
        )
    if longest > args.inference_max_seq_length:
        raise ValueError(
            f"--inference-max-seq-length {args.inference_max_seq_length} is below the longest "
            f"request ({longest} tokens)"
        )
    if "bi" in args.parity_modes:
        validate_batch_invariance(args, batch_invariant=True)
