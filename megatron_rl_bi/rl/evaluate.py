"""Validation reward: the policy's mean task reward on a held-out prompt set, sampled the way the
run samples (conversations too, with an environment), with one fixed seed so every evaluation of
a run draws comparably.

Each data-parallel rank scores its own shard of the set (example i on rank i % world); the mean is
pooled over ranks by count.
"""

import dataclasses
from collections import Counter

import torch

from megatron_rl_bi.distributed import MetricTerms
from megatron_rl_bi.inference import Generator, Sampling
from megatron_rl_bi.rl.rollouts import RolloutConfig, generate_and_score

VALIDATION_REWARD = "validation_reward/mean"


def validation_terms(generator: Generator, examples: list, tokenizer, sampling: Sampling,
                     seed: int, config: RolloutConfig, rank: int | None = None,
                     world: int | None = None) -> MetricTerms:
    """Data-parallel rank `rank`'s share (default: this process's) of `validation_reward/mean`:
    each example completed once, or with an environment (--rl-env) as a conversation, scored as
    the rollouts are; and how many rewards scored 0 because the verifier or the environment
    failed. A generator rank apart passes the rank and world of the trainer it serves."""
    if rank is None:
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    shard = examples[rank::world]
    scores = []
    if shard:
        _, scores = generate_and_score(generator, shard, tokenizer, dataclasses.replace(sampling, seed=seed),
                                       config, Counter())
    return MetricTerms(means={VALIDATION_REWARD: (sum(reward for reward, _ in scores), len(scores))},
                       sums={"validation/reward_problems": sum(problem is not None for _, problem in scores)})
