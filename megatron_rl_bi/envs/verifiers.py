"""Exact verifiers: completion text -> reward in {0, 1}. Each raises nothing on bad model output
(that is reward 0); a raise means a bug, which the reward stage counts and scores 0."""

import ast
import re
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


_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def _normalize_number(text: str) -> Fraction | None:
    text = text.replace(",", "").replace("$", "").strip()
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def verify_math(completion: str, answer: str) -> float:
    """The final answer is the last \\boxed{...} if any, else the last number in the completion.
    Numbers compare exactly as fractions (1/2 == 0.5); other answers as stripped strings."""
    boxed = _BOXED.findall(completion)
    if boxed:
        given = boxed[-1]
    else:
        numbers = _NUMBER.findall(completion.replace(",", ""))
        given = numbers[-1] if numbers else ""
    expected_number = _normalize_number(answer)
    if expected_number is not None:
        return float(_normalize_number(given) == expected_number)
    return float(given.strip() == answer.strip())
