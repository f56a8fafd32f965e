"""The one reduction of metrics over data-parallel ranks, with two real ranks (gloo, CPU):
means weighted by counts, a rank with nothing to report changes nothing, names one rank lacks,
sums and maxima; hand-computed values."""

import math

import torch
import torch.multiprocessing as mp

from megatron_rl_bi.distributed import MetricTerms, all_reduce_metrics

from .conftest import free_port

# Rank 0: 3 tokens with reward sum 3 (mean 1.0), loss share 0.25, max diff 0.5.
# Rank 1: 1 token with reward sum 0 (mean 0.0), no loss (it trained nothing), no max, and a
# metric rank 0 lacks.
RANK_TERMS = [
    MetricTerms(means={"reward": (3.0, 3), "empty": (0.0, 0)}, sums={"tokens": 3, "loss": 0.25},
                maxima={"max_diff": 0.5, "none": -math.inf}),
    MetricTerms(means={"reward": (0.0, 1), "empty": (0.0, 0), "only_rank_1": (6.0, 2)},
                sums={"tokens": 1}, maxima={}),
]
EXPECTED = {"reward": 0.75, "tokens": 4, "loss": 0.25, "max_diff": 0.5, "only_rank_1": 3.0}


def _rank(rank: int, port: int, results):
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=2)
    try:
        results[rank] = all_reduce_metrics(RANK_TERMS[rank])
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_pool_weighted_by_counts():
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(free_port(), results), nprocs=2)
    for rank in (0, 1):
        pooled = dict(results[rank])
        assert {k: pooled[k] for k in EXPECTED} == EXPECTED
        assert isinstance(pooled["tokens"], int)
        assert math.isnan(pooled["empty"])  # count 0 on every rank: no value, not 0
        assert math.isnan(pooled["none"])  # a maximum over no values


def test_finalize_on_one_process():
    terms = MetricTerms(means={"m": (1.0, 4), "e": (0.0, 0)}, sums={"s": 2},
                        maxima={"x": 3.0, "y": -math.inf})
    assert terms.update(MetricTerms(sums={"t": 1.5})).sums == {"s": 2, "t": 1.5}
    result = terms.finalize()
    assert result["m"] == 0.25 and result["s"] == 2 and result["x"] == 3.0
    assert math.isnan(result["e"]) and math.isnan(result["y"])
