"""Generator ranks apart from trainer ranks (--rl-generator-ranks K): who is which, and the bridge
between them.

Of torchrun's N processes the last K generate and the first N - K train. The trainers form the
torch.distributed world every other module sees (data parallel over N - K ranks, exactly as a run
without generators); each generator is a world of its own (one rank, its own engine). The bridge
joins them: a TCPStore served by trainer rank 0 carries small records (a rank's rollout batch, the
start of a run), and a process group of trainer rank 0 and the generators (--refit-method: gloo
over the CPU, or nccl) carries the weights. Every wait has a deadline (--rl-generator-timeout) and
its error names the rank waited for: a process that died or hangs stops the run, never silently.
"""

import datetime
import os
import pickle
import threading
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Roles:
    """This process's place among `world_size` processes of which the last `generators`
    generate."""

    rank: int
    world_size: int
    generators: int

    @property
    def trainers(self) -> int:
        return self.world_size - self.generators

    def trainers_on_node(self, local_world_size: int, node_rank: int) -> int:
        """The trainer processes of node `node_rank` (torchrun's GROUP_RANK), each node running
        `local_world_size` consecutive ranks."""
        first = node_rank * local_world_size
        return max(0, min(self.trainers, first + local_world_size) - first)

    @property
    def is_generator(self) -> bool:
        return self.rank >= self.trainers

    @property
    def generator_index(self) -> int:
        return self.rank - self.trainers

    def served_ranks(self) -> list[int]:
        """The trainer ranks this generator generates for (trainer rank r: generator r mod K)."""
        return list(range(self.generator_index, self.trainers, self.generators))

    def generator_of(self, trainer_rank: int) -> int:
        """The process rank of the generator that generates for `trainer_rank`."""
        return self.trainers + trainer_rank % self.generators


def roles_from_environment(generators: int) -> Roles:
    """torchrun's RANK and WORLD_SIZE, split; one ValueError naming the flag when there would be
    no trainer left."""
    roles = Roles(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), generators)
    if generators and roles.trainers < 1:
        raise ValueError(f"--rl-generator-ranks {generators} of {roles.world_size} processes leaves no trainer: "
                         f"launch more processes (torchrun --nproc-per-node) or fewer generators")
    return roles


def join_world(roles: Roles, backend: str) -> None:
    """torch.distributed for this process's role: the trainers' world (torchrun's rendezvous,
    N - K ranks), or a generator's own world of one."""
    if roles.is_generator:
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
    else:
        torch.distributed.init_process_group(backend, rank=roles.rank, world_size=roles.trainers)


def bridge_address() -> tuple[str, int]:
    """Where trainer rank 0 serves the bridge's store: torchrun's master address, the port after
    its master port."""
    return os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", 29500)) + 1


class Bridge:
    """The store and the weights' process group between trainers and generators."""

    def __init__(self, roles: Roles, refit_method: str, timeout_s: float, host: str, port: int):
        self.roles, self.timeout_s = roles, timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = torch.distributed.TCPStore(host, port, is_master=roles.rank == 0, timeout=timeout,
                                                wait_for_workers=False)
        # Records are written over a connection of their own: a trainer's weights thread writes
        # while its training thread waits on the first one for a batch.
        self.writer = torch.distributed.TCPStore(host, port, is_master=False, timeout=timeout)
        self.writing = threading.Lock()
        self.group = None
        if roles.rank == 0 or roles.is_generator:
            self.group = _weights_group(refit_method, torch.distributed.PrefixStore("weights", self.store),
                                        0 if roles.rank == 0 else 1 + roles.generator_index,
                                        1 + roles.generators, timeout)
        self.device = torch.device("cpu") if refit_method == "gloo" else torch.device("cuda")

    def put(self, key: str, value: object) -> None:
        with self.writing:
            self.writer.set(key, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))

    def take(self, key: str, sender: str) -> object:
        """The record under `key` (waited for; then removed from the store); `sender` names who
        should have written it, for the error when it does not come in time."""
        try:
            self.store.wait([key])
        except (RuntimeError, torch.distributed.DistError) as exc:
            raise RuntimeError(
                f"{sender} sent nothing for {key!r} within {self.timeout_s:g} s (--rl-generator-timeout): "
                f"it died, hangs or is slower than the limit ({type(exc).__name__}: {exc})") from exc
        value = pickle.loads(self.store.get(key))
        self.store.delete_key(key)
        return value

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        """`tensors` from trainer rank 0 into every generator's, in place, one at a time (a
        generator's must have the trainer's shapes and dtypes: see `check_layout`)."""
        for tensor in tensors:
            staged = tensor if tensor.device == self.device else tensor.to(self.device)
            self.group.broadcast([staged], _root()).wait()
            if staged is not tensor:
                tensor.copy_(staged)


def check_layout(bridge: Bridge, names_and_tensors: list[tuple[str, torch.Tensor]], generator: str) -> None:
    """Trainer rank 0 publishes its module's tensors' names, shapes and dtypes; each generator
    compares its own and fails naming the first that differs (the two builds differ: flags,
    checkpoint config)."""
    layout = [(name, tuple(t.shape), str(t.dtype)) for name, t in names_and_tensors]
    if bridge.roles.rank == 0:
        for index in range(bridge.roles.generators):
            bridge.put(f"layout/{index}", layout)
        return
    expected = bridge.take(f"layout/{bridge.roles.generator_index}", "trainer rank 0")
    for mine, theirs in zip(layout, expected):
        if mine != theirs:
            raise ValueError(f"{generator}: its model has {mine}, the trainer's {theirs}: the generator must be "
                             "built with the trainer's flags")
    if len(layout) != len(expected):
        raise ValueError(f"{generator}: its model has {len(layout)} tensors, the trainer's {len(expected)}")


def _root() -> torch.distributed.BroadcastOptions:
    options = torch.distributed.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    return options


def _weights_group(method: str, store, rank: int, size: int, timeout: datetime.timedelta):
    if method == "gloo":
        return torch.distributed.ProcessGroupGloo(store, rank, size, timeout)
    options = torch.distributed.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return torch.distributed.ProcessGroupNCCL(store, rank, size, options)
