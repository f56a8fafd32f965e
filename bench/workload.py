"""The work every benchmark measures, built once from the flags: the model with Megatron's DDP
and optimizer, its engine, the requests, a packed trainer batch, and the RL update."""

import argparse
import gc
import json
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

from bench.report import positive_int
from megatron_rl_bi.config import (
    parse_args,
    print_arguments,
    validate_batch_invariance,
    validate_installed_kernels,
)
from megatron_rl_bi.config.from_args import engine_config_from_args
from megatron_rl_bi.distributed import initialize_distributed
from megatron_rl_bi.inference import Generator, Sampling
from megatron_rl_bi.models.build import build_model
from megatron_rl_bi.models.logprobs import forward_logprobs
from megatron_rl_bi.optimizer import build_ddp_and_optimizer
from megatron_rl_bi.packing import PackedBatch, pack_sequences
from megatron_rl_bi.parity.harness import random_requests, run_parity
from megatron_rl_bi.reporting.provenance import provenance
from megatron_rl_bi.rl.rollouts import Rollout
from megatron_rl_bi.rl.step import StepConfig, train_on_rollouts

TRAIN_SEQUENCE_TOKENS = 512
PARITY_REQUESTS, PARITY_NEW_TOKENS = 8, 32


def add_workload_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("bench workload")
    group.add_argument("--bench-train-tokens", type=positive_int, default=16384)
    group.add_argument("--bench-requests", type=positive_int, default=32)
    group.add_argument("--bench-new-tokens", type=positive_int, default=128)
    group.add_argument("--bench-prompt-tokens", type=positive_int, nargs=2, default=[64, 512], metavar=("MIN", "MAX"),
                       help="prompt lengths, mixed uniformly (MIN = MAX: every request decodes at that "
                            "context; e.g. 4096 4096 for the KV-bound decode of long responses)")
    group.add_argument("--bench-vocab-size", type=positive_int, default=32000)
    group.add_argument("--bench-default-first", action="store_true",
                       help="measure default mode before BI mode (bench/suite.py --rounds alternates the "
                            "order, so a machine's drift does not fall on one mode)")
    group.add_argument("--bench-mode", choices=("both", "bi", "default"), default="both",
                       help="'bi' or 'default': that mode alone (bench/suite.py runs each mode in a process "
                            "of its own, the second on the first's weights: nothing of the first is left "
                            "to the second, where a MoE model's first mode kept 25 GiB on an H100)")
    group.add_argument("--bench-weights", default=None, metavar="FILE",
                       help="the model's weights from FILE (as --bench-save-weights wrote them), not a "
                            "fresh initialization")
    group.add_argument("--bench-save-weights", default=None, metavar="FILE",
                       help="the model's weights to FILE after the last mode, for --bench-weights")
    parser.set_defaults(lr=1e-6)  # the optimizer needs one; the update's speed does not depend on it
    return parser


@dataclass
class Workload:
    model: torch.nn.Module
    ddp: torch.nn.Module | None  # None (and no optimizer) where the bench measures the engine alone
    optimizer: object
    generator: Generator
    prompts: list[list[int]]
    batch: PackedBatch

    @property
    def trains(self) -> bool:
        return self.ddp is not None

    def train_step(self) -> None:
        """One packed forward+backward (no optimizer)."""
        self.ddp.train()
        logprobs, _ = forward_logprobs(self.ddp, self.batch)
        logprobs.sum().backward()
        self.ddp.zero_grad_buffer()

    def rollouts(self, new_tokens: int) -> list[Rollout]:
        """The requests' generations scored in pairs (advantages -1 and +1), as a GRPO step
        receives them."""
        generations = self.generator.generate(self.prompts, Sampling(max_new_tokens=new_tokens, seed=0))
        return [Rollout(g, reward=float(i % 2), group_id=i // 2, weight_version=0,
                        advantage=1.0 if i % 2 else -1.0) for i, g in enumerate(generations)]

    def rl_update(self, rollouts: list[Rollout]) -> None:
        """The RL step's update: packing, trainer logprobs, loss, backward, optimizer step."""
        train_on_rollouts(self.ddp, self.optimizer, rollouts, StepConfig(micro_batch_tokens=16384))

    def generate(self, new_tokens: int) -> None:
        self.generator.generate(self.prompts, Sampling(max_new_tokens=new_tokens, seed=0))

    def parity_max(self) -> float:
        """The largest |engine - trainer| logprob over a few requests (0 in BI mode): a speed-up
        that changes one side's bits fails the bench."""
        prompts = self.prompts[:PARITY_REQUESTS]
        result = run_parity(self.model, self.generator, prompts, [PARITY_NEW_TOKENS] * len(prompts),
                            Sampling(seed=0), micro_batch_tokens=16384, orders=1)
        return result["all_reported"]["bit_wise/logprob_diff/max"]


def build_workload(args: argparse.Namespace, weights: dict | None = None, trains: bool = True) -> Workload:
    """The model (with `weights` if given) in the current BI mode, wrapped in Megatron's DDP
    with its optimizer unless it does not `trains`; prompts of --bench-prompt-tokens."""
    low, high = args.bench_prompt_tokens
    if low > high:
        raise SystemExit(f"--bench-prompt-tokens {low} {high}: MIN must not exceed MAX")
    model = build_model(args, args.bench_vocab_size)
    if weights is not None:
        model.load_state_dict(weights)
    prompts, _ = random_requests(args.bench_requests, (low, high), (1, 1), args.bench_vocab_size, 0)
    lengths = [TRAIN_SEQUENCE_TOKENS] * (args.bench_train_tokens // TRAIN_SEQUENCE_TOKENS)
    batch = pack_sequences([prompts[i % len(prompts)][:1] * n for i, n in enumerate(lengths)]).to("cuda")
    # before the engine: DDP may move params
    ddp, optimizer = build_ddp_and_optimizer(args, model) if trains else (None, None)
    return Workload(model, ddp, optimizer, Generator(model, engine_config_from_args(args)), prompts,
                    batch)


def run_modes(extra_args_provider, measure: Callable) -> tuple[argparse.Namespace, dict]:
    """Parses the flags, then `measure(args, batch_invariant, weights) -> (result, weights)` in
    BI mode and in default mode (BI first unless --bench-default-first), the second on the first's
    weights, or in the one mode --bench-mode names; the weights from --bench-weights if given, to
    --bench-save-weights if given. Each result holds `parity_max`. The report: provenance,
    config, and each measured mode's result under "bi" or "default"; and the flags."""
    args = parse_args(extra_args_provider=extra_args_provider)
    validate_batch_invariance(args, batch_invariant=True)
    validate_installed_kernels(args)
    print_arguments(args)
    initialize_distributed(args.seed, cuda_graphs=args.cuda_graph_impl == "local")
    modes = {"both": (not args.bench_default_first, args.bench_default_first), "bi": (True,),
             "default": (False,)}[args.bench_mode]
    weights = torch.load(args.bench_weights, weights_only=False) if args.bench_weights else None  # our own file
    results = {}
    for index, batch_invariant in enumerate(modes):
        if index:
            release_first_mode()
        results[batch_invariant], weights = measure(args, batch_invariant, weights)
        print_numbers(batch_invariant, results[batch_invariant])
    if args.bench_save_weights:
        torch.save(weights, args.bench_save_weights)
    torch.distributed.destroy_process_group()
    config = {k: str(v) for k, v in vars(args).items()
              if k.startswith(("bench_", "hidden", "num_layers", "num_attention", "num_query", "ffn",
                               "hybrid", "cuda_graph", "inference_cuda_graph"))}
    return args, {**provenance(), "config": config,
                  **{("bi" if mode else "default"): result for mode, result in results.items()}}


def release_first_mode() -> None:
    """What the first mode left, freed before the second builds its own; what stays is named."""
    # megatron-core's global graph record keeps the first engine's graph runners, and through them
    # its model, alive past measure's frame: release them before the second mode builds its own.
    delete_cuda_graphs()
    # Reference cycles can keep the first engine's cache (as in the freed-cache GPU test): at
    # Qwen3-4B's size the second mode's engine found 97 GiB still held and ran out of memory.
    gc.collect()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated()
    print(f"between the modes: {held / 2**30:.2f} GiB still allocated", flush=True)
    if held > 2**30:  # what keeps the first mode alive (a MoE model held 25 GiB here on an H100)
        for tensor in largest_live_tensors("cuda", 8):
            print(f"  still alive: {json.dumps(tensor)}", flush=True)


def largest_live_tensors(device_type: str, count: int) -> list[dict]:
    """The `count` largest storages of live tensors on `device_type`, each with its largest
    tensor's shape and dtype and the types of what holds any tensor of it (through a dict: what
    holds the dict): where memory that should have been freed is kept. A buffer whose own tensor
    only C++ holds (a view's base: megatron-core's gradient buffer under each parameter's
    `main_grad`) is named by its views' holders. Memory that no Python tensor holds (a CUDA
    graph's pool, C++ buffers) is not among them."""
    storages = {}  # storage address -> [bytes, its largest tensor (a view's base, not the view), its tensors]
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type == device_type:
            entry = storages.setdefault(obj.untyped_storage().data_ptr(), [obj.untyped_storage().nbytes(), obj, []])
            entry[2].append(obj)
            if obj.numel() > entry[1].numel():
                entry[1] = obj
    largest = sorted(storages.values(), key=lambda entry: entry[0], reverse=True)[:count]
    own = {id(entry) for entry in storages.values()} | {id(entry[2]) for entry in storages.values()}  # the search's
    rows = []
    for nbytes, tensor, tensors in largest:
        holders = set()
        for view in tensors:
            holders |= _holders(view, own)
        rows.append({"gib": nbytes / 2**30, "shape": list(tensor.shape), "dtype": str(tensor.dtype),
                     "held_by": sorted(holders)})
    return rows


def _holders(tensor: torch.Tensor, own: set[int]) -> set[str]:
    """The types of what holds `tensor`, but the objects of ids `own` (the search's)."""
    referrers = gc.get_referrers(tensor)
    names = set()
    for referrer in referrers:
        if id(referrer) in own or isinstance(referrer, types.FrameType):
            continue
        if not isinstance(referrer, dict):
            names.add(type(referrer).__name__)
            continue
        # a dict (a module's `_parameters`, an object's attributes) is named by what holds it
        owners = {type(o).__name__ for o in gc.get_referrers(referrer)
                  if o is not referrers and not isinstance(o, types.FrameType)}
        names.update(owners or {"dict"})
    return names


def print_numbers(batch_invariant: bool, result: dict) -> None:
    """A mode's numbers in the log once measured: a run stopped in its second mode keeps the first's."""
    numbers = {key: value for key, value in result.items() if isinstance(value, float | int)}
    print(f"{'bi' if batch_invariant else 'default'} mode: {json.dumps(numbers)}", flush=True)


def check_bi_parity(report: dict) -> None:
    """After the report is written: exit 1 unless BI mode, where measured, kept engine/trainer
    parity."""
    if "bi" in report and report["bi"]["parity_max"] != 0.0:
        raise SystemExit(f"BI parity broken: engine vs trainer max |diff| {report['bi']['parity_max']}")
