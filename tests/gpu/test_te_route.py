"""The TransformerEngine route (--transformer-impl transformer_engine; runs where TE is
installed, skipped elsewhere): dense and hybrid models build, megatron-core's BI patches of TE's
fused norm+linear normalization and GEMM, as the switch replaces them (bi/rmsnorm.py,
bi/te_gemm.py), are the paths taken, and engine vs trainer logprobs are equal."""

import pytest

from megatron_rl_bi import bi
from megatron_rl_bi.bi import switch
from megatron_rl_bi.inference import EngineConfig, Generator, Sampling
from megatron_rl_bi.parity.harness import random_requests, run_parity

from .conftest import TINY_DENSE_ARGS, TINY_HYBRID_ARGS, VOCAB_SIZE, build

pytest.importorskip("transformer_engine", reason="the TE route needs TransformerEngine")
pytestmark = pytest.mark.gpu

ENGINE = EngineConfig(max_requests=32, max_tokens=8192, max_sequence_length=1024, buffer_size_gb=2.0,
                      prompt_logprobs=True)


def _counted_ours(monkeypatch, name: str) -> list:
    """Counts calls of the piece the BI switch installs in place of megatron-core's `name`."""
    calls, ours = [], switch._OURS[name]

    def counted(*args, **kwargs):
        calls.append(name)
        return ours(*args, **kwargs)

    monkeypatch.setitem(switch._OURS, name, counted)
    return calls


@pytest.mark.parametrize("model_args", [TINY_DENSE_ARGS, TINY_HYBRID_ARGS], ids=["dense", "hybrid"])
def test_te_route_takes_the_bi_patches_and_keeps_parity(model_args, distributed, monkeypatch):
    bi.disable()  # the patches are installed when the switch turns on, after these spies
    norms = _counted_ours(monkeypatch, "_te_apply_normalization_patched")
    gemms = _counted_ours(monkeypatch, "_te_general_gemm_patched")
    try:
        model = build(model_args, batch_invariant=True, extra=["--transformer-impl", "transformer_engine"])
        prompts, budgets = random_requests(16, (1, 300), (1, 64), VOCAB_SIZE, seed=3)
        result = run_parity(model, Generator(model, ENGINE), prompts, budgets, Sampling(seed=3),
                            micro_batch_tokens=6000, orders=1)
    finally:
        bi.disable()
    assert norms and gemms, "the switch's TE norm and GEMM were not called"
    assert result["completion_only"]["bit_wise/tokens"] >= 64
    assert result["all_reported"]["bit_wise/logprob_diff/max"] == 0.0, result["all_reported"]
