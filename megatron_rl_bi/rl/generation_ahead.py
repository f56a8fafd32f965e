"""Rollouts generated ahead of training (--rl-partial-rollouts --rl-generation-lag L): the batches
in flight, each rollout's weight version, and how stale a step's rollouts are. Generator and
trainer take turns on one module here; the bookkeeping is what a generator apart would use."""

import collections
import dataclasses
import time

from megatron_rl_bi.distributed import MetricTerms
from megatron_rl_bi.inference import Generation
from megatron_rl_bi.rl.rollouts import Rollout


class GenerationAhead:
    """Rollout batches generated ahead of the step that trains on them (--rl-generation-lag L):
    L + 1 batches in flight, the oldest trained on, each generated with the weights of its time
    (recorded per rollout, Rollout.weight_version), from the prompts and with the sampling seed
    of the step it is for. L = 0 generates each step's batch at its step: the synchronous loop."""

    def __init__(self, lag: int, last_step: int, generate):
        self.lag, self.last_step, self.generate, self.pending = lag, last_step, generate, collections.deque()

    def take(self, step: int, weight_version: int) -> tuple[list, MetricTerms, float]:
        """Step `step`'s batch (groups, statistics) and the seconds spent generating now (for it
        and for the steps after it, up to the run's last)."""
        started = time.time()
        while len(self.pending) <= self.lag and step + len(self.pending) <= self.last_step:
            self.pending.append(self.generate(step + len(self.pending), weight_version))
        groups, stats = self.pending.popleft()
        return groups, stats, time.time() - started

    def start(self, step: int, weight_version: int, module) -> None:
        """Nothing to send: the engine generates with the trainer's own module."""

    def published(self, step: int, weight_version: int, module) -> None:
        """Nothing to send: the engine generates with the trainer's own module."""

    def finish(self) -> None:
        """Nothing runs apart to be told."""

    def state_dict(self) -> list[dict]:
        """The batches generated and not yet trained on, as plain values (for the checkpoint:
        a resumed run trains on them, neither losing nor regenerating one)."""
        return [batch_to_plain(groups, stats) for groups, stats in self.pending]

    def load_state_dict(self, state: list[dict]) -> None:
        self.pending = collections.deque(batch_from_plain(batch) for batch in state)


def batch_to_plain(groups: list, stats: MetricTerms) -> dict:
    """A batch of rollout groups and its statistics as plain values (a checkpoint, the bridge)."""
    return {"groups": [[dataclasses.asdict(r) for r in group] for group in groups],
            "stats": dataclasses.asdict(stats)}


def batch_from_plain(batch: dict) -> tuple[list, MetricTerms]:
    return ([[Rollout(**{**r, "generation": Generation(**r["generation"])}) for r in group]
             for group in batch["groups"]], MetricTerms(**batch["stats"]))


def weights_step(step: int, lag: int) -> int:
    """The step whose weights generate step `step`'s batch (0: the starting weights): L steps
    before the previous one."""
    return max(0, step - 1 - lag)


def staleness_terms(rollouts: list, weight_version: int) -> MetricTerms:
    """Optimizer steps between the weights that sampled each rollout and the weights it trains."""
    lags = [weight_version - r.weight_version for r in rollouts]
    return MetricTerms(means={"rollouts/staleness": (sum(lags), len(lags))},
                       maxima={"rollouts/staleness_max": float(max(lags, default=0))})
