r"""Hugging Face checkpoints <-> Megatron, through the same mapping `--hf-checkpoint` and
`--save-hf` use (one GPU process; flags are pretrain_rl.py's, the model's from the checkpoint).

  # HF -> a Megatron torch_dist checkpoint, for --pretrained-checkpoint OUT
  python tools/convert_hf.py import --hf-checkpoint DIR --save OUT --bf16 --flash-attention-version 4
  # a pretrain_rl.py checkpoint (--save root or one iter_N) -> HF, shaped like DIR
  python tools/convert_hf.py export --hf-checkpoint DIR --load RUN/checkpoints --save-hf OUT \
      --bf16 --flash-attention-version 4
  # our bf16 logits vs transformers' fp32 forward on random tokens, next to transformers' own
  # bf16 forward (not a bitwise claim: other kernels); fails when ours is more than
  # VERIFY_FACTOR times further from fp32 than transformers' bf16 is
  python tools/convert_hf.py verify --hf-checkpoint DIR --bf16 --flash-attention-version 4 \
      [--hf-verify-output results/verify_NAME.json]
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rl_bi import bi  # noqa: E402
from megatron_rl_bi.checkpoints.hf import export_hf, load_hf_weights, read_hf_model  # noqa: E402
from megatron_rl_bi.checkpoints.hf.files import check_export_dir  # noqa: E402
from megatron_rl_bi.checkpoints.hf.verify import verify  # noqa: E402
from megatron_rl_bi.checkpoints.megatron import (  # noqa: E402
    check_weights_dir,
    load_pretrained_weights,
    resolve_checkpoint_dir,
    save_weights,
    start_save_results_queue,
)
from megatron_rl_bi.config import (  # noqa: E402
    add_hf_args,
    add_rl_args,
    build_parser,
    parse_rl_args,
    print_arguments,
    validate_installed_kernels,
)
from megatron_rl_bi.config.rl_args import load_recipe  # noqa: E402
from megatron_rl_bi.distributed import initialize_distributed  # noqa: E402
from megatron_rl_bi.models.build import build_model  # noqa: E402
from megatron_rl_bi.reporting.provenance import provenance  # noqa: E402

MODES = ("import", "export", "verify")


# The flags each mode needs, and what for.
HF_CHECKPOINT = {"hf_checkpoint": "--hf-checkpoint DIR (the architecture, and the source of import)"}
NEEDED = {"import": {**HF_CHECKPOINT, "save": "--save OUT (the Megatron checkpoint written)"},
          "export": {**HF_CHECKPOINT, "load": "--load RUN/checkpoints (the checkpoint exported)",
                     "save_hf": "--save-hf OUT (the HF directory written)"},
          "verify": HF_CHECKPOINT}


def check_mode_flags(mode: str, argv: list[str]) -> None:
    """The flags `mode` needs, on the command line or in its --recipe. Checked before
    parse_rl_args: without --hf-checkpoint Megatron's own checks fail first, on the model flags
    the checkpoint would have given."""
    parser = build_parser(lambda p: add_hf_args(add_rl_args(p)))
    given, _ = parser.parse_known_args(argv)
    recipe = load_recipe(given.recipe, parser) if given.recipe else {}
    missing = [why for dest, why in NEEDED[mode].items() if not (getattr(given, dest) or recipe.get(dest))]
    if missing:
        raise ValueError(f"{mode} needs " + "; ".join(missing))


def check_paths(mode: str, args) -> None:
    """Before the model is built on the GPU: the checkpoint exported exists, and the directory
    written replaces nothing but an earlier output of its kind."""
    if mode == "export":
        resolve_checkpoint_dir(args.load, "--load")
        if os.path.realpath(args.save_hf) == os.path.realpath(args.hf_checkpoint):
            raise ValueError(f"--save-hf {args.save_hf}: is --hf-checkpoint, the source; choose another directory")
        check_export_dir(args.save_hf)
    if mode == "import":
        check_weights_dir(args.save)


def read_inputs(mode: str, argv: list[str]):
    """The flags and the HF config, checked before CUDA is touched."""
    if mode == "import" and "--save-interval" not in argv:  # one checkpoint; Megatron wants it with --save
        argv = [*argv, "--save-interval", "1"]
    if not {"-h", "--help"} & set(argv):  # MODE --help: pretrain_rl.py's flags, from parse_rl_args
        check_mode_flags(mode, argv)
    args = parse_rl_args(argv)
    check_paths(mode, args)
    validate_installed_kernels(args)
    return args, read_hf_model(args.hf_checkpoint)


def write_verify_report(args, hf, report: dict) -> None:
    """The verify report with its provenance, the checkpoint's architecture and the mode."""
    config = {key: hf.text_config.get(key) for key in ("model_type", "num_hidden_layers", "hidden_size",
                                                       "num_attention_heads", "vocab_size")}
    with open(args.hf_verify_output, "w") as f:
        json.dump({**provenance(), "hf_checkpoint": hf.path, "hf_config": config,
                   "batch_invariant_mode": args.batch_invariant_mode, **report}, f, indent=2)
    print(f"verify report: {args.hf_verify_output}")


def main() -> None:
    if len(sys.argv) >= 2 and sys.argv[1] in ("-h", "--help"):
        print(__doc__ + "\nMode flags: `python tools/convert_hf.py MODE --help` (pretrain_rl.py's flags).")
        return
    if len(sys.argv) < 2 or sys.argv[1] not in MODES:
        raise SystemExit(f"usage: convert_hf.py {{{','.join(MODES)}}} --hf-checkpoint DIR [flags]")
    mode = sys.argv[1]
    start_save_results_queue()  # forked while this process has one thread and no CUDA
    try:
        args, hf = read_inputs(mode, sys.argv[2:])
    except ValueError as exc:  # bad input: the message names it, a traceback would bury it
        raise SystemExit(f"convert_hf.py: error: {exc}") from None
    print_arguments(args)
    initialize_distributed(args.seed)
    with bi.batch_invariant(args.batch_invariant_mode):
        model = build_model(args, hf.vocab_size)
        if mode == "export":
            load_pretrained_weights(args.load, model, "--load")
            export_hf(model, hf, args.save_hf)
        else:
            load_hf_weights(model, hf)
        if mode == "import":
            save_weights(model, args.save)
        if mode == "verify":
            report = verify(model, hf.path, hf.vocab_size)
            print(json.dumps(report, indent=2))
            if args.hf_verify_output:
                write_verify_report(args, hf, report)
            if not report["passed"]:
                raise SystemExit(1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
