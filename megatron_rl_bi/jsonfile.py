"""JSON objects read from files, with errors that say where: FILE:LINE of the bad text."""

import json


def parse_object(text: str, path: str, first_line: int = 1) -> dict:
    """The JSON object `text`, which starts at line `first_line` of `path` (a JSONL record's line
    number; 1 for a whole file)."""
    try:
        value = json.loads(text.rstrip())  # a JSONL line's newline would count as a line
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{first_line + exc.lineno - 1}: not JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}:{first_line}: expected a JSON object, got {type(value).__name__}")
    return value


def read_object(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return parse_object(f.read(), path)
