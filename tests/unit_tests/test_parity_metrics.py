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


def test_routing_sets_compared_by_hand_per_layer_and_over_tokens():
    from megatron_rl_bi.parity import routing_terms

    # 4 tokens, 2 MoE layers, top 2; token 3 is not compared
    train = torch.tensor([[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[3, 0], [1, 2]], [[0, 1], [0, 1]]])
    engine = torch.tensor([[[1, 0], [2, 3]],   # the same sets in another order: equal
                           [[1, 2], [0, 2]],   # layer 1 differs
                           [[2, 0], [1, 3]],   # both layers differ
                           [[2, 3], [2, 3]]])  # differs, but not compared
    routed = torch.tensor([True, True, True, False])
    m = routing_terms(train, engine, routed).finalize()
    assert m["routing/tokens"] == 3
    assert m["routing/ratio_tokens_different"] == pytest.approx(2 / 3)
    assert m["routing/ratio_different"] == pytest.approx(3 / 6)
    assert m["routing/layer_0/ratio_different"] == pytest.approx(1 / 3)
    assert m["routing/layer_1/ratio_different"] == pytest.approx(2 / 3)
    same = routing_terms(train, train.flip(-1), routed).finalize()
    assert same["routing/ratio_tokens_different"] == same["routing/ratio_different"] == 0.0
    with pytest.raises(ValueError, match="routing of equal shapes"):
        routing_terms(train, engine[:, :1], routed)


def test_engine_routing_without_the_trainers_is_an_error(monkeypatch):
    from types import SimpleNamespace

    from megatron_rl_bi.parity import RoutingCompared, metrics

    compared = RoutingCompared()
    compared.add(SimpleNamespace(engine_routing=None))  # no routing recorded: nothing compared
    assert compared.terms().finalize() == {}
    monkeypatch.setattr(metrics, "recorded_routing", lambda: None)
    with pytest.raises(RuntimeError, match="the engine recorded routing but the trainer's forward did not"):
        compared.add(SimpleNamespace(engine_routing=torch.zeros(2, 1, 2), routed=torch.ones(2, dtype=torch.bool)))
