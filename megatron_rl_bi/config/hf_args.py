"""Flags for Hugging Face checkpoints in and out, and the model flags a checkpoint implies.

With `--hf-checkpoint DIR` the architecture flags come from DIR/config.json (as defaults, below
the `--rl-loss` preset, the recipe and the command line), the tokenizer defaults to DIR's, and a
flag given elsewhere that contradicts the checkpoint is an error naming both.
"""

import argparse
import os


def add_hf_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("megatron_rl_bi: Hugging Face checkpoints")
    group.add_argument("--hf-checkpoint", default=None, metavar="DIR",
                       help="start from this Hugging Face directory (Qwen3, Qwen3-MoE, Qwen3.5): model flags "
                       "from its config.json, weights from its safetensors, its tokenizer")
    group.add_argument("--save-hf", default=None, metavar="DIR",
                       help="write the policy as Hugging Face directories DIR/iter_N (at the end "
                       "and every --save-hf-interval steps); needs --hf-checkpoint")
    group.add_argument("--save-hf-interval", type=int, default=0,
                       help="steps between --save-hf exports; 0: at the end only")
    group.add_argument("--hf-verify-output", default=None, metavar="FILE",
                       help="tools/convert_hf.py verify: also write the report, with provenance, "
                       "to this JSON file")
    return parser


def checkpoint_flag_errors(args: argparse.Namespace, model_flags: dict, flag_names: dict) -> list[str]:
    """Every model flag whose value differs from the checkpoint's (`model_flags`, from
    `megatron_flags`), and the checkpoint flags used without what they need; `flag_names` maps
    destinations to flags."""
    errors = [
        f"{flag_names.get(dest, dest)} ({dest}={getattr(args, dest)!r}) contradicts "
        f"{args.hf_checkpoint}/config.json, which implies {dest}={value!r}"
        for dest, value in model_flags.items() if getattr(args, dest) != value
    ]
    if args.save_hf and not args.hf_checkpoint:
        errors.append("--save-hf needs --hf-checkpoint (the config and tokenizer to write)")
    if args.save_hf_interval and not args.save_hf:
        errors.append("--save-hf-interval needs --save-hf DIR")
    if args.hf_verify_output and not os.path.isdir(os.path.dirname(os.path.abspath(args.hf_verify_output))):
        errors.append(f"--hf-verify-output {args.hf_verify_output}: its directory does not exist")
    if args.hf_checkpoint and args.pretrained_checkpoint:
        errors.append("--hf-checkpoint and --pretrained-checkpoint both give the starting weights: "
                      "pass one")
    return errors
