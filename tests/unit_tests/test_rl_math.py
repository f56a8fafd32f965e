"""Advantages, rewards and losses against hand-computed values."""

import math

import pytest
import torch

from megatron_rl_bi.rl.advantages import group_advantages
from megatron_rl_bi.rl.losses import LossConfig, LossInputs, policy_loss, token_weights
from megatron_rl_bi.rl.rewards import groups_with_signal, overlong_penalty, safe_reward

GRPO = LossConfig(eps_low=0.2, eps_high=0.2)
DAPO = LossConfig(eps_low=0.2, eps_high=0.28)


def test_group_advantages_worked_example():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    adv = group_advantages(rewards, eps=0.0)
    assert adv.tolist() == [[1.0, -1.0, -1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    assert group_advantages(rewards, normalize_std=False).tolist()[0] == [0.5, -0.5, -0.5, 0.5]
    two = group_advantages(torch.tensor([[1.0, 0.0]]), eps=0.0)
    assert two.tolist() == [[1.0, -1.0]]  # population std
    with pytest.raises(ValueError, match="num_groups, group_size"):
        group_advantages(torch.zeros(4))


def test_a_group_of_equal_rewards_gets_exactly_zero_advantage():
    """Eight rewards of 0.7 (a task reward of 1 shaped by -0.3): their float32 mean is 1 ulp
    (5.96e-8) off 0.7, and so is their population std, so centered / (std + 1e-6) was
    5.96e-8 / 1.0596e-6 = 0.056 for every completion: a push towards all of them. Exactly 0."""
    flat = torch.full((1, 8), 0.7)
    assert torch.equal(group_advantages(flat), torch.zeros(1, 8))
    assert torch.equal(group_advantages(flat, normalize_std=False), torch.zeros(1, 8))
    # the other groups of the batch keep theirs: [1, 0] -> +-0.5 / (0.5 + 1e-6)
    mixed = group_advantages(torch.tensor([[0.7] * 8, [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]]))
    assert torch.equal(mixed[0], torch.zeros(8))
    assert mixed[1].tolist() == pytest.approx([0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6)] * 4)


def test_overlong_penalty_docstring_values():
    lengths = torch.tensor([10, 16, 18, 20, 25])
    assert overlong_penalty(lengths, 20, 4).tolist() == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert overlong_penalty(lengths, 20, 4, penalty=0.5).tolist()[2] == -0.25
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(lengths, 20, 0)


def test_overlong_penalty_refuses_a_zero_budget():
    """A budget of 0 would shape over a buffer of 0 tokens: (0 - 0) / 0 is a NaN reward."""
    with pytest.raises(ValueError, match=r"budgets > 0, got \[20.0, 0.0\]"):
        overlong_penalty(torch.tensor([3, 0]), torch.tensor([20, 0]), 4)


def test_overlong_penalty_per_budget():
    # budgets the engine ran with: 20 (buffer 4), and 6 (clamped: buffer 4 still fits), and 2
    # (shorter than the buffer: shaping over the whole budget)
    lengths = torch.tensor([18, 5, 1])
    assert overlong_penalty(lengths, torch.tensor([20, 6, 2]), 4).tolist() == [-0.5, -0.75, -0.5]


def test_groups_with_signal():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert groups_with_signal(rewards).tolist() == [False, True, False]


def test_safe_reward_counts_a_crashing_verifier():
    assert safe_reward(lambda c: 1.0 if c == "ok" else 0.0, "ok") == (1.0, None)

    def broken(completion):
        raise KeyError("bug")

    assert safe_reward(broken, "ok") == (0.0, "raised")
    assert safe_reward(lambda c: None, "ok") == (0.0, "raised")  # not a number
    assert safe_reward(lambda c: "1", "ok") == (0.0, "raised")  # text, though float() reads it
    assert safe_reward(lambda c: b"1", "ok") == (0.0, "raised")  # bytes too: float(b"1") is 1.0
    assert safe_reward(lambda c: True, "ok") == (1.0, None)  # a bool is a number


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_safe_reward_zeroes_nonfinite_rewards(value):
    assert safe_reward(lambda c: value, "ok") == (0.0, "nonfinite")


def _inputs(logprobs, old, adv, weights=None, **kw):
    logprobs = torch.tensor(logprobs, dtype=torch.float64, requires_grad=True)
    n = logprobs.numel()
    weights = (torch.full((n,), 1.0 / n, dtype=torch.float64) if weights is None
               else torch.tensor(weights, dtype=torch.float64))
    t = lambda v: None if v is None else torch.tensor(v, dtype=torch.float64)  # noqa: E731
    return LossInputs(
        logprobs=logprobs, old_logprobs=t(old), advantages=t(adv), token_weights=weights,
        **{k: t(v) for k, v in kw.items()},
    )


def test_on_policy_loss_is_minus_mean_advantage():
    inputs = _inputs([-1.0, -2.0, -0.5], [-1.0, -2.0, -0.5], [1.0, -1.0, 0.5])
    loss, metrics = policy_loss(inputs, GRPO)
    assert loss.item() == pytest.approx(-(1.0 - 1.0 + 0.5) / 3)
    loss.backward()
    assert inputs.logprobs.grad.tolist() == pytest.approx([-1 / 3, 1 / 3, -1 / 6])
    assert metrics["clip_fraction"].item() == 0.0
    assert metrics["ratio_mean"].item() == pytest.approx(1.0)


@pytest.mark.parametrize(
    "log_ratio, advantage, config, expected_term, gradient_flows",
    [
        (0.5, 1.0, GRPO, 1.2, False),  # ratio 1.65 > 1.2, positive advantage: clipped
        (0.5, -1.0, GRPO, -math.exp(0.5), True),  # negative advantage: unclipped side wins
        (math.log(0.5), 1.0, GRPO, 0.5, True),  # ratio 0.5 < 0.8, positive: unclipped
        (math.log(0.5), -1.0, GRPO, -0.8, False),  # negative: clipped at 0.8
        (math.log(1.25), 1.0, GRPO, 1.2, False),  # GRPO clips 1.25 at 1.2 ...
        (math.log(1.25), 1.0, DAPO, 1.25, True),  # ... DAPO's clip-higher (1.28) does not
    ],
)
def test_clip_edges(log_ratio, advantage, config, expected_term, gradient_flows):
    inputs = _inputs([-1.0 + log_ratio], [-1.0], [advantage], weights=[1.0])
    loss, metrics = policy_loss(inputs, config)
    assert loss.item() == pytest.approx(-expected_term)
    loss.backward()
    assert (inputs.logprobs.grad.item() != 0) == gradient_flows
    assert metrics["clip_fraction"].item() == (0.0 if gradient_flows else 1.0)


def test_truncated_importance_sampling_weights_the_surrogate():
    # trainer old logprob -1.0, engine sampled with -1.5: weight exp(0.5) = 1.6487, cap 1.5
    base = dict(logprobs=[-1.0], old=[-1.0], adv=[1.0], weights=[1.0], engine_logprobs=[-1.5])
    loss_uncapped, m = policy_loss(_inputs(**base), LossConfig(tis_cap=10.0))
    assert loss_uncapped.item() == pytest.approx(-math.exp(0.5))
    assert m["tis/capped_fraction"].item() == 0.0
    loss_capped, m = policy_loss(_inputs(**base), LossConfig(tis_cap=1.5))
    assert loss_capped.item() == pytest.approx(-1.5)
    assert m["tis/weight_mean"].item() == pytest.approx(1.5)
    assert m["tis/capped_fraction"].item() == 1.0
    loss_off, _ = policy_loss(_inputs(**base), LossConfig())
    assert loss_off.item() == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="tis_cap needs engine_logprobs"):
        policy_loss(_inputs([-1.0], [-1.0], [1.0]), LossConfig(tis_cap=2.0))


def test_k3_kl_and_entropy_terms():
    # r = ref - logp = -1: k3 = e^-1 + 1 - 1
    inputs = _inputs([-1.0], [-1.0], [0.0], weights=[1.0], ref_logprobs=[-2.0], entropy=[0.7])
    loss, metrics = policy_loss(inputs, LossConfig(kl_beta=0.1, entropy_weight=0.01))
    assert metrics["kl"].item() == pytest.approx(math.exp(-1))
    assert loss.item() == pytest.approx(0.1 * math.exp(-1) - 0.01 * 0.7)


def test_fully_masked_batch_and_non_finite_padding_give_zero_not_nan():
    inf = float("inf")
    inputs = _inputs([-inf, float("nan")], [-inf, -1.0], [1.0, -1.0], weights=[0.0, 0.0],
                     engine_logprobs=[-inf, -inf])
    loss, _ = policy_loss(inputs, LossConfig(tis_cap=2.0))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(inputs.logprobs.grad, torch.zeros(2, dtype=torch.float64))


def test_entropy_outside_completions_cannot_make_the_loss_nan():
    """Padding positions may hold anything, the entropy included: a NaN there weighs nothing.
    On-policy, advantage 0: loss = -0.01 * 0.7 (the one counted token's entropy bonus)."""
    inputs = _inputs([-1.0, -1.0], [-1.0, -1.0], [0.0, 0.0], weights=[1.0, 0.0],
                     entropy=[0.7, float("nan")])
    loss, metrics = policy_loss(inputs, LossConfig(entropy_weight=0.01))
    assert loss.item() == pytest.approx(-0.007)
    assert metrics["entropy"].item() == pytest.approx(0.7)


@pytest.mark.parametrize("global_tokens, global_sequences, per_token, per_sequence", [
    # this micro-batch is the whole mini-batch: 3 tokens, 2 completions of 2 and 1 tokens;
    # 'sequence' 1 / (2 tokens * 2) and 1 / (1 token * 2)
    (3, 2, 1 / 3, (1 / 4, 1 / 2)),
    # it holds 3 of the mini-batch's 6 tokens and 2 of its 4 completions: the weights divide by the
    # global counts, not this micro-batch's: 'token' 1/6; 'sequence' 1 / (2 * 4) and 1 / (1 * 4)
    (6, 4, 1 / 6, (1 / 8, 1 / 4)),
])
def test_token_weights_token_and_sequence_aggregation(global_tokens, global_sequences, per_token, per_sequence):
    mask = torch.tensor([False, True, True, False, True])
    seq = torch.tensor([0, 0, 0, 1, 1])
    tok = token_weights(mask, seq, "token", global_tokens=global_tokens, global_sequences=global_sequences)
    assert tok.tolist() == pytest.approx([0, per_token, per_token, 0, per_token])
    per_seq = token_weights(mask, seq, "sequence", global_tokens=global_tokens, global_sequences=global_sequences)
    first, second = per_sequence
    assert per_seq.tolist() == pytest.approx([0, first, first, 0, second])
    with pytest.raises(ValueError, match="aggregation mean"):
        token_weights(mask, seq, "mean", global_tokens, global_sequences)


def test_sequence_weights_of_a_completion_without_tokens_are_zero_not_nan():
    """Sequence 1 has no completion token (a prompt alone): its length 0 is clamped to 1, so its
    positions weigh 0 / 1 = 0, not 0 / 0; sequence 0's two tokens weigh 1 / (2 * 2) each."""
    mask = torch.tensor([False, True, True, False, False])
    seq = torch.tensor([0, 0, 0, 1, 1])
    weights = token_weights(mask, seq, "sequence", global_tokens=2, global_sequences=2)
    assert torch.equal(weights, torch.tensor([0.0, 0.25, 0.25, 0.0, 0.0]))


def test_micro_batch_split_sums_to_the_full_batch_loss():
    torch.manual_seed(0)
    logp, old, adv = torch.randn(8).double() - 2, torch.randn(8).double() - 2, torch.randn(8).double()
    weights = torch.full((8,), 1 / 8, dtype=torch.float64)
    full, _ = policy_loss(LossInputs(logp, old, adv, weights), DAPO)
    halves = sum(
        policy_loss(LossInputs(logp[s], old[s], adv[s], weights[s]), DAPO)[0]
        for s in (slice(0, 3), slice(3, 8))
    )
    assert halves.item() == pytest.approx(full.item())
