"""Trainer-side token logprobs (and, when a loss needs it, entropy): one packed THD forward of
the shared model. Both are of the distribution the engine samples from: softmax of the logits
divided by the sampling temperature (top-k/top-p filtering is not reproduced: config.rl_args
refuses it in both modes).

The LM head runs here, on the model's final hidden states, a chunk of rows at a time, each chunk
recomputed in the backward (activation checkpointing): no [tokens, vocab] tensor of a whole
micro-batch is ever held, only one chunk's. Rows are independent in every kernel the head runs
(the BI GEMM and log-softmax are batch-invariant), so the logprobs' bits do not depend on the
chunking; the LM head's weight gradient sums the chunks' products in chunk order.
"""

import functools

import torch
from megatron.core.utils import unwrap_model
from torch.utils.checkpoint import checkpoint

from megatron_rl_bi import bi, compat
from megatron_rl_bi.memory import LOGITS_CHUNK_ELEMENTS
from megatron_rl_bi.packing import PackedBatch


def _entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[t, V] -> [t] fp32 entropy of softmax(logits / temperature)."""
    log_p = torch.log_softmax(bi.sampling_logits(logits, temperature), dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


def _head(language_model, hidden: torch.Tensor, target_ids: torch.Tensor, temperature: float,
          with_entropy: bool) -> tuple[torch.Tensor, ...]:
    """hidden [t, 1, h] -> logprobs [t] (and entropy [t]) of one chunk through the LM head."""
    weight = (language_model.shared_embedding_or_output_weight()
              if language_model.share_embeddings_and_output_weights else None)
    logits, _ = language_model.output_layer(hidden, weight=weight)
    logits = language_model._scale_logits(logits)[:, 0]  # [t, V]; megatron-core's MuP scaling
    logprobs = bi.selective_log_softmax(logits, target_ids, temperature=temperature)
    return (logprobs, _entropy(logits, temperature)) if with_entropy else (logprobs,)


def head_chunk_rows(vocab_size: int) -> int:
    return max(1, LOGITS_CHUNK_ELEMENTS // vocab_size)


def forward_logprobs(
    model: torch.nn.Module, batch: PackedBatch, with_entropy: bool = False,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(next token) at every packed position at the sampling `temperature`, fp32 [T]
    (positions without a target hold the logprob of token 0: mask with `batch.has_target`), and
    the entropy [T] if asked."""
    language_model = unwrap_model(model)
    with compat.final_hidden_states(language_model):
        hidden = model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=None,
                       packed_seq_params=batch.packed_seq_params())  # [T, 1, h]
    hidden = hidden.to(language_model.config.params_dtype)  # Float16Module returned an fp32 copy
    return head_logprobs(language_model, hidden, batch.target_ids, temperature, with_entropy)


def head_logprobs(language_model, hidden: torch.Tensor, target_ids: torch.Tensor, temperature: float = 1.0,
                  with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head on final hidden states [T, 1, h], a chunk of rows at a time (each recomputed in
    the backward): logprobs [T] of `target_ids`, and the entropy [T] if asked."""
    head = functools.partial(_head, language_model, temperature=temperature, with_entropy=with_entropy)
    rows = head_chunk_rows(language_model.output_layer.output_size)
    parts = []
    for start in range(0, hidden.shape[0], rows):
        chunk = (hidden[start:start + rows], target_ids[start:start + rows])
        parts.append(checkpoint(head, *chunk, use_reentrant=False) if torch.is_grad_enabled() else head(*chunk))
    logprobs = torch.cat([part[0] for part in parts])
    return logprobs, (torch.cat([part[1] for part in parts]) if with_entropy else None)
