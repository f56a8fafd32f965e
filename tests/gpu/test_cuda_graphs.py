"""The engine's CUDA graphs (--cuda-graph-impl local --inference-cuda-graph-scope block) in BI
mode: a graphed engine generates exactly what the eager engine generates on the same model
(tokens and logprobs), still does after the weights change in place, and keeps trainer parity."""

import pytest
import torch
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.utils import get_attr_wrapped_model

from megatron_rl_bi import bi
from megatron_rl_bi.inference import EngineConfig, Generator, Sampling
from megatron_rl_bi.parity.harness import random_requests, run_parity

from .conftest import VOCAB_SIZE, build_dense

pytestmark = pytest.mark.gpu

GRAPH_FLAGS = ["--cuda-graph-impl", "local", "--inference-cuda-graph-scope", "block"]


def _engine(cuda_graphs):
    return EngineConfig(max_requests=32, max_tokens=8192, max_sequence_length=1024,
                        buffer_size_gb=2.0, prompt_logprobs=True, cuda_graphs=cuda_graphs)


@pytest.fixture(scope="module")
def graph_model(distributed):
    model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=True, force_reset_rng=True)
    yield build_dense(batch_invariant=True, extra=GRAPH_FLAGS)
    bi.disable()
    model_parallel_cuda_manual_seed(1234, force_reset_rng=True)


def test_graphed_engine_equals_the_eager_one_and_the_trainer(graph_model):
    eager, graphed = Generator(graph_model, _engine(None)), Generator(graph_model, _engine(-1))
    runners = get_attr_wrapped_model(graph_model, "decoder").cudagraph_manager.cudagraph_runners
    assert runners, "no CUDA graph was captured"
    prompts, budgets = random_requests(24, (1, 300), (1, 64), VOCAB_SIZE, seed=5)
    sampling = Sampling(temperature=1.0, seed=5)

    def assert_same_generations():
        a = eager.generate(prompts, sampling, budgets)
        b = graphed.generate(prompts, sampling, budgets)
        assert [g.completion_tokens for g in a] == [g.completion_tokens for g in b]
        assert [g.completion_logprobs for g in a] == [g.completion_logprobs for g in b]

    assert_same_generations()
    with torch.no_grad():  # an optimizer step: same storage, new values
        for param in graph_model.parameters():
            param.add_(torch.randn_like(param), alpha=1e-3)
    assert_same_generations()
    result = run_parity(graph_model, graphed, prompts, budgets, sampling,
                        micro_batch_tokens=6000, orders=1)
    assert result["completion_only"]["bit_wise/tokens"] >= 64
    assert result["all_reported"]["bit_wise/logprob_diff/max"] == 0.0, result["all_reported"]
