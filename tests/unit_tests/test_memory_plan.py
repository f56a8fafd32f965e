"""The memory planner's arithmetic (CPU): parameter counts against megatron-core's built models,
every item of a plan against hand-computed values for a dense and a hybrid model, each lever on
and off, the KV cache check, the levers suggested, and the tool end to end."""

import dataclasses
import importlib.util
import json
import types

import pytest

from megatron_rl_bi import bi, memory
from megatron_rl_bi.config import parse_rl_args
from megatron_rl_bi.config.from_args import levers_from_args, memory_run_from_args, model_shape_from_args
from megatron_rl_bi.memory import (
    GENERATION,
    GIB,
    TRAINING,
    EngineShape,
    Levers,
    ModelShape,
    Recompute,
    RunShape,
    activation_bytes,
    host_memory_problem,
    host_memory_warning,
    kv_bytes_per_token,
    kv_cache_problem,
    logits_bytes,
    parameter_count,
    plan_memory,
)

from .. import REPO

COMMON = ["--seq-length", "64", "--max-position-embeddings", "64", "--use-cpu-initialization",
          "--no-initialization", "--transformer-impl", "local", "--flash-attention-version", "4"]
BUILT = {
    "dense, tied": ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "48", "--num-attention-heads", "4",
                    "--swiglu", "--disable-bias-linear"],
    "dense, untied, biases, GQA, QK norm": [
        "--num-layers", "3", "--hidden-size", "32", "--ffn-hidden-size", "40", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16", "--qk-layernorm",
        "--untie-embeddings-and-output-weights"],
    "hybrid, output gate": [
        "--hybrid-layer-pattern", "G-*-G-", "--hidden-size", "32", "--ffn-hidden-size", "48",
        "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
        "--swiglu", "--disable-bias-linear", "--qk-layernorm", "--attention-output-gate",
        "--linear-num-key-heads", "2", "--linear-num-value-heads", "4", "--linear-key-head-dim", "8",
        "--linear-value-head-dim", "8", "--linear-conv-kernel-dim", "4"],
    "dense-MoE, one layer in two, biases": [
        "--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "48", "--num-attention-heads", "4",
        "--swiglu", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24",
        "--moe-layer-freq", "[1,0]"],
    # --moe-shared-expert-gate without a shared expert: no gate is built
    "dense-MoE, a shared expert's gate flag without one": [
        "--num-layers", "1", "--hidden-size", "32", "--ffn-hidden-size", "48", "--num-attention-heads", "4",
        "--swiglu", "--disable-bias-linear", "--num-experts", "2", "--moe-router-topk", "2",
        "--moe-shared-expert-gate"],
    "hybrid GDN-MoE, top 1, gated shared expert": [
        "--hybrid-layer-pattern", "GE*E", "--hidden-size", "32", "--ffn-hidden-size", "48", "--disable-bias-linear",
        "--num-attention-heads", "4", "--kv-channels", "8", "--num-experts", "3", "--moe-router-topk", "1",
        "--moe-router-pre-softmax", "--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate",
        "--linear-num-key-heads", "2", "--linear-num-value-heads", "4", "--linear-key-head-dim", "8",
        "--linear-value-head-dim", "8", "--linear-conv-kernel-dim", "4"],
}


@pytest.mark.parametrize("flags", BUILT.values(), ids=list(BUILT))
def test_parameter_count_is_the_built_models(cpu_training, flags):
    from megatron_rl_bi.models.build import build_model

    args = parse_rl_args(COMMON + flags)
    with bi.batch_invariant(False):
        model = build_model(args, 50)
    assert parameter_count(model_shape_from_args(args, 50)) == sum(p.numel() for p in model.parameters())


# A dense model small enough to count by hand: 2 layers, hidden 4, FFN 8 (SwiGLU), 2 heads of 2,
# 1 KV head, vocabulary 16 (tied), bf16.
DENSE = ModelShape(layers=("*-", "*-"), hidden=4, ffn=8, heads=2, kv_heads=1, head_dim=2, vocab=16, tied=True)
# One GDN layer and one MLP: key heads 1 x 2, value heads 2 x 2, conv kernel 4.
HYBRID = ModelShape(layers=("G", "-"), hidden=4, ffn=8, heads=2, kv_heads=1, head_dim=2, vocab=16, tied=True,
                    gdn_key_heads=1, gdn_value_heads=2, gdn_key_dim=2, gdn_value_dim=2, gdn_conv_kernel=4)


def test_parameters_by_hand():
    # dense: embedding 16*4; attention: norm 4 + qkv 4*(4 + 2*2) + proj 4*4 = 52;
    # MLP: norm 4 + fc1 4*16 + fc2 8*4 = 100; two layers; final norm 4.
    assert parameter_count(DENSE) == 64 + 2 * (52 + 100) + 4 == 372
    # GDN: norm 4 + in_proj 4*(2*2 + 2*4 + 2*2) = 64 + conv (2*2 + 4)*4 = 32 + A_log and dt_bias 2*2
    # + out norm 2 + out_proj 4*4 = 16 -> 122; MLP 100; embedding 64; final norm 4.
    assert parameter_count(HYBRID) == 64 + 122 + 100 + 4 == 290
    # MoE: norm 4 + router 4*3 + 3 experts of fc1 4*(2*2) + fc2 2*4 = 24 each + a shared expert of
    # width 8 like the MLP's (96) -> 4 + 12 + 72 + 96 = 184
    moe = dataclasses.replace(DENSE, layers=("*E",), experts=3, topk=2, expert_ffn=2, shared_ffn=8)
    assert parameter_count(moe) == 64 + 52 + 184 + 4 == 304


def test_moe_activations_by_hand():
    # per token, bf16, after the norm (12): the normed input 4 * 2 = 8; each of k = 2 rows: its
    # input 4, fc1 output 2*2, silu, linear half + offset and product 3*2, the scaled product fc2
    # takes 2 -> 16 * 2 = 32 a row, 64; routing: sort indices and argsort 2*3 and the row maps 2*2,
    # int64 (10 * 8 = 80), the top-k's fp32 softmax 2*4 = 8, the rows' probabilities 2*2 = 4
    moe = dataclasses.replace(DENSE, layers=("*E",), experts=3, topk=2, expert_ffn=2)
    assert memory.activation_bytes_per_token(moe, "E") == 12 + 8 + 64 + 80 + 8 + 4 == 176
    # + a shared expert of width 8: fc1 output 16 and activations 24 -> 80; fp32 router: the rows'
    # probabilities 2*4; the load-balancing loss's fp32 softmax 3*4; the z-loss's fp32 logits 3*4
    # and log-sum-exp 4
    moe = dataclasses.replace(moe, shared_ffn=8, router_bytes=4, load_balancing_loss=True, z_loss=True)
    assert memory.activation_bytes_per_token(moe, "E") == 176 + 80 + 4 + 12 + 16
    # the load-balancing loss's softmax is fp32 with a bf16 router too (megatron-core's
    # compute_routing_scores_for_aux_loss: softmax(dtype=float32)): 3 * 4 beside the 176
    bf16_router = dataclasses.replace(DENSE, layers=("*E",), experts=3, topk=2, expert_ffn=2, load_balancing_loss=True)
    assert memory.activation_bytes_per_token(bf16_router, "E") == 176 + 12


def test_activations_by_hand():
    # per token, bf16 (2 bytes): MLP: norm input 4*2 + 4 (1/rms) = 12, fc1 input 4, fc1 output 16,
    # silu, linear half + offset, and product 24 -> 12 + 44*2 = 100. Attention: norm 12, qkv input
    # 4 and output 8, rotated q 4 and k 2, output 4 -> 12 + 22*2, + fp32 lse 2 heads * 4 -> 64.
    # A layer: 164.
    assert activation_bytes(DENSE, 10, Recompute()) == 2 * 164 * 10
    # full, uniform, 1 layer a chunk: 2 chunk inputs (10 tokens * 4 * 2 bytes) + one layer
    assert activation_bytes(DENSE, 10, Recompute("full", "uniform", 1)) == 2 * 80 + 1640
    # full, block, 1 layer: its input + the other layer (the larger of it and the recomputed one)
    assert activation_bytes(DENSE, 10, Recompute("full", "block", 1)) == 80 + 1640
    assert activation_bytes(DENSE, 10, Recompute("selective")) == 2 * 164 * 10  # FA keeps its inputs
    # GDN, per token: norm 12; bf16: input 4, projected 2*2 + 2*4 + 2*2 = 16, q and k repeated to
    # the value heads 2*2*2 = 8, v 4, beta 2, core/norm/proj inputs 3*4 -> 46 * 2 = 92;
    # fp32: g and softplus 3*2, gate and silu 2*4, 1/rms 2 -> 16 * 4 = 64. Total 168.
    assert memory.activation_bytes_per_token(HYBRID, "G") == 168


def test_attention_with_qk_norm_and_rope_by_hand():
    # 64 as above; QK norms' contiguous inputs (q 4 + k 2) * 2 = 12 and their fp32 1/rms per head
    # (2 + 1) * 4 = 12; RoPE's cos and sin for q and for k over 2 channels: 4 * 2 * 2 = 16
    shape = dataclasses.replace(DENSE, qk_norm=True, rotary_dim=2)
    assert memory.activation_bytes_per_token(shape, "*") == 64 + 12 + 12 + 16


def test_the_backward_holds_a_recomputed_chunk_or_the_lm_head_not_both():
    head = 500
    # without recompute every layer's activations stay through the head's backward
    assert memory.backward_activation_bytes(DENSE, 10, Recompute(), head) == 3280
    # full, uniform: the 2 chunk inputs through the head's backward; then one layer recomputed
    # (160 + 1640), beyond the head's 500 once it is freed: 1300
    assert memory.backward_activation_bytes(DENSE, 10, Recompute("full", "uniform", 1), head) == 1300
    assert memory.backward_activation_bytes(DENSE, 10, Recompute("full", "uniform", 1), 5000) == 160
    # full, block, 1 layer: its input and the second layer kept (80 + 1640), more than the
    # recomputed first layer (80 + 1640) less the head
    assert memory.backward_activation_bytes(DENSE, 10, Recompute("full", "block", 1), head) == 1720


def test_lm_head_by_hand(monkeypatch):
    # hidden states: 10 * 4 * (2 bf16 + 4 fp32 copy + 2 bf16 cast); one chunk of 10 rows * 16 * 16
    assert logits_bytes(DENSE, 10) == 10 * 4 * 8 + 10 * 16 * 16
    monkeypatch.setattr(memory, "LOGITS_CHUNK_ELEMENTS", 48)  # 3 rows a chunk
    assert logits_bytes(DENSE, 10) == 10 * 4 * 8 + 3 * 16 * 16
    monkeypatch.setattr(memory, "LOGITS_CHUNK_ELEMENTS", 8)  # fewer than a row's 16: one row a chunk (logprobs' too)
    assert logits_bytes(DENSE, 10) == 10 * 4 * 8 + 1 * 16 * 16


def test_kv_cache_by_hand():
    assert kv_bytes_per_token(DENSE) == 2 * 2 * 2 * 2  # bf16, key and value, 2 layers, 1 head of 2
    # GDN states: conv (2*2 + 4) * 4 * 2 bytes = 64, rule 2 * 2 * 2 * 4 bytes = 32
    assert memory.gdn_state_bytes_per_request(HYBRID) == 96


def test_the_weights_a_decode_step_reads_by_hand():
    # tied: all 372 parameters of 2 B (the embedding is the output layer too)
    assert memory.decode_weight_bytes(DENSE) == 372 * 2
    # untied: an output layer more (16 x 4), the input embedding left out: a step reads a row a request
    assert memory.decode_weight_bytes(dataclasses.replace(DENSE, tied=False)) == (372 + 64 - 64) * 2
    assert memory.decode_weight_bytes(dataclasses.replace(DENSE, param_bytes=4)) == 372 * 4


def _run(shape=DENSE, buffer=1000, gpu=100_000, dp=1, tokens=10):
    engine = EngineShape(max_requests=4, max_sequence_length=8, block_tokens=2, buffer_bytes=buffer)
    return RunShape(model=shape, engine=engine, micro_batch_tokens=tokens, data_parallel=dp, gpu_bytes=gpu)


def test_plan_by_hand_each_lever():
    params = 372
    plan = plan_memory(_run(), Levers())
    assert {i.name: i.bytes for i in plan.items} == {
        "weights": 2 * params, "gradients": 4 * params, "optimizer": 12 * params, "KV cache + GDN states": 1000,
        "engine logits buffer": 0, "activations": 3280, "LM head": 2880,
        "optimizer step": 0}  # AdamW's 4 * params fit in what the backward freed
    assert plan.phase_bytes(GENERATION) == 18 * params + 1000
    assert plan.phase_bytes(TRAINING) == 18 * params + 1000 + 3280 + 2880 == plan.peak_bytes
    recompute = plan_memory(_run(), Levers(kv_cache_mode="recompute"))
    assert recompute.phase_bytes(TRAINING) == 18 * params + 3280 + 2880  # the cache freed
    offload = plan_memory(_run(), Levers(offload_optimizer_during_inference=True))
    assert offload.phase_bytes(GENERATION) == 6 * params + 1000  # optimizer on the CPU meanwhile
    assert plan_memory(_run(dp=4), Levers(distributed_optimizer=True)).item("optimizer").bytes == 12 * params // 4
    assert plan_memory(_run(), Levers(optimizer_cpu_offload=True)).item("optimizer").bytes == 0
    # host memory: on the CPU route the whole state and the gradients' fp32 host copy, 12 + 4
    # bytes a parameter (1/4 each, distributed over 4); the GPU state while generating with the
    # offload lever; none otherwise
    assert plan_memory(_run(dp=4), Levers(optimizer_cpu_offload=True, distributed_optimizer=True)
                       ).host_optimizer_bytes == 16 * params // 4
    assert offload.host_optimizer_bytes == 12 * params and plan.host_optimizer_bytes == 0
    assert plan_memory(_run(), Levers(reference_model=True)).item("KL reference weights").bytes == 2 * params
    full = plan_memory(_run(), Levers(recompute=Recompute("full", "uniform", 1)))
    assert full.item("activations").bytes == 160  # the chunk inputs: a recomputed layer (1640) < the head
    assert full.item("activations").note.endswith(f"(none: {3280 / memory.GIB:.2f} GiB)")  # beside, for comparison


def test_plan_by_hand_with_generators_apart():
    params = 372
    trainer = plan_memory(dataclasses.replace(_run(), role="trainer"), Levers())
    assert {i.name: i.bytes for i in trainer.items} == {
        "weights": 2 * params, "gradients": 4 * params, "optimizer": 12 * params, "activations": 3280,
        "LM head": 2880, "optimizer step": 0}  # no engine
    assert trainer.peak_bytes == 18 * params + 3280 + 2880 and trainer.requests_at_once == 0
    generator = plan_memory(dataclasses.replace(_run(), role="generator", requests=10), Levers())
    assert {i.name: i.bytes for i in generator.items} == {
        "weights": 2 * params, "KV cache + GDN states": 1000, "engine logits buffer": 0}
    assert generator.peak_bytes == generator.phase_bytes(GENERATION) == 2 * params + 1000
    assert generator.phase_bytes(TRAINING) == 0 and generator.host_optimizer_bytes == 0
    assert (generator.requests_at_once, generator.generation_waves) == (4, 3)
    # its cache by fraction: of what its weights leave (no optimizer there)
    by_fraction = plan_memory(dataclasses.replace(_run(gpu=20_000), role="generator"), Levers(kv_cache_fraction=0.5))
    assert by_fraction.item("KV cache + GDN states").bytes == int(0.5 * (20_000 - 2 * params))
    assert "engine: the cache holds" not in memory.format_plan(trainer)
    # nor host memory for an optimizer it does not have, whatever the optimizer's levers
    for levers in (Levers(offload_optimizer_during_inference=True), Levers(optimizer_cpu_offload=True)):
        apart = plan_memory(dataclasses.replace(_run(), role="generator"), levers)
        assert apart.host_optimizer_bytes == 0 and "host: the optimizer" not in memory.format_plan(apart)


def test_optimizer_step_by_hand(monkeypatch):
    params = 372
    assert memory.optimizer_step_bytes(params, Levers(), 1, fused_adam=False) == 4 * params  # sqrt(exp_avg_sq)
    assert memory.optimizer_step_bytes(params, Levers(distributed_optimizer=True), 4, fused_adam=False) == params
    assert memory.optimizer_step_bytes(params, Levers(), 1, fused_adam=True) == 0
    assert memory.optimizer_step_bytes(params, Levers(optimizer_cpu_offload=True), 1, fused_adam=False) == 0
    # the step comes after the backward has freed its tensors: it adds only what exceeds them
    monkeypatch.setattr(memory, "backward_activation_bytes", lambda *args: 100)
    monkeypatch.setattr(memory, "logits_bytes", lambda *args: 200)
    plan = plan_memory(_run(), Levers())
    assert plan.item("optimizer step").bytes == 4 * params - 300
    assert plan.phase_bytes(TRAINING) == 18 * params + 1000 + 4 * params
    fused = plan_memory(dataclasses.replace(_run(), fused_adam=True), Levers())
    assert fused.item("optimizer step").bytes == 0 and fused.phase_bytes(TRAINING) == 18 * params + 1000 + 300


def test_kv_cache_sized_by_fraction_of_what_generation_leaves():
    plan = plan_memory(_run(gpu=20_000), Levers(kv_cache_fraction=0.5))
    assert plan.item("KV cache + GDN states").bytes == int(0.5 * (20_000 - 18 * 372))
    # a state larger than the GPU (18 * 372 = 6696 > 5000) leaves none: a cache of 0, not a negative one
    assert plan_memory(_run(gpu=5000), Levers(kv_cache_fraction=0.5)).item("KV cache + GDN states").bytes == 0
    assert memory.kv_cache_bytes(-100, Levers(kv_cache_fraction=0.5), _run().engine) == 0


def test_what_the_gpu_holds_beyond_torch_is_not_free_for_tensors():
    run = dataclasses.replace(_run(gpu=20_000), outside_torch_bytes=3000)
    by_fraction = plan_memory(run, Levers(kv_cache_fraction=0.5))
    assert by_fraction.item("KV cache + GDN states").bytes == int(0.5 * (20_000 - 3000 - 18 * 372))
    peak = plan_memory(run, Levers()).peak_bytes  # 18 * 372 + 1000 + 3280 + 2880 = 13,856
    assert peak == 13_856

    def verdict(plan):
        return next(line for line in memory.format_plan(plan).splitlines() if line.startswith("predicted peak"))
    exactly = plan_memory(dataclasses.replace(run, gpu_bytes=peak + 3000), Levers())
    assert exactly.fits and verdict(exactly).endswith("GiB beyond torch (CUDA context, NCCL, cuBLAS, kernels) "
                                                      "of 0.0 GiB: fits")
    short = plan_memory(dataclasses.replace(run, gpu_bytes=peak + 2999), Levers())  # the tensors alone would fit
    assert not short.fits and verdict(short).endswith(": does NOT fit")
    assert "beyond torch" not in memory.format_plan(plan_memory(_run(), Levers()))  # none given, none printed


def test_optimizer_growth_between_the_engines_build_and_generation():
    # 372 bf16 parameters: at the build the fp32 main weights (4 bytes each) are placed; while
    # generating the whole state (12), none of it when offloaded, never any on the CPU route
    growth = memory.optimizer_growth_before_generation
    assert growth(372, DENSE, Levers(), 1) == 8 * 372  # Adam's moments still to come
    assert growth(372, DENSE, Levers(offload_optimizer_during_inference=True), 1) == -4 * 372
    assert growth(372, DENSE, Levers(distributed_optimizer=True), 4) == 12 * 372 // 4 - 4 * 372 // 4
    assert growth(372, DENSE, Levers(optimizer_cpu_offload=True, offload_optimizer_during_inference=True), 1) == 0
    fp32 = ModelShape(**{**DENSE.__dict__, "param_bytes": 4})
    assert growth(372, fp32, Levers(offload_optimizer_during_inference=True), 1) == 0  # no main copy


def test_suggestions_lower_the_peak_largest_saving_first():
    shape = ModelShape(layers=("*-",) * 8, hidden=1024, ffn=4096, heads=16, kv_heads=16, head_dim=64, vocab=32000)
    plan = plan_memory(_run(shape=shape, buffer=2 * memory.GIB, gpu=10 * memory.GIB, tokens=16384), Levers())
    assert plan.peak_bytes > plan.gpu_bytes
    peaks = [float(text.rsplit("-> ", 1)[1].split()[0]) for text in plan.suggestions]
    assert peaks == sorted(peaks) and all(p < plan.peak_bytes / memory.GIB for p in peaks)
    assert plan.suggestions[0].startswith("--recompute-granularity full")
    assert any(text.startswith("--rl-kv-cache-management-mode recompute") for text in plan.suggestions)
    assert "does NOT fit" in memory.format_plan(plan)


def test_a_cache_that_holds_no_request_is_named_with_its_flags():
    # 8 tokens need 4 blocks of 2 (+1 the engine keeps as a dummy); a block is 2 * 16 bytes = 32
    assert kv_cache_problem(DENSE, _run(buffer=5 * 32).engine, "--x") is None
    problem = kv_cache_problem(DENSE, _run(buffer=4 * 32).engine, "--inference-dynamic-batching-buffer-size-gb 1e-07")
    assert problem.startswith("--inference-dynamic-batching-buffer-size-gb 1e-07: the KV cache of 0.00 GiB holds 3 "
                              "blocks of 2 tokens")
    assert "fewer than one request of --inference-max-seq-length 8 needs (4)" in problem
    # GDN states of every request slot come off the top: 4 slots * 96 bytes
    hybrid = ModelShape(**{**HYBRID.__dict__, "layers": ("G", "*", "-")})
    assert kv_cache_problem(hybrid, _run(buffer=4 * 96 + 5 * 8 * 2).engine, "--x") is None
    assert "--inference-dynamic-batching-max-requests 4" in kv_cache_problem(hybrid, _run(buffer=5 * 16).engine, "--x")


def test_requests_the_cache_holds_and_generation_waves():
    # a request of 8 tokens needs 4 blocks of 32 bytes; 1000 bytes are 31 blocks, 30 usable: 7
    # requests, capped at the 4 request slots; 10 requests a step run in 3 waves of 4
    run = dataclasses.replace(_run(buffer=1000), requests=10)
    assert memory.requests_held(DENSE, run.engine) == 4
    plan = plan_memory(run, Levers())
    assert (plan.requests_at_once, plan.generation_waves) == (4, 3)
    assert plan.summary()["generation_waves"] == 3
    # 320 bytes: 9 usable blocks hold 2 requests, fewer than the 4 slots: said, with the flag
    small = plan_memory(dataclasses.replace(_run(buffer=320), requests=10), Levers())
    assert (small.requests_at_once, small.generation_waves) == (2, 5)
    assert any(text.startswith("--inference-dynamic-batching-max-requests 2: the cache holds 2 requests")
               for text in small.suggestions)
    # 100 bytes: 3 blocks, 2 usable, fewer than one request's 4: no request at once, no waves,
    # and no suggestion of 0 request slots
    none = plan_memory(dataclasses.replace(_run(buffer=100), requests=10), Levers())
    assert (none.requests_at_once, none.generation_waves) == (0, 0)
    assert not [text for text in none.suggestions if text.startswith("--inference-dynamic-batching-max-requests")]


def test_the_tool_prints_and_writes_the_plan(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("memory_plan", REPO / "tools" / "memory_plan.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    output = tmp_path / "plan.json"
    monkeypatch.setattr("sys.argv", ["memory_plan.py", "--plan-gpus", "2", "--plan-output", str(output),
                                     "--recipe", str(REPO / "examples" / "recipes" / "tiny_sort.yaml"),
                                     "--batch-invariant-mode", "--flash-attention-version", "4",
                                     "--use-distributed-optimizer"])
    tool.main()
    written = json.loads(output.read_text())
    assert written["gpus"] == 2 and "source_hash" in written
    assert written["plan_gib"]["peak"] == max(written["plan_gib"]["peak_generation"],
                                              written["plan_gib"]["peak_training"])
    assert "fp32 main weights + Adam, 1/2 each (distributed)" in capsys.readouterr().out
    monkeypatch.setattr("sys.argv", ["memory_plan.py", "--plan-output", str(output), "--recipe",
                                     str(REPO / "examples" / "recipes" / "tiny_sort.yaml"), "--batch-invariant-mode",
                                     "--flash-attention-version", "4", "--rl-generator-ranks", "1"])
    tool.main()
    written, printed = json.loads(output.read_text()), capsys.readouterr().out
    assert "a trainer (1 data-parallel):" in printed and "\na generator:\n" in printed
    assert "--plan-gpus 1: the trainers' GPUs; each generator rank (--rl-generator-ranks) is planned apart" in printed
    beyond = memory.OUTSIDE_TORCH_BYTES / memory.GIB  # each process's, beside its tensors
    assert written["plan_gib"]["outside_torch"] == written["generator_plan_gib"]["outside_torch"] == beyond
    together = written["plan_gib"]["peak"] + written["generator_plan_gib"]["peak"] + 2 * beyond
    assert f"a trainer and a generator on one GPU: {together:.2f} GiB, beyond torch included" in printed
    assert f" + {beyond:.2f} GiB beyond torch (CUDA context, NCCL, cuBLAS, kernels) of 139.8 GiB: fits" in printed
    assert "KV cache + GDN states" not in written["plan_gib"] and "gradients" not in written["generator_plan_gib"]
    monkeypatch.setattr("sys.argv", ["memory_plan.py", "--plan-gpus", "0"])
    with pytest.raises(SystemExit, match="--plan-gpus must be >= 1"):
        tool.main()


def _memory_plan_tool():
    spec = importlib.util.spec_from_file_location("memory_plan", REPO / "tools" / "memory_plan.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_the_tools_own_example_runs_as_written(tmp_path, monkeypatch, capsys):
    """The docstring's first command, its checkpoint made here (Qwen3-4B's config, no weights:
    a plan reads none) and its paths under tmp_path; it failed on the recipe's checkpoint
    intervals without their directories."""
    import shlex
    import subprocess
    import sys

    tool = _memory_plan_tool()
    example = tool.__doc__.split("\n\n  ", 1)[1].split("\n  python", 1)[0].replace("\\\n", " ")
    subprocess.run([sys.executable, str(REPO / "tools" / "random_hf_checkpoint.py"), "qwen3-4b", str(tmp_path),
                    "--config-only"], check=True, capture_output=True)
    argv = [a.replace("/ckpt/Qwen3-4B", str(tmp_path / "hf")).replace("runs/", f"{tmp_path}/runs/")
            for a in shlex.split(example)]
    assert argv[:2] == ["python", "tools/memory_plan.py"]
    monkeypatch.chdir(REPO)
    monkeypatch.setattr("sys.argv", argv[1:])
    tool.main()
    assert "predicted peak" in capsys.readouterr().out


def test_the_tool_plans_for_this_machine_s_gpu_else_an_h200(monkeypatch, capsys):
    """An H100's plan said 'of 139.8 GiB: fits' when the GPU's memory was not given."""
    tool = _memory_plan_tool()
    argv = ["memory_plan.py", "--recipe", str(REPO / "examples" / "recipes" / "tiny_sort.yaml"),
            "--flash-attention-version", "4"]
    monkeypatch.setattr("sys.argv", argv)
    tool.main()
    assert " of 139.8 GiB: fits" in capsys.readouterr().out  # no GPU here: an H200's
    monkeypatch.setattr(tool.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tool.torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(total_memory=int(79.1 * GIB), name="H100"))
    tool.main()
    assert " of 79.1 GiB: fits" in capsys.readouterr().out
    monkeypatch.setattr("sys.argv", argv + ["--plan-gpu-memory-gib", "40"])
    tool.main()
    assert " of 40.0 GiB: fits" in capsys.readouterr().out


def test_the_tools_help_shows_its_own_flags(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["memory_plan.py", "--help"])
    _memory_plan_tool().main()
    printed = capsys.readouterr().out
    assert "--plan-gpus" in printed and "--plan-gpu-memory-gib" in printed and "--plan-output" in printed
    assert printed.rstrip().endswith("Every other flag is pretrain_rl.py's: python pretrain_rl.py --help")


def test_recompute_of_several_layers_a_chunk_by_hand():
    four = dataclasses.replace(DENSE, layers=("*-",) * 4)  # 1640 bytes a layer at 10 tokens, inputs 80
    # uniform, 2 layers a chunk: 2 chunk inputs, then a chunk of 2 layers recomputed
    assert activation_bytes(four, 10, Recompute("full", "uniform", 2)) == 2 * 80 + 2 * 1640
    # uniform, 3 layers a chunk: chunks of 3 and 1 layers; the larger one recomputed
    assert activation_bytes(four, 10, Recompute("full", "uniform", 3)) == 2 * 80 + 3 * 1640
    # block, 2: the first 2 layers checkpointed one by one, the last 2 kept through the forward
    assert activation_bytes(four, 10, Recompute("full", "block", 2)) == 2 * 80 + 2 * 1640
    assert activation_bytes(four, 10, Recompute("full", "block", 3)) == 3 * 80 + 1640


def test_block_recompute_holds_the_first_layers_recomputed_not_the_kept_ones():
    """A hybrid "-*" pattern: an MLP layer of 100 bytes a token, then attention of 64 (as in
    test_activations_by_hand), 10 tokens: 1000 and 640 bytes. Block, 1 layer: the MLP checkpointed
    (its input 10 * 4 * 2 = 80) and attention kept: 80 + 640 = 720 through the forward; the MLP
    recomputed in the backward, 80 + 1000 = 1080, the larger."""
    mixed = dataclasses.replace(DENSE, layers=tuple("-*"))
    assert activation_bytes(mixed, 10, Recompute("full", "block", 1)) == 80 + 1000


def test_cuda_graphs_hold_a_decode_steps_fp32_logits_while_generating():
    params, run = 372, _run()
    graphed = dataclasses.replace(run, engine=dataclasses.replace(run.engine, cuda_graphs=True))
    plan = plan_memory(graphed, Levers())
    assert plan.item("engine logits buffer").bytes == 4 * 16 * 4  # 4 requests, 16 logits, fp32
    assert plan.phase_bytes(GENERATION) == 18 * params + 1000 + 256
    assert plan.phase_bytes(TRAINING) == 18 * params + 1000 + 3280 + 2880
    # a cache by fraction takes its share of what the state and the logits buffer leave:
    # 0.5 * (20,000 - 18 * 372 - 256) = 6524
    graphed = dataclasses.replace(graphed, gpu_bytes=20_000)
    assert plan_memory(graphed, Levers(kv_cache_fraction=0.5)).item("KV cache + GDN states").bytes == 6524


def test_a_node_whose_memory_cannot_hold_its_processes_optimizers_is_named():
    assert host_memory_problem(40 * GIB, 3, 125 * GIB, sharded=False) is None
    assert host_memory_problem(40 * GIB, 3, 120 * GIB, sharded=False) is None  # exactly full
    assert host_memory_problem(40 * GIB + 1, 3, 120 * GIB, sharded=False) is not None
    problem = host_memory_problem(40 * GIB, 4, 125 * GIB, sharded=False)
    assert problem.startswith("the optimizer takes 40.0 GiB of host memory a training process")
    assert "160.0 GiB for this node's 4; the node has 125.0 GiB: shard it over the GPUs (--use-distributed-optimizer)" in problem
    assert problem.endswith("(--rl-offload-optimizer-during-inference instead)")
    assert "shard it over more GPUs" in host_memory_problem(40 * GIB, 4, 125 * GIB, sharded=True)
    # fits, but within 15% of the node: warned (the 35B-A3B 8-layer run, 115.4 of 125 GiB, was killed)
    assert host_memory_warning(40 * GIB, 2, 125 * GIB) is None  # 64%
    warning = host_memory_warning(int(115.4 * GIB), 1, 125 * GIB)
    assert warning.startswith("warning: the optimizers of this node's 1 training process(es) take 115.4 GiB of its "
                              "125.0 GiB of host memory (92%)")
    assert host_memory_warning(40 * GIB, 4, 125 * GIB) is None  # does not fit: the problem says so
    assert host_memory_warning(17 * GIB, 1, 20 * GIB) is None  # exactly 85%: within the share
    assert host_memory_warning(17 * GIB + 1, 1, 20 * GIB) is not None


@pytest.mark.parametrize("limit,expected", [("1048576\n", 1 << 20), ("max\n", None), (str(1 << 62), None),
                                            (None, None)])
def test_the_node_s_memory_is_its_cgroup_s_limit_where_that_is_lower(tmp_path, monkeypatch, limit, expected):
    """A container's limit (cgroup v2's memory.max: bytes, or "max"); the machine's memory where
    the limit is higher, unlimited or not there."""
    import os

    from megatron_rl_bi import memory

    path = tmp_path / "memory.max"
    if limit is not None:
        path.write_text(limit)
    monkeypatch.setattr(memory, "CGROUP_MEMORY_MAX", str(path))
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert memory.node_memory_bytes() == (expected or physical)


def test_fewer_recomputed_layers_where_training_stays_within_the_peak():
    """DENSE, 10 tokens, the cache freed while training: state 18 * 372 = 6696 bytes, LM head 2880.
    Activations under full recompute: uniform 1, two layer inputs of 10 * 4 * 2 = 80 bytes, 160;
    block 1, one input and the second layer's 1640, 1720; none, 3280. Training: 9736, 11296,
    12856 bytes; generation 6696 + the cache."""
    uniform = Levers(recompute=Recompute("full", "uniform", 1), kv_cache_mode="recompute")
    suggested = {buffer: [text for text in plan_memory(_run(buffer=buffer), uniform).suggestions
                          if "layers recomputed" in text] for buffer in (3000, 5000, 7000)}
    assert suggested[3000] == []  # the peak is training's own (9736 > 9696)
    assert suggested[5000][0].startswith("--recompute-method block --recompute-num-layers 1: 1 of 2 layers "
                                         "recomputed, not 2")  # 11296 <= 11696 < 12856
    assert suggested[7000][0].startswith("no --recompute-granularity: 0 of 2 layers recomputed")  # 12856 <= 13696
    assert not [text for text in plan_memory(_run(buffer=7000), Levers(kv_cache_mode="recompute")).suggestions
                if "layers recomputed" in text]  # nothing recomputed: nothing to spare
    over = plan_memory(_run(buffer=5000, gpu=10_000), uniform)  # does not fit: less recompute is no help
    assert not [text for text in over.suggestions if "layers recomputed" in text]
    # training's peak equal to the peak is within it: a cache of 4600 makes generation 6696 + 4600 = 11296,
    # block 1's training
    at_peak = [text for text in plan_memory(_run(buffer=4600), uniform).suggestions if "layers recomputed" in text]
    assert at_peak[0].startswith("--recompute-method block --recompute-num-layers 1: 1 of 2 layers recomputed")


def test_fewer_recomputed_layers_under_block_recompute_counts_from_the_layers_it_recomputes():
    """Block, 1 of DENSE's 2 layers recomputed (training 11296 bytes, as above): only fewer than 1
    can be suggested, none (12856) where the peak is 11696 (a cache of 5000), not the 1 it is."""
    block = Levers(recompute=Recompute("full", "block", 1), kv_cache_mode="recompute")
    suggested = {buffer: [text for text in plan_memory(_run(buffer=buffer), block).suggestions
                          if "layers recomputed" in text] for buffer in (5000, 7000)}
    assert suggested[5000] == []
    assert suggested[7000][0].startswith("no --recompute-granularity: 0 of 2 layers recomputed, not 1,")


def test_fp32_weights_have_no_fp32_main_copy_in_the_optimizer():
    # fp32 parameters: Adam's two moments only, 8 bytes a parameter; bf16 ones add the main copy, 12
    fp32 = dataclasses.replace(DENSE, param_bytes=4)
    assert memory.optimizer_bytes(372, fp32, Levers(), 1) == 8 * 372
    assert memory.optimizer_bytes(372, DENSE, Levers(), 1) == 12 * 372
    assert plan_memory(_run(shape=fp32), Levers()).item("optimizer").bytes == 8 * 372


def test_a_micro_batch_shorter_than_the_longest_sequence_trains_that_sequence():
    """--rl-micro-batch-tokens 4, --inference-max-seq-length 8: a sequence of 8 tokens is a
    micro-batch of its own. Activations 8 tokens * 2 layers * 164 = 2624; LM head 8 * 4 * 8 + 8
    rows * 16 * 16 = 2304."""
    plan = plan_memory(_run(tokens=4), Levers())
    assert plan.item("activations").bytes == 2624 and plan.item("LM head").bytes == 2304
    assert plan.item("activations").note.startswith("8 tokens")


def test_a_halved_micro_batch_is_suggested_no_shorter_than_the_longest_sequence():
    # 10 tokens halved are 5, fewer than one sequence of --inference-max-seq-length 8: 8 is suggested
    suggested = [text for text in plan_memory(_run(), Levers()).suggestions if text.startswith("--rl-micro-batch")]
    assert suggested[0].startswith("--rl-micro-batch-tokens 8: peak")


MODEL_FLAGS = COMMON + BUILT["dense, tied"]


def test_the_params_dtype_sets_a_parameters_bytes():
    for flags, expected in (([], 4), (["--bf16"], 2), (["--fp16"], 2)):
        assert model_shape_from_args(parse_rl_args(MODEL_FLAGS + flags), 50).param_bytes == expected


def test_the_load_balancing_loss_is_counted_where_megatron_core_enables_it():
    """TopKRouter.is_aux_loss_enabled: aux_loss, seq_aux_loss or global_aux_loss with a coefficient > 0."""
    moe = MODEL_FLAGS + ["--num-experts", "4", "--moe-router-topk", "2"]

    def counted(*flags):
        return model_shape_from_args(parse_rl_args(moe + list(flags)), 50).load_balancing_loss

    assert not counted()  # aux_loss of coefficient 0, Megatron's default
    for kind in ("aux_loss", "seq_aux_loss", "global_aux_loss"):
        assert counted("--moe-router-load-balancing-type", kind, "--moe-aux-loss-coeff", "0.01")
    assert not counted("--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0.01")
    two = ["--moe-router-load-balancing-type", "seq_aux_loss", "global_aux_loss", "--moe-aux-loss-coeff"]
    assert counted(*two, "0", "0.01") and not counted(*two, "0", "0")


def test_the_levers_and_the_run_are_read_from_their_flags():
    def levers(*flags):
        return levers_from_args(parse_rl_args(MODEL_FLAGS + list(flags)))

    assert levers() == Levers()  # --grpo-kl-beta 0: no reference model
    assert levers("--grpo-kl-beta", "0.01") == Levers(reference_model=True)
    assert levers("--bf16", "--rl-offload-optimizer-during-inference") == Levers(
        offload_optimizer_during_inference=True)
    assert levers("--optimizer-cpu-offload", "--use-precision-aware-optimizer") == Levers(optimizer_cpu_offload=True)
    # full recompute without --recompute-num-layers (megatron-core refuses it only when it builds
    # the model) is planned as 1 layer a chunk, not a chunk of none
    assert levers("--recompute-granularity", "full", "--recompute-method", "uniform").recompute == Recompute(
        "full", "uniform", 1)
    # each rank generates its prompts x the group size
    run = memory_run_from_args(parse_rl_args(MODEL_FLAGS + ["--grpo-prompts-per-step", "3", "--grpo-group-size", "5"]),
                               50, 2, 1000)
    assert (run.requests, run.data_parallel, run.gpu_bytes, run.role) == (15, 2, 1000, "colocated")
