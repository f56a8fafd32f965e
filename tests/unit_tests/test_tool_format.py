"""--rl-tool-format chat on CPU: a byte-level BPE tokenizer trained here with a chat template in
Qwen3's manner (tools declared in a system turn, tool answers as <tool_response> in a user turn),
the wrapping it writes around a tool answer, Qwen3's JSON and Qwen3.5's XML calls handed to the
environment as its tag, a whole conversation's tokens and who wrote them (hand-written), and the
refusals, each naming the flag."""

import json
from types import SimpleNamespace

import pytest

from megatron_rl_bi.envs import Example
from megatron_rl_bi.envs.search import SEARCH_TOOL
from megatron_rl_bi.envs.tokenizer import CharTokenizer, HFTokenizer
from megatron_rl_bi.envs.tool_format import build_tool_format, parse_tool_call, tool_message_wrapping
from megatron_rl_bi.inference import Generation, Sampling
from megatron_rl_bi.rl.conversations import TurnConfig, run_conversations

from ..chat_tokenizer import NO_TOOL_TEMPLATE, TOOL_TEMPLATE, save_bpe_tokenizer
from .conftest import ScriptedGenerator

@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return save_bpe_tokenizer(tmp_path_factory.mktemp("bpe"), TOOL_TEMPLATE)


class Lookup:
    """Search for the key; the answer 317 scores 1."""

    stop_strings = ("</search>", "</answer>")
    tools = (SEARCH_TOOL,)

    def reset(self, example):
        self.seen = []
        return example.prompt

    def step(self, text):
        self.seen.append(text)
        if text.endswith("</search>"):
            return "\nDoc 1: b4x is 317\n", 0.0, False
        return "", float(text.endswith("<answer>317</answer>")), True


class ScriptedEngine(ScriptedGenerator):
    """Turn k (k tool answers in the request so far) samples turns[k], then end-of-document."""

    def __init__(self, tok, turns):
        self.tok, self.turns, self.requests = tok, turns, []
        self.config = SimpleNamespace(max_sequence_length=512, max_prompt_tokens=511)

    def generate(self, prompts, sampling, max_new_tokens=None):
        out = []
        for prompt in prompts:
            self.requests.append(list(prompt))
            ids = self.tok.encode(self.turns[self.tok.decode(prompt).count("</tool_response>")]) + [self.tok.eod]
            out.append(Generation(prompt_tokens=list(prompt), completion_tokens=ids,
                                  completion_logprobs=[-1.0] * len(ids), stopped_on_eod=True))
        return out


BEFORE = "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
AFTER = "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_the_wrapping_of_a_tool_answer_is_the_templates(tok):
    assert tool_message_wrapping(tok, (SEARCH_TOOL,)) == (BEFORE, AFTER)


def test_the_prompt_declares_the_tools_the_templates_way(tok):
    prompt = tok._tok.decode(build_tool_format("chat", tok, Lookup).prompt("find b4x"))
    assert prompt == ("<|im_start|>system\nTools:\n" + json.dumps(SEARCH_TOOL) + "\nCall one as <tool_call>"
                      "{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\n"
                      "<|im_start|>user\nfind b4x<|im_end|>\n<|im_start|>assistant\n")
    # the tags format keeps the plain prompt (no tools declared)
    assert tok._tok.decode(build_tool_format("tags", tok, Lookup).prompt("find b4x")) == (
        "<|im_start|>user\nfind b4x<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("body,parsed", [
    ('{"name": "search", "arguments": {"query": "b4x"}}', ("search", {"query": "b4x"})),
    ('{"name": "search", "arguments": "{\\"query\\": \\"b4x\\"}"}', ("search", {"query": "b4x"})),
    ("<function=search>\n<parameter=query>\nb4x\n</parameter>\n</function>", ("search", {"query": "b4x"})),
    ('{"name": "search", "arguments": {"query": "b4x"}', None),
    ('["search"]', None),
    ('{"arguments": {"query": "b4x"}}', None),
    ('{"name": "search", "arguments": [1]}', None),
])
def test_tool_calls_parse_in_json_and_xml_or_not_at_all(body, parsed):
    assert parse_tool_call(body) == parsed


@pytest.mark.parametrize("text,action", [
    ('hm <tool_call>\n{"name": "search", "arguments": {"query": "b4x"}}\n</tool_call>', "hm <search>b4x</search>"),
    ("<tool_call>\n<function=search>\n<parameter=query>\nb4x\n</parameter>\n</function>\n</tool_call>",
     "<search>b4x</search>"),
    ('<tool_call>{"name": "browse", "arguments": {"query": "b4x"}}</tool_call>',  # no such tool
     '<tool_call>{"name": "browse", "arguments": {"query": "b4x"}}</tool_call>'),
    ('<tool_call>{"name": "search", "arguments": {"q": "b4x"}}</tool_call>',  # not its argument
     '<tool_call>{"name": "search", "arguments": {"q": "b4x"}}</tool_call>'),
    ("<search>b4x</search>", "<search>b4x</search>"),  # tags written directly pass
    ("<answer>317</answer>", "<answer>317</answer>"),
])
def test_a_call_reaches_the_environment_as_its_tag(tok, text, action):
    assert build_tool_format("chat", tok, Lookup).action(text) == action


def test_a_chat_conversation_keeps_who_wrote_each_token(tok):
    call = '<tool_call>\n{"name": "search", "arguments": {"query": "b4x"}}\n</tool_call>'
    engine = ScriptedEngine(tok, [call, "<answer>317</answer>"])
    example = Example(prompt="find b4x", answer="317", verify=None)
    [conversation], [score], counts = run_conversations(
        engine, [example], Lookup, tok, Sampling(max_new_tokens=64, eod_id=tok.eod),
        TurnConfig(max_turns=3, tool_format="chat"))
    turn1, answer = tok.encode(call), tok.encode("Doc 1: b4x is 317")
    written = tok.encode(BEFORE) + answer + tok.encode(AFTER)
    turn2 = tok.encode("<answer>317</answer>")
    # each turn kept through its stop string (its end-of-document dropped); between them the
    # template's tool message with the environment's answer
    assert conversation.completion_tokens == turn1 + written + turn2
    assert conversation.completion_sampled == [True] * len(turn1) + [False] * len(written) + [True] * len(turn2)
    assert score == (1.0, None) and counts["turns"] == 2
    # the second turn continued the same tokens; the environment saw the call as its tag
    assert engine.requests[1] == conversation.prompt_tokens + turn1 + written
    assert tok._tok.decode(conversation.prompt_tokens).startswith("<|im_start|>system\nTools:")


def test_the_answer_is_cut_to_its_budget_inside_the_wrapping(tok):
    turns = build_tool_format("chat", tok, Lookup)
    cut = turns.observation("Doc 1: b4x is 317", 3)
    assert cut == tok.encode(BEFORE) + tok.encode("Doc 1: b4x is 317")[:3] + tok.encode(AFTER)


class NoTools(Lookup):
    tools = ()


class TwoArguments(Lookup):
    tools = ({"type": "function", "function": {"name": "search", "parameters": {"required": ["query", "k"]}}},)


def test_what_chat_cannot_do_is_refused_naming_the_flag(tmp_path, tok):
    with pytest.raises(ValueError, match="--rl-tool-format chat needs a tokenizer with a chat template"):
        build_tool_format("chat", CharTokenizer(), Lookup)
    with pytest.raises(ValueError, match="--rl-tool-format chat: the environment NoTools declares no `tools`"):
        build_tool_format("chat", tok, NoTools)
    with pytest.raises(ValueError, match="--rl-tool-format chat: tool 'search' must have exactly one required"):
        build_tool_format("chat", tok, TwoArguments)
    no_tool_messages = save_bpe_tokenizer(tmp_path, NO_TOOL_TEMPLATE)
    with pytest.raises(ValueError, match="--rl-tool-format chat: the tokenizer's chat template does not render a tool"):
        build_tool_format("chat", no_tool_messages, Lookup)


def test_the_chat_cases_tokenizer_is_this_ones_and_renders_tool_turns(tmp_path):
    """tests/functional_tests/assets/chat_tokenizer (gpt_tiny/conversation_chat) is what
    tests/chat_tokenizer.py writes, and --rl-tool-format chat takes it."""
    import pathlib

    asset = pathlib.Path(__file__).resolve().parents[1] / "functional_tests" / "assets" / "chat_tokenizer"
    save_bpe_tokenizer(tmp_path, TOOL_TEMPLATE)
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (asset / name).read_text() == (tmp_path / name).read_text()
    environment = type("Search", (), {"stop_strings": ("</search>", "</answer>"), "tools": (SEARCH_TOOL,)})
    turns = build_tool_format("chat", HFTokenizer(str(asset)), environment)
    assert turns.before and turns.after
