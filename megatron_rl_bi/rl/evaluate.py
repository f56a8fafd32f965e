"""Validation reward: the policy's mean task reward on a held-out prompt set, sampled the way the
run samples, with one fixed seed so every evaluation of a run draws comparably.

Each data-parallel rank scores its own shard of the set (example i on rank i % world); the mean is
pooled over ranks by count.
"""

import dataclasses

import torch

from megatron_rl_bi.distributed import MetricTerms
from megatron_rl_bi.inference import Generator, Sampling
from megatron_rl_bi.rl.rewards import score_completion

VALIDATION_REWARD = "validation_reward/mean"


def validation_terms(generator: Generator, examples: list, tokenizer, sampling: Sampling,
                     seed: int) -> MetricTerms:
    """This rank's share of `validation_reward/mean` (and how many rewards scored 0 because the
    verifier raised or returned a non-finite value)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    shard = examples[rank::world]
    rewards, problems = [], 0
    if shard:
        prompts = [tokenizer.encode_prompt(example.prompt) for example in shard]
        generations = generator.generate(prompts, dataclasses.replace(sampling, seed=seed))
        for example, generation in zip(shard, generations):
            reward, problem = score_completion(example, generation, tokenizer)
            rewards.append(reward)
            problems += problem is not None
    return MetricTerms(means={VALIDATION_REWARD: (sum(rewards), len(rewards))},
                       sums={"validation/reward_problems": problems})
