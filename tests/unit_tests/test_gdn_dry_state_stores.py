"""SwitchedGatedDeltaNet.dry_state_stores, compile ahead's stand-in for an engine step's state
stores (megatron-core's tensor_masked_update, CUDA only, recorded here): the final states of the
layer's own `_varlen_core` into states laid out as one layer's of the engine's slots, with int64
slots at both of a pointer's alignments that Triton compiles apart (16 bytes and 8)."""

import torch

from megatron_rl_bi.models import gdn

from .test_gdn_graphed_decode import gdn_layer  # noqa: F401
from .test_hf_checkpoints import cpu_megatron  # noqa: F401


def test_the_dry_stores_meet_the_engines_layouts_and_both_slot_alignments(gdn_layer, monkeypatch):  # noqa: F811
    stores = []
    monkeypatch.setattr(gdn, "tensor_masked_update", lambda states, idx, new_states: stores.append(
        (states, idx, new_states)))
    finals = []
    varlen_core = gdn_layer._varlen_core
    monkeypatch.setattr(gdn_layer, "_varlen_core", lambda *args, **kwargs: finals.append(
        varlen_core(*args, **kwargs)) or finals[-1])
    steps, recurrent = [], gdn_layer._recurrent
    monkeypatch.setattr(gdn_layer, "_recurrent", lambda decode_only: steps.append(decode_only) or
                        recurrent(decode_only))
    with torch.no_grad():
        gdn_layer.dry_state_stores("cpu")
    conv_final, rule_final = finals[0][2:]
    assert len(finals) == 1 and len(stores) == 4
    assert steps == [False]  # the rule's kernel of a step with a prefill (chunked with gdn_recurrent left off)
    # the engine's slots, as inference.engine.gdn_inference_state_config declares them
    conv = ((gdn_layer.conv_dim_local_tp, gdn_layer.conv_kernel_dim), gdn_layer.config.params_dtype, conv_final)
    rule = ((gdn_layer.num_v_heads_local_tp, gdn_layer.key_head_dim, gdn_layer.value_head_dim), torch.float32,
            rule_final)
    for (states, idx, new_states), (shape, dtype, final) in zip(stores, [conv, rule] * 2):
        assert tuple(states.shape[1:]) == tuple(shape) and states.dtype == dtype and states.is_contiguous()
        assert new_states is final and idx.dtype == torch.int64
    assert [idx.data_ptr() % 16 for _, idx, _ in stores] == [0, 0, 8, 8]
