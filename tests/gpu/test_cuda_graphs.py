"""The engine's CUDA graphs (--cuda-graph-impl local --inference-cuda-graph-scope block) in BI
mode, dense, hybrid (GDN layers: decode-only graphs), dense-MoE and hybrid GDN-MoE (the experts'
grouped GEMM inside the graphs): a graphed engine generates exactly what the eager engine
generates on the same model (tokens and logprobs), still does after the weights change in place,
and keeps trainer parity."""

import pytest
import torch
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_rl_bi import bi
from megatron_rl_bi.inference import EngineConfig, Generator, Sampling
from megatron_rl_bi.parity.harness import random_requests, run_parity

from .conftest import TINY_DENSE_ARGS, TINY_HYBRID_ARGS, TINY_HYBRID_MOE_ARGS, TINY_MOE_ARGS, VOCAB_SIZE, build

pytestmark = pytest.mark.gpu

GRAPH_FLAGS = ["--cuda-graph-impl", "local", "--inference-cuda-graph-scope", "block"]
MODELS = {"dense": (TINY_DENSE_ARGS, []), "hybrid": (TINY_HYBRID_ARGS, ["--decode-only-cuda-graphs"]),
          "dense-MoE": (TINY_MOE_ARGS, []), "hybrid GDN-MoE": (TINY_HYBRID_MOE_ARGS, ["--decode-only-cuda-graphs"])}


def _engine(cuda_graphs, decode_only):
    return EngineConfig(max_requests=32, max_tokens=8192, max_sequence_length=1024,
                        buffer_size_gb=2.0, prompt_logprobs=True, cuda_graphs=cuda_graphs,
                        cuda_graphs_decode_only=decode_only)


@pytest.fixture(params=sorted(MODELS))
def graph_model(request, distributed):
    model_args, extra = MODELS[request.param]
    model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=True, force_reset_rng=True)
    try:
        yield build(model_args, batch_invariant=True, extra=GRAPH_FLAGS + extra), bool(extra)
    finally:
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

        bi.disable()
        destroy_moe_metrics_tracker()  # a MoE model's entries are sized by its layer count
        model_parallel_cuda_manual_seed(1234, force_reset_rng=True)


def test_graphed_engine_equals_the_eager_one_and_the_trainer(graph_model):
    model, decode_only = graph_model
    eager = Generator(model, _engine(None, decode_only))
    graphed = Generator(model, _engine(-1, decode_only))
    assert any(getattr(m, "cudagraph_manager", None) and m.cudagraph_manager.cudagraph_runners
               for m in model.modules()), "no CUDA graph was captured"
    prompts, budgets = random_requests(24, (1, 300), (1, 64), VOCAB_SIZE, seed=5)
    sampling = Sampling(temperature=1.0, seed=5)

    def assert_same_generations():
        a = eager.generate(prompts, sampling, budgets)
        b = graphed.generate(prompts, sampling, budgets)
        assert [g.completion_tokens for g in a] == [g.completion_tokens for g in b]
        assert [g.completion_logprobs for g in a] == [g.completion_logprobs for g in b]

    assert_same_generations()
    with torch.no_grad():  # an optimizer step: same storage, new values
        for param in model.parameters():
            param.add_(torch.randn_like(param), alpha=1e-3)
    assert_same_generations()
    result = run_parity(model, graphed, prompts, budgets, sampling, micro_batch_tokens=6000, orders=1)
    assert result["completion_only"]["bit_wise/tokens"] >= 64
    assert result["all_reported"]["bit_wise/logprob_diff/max"] == 0.0, result["all_reported"]
