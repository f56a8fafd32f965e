"""Supervised warm-up on a task's reference answers, so a tiny model starts RL with signal.

Loss: mean negative log-likelihood of the answer tokens (and end-of-document), normalized by the
global answer-token count; same packing and forward as the RL step.
"""

import torch

from megatron_rl_bi.envs import Example
from megatron_rl_bi.models.logprobs import forward_logprobs
from megatron_rl_bi.rl.packing import completion_mask, pack_sequences, pack_token_values


def sft_step(ddp, optimizer, examples: list[Example], tokenizer) -> float:
    """One optimizer step on `examples` (one packed micro-batch); returns the global mean NLL."""
    prompts = [tokenizer.encode(e.prompt) for e in examples]
    answers = [tokenizer.encode(e.answer) + [tokenizer.eod] for e in examples]
    batch = pack_sequences([p + a for p, a in zip(prompts, answers)])
    answer_mask = pack_token_values(
        [completion_mask(len(p), len(p) + len(a)) for p, a in zip(prompts, answers)], batch
    ).to(torch.cuda.current_device())
    tokens = torch.tensor([float(answer_mask.sum())], device=answer_mask.device)
    torch.distributed.all_reduce(tokens)
    ddp.train()
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    logprobs, _ = forward_logprobs(ddp, batch.to(torch.cuda.current_device()))
    loss = -torch.where(answer_mask, logprobs, torch.zeros_like(logprobs)).sum() / tokens
    loss.backward()
    ddp.finish_grad_sync()
    optimizer.step()
    global_loss = loss.detach().clone()
    torch.distributed.all_reduce(global_loss)
    return global_loss.item()
