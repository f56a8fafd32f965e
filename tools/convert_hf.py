"""Hugging Face checkpoints <-> Megatron, through the same mapping `--hf-checkpoint` and
`--save-hf` use (one GPU process; flags are pretrain_rl.py's, the model's from the checkpoint).

  # HF -> a Megatron torch_dist checkpoint, for --pretrained-checkpoint OUT
  python tools/convert_hf.py import --hf-checkpoint DIR --save OUT --bf16
  # a pretrain_rl.py checkpoint (--save root or one iter_N) -> HF, shaped like DIR
  python tools/convert_hf.py export --hf-checkpoint DIR --load RUN/checkpoints --save-hf OUT --bf16
  # our bf16 logits vs transformers' fp32 forward on random tokens, next to transformers' own
  # bf16 forward (not a bitwise claim: other kernels); fails when ours is more than
  # VERIFY_FACTOR times further from fp32 than transformers' bf16 is
  python tools/convert_hf.py verify --hf-checkpoint DIR --bf16
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rl_bi import bi  # noqa: E402
from megatron_rl_bi.checkpoints.hf import export_hf, load_hf_weights, read_hf_model  # noqa: E402
from megatron_rl_bi.checkpoints.megatron import load_pretrained_weights, save_weights  # noqa: E402
from megatron_rl_bi.config import parse_rl_args  # noqa: E402
from megatron_rl_bi.distributed import initialize_distributed  # noqa: E402
from megatron_rl_bi.models.build import build_model  # noqa: E402
from megatron_rl_bi.packing import pack_sequences  # noqa: E402

MODES = ("import", "export", "verify")
VERIFY_TOKENS = (64, 200, 17)  # sequence lengths of the verify batch
# Our bf16 model may be at most this many times further from transformers' fp32 forward than
# transformers' own bf16 forward is: two bf16 implementations each differ from the fp32 result
# by rounding that grows with depth (measured on the H200, ours vs transformers both in bf16:
# Qwen3-0.6B 1.3e-2, Qwen3.5-2B 5.3e-2 relative), while a wrong mapping
# is off by order 1.
VERIFY_FACTOR = 2.0


def _relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).norm() / reference.norm()).item()


def _transformers_logits(hf_path: str, dtype, sequences) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=dtype).cuda().eval()
    with torch.no_grad():
        logits = torch.cat([model(torch.tensor([s], device="cuda")).logits[0] for s in sequences])
    del model
    torch.cuda.empty_cache()
    return logits.float()


def verify(model, hf_path: str, vocab_size: int) -> dict:
    """Our bf16 logits and transformers' bf16 logits, each against transformers' fp32 forward
    on random tokens: relative L2 error and top-1 agreement."""
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in VERIFY_TOKENS]
    batch = pack_sequences(sequences).to("cuda")
    with torch.no_grad():
        ours = model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=None,
                     packed_seq_params=batch.packed_seq_params())[0][:, :vocab_size].float()
    exact = _transformers_logits(hf_path, torch.float32, sequences)
    theirs = _transformers_logits(hf_path, torch.bfloat16, sequences)
    report = {
        "ours_vs_fp32_relative_l2": _relative_error(ours, exact),
        "transformers_bf16_vs_fp32_relative_l2": _relative_error(theirs, exact),
        "ours_top1_agreement_with_fp32": (ours.argmax(-1) == exact.argmax(-1)).float().mean().item(),
        "transformers_bf16_top1_agreement_with_fp32":
            (theirs.argmax(-1) == exact.argmax(-1)).float().mean().item(),
        "ours_vs_transformers_bf16_relative_l2": _relative_error(ours, theirs),
        "allowed_factor": VERIFY_FACTOR,
    }
    report["passed"] = (report["ours_vs_fp32_relative_l2"]
                        <= VERIFY_FACTOR * report["transformers_bf16_vs_fp32_relative_l2"])
    return report


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in MODES:
        raise SystemExit(f"usage: convert_hf.py {{{','.join(MODES)}}} --hf-checkpoint DIR [flags]")
    mode, args = sys.argv[1], parse_rl_args(sys.argv[2:])
    if not args.hf_checkpoint:
        raise ValueError("convert_hf.py needs --hf-checkpoint DIR (the architecture, and the source "
                         "of import)")
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
