"""compat.single_bucket_sampling_without_sync: when every active request has the same sampling
parameters, megatron-core's torch sampler draws from the logit rows directly (no host-built
index tensor, so no blocking copy); the tokens are those of the same generator on the same rows
(megatron-core's `torch.multinomial` there, its one-sample path written out here),
and the processed log-probs those of megatron-core's kernel (which runs on CPU too: compared
here with torch.equal). Mixed buckets, a row count other than the active requests' and the
speculative path go to megatron-core's kernels. (The sampler's equality with megatron-core's own
kernel is a GPU test: tests/gpu/test_sampling.py; that kernel needs CUDA.)"""

from types import SimpleNamespace

import pytest
import torch
from megatron.core.inference.sampling.torch_sampling import TorchSampling

from megatron_rl_bi import compat

VOCAB = 50


@pytest.fixture
def upstream_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(TorchSampling, "sample_kernel", lambda self, logits, n, context, **kwargs: calls.append(n))
    monkeypatch.setattr(TorchSampling, "log_probs_kernel",
                        lambda self, logits, context, **kwargs: calls.append(len(logits)))
    compat.single_bucket_sampling_without_sync()
    compat.single_bucket_sampling_without_sync()  # idempotent: one wrapper
    return calls


def _context(temperatures, top_ks, paused=0):
    count = len(temperatures)
    return SimpleNamespace(total_request_count=count, paused_request_count=paused, active_request_metadata={
        "temperature": torch.tensor(temperatures + [9.0]), "top_k": torch.tensor(top_ks + [7]),
        "top_p": torch.zeros(count + 1)})


def _sampler(seed):
    return TorchSampling(torch.Generator().manual_seed(seed), VOCAB)


LOGITS = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 0), (1.0, 5), (1.0, 1)])
def test_one_bucket_samples_its_rows_with_the_same_draw(upstream_calls, temperature, top_k):
    output = torch.full((4,), -1, dtype=torch.int64)
    result = _sampler(3).sample_kernel(LOGITS, 4, _context([temperature] * 4, [top_k] * 4),
                                       no_top_k=top_k == 0, no_top_p=True, output=output)
    expected = TorchSampling.sample_from_logits(LOGITS[:4], temperature, top_k, 0.0,
                                                generator=torch.Generator().manual_seed(3), vocab_size=VOCAB)
    assert result is output and torch.equal(output, expected) and upstream_calls == []


def test_gathered_rows(upstream_calls):
    rows = torch.tensor([5, 0, 2, 2])
    tokens = _sampler(4).sample_kernel(LOGITS, 3, _context([1.0] * 3, [0] * 3), no_top_k=True, no_top_p=True,
                                       gather_indices=rows)
    expected = TorchSampling.sample_from_logits(LOGITS[rows[:3]], 1.0, 0, 0.0,
                                                generator=torch.Generator().manual_seed(4), vocab_size=VOCAB)
    assert torch.equal(tokens, expected) and upstream_calls == []


@pytest.mark.parametrize("temperatures, top_ks, n, kwargs", [
    ([1.0, 0.7, 1.0], [0, 0, 0], 3, {}),                           # two buckets
    ([1.0, 1.0, 1.0], [0, 5, 0], 3, {}),
    ([1.0, 1.0, 1.0], [0, 0, 0], 2, {}),                           # rows other than the requests
    ([1.0, 1.0, 1.0], [0, 0, 0], 3, {"token_to_request_index": torch.tensor([0, 1, 2])}),
])
def test_other_cases_go_to_megatron_cores_kernel(upstream_calls, temperatures, top_ks, n, kwargs):
    _sampler(0).sample_kernel(LOGITS, n, _context(temperatures, top_ks), no_top_k=True, no_top_p=True, **kwargs)
    assert upstream_calls == [n]


UPSTREAM_LOG_PROBS = getattr(TorchSampling.log_probs_kernel, "upstream", TorchSampling.log_probs_kernel)


@pytest.mark.parametrize("temperature, top_k", [(0.7, 0), (0.5, 5), (1.3, 0)])
def test_one_bucket_log_probs_are_megatron_cores(upstream_calls, temperature, top_k):
    context = _context([temperature] * 4, [top_k] * 4)
    ours = TorchSampling.log_probs_kernel(_sampler(0), LOGITS[:4], context)
    assert upstream_calls == []
    assert torch.equal(ours, UPSTREAM_LOG_PROBS(_sampler(0), LOGITS[:4], context))
    if top_k == 0:  # by hand: the log-softmax of the logits over the temperature
        assert torch.equal(ours, torch.log_softmax(LOGITS[:4] / temperature, dim=-1))
    else:  # all but the top-k of each row are filtered out
        assert torch.isinf(ours).sum(dim=-1).tolist() == [VOCAB - top_k] * 4


@pytest.mark.parametrize("temperatures, rows, kwargs", [
    ([1.0, 0.7, 1.0], 3, {}),                                      # two buckets
    ([0.7, 0.7, 0.7], 4, {}),                                      # rows other than the requests
    ([0.7, 0.7, 0.7], 3, {"token_to_request_index": torch.tensor([0, 1, 2])}),
])
def test_other_log_probs_go_to_megatron_cores_kernel(upstream_calls, temperatures, rows, kwargs):
    TorchSampling.log_probs_kernel(_sampler(0), LOGITS[:rows], _context(temperatures, [0] * 3), **kwargs)
    assert upstream_calls == [rows]
