"""Process setup (one process per GPU, data parallel only) and the one reduction of metrics over
data-parallel ranks."""

import math
import os
import socket
from dataclasses import dataclass, field

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed


def _init_process_group(backend: str) -> None:
    """The default process group, from the launcher's environment. A plain single process (a
    tool, a GPU test, a run without torchrun) meets itself in memory: a rendezvous over TCP needs
    a port, and two such processes started together on one machine took the same free port, and
    one failed with EADDRINUSE (GPU tests side by side on an H100). A larger world meets at
    MASTER_ADDR:MASTER_PORT (127.0.0.1:29500 unless the launcher said)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1 and "MASTER_PORT" not in os.environ:
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    torch.distributed.init_process_group(backend, rank=int(os.environ.get("RANK", 0)), world_size=world)


def initialize_distributed(seed: int, cuda_graphs: bool = False, share_gpus: bool = False) -> None:
    """One process per GPU (torchrun or a single plain process); TP = PP = 1. With `cuda_graphs`
    (--cuda-graph-impl local) the RNG tracker is the graph-safe one megatron-core's graph
    manager requires. `share_gpus` (generator ranks apart) puts more processes than GPUs on a
    node round-robin, so one GPU can hold a trainer and a generator."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank % torch.cuda.device_count() if share_gpus else local_rank)
    if not torch.distributed.is_initialized():
        _init_process_group("nccl")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1, pipeline_model_parallel_size=1
        )
    model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=cuda_graphs)


def launch_processes() -> list[dict]:
    """The launch check (--launch-check): the process group over gloo (no GPU) from torchrun's
    environment, and megatron-core's data-parallel groups as a run builds them; every process's
    rank, world size, node and data-parallel group, gathered on every rank."""
    if not torch.distributed.is_initialized():
        _init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    mine = {"rank": torch.distributed.get_rank(), "world_size": torch.distributed.get_world_size(),
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
            "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
            "data_parallel_group": torch.distributed.get_process_group_ranks(
                parallel_state.get_data_parallel_group())}
    everyone = [None] * mine["world_size"]
    torch.distributed.all_gather_object(everyone, mine)
    return everyone


def launch_problems(processes: list[dict]) -> list[str]:
    """What is wrong with a launch: a rank missing or twice, a world size that ranks disagree
    on, data-parallel groups other than all ranks (TP = PP = CP = 1)."""
    world = processes[0]["world_size"]
    problems = []
    if sorted(p["rank"] for p in processes) != list(range(world)):
        problems.append(f"ranks {sorted(p['rank'] for p in processes)}, expected 0..{world - 1} once each")
    if {p["world_size"] for p in processes} != {world}:
        problems.append(f"world sizes {sorted({p['world_size'] for p in processes})} differ between ranks")
    problems += [f"rank {p['rank']}: data-parallel group {p['data_parallel_group']}, expected all {world} ranks"
                 for p in processes if p["data_parallel_group"] != list(range(world))]
    return problems


@dataclass
class MetricTerms:
    """One rank's share of metrics that pool over ranks.

    `means` are (sum of values, count) pairs, so the pooled mean weighs each rank by its count
    and a rank with nothing to report (count 0) changes nothing; a mean over a total count of 0
    is NaN. `sums` add up; `maxima` take the largest (NaN where no rank had a value).
    """

    means: dict[str, tuple[float, float]] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=dict)
    maxima: dict[str, float] = field(default_factory=dict)

    def update(self, other: "MetricTerms") -> "MetricTerms":
        self.means.update(other.means)
        self.sums.update(other.sums)
        self.maxima.update(other.maxima)
        return self

    def finalize(self) -> dict[str, float]:
        result = {name: total / count if count else math.nan
                  for name, (total, count) in self.means.items()}
        result.update(self.sums)
        result.update({name: math.nan if value == -math.inf else value
                       for name, value in self.maxima.items()})
        return result


def _union_of_names(local: list[str]) -> list[str]:
    every_rank = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every_rank, local)
    return sorted(set().union(*every_rank))


def all_reduce_metrics(terms: MetricTerms) -> dict[str, float]:
    """`terms` pooled over all ranks (a collective: every rank calls it, in the same order).
    Ranks may report different names; a name missing on a rank counts as count 0, sum 0, or no
    value for a maximum. Sums that are Python ints on this rank come back as ints."""
    # NCCL reduces CUDA tensors; gloo (CPU tests) CPU ones.
    device = torch.cuda.current_device() if torch.distributed.get_backend() == "nccl" else "cpu"
    names = _union_of_names([f"mean:{n}" for n in terms.means] + [f"sum:{n}" for n in terms.sums]
                            + [f"max:{n}" for n in terms.maxima])
    kinds = {kind: [n.split(":", 1)[1] for n in names if n.startswith(kind + ":")]
             for kind in ("mean", "sum", "max")}
    added = torch.tensor(
        [v for n in kinds["mean"] for v in terms.means.get(n, (0.0, 0.0))]
        + [float(terms.sums.get(n, 0.0)) for n in kinds["sum"]],
        dtype=torch.float64, device=device,
    )
    largest = torch.tensor([float(terms.maxima.get(n, -math.inf)) for n in kinds["max"]],
                           dtype=torch.float64, device=device)
    torch.distributed.all_reduce(added)
    torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
    added, largest = added.tolist(), largest.tolist()
    num_means = len(kinds["mean"])
    pooled = MetricTerms(
        means={n: (added[2 * i], added[2 * i + 1]) for i, n in enumerate(kinds["mean"])},
        sums={n: int(v) if isinstance(terms.sums.get(n), int) else v
              for n, v in zip(kinds["sum"], added[2 * num_means:])},
        maxima=dict(zip(kinds["max"], largest)),
    )
    return pooled.finalize()
