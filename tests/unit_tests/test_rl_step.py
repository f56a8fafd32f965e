"""The whole RL update (`rl.step.train_on_rollouts`) on CPU: a one-process gloo group and a small
stand-in for Megatron's DDP model and optimizer. Checks the plumbing that the GPU runs trust:
parity over engine-reported positions, the loss against a hand-computed value, the old-logprob
path of several updates, the TIS shadow loss, and the skipped step."""

import dataclasses
import json
import time
import types

import pytest
import torch

from megatron_rl_bi.inference import Generation
from megatron_rl_bi.models.logprobs import forward_logprobs
from megatron_rl_bi.packing import pack_completions, unpack_token_values
from megatron_rl_bi.rl.losses import LossConfig
from megatron_rl_bi.rl.rollouts import Rollout
from megatron_rl_bi.rl import step
from megatron_rl_bi.rl.step import StepConfig, train_on_rollouts

VOCAB = 11


class _OutputLayer(torch.nn.Linear):
    """megatron-core's ColumnParallelLinear API: forward(input, weight=None) -> (output, bias)."""

    @property
    def output_size(self):
        return self.out_features

    def forward(self, hidden, weight=None):
        return super().forward(hidden), None


class TinyDDP(torch.nn.Module):
    """Embedding + output layer with the language model's API forward_logprobs uses (post_process,
    output_layer, config.params_dtype), and the DDP methods the step uses."""

    share_embeddings_and_output_weights = False

    def __init__(self, vocab_size: int = VOCAB):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab_size, 8)
        self.output_layer = _OutputLayer(8, vocab_size)
        self.post_process = True
        self.config = types.SimpleNamespace(params_dtype=torch.float32)

    def forward(self, input_ids, position_ids, attention_mask, packed_seq_params):
        hidden = self.embed(input_ids).transpose(0, 1)  # [T, 1, h]
        return self.output_layer(hidden)[0].transpose(0, 1) if self.post_process else hidden

    def _scale_logits(self, logits):
        return logits

    def zero_grad_buffer(self):
        self.zero_grad()

    def finish_grad_sync(self):
        pass


class SGD:
    """Megatron's optimizer API: step() -> (success, grad norm, zeros in grad); the norm is a
    float, or a 0-dim tensor as megatron-core returns it when TE is installed."""

    def __init__(self, model, norm_as_tensor=False):
        self.model, self.inner = model, torch.optim.SGD(model.parameters(), lr=0.1)
        self.norm_as_tensor = norm_as_tensor

    @property
    def param_groups(self):
        return self.inner.param_groups

    def zero_grad(self):
        self.inner.zero_grad()

    def step(self):
        norm = torch.cat([p.grad.flatten() for p in self.model.parameters()]).norm()
        self.inner.step()
        return True, norm if self.norm_as_tensor else norm.item(), None


@pytest.fixture
def one_rank(gloo_group, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


def _rollouts(model, advantages, engine_offset=0.0, temperature=1.0):
    """Two rollouts whose engine logprobs are the model's own at `temperature` (+ `engine_offset`)."""
    generations = [Generation([1, 2, 3], [4, 5], [0.0, 0.0]), Generation([6], [7, 8, 9], [0.0] * 3)]
    packed = pack_completions(generations)
    with torch.no_grad():
        logprobs, _ = forward_logprobs(model, packed.batch, temperature=temperature)
    for generation, row in zip(generations, unpack_token_values(logprobs, packed.batch)):
        completion = row[len(generation.prompt_tokens) - 1 :]
        generation.completion_logprobs = (completion + engine_offset).tolist()
    return [Rollout(g, reward=0.0, group_id=0, weight_version=0, advantage=a)
            for g, a in zip(generations, advantages)]


def test_one_update_parity_and_loss(one_rank):
    model = TinyDDP()
    rollouts = _rollouts(model, advantages=[1.0, 0.5])
    config = StepConfig(loss=LossConfig(), aggregation="sequence", micro_batch_tokens=5)
    metrics = train_on_rollouts(model, SGD(model), rollouts, config)
    # ratio 1: the loss is minus the mean over completions of their advantage
    assert metrics["loss"] == pytest.approx(-0.75)
    assert metrics["ratio_mean"] == pytest.approx(1.0) and metrics["clip_fraction"] == 0.0
    assert metrics["bit_wise/tokens"] == 5  # 2 + 3 completion tokens, over two micro-batches
    assert metrics["micro_batches"] == 2  # 5 and 4 tokens, at most 5 a micro-batch
    assert metrics["bit_wise/logprob_diff/max"] == 0.0
    assert metrics["grad_norm"] > 0 and metrics["update_skipped"] == 0.0
    assert metrics["lr"] == 0.1 and metrics["optimizer_steps"] == 1


def test_a_tensor_grad_norm_is_logged_as_a_float(one_rank):
    model = TinyDDP()
    metrics = train_on_rollouts(model, SGD(model, norm_as_tensor=True), _rollouts(model, [1.0, 0.5]),
                                StepConfig(micro_batch_tokens=5))
    assert type(metrics["grad_norm"]) is float and metrics["grad_norm"] > 0
    json.dumps(metrics)  # the metrics file takes it


def test_two_updates_use_the_old_logprobs_and_tis_shadow_loss(one_rank):
    model = TinyDDP()
    rollouts = _rollouts(model, advantages=[1.0, -1.0], engine_offset=-0.5)
    config = StepConfig(loss=LossConfig(tis_cap=1.2), aggregation="token", updates_per_step=2)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = train_on_rollouts(model, SGD(model), rollouts, config)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # engine = trainer - 0.5 at every compared position (the pre-update trainer)
    assert metrics["bit_wise/logprob_diff/mean"] == pytest.approx(0.5)
    assert metrics["bit_wise/ratio_tokens_different"] == 1.0
    assert metrics["bit_wise/tokens"] == 5
    # TIS weight min(exp(0.5), 1.2) = 1.2 everywhere, so the shadow loss differs
    assert metrics["tis/weight_mean"] == pytest.approx(1.2)
    assert metrics["loss"] != metrics["loss_without_tis"]
    assert metrics["micro_batches"] == 2  # one rollout in each update's mini-batch; the old logprobs' pass trains none


def test_no_completion_tokens_skips_the_update(one_rank):
    model = TinyDDP()
    metrics = train_on_rollouts(model, SGD(model), [], StepConfig())
    assert metrics["update_skipped"] == 1.0 and metrics["bit_wise/tokens"] == 0
    assert metrics["optimizer_steps"] == 0


def test_an_empty_mini_batch_is_skipped_not_fatal(one_rank):
    model = TinyDDP()
    rollouts = _rollouts(model, advantages=[1.0, -1.0])[:1]  # one rollout, two updates
    metrics = train_on_rollouts(model, SGD(model), rollouts, StepConfig(updates_per_step=2))
    assert metrics["optimizer_steps"] == 1 and metrics["update_skipped"] == 0.5
    assert metrics["bit_wise/tokens"] == 2


def test_a_skipped_update_does_not_dilute_the_logged_loss_and_norm(one_rank):
    """One rollout, two updates: the second mini-batch is empty and skipped; the loss and grad norm
    logged are the update taken's, as with one update (not halved by the skipped one)."""
    model = TinyDDP()
    rollout = _rollouts(model, advantages=[1.0, -1.0])[:1]
    two = train_on_rollouts(model, RecordingSGD(model, lr=0.0), rollout, StepConfig(updates_per_step=2))
    one = train_on_rollouts(model, RecordingSGD(model, lr=0.0), rollout, StepConfig(updates_per_step=1))
    assert two["update_skipped"] == 0.5 and one["update_skipped"] == 0.0
    # ratio 1: the loss is minus the one completion's advantage
    assert two["loss"] == pytest.approx(-1.0) and one["loss"] == pytest.approx(-1.0)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"]) and one["grad_norm"] > 0


class SlowSGD(SGD):
    def step(self):
        time.sleep(0.2)
        return super().step()


def test_the_optimizers_own_time_is_recorded(one_rank, monkeypatch):
    """Two updates whose optimizer steps take 0.2 s each and whose micro-batches 0.3 s each: the
    record holds the first, not the second."""
    micro_batch_loss = step._micro_batch_loss

    def slow_micro_batch_loss(*args, **kwargs):
        time.sleep(0.3)
        return micro_batch_loss(*args, **kwargs)

    monkeypatch.setattr(step, "_micro_batch_loss", slow_micro_batch_loss)
    model = TinyDDP()
    metrics = train_on_rollouts(model, SlowSGD(model), _rollouts(model, advantages=[1.0, -1.0]),
                                StepConfig(updates_per_step=2))
    assert metrics["optimizer_steps"] == 2 and 0.4 <= metrics["time/optimizer_s"] < 0.6
    assert train_on_rollouts(model, SlowSGD(model), [], StepConfig())["time/optimizer_s"] == 0.0


def test_the_lr_schedule_steps_once_per_update(one_rank):
    from megatron_rl_bi.config import parse_rl_args
    from megatron_rl_bi.optimizer import build_lr_scheduler

    args = parse_rl_args(["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1",
                          "--seq-length", "8", "--max-position-embeddings", "8", "--lr", "0.1",
                          "--lr-decay-style", "linear", "--train-iters", "1",
                          "--grpo-iterations", "2"])
    model = TinyDDP()
    optimizer = SGD(model)
    scheduler = build_lr_scheduler(args, optimizer)
    rollouts = _rollouts(model, advantages=[1.0, -1.0])
    metrics = train_on_rollouts(model, optimizer, rollouts, StepConfig(updates_per_step=2),
                                lr_scheduler=scheduler)
    assert metrics["lr"] == pytest.approx(0.05)  # the second update's: halfway down to 0
    assert scheduler.num_steps == 2 and optimizer.param_groups[0]["lr"] == 0.0


def test_trainer_logprobs_follow_the_sampling_temperature(one_rank):
    model = TinyDDP()
    rollouts = _rollouts(model, advantages=[1.0, -1.0], temperature=0.7)
    same = train_on_rollouts(model, SGD(model), rollouts, StepConfig(temperature=0.7,
                                                                     micro_batch_tokens=100))
    assert same["bit_wise/logprob_diff/max"] == 0.0
    model = TinyDDP()
    other = train_on_rollouts(model, SGD(model), _rollouts(model, [1.0, -1.0], temperature=0.7),
                              StepConfig(micro_batch_tokens=100))
    assert other["bit_wise/ratio_tokens_different"] == 1.0


def test_token_aggregation_divides_by_the_sampled_tokens_of_every_micro_batch(one_rank):
    """A conversation (prompt 3 tokens; 4 completion tokens, the middle 2 an environment's) with
    advantage 1 and a plain rollout (3 completion tokens) with 0.5, one micro-batch each. At ratio
    1 the loss is minus the token mean of the advantage over the 2 + 3 sampled tokens:
    -(2 * 1 + 3 * 0.5) / 5 = -0.7 (not / 7 with the environment's tokens counted, nor -1 - 0.5
    with each micro-batch's own count)."""
    model = TinyDDP()
    conversation = Generation([1, 2, 3], [4, 5, 6, 7], [0.0] * 4, completion_sampled=[True, False, False, True])
    rollouts = [Rollout(conversation, reward=0.0, group_id=0, weight_version=0, advantage=1.0),
                Rollout(Generation([6], [7, 8, 9], [0.0] * 3), reward=0.0, group_id=0, weight_version=0,
                        advantage=0.5)]
    metrics = train_on_rollouts(model, SGD(model), rollouts, StepConfig(aggregation="token", micro_batch_tokens=5))
    assert metrics["micro_batches"] == 2 and metrics["bit_wise/tokens"] == 5
    assert metrics["loss"] == pytest.approx(-0.7)


def test_each_rank_normalizes_by_the_counts_of_all_ranks(one_rank, monkeypatch):
    """Two ranks holding the same rollouts, made by an all-reduce that doubles every sum: 10
    completion tokens in all, so this rank's share of the loss is -(2 * 1 + 3 * 0.5) / 10 and the
    pooled loss the one-rank -0.7 (with this rank's own count of 5 it would pool to -1.4)."""
    def two_equal_ranks(tensor, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        if op == torch.distributed.ReduceOp.SUM:
            tensor.mul_(2)

    monkeypatch.setattr(torch.distributed, "all_reduce", two_equal_ranks)
    model = TinyDDP()
    metrics = train_on_rollouts(model, SGD(model), _rollouts(model, advantages=[1.0, 0.5]),
                                StepConfig(aggregation="token", micro_batch_tokens=5))
    assert metrics["bit_wise/tokens"] == 10 and metrics["micro_batches"] == 4
    assert metrics["loss"] == pytest.approx(-0.7)


class RecordingSGD(SGD):
    def __init__(self, model, lr):
        super().__init__(model)
        self.inner.param_groups[0]["lr"] = lr
        self.norms = []

    def step(self):
        result = super().step()
        self.norms.append(result[1])
        return result


def test_each_update_has_its_own_gradient_and_the_logged_norm_is_their_mean(one_rank):
    """Two updates on two copies of one rollout at learning rate 0 (the weights do not move): the
    second update's gradient is the first's again, not the two added up, and the logged grad norm
    is the mean of the two (equal) norms."""
    model = TinyDDP()
    rollout = _rollouts(model, advantages=[1.0, -1.0])[0]
    optimizer = RecordingSGD(model, lr=0.0)
    metrics = train_on_rollouts(model, optimizer, [rollout, dataclasses.replace(rollout)],
                                StepConfig(updates_per_step=2))
    first, second = optimizer.norms
    assert first > 0 and second == first
    assert metrics["grad_norm"] == pytest.approx(first)


def test_one_update_takes_the_ratios_denominator_from_its_own_forward(one_rank, monkeypatch):
    """With one update the old logprobs are the training forward's own, detached: one forward per
    micro-batch (2 here). With two updates a first pass over all rollouts computes them: 2 + 2."""
    forwards = []

    def counting_forward_logprobs(*args, **kwargs):
        forwards.append(1)
        return forward_logprobs(*args, **kwargs)

    monkeypatch.setattr(step, "forward_logprobs", counting_forward_logprobs)
    model = TinyDDP()
    rollouts = _rollouts(model, advantages=[1.0, -1.0])
    train_on_rollouts(model, SGD(model), rollouts, StepConfig(micro_batch_tokens=5))
    assert len(forwards) == 2
    forwards.clear()
    train_on_rollouts(model, SGD(model), rollouts, StepConfig(micro_batch_tokens=5, updates_per_step=2))
    assert len(forwards) == 4
