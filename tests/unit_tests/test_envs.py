import json

import pytest

from megatron_rl_bi.envs import PromptSource, build_task
from megatron_rl_bi.envs.tokenizer import CharTokenizer, build_tokenizer
from megatron_rl_bi.envs.verifiers import verify_countdown, verify_math, verify_sort


def test_verify_sort():
    assert verify_sort("abcd\nsomething else", "abcd") == 1.0
    assert verify_sort(" abcd ", "abcd") == 1.0
    assert verify_sort("abdc", "abcd") == 0.0
    assert verify_sort("", "abcd") == 0.0


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("3*5+7", 1.0),  # 22
        ("7+5*3", 1.0),
        ("(7+5)*3", 0.0),  # 36
        ("3*5+7+7", 0.0),  # 7 used twice
        ("3*5", 0.0),  # 7 unused
        ("15+7", 0.0),  # not the given numbers
        ("3*5+7 ; import os", 0.0),
        ("3**5+7", 0.0),  # power is not allowed
        ("", 0.0),
        ("(3*5+7", 0.0),  # syntax error
    ],
)
def test_verify_countdown(completion, reward):
    assert verify_countdown(completion, [3, 5, 7], 22) == reward


def test_verify_countdown_division_is_exact():
    assert verify_countdown("8/(3-1)", [8, 3, 1], 4) == 1.0
    assert verify_countdown("7/2+1", [7, 2, 1], 4) == 0.0  # 4.5
    assert verify_countdown("3/(2-2)", [3, 2, 2], 1) == 0.0  # division by zero


def test_verify_math():
    assert verify_math("so the answer is \\boxed{42}.", "42") == 1.0
    assert verify_math("first 3 then 7", "7") == 1.0
    assert verify_math("it is 1/2", "0.5") == 1.0
    assert verify_math("total 1,234", "1234") == 1.0
    assert verify_math("\\boxed{41}", "42") == 0.0
    assert verify_math("no number", "42") == 0.0
    assert verify_math("\\boxed{x+1}", "x+1") == 1.0


def test_built_in_examples_verify_their_own_answer():
    for name in ("sort", "countdown"):
        task = build_task(name, seed=3)
        for index in range(50):
            example = task.example(index)
            assert example.verify(example.answer) == 1.0, (name, example)
            assert example.verify(example.answer + "1") == 0.0


def test_sort_example_is_deterministic():
    a, b = build_task("sort", 3).example(11), build_task("sort", 3).example(11)
    assert a.prompt == b.prompt and a.prompt.startswith("sort: ") and a.prompt.endswith("\n")
    assert sorted(a.prompt[6:-1]) == list(a.answer)


def test_jsonl_reads_and_shuffles_per_epoch(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(4)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    source = PromptSource(build_task("jsonl", 0, str(path)), seed=0)
    first_epoch = [e.prompt for e in source.take(4)]
    assert sorted(first_epoch) == ["q0", "q1", "q2", "q3"]
    assert source.position == 4
    assert source.take(1)[0].verify("answer \\boxed{%s}" % source.task.example(0).answer) in (0.0, 1.0)


def test_jsonl_order_is_reshuffled_each_epoch_and_repeats_with_the_seed(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(20)))
    task = build_task("jsonl", 0, str(path))

    def epochs(seed):
        source = PromptSource(task, seed=seed)
        return [e.prompt for e in source.take(20)], [e.prompt for e in source.take(20)]

    first, second = epochs(7)
    assert sorted(first) == sorted(second) == sorted(f"q{i}" for i in range(20))
    assert first != second and first != [f"q{i}" for i in range(20)]
    assert epochs(7) == (first, second)


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "d.jsonl:2: not JSON"),
        ('["a"]', "d.jsonl:2: expected a JSON object, got list"),
        ('{"prompt": "p"}', "d.jsonl:2: field 'answer' must be a non-empty string"),
        ('{"prompt": 3, "answer": "1"}', "d.jsonl:2: field 'prompt' must be a non-empty string"),
        ('{"prompt": "p", "answer": true}', "d.jsonl:2: field 'answer' must be a non-empty string or a finite number"),
        ('{"prompt": "p", "answer": NaN}', "d.jsonl:2: field 'answer' must be a non-empty string or a finite number"),
        ('{"prompt": "p", "answer": -Infinity}', "d.jsonl:2: field 'answer' must be"),
        ('{"prompt": "p", "answer": [1]}', "d.jsonl:2: field 'answer' must be"),
        ('{"prompt": "p", "answer": ""}', "d.jsonl:2: field 'answer' must be"),
    ],
)
def test_jsonl_malformed_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "p", "answer": "1"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_task("jsonl", 0, str(path))


def test_jsonl_number_answers_are_compared_as_numbers(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "abc", "answer": 3}\n{"prompt": "half", "answer": -0.5}\n'
                    '{"prompt": "big", "answer": 1e21}\n')
    task = build_task("jsonl", 0, str(path))
    assert [e.answer for e in task.examples] == ["3", "-0.5", "1e+21"]
    three, half, big = task.examples
    assert three.verify("so \\boxed{3}") == 1.0 and three.verify("3.5") == 0.0
    assert half.verify("it is -1/2") == 1.0
    assert big.verify("1,000,000,000,000,000,000,000") == 1.0


def test_jsonl_that_is_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "p", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: not UTF-8 \(invalid continuation byte at byte 16"):
        build_task("jsonl", 0, str(path))


def test_jsonl_windows_line_ends_read_as_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "p", "answer": "1"}\r\n\r\n{"prompt": "q", "answer": "2"}\r\n')
    task = build_task("jsonl", 0, str(path))
    assert [e.prompt for e in task.examples] == ["p", "q"] and task.line_numbers == [1, 3]


def test_unknown_task_and_missing_dataset():
    with pytest.raises(ValueError, match="--rl-task jsonl needs --rl-dataset"):
        build_task("jsonl", 0)
    with pytest.raises(ValueError, match="--rl-task poker"):
        build_task("poker", 0)


def test_prompt_source_shards_ranks_and_resumes():
    task = build_task("sort", 1)
    rank0, rank1 = PromptSource(task, 0, rank=0, world_size=2), PromptSource(task, 0, 1, 2)
    a, b = rank0.take(3), rank1.take(3)
    assert [e.prompt for e in a] == [task.example(i).prompt for i in (0, 2, 4)]
    assert [e.prompt for e in b] == [task.example(i).prompt for i in (1, 3, 5)]
    resumed = PromptSource(task, 0, rank=0, world_size=2)
    resumed.load_state_dict(rank0.state_dict())
    assert resumed.take(1)[0].prompt == rank0.take(1)[0].prompt


def test_char_tokenizer_round_trip_and_errors():
    tok = CharTokenizer()
    ids = tok.encode("sort: cab\n")
    assert tok.decode(ids + [tok.eod]) == "sort: cab\n"
    assert tok.vocab_size == 3 + 95 + 1
    with pytest.raises(ValueError, match="outside the char tokenizer"):
        tok.encode("é")
    with pytest.raises(ValueError, match="--rl-tokenizer bpe"):
        build_tokenizer("bpe")


def test_jsonl_prompts_are_checked_before_any_gpu_work(tmp_path):
    from megatron_rl_bi.envs.tasks import JsonlTask

    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1 + 1", "answer": "2"}\n\n{"prompt": "caf\\u00e9", "answer": "x"}\n')
    task = JsonlTask(str(path))
    with pytest.raises(ValueError, match=r"d.jsonl:3: the prompt cannot be tokenized"):
        task.check_prompts(CharTokenizer().encode_prompt, max_tokens=100)
    path.write_text('{"prompt": "1 + 1 = ?", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:1: the prompt is 9 tokens; the engine takes at most 8"):
        JsonlTask(str(path)).check_prompts(CharTokenizer().encode_prompt, max_tokens=8)
    JsonlTask(str(path)).check_prompts(CharTokenizer().encode_prompt, max_tokens=9)
