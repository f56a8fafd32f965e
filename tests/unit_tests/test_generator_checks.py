"""What Generator refuses before building an engine (CPU): a model built in the other kernel
mode, and engine CUDA graphs on a model built without --cuda-graph-impl local."""

from types import SimpleNamespace

import pytest

from megatron_rl_bi import bi
from megatron_rl_bi.inference import EngineConfig, Generator


def _model(batch_invariant_mode, cuda_graph_impl="none"):
    return SimpleNamespace(config=SimpleNamespace(batch_invariant_mode=batch_invariant_mode,
                                                  cuda_graph_impl=cuda_graph_impl))


def test_a_model_of_the_other_kernel_mode_is_refused():
    with pytest.raises(ValueError, match="model built with batch_invariant_mode=True but the BI switch is off"):
        Generator(_model(True), EngineConfig())


def test_cuda_graphs_need_a_model_built_for_them():
    assert not bi.enabled()
    with pytest.raises(ValueError, match="--cuda-graph-impl local --inference-cuda-graph-scope block"):
        Generator(_model(False), EngineConfig(cuda_graphs=-1))
