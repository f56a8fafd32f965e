"""How a conversation's tool turns are written in tokens (--rl-tool-format).

`tags`: Search-R1's format. The model writes the environment's own tags (`<search>query</search>`)
and the environment's answer follows as plain text in the same assistant turn.

`chat`: the tokenizer's chat template's tool calling, for checkpoints trained on it (Qwen's).
The prompt declares the environment's tools (its `tools`, function schemas, given to the
template as `tools`). The model calls one as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(Qwen3) or `<tool_call><function=NAME><parameter=ARG>...</parameter></function></tool_call>`
(Qwen3.5). The environment's answer is written exactly as the template renders a `tool` message
after the assistant's turn, and the next assistant turn is opened. A call reaches the environment
as its tag (`<search>query</search>`: a tool's name is its tag, its one required argument the
tag's text), so one environment serves both formats; tags written directly still work.

Either way tokens stay tokens: the template's wrapping and the answer are encoded once, apart,
and nothing sampled is encoded again.
"""

import json
import re

# The call the turn ends with (the stop string "</tool_call>" cut it there).
_CALL_AT_END = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>\s*$", re.S)
_XML_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)
# Texts no template writes, to find where a rendered message's content sits.
_ASSISTANT_MARK, _TOOL_MARK = "\u2063assistant-turn\u2063", "\u2063tool-answer\u2063"


class TagTurns:
    """--rl-tool-format tags: the environment's tags as they are."""

    def __init__(self, tokenizer, environment: type):
        self.tokenizer, self.stop_strings = tokenizer, tuple(environment.stop_strings)

    def prompt(self, observation: str) -> list[int]:
        return self.tokenizer.encode_prompt(observation)

    def action(self, text: str) -> str:
        return text

    def demonstrated(self, text: str) -> str:
        """A demonstration's model turn (written in the environment's tags) as the model would
        write it in this format: what `action` reads back as `text`."""
        return text

    def observation(self, text: str, max_tokens: int) -> list[int]:
        return self.tokenizer.encode_observation(text)[:max_tokens]


class ChatTemplateTurns(TagTurns):
    """--rl-tool-format chat: the tokenizer's chat template's tool calls and tool messages."""

    def __init__(self, tokenizer, environment: type):
        super().__init__(tokenizer, environment)
        self.tools = tuple(environment.tools)
        self.arguments = {tool_name(tool): tag_argument(tool) for tool in self.tools}
        self.stop_strings += ("</tool_call>",)
        before, after = tool_message_wrapping(tokenizer, self.tools)
        self.before, self.after = tokenizer.encode(before), tokenizer.encode(after)

    def prompt(self, observation: str) -> list[int]:
        return self.tokenizer.encode_prompt(observation, tools=self.tools)

    def action(self, text: str) -> str:
        """The turn with the tool call it ends with written as the tool's tag; a call that does
        not parse, or names no tool of the environment, is left as it is (the environment then
        says the turn took no action)."""
        call = _CALL_AT_END.search(text)
        parsed = call and parse_tool_call(call.group(1))
        if not parsed or parsed[0] not in self.arguments:
            return text
        name, arguments = parsed
        value = arguments.get(self.arguments[name])
        if not isinstance(value, str):
            return text
        return f"{text[:call.start()]}<{name}>{value}</{name}>"

    def demonstrated(self, text: str) -> str:
        """The tool's tag the turn ends with as the template's call (Qwen3's JSON form)."""
        for name, argument in self.arguments.items():
            tag = re.search(rf"<{re.escape(name)}>(.*?)</{re.escape(name)}>\s*$", text, re.S)
            if tag:
                call = json.dumps({"name": name, "arguments": {argument: tag.group(1)}})
                return f"{text[:tag.start()]}<tool_call>\n{call}\n</tool_call>"
        return text

    def observation(self, text: str, max_tokens: int) -> list[int]:
        """The answer (at most `max_tokens` of it) inside the template's tool message, then the
        next assistant turn's opening."""
        return self.before + self.tokenizer.encode_observation(text.strip("\n"))[:max_tokens] + self.after


def parse_tool_call(body: str) -> tuple[str, dict] | None:
    """(name, arguments) of a call's body, JSON or XML form; None when it is neither."""
    function = _XML_FUNCTION.fullmatch(body.strip())
    if function:
        return function.group(1), dict(_XML_PARAMETER.findall(function.group(2)))
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return (call["name"], arguments) if isinstance(arguments, dict) else None


def tool_name(tool: dict) -> str:
    return tool["function"]["name"]


def tag_argument(tool: dict) -> str:
    """The one required argument of a tool schema: the text of its tag."""
    required = tool["function"].get("parameters", {}).get("required", [])
    if len(required) != 1:
        raise ValueError(f"--rl-tool-format chat: tool {tool_name(tool)!r} must have exactly one required "
                         f"argument (its tag's text), it has {required}")
    return required[0]


def tool_message_wrapping(tokenizer, tools: tuple[dict, ...]) -> tuple[str, str]:
    """The text the chat template writes around a tool message that follows an assistant turn:
    (before it: the assistant turn's end and the tool message's start; after it: the tool
    message's end and the next assistant turn's opening)."""
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _ASSISTANT_MARK},
                {"role": "tool", "content": _TOOL_MARK}]
    try:
        text = tokenizer.render_chat(messages, tools=tools)
    except Exception as exc:  # noqa: BLE001 - a template's own error, reported with the flag
        raise ValueError(f"--rl-tool-format chat: the tokenizer's chat template cannot render a tool "
                         f"message ({type(exc).__name__}: {exc})") from exc
    if text.count(_ASSISTANT_MARK) != 1 or text.count(_TOOL_MARK) != 1:
        raise ValueError("--rl-tool-format chat: the tokenizer's chat template does not render a tool "
                         "message after an assistant turn; use --rl-tool-format tags")
    return tuple(text.split(_ASSISTANT_MARK)[1].split(_TOOL_MARK))


def build_tool_format(name: str, tokenizer, environment: type) -> TagTurns:
    """The turn format --rl-tool-format names, for `environment` (a ValueError naming the flag
    when the tokenizer or the environment cannot do it)."""
    if name == "tags":
        return TagTurns(tokenizer, environment)
    if name != "chat":
        raise ValueError(f"--rl-tool-format {name}: expected 'tags' or 'chat'")
    if not getattr(tokenizer, "uses_chat_template", False):
        raise ValueError("--rl-tool-format chat needs a tokenizer with a chat template (--rl-tokenizer "
                         "hf:PATH, without --rl-no-chat-template)")
    if not getattr(environment, "tools", None):
        raise ValueError(f"--rl-tool-format chat: the environment {environment.__name__} declares no "
                         "`tools` (function schemas, one per tag)")
    return ChatTemplateTurns(tokenizer, environment)
