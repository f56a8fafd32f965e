"""Exact verifiers: completion text -> reward in {0, 1}. Each raises nothing on bad model output
(that is reward 0); a raise means a bug, which the reward stage counts and scores 0."""

import ast
import re
import string
from fractions import Fraction


def _first_line(completion: str) -> str:
    return completion.split("\n", 1)[0].strip()


def verify_sort(completion: str, answer: str) -> float:
    """The first line must be exactly the sorted letters."""
    return float(_first_line(completion) == answer)


_ALLOWED_NODES = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    left, right = _evaluate(node.left), _evaluate(node.right)
    if isinstance(node.op, ast.Add):
        return left + right
    if isinstance(node.op, ast.Sub):
        return left - right
    if isinstance(node.op, ast.Mult):
        return left * right
    return left / right  # ZeroDivisionError is caught by the caller


def verify_countdown(completion: str, numbers: list[int], target: int) -> float:
    """The first line must be an arithmetic expression (+ - * / and parentheses) that uses each
    given number exactly once and equals the target."""
    expression = _first_line(completion)
    if not expression or not re.fullmatch(r"[\d+\-*/() ]+", expression):
        return 0.0
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        return 0.0
    nodes = list(ast.walk(tree))
    if not all(isinstance(n, _ALLOWED_NODES) for n in nodes):
        return 0.0
    used = sorted(n.value for n in nodes if isinstance(n, ast.Constant))
    if not all(isinstance(v, int) for v in used) or used != sorted(numbers):
        return 0.0
    try:
        return float(_evaluate(tree) == target)
    except ZeroDivisionError:
        return 0.0


_FINAL_PHRASES = re.compile(
    r"(?:final answer|the answer|answer)\s*(?:is|:)\s*(.+?)(?:\.\s|\.$|\n|$)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}|\\[dt]?frac(\d)(\d)")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def _last_braced(text: str, command: str) -> str | None:
    """Content of the last `\\command{...}`, braces balanced (`\\boxed{\\frac{1}{2}}`)."""
    start = text.rfind("\\" + command + "{")
    if start < 0:
        return None
    depth, begin = 0, start + len(command) + 2
    for i in range(begin - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
    return None  # unbalanced: no answer


def final_answer(completion: str) -> str:
    """The answer a completion commits to: the last \\boxed{} (or \\fbox{}), else the text after
    '####', else after 'the answer is' / 'Answer:', else the last number; '' if none."""
    for command in ("boxed", "fbox"):
        if (boxed := _last_braced(completion, command)) is not None:
            return boxed
    if "####" in completion:
        return completion.rsplit("####", 1)[1].strip().split("\n")[0]
    if phrases := _FINAL_PHRASES.findall(completion):
        return phrases[-1]
    numbers = _NUMBER.findall(completion.replace(",", ""))
    return numbers[-1] if numbers else ""


def _normalize(text: str) -> str:
    """LaTeX and formatting noise out: $, \\left/\\right, spacing commands, \\text{}, degrees,
    percent signs, thousands separators, a leading 'x =' and trailing punctuation."""
    text = _TEXT.sub(r"\1", text)
    for noise in ("$", "\\left", "\\right", "\\!", "\\,", "\\;", "\\%", "%", "^\\circ",
                  "^{\\circ}", "\\displaystyle"):
        text = text.replace(noise, "")
    text = re.sub(r"^\s*[a-zA-Z]\s*=\s*", "", text)
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
    return text.strip().rstrip(".").replace(" ", "")


def _as_number(text: str) -> Fraction | None:
    """-3, 0.5, 1/2, \\frac{1}{2}, -\\dfrac{3}{4}, \\frac12 as exact fractions; else None."""
    sign = -1 if text.startswith("-") else 1
    body = text[1:] if sign < 0 else text
    if match := _FRAC.fullmatch(body):
        numerator, denominator = (match.group(1), match.group(2)) if match.group(1) else match.group(3, 4)
        parts = (_as_number(numerator), _as_number(denominator))
        if None in parts or parts[1] == 0:
            return None
        return sign * parts[0] / parts[1]
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def verify_math(completion: str, answer: str) -> float:
    """1 if the completion's final answer equals `answer`: as exact numbers where both are
    numbers (1/2 == 0.5 == \\frac{1}{2}, 1,234 == 1234), else as normalized LaTeX strings."""
    given, expected = _normalize(final_answer(completion)), _normalize(answer)
    if not given:
        return 0.0
    given_number, expected_number = _as_number(given), _as_number(expected)
    if expected_number is not None:
        return float(given_number == expected_number)
    return float(given == expected)


def normalize_answer(text: str) -> str:
    """Search-R1's exact-match normalization: lower case, no punctuation, no articles, single
    spaces."""
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def tagged_answer(text: str) -> str | None:
    """The last <answer>...</answer> of `text`, stripped; None without one."""
    found = re.findall(r"<answer>(.*?)</answer>", text, flags=re.DOTALL)
    return found[-1].strip() if found else None


def verify_exact_match(completion: str, answers: tuple[str, ...]) -> float:
    """1 when the completion's tagged answer (or, untagged, the whole completion) equals one of
    `answers` after normalize_answer."""
    answer = tagged_answer(completion)
    given = normalize_answer(completion if answer is None else answer)
    return float(given in {normalize_answer(a) for a in answers})
