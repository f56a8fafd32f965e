"""models/moe.py on the CPU: the stable top-k, the expert slots, the fixed-order permutation and
combine by hand, and megatron-core's MoE layer built with them: a token's routing and output the
same bits alone and in any batch, with and without autograd, under the switch."""

import itertools

import pytest
import torch

from megatron_rl_bi import bi
from megatron_rl_bi.models import moe


def test_stable_topk_keeps_the_lowest_index_of_equal_scores_in_one_order():
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0], [0.0, -1.0, 4.0, 4.0]])
    for flag in (True, False):
        values, indices = moe.stable_topk(scores, 2, dim=1, sorted=flag)
        assert indices.tolist() == [[1, 2], [0, 1], [2, 3]]
        assert values.tolist() == [[3.0, 3.0], [5.0, 5.0], [4.0, 4.0]]
    assert moe.stable_topk(scores, 1, largest=False).indices.tolist() == [[0], [0], [1]]


def test_the_mode_replaces_torch_topk_function_and_method_only_inside_it():
    scores = torch.tensor([[2.0, 2.0, 2.0]])
    with moe._StableTopK():
        assert torch.topk(scores, k=2, dim=1, sorted=False).indices.tolist() == [[0, 1]]
        assert scores.topk(2).indices.tolist() == [[0, 1]]
        assert torch.sort(scores, descending=True).values.tolist() == [[2.0, 2.0, 2.0]]
    assert torch.topk(scores, 2).indices.shape == (1, 2)  # torch's own again (any of the ties)


# tokens 0..2 over experts 0..3, two each: t0 -> {1, 3}, t1 -> {0, 1}, t2 -> {1, 2}
ROUTING = torch.tensor([[0, 1, 0, 1], [1, 1, 0, 0], [0, 1, 1, 0]], dtype=torch.bool)


def test_expert_slots_by_hand():
    """Rows grouped by expert (e0: t1; e1: t0 t1 t2; e2: t2; e3: t0), as megatron-core's permute
    orders them, and each token's rows in ascending expert order."""
    slots = moe.expert_slots(ROUTING, 2)
    assert slots.token_of_row.tolist() == [1, 0, 1, 2, 2, 0]
    assert slots.rows_of_token.tolist() == [[1, 5], [0, 2], [3, 4]]
    assert slots.expert_major.tolist() == [0 * 3 + 1, 1 * 3 + 0, 1 * 3 + 1, 1 * 3 + 2, 2 * 3 + 2, 3 * 3 + 0]


def test_permute_and_combine_by_hand_forward_and_backward():
    slots = moe.expert_slots(ROUTING, 2)
    tokens = torch.tensor([[1.0], [2.0], [3.0]], requires_grad=True)
    rows = moe._Permute.apply(tokens, slots.token_of_row, slots.rows_of_token)
    assert rows.tolist() == [[2.0], [1.0], [2.0], [3.0], [3.0], [1.0]]
    scaled = rows * torch.tensor([[10.0], [20.0], [30.0], [40.0], [50.0], [60.0]])
    out = moe._Combine.apply(scaled, slots.token_of_row, slots.rows_of_token)
    assert out.tolist() == [[1 * 20 + 1 * 60], [2 * 10 + 2 * 30], [3 * 40 + 3 * 50]]
    out.backward(torch.tensor([[1.0], [2.0], [3.0]]))
    # d out_t / d token_t: the sum of its two rows' scales
    assert tokens.grad.tolist() == [[20.0 + 60.0], [2 * (10.0 + 30.0)], [3 * (40.0 + 50.0)]]


def test_the_combine_adds_in_fp32_and_rounds_once():
    """1 + 2^-8 + 2^-8: in bf16 step by step 1 (each 2^-8 is half an ulp, rounded to even); in
    fp32 then rounded once 1 + 2^-7."""
    routing = torch.tensor([[1, 1, 1]], dtype=torch.bool)
    slots = moe.expert_slots(routing, 3)
    rows = torch.tensor([[1.0], [2.0**-8], [2.0**-8]], dtype=torch.bfloat16)
    out = moe._Combine.apply(rows, slots.token_of_row, slots.rows_of_token)
    assert out.dtype == torch.bfloat16 and out.item() == 1.0 + 2.0**-7
    assert (rows[0] + rows[1] + rows[2]).item() == 1.0


def test_the_combine_adds_a_tokens_rows_in_ascending_expert_order():
    """Experts 0, 1, 2 give 2^24, 1, -2^24: (2^24 + 1) - 2^24 = 0 in fp32 (2^24 + 1 rounds to
    2^24); from the last expert, (-2^24 + 1) + 2^24 = 1."""
    slots = moe.expert_slots(torch.tensor([[1, 1, 1]], dtype=torch.bool), 3)
    rows = torch.tensor([[2.0**24], [1.0], [-(2.0**24)]])
    assert moe._Combine.apply(rows, slots.token_of_row, slots.rows_of_token).item() == 0.0


HIDDEN, EXPERTS, TOPK = 16, 4, 2


def moe_config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=8,
                  num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=8,
                  use_cpu_initialization=True, add_bias_linear=False, gated_linear_unit=True,
                  moe_aux_loss_coeff=0.0)
    return TransformerConfig(**{**fields, **overrides})


@pytest.fixture
def moe_layer(cpu_training, cpu_dispatch):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    def build(**overrides):
        torch.manual_seed(0)
        layer = moe.moe_mlp(ColumnParallelLinear, RowParallelLinear)(config=moe_config(**overrides))
        return layer.half()  # fp16: the Triton interpreter mis-reads bf16 (test_bi_gemm.py)

    return build


def tied_tokens(count: int) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(count, 1, HIDDEN).half()


def with_tied_experts(layer):
    """Experts 1, 2 and 3 get the same router weights: every token's three logits are equal."""
    with torch.no_grad():
        layer.router.weight[2:].copy_(layer.router.weight[1])
    return layer


def test_a_tokens_routing_is_the_same_alone_and_in_any_batch_with_ties(moe_layer):
    layer = with_tied_experts(moe_layer())
    tokens = tied_tokens(6)
    with bi.batch_invariant(True):
        alone = [layer.router(tokens[i : i + 1]) for i in range(6)]
        for size in range(1, 7):
            for order in itertools.islice(itertools.permutations(range(6), size), 20):
                probs, routing = layer.router(tokens[list(order)])
                for row, i in enumerate(order):
                    assert torch.equal(routing[row], alone[i][1][0])
                    assert torch.equal(probs[row], alone[i][0][0])
    # the tie keeps the lowest experts: {0, 1} where expert 0 leads, else {1, 2} (torch.topk on
    # the CPU keeps others, e.g. {2, 3} of four equal scores)
    logits = (tokens[:, 0].float() @ layer.router.weight.float().T)
    expected = [[0, 1] if logit[0] > logit[1] else [1, 2] for logit in logits]
    assert [routing[0].nonzero().flatten().tolist() for _, routing in alone] == expected
    assert [0, 1] in expected and [1, 2] in expected


def test_routing_and_output_are_the_same_with_and_without_autograd(moe_layer):
    """The trainer records autograd, the engine does not: torch.topk sorts only in the first."""
    layer = with_tied_experts(moe_layer())
    tokens = tied_tokens(6)
    with bi.batch_invariant(True):
        with torch.no_grad():
            probs, routing = layer.router(tokens)
            out, _ = layer(tokens)
        probs_grad, routing_grad = layer.router(tokens)
        out_grad, _ = layer(tokens)
    assert torch.equal(routing, routing_grad) and torch.equal(probs, probs_grad.detach())
    assert torch.equal(out, out_grad.detach())


def test_a_tokens_layer_output_is_the_same_alone_and_in_a_batch(moe_layer):
    layer = moe_layer(moe_shared_expert_intermediate_size=8)
    tokens = tied_tokens(5)
    with bi.batch_invariant(True), torch.no_grad():
        batch, _ = layer(tokens)
        for i in range(5):
            alone, _ = layer(tokens[i : i + 1])
            assert torch.equal(alone[0], batch[i])
    with bi.batch_invariant(False), torch.no_grad():  # megatron-core's own path: the same math
        default, _ = layer(tokens)
    assert (default.float() - batch.float()).abs().max() < 2e-2


def test_the_layers_gradients_flow_to_tokens_router_and_every_expert(moe_layer):
    layer = moe_layer()
    tokens = tied_tokens(8).requires_grad_(True)
    with bi.batch_invariant(True):
        out, _ = layer(tokens)
        out.float().square().sum().backward()
    assert tokens.grad.abs().sum() > 0 and layer.router.weight.grad.abs().sum() > 0
    used = torch.zeros(EXPERTS, dtype=torch.bool)
    with bi.batch_invariant(True), torch.no_grad():
        used[layer.router(tokens)[1].any(dim=0)] = True
    for e, expert in enumerate(layer.experts.local_experts):
        assert (expert.linear_fc1.weight.grad is not None and expert.linear_fc1.weight.grad.abs().sum() > 0) == bool(used[e])


MODEL_FLAGS = ["--hidden-size", "32", "--ffn-hidden-size", "48", "--num-attention-heads", "4",
               "--group-query-attention", "--num-query-groups", "2", "--swiglu", "--disable-bias-linear",
               "--fp16", "--seq-length", "128", "--max-position-embeddings", "128", "--use-cpu-initialization",
               "--transformer-impl", "local", "--flash-attention-version", "4", "--num-experts", "4",
               "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16", "--moe-aux-loss-coeff", "0.01"]
MOE_MODELS = {  # (flags, MoE layers)
    "dense-MoE": (["--num-layers", "3", "--moe-layer-freq", "[1,0,1]"], 2),
    "hybrid GDN-MoE": (["--hybrid-layer-pattern", "GE*E", "--linear-num-key-heads", "2",
                       "--linear-num-value-heads", "4", "--linear-key-head-dim", "8",
                       "--linear-value-head-dim", "8", "--linear-conv-kernel-dim", "4"], 2),
}


@pytest.mark.parametrize("flags, moe_layers", MOE_MODELS.values(), ids=list(MOE_MODELS))
def test_a_moe_models_packed_hidden_states_are_those_of_its_sequences_alone(cpu_forward, cpu_dispatch,
                                                                            flags, moe_layers):
    """The model pretrain_rl builds from --num-experts: MoE layers where asked, and in BI mode
    every decoder layer's output for a packed batch equals each sequence's alone. (Layers, not
    logits: on the CPU the fp32 output layer is torch's CPU GEMM, not a BI kernel.)"""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_rl_bi.config import parse_rl_args
    from megatron_rl_bi.models.build import build_model
    from megatron_rl_bi.packing import pack_sequences

    args = parse_rl_args(MODEL_FLAGS + flags)
    with bi.batch_invariant(True):
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)  # GDN's initialization draws from the tracker's state
        model = build_model(args, 40)
        layers = [m for m in model.modules() if isinstance(m, moe.BatchInvariantMoELayer)]
        assert len(layers) == moe_layers and not any(type(m) is MoELayer for m in model.modules())
        outputs = []
        decoder_layers = model.module.decoder.layers
        for layer in decoder_layers:
            layer.register_forward_hook(lambda m, a, out: outputs.append(out[0] if isinstance(out, tuple) else out))

        def hidden_states(sequences):
            outputs.clear()
            batch = pack_sequences(sequences)
            with torch.no_grad():
                model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=None,
                      packed_seq_params=batch.packed_seq_params())
            return list(outputs)

        sequences = [[(7 * i + 3 * n) % 37 + 1 for i in range(n)] for n in (5, 11, 3, 8)]
        packed = hidden_states(sequences)
        alone = [hidden_states([s]) for s in sequences]
    assert len(packed) == len(decoder_layers)
    for index, layer_output in enumerate(packed):
        assert torch.equal(layer_output, torch.cat([a[index] for a in alone])), index


def test_router_losses_scaled_to_the_steps_tokens_equal_megatrons_unscaled_mean(moe_layer):
    """Under --calculate-per-token-loss megatron-core multiplies a micro-batch's load-balancing
    loss by its T tokens and leaves the division to finalize_model_grads, which this package's
    steps do not call: scale_router_losses(T) restores the loss megatron-core attaches without
    per-token losses (the router gradient equal within fp32 rounding of the two products)."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    tokens = tied_tokens(12).float()
    grads = {}
    destroy_moe_metrics_tracker()  # process-wide: other tests' MoE forwards recorded into it
    for per_token in (False, True):
        layer = moe_layer(moe_aux_loss_coeff=1.0, calculate_per_token_loss=per_token).float()
        layer.set_layer_number(1)  # what a decoder block sets; the tracker records by layer
        moe.scale_router_losses(torch.tensor(12.0 if per_token else 1.0))
        out, _ = layer(tokens)
        (out * 0).sum().backward()  # only the attached load-balancing loss has a gradient
        grads[per_token] = layer.router.weight.grad.clone()
        assert moe.router_loss_sums()["moe/load_balancing_loss"] > 0
        assert moe.router_loss_sums() == {}  # read once, then cleared
        destroy_moe_metrics_tracker()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    assert grads[False].abs().sum() > 0
    torch.testing.assert_close(grads[True], grads[False], rtol=1e-5, atol=1e-7)


def test_the_routers_initial_weights_follow_the_seed_alone(cpu_training):
    """megatron-core draws the router's weights from torch's CPU generator: before build_model
    seeded it, a second model of the same --seed got other router weights, and another --seed
    the same ones."""
    from megatron_rl_bi.config import parse_rl_args
    from megatron_rl_bi.models.build import build_model

    def router_weights(seed: int):
        args = parse_rl_args(MODEL_FLAGS + ["--num-layers", "1", "--seed", str(seed)])
        with bi.batch_invariant(False):
            model = build_model(args, 40)
        return next(m for m in model.modules() if isinstance(m, moe.BatchInvariantRouter)).weight.detach().clone()

    first = router_weights(5)
    torch.rand(7)  # anything else drawing from the generator in between
    assert torch.equal(router_weights(5), first)
    assert not torch.equal(router_weights(6), first)


def test_routers_record_the_experts_they_chose_for_routing_metrics(moe_layer):
    """--moe-enable-routing-replay: each forward's chosen experts, read once, in the layer's
    order ([tokens, layers, k]); a router built before `forget_routing_recorders` records no more."""
    moe.forget_routing_recorders()
    stale = moe_layer(moe_enable_routing_replay=True)
    moe.forget_routing_recorders()
    layer = moe_layer(moe_enable_routing_replay=True)
    moe.start_recording_routing()
    tokens = tied_tokens(5)
    with bi.batch_invariant(True):
        _, routing_map = layer.router(tokens)
        recorded = moe.recorded_routing()
        assert recorded.shape == (5, 1, TOPK)
        assert [sorted(row) for row in recorded[:, 0].tolist()] == [
            row.nonzero().flatten().tolist() for row in routing_map]
        assert moe.recorded_routing() is None  # read once
        stale.router(tokens)
        assert moe.recorded_routing() is None  # the forgotten router is not asked
    moe.forget_routing_recorders()


def test_without_autograd_the_experts_run_at_once_with_each_experts_bits(moe_layer, monkeypatch):
    """The engine's path: under the switch and no autograd, megatron-core's expert forward once over
    every expert's rows, both linears grouped; with autograd, the switch off or the GEMM piece left
    off, one expert after another. The rows are the same bits either way (K fits one K step of the
    interpreter's dot; the GPU test holds it at real widths)."""
    from megatron_rl_bi.bi import grouped_gemm

    calls = []
    grouped = grouped_gemm.grouped_matmul
    monkeypatch.setattr(grouped_gemm, "grouped_matmul", lambda *a: calls.append(a[0].shape) or grouped(*a))
    layer = moe_layer()
    tokens = tied_tokens(40)
    with bi.batch_invariant(True):
        with torch.no_grad():
            at_once, _ = layer(tokens)
        assert calls == [(40 * TOPK, HIDDEN), (40 * TOPK, 8)]
        one_after_another, _ = layer(tokens)
        with torch.no_grad(), bi.batch_invariant(True, without=["gemm"]):
            layer(tokens)
    with torch.no_grad():
        layer(tokens)
    assert len(calls) == 2 and torch.equal(at_once, one_after_another.detach())


def test_experts_with_biases_run_one_after_another(moe_layer, monkeypatch):
    """The grouped GEMM adds no bias: a layer whose linears have one keeps megatron-core's path."""
    from megatron_rl_bi.bi import grouped_gemm

    monkeypatch.setattr(grouped_gemm, "grouped_matmul", lambda *a: pytest.fail("grouped with biases"))
    layer = moe_layer(add_bias_linear=True)
    with bi.batch_invariant(True), torch.no_grad():
        out, _ = layer(tied_tokens(8))
    assert out.shape == (8, 1, HIDDEN)


def test_whether_the_experts_group_is_asked_for_each_dtype(moe_layer):
    """Cached per dtype and device: fp16 weights group fp16 rows, not bf16 ones."""
    experts = moe_layer().experts
    cpu = torch.device("cpu")
    assert experts._weights_groupable(torch.float16, cpu) and not experts._weights_groupable(torch.bfloat16, cpu)
