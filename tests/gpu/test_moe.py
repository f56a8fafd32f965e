"""Mixture-of-experts models (models/moe.py) on the GPU, dense-MoE and hybrid GDN-MoE. BI mode:
a MoE layer's rows get the same bits alone and in any batch, its backward repeats its bits, and
engine logprobs == trainer logprobs before and after an optimizer step, and no token's experts
differ between them (`routing/*`). Default mode (megatron-core's own top-k and scatter-add
combine): the harness sees a mismatch, in logprobs and in routing."""

import pytest
import torch

from megatron_rl_bi import bi
from megatron_rl_bi.inference import EngineConfig, Generator, Sampling
from megatron_rl_bi.models.moe import BatchInvariantMoELayer
from megatron_rl_bi.parity.harness import random_requests, run_parity

from .conftest import (TINY_HYBRID_MOE_ARGS, TINY_MOE_ARGS, VOCAB_SIZE, assert_parity_across_a_step, build,
                       packed_logits)

pytestmark = pytest.mark.gpu

MODELS = {"dense-MoE": TINY_MOE_ARGS, "hybrid GDN-MoE": TINY_HYBRID_MOE_ARGS}
ENGINE = EngineConfig(max_requests=64, max_tokens=8192, max_sequence_length=1024,
                      buffer_size_gb=4.0, prompt_logprobs=True)


def test_stable_topk_keeps_the_lowest_index_of_equal_scores_on_the_gpu():
    """torch's CUDA sort keeps equal values in no fixed order unless asked to be stable (its CPU
    sort keeps them in order either way, so the CPU tests cannot tell): one larger score, then
    the ties by lowest index, in every row."""
    from megatron_rl_bi.models.moe import stable_topk

    scores = torch.zeros(256, 128, device="cuda")
    scores[:, 100] = 1.0
    assert torch.equal(stable_topk(scores, 4).indices.cpu(), torch.tensor([100, 0, 1, 2]).expand(256, 4))


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, distributed):
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    yield request.param, build(MODELS[request.param], batch_invariant=True, seed=0)
    bi.disable()
    destroy_moe_metrics_tracker()  # its entries are sized by the first model's layer count


def _first_moe(model):
    return next(m for m in model.modules() if isinstance(m, BatchInvariantMoELayer))


def test_a_moe_layers_rows_are_the_same_alone_and_in_any_batch(model):
    _, model = model
    layer = _first_moe(model)
    torch.manual_seed(0)
    tokens = torch.randn(300, 1, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        full, _ = layer(tokens)
        for sizes in ((1,) * 8 + (292,), (7, 1, 44, 248), (150, 150), (299, 1)):
            parts = torch.split(tokens, list(sizes))
            assert torch.equal(torch.cat([layer(p)[0] for p in parts]), full), sizes
        permutation = torch.randperm(300, device="cuda")
        assert torch.equal(layer(tokens[permutation])[0], full[permutation])


def test_experts_at_once_give_the_bits_of_one_expert_after_another(model, monkeypatch):
    """Without autograd (the engine) the experts run at once through the grouped GEMM; with it
    (the trainer) one after another: every row the same bits."""
    from megatron_rl_bi.bi import grouped_gemm

    _, model = model
    layer = _first_moe(model)
    calls = []
    grouped = grouped_gemm.grouped_matmul
    monkeypatch.setattr(grouped_gemm, "grouped_matmul", lambda *a: calls.append(1) or grouped(*a))
    torch.manual_seed(0)
    tokens = torch.randn(300, 1, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        at_once, _ = layer(tokens)
    assert len(calls) == 2  # linear_fc1 and linear_fc2
    one_after_another, _ = layer(tokens)
    assert len(calls) == 2 and torch.equal(at_once, one_after_another.detach())


def test_a_moe_layers_backward_repeats_its_bits(model):
    """megatron-core's permutation backward adds a token's k row gradients with atomics."""
    _, model = model
    layer = _first_moe(model)
    torch.manual_seed(1)
    tokens = torch.randn(4096, 1, 1024, device="cuda", dtype=torch.bfloat16)
    grads = []
    for _ in range(3):
        x = tokens.clone().requires_grad_(True)
        out, _ = layer(x)
        out.float().square().sum().backward()
        grads.append((x.grad.clone(), layer.router.weight.grad.clone()))
        layer.zero_grad(set_to_none=True)
    for x_grad, router_grad in grads[1:]:
        assert torch.equal(x_grad, grads[0][0]) and torch.equal(router_grad, grads[0][1])


def test_engine_matches_trainer_bitwise_before_and_after_a_step(model):
    _, model = model

    def backward():
        model.train()
        torch.manual_seed(2)
        sequences = [torch.randint(0, VOCAB_SIZE, (n,)).tolist() for n in (100, 37)]
        packed_logits(model, sequences).float().logsumexp(-1).sum().backward()

    assert_parity_across_a_step(model, ENGINE, backward)


def test_default_mode_sees_a_mismatch(model):
    name, bi_model = model
    with bi.batch_invariant(False):  # restored after: later tests use the BI model
        default = build(MODELS[name], batch_invariant=False, seed=0)
        default.load_state_dict(bi_model.state_dict())
        prompts, budgets = random_requests(32, (1, 500), (1, 256), VOCAB_SIZE, seed=11)
        result = run_parity(default, Generator(default, ENGINE), prompts, budgets,
                            Sampling(temperature=1.0, seed=11), micro_batch_tokens=6000, orders=1)
    assert result["all_reported"]["bit_wise/logprob_diff/abs_mean"] > 0


def test_routing_differs_between_engine_and_trainer_in_default_mode_only(model):
    """--moe-enable-routing-replay: the engine's and the trainer's expert sets for the same
    requests (`routing/*`): 0 tokens differ in BI mode by construction; in default mode some do."""
    from megatron_rl_bi.models.moe import forget_routing_recorders

    name, bi_model = model
    prompts, budgets = random_requests(32, (1, 500), (1, 256), VOCAB_SIZE, seed=11)
    routing = {}
    for batch_invariant in (True, False):
        with bi.batch_invariant(batch_invariant):
            recording = build(MODELS[name], batch_invariant, ["--moe-enable-routing-replay"], seed=0)
            recording.load_state_dict(bi_model.state_dict())
            result = run_parity(recording, Generator(recording, ENGINE), prompts, budgets,
                                Sampling(temperature=1.0, seed=11), micro_batch_tokens=6000, orders=1)
            routing[batch_invariant] = result["all_reported"]
    forget_routing_recorders()
    assert routing[True]["routing/tokens"] > 1000 and routing[True]["routing/ratio_tokens_different"] == 0
    assert routing[False]["routing/ratio_tokens_different"] > 0, routing[False]


def test_the_models_training_step_repeats_its_bits(model, distributed):
    """The whole model under megatron-core's DDP and optimizer, as pretrain_rl trains it: the same
    packed batch's loss backward three times from the same weights gives every parameter the same
    gradient (the failure names the parameters that differ). On the H200 at b6caf84 the tiny MoE
    recipe's warm-up parted between runs by its 25th step, while a MoE layer alone repeats; at 0cfc410,
    with torch's CPU generator seeded (the router's initialization), two runs of the recipe repeated
    every value over 120 steps."""
    from megatron_rl_bi.config import parse_args
    from megatron_rl_bi.optimizer import build_ddp_and_optimizer

    name, bi_model = model
    # pretrain_rl's defaults give --lr; megatron-core's optimizer refuses none
    args = parse_args(MODELS[name] + ["--batch-invariant-mode", "--lr", "1e-5"])
    ddp, _ = build_ddp_and_optimizer(args, bi_model)
    torch.manual_seed(3)
    sequences = [torch.randint(0, VOCAB_SIZE, (n,)).tolist() for n in (300, 41, 700, 5)]
    grads = []
    for _ in range(3):
        ddp.zero_grad_buffer()
        packed_logits(ddp, sequences).float().logsumexp(-1).mean().backward()
        ddp.finish_grad_sync()
        grads.append({n: p.main_grad.clone() for n, p in bi_model.named_parameters()})
    differ = [n for n in grads[0] if not all(torch.equal(g[n], grads[0][n]) for g in grads[1:])]
    assert not differ, differ
