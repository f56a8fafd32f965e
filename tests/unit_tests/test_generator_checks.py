"""What Generator refuses before building an engine (CPU): a model built in the other kernel
mode, and engine CUDA graphs on a model built without --cuda-graph-impl local. And what it does
with the engine's cache once built (megatron-core's engine scripted)."""

from types import SimpleNamespace

import pytest
import torch

from megatron_rl_bi import bi
from megatron_rl_bi.inference import EngineConfig, Generator
from megatron_rl_bi.inference import engine as engine_module


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


class _ScriptedEngine:
    def __init__(self, controller, context):
        self.calls = []

    def reset(self):
        self.calls.append("reset")

    def suspend(self):
        self.calls.append("suspend")


@pytest.mark.parametrize("mode, calls", [("persist", []), ("recompute", ["reset", "suspend"]),
                                         ("offload", ["reset", "suspend"])])
def test_the_engine_is_left_with_its_cache_freed_unless_it_persists(monkeypatch, mode, calls):
    """The cache is sized for the generation phase (the optimizer on the CPU); the optimizer state
    comes back to the GPU right after the build, and must not meet the cache there."""
    for name, stand_in in (("DynamicInferenceContext", lambda config, inference_config: None),
                           ("GPTInferenceWrapper", lambda model, context: None),
                           ("TextGenerationController", lambda wrapper, tokenizer: None),
                           ("gdn_inference_state_config", lambda model: None),
                           ("DynamicInferenceEngine", _ScriptedEngine)):
        monkeypatch.setattr(engine_module, name, stand_in)
    monkeypatch.setattr(engine_module.compat, "full_precision_graph_logits", lambda controller: None)
    monkeypatch.setattr(engine_module.compat, "single_bucket_sampling_without_sync", lambda: None)
    model = torch.nn.Linear(1, 1)
    model.config = _model(False).config
    assert Generator(model, EngineConfig(kv_cache_management_mode=mode)).engine.calls == calls
