"""Writes the built-in lookup task's corpus (`--rl-task lookup`, its passages in the task's order)
as a retrieval server's JSONL, so the tiny search recipe can run through a server
(tools/retrieval_server.py) with the passages it searches in-process:

  python tools/lookup_corpus.py --seed 1234 --output runs/lookup_corpus.jsonl
  python tools/retrieval_server.py --corpus runs/lookup_corpus.jsonl --port 8000 &
  torchrun --standalone --nproc-per-node 1 pretrain_rl.py --recipe examples/recipes/tiny_lookup.yaml \
      --batch-invariant-mode --flash-attention-version 4 --rl-search-url http://127.0.0.1:8000/retrieve

A document's id is its line's index, as the in-process index numbers its passages, so both
retrievers rank the same passages the same way.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rl_bi.envs.tasks import LookupTask  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, required=True, help="the run's --seed (the recipe's: 1234)")
    parser.add_argument("--output", required=True, help="the JSONL to write")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    passages = LookupTask(args.seed).corpus
    with open(args.output, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"contents": passage}) + "\n" for passage in passages)
    print(f"{args.output}: {len(passages)} passages of the lookup task's corpus (seed {args.seed})")


if __name__ == "__main__":
    main()
