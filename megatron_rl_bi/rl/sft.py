"""Supervised warm-up on a task's reference answers (or demonstrations: a multi-turn task's whole
transcript), so a tiny model starts RL with signal.

Loss: mean negative log-likelihood of the answer tokens (and end-of-document), normalized by the
global answer-token count; same packing and forward as the RL step.
"""

import torch

from megatron_rl_bi.distributed import MetricTerms, all_reduce_metrics
from megatron_rl_bi.envs import Example
from megatron_rl_bi.models.logprobs import forward_logprobs
from megatron_rl_bi.packing import pack_sequences


def sft_step(ddp, optimizer, examples: list[Example], tokenizer) -> float:
    """One optimizer step on `examples` (one packed micro-batch); returns the global mean NLL."""
    prompts = [tokenizer.encode_prompt(e.prompt) for e in examples]
    answers = [tokenizer.encode(e.demonstration or e.answer) + [tokenizer.eod] for e in examples]
    batch = pack_sequences([p + a for p, a in zip(prompts, answers)], [len(p) for p in prompts])
    batch = batch.to(torch.cuda.current_device())
    answer_mask = batch.completion
    tokens = torch.tensor([float(answer_mask.sum())], device=answer_mask.device)
    torch.distributed.all_reduce(tokens)
    ddp.train()
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    logprobs, _ = forward_logprobs(ddp, batch)
    loss = -torch.where(answer_mask, logprobs, torch.zeros_like(logprobs)).sum() / tokens
    loss.backward()
    ddp.finish_grad_sync()
    optimizer.step()
    return all_reduce_metrics(MetricTerms(sums={"nll": loss.item()}))["nll"]
