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


def read_jsonl(path: str) -> list[dict]:
    """The objects of a JSON Lines file, one a line (blank lines skipped). A file that is one JSON
    document over several lines (a report, pretty-printed) is named as such, not as a bad line."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    records = []
    for number, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 and the like may sit in a string
        if not line.strip():
            continue
        try:
            records.append(parse_object(line, path, number))
        except ValueError:
            if number == 1 and _one_document(text):
                raise ValueError(f"{path}: one JSON document over several lines, not JSON Lines (one "
                                 "object a line, as --rl-metrics-jsonl writes)") from None
            raise
    return records


def _one_document(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
