"""compat.single_bucket_sampling_without_sync on the GPU: the same tokens as megatron-core's torch
sampler (same logits, same generator seed), with and without gathered rows, and the same
processed log-probs as its log-probs kernel."""

from types import SimpleNamespace

import pytest
import torch
from megatron.core.inference.sampling.torch_sampling import TorchSampling

from megatron_rl_bi import compat

pytestmark = pytest.mark.gpu

VOCAB = 151936
N = 32  # active requests


def _one_bucket_context(temperature):
    """A context whose N active requests all sample at `temperature` (no top-k, no top-p)."""
    return SimpleNamespace(total_request_count=N, paused_request_count=0, active_request_metadata={
        "temperature": torch.full((64,), temperature), "top_k": torch.zeros(64, dtype=torch.int64),
        "top_p": torch.zeros(64)})


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("gathered", [False, True])
def test_same_tokens_as_megatron_cores_sampler(temperature, gathered):
    compat.single_bucket_sampling_without_sync()
    ours, upstream = TorchSampling.sample_kernel, TorchSampling.sample_kernel.upstream
    context = _one_bucket_context(temperature)
    torch.manual_seed(0)
    logits = torch.randn(48, VOCAB, device="cuda")
    gather = torch.randint(0, 48, (N,), device="cuda") if gathered else None
    tokens = []
    for kernel in (ours, upstream):
        sampler = TorchSampling(torch.Generator(device="cuda").manual_seed(5), VOCAB)
        output = torch.empty(N, dtype=torch.int64, device="cuda")
        for _ in range(3):  # the generator's later draws agree too
            kernel(sampler, logits, N, context, no_top_k=True, no_top_p=True, gather_indices=gather, output=output)
            tokens.append(output.clone())
    assert all(torch.equal(a, b) for a, b in zip(tokens[:3], tokens[3:]))


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_same_log_probs_as_megatron_cores_kernel(temperature):
    compat.single_bucket_sampling_without_sync()
    ours, upstream = TorchSampling.log_probs_kernel, TorchSampling.log_probs_kernel.upstream
    context = _one_bucket_context(temperature)
    torch.manual_seed(0)
    logits = torch.randn(N, VOCAB, device="cuda")
    sampler = TorchSampling(torch.Generator(device="cuda").manual_seed(5), VOCAB)
    assert torch.equal(ours(sampler, logits, context), upstream(sampler, logits, context))
