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

    def state_dict(self) -> list[dict]:
        """The batches generated and not yet trained on, as plain values (for the checkpoint:
        a resumed run trains on them, neither losing nor regenerating one)."""
        return [{"groups": [[dataclasses.asdict(r) for r in group] for group in groups],
                 "stats": dataclasses.asdict(stats)} for groups, stats in self.pending]

    def load_state_dict(self, state: list[dict]) -> None:
        self.pending = collections.deque(
            ([[Rollout(**{**r, "generation": Generation(**r["generation"])}) for r in group]
              for group in batch["groups"]], MetricTerms(**batch["stats"])) for batch in state)


def staleness_terms(rollouts: list, weight_version: int) -> MetricTerms:
    """Optimizer steps between the weights that sampled each rollout and the weights it trains."""
    lags = [weight_version - r.weight_version for r in rollouts]
    return MetricTerms(means={"rollouts/staleness": (sum(lags), len(lags))},
                       maxima={"rollouts/staleness_max": float(max(lags, default=0))})
