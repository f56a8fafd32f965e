"""Tiny random Hugging Face checkpoints written by `transformers` inside the tests (nothing is
downloaded): Qwen3 (dense), Qwen3-MoE, Qwen3.5 and Qwen3.5-MoE (hybrid, flat or nested in a
vision-language config),
with a small word-level tokenizer that has a chat template."""

import json
import os

import torch

WORDS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "user", "assistant", "\n"] + [
    str(i) for i in range(40)] + ["+", "=", "what", "is", "the", "answer", "boxed"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", "isolated"),
                                                     pre_tokenizers.WhitespaceSplit()])
    backend.add_special_tokens(WORDS[:3])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every tensor random (norm weights too), so a mapping that swaps or drops one shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.05
            param.copy_((1.0 if name.endswith("norm.weight") and "linear_attn" in name else 0.0)
                        + noise if "A_log" not in name else noise.abs().log())


def _mlps_of_order_one(model: torch.nn.Module, seed: int) -> None:
    """MLP (and expert, router) weights and pre-MLP norms of order 1, so that silu is not the
    near-linear x/2 it is at `_randomize`'s scale, where a mapping that swapped an MLP's gate and
    up halves would go unseen (silu(g) * u ~ silu(u) * g)."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("post_attention_layernorm.weight"):
                param.add_(1.0)
            elif ".mlp." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)


# Qwen3's sizes, shared by the dense and the MoE checkpoint
QWEN3_SIZES = dict(vocab_size=len(WORDS) + 3, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _save(model: torch.nn.Module, path: str, seed: int) -> None:
    _randomize(model, seed)
    _mlps_of_order_one(model, seed)
    model.save_pretrained(path)
    save_tokenizer(path)


def save_qwen3(path: str, tied: bool = True, seed: int = 0) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    _save(Qwen3ForCausalLM(Qwen3Config(**QWEN3_SIZES, num_hidden_layers=2, tie_word_embeddings=tied)), path, seed)


def save_qwen3_moe(path: str, norm_topk_prob: bool = True, seed: int = 0) -> None:
    """Three layers, the middle one dense (`mlp_only_layers`), four experts of which two a token."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**QWEN3_SIZES, num_hidden_layers=3, tie_word_embeddings=False,
                            moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                            decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=norm_topk_prob)
    _save(Qwen3MoeForCausalLM(config), path, seed)


QWEN35_SIZES = dict(vocab_size=len(WORDS) + 3, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                    max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                     "partial_rotary_factor": 0.25})
# Qwen3.5-MoE's MLPs: four experts of which two a token, and a gated shared expert
QWEN35_MOE_SIZES = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
                        num_experts_per_tok=2)


def qwen35_text_config(moe: bool = False, **overrides):
    if moe:
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

        return Qwen3_5MoeTextConfig(**{**QWEN35_SIZES, **QWEN35_MOE_SIZES, **overrides})
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**{**QWEN35_SIZES, "intermediate_size": 96, **overrides})


def save_qwen35(path: str, nested: bool = False, seed: int = 0, extra_tensors: dict | None = None,
                tied: bool = False, moe: bool = False) -> None:
    """`nested`: written as a vision-language `qwen3_5` (`qwen3_5_moe`) config with the text model
    under `model.language_model.` (the vision tower itself is left out of the tiny checkpoint).
    `moe`: Qwen3.5-MoE, its expert, router and shared-expert weights of order one."""
    from safetensors.torch import load_file, save_file
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

    causal_lm = Qwen3_5MoeForCausalLM if moe else Qwen3_5ForCausalLM
    model = causal_lm(qwen35_text_config(moe, tie_word_embeddings=tied))
    _randomize(model, seed)
    if moe:
        _mlps_of_order_one(model, seed)
    model.save_pretrained(path)
    save_tokenizer(path)
    if not (nested or extra_tensors):
        return
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    if nested:
        tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
        with open(os.path.join(path, "config.json")) as f:
            text_config = json.load(f)
        config = {"model_type": "qwen3_5_moe" if moe else "qwen3_5",
                  "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
                  "text_config": text_config, "vision_config": {"depth": 1}}
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
    save_file({**tensors, **(extra_tensors or {})}, file, metadata={"format": "pt"})
