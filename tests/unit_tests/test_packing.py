import pytest
import torch

from megatron_rl_bi.rl.packing import pack_sequences, pack_token_values, unpack_token_values


def test_pack_matches_the_docstring_example():
    batch = pack_sequences([[5, 6, 7], [8, 9]])
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert batch.cu_seqlens.tolist() == [0, 3, 5]
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.max_seqlen == 3
    assert batch.target_ids.tolist() == [6, 7, 0, 9, 0]
    assert batch.has_target.tolist() == [True, True, False, True, False]
    params = batch.packed_seq_params()
    assert params.qkv_format == "thd" and params.max_seqlen_q == 3


def test_single_token_sequences_have_no_target():
    batch = pack_sequences([[1], [2, 3], [4]])
    assert batch.has_target.tolist() == [False, True, False, False]
    assert batch.position_ids.tolist() == [[0, 0, 1, 0]]


def test_token_values_round_trip():
    batch = pack_sequences([[5, 6, 7], [8, 9], [1]])
    values = [torch.tensor([0.25, 0.5]), torch.tensor([0.75]), torch.tensor([])]
    packed = pack_token_values(values, batch, fill=-1.0)
    assert packed.tolist() == [0.25, 0.5, -1.0, 0.75, -1.0, -1.0]
    back = unpack_token_values(packed, batch)
    assert [row.tolist() for row in back] == [[0.25, 0.5], [0.75], []]


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="at least one token"):
        pack_sequences([[1, 2], []])
    with pytest.raises(ValueError, match="at least one sequence"):
        pack_sequences([])
    batch = pack_sequences([[1, 2, 3]])
    with pytest.raises(ValueError, match="sequence 0: 1 values for 3 tokens"):
        pack_token_values([torch.tensor([0.0])], batch)


def test_micro_batches_respect_the_token_budget():
    from types import SimpleNamespace

    from megatron_rl_bi.rl.packing import micro_batches

    items = [SimpleNamespace(tokens=[0] * n) for n in (3, 4, 2, 9, 1)]
    groups = micro_batches(items, max_tokens=7)
    assert [[len(i.tokens) for i in g] for g in groups] == [[3, 4], [2], [9], [1]]
    assert micro_batches([], 5) == []


def test_completion_mask_by_predicting_position():
    from megatron_rl_bi.rl.packing import completion_mask

    # prompt [5, 6], completion [7, 8]: positions 0..2 predict 6, 7, 8
    assert completion_mask(2, 4).tolist() == [False, True, True]
    assert completion_mask(1, 3).tolist() == [True, True]
