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
  python tools/convert_hf.py verify --hf-checkpoint DIR --bf16 --flash-attention-version 4
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rl_bi import bi  # noqa: E402
from megatron_rl_bi.checkpoints.hf import export_hf, load_hf_weights, read_hf_model  # noqa: E402
from megatron_rl_bi.checkpoints.hf.verify import verify  # noqa: E402
from megatron_rl_bi.checkpoints.megatron import load_pretrained_weights, save_weights  # noqa: E402
from megatron_rl_bi.config import parse_rl_args, validate_installed_kernels  # noqa: E402
from megatron_rl_bi.distributed import initialize_distributed  # noqa: E402
from megatron_rl_bi.models.build import build_model  # noqa: E402

MODES = ("import", "export", "verify")


# The flags each mode needs besides --hf-checkpoint, and what for.
NEEDED = {"import": {"save": "--save OUT (the Megatron checkpoint written)"},
          "export": {"load": "--load RUN/checkpoints (the checkpoint exported)",
                     "save_hf": "--save-hf OUT (the HF directory written)"},
          "verify": {}}


def main() -> None:
    if len(sys.argv) >= 2 and sys.argv[1] in ("-h", "--help"):
        print(__doc__ + "\nMode flags: `python tools/convert_hf.py MODE --help` (pretrain_rl.py's flags).")
        return
    if len(sys.argv) < 2 or sys.argv[1] not in MODES:
        raise SystemExit(f"usage: convert_hf.py {{{','.join(MODES)}}} --hf-checkpoint DIR [flags]")
    mode, args = sys.argv[1], parse_rl_args(sys.argv[2:])
    missing = ["--hf-checkpoint DIR (the architecture, and the source of import)"] * (not args.hf_checkpoint)
    missing += [why for dest, why in NEEDED[mode].items() if not getattr(args, dest)]
    if missing:
        raise ValueError(f"convert_hf.py {mode} needs " + "; ".join(missing))
    validate_installed_kernels(args)
    hf = read_hf_model(args.hf_checkpoint)
    initialize_distributed(args.seed)
    with bi.batch_invariant(args.batch_invariant_mode):
        model = build_model(args, hf.vocab_size)
        if mode == "export":
            load_pretrained_weights(args.load, model)
            export_hf(model, hf, args.save_hf)
        else:
            load_hf_weights(model, hf)
        if mode == "import":
            save_weights(model, args.save)
        if mode == "verify":
            report = verify(model, hf.path, hf.vocab_size)
            print(json.dumps(report, indent=2))
            if not report["passed"]:
                raise SystemExit(1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
