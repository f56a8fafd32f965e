"""The parity doctor's capture, alignment and comparison (parity/capture.py, parity/doctor.py).

On the CPU, in BI mode (the kernels' Python in the Triton interpreter), a tiny dense and a tiny
hybrid model run the same sequences twice, as differently batched as the engine and the trainer
batch them: the trainer's way (packed micro-batches in order, `TrainerRows`) and an engine
stand-in (the sequences packed in another order and grouping, its keys written out by the test).
Rows of the same token must meet whatever their batch, so every component agrees; a difference
planted in one component on the engine side must be named as where the two sides part, with
every component before it still agreeing. The engine's own key reading (`engine_row_keys`) is
checked against a hand-built megatron-core context; on the H200, tests/gpu/test_parity_doctor.py
runs it against the real engine."""

import inspect
import math
from types import SimpleNamespace

import pytest
import torch
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_rl_bi import bi
from megatron_rl_bi.config import parse_rl_args
from megatron_rl_bi.models.build import build_model
from megatron_rl_bi.models.logprobs import forward_logprobs
from megatron_rl_bi.packing import pack_sequences
from megatron_rl_bi.parity.capture import Capture, TrainerRows, components, engine_row_keys
from megatron_rl_bi.parity.doctor import compare_components, diff_rows, first_differing, format_report
from tests.unit_tests.test_memory_saved_tensors import COMMON, MODELS, VOCAB

# fp16: the Triton interpreter mis-reads bf16 (tests/unit_tests/test_bi_gemm.py); initialized weights
FLAGS = ["--fp16" if flag == "--bf16" else flag for flag in COMMON if flag != "--no-initialization"]
# torch's CPU elementwise kernels (sigmoid, softplus, SiLU, rsqrt, ...) compute a tensor's last
# (elements mod twice the vector width) elements in a scalar loop that rounds otherwise than the
# vector body, so on the CPU a token's bits depend on its place in the batch unless every packed
# forward holds a multiple of 64 tokens (the widest unrolled vector: 32 fp16 lanes, twice); how
# many fall in the tail depends on the machine's vector width (CI's differs from this box's). The
# GPU's elementwise kernels have no such tail. So each batch below is 64 tokens: sequences 0 and 1
# together, or sequence 2 alone.
BATCH_TOKENS = 64
_tokens = torch.randint(1, VOCAB, (2 * BATCH_TOKENS,), generator=torch.Generator().manual_seed(3)).tolist()
SEQUENCES = [_tokens[:29], _tokens[29:BATCH_TOKENS], _tokens[BATCH_TOKENS:]]
PROMPT_LENGTHS = [3, 2, 4]


def _forward(model, group: list[int]):
    batch = [SEQUENCES[s] for s in group]
    assert sum(map(len, batch)) % BATCH_TOKENS == 0, "a batch whose tokens are no multiple of 64: see SEQUENCES"
    forward_logprobs(model, pack_sequences(batch))


def _as_engine_batches(model, batches: list[list[int]]):
    """Forwards of the sequences numbered in `batches`, one packed forward per group, keyed by the
    sequences' own numbers: the engine stand-in."""
    order = iter(batches)

    def keys(args, kwargs):
        group = next(order)
        rows = [(sequence, position) for sequence in group for position in range(len(SEQUENCES[sequence]))]
        return rows, [SEQUENCES[s][p] for s, p in rows]

    with Capture(model, keys) as side:
        for group in batches:
            _forward(model, group)
    return side


def _as_trainer_batches(model):
    with Capture(model, TrainerRows()) as side:
        for group in ([0, 1], [2]):
            _forward(model, group)
    return side


@pytest.fixture(params=["dense", "hybrid"])
def model(request, cpu_forward, cpu_dispatch):
    # megatron-core `torch.compile`s the attention output gate; Inductor's CPU code for it differs
    # by the machine's vector instructions, and once compiled for this fp16 model it gave a later
    # test's Qwen3.5 import values 0.12 off transformers'. Here it runs eagerly.
    with torch.compiler.set_stance("force_eager"), bi.batch_invariant(True):
        model_parallel_cuda_manual_seed(0)  # GDN's initialization draws from the tracker's state
        yield build_model(parse_rl_args(FLAGS + MODELS[request.param]), VOCAB)


def _plant(model, component: str):
    """Scales what `component` returns by 1.5 and adds 1/8 (registered before the capture's hook,
    which sees it)."""
    def change(module, inputs, output):
        if isinstance(output, tuple):
            return (output[0] * 1.5 + 1 / 8, *output[1:])
        return output * 1.5 + 1 / 8
    return components(model)[component].register_forward_hook(change)


def test_components_are_every_part_in_forward_order(model):
    names = list(components(model))
    assert names[0] == "embedding" and names[-2:] == ["final_norm", "output_layer"]
    layers = [name for name in names if name.startswith("layers.")]
    assert [int(name.split(".")[1]) for name in layers] == sorted(int(name.split(".")[1]) for name in layers)
    assert "layers.0.self_attention" in names and "layers.1.mlp" in names


def test_rows_of_the_same_tokens_meet_whatever_their_batch(model):
    with bi.batch_invariant(True):
        engine = _as_engine_batches(model, [[2], [1, 0]])
        trainer = _as_trainer_batches(model)
    engine.check_tokens(SEQUENCES, "engine")
    trainer.check_tokens(SEQUENCES, "trainer")
    diffs = compare_components(engine.captured(), trainer.captured(), PROMPT_LENGTHS)
    assert [d.component for d in diffs] == list(components(model))
    assert all(d.rows == sum(map(len, SEQUENCES)) for d in diffs)
    assert [d.component for d in diffs if d.rows_different] == []
    assert first_differing(diffs) is None


@pytest.mark.parametrize("planted", ["layers.0.input_layernorm", "layers.0.self_attention", "layers.1.mlp",
                                     "final_norm"])
def test_a_planted_difference_is_named_and_nothing_before_it(model, planted):
    names = list(components(model))
    handle = _plant(model, planted)
    with bi.batch_invariant(True):
        engine = _as_engine_batches(model, [[1, 0], [2]])
    handle.remove()
    with bi.batch_invariant(True):
        trainer = _as_trainer_batches(model)
    diffs = compare_components(engine.captured(), trainer.captured(), PROMPT_LENGTHS)
    assert first_differing(diffs) == planted
    differing = [d.component for d in diffs if d.rows_different]
    assert differing[0] == planted and not set(differing) & set(names[:names.index(planted)])
    assert diffs[names.index(planted)].rows_different == sum(map(len, SEQUENCES))
    assert "output_layer" in differing  # what the planted component feeds differs too
    assert f"engine and trainer part at {planted}" in format_report("bi", {
        "components": [vars(d) for d in diffs], "first_differing": first_differing(diffs)})


def test_check_tokens_refuses_keys_of_other_tokens(model):
    """Keys that misread the batch (here its first sequence called the second) are refused."""
    def misread(args, kwargs):
        rows = [(1 - sequence, position) for sequence in (0, 1) for position in range(len(SEQUENCES[sequence]))]
        return rows, kwargs["input_ids"][0].tolist()

    with bi.batch_invariant(True), Capture(model, misread) as side:
        _forward(model, [0, 1])
    with pytest.raises(RuntimeError, match=r"\(sequence 1, position 0\) fed token 29, but that position holds 27"):
        side.check_tokens(SEQUENCES, "engine")


def test_a_component_the_trainer_did_not_compute_is_refused():
    from megatron_rl_bi.parity.capture import Captured

    engine = {"embedding": Captured("Embedding", [(0, 0), (0, 1)], torch.zeros(2, 4))}
    other_rows = {"embedding": Captured("Embedding", [(1, 0)], torch.zeros(1, 4))}
    for trainer in ({}, other_rows):
        with pytest.raises(RuntimeError, match="embedding: the trainer computed none of the engine's 2 rows"):
            compare_components(engine, trainer, [1, 1])


def test_diff_rows_by_hand():
    engine = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, math.nan], [0.0, 1.0]])
    trainer = torch.tensor([[1.0, 2.0], [3.0, 4.5], [5.0, math.nan], [-0.0, 1.0]])
    diff = diff_rows("x", "Linear", engine, trainer, torch.tensor([True, True, False, False]))
    # row 1 differs by 0.5 (prefill); row 2's NaNs have the same bits; row 3's -0.0 differs by 0 (decode)
    assert (diff.rows, diff.rows_different, diff.prefill_rows_different, diff.decode_rows_different) == (4, 2, 1, 1)
    assert diff.max_abs_diff == 0.5 and diff.mean_abs_diff == 0.5 / 8
    nan = diff_rows("x", "Linear", torch.tensor([[math.nan]]), torch.tensor([[1.0]]), torch.tensor([True]))
    assert nan.max_abs_diff == math.inf and nan.rows_different == 1


def _context(active, padded, token_to_request_idx, request_ids, positions, tokens):
    return SimpleNamespace(active_token_count=active, padded_active_token_count=padded,
                           token_to_request_idx=torch.tensor(token_to_request_idx, dtype=torch.int32),
                           request_ids=torch.tensor(request_ids, dtype=torch.int32),
                           token_to_pos_ids=torch.tensor(positions), token_to_input_ids=torch.tensor(tokens))


def test_engine_row_keys_from_the_contexts_bookkeeping():
    # slot 0 is paused (request 4); slots 1 and 2 decode requests 7 and 2 at positions 9 and 5;
    # slot 3 prefills request 0's three tokens; two padding rows; stale entries after them
    context = _context(5, 7, [1, 2, 3, 3, 3, 0, 0], [4, 7, 2, 0, -1], [9, 5, 0, 1, 2, 0, 0],
                       [50, 51, 60, 61, 62, 0, 0])
    keys, tokens = engine_row_keys(context)
    assert keys == [(7, 9), (2, 5), (0, 0), (0, 1), (0, 2), None, None]
    assert tokens == [50, 51, 60, 61, 62, None, None]


def test_megatron_core_keeps_the_bookkeeping_the_keys_read():
    source = inspect.getsource(DynamicInferenceContext)
    for name in ("active_token_count", "padded_active_token_count", "token_to_request_idx", "request_ids",
                 "token_to_pos_ids", "token_to_input_ids"):
        assert f"self.{name} =" in source, name


def _two_generations():
    from megatron_rl_bi.inference import Generation
    from megatron_rl_bi.packing import pack_completions

    generations = [Generation([5, 6], [7, 8], [-1.0, -2.0], prompt_logprobs=[-0.5]),
                   Generation([9], [10], [-3.0], prompt_logprobs=[])]
    packed = pack_completions(generations)  # positions: g0 0..3, g1 0..1
    train = packed.engine_logprobs.clone()
    train[1] = -1.25  # g0's last prompt token (a prefill row) predicts its first completion token
    compared = {"train": train, "engine": packed.engine_logprobs, "reported": packed.reported,
                "completion": packed.batch.completion}
    return compared, generations


def test_the_logprob_rows_by_hand():
    from megatron_rl_bi.parity.doctor import logprob_diff, unmasked_logprob_diff

    compared, generations = _two_generations()
    diff = logprob_diff(compared, generations)
    assert (diff.rows, diff.rows_different, diff.prefill_rows_different, diff.max_abs_diff) == (4, 1, 1, 0.25)
    # without the mask, as RL packs it: g0's first prompt position holds the engine's 0 against -0.5
    unmasked = unmasked_logprob_diff(compared, generations)
    assert (unmasked.rows, unmasked.rows_different, unmasked.max_abs_diff) == (4, 2, 0.5)


def test_the_ablation_table_by_hand():
    from megatron_rl_bi.parity.doctor import ablation_table, format_ablation

    def report(differ, first):
        return {"components": [{"rows": 9, "rows_different": differ, "max_abs_diff": 0.5 * differ}],
                "first_differing": first, "unmasked": {"rows": 11, "rows_different": 2, "max_abs_diff": 3.0}}

    reports = {"bi": report(0, None), "bi without gemm": report(4, "layers.0.self_attention")}
    rows = ablation_table(reports, {"gemm": "the GEMM", "gdn_recurrent": "the GDN kernel"},
                          {"gemm": None, "gdn_recurrent": "no GDN layers"})
    assert rows == [
        {"piece": "(none: all on)", "does": "every piece on", "tokens": 9, "tokens_different": 0, "max_abs_diff": 0.0,
         "first_differing": None},
        {"piece": "gemm", "does": "the GEMM", "tokens": 9, "tokens_different": 4, "max_abs_diff": 2.0,
         "first_differing": "layers.0.self_attention"},
        {"piece": "gdn_recurrent", "does": "the GDN kernel", "not_run": "no GDN layers"},
        {"piece": "reported_mask", "does": "logprobs compared only where the engine reported one", "tokens": 11,
         "tokens_different": 2, "max_abs_diff": 3.0, "first_differing": "logprobs without the reported mask"}]
    table = format_ablation(rows)
    assert "gdn_recurrent      not run: no GDN layers" in table and "layers.0.self_attention" in table


def test_the_engines_attention_splits_follow_the_attention_split_piece(cpu_forward, cpu_dispatch):
    """megatron-core's Attention picks the engine's FlashAttention KV splits by its own
    `batch_invariant_mode`: build_model sets it from the piece."""
    from megatron.core.transformer.attention import Attention

    def modes(without):
        with bi.batch_invariant(True, without):
            model_parallel_cuda_manual_seed(0)
            built = build_model(parse_rl_args(FLAGS + MODELS["dense"]), VOCAB)
        return {module.batch_invariant_mode for module in built.modules() if isinstance(module, Attention)}

    assert modes(()) == {True}
    assert modes(["attention_split"]) == {False}
