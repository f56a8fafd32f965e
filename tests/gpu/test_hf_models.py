"""Architectures imported from Hugging Face checkpoints keep bitwise engine/trainer parity in BI
mode (GPU): Qwen3 (QK norm) and Qwen3.5 (GDN, gated attention with head dim 256, partial rotary,
zero-centred norms), tiny random checkpoints written by transformers in the test; and in both
modes their logits agree with transformers' (parity alone cannot show a layer computed wrongly
on both sides, e.g. a norm scaled by the wrong weight)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_checkpoints import qwen35_text_config, save_qwen3, save_qwen35  # noqa: E402

from megatron_rl_bi import bi  # noqa: E402
from megatron_rl_bi.checkpoints.hf import load_hf_weights, read_hf_model  # noqa: E402
from megatron_rl_bi.checkpoints.hf.verify import verify  # noqa: E402
from megatron_rl_bi.config import parse_rl_args  # noqa: E402
from megatron_rl_bi.inference import EngineConfig, Generator, Sampling  # noqa: E402
from megatron_rl_bi.parity.harness import random_requests, run_parity  # noqa: E402

from .conftest import FLASH_ATTENTION_VERSION  # noqa: E402

pytestmark = pytest.mark.gpu

ENGINE = EngineConfig(max_requests=32, max_tokens=4096, max_sequence_length=256,
                      buffer_size_gb=1.0, prompt_logprobs=True)


def _save(family: str, path: str) -> None:
    if family == "qwen3":
        save_qwen3(path)
    else:
        save_qwen35(path)


def _imported_model(path, batch_invariant=True, transformer_impl="local"):
    from megatron_rl_bi.models.build import build_model

    args = parse_rl_args(["--hf-checkpoint", path, "--bf16", "--flash-attention-version", FLASH_ATTENTION_VERSION,
                          "--transformer-impl", transformer_impl]
                         + ["--batch-invariant-mode"] * batch_invariant)
    bi.enable() if batch_invariant else bi.disable()
    model = build_model(args, args.vocab_size)
    load_hf_weights(model, read_hf_model(path))
    return model


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_imported_model_engine_matches_trainer(tmp_path, distributed, family):
    path = str(tmp_path / "hf")
    _save(family, path)
    try:
        model = _imported_model(path)
        vocab = read_hf_model(path).vocab_size
        prompts, budgets = random_requests(16, (1, 120), (1, 100), vocab, seed=3)
        result = run_parity(model, Generator(model, ENGINE), prompts, budgets,
                            Sampling(temperature=1.0, seed=3), micro_batch_tokens=1000, orders=2)
    finally:
        bi.disable()
    metrics = result["all_reported"]
    assert metrics["bit_wise/tokens"] >= 1000
    assert metrics["bit_wise/logprob_diff/max"] == 0.0, metrics
    assert metrics["bit_wise/ratio_tokens_different"] == 0.0, metrics


@pytest.mark.parametrize("transformer_impl", ["local", "transformer_engine"])
@pytest.mark.parametrize("batch_invariant", [True, False], ids=["bi", "default"])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_imported_model_logits_match_transformers(tmp_path, distributed, family, batch_invariant,
                                                  transformer_impl):
    """tools/convert_hf.py's verify rule: at most twice as far from transformers' fp32 forward as
    transformers' own bf16 forward (the checkpoints' norm weights are random, not 0 or 1)."""
    if transformer_impl == "transformer_engine":
        pytest.importorskip("transformer_engine", reason="the TE route needs TransformerEngine")
    path = str(tmp_path / "hf")
    _save(family, path)
    try:
        model = _imported_model(path, batch_invariant, transformer_impl)
        report = verify(model, path, read_hf_model(path).vocab_size)
    finally:
        bi.disable()
    assert report["passed"], report


def test_head_dim_256_gated_attention(tmp_path, distributed):
    """Qwen3.5's attention shape (head dim 256, output gate, rotary on a quarter of the dims)."""
    from hf_checkpoints import save_tokenizer
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    path = str(tmp_path / "hf")
    config = qwen35_text_config(head_dim=256, num_attention_heads=2, num_key_value_heads=1)
    Qwen3_5ForCausalLM(config).save_pretrained(path)
    save_tokenizer(path)
    try:
        model = _imported_model(path)
        prompts, budgets = random_requests(8, (1, 120), (1, 60), config.vocab_size, seed=4)
        result = run_parity(model, Generator(model, ENGINE), prompts, budgets,
                            Sampling(temperature=1.0, seed=4), micro_batch_tokens=1000, orders=1)
    finally:
        bi.disable()
    assert result["all_reported"]["bit_wise/logprob_diff/max"] == 0.0
