"""Supervised warm-up on a task's reference answers (or demonstrations: a multi-turn task's whole
transcript, written in the run's tool format as its conversations are), so a tiny model starts RL
with signal.

Loss: mean negative log-likelihood of the tokens the model writes (the answer, or a
demonstration's turns, and end-of-document), normalized by their global count; an environment's
answers in a demonstration are context, as in RL. Each piece is encoded on its own, as a
conversation's turns and observations are. Same packing and forward as the RL step.
"""

import torch

from megatron_rl_bi.distributed import MetricTerms, all_reduce_metrics
from megatron_rl_bi.envs import Example
from megatron_rl_bi.envs.tool_format import TagTurns
from megatron_rl_bi.inference import Generation
from megatron_rl_bi.models.logprobs import forward_logprobs
from megatron_rl_bi.models.moe import router_loss_sums, scale_router_losses
from megatron_rl_bi.packing import pack_completions


def demonstration(example: Example, tokenizer, turns: TagTurns | None = None,
                  observation_tokens: int = 512) -> Generation:
    """The example's target as a conversation would hold it: the model's pieces sampled, the
    environment's not; with `turns` (the run's --rl-tool-format) the prompt, the model's tool
    calls and the environment's answers written as that format writes them (the tags format's
    are the demonstration's own text)."""
    tokens, sampled = [], []
    for turn, text in enumerate(example.demonstration or (example.answer,)):
        if turn % 2:
            ids = turns.observation(text, observation_tokens) if turns else tokenizer.encode(text)
        else:
            ids = tokenizer.encode(turns.demonstrated(text) if turns else text)
        tokens += ids
        sampled += [turn % 2 == 0] * len(ids)
    tokens, sampled = tokens + [tokenizer.eod], sampled + [True]
    prompt = turns.prompt(example.prompt) if turns else tokenizer.encode_prompt(example.prompt)
    return Generation(prompt_tokens=prompt, completion_tokens=tokens,
                      completion_logprobs=[0.0] * len(tokens), completion_sampled=sampled)


def sft_step(ddp, optimizer, examples: list[Example], tokenizer, turns: TagTurns | None = None,
             observation_tokens: int = 512) -> float:
    """One optimizer step on `examples` (one packed micro-batch); returns the global mean NLL."""
    batch = pack_completions([demonstration(e, tokenizer, turns, observation_tokens) for e in examples]).batch
    batch = batch.to(torch.cuda.current_device())
    answer_mask = batch.completion
    tokens = torch.tensor([float(answer_mask.sum()), float(answer_mask.numel())], device=answer_mask.device)
    torch.distributed.all_reduce(tokens)
    scale_router_losses(tokens[1])
    ddp.train()
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    logprobs, _ = forward_logprobs(ddp, batch)
    loss = -torch.where(answer_mask, logprobs, torch.zeros_like(logprobs)).sum() / tokens[0]
    loss.backward()
    router_loss_sums()  # a MoE model's router losses of the warm-up: not reported
    ddp.finish_grad_sync()
    optimizer.step()
    return all_reduce_metrics(MetricTerms(sums={"nll": loss.item()}))["nll"]
