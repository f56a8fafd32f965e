"""Sequence packing into one THD row for the trainer forward, and the way back.

A batch of N token sequences becomes input_ids [1, T] (T = sum of lengths, no padding) with
cu_seqlens [N + 1]; FlashAttention's varlen kernel keeps sequences apart. Per-token values
(engine logprobs, loss masks, advantages) are laid out by *predicting position*: packed index
`start + j` holds the value for token j + 1 of its sequence, because the logits at position j
predict token j + 1. The last position of each sequence predicts nothing.

Example: sequences [5, 6, 7] and [8, 9] -> input_ids [[5, 6, 7, 8, 9]], cu_seqlens [0, 3, 5],
target_ids [6, 7, 0, 9, 0], has_target [T, T, F, T, F].
"""

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64, restarting at 0 in each sequence
    cu_seqlens: torch.Tensor  # [N + 1] int32
    max_seqlen: int
    target_ids: torch.Tensor  # [T] int64: the next token, 0 where there is none
    has_target: torch.Tensor  # [T] bool

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    def packed_seq_params(self) -> PackedSeqParams:
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )

    def to(self, device) -> "PackedBatch":
        return PackedBatch(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            cu_seqlens=self.cu_seqlens.to(device),
            max_seqlen=self.max_seqlen,
            target_ids=self.target_ids.to(device),
            has_target=self.has_target.to(device),
        )


def pack_sequences(sequences: list[list[int]]) -> PackedBatch:
    if not sequences:
        raise ValueError("pack_sequences needs at least one sequence")
    lengths = [len(seq) for seq in sequences]
    if min(lengths) < 1:
        raise ValueError(f"every sequence needs at least one token, got lengths {lengths}")
    tokens = torch.tensor([tok for seq in sequences for tok in seq], dtype=torch.int64)
    cu_seqlens = torch.zeros(len(sequences) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(lengths), 0)
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), torch.tensor(lengths))
    position_ids = torch.arange(tokens.numel()) - starts
    ends = cu_seqlens[1:].long() - 1
    has_target = torch.ones(tokens.numel(), dtype=torch.bool)
    has_target[ends] = False
    target_ids = torch.zeros_like(tokens)
    target_ids[:-1] = tokens[1:]
    target_ids[~has_target] = 0
    return PackedBatch(
        input_ids=tokens.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        cu_seqlens=cu_seqlens,
        max_seqlen=max(lengths),
        target_ids=target_ids,
        has_target=has_target,
    )


def completion_mask(prompt_length: int, length: int) -> torch.Tensor:
    """bool [length - 1], by predicting position: True where the predicted token is one of the
    tokens after the first `prompt_length` (a completion or answer token)."""
    return torch.arange(length - 1) >= prompt_length - 1


def pack_token_values(
    values: list[torch.Tensor], batch: PackedBatch, fill: float = 0.0
) -> torch.Tensor:
    """values[i][k] is the value for token k + 1 of sequence i (length len_i - 1) -> [T]."""
    if len(values) != batch.num_sequences:
        raise ValueError(f"{len(values)} value rows for {batch.num_sequences} sequences")
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
    rows = []
    for i, (row, length) in enumerate(zip(values, lengths)):
        row = torch.as_tensor(row)
        if row.numel() != length - 1:
            raise ValueError(f"sequence {i}: {row.numel()} values for {length} tokens")
        rows.append(torch.cat([row.reshape(-1), torch.full((1,), fill, dtype=row.dtype)]))
    return torch.cat(rows)


def unpack_token_values(packed: torch.Tensor, batch: PackedBatch) -> list[torch.Tensor]:
    """Inverse of pack_token_values: [T] -> per sequence [len_i - 1]."""
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
    return [row[:-1] for row in torch.split(packed, lengths)]


def micro_batches(items: list, max_tokens: int) -> list[list]:
    """Consecutive groups of items (anything with `.tokens`) of at most `max_tokens` tokens each;
    an item longer than that forms a micro-batch of its own."""
    batches, current, tokens = [], [], 0
    for item in items:
        length = len(item.tokens)
        if current and tokens + length > max_tokens:
            batches.append(current)
            current, tokens = [], 0
        current.append(item)
        tokens += length
    return batches + ([current] if current else [])
