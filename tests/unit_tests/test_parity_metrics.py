import math

import pytest
import torch

from megatron_rl_bi.parity import parity_metrics


def test_identical_logprobs_read_zero():
    train = torch.tensor([-0.5, -1.25, -3.0])
    m = parity_metrics(train, train.clone().double(), torch.ones(3, dtype=torch.bool))
    assert m["bit_wise/logprob_diff/mean"] == 0.0
    assert m["bit_wise/logprob_diff/abs_mean"] == 0.0
    assert m["bit_wise/logprob_diff/max"] == 0.0
    assert m["bit_wise/ratio_tokens_different"] == 0.0
    assert m["bit_wise/tokens"] == 3


def test_hand_computed_diffs_over_reported_positions_only():
    train = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    engine = torch.tensor([-1.5, -2.0, -2.0, -100.0])
    reported = torch.tensor([True, True, True, False])  # position 3 never reported
    m = parity_metrics(train, engine, reported)
    # diffs over reported: 0.5, 0.0, -1.0
    assert m["bit_wise/logprob_diff/mean"] == pytest.approx(-0.5 / 3)
    assert m["bit_wise/logprob_diff/abs_mean"] == pytest.approx(1.5 / 3)
    assert m["bit_wise/logprob_diff/max"] == 1.0
    assert m["bit_wise/ratio_tokens_different"] == pytest.approx(2 / 3)
    assert m["bit_wise/tokens"] == 3


def test_engine_values_are_cast_to_the_trainer_dtype():
    # 1 + 2**-30 is not representable in fp32: it equals 1.0 after the cast, so no difference.
    engine = torch.tensor([1.0 + 2.0**-30], dtype=torch.float64)
    m = parity_metrics(torch.tensor([1.0]), engine, torch.tensor([True]))
    assert m["bit_wise/ratio_tokens_different"] == 0.0
    # A difference of one fp32 ulp is seen.
    engine = torch.tensor([1.0 + 2.0**-23], dtype=torch.float64)
    m = parity_metrics(torch.tensor([1.0]), engine, torch.tensor([True]))
    assert m["bit_wise/ratio_tokens_different"] == 1.0
    assert m["bit_wise/logprob_diff/max"] == 2.0**-23
    # bf16 trainer logprobs compare in bf16.
    m = parity_metrics(torch.tensor([1.0], dtype=torch.bfloat16), engine, torch.tensor([True]))
    assert m["bit_wise/ratio_tokens_different"] == 0.0


def test_empty_mask_gives_nan_not_a_vacuous_zero():
    m = parity_metrics(torch.zeros(2), torch.ones(2), torch.zeros(2, dtype=torch.bool))
    assert m["bit_wise/tokens"] == 0
    assert math.isnan(m["bit_wise/logprob_diff/max"])
    assert math.isnan(m["bit_wise/ratio_tokens_different"])


def test_non_finite_values():
    inf = float("inf")
    train = torch.tensor([-inf, -inf, float("nan"), -1.0])
    engine = torch.tensor([-inf, -1.0, -1.0, -1.0])
    m = parity_metrics(train, engine, torch.ones(4, dtype=torch.bool))
    # matching -inf is equal; -inf vs -1 and nan vs -1 differ
    assert m["bit_wise/ratio_tokens_different"] == 0.5
    assert m["bit_wise/logprob_diff/max"] == inf


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="equal shapes"):
        parity_metrics(torch.zeros(3), torch.zeros(2), torch.ones(3, dtype=torch.bool))
