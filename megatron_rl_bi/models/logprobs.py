"""Trainer-side token logprobs (and, when a loss needs it, entropy): one packed THD forward of
the shared model. Both are of the distribution the engine samples from: softmax of the logits
divided by the sampling temperature (top-k/top-p filtering is not reproduced: config.rl_args
refuses it in both modes)."""

import torch

from megatron_rl_bi import bi
from megatron_rl_bi.packing import PackedBatch

ENTROPY_CHUNK_ROWS = 1024


def _entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[T, V] -> [T] fp32 entropy of softmax(logits / temperature), in row chunks (autograd)."""
    parts = []
    for start in range(0, logits.shape[0], ENTROPY_CHUNK_ROWS):
        chunk = bi.sampling_logits(logits[start : start + ENTROPY_CHUNK_ROWS], temperature)
        log_p = torch.log_softmax(chunk, dim=-1)
        parts.append(-(log_p.exp() * log_p).sum(-1))
    return torch.cat(parts)


def forward_logprobs(
    model: torch.nn.Module, batch: PackedBatch, with_entropy: bool = False,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(next token) at every packed position at the sampling `temperature`, fp32 [T]
    (positions without a target hold the logprob of token 0: mask with `batch.has_target`), and
    the entropy [T] if asked."""
    logits = model(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        attention_mask=None,
        packed_seq_params=batch.packed_seq_params(),
    )[0]  # [T, V]
    logprobs = bi.selective_log_softmax(logits, batch.target_ids, temperature=temperature)
    return logprobs, (_entropy(logits, temperature) if with_entropy else None)
