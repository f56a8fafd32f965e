"""The work every benchmark measures, built once from the flags: the model, its engine, the
requests and a packed trainer batch of the same model."""

import argparse
from dataclasses import dataclass

import torch

from megatron_rl_bi.config.from_args import engine_config_from_args
from megatron_rl_bi.inference import Generator, Sampling
from megatron_rl_bi.models.build import build_model
from megatron_rl_bi.models.logprobs import forward_logprobs
from megatron_rl_bi.packing import PackedBatch, pack_sequences
from megatron_rl_bi.parity.harness import random_requests

TRAIN_SEQUENCE_TOKENS = 512


def add_workload_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("bench workload")
    group.add_argument("--bench-train-tokens", type=int, default=16384)
    group.add_argument("--bench-requests", type=int, default=32)
    group.add_argument("--bench-new-tokens", type=int, default=128)
    group.add_argument("--bench-vocab-size", type=int, default=32000)
    return parser


@dataclass
class Workload:
    model: torch.nn.Module
    generator: Generator
    prompts: list[list[int]]
    batch: PackedBatch

    def train_step(self) -> None:
        """One packed forward+backward (no optimizer)."""
        self.model.train()
        logprobs, _ = forward_logprobs(self.model, self.batch)
        logprobs.sum().backward()
        self.model.zero_grad(set_to_none=True)

    def generate(self, new_tokens: int) -> None:
        self.generator.generate(self.prompts, Sampling(max_new_tokens=new_tokens, seed=0))


def build_workload(args: argparse.Namespace, weights: dict | None = None) -> Workload:
    """The model (with `weights` if given) in the current BI mode; prompts of 64-512 tokens."""
    model = build_model(args, args.bench_vocab_size)
    if weights is not None:
        model.load_state_dict(weights)
    prompts, _ = random_requests(args.bench_requests, (64, 512), (1, 1), args.bench_vocab_size, 0)
    lengths = [TRAIN_SEQUENCE_TOKENS] * (args.bench_train_tokens // TRAIN_SEQUENCE_TOKENS)
    batch = pack_sequences([prompts[i % len(prompts)][:1] * n for i, n in enumerate(lengths)]).to("cuda")
    return Workload(model, Generator(model, engine_config_from_args(args)), prompts, batch)
