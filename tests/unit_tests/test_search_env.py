"""The built-in search environment (--rl-env search) and the lookup task that needs it (CPU):
BM25 retrieval on a hand-made corpus, the corpus file's errors, Search-R1's answer
normalization, the tags of a conversation, and a scripted engine that follows the lookup task's
demonstration earning its reward through the real conversation loop."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron_rl_bi.config import parse_rl_args
from megatron_rl_bi.envs import Example
from megatron_rl_bi.envs.environment import build_environment
from megatron_rl_bi.envs.search import Retriever, read_corpus, search_environment
from megatron_rl_bi.envs.verifiers import normalize_answer
from megatron_rl_bi.envs.tasks import LookupTask
from megatron_rl_bi.envs.tokenizer import CharTokenizer
from megatron_rl_bi.inference import Generation, Sampling
from megatron_rl_bi.rl.conversations import TurnConfig, run_conversations

from .. import REPO
from .conftest import ScriptedGenerator

CORPUS = ["The Eiffel Tower is in Paris.", "Mount Fuji is the highest mountain in Japan.",
          "Paris is the capital of France.", "The Nile flows through Egypt."]


def test_bm25_returns_the_passage_that_matches_the_query():
    retriever = Retriever(CORPUS)
    assert retriever.search("highest mountain of Japan", 1) == [CORPUS[1]]
    assert retriever.search("capital of France", 2)[0] == CORPUS[2]
    assert len(retriever.search("Paris", 10)) == len(CORPUS)  # k capped at the corpus
    assert retriever.search("the of", 3) == []  # stop words only: nothing to match


def test_the_corpus_file_is_read_with_its_errors_named(tmp_path):
    good = tmp_path / "corpus.jsonl"
    good.write_text(json.dumps({"id": 1, "contents": "a passage"}) + "\n\n" + json.dumps({"text": "another"}) + "\n")
    assert read_corpus(str(good)) == ["a passage", "another"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"title": "no text"}) + "\n")
    with pytest.raises(ValueError, match=f"{bad}:2: a passage needs a non-empty 'contents' or 'text'"):
        read_corpus(str(bad))


def test_answers_compare_after_search_r1_normalization():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("an apple") == "apple"


def test_a_search_conversation_searches_then_answers():
    env = search_environment(Retriever(CORPUS), top_k=1)()
    assert env.reset(Example(prompt="Q: where is the Eiffel Tower?\n", answer="Paris", verify=None)).startswith("Q:")
    observation, reward, done = env.step("I should look. <search>Eiffel Tower</search>")
    assert observation == "\n<information>Doc 1: The Eiffel Tower is in Paris.</information>\n"
    assert (reward, done) == (0.0, False)
    assert env.step("<answer>the paris</answer>")[1:] == (1.0, True)
    assert env.step("<answer>Lyon</answer>")[1:] == (0.0, True)
    assert env.step("no tags at all") == (
        "\nThe last turn took no action. Write one of: <search>query</search> or <answer>answer</answer>.\n",
        0.0, False)  # told so; the conversation goes on


class FollowsTheDemonstration(ScriptedGenerator):
    """Samples the lookup task's demonstration, a turn at a time: through </search>, then the
    answer and end-of-document."""

    config = SimpleNamespace(max_sequence_length=256, max_prompt_tokens=255)

    def __init__(self, task, tokenizer):
        self.task, self.tok = task, tokenizer

    def generate(self, prompts, sampling, max_new_tokens=None):
        out = []
        for prompt in prompts:
            text = self.tok.decode(prompt)
            key = text.split()[1]
            turn = f"<search>{key}</search>" if "<information>" not in text else \
                f"<answer>{self.task.values[key]}</answer>"
            ids = self.tok.encode(turn) + [self.tok.eod]
            out.append(Generation(prompt_tokens=list(prompt), completion_tokens=ids,
                                  completion_logprobs=[-1.0] * len(ids), stopped_on_eod=True))
        return out


def test_the_lookup_task_is_solved_by_searching_as_its_demonstration_does():
    task, tok = LookupTask(seed=3), CharTokenizer()
    assert len(task.corpus) == 4096 and all(" is " in p for p in task.corpus)
    examples = [task.example(i) for i in range(6)]
    environment = build_environment("search", task, search_top_k=1)
    generations, scores, counts = run_conversations(FollowsTheDemonstration(task, tok), examples, environment, tok,
                                                    Sampling(max_new_tokens=40, eod_id=tok.eod), TurnConfig(max_turns=3))
    assert scores == [(1.0, None)] * 6 and counts["turns"] == 12
    # the conversation is the demonstration (the SFT warm-up's target), token for token
    for example, generation in zip(examples, generations):
        assert tok.decode(generation.completion_tokens) == "".join(example.demonstration)


COMMON = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "48", "--num-attention-heads", "4",
          "--seq-length", "64", "--max-position-embeddings", "64", "--train-iters", "1", "--bf16"]


@pytest.mark.parametrize("flags,message", [
    (["--rl-task", "lookup"], "--rl-task lookup needs --rl-env search"),
    (["--rl-env", "search", "--rl-reward-fn", "m:f"], "--rl-reward-fn with --rl-env"),
    (["--rl-search-corpus", "README.md"], "--rl-search-corpus is read by --rl-env search only"),
    (["--rl-env", "search", "--rl-search-corpus", "no_such.jsonl"], "--rl-search-corpus no_such.jsonl: no such file"),
    (["--rl-env", "search", "--rl-env-timeout", "0"], "--rl-env-timeout must be > 0"),
    (["--rl-env", "search", "--rl-env-workers", "0"], "--rl-env-workers must be >= 1, got 0"),
    (["--rl-tool-format", "chat"], "--rl-tool-format chat writes an environment's tool calls: it needs --rl-env"),
    (["--rl-search-url", "http://h:1/retrieve"], "--rl-search-url is read by --rl-env search only"),
    (["--rl-env", "search", "--rl-search-url", "h:1/retrieve"], "--rl-search-url h:1/retrieve: expected an http"),
    (["--rl-env", "search", "--rl-search-url", "http://h:1/r", "--rl-search-corpus", "README.md"],
     "--rl-search-corpus and --rl-search-url: give one"),
    (["--rl-env", "search", "--rl-search-url", "http://h:1/r", "--rl-search-timeout", "0"],
     "--rl-search-timeout must be > 0"),
    (["--rl-env", "search", "--rl-search-url", "http://h:1/r", "--rl-search-retries", "-1"],
     "--rl-search-retries must be >= 0"),
])
def test_search_flags_that_cannot_work_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        parse_rl_args(COMMON + flags)


def test_search_without_a_corpus_names_the_flag():
    with pytest.raises(ValueError, match="--rl-env search needs --rl-search-corpus FILE"):
        build_environment("search", task=SimpleNamespace())


def test_qa_lines_as_published_become_questions_with_every_golden_answer(tmp_path):
    from megatron_rl_bi.envs.tasks import QUESTION_PROMPT, JsonlTask

    path = tmp_path / "nq.jsonl"
    path.write_text(json.dumps({"id": "q1", "question": "where is the eiffel tower", "golden_answers": ["Paris", "Paris, France"]})
                    + "\n" + json.dumps({"question": "capital of egypt", "answer": "Cairo"}) + "\n")
    first, second = JsonlTask(str(path)).examples
    assert first.prompt == QUESTION_PROMPT.format("where is the eiffel tower") and first.accepted == ("Paris", "Paris, France")
    assert first.verify("<answer>paris france</answer>") == 1.0 and first.verify("<answer>Lyon</answer>") == 0.0
    assert second.accepted == ("Cairo",) and second.verify("Cairo.") == 1.0  # untagged: the whole completion
    env = search_environment(Retriever(CORPUS), top_k=1)()
    env.reset(first)
    assert env.step("<answer>Paris, France</answer>")[1] == 1.0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "golden_answers": []}) + "\n")
    with pytest.raises(ValueError, match=f"{bad}:1: field 'golden_answers' .* must be a non-empty"):
        JsonlTask(str(bad))


def test_bm25s_is_imported_without_jax(tmp_path):
    """A JAX that bm25s would import takes 75 % of the GPU at its first op: it must stay unimported.
    The planted JAX imports cleanly (bm25s treats a failing import as no JAX) and writes a file
    when its op runs."""
    op_ran = tmp_path / "op_ran"
    (tmp_path / "jax").mkdir()
    (tmp_path / "jax" / "__init__.py").write_text("")
    (tmp_path / "jax" / "lax.py").write_text(f"def top_k(scores, k):\n    open({str(op_ran)!r}, 'w').close()\n")
    code = ("import sys; from megatron_rl_bi import compat; bm25s = compat.bm25s_without_jax(); "
            "from bm25s import selection; assert not selection.JAX_IS_AVAILABLE; "
            "assert 'jax' not in sys.modules; print('ok')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]
    assert not op_ran.exists()
