import os

import pytest
import torch

# BI_GPU_TESTS_TRANSFORMER_IMPL=transformer_engine runs every model of these tests through TE,
# BI_GPU_TESTS_FLASH_ATTENTION_VERSION=3 through FlashAttention-3 (explicit, so installing TE or
# FA3 never changes what a plain run tests).
TRANSFORMER_IMPL = os.environ.get("BI_GPU_TESTS_TRANSFORMER_IMPL", "local")
FLASH_ATTENTION_VERSION = os.environ.get("BI_GPU_TESTS_FLASH_ATTENTION_VERSION", "4")

COMMON_ARGS = [
    "--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--bf16",
    "--seq-length", "1024", "--max-position-embeddings", "1024", "--micro-batch-size", "1",
    "--flash-attention-version", FLASH_ATTENTION_VERSION, "--seed", "1234", "--transformer-impl", TRANSFORMER_IMPL,
]
TINY_DENSE_ARGS = [
    # Large enough (K = 2048) that stock cuBLAS/FlashAttention schedules differ between decode
    # and trainer shapes, so the default-mode check can see a mismatch.
    "--num-layers", "4", "--hidden-size", "2048", "--ffn-hidden-size", "5632",
    "--num-attention-heads", "16", "--group-query-attention", "--num-query-groups", "4",
    *COMMON_ARGS,
]
TINY_HYBRID_ARGS = [
    "--hybrid-layer-pattern", "G-G-G-*-", "--hidden-size", "512", "--ffn-hidden-size", "1408",
    "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2",
    "--linear-num-key-heads", "4", "--linear-num-value-heads", "8",
    "--linear-key-head-dim", "64", "--linear-value-head-dim", "64", "--linear-conv-kernel-dim", "4",
    *COMMON_ARGS,
]
VOCAB_SIZE = 32000
MOE_ARGS = ["--num-experts", "16", "--moe-router-topk", "4", "--moe-ffn-hidden-size", "512",
            "--moe-shared-expert-intermediate-size", "512", "--moe-aux-loss-coeff", "0.01",
            "--moe-router-dtype", "fp32", "--hidden-size", "1024", "--ffn-hidden-size", "2816",
            "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2"]
TINY_MOE_ARGS = ["--num-layers", "4", *MOE_ARGS, *COMMON_ARGS]
# Qwen3.5-MoE's layers: its shared expert scaled by the sigmoid of its own gate
TINY_HYBRID_MOE_ARGS = ["--hybrid-layer-pattern", "GEGE*E", "--linear-num-key-heads", "4",
                        "--linear-num-value-heads", "8", "--linear-key-head-dim", "64",
                        "--linear-value-head-dim", "64", "--linear-conv-kernel-dim", "4",
                        "--moe-shared-expert-gate", *MOE_ARGS, *COMMON_ARGS]


@pytest.fixture(scope="session")
def distributed():
    from megatron_rl_bi.distributed import initialize_distributed

    initialize_distributed(seed=1234)
    yield


def build(model_args: list[str], batch_invariant: bool, extra: list[str] = (), seed: int = 1234):
    """The model of `model_args` (+ `extra`) on the GPU, weights from `seed`. The BI switch is
    left set to `batch_invariant` (the model runs in that mode; fixtures turn it off after)."""
    from megatron_rl_bi import bi
    from megatron_rl_bi.config import parse_args
    from megatron_rl_bi.models.build import build_model

    args = parse_args(model_args + (["--batch-invariant-mode"] if batch_invariant else []) + list(extra))
    bi.enable() if batch_invariant else bi.disable()
    torch.manual_seed(seed)
    return build_model(args, VOCAB_SIZE)


def build_dense(batch_invariant: bool, extra: list[str] = ()):
    return build(TINY_DENSE_ARGS, batch_invariant, extra)


def assert_bitwise(result: dict) -> None:
    """A run_parity result over enough tokens (5,000 reported, 2 x 256 of completions) with
    engine and trainer logprobs equal at every one."""
    metrics = result["all_reported"]
    assert metrics["bit_wise/tokens"] >= 5000
    assert result["completion_only"]["bit_wise/tokens"] >= 2 * 256
    assert metrics["bit_wise/logprob_diff/max"] == 0.0, metrics
    assert metrics["bit_wise/ratio_tokens_different"] == 0.0, metrics


def packed_logits(model, sequences: list[list[int]]) -> torch.Tensor:
    """The model's logits of `sequences` packed into one batch."""
    from megatron_rl_bi.packing import pack_sequences

    batch = pack_sequences(sequences).to("cuda")
    return model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=None,
                 packed_seq_params=batch.packed_seq_params())[0]


def assert_parity_across_a_step(model, engine, backward) -> None:
    """Engine logprobs == trainer logprobs (one Generator, the same module) over 32 requests,
    before and after an SGD step on the gradients `backward()` leaves, which must move a weight."""
    from megatron_rl_bi.inference import Generator, Sampling
    from megatron_rl_bi.parity.harness import random_requests, run_parity

    generator = Generator(model, engine)
    prompts, budgets = random_requests(32, (1, 500), (1, 256), VOCAB_SIZE, seed=11)
    sampling = Sampling(temperature=1.0, seed=11)
    assert_bitwise(run_parity(model, generator, prompts, budgets, sampling, micro_batch_tokens=6000, orders=2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    backward()
    torch.optim.SGD(model.parameters(), lr=1e-2).step()
    model.zero_grad(set_to_none=True)
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert_bitwise(run_parity(model, generator, prompts, budgets, sampling, micro_batch_tokens=6000, orders=1))
