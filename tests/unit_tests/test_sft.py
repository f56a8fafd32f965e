"""The SFT warm-up's target (CPU): a demonstration's environment answers are context, with no
loss, as in RL; an answer alone is all target."""

from megatron_rl_bi.envs.tasks import Example, LookupTask
from megatron_rl_bi.envs.tokenizer import CharTokenizer
from megatron_rl_bi.packing import pack_completions
from megatron_rl_bi.rl.sft import demonstration


def test_a_demonstrations_environment_answer_is_context():
    tok = CharTokenizer()
    example = Example(prompt="find b4x\n", answer="317", verify=None,
                      demonstration=("<search>b4x</search>", "\n<information>Doc 1: b4x is 317</information>\n",
                                     "<answer>317</answer>"))
    target = demonstration(example, tok)
    search, information, answer = (len(t) for t in example.demonstration)  # one character a token
    assert target.completion_sampled == [True] * search + [False] * information + [True] * (answer + 1)
    assert target.completion_tokens[-1] == tok.eod
    # the loss's positions predict the model's tokens only: 20 + 20 + end-of-document
    batch = pack_completions([target]).batch
    assert int(batch.completion.sum()) == search + answer + 1 == 41
    predicted = batch.target_ids[batch.completion].tolist()
    assert tok.decode([t for t in predicted if t != tok.eod]) == "<search>b4x</search><answer>317</answer>"


def test_an_answer_alone_is_all_target():
    tok = CharTokenizer()
    target = demonstration(Example(prompt="sort: cab\n", answer="abc", verify=None), tok)
    assert target.completion_tokens == tok.encode("abc") + [tok.eod] and all(target.completion_sampled)
    assert int(pack_completions([target]).batch.completion.sum()) == 4


def test_the_lookup_tasks_demonstration_shows_the_search_environments_answer():
    example = LookupTask(seed=0).example(0)
    key, value = example.prompt.split()[1], example.answer
    assert example.demonstration == (f"<search>{key}</search>", f"\n<information>Doc 1: {key} is {value}</information>\n",
                                     f"<answer>{value}</answer>")


def test_a_chat_format_runs_demonstration_is_written_as_its_conversations_are(tmp_path):
    """--rl-tool-format chat: the warm-up's prompt declares the tools, the model's search is the
    template's tool call (which the run reads back as the search), the environment's answer is
    the tool message, and only the model's turns are targets. (In the environment's tags the
    model would learn calls that a chat-format run never reads.)"""
    from megatron_rl_bi.envs.search import SearchEnvironment
    from megatron_rl_bi.envs.tool_format import build_tool_format

    from ..chat_tokenizer import TOOL_TEMPLATE, save_bpe_tokenizer

    tok = save_bpe_tokenizer(tmp_path, TOOL_TEMPLATE)
    turns = build_tool_format("chat", tok, SearchEnvironment)
    example = LookupTask(seed=0).example(0)
    search, information, answer = example.demonstration
    target = demonstration(example, tok, turns, observation_tokens=512)
    assert target.prompt_tokens == turns.prompt(example.prompt) != tok.encode_prompt(example.prompt)
    call = tok.decode(target.completion_tokens[: target.completion_sampled.index(False)])
    assert "<tool_call>" in call and turns.action(call) == search
    observation = turns.observation(information, 512)
    first = target.completion_sampled.index(False)
    assert target.completion_tokens[first:first + len(observation)] == observation
    assert not any(target.completion_sampled[first:first + len(observation)])
    assert all(target.completion_sampled[first + len(observation):])
    # the tags format: the demonstration's own text, as without a format
    tags = build_tool_format("tags", tok, SearchEnvironment)
    assert demonstration(example, tok, tags) == demonstration(example, tok)
