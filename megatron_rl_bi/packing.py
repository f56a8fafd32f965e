"""Sequences -> one packed THD row for the trainer forward, and per-token values in and out of it.

A batch of N token sequences becomes input_ids [1, T] (T = sum of lengths, no padding) with
cu_seqlens [N + 1]; FlashAttention's varlen kernel and the GDN rule keep sequences apart.
Per-token values (engine logprobs, loss masks, advantages) are laid out by *predicting position*:
packed index `start + j` holds the value for token j + 1 of its sequence, because the logits at
position j predict token j + 1. The last position of each sequence predicts nothing.

Example: sequences [5, 6, 7] and [8, 9] with prompts of 2 and 1 tokens -> input_ids
[[5, 6, 7, 8, 9]], cu_seqlens [0, 3, 5], target_ids [6, 7, 0, 9, 0],
has_target [T, T, F, T, F], completion [F, T, F, T, F].

This module is the one place that maps engine-reported logprobs to packed positions
(`pack_completions`): the RL step and the parity harness both use it.
"""

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams


def sequence_lengths(cu_seqlens: torch.Tensor) -> list[int]:
    """[N + 1] cumulative bounds -> the N lengths."""
    return cu_seqlens.diff().tolist()


def uniform_cu_seqlens(num_sequences: int, length: int, device) -> torch.Tensor:
    """Bounds of `num_sequences` back-to-back sequences of `length` tokens: int32 [N + 1]
    (an [s, b, ...] batch viewed as b packed sequences)."""
    return torch.arange(0, (num_sequences + 1) * length, length, dtype=torch.int32, device=device)


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64, restarting at 0 in each sequence
    cu_seqlens: torch.Tensor  # [N + 1] int32
    max_seqlen: int
    target_ids: torch.Tensor  # [T] int64: the next token, 0 where there is none
    has_target: torch.Tensor  # [T] bool
    completion: torch.Tensor  # [T] bool: predicts a token after its sequence's prompt

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def sequence_lengths(self) -> list[int]:
        return sequence_lengths(self.cu_seqlens)

    @property
    def sequence_ids(self) -> torch.Tensor:
        """[T] int64: which sequence each packed position belongs to (computed where
        cu_seqlens lives, without a copy to the host)."""
        sequences = torch.arange(self.num_sequences, device=self.cu_seqlens.device)
        return torch.repeat_interleave(sequences, self.cu_seqlens.diff())

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
            **{name: value.to(device) if torch.is_tensor(value) else value
               for name, value in vars(self).items()}
        )


def pack_sequences(sequences: list[list[int]], prompt_lengths: list[int] | None = None) -> PackedBatch:
    """`prompt_lengths[i]`: leading tokens of sequence i that are prompt (default 1, so every
    predicted token counts as completion)."""
    if not sequences:
        raise ValueError("pack_sequences needs at least one sequence")
    lengths = [len(seq) for seq in sequences]
    if min(lengths) < 1:
        raise ValueError(f"every sequence needs at least one token, got lengths {lengths}")
    if prompt_lengths is None:
        prompt_lengths = [1] * len(sequences)
    tokens = torch.tensor([tok for seq in sequences for tok in seq], dtype=torch.int64)
    cu_seqlens = torch.zeros(len(sequences) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(lengths), 0)
    per_token = torch.tensor(lengths)
    position_ids = torch.arange(tokens.numel()) - torch.repeat_interleave(cu_seqlens[:-1].long(), per_token)
    has_target = torch.ones(tokens.numel(), dtype=torch.bool)
    has_target[cu_seqlens[1:].long() - 1] = False
    target_ids = torch.zeros_like(tokens)
    target_ids[:-1] = tokens[1:]
    target_ids[~has_target] = 0
    first_completion = torch.repeat_interleave(torch.tensor(prompt_lengths) - 1, per_token)
    return PackedBatch(
        input_ids=tokens.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        cu_seqlens=cu_seqlens,
        max_seqlen=max(lengths),
        target_ids=target_ids,
        has_target=has_target,
        completion=has_target & (position_ids >= first_completion),
    )


def pack_token_values(
    values: list[torch.Tensor], batch: PackedBatch, fill: float = 0.0
) -> torch.Tensor:
    """values[i][k] is the value at position k < len_i - 1 of sequence i (a logprob: that of token
    k + 1), a scalar or a tensor of any trailing shape -> [T, ...], `fill` at each last position."""
    if len(values) != batch.num_sequences:
        raise ValueError(f"{len(values)} value rows for {batch.num_sequences} sequences")
    rows = []
    for i, (row, length) in enumerate(zip(values, batch.sequence_lengths)):
        row = torch.as_tensor(row)
        if row.dim() == 0 or row.shape[0] != length - 1:
            raise ValueError(f"sequence {i}: {row.shape[0] if row.dim() else 0} values for {length} tokens")
        rows.append(torch.cat([row, row.new_full((1, *row.shape[1:]), fill)]))
    return torch.cat(rows)


def unpack_token_values(packed: torch.Tensor, batch: PackedBatch) -> list[torch.Tensor]:
    """Inverse of pack_token_values: [T] -> per sequence [len_i - 1]."""
    return [row[:-1] for row in torch.split(packed, batch.sequence_lengths)]


@dataclass
class PackedCompletions:
    """Prompt + completion sequences packed, with the engine's logprobs at their positions."""

    batch: PackedBatch
    engine_logprobs: torch.Tensor  # [T] fp32, 0 where the engine reported nothing
    reported: torch.Tensor  # [T] bool: positions whose logprob the engine reported
    engine_routing: torch.Tensor | None = None
    """[T, MoE layers, k]: the experts the engine routed each position's token to (-1 where it
    recorded none); None when no item carries routing."""
    routed: torch.Tensor | None = None
    """[T] bool: tokens the engine sampled, then ran (its routing recorded): the sampled tokens
    but each sequence's last."""

    def to(self, device) -> "PackedCompletions":
        def moved(tensor):
            return None if tensor is None else tensor.to(device)

        return PackedCompletions(self.batch.to(device), self.engine_logprobs.to(device),
                                 self.reported.to(device), moved(self.engine_routing), moved(self.routed))


def pack_completions(items: list, device=None) -> PackedCompletions:
    """`items` (engine Generations, or anything with their fields): `prompt_tokens`,
    `completion_tokens`, `completion_logprobs` (the engine's, one per completion token; any value
    at an environment's tokens), `prompt_logprobs` (tokens 2..P, or None when the engine did not
    report them) and `completion_sampled` (None, or which completion tokens were sampled).
    Environment tokens are context: neither completion (no loss) nor reported (no parity)."""
    batch = pack_sequences([item.prompt_tokens + item.completion_tokens for item in items],
                           [len(item.prompt_tokens) for item in items])
    values, reported, written = [], [], []
    for item in items:
        num_prompt = len(item.prompt_tokens) - 1
        prompt = item.prompt_logprobs
        values.append(torch.tensor(([0.0] * num_prompt if prompt is None else prompt)
                                   + item.completion_logprobs, dtype=torch.float32))
        by_environment = torch.zeros(values[-1].numel(), dtype=torch.bool)
        if item.completion_sampled is not None:
            by_environment[num_prompt:] = ~torch.tensor(item.completion_sampled, dtype=torch.bool)
        mask = ~by_environment
        if prompt is None:
            mask[:num_prompt] = False
        reported.append(mask)
        written.append(by_environment)
    batch.completion = batch.completion & ~pack_token_values(written, batch)
    packed = PackedCompletions(batch, pack_token_values(values, batch),
                               pack_token_values(reported, batch), *_packed_routing(items, batch))
    return packed if device is None else packed.to(device)


def _packed_routing(items: list, batch: PackedBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The engine's routing at each position ([T, layers, k], -1 where none) and the sampled
    tokens whose routing it recorded ([T]); (None, None) when no item carries routing."""
    shape = next((item.routing.shape[1:] for item in items if getattr(item, "routing", None) is not None), None)
    if shape is None:
        return None, None
    rows, routed = [], []
    for item in items:
        length = len(item.prompt_tokens) + len(item.completion_tokens)
        routing = getattr(item, "routing", None)
        rows.append(torch.full((length - 1, *shape), -1, dtype=torch.int64) if routing is None
                    else routing.to(torch.int64))
        sampled = torch.zeros(length - 1, dtype=torch.bool)
        if routing is not None:
            completion = (torch.ones(len(item.completion_tokens), dtype=torch.bool) if item.completion_sampled is None
                          else torch.tensor(item.completion_sampled, dtype=torch.bool))
            sampled[len(item.prompt_tokens):] = completion[:-1]  # the last token was never run
        routed.append(sampled)
    return pack_token_values(rows, batch, fill=-1), pack_token_values(routed, batch)


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
