"""Writes a seeded set of small terminal tasks (file and text manipulation) in
envs/terminal.py's layout: each line an instruction, the files it starts with, a test script
(kept from the model until scoring) and a reference solution, one shell command.

  python tools/terminal_tasks.py --count 48 --seed 0 --output examples/tasks/terminal_tiny.jsonl

The instructions are short (the tiny recipe's character tokenizer and 256-token context) and
name their files, which each task draws at random, so a model must read the instruction rather
than repeat a command it has seen.
"""

import argparse
import json
import random
import string

WORDS = ("ant", "bee", "cat", "dog", "elk", "fox", "gnu", "hen", "owl", "pig", "ram", "yak")


def _name(rng: random.Random) -> str:
    return rng.choice(string.ascii_lowercase) + rng.choice(string.ascii_lowercase)


def _lines(rng: random.Random) -> list[str]:
    return rng.sample(WORDS, rng.randint(3, 5))


def _text(lines: list[str]) -> str:
    return "".join(f"{line}\n" for line in lines)


def _expect(path: str, text: str) -> str:
    """A test script: `path` holds exactly `text` (letters, digits and newlines: printf's format)."""
    return f"printf '{text.replace(chr(10), chr(92) + 'n')}' | cmp -s - {path}\n"


def _task(rng: random.Random) -> dict:
    source, target = _name(rng), _name(rng)
    while target == source:
        target = _name(rng)
    lines = _lines(rng)
    kind = rng.choice(("sort", "first", "last", "count", "copy", "upper", "grep", "reverse"))
    if kind == "sort":
        want, instruction, solution = _text(sorted(lines)), f"sort {source} into {target}", f"sort {source} > {target}"
    elif kind == "first":
        want, instruction, solution = _text(lines[:1]), f"first line of {source} into {target}", f"head -1 {source} > {target}"
    elif kind == "last":
        want, instruction, solution = _text(lines[-1:]), f"last line of {source} into {target}", f"tail -1 {source} > {target}"
    elif kind == "count":
        want, instruction, solution = f"{len(lines)}\n", f"count lines of {source} into {target}", f"wc -l < {source} > {target}"
    elif kind == "copy":
        want, instruction, solution = _text(lines), f"copy {source} to {target}", f"cp {source} {target}"
    elif kind == "upper":
        want = _text([line.upper() for line in lines])
        instruction, solution = f"uppercase {source} into {target}", f"tr a-z A-Z < {source} > {target}"
    elif kind == "grep":
        letter = rng.choice(sorted(set("".join(lines))))
        want = _text([line for line in lines if letter in line])
        instruction, solution = f"lines of {source} with {letter} into {target}", f"grep {letter} {source} > {target}"
    else:
        want, instruction, solution = _text(lines[::-1]), f"reverse {source} into {target}", f"tac {source} > {target}"
    return {"instruction": f"{instruction}\n", "files": {source: _text(lines)},
            "tests": {"check.sh": _expect(target, want)}, "test": "sh .tests/check.sh",
            "solution": solution, "seconds": 10}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, required=True, help="tasks to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", required=True, help="the JSONL file to write")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.count < 1:
        parser.error(f"--count must be >= 1, got {args.count}")
    rng = random.Random(f"terminal-tasks-{args.seed}")
    with open(args.output, "w", encoding="utf-8") as f:
        for _ in range(args.count):
            f.write(json.dumps(_task(rng)) + "\n")
    print(f"wrote {args.count} tasks to {args.output}")


if __name__ == "__main__":
    main()
