"""Our model's logits against transformers' on the same Hugging Face checkpoint (GPU): not a
bitwise claim (other kernels), a check that the mapping and every layer's math are right."""

import torch

from megatron_rl_bi.numerics import relative_l2_error
from megatron_rl_bi.packing import pack_sequences

VERIFY_TOKENS = (64, 200, 17)  # sequence lengths of the verify batch
# Our bf16 model may be at most this many times further from transformers' fp32 forward than
# transformers' own bf16 forward is: two bf16 implementations each differ from the fp32 result
# by rounding that grows with depth (measured on the H200, ours vs transformers both in bf16:
# Qwen3-0.6B 1.3e-2, Qwen3.5-2B 5.3e-2 relative), while a wrong mapping
# is off by order 1.
VERIFY_FACTOR = 2.0


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
        "ours_vs_fp32_relative_l2": relative_l2_error(ours, exact),
        "transformers_bf16_vs_fp32_relative_l2": relative_l2_error(theirs, exact),
        "ours_top1_agreement_with_fp32": (ours.argmax(-1) == exact.argmax(-1)).float().mean().item(),
        "transformers_bf16_top1_agreement_with_fp32":
            (theirs.argmax(-1) == exact.argmax(-1)).float().mean().item(),
        "ours_vs_transformers_bf16_relative_l2": relative_l2_error(ours, theirs),
        "allowed_factor": VERIFY_FACTOR,
    }
    report["passed"] = (report["ours_vs_fp32_relative_l2"]
                        <= VERIFY_FACTOR * report["transformers_bf16_vs_fp32_relative_l2"])
    return report
