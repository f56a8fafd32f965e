"""Rollouts from generator ranks apart from the trainers (--rl-generator-ranks K; the processes and
the bridge between them: megatron_rl_bi.bridge), within the window of --rl-generation-lag L.

Step s's batch is generated with the weights of step max(0, s - 1 - L), from trainer rank r's
prompts with its sampling seed: exactly what the colocated loop generates (rl.generation_ahead),
so with the same flags a run with generators apart repeats the colocated run's rollouts bit for
bit, L = 0 included; only where the batches are generated, and when, differs.

What goes over the bridge:
  start/R            trainer rank R -> its generator: the step whose weights come first, the
                     first step to generate, R's prompt position (a resumed run's) and the
                     trainer's `Schedule`, which the generator follows
  refit/G/S          trainer rank 0 -> generator G: the weight version after step S (None: the
                     run stopped early), followed by the weights themselves over the weights group
  batch/S/R          generator -> trainer rank R: step S's batch and R's prompt position after it
  eval/S/R           generator -> trainer rank R: R's share of the validation of step S's weights
The trainer sends the weights after step S when some batch still to come is generated with them
(S <= last step - 1 - L) or when S is validated (`Schedule`), from a copy taken after the update,
on a thread of its own: it trains on while a generator finishes the batch it is on.
"""

import collections
import dataclasses
import threading
import time
from dataclasses import dataclass

import torch
from megatron.core.utils import unwrap_model

from megatron_rl_bi.bridge import Bridge, check_layout
from megatron_rl_bi.distributed import MetricTerms
from megatron_rl_bi.envs import PromptSource
from megatron_rl_bi.rl.evaluate import validation_terms
from megatron_rl_bi.rl.generation_ahead import batch_from_plain, batch_to_plain, weights_step
from megatron_rl_bi.rl.old_weights import weight_tensors
from megatron_rl_bi.rl.rollouts import collect_rollouts, step_sampling


@dataclass(frozen=True)
class Schedule:
    """When the weights go to the generators: after every step whose weights generate a batch
    still to come (step <= last - 1 - lag), and after every step validated there
    (--eval-interval). The trainer's travels in the start record: both sides read the same one."""

    lag: int
    last_step: int
    eval_interval: int = 0

    def validated(self, step: int) -> bool:
        return bool(self.eval_interval) and step % self.eval_interval == 0

    def sends_after(self, step: int) -> bool:
        return step <= self.last_step - 1 - self.lag or self.validated(step)

    def next_send(self, after: int) -> int | None:
        """The first step after `after` whose weights are sent; None when there is none."""
        return next((s for s in range(after + 1, self.last_step + 1) if self.sends_after(s)), None)


class PromptPosition:
    """A trainer rank's prompt position when its prompts are drawn by a generator: what the last
    batch received left (None before the first: the generator starts at the beginning)."""

    def __init__(self):
        self.state = None

    def state_dict(self) -> dict | None:
        return self.state

    def load_state_dict(self, state: dict | None) -> None:
        self.state = state


class RemoteGeneration:
    """The trainer's side: GenerationAhead's interface, its batches received from a generator."""

    def __init__(self, bridge: Bridge, schedule: Schedule):
        self.bridge, self.schedule = bridge, schedule
        self.lag, self.last_step = schedule.lag, schedule.last_step
        self.rank = torch.distributed.get_rank()
        self.source, self.pending = PromptPosition(), collections.deque()
        self.received_step = self.trained_step = 0
        self.sending, self.send_error = None, None

    def start(self, step: int, weight_version: int, module) -> None:
        """Tells the generator where the run starts (fresh, or resumed at `step` with the batches
        its checkpoint holds) and sends it the weights to start from."""
        self.trained_step, self.received_step = step, step + len(self.pending)
        self.bridge.put(f"start/{self.rank}", {"weights_step": step, "first_step": self.received_step + 1,
                                               "source": self.source.state_dict(),
                                               "schedule": dataclasses.asdict(self.schedule)})
        if self.rank == 0:
            check_layout(self.bridge, weight_tensors(unwrap_model(module)), "generator")
        self._send(step, weight_version, module)

    def take(self, step: int, weight_version: int) -> tuple[list, object, float]:
        """Step `step`'s batch and the seconds spent waiting for it."""
        started = time.time()
        if not self.pending:
            self._receive()
        groups, stats = self.pending.popleft()
        self.trained_step = step
        return groups, stats, time.time() - started

    def published(self, step: int, weight_version: int, module) -> None:
        """After step `step`'s update: the weights go to the generators if a batch still to come
        is generated with them, or if they are validated there."""
        if self.schedule.sends_after(step):
            self._send(step, weight_version, module)

    def validation(self, step: int) -> MetricTerms:
        """This rank's share of the validation of the weights after `step`, from its generator."""
        return MetricTerms(**self.bridge.take(f"eval/{step}/{self.rank}",
                                              f"generator rank {self.bridge.roles.generator_of(self.rank)}"))

    def finish(self) -> None:
        """The run ends after the step trained last (its last step, or an early stop): the last
        weights are sent, and generators waiting for weights that will not come are told."""
        self._wait_for_send()
        next_weights = self.schedule.next_send(self.trained_step)
        if self.rank == 0 and next_weights is not None:
            for index in range(self.bridge.roles.generators):
                self.bridge.put(f"refit/{index}/{next_weights}", None)

    def state_dict(self) -> list[dict]:
        """The batches due within the window (received first if still on their way), as a
        colocated run's checkpoint holds them."""
        while self.received_step < min(self.trained_step + self.lag, self.last_step):
            self._receive()
        return [batch_to_plain(groups, stats) for groups, stats in self.pending]

    def load_state_dict(self, state: list[dict]) -> None:
        self.pending = collections.deque(batch_from_plain(batch) for batch in state)

    def _receive(self) -> None:
        step = self.received_step + 1
        record = self.bridge.take(f"batch/{step}/{self.rank}",
                                  f"generator rank {self.bridge.roles.generator_of(self.rank)}")
        self.pending.append(batch_from_plain(record))
        self.source.load_state_dict(record["source"])
        self.received_step = step

    def _send(self, step: int, weight_version: int, module) -> None:
        """Trainer rank 0 sends the weights after `step`, copied now, on its sending thread."""
        self._wait_for_send()
        if self.rank != 0:
            return
        device = self.bridge.device
        copies = [t.detach().to(device, copy=True) for _, t in weight_tensors(unwrap_model(module))]

        def send() -> None:
            try:
                for index in range(self.bridge.roles.generators):
                    self.bridge.put(f"refit/{index}/{step}", weight_version)
                self.bridge.broadcast(copies)
            except Exception as exc:  # noqa: BLE001 - raised on the training thread at the next send
                self.send_error = exc

        self.sending = threading.Thread(target=send, daemon=True)
        self.sending.start()

    def _wait_for_send(self) -> None:
        if self.sending is not None:
            self.sending.join()
            self.sending = None
        if self.send_error is not None:
            raise RuntimeError(f"sending the weights to the generators failed: {self.send_error}") from self.send_error


def rank_batches(engine, tokenizer, sampling, rollout_config):
    """The generator's `generate` for serve_generation: trainer rank R's batch of a step, from R's
    prompts with R's sampling seed, as R would generate it with its own engine."""
    def generate(step: int, weight_version: int, rank: int, source: PromptSource):
        return collect_rollouts(engine, source, tokenizer, step_sampling(sampling, step, rank), rollout_config,
                                weight_version)

    return generate


def rank_validation(engine, examples: list, tokenizer, sampling, seed: int, rollout_config, trainers: int):
    """The generator's `validate` for serve_generation: trainer rank R's share of the held-out
    set, scored as R would score it with its own engine."""
    def validate(rank: int) -> MetricTerms:
        return validation_terms(engine, examples, tokenizer, sampling, seed, rollout_config, rank, trainers)

    return validate


def serve_generation(bridge: Bridge, module, task, seed: int, generate, validate=None) -> None:
    """A generator's whole run: the start record of each trainer rank it serves, the weights,
    every batch from the first step to the last with the weights its window asks for, and the
    validation of the weights of each validated step, as the trainers' schedule says.
    `generate(step, weight_version, trainer_rank, source)` -> (groups, stats);
    `validate(trainer_rank)` -> MetricTerms of that rank's share of the held-out set."""
    roles = bridge.roles
    ranks = roles.served_ranks()
    starts = {rank: bridge.take(f"start/{rank}", f"trainer rank {rank}") for rank in ranks}
    sources = {rank: PromptSource(task, seed, rank, roles.trainers) for rank in ranks}
    for rank, start in starts.items():
        if start["source"] is not None:
            sources[rank].load_state_dict(start["source"])
    schedule = Schedule(**starts[ranks[0]]["schedule"])
    named = weight_tensors(unwrap_model(module))
    check_layout(bridge, named, f"generator rank {roles.rank}")
    weights = _ReceivedWeights(bridge, [tensor for _, tensor in named], schedule, ranks, validate)
    weights.receive(starts[ranks[0]]["weights_step"], validating=False)
    for step in range(starts[ranks[0]]["first_step"], schedule.last_step + 1):
        if not weights.receive_through(weights_step(step, schedule.lag)):
            return  # the trainers stopped early
        for rank in ranks:
            groups, stats = generate(step, weights.version, rank, sources[rank])
            bridge.put(f"batch/{step}/{rank}", {**batch_to_plain(groups, stats), "source": sources[rank].state_dict()})
    weights.receive_through(schedule.last_step)  # the weights only validated, after the last batch


class _ReceivedWeights:
    """A generator's weights: the step and version they are of, received in the schedule's
    order; the weights of a validated step are validated as soon as they arrive."""

    def __init__(self, bridge: Bridge, tensors: list, schedule: Schedule, ranks: list[int], validate):
        self.bridge, self.tensors, self.schedule, self.ranks, self.validate = bridge, tensors, schedule, ranks, validate
        self.step, self.version = 0, None

    def receive(self, step: int, validating: bool = True) -> bool:
        """The weights after `step` (validated if the schedule says so and `validating`: not the
        weights a run starts or resumes from, validated before); False when the trainers
        stopped instead."""
        self.version = _receive_weights(self.bridge, self.tensors, step)
        self.step = step
        if self.version is not None and validating and self.validate is not None and self.schedule.validated(step):
            for rank in self.ranks:
                self.bridge.put(f"eval/{step}/{rank}", dataclasses.asdict(self.validate(rank)))
        return self.version is not None

    def receive_through(self, step: int) -> bool:
        """Every weights sent up to `step`, in order; False when the trainers stopped."""
        while (following := self.schedule.next_send(self.step)) is not None and following <= step:
            if not self.receive(following):
                return False
        return True


@torch.no_grad()
def _receive_weights(bridge: Bridge, tensors: list, step: int) -> int | None:
    """The weights after `step` into `tensors`, and their version; None when the run stopped."""
    version = bridge.take(f"refit/{bridge.roles.generator_index}/{step}", "trainer rank 0")
    if version is not None:
        bridge.broadcast(tensors)
    return version
