"""Tokenizers: a built-in character tokenizer (no download) and a Hugging Face wrapper.

Both expose what the RL loop needs: `encode(text) -> ids`, `encode_prompt(text) -> ids` (a task
prompt as the model expects it: through the chat template where there is one),
`encode_observation(text) -> ids` (an environment's answer: any text), `decode(ids) -> text`,
`eod`, `vocab_size`.
"""

import os

_SPECIALS = ("<pad>", "<bos>", "<eos>")
_CHARS = [chr(code) for code in range(32, 127)] + ["\n"]


class CharTokenizer:
    """One id per printable ASCII character and newline, after <pad>, <bos>, <eos>."""

    def __init__(self):
        self.vocab = list(_SPECIALS) + _CHARS
        self._ids = {char: i for i, char in enumerate(self.vocab)}
        self.pad, self.bos, self.eod = 0, 1, 2

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        unknown = sorted({c for c in text if c not in self._ids})
        if unknown:
            raise ValueError(f"characters outside the char tokenizer's vocabulary: {unknown}")
        return [self._ids[c] for c in text]

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)

    def encode_observation(self, text: str) -> list[int]:
        """An environment's answer, which no dataset check has seen (a command's tab, a program's
        U+FFFD): characters outside the vocabulary read as '?', not a failed sample."""
        return [self._ids.get(c, self._ids["?"]) for c in text]

    def decode(self, ids: list[int]) -> str:
        """Specials decode to nothing; ids past the vocabulary (the model's padded rows) to
        U+FFFD, so a completion that samples them fails verification instead of the run."""
        return "".join(
            self.vocab[i] if i < len(self.vocab) else "\ufffd"
            for i in ids
            if not 0 <= i < len(_SPECIALS)
        )


class HFTokenizer:
    """A Hugging Face tokenizer from a local path (needs `transformers`). Prompts go through the
    tokenizer's chat template as one user turn with the assistant turn opened, unless
    `chat_template` is False (base models) or the tokenizer has none."""

    def __init__(self, path: str, chat_template: bool = True):
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise ImportError("--rl-tokenizer hf:PATH needs `pip install transformers`") from exc
        self._tok = AutoTokenizer.from_pretrained(path)
        if self._tok.eos_token_id is None:
            raise ValueError(f"tokenizer at {path} has no eos token")
        self.eod = self._tok.eos_token_id
        self.uses_chat_template = chat_template and bool(self._tok.chat_template)

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    encode_observation = encode  # a byte-level vocabulary encodes any text

    def encode_prompt(self, text: str, tools: tuple[dict, ...] | None = None) -> list[int]:
        """`tools` (function schemas) are declared the template's way (--rl-tool-format chat)."""
        if not self.uses_chat_template:
            return self.encode(text)
        return self.encode(self.render_chat([{"role": "user", "content": text}], tools))

    def render_chat(self, messages: list[dict], tools: tuple[dict, ...] | None = None) -> str:
        """The chat template's text for `messages`, with the assistant's next turn opened."""
        return self._tok.apply_chat_template(messages, tools=list(tools) if tools else None,
                                             add_generation_prompt=True, tokenize=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def build_tokenizer(spec: str, chat_template: bool = True):
    """'char' or 'hf:PATH' (the --rl-tokenizer flag); `chat_template` False is
    --rl-no-chat-template."""
    if spec == "char":
        return CharTokenizer()
    if spec.startswith("hf:"):
        if not os.path.isdir(spec[3:]):  # else transformers reads it as a Hub repo id
            raise ValueError(f"--rl-tokenizer {spec}: no such directory (a local tokenizer directory)")
        return HFTokenizer(spec[3:], chat_template)
    raise ValueError(f"--rl-tokenizer {spec}: expected 'char' or 'hf:PATH'")
