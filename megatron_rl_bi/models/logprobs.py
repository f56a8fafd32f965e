"""Trainer-side token logprobs: one packed (THD) forward of the shared model."""

import torch

from megatron_rl_bi import bi
from megatron_rl_bi.rl.packing import PackedBatch


def forward_logprobs(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """log p(next token) at every packed position, fp32 [T]; positions without a target hold
    the logprob of token 0 and must be masked with `batch.has_target`."""
    logits = model(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        attention_mask=None,
        packed_seq_params=batch.packed_seq_params(),
    )  # [1, T, V]
    return bi.selective_log_softmax(logits[0], batch.target_ids)
