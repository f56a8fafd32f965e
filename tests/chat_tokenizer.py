"""A byte-level BPE tokenizer with a chat template in Qwen3's manner (tools declared in a system
turn, tool answers as <tool_response> in a user turn), trained here on a few lines: what the
chat tool-format tests and the functional case gpt_tiny/conversation_chat (out until its golden
values are regenerated: docs/testing.md) run (nothing is
downloaded). `python -m tests.chat_tokenizer DIR` writes it (the case's copy:
tests/functional_tests/assets/chat_tokenizer)."""

import sys

from megatron_rl_bi.envs.tokenizer import HFTokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Written for this test after the layout of Qwen3's template (not its text).
TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}"
    "{%- endfor %}{{- '\\nCall one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
NO_TOOL_TEMPLATE = ("{%- for m in messages if m.role != 'tool' %}{{- '<|im_start|>' + m.role + '\\n' + m.content "
                    "+ '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                    "{%- endif %}")


def save_bpe_tokenizer(path, template: str) -> HFTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = ["<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"b4x\"}}\n</tool_call>",
              "<tool_response>\nDoc 1: b4x is 317\n</tool_response>", "find b4x <answer>317</answer>"]
    backend.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(path))
    return HFTokenizer(str(path))


if __name__ == "__main__":
    save_bpe_tokenizer(sys.argv[1], TOOL_TEMPLATE)
