"""The GDN layer's CUDA-graph decode path on CPU (fla's kernels in the Triton interpreter): a
decode-only step padded to a graph's batch size, with the request slots read from the device
(-1 for padding), gives the real requests the outputs and next states the eager path gives, and
leaves every other slot's states untouched. Values compared within 1e-6: the two paths run the
in/out projections over 4 and 3 rows (torch's CPU GEMM); the bitwise claim, under BI kernels,
is the GPU test tests/gpu/test_cuda_graphs.py."""

import os
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_checkpoints import save_qwen35  # noqa: E402

from megatron_rl_bi.checkpoints.hf import load_hf_weights, read_hf_model  # noqa: E402
from megatron_rl_bi.models import gdn  # noqa: E402

from .test_hf_checkpoints import build, cpu_megatron  # noqa: E402, F401

REAL_SLOTS, SLOTS = [4, 0, 2], 6


class DecodeContext:
    """What the layer reads from megatron-core's dynamic context in a decode-only step."""

    num_speculative_tokens = 0

    def __init__(self, states, slots, graphed):
        self.states, self.graphed = states, graphed
        self.mamba_metadata = SimpleNamespace(batch_indices_decode=torch.tensor(slots, dtype=torch.int32),
                                              batch_indices_prefill=None, cu_seqlens_list=[0])
        self.batch_dimensions = SimpleNamespace(decode_req_count=len(REAL_SLOTS), prefill_req_count=0)
        self.padded_batch_dimensions = SimpleNamespace(decode_req_count=len(slots), prefill_req_count=0)

    def is_dynamic_batching(self):
        return True

    def using_cuda_graph_this_step(self):
        return self.graphed

    def mamba_states_cache(self, layer_number):
        return self.states


def _masked_update(states, idx, new_states):
    """megatron-core's Triton `tensor_masked_update` (CUDA only), in torch: -1 rows skipped."""
    keep = idx >= 0
    states[idx[keep].long()] = new_states[keep]


@pytest.fixture
def gdn_layer(tmp_path, cpu_megatron, monkeypatch):  # noqa: F811
    monkeypatch.setattr(gdn, "tensor_masked_update", _masked_update)
    save_qwen35(str(tmp_path / "hf"))
    hf = read_hf_model(str(tmp_path / "hf"))
    model, _ = build(hf.path)
    load_hf_weights(model, hf)
    layer = next(m for m in model.modules() if isinstance(m, gdn.SwitchedGatedDeltaNet))
    return layer.eval()


def test_graphed_decode_step_equals_the_eager_one(gdn_layer):
    torch.manual_seed(0)
    conv = torch.randn(SLOTS, gdn_layer.conv_dim_local_tp, gdn_layer.conv_kernel_dim)
    rule = torch.randn(SLOTS, gdn_layer.num_v_heads_local_tp, gdn_layer.key_head_dim,
                       gdn_layer.value_head_dim)
    hidden = torch.randn(len(REAL_SLOTS) + 1, 1, gdn_layer.config.hidden_size)  # one padding row
    eager_states, graphed_states = (conv.clone(), rule.clone()), (conv.clone(), rule.clone())
    with torch.no_grad():
        eager, _ = gdn_layer(hidden, None, inference_context=DecodeContext(eager_states, REAL_SLOTS, False))
        graphed, _ = gdn_layer(hidden, None,
                               inference_context=DecodeContext(graphed_states, REAL_SLOTS + [-1], True))
    real = len(REAL_SLOTS)
    torch.testing.assert_close(graphed[:real], eager[:real], rtol=0, atol=1e-6)
    for before, after_eager, after_graphed in zip((conv, rule), eager_states, graphed_states):
        torch.testing.assert_close(after_graphed[REAL_SLOTS], after_eager[REAL_SLOTS], rtol=0, atol=1e-6)
        assert not torch.equal(after_graphed[REAL_SLOTS], before[REAL_SLOTS])
        untouched = [s for s in range(SLOTS) if s not in REAL_SLOTS]
        assert torch.equal(after_graphed[untouched], before[untouched])


def test_a_graphed_step_with_prefills_is_refused(gdn_layer):
    context = DecodeContext((torch.zeros(1), torch.zeros(1)), REAL_SLOTS, True)
    context.padded_batch_dimensions.prefill_req_count = 1
    with pytest.raises(NotImplementedError, match="--decode-only-cuda-graphs"):
        gdn_layer(torch.zeros(4, 1, gdn_layer.config.hidden_size), None, inference_context=context)
