"""A Hugging Face checkpoint with a published architecture and random weights, written by
`transformers` (nothing downloaded), plus a synthetic tokenizer over the full vocabulary (with a
chat template) and a small JSONL of arithmetic prompts: what the H200 runs of real architectures
import.

  python tools/random_hf_checkpoint.py qwen3-0.6b runs/qwen3_0p6b_config
  -> runs/qwen3_0p6b_config/hf/ (config.json, model.safetensors, tokenizer) and math.jsonl
  python tools/random_hf_checkpoint.py qwen3.5-9b runs/qwen35_9b_8l --num-hidden-layers 8
  -> Qwen3.5-9B's widths at 8 layers (6 GDN, 2 attention)
"""

import argparse
import json
import os
import random

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Published config.json values (Qwen/Qwen3-0.6B, Qwen/Qwen3-4B, Qwen/Qwen3-30B-A3B; Qwen/Qwen3.5-2B's
# and Qwen/Qwen3.5-9B's text_config; Qwen/Qwen3.5-35B-A3B's widths as transformers'
# Qwen3_5MoeTextConfig documents them, its defaults, with the other Qwen3.5 presets' rope and context).
PRESETS = {
    "qwen3-0.6b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "qwen3-4b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "qwen3.5-9b": dict(
        model_type="qwen3_5_text", vocab_size=248320, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=262144,
        rms_norm_eps=1e-6, tie_word_embeddings=False, attn_output_gate=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                         "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                         "mrope_interleaved": True},
    ),
    "qwen3.5-35b-a3b": dict(
        model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        num_experts=256, num_experts_per_tok=8, max_position_embeddings=262144, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attn_output_gate=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                         "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                         "mrope_interleaved": True},
    ),
    "qwen3.5-2b": dict(
        model_type="qwen3_5_text", vocab_size=248320, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=262144,
        rms_norm_eps=1e-6, tie_word_embeddings=True, attn_output_gate=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                         "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                         "mrope_interleaved": True},
    ),
}


def save_tokenizer(path: str, vocab_size: int) -> int:
    """Word-level tokenizer: specials, the words of the prompts, then filler words up to
    `vocab_size` (so every id the model can sample decodes). Returns the eos id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + ["user", "assistant", "what", "is", "+", "?", "answer", "boxed"]
    words += [str(i) for i in range(200)]
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=SPECIALS[0]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(SPECIALS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=SPECIALS[2],
                                        pad_token=SPECIALS[0])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return tokenizer.eos_token_id


def _config(preset: dict, eos_id: int):
    from transformers import AutoConfig

    values = dict(preset)
    return AutoConfig.for_model(values.pop("model_type"), eos_token_id=eos_id, **values)


def save_config(path: str, preset: dict, eos_id: int) -> None:
    _config(preset, eos_id).save_pretrained(path)


def save_model(path: str, preset: dict, eos_id: int, seed: int) -> None:
    from transformers import AutoModelForCausalLM

    config = _config(preset, eos_id)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    print(f"{path}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters")


def save_prompts(path: str, count: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(count):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            f.write(json.dumps({"prompt": f"what is {a} + {b} ? answer boxed", "answer": str(a + b)}) + "\n")


def _depth(layers: int, preset: dict) -> int:
    """--num-hidden-layers, checked: a hybrid's depth keeps whole groups of three GDN layers and
    one attention layer."""
    group = 4 if preset["model_type"] in ("qwen3_5_text", "qwen3_5_moe_text") else 1
    if layers < group or layers % group:
        raise SystemExit(f"--num-hidden-layers {layers}: {preset['model_type']} needs a positive multiple of {group}")
    return layers


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("preset", choices=sorted(PRESETS))
    parser.add_argument("out", help="directory for hf/ and math.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config-only", action="store_true",
                        help="write config.json and the tokenizer, no weights (enough for "
                        "tools/memory_plan.py)")
    parser.add_argument("--num-hidden-layers", type=int, default=None, metavar="N",
                        help="the preset's widths with N layers instead of its own depth (Qwen3.5: "
                        "a multiple of 4, every fourth layer full attention as published): a "
                        "model of the published widths that fits where the full depth does not")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    preset = PRESETS[args.preset]
    if args.num_hidden_layers is not None:
        preset = {**preset, "num_hidden_layers": _depth(args.num_hidden_layers, preset)}
    hf = os.path.join(args.out, "hf")
    eos_id = save_tokenizer(hf, preset["vocab_size"])
    if args.config_only:
        save_config(hf, preset, eos_id)
    else:
        save_model(hf, preset, eos_id, args.seed)
    save_prompts(os.path.join(args.out, "math.jsonl"), 256, args.seed)
    written = "config and tokenizer, no weights" if args.config_only else "random weights, config and tokenizer"
    print(f"{args.preset}: {hf} ({written}, {preset['num_hidden_layers']} layers), "
          f"{os.path.join(args.out, 'math.jsonl')} (256 prompts)", flush=True)


if __name__ == "__main__":
    main()
