"""The JSONL task's math verifier on hand-written completions: where the final answer is taken
from, and which forms of the same answer count as equal."""

import pytest

from megatron_rl_bi.envs.verifiers import final_answer, verify_math

CORRECT = [
    # (completion, reference answer)
    ("so the answer is \\boxed{42}.", "42"),
    ("\\boxed{41} is wrong, I fix it: \\boxed{42}", "42"),
    ("first 3 then 7", "7"),
    ("it is 1/2", "0.5"),
    ("total 1,234", "1234"),
    ("\\boxed{1,234}", "1234"),
    ("\\boxed{\\frac{1}{2}}", "1/2"),
    ("\\boxed{\\dfrac{3}{4}}", "0.75"),
    ("\\boxed{\\tfrac{3}{4}}", "\\frac{3}{4}"),
    ("\\boxed{\\frac12}", "0.5"),
    ("\\boxed{-\\frac{2}{3}}", "-2/3"),
    ("\\boxed{-5}", "-5"),
    ("the result is -5", "-5"),
    ("\\boxed{x = 3}", "3"),
    ("\\boxed{3.0}", "3"),
    ("\\boxed{50\\%}", "50"),
    ("\\boxed{90^\\circ}", "90"),
    ("\\boxed{\\text{12}}", "12"),
    ("$\\boxed{7}$", "7"),
    ("\\boxed{\\left(1, 2\\right)}", "(1,2)"),
    ("\\boxed{x+1}", "x+1"),
    ("\\boxed{x + 1}", "x+1"),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}"),
    ("reasoning...\n#### 72", "72"),
    ("The answer is 18.", "18"),
    ("Answer: 3/4\n", "\\frac{3}{4}"),
    ("Final answer: 10", "10"),
    ("\\fbox{9}", "9"),
    ("\\boxed{\\frac{-1}{4}}", "-0.25"),
]
WRONG = [
    ("\\boxed{41}", "42"),
    ("no number here", "42"),
    ("\\boxed{0.333}", "1/3"),  # exact comparison: a rounded decimal is not the fraction
    ("\\boxed{\\frac{1}{0}}", "1"),
    ("\\boxed{x+2}", "x+1"),
    ("#### 71", "72"),
    ("the answer is 5 but the \\boxed{6}", "5"),  # the boxed answer wins
    ("", "0"),
    ("\\boxed{}", "0"),
]


@pytest.mark.parametrize("completion,answer", CORRECT)
def test_equal_answers(completion, answer):
    assert verify_math(completion, answer) == 1.0


@pytest.mark.parametrize("completion,answer", WRONG)
def test_wrong_answers(completion, answer):
    assert verify_math(completion, answer) == 0.0


def test_unbalanced_box_falls_back_to_the_last_number():
    assert final_answer("\\boxed{42") == "42"


def test_where_the_final_answer_comes_from():
    assert final_answer("a \\boxed{1} b \\boxed{\\frac{2}{3}}") == "\\frac{2}{3}"
    assert final_answer("steps 1, 2\n#### 3\nmore") == "3"
    assert final_answer("So the answer is 4. Then 5") == "4"
    assert final_answer("nothing") == ""
