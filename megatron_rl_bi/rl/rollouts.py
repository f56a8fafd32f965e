"""Rollouts: G completions per prompt from the engine, scored by the task's verifier.

`Rollout` is what everything downstream of the engine takes. DAPO's dynamic sampling keeps only
groups whose rewards differ and draws new prompts until the step has enough groups (or
`max_rounds` is reached; the step then trains on what it has and says so in its metrics).
"""

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass

import torch

from megatron_rl_bi.distributed import MetricTerms
from megatron_rl_bi.envs import PromptSource
from megatron_rl_bi.envs.environment import FAILED, TIMED_OUT
from megatron_rl_bi.inference import Generation, Generator, Sampling
from megatron_rl_bi.rl.advantages import group_advantages
from megatron_rl_bi.rl.conversations import TurnConfig, run_conversations
from megatron_rl_bi.rl.rewards import (
    NONFINITE,
    RAISED,
    groups_with_signal,
    overlong_penalty,
    score_completion,
)


@dataclass
class Rollout:
    """One completion the policy is trained on: the engine's generation and its scoring."""

    generation: Generation
    reward: float
    group_id: int
    weight_version: int  # optimizer steps taken by the weights that generated it
    advantage: float = 0.0

    @property
    def prompt_tokens(self) -> list[int]:
        return self.generation.prompt_tokens

    @property
    def completion_tokens(self) -> list[int]:
        return self.generation.completion_tokens

    @property
    def tokens(self) -> list[int]:
        return self.generation.tokens

    @property
    def truncated(self) -> bool:
        """Stopped by the token budget, not by end-of-document."""
        return not self.generation.stopped_on_eod


@dataclass(kw_only=True)
class RolloutConfig:
    prompts_per_step: int = 8
    """Groups per step on each data-parallel rank (--grpo-prompts-per-step)."""
    group_size: int = 8
    """Completions per prompt (--grpo-group-size)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and refill (DAPO;
    --grpo-filter-groups-with-same-reward)."""
    max_rounds: int = 4
    """Generation rounds per step when refilling (--rl-dynamic-sampling-max-rounds)."""
    overlong_buffer: int = 0
    """DAPO overlong shaping over the last N tokens of the budget; 0 disables
    (--rl-overlong-buffer)."""
    overlong_penalty: float = 1.0
    """Reward at (and past) the full budget under overlong shaping (--rl-overlong-penalty)."""
    normalize_std: bool = True
    """Divide advantages by the group's reward std (off with --rl-no-advantage-std)."""
    environment: type | None = None
    """Multi-turn rollouts with this environment class (--rl-env); None: one completion each."""
    turns: TurnConfig = dataclasses.field(default_factory=TurnConfig)
    """The conversations' limits, with an environment."""


def _score_group(generations, scores, sampling, config, group_id, weight_version):
    """One prompt's rollouts with rewards (task reward + overlong shaping over the budget each
    request ran with), their raw task rewards, and the problems counted (verifier raised,
    non-finite reward, environment failed or timed out)."""
    rollouts, task_rewards, problems = [], [], Counter()
    for generation, (reward, problem) in zip(generations, scores):
        problems[problem] += 1
        task_rewards.append(reward)
        rollouts.append(Rollout(generation, reward, group_id, weight_version))
    if config.overlong_buffer:
        lengths = torch.tensor([len(r.completion_tokens) for r in rollouts])
        budgets = torch.tensor([sampling.max_new_tokens if g.max_new_tokens is None
                                else g.max_new_tokens for g in generations])
        shaping = overlong_penalty(lengths, budgets, config.overlong_buffer, config.overlong_penalty)
        for rollout, penalty in zip(rollouts, shaping.tolist()):
            rollout.reward += penalty
    return rollouts, task_rewards, problems


def generate_and_score(generator, samples, tokenizer, sampling, config, conversation_counts):
    """Each sample's generation and score (reward, problem): one completion scored by the
    example's verifier, or with an environment (--rl-env) a conversation scored by it (what
    happened added to `conversation_counts`)."""
    if config.environment is None:
        generations = generator.generate([tokenizer.encode_prompt(e.prompt) for e in samples], sampling)
        return generations, [score_completion(e, g, tokenizer) for e, g in zip(samples, generations)]
    generations, scores, counts = run_conversations(generator, samples, config.environment, tokenizer,
                                                    sampling, config.turns)
    turns_max = max(conversation_counts["turns_max"], counts.pop("turns_max"))
    conversation_counts.update(counts)
    conversation_counts["turns_max"] = turns_max  # a maximum over rounds, not a sum
    return generations, scores


def step_sampling(sampling: Sampling, step: int, rank: int) -> Sampling:
    """The sampling of data-parallel rank `rank`'s batch for `step`: its seed a function of the
    run's seed, the step and the rank (so a resumed run, or a generator apart, draws the same)."""
    return dataclasses.replace(sampling, seed=sampling.seed + 1_000_003 * step + rank)


def _report_round(round_index: int, generations: list[Generation], seconds: float) -> None:
    """Rank 0 prints each generation round's pace: a long generation (8K-token responses, DAPO's
    extra rounds) shows how far it is long before its step's record."""
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    tokens = sum(g.sampled_tokens for g in generations)
    print(f"generation round {round_index + 1}: {len(generations)} requests, {tokens} new tokens in "
          f"{seconds:.1f} s ({tokens / max(seconds, 1e-9):.0f} tokens/s)", flush=True)


def collect_rollouts(
    generator: Generator,
    source: PromptSource,
    tokenizer,
    sampling: Sampling,
    config: RolloutConfig,
    weight_version: int,
) -> tuple[list[list[Rollout]], MetricTerms]:
    """Groups of `group_size` rollouts with advantages set, and this rank's rollout statistics."""
    groups, task_rewards, problems, dropped, rounds = [], [], Counter(), 0, 0
    conversation_counts = Counter()
    while len(groups) < config.prompts_per_step and rounds < config.max_rounds:
        examples = source.take(config.prompts_per_step - len(groups))
        samples = [e for e in examples for _ in range(config.group_size)]
        round_sampling = dataclasses.replace(sampling, seed=sampling.seed + 7919 * rounds)
        started = time.time()
        generations, scores = generate_and_score(generator, samples, tokenizer, round_sampling, config,
                                                 conversation_counts)
        _report_round(rounds, generations, time.time() - started)
        for i, example in enumerate(examples):
            span = slice(i * config.group_size, (i + 1) * config.group_size)
            group, rewards_of_group, group_problems = _score_group(
                generations[span], scores[span], sampling, config, len(groups), weight_version,
            )
            problems += group_problems
            task_rewards += rewards_of_group
            # DAPO filters on task accuracy: shaping alone does not make a group informative.
            if config.dynamic_sampling and not groups_with_signal(torch.tensor([rewards_of_group]))[0]:
                dropped += 1
                continue
            rewards = torch.tensor([[r.reward for r in group]])
            for rollout, advantage in zip(group, group_advantages(rewards, config.normalize_std)[0]):
                rollout.advantage = advantage.item()
            groups.append(group)
        rounds += 1
        if not config.dynamic_sampling:
            break
    trained = [r for group in groups for r in group]
    stats = MetricTerms(
        sums={"rollouts/groups": len(groups), "rollouts/groups_dropped": dropped,
              "rollouts/generated": len(task_rewards),
              "rollouts/verifier_failures": problems[RAISED],
              "rollouts/nonfinite_rewards": problems[NONFINITE]},
        means={
            "rollouts/rounds": (rounds, 1),
            "rollouts/truncated_fraction": (sum(r.truncated for r in trained), len(trained)),
            "rollouts/completion_length": (sum(len(r.completion_tokens) for r in trained),
                                           len(trained)),
            # Task reward (accuracy for 0/1 verifiers) over everything generated, dropped too.
            "reward/task_mean": (sum(task_rewards), len(task_rewards)),
            # Shaped reward of the rollouts trained on.
            "reward/trained_mean": (sum(r.reward for r in trained), len(trained)),
        },
    )
    if config.environment is not None:
        stats.update(_conversation_terms(trained, conversation_counts, len(task_rewards)))
    return groups, stats


def _conversation_terms(trained: list[Rollout], counts: Counter, samples: int) -> MetricTerms:
    """Multi-turn metrics: turns per conversation (of all generated), environment problems, the
    seconds spent waiting for the environment, conversations cut by a limit, and the trained
    rollouts' sampled and environment tokens."""
    sampled = sum(r.generation.sampled_tokens for r in trained)
    return MetricTerms(
        sums={"rollouts/env_failures": counts[FAILED], "rollouts/env_timeouts": counts[TIMED_OUT],
              "rollouts/conversations_cut": counts["truncated"], "rollouts/env_seconds": counts["env_seconds"]},
        means={"rollouts/turns": (counts["turns"], samples),
               "rollouts/sampled_tokens": (sampled, len(trained)),
               "rollouts/environment_tokens": (sum(len(r.completion_tokens) for r in trained) - sampled,
                                               len(trained))},
        maxima={"rollouts/turns_max": float(counts["turns_max"])},
    )
