"""Engine-vs-trainer parity on one set of requests: generate, recompute, compare.

Used by tools/check_parity.py, the benches and the GPU tests. The trainer side runs in training
mode with autograd on, exactly as the RL step does, in packed micro-batches of at most
`micro_batch_tokens` tokens (so different trainer batch shapes are exercised too).
"""

import random

import torch

from megatron_rl_bi.inference import Generation, Generator, Sampling
from megatron_rl_bi.models.logprobs import forward_logprobs
from megatron_rl_bi.packing import micro_batches, pack_completions
from megatron_rl_bi.parity.metrics import RoutingCompared, parity_metrics, routing_terms


def random_requests(
    num_requests: int,
    prompt_lengths: tuple[int, int],
    max_new_tokens: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> tuple[list[list[int]], list[int]]:
    """Prompts of uniformly mixed lengths and decode budgets; the first request gets the
    shortest prompt and the longest budget, the second the longest prompt, so both ends are hit."""
    rng = random.Random(seed)
    lengths = [rng.randint(*prompt_lengths) for _ in range(num_requests)]
    budgets = [rng.randint(*max_new_tokens) for _ in range(num_requests)]
    lengths[0], budgets[0] = prompt_lengths[0], max_new_tokens[1]
    if num_requests > 1:
        lengths[1] = prompt_lengths[1]
    prompts = [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]
    return prompts, budgets


def trainer_vs_engine(
    model: torch.nn.Module, generations: list[Generation], micro_batch_tokens: int,
    temperature: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Packed per-position tensors (CPU): trainer logprobs at the sampling `temperature` and the
    engine's, the engine-reported mask and the completion mask; for a MoE model under
    --moe-enable-routing-replay also both sides' routing and the tokens it compares
    (RoutingCompared.tensors)."""
    parts = {"train": [], "engine": [], "reported": [], "completion": []}
    routing = RoutingCompared()
    model.train()
    for group in micro_batches(generations, micro_batch_tokens):
        packed = pack_completions(group)
        logprobs, _ = forward_logprobs(model, packed.batch.to("cuda"), temperature=temperature)
        routing.add(packed)
        parts["train"].append(logprobs.detach().cpu())
        parts["engine"].append(packed.engine_logprobs)
        parts["reported"].append(packed.reported)
        parts["completion"].append(packed.batch.completion)
    return {**{name: torch.cat(tensors) for name, tensors in parts.items()}, **routing.tensors()}


def compared_metrics(compared: dict[str, torch.Tensor]) -> dict:
    """bit_wise/* over every reported token (and routing/* when compared), and over the
    completions' alone."""
    train, engine, reported = compared["train"], compared["engine"], compared["reported"]
    routing = (routing_terms(compared["train_routing"], compared["engine_routing"], compared["routed"]).finalize()
               if "routed" in compared else {})
    return {
        "all_reported": parity_metrics(train, engine, reported) | routing,
        "completion_only": parity_metrics(train, engine, reported & compared["completion"]),
    }


def run_parity(
    model: torch.nn.Module,
    generator: Generator,
    prompts: list[list[int]],
    budgets: list[int],
    sampling: Sampling,
    micro_batch_tokens: int,
    orders: int = 2,
) -> dict:
    """Generates the requests in `orders` admission orders (as given, then shuffled with the
    sampling seed), compares each run against the trainer, and pools all runs."""
    runs, pooled = [], []
    order = list(range(len(prompts)))
    for run in range(orders):
        if run > 0:
            random.Random(sampling.seed + run).shuffle(order)
        generations = generator.generate(
            [prompts[i] for i in order], sampling, [budgets[i] for i in order]
        )
        compared = trainer_vs_engine(model, generations, micro_batch_tokens, sampling.temperature)
        pooled.append(compared)
        runs.append(
            {
                "order_head": order[:8],
                "completion_tokens": sum(len(g.completion_tokens) for g in generations),
                **compared_metrics(compared),
            }
        )
    total = {name: torch.cat([c[name] for c in pooled]) for name in pooled[0]}
    return {"runs": runs, **compared_metrics(total)}
