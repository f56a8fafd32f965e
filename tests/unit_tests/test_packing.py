import pytest
import torch

from megatron_rl_bi.packing import pack_sequences, pack_token_values, unpack_token_values


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

    from megatron_rl_bi.packing import micro_batches

    items = [SimpleNamespace(tokens=[0] * n) for n in (3, 4, 2, 9, 1)]
    groups = micro_batches(items, max_tokens=7)
    assert [[len(i.tokens) for i in g] for g in groups] == [[3, 4], [2], [9], [1]]
    assert micro_batches([], 5) == []
    # a first item over the budget is a micro-batch of its own, with no empty one before it
    first_long = micro_batches([SimpleNamespace(tokens=[0] * n) for n in (9, 2)], max_tokens=7)
    assert [[len(i.tokens) for i in g] for g in first_long] == [[9], [2]]


def test_completion_mask_by_predicting_position():
    # prompt [5, 6], completion [7, 8]: positions 0..2 predict 6, 7, 8; then prompt [1],
    # completion [2, 3]; then a one-token prompt with no completion.
    batch = pack_sequences([[5, 6, 7, 8], [1, 2, 3], [4]], prompt_lengths=[2, 1, 1])
    assert batch.completion.tolist() == [False, True, True, False, True, True, False, False]
    # without prompt lengths every predicted token counts
    assert pack_sequences([[5, 6, 7]]).completion.tolist() == [True, True, False]


def test_lengths_ids_and_uniform_bounds():
    from megatron_rl_bi.packing import sequence_lengths, uniform_cu_seqlens

    batch = pack_sequences([[5, 6, 7], [8, 9], [1]])
    assert batch.sequence_lengths == [3, 2, 1]
    assert batch.sequence_ids.tolist() == [0, 0, 0, 1, 1, 2]
    assert sequence_lengths(torch.tensor([0, 4, 4, 9])) == [4, 0, 5]
    bounds = uniform_cu_seqlens(3, 5, "cpu")
    assert bounds.tolist() == [0, 5, 10, 15] and bounds.dtype == torch.int32


def test_pack_completions_places_engine_logprobs_by_predicting_position():
    from types import SimpleNamespace

    from megatron_rl_bi.packing import pack_completions

    without_prompt = SimpleNamespace(prompt_tokens=[5, 6], completion_tokens=[7, 8], completion_sampled=None,
                                     completion_logprobs=[-0.25, -0.5], prompt_logprobs=None)
    with_prompt = SimpleNamespace(prompt_tokens=[9, 3], completion_tokens=[4], completion_sampled=None,
                                  completion_logprobs=[-0.75], prompt_logprobs=[-2.0])
    packed = pack_completions([without_prompt, with_prompt])
    # tokens [5 6 7 8 | 9 3 4]: position j predicts token j + 1 of its sequence
    assert packed.batch.target_ids.tolist() == [6, 7, 8, 0, 3, 4, 0]
    assert packed.engine_logprobs.dtype == torch.float32
    assert packed.engine_logprobs.tolist() == [0.0, -0.25, -0.5, 0.0, -2.0, -0.75, 0.0]
    assert packed.reported.tolist() == [False, True, True, False, True, True, False]
    assert packed.batch.completion.tolist() == [False, True, True, False, False, True, False]


def test_environment_tokens_of_a_conversation_are_context_only():
    from megatron_rl_bi.inference import Generation
    from megatron_rl_bi.packing import pack_completions

    # prompt [1 2]; turn 1 samples 3 4; the environment answers 5 6; turn 2 samples 7
    conversation = Generation(prompt_tokens=[1, 2], completion_tokens=[3, 4, 5, 6, 7],
                              completion_logprobs=[-0.25, -0.5, 0.0, 0.0, -0.75],
                              completion_sampled=[True, True, False, False, True])
    packed = pack_completions([conversation])
    # position j predicts token j + 1: 2 (prompt), 3 4 (sampled), 5 6 (environment), 7 (sampled)
    assert packed.batch.completion.tolist() == [False, True, True, False, False, True, False]
    assert packed.reported.tolist() == [False, True, True, False, False, True, False]
    assert packed.engine_logprobs.tolist() == [0.0, -0.25, -0.5, 0.0, 0.0, -0.75, 0.0]
    assert conversation.sampled_tokens == 3


def test_engine_routing_lands_at_each_tokens_position_and_sampled_tokens_are_compared():
    """Routing [P + C - 1, layers, k] is that of the tokens the engine ran, in order: position k
    of the packed sequence holds token k's; the compared tokens are the sampled ones the engine
    then ran (not a prompt token, not an environment's, not the last)."""
    from megatron_rl_bi.inference import Generation
    from megatron_rl_bi.packing import pack_completions

    def routing(length):
        return torch.arange(length * 2).reshape(length, 1, 2)

    single = Generation(prompt_tokens=[1, 2], completion_tokens=[3, 4, 5], completion_logprobs=[0.0] * 3,
                        routing=routing(4))
    talk = Generation(prompt_tokens=[6], completion_tokens=[7, 8, 9, 10], completion_logprobs=[0.0] * 4,
                      completion_sampled=[True, False, True, True], routing=routing(4))
    unrecorded = Generation(prompt_tokens=[11], completion_tokens=[12], completion_logprobs=[0.0])
    packed = pack_completions([single, talk, unrecorded])
    assert packed.engine_routing.shape == (12, 1, 2)
    assert packed.engine_routing[:, 0, 0].tolist() == [0, 2, 4, 6, -1, 0, 2, 4, 6, -1, -1, -1]
    assert packed.routed.tolist() == [False, False, True, True, False,
                                      False, True, False, True, False, False, False]
    assert pack_completions([unrecorded]).engine_routing is None
