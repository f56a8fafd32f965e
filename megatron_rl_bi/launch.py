"""The launch check (--launch-check): a run's launch, without its GPU work. Every process joins
the process group over gloo and builds megatron-core's data-parallel groups as a run would, says
where it landed, and rank 0 says whether the launch is whole (every rank once, one world size,
the groups a data-parallel run needs) and the step a --load would resume from: a pre-flight of a
cluster job (examples/slurm/*.sbatch), runnable on CPU-only nodes. With generator ranks apart
each process says its role; the trainers are the data-parallel ranks a checkpoint must match.
An input error under torchrun is handed to torchrun's failure summary (`report_to_torchrun`)."""

import json
import os
import time

import torch

from megatron_rl_bi.bridge import Roles
from megatron_rl_bi.checkpoints.megatron import latest_checkpoint, read_rl_state
from megatron_rl_bi.distributed import launch_problems, launch_processes


def resume_line(load_dir: str | None, trainers: int) -> tuple[str, list[str]]:
    """Where a run with --load `load_dir` would start, and what would stop it resuming here with
    `trainers` data-parallel ranks."""
    if not load_dir:
        return "no --load: would start a fresh run", []
    path = latest_checkpoint(load_dir)
    if path is None:
        return f"--load {load_dir}: no checkpoint yet, would start a fresh run", []
    ranks = read_rl_state(path)
    problems = [] if len(ranks) == trainers else [
        f"{path} was written by {len(ranks)} data-parallel ranks; this launch has {trainers}"]
    return f"--load {load_dir}: would resume from {path} (step {ranks[0]['step']})", problems


def launch_check(load_dir: str | None, kernel_problem: str | None = None, generators: int = 0) -> None:
    """Prints this process's place (with `generators` apart, --rl-generator-ranks, its role); rank
    0 prints the verdict, and `kernel_problem` (the kernels this node lacks: a GPU run would stop
    there, the launch is judged without them). SystemExit(1) on any problem of the launch."""
    processes = launch_processes()
    me = processes[torch.distributed.get_rank()]
    roles = Roles(me["rank"], me["world_size"], generators)
    place = (f"generator for trainer ranks {roles.served_ranks()}" if roles.is_generator else
             f"data-parallel group {me['data_parallel_group'][:roles.trainers]}")
    print(f"launch check: rank {me['rank']} of {me['world_size']} on {me['node']} (local rank "
          f"{me['local_rank']}), {place}", flush=True)
    resume, problems = resume_line(load_dir, roles.trainers)
    problems = launch_problems(processes) + problems
    if me["rank"] == 0:
        nodes = sorted({p["node"] for p in processes})
        verdict = "FAILED: " + "; ".join(problems) if problems else "passed"
        print(f"launch check {verdict}: {me['world_size']} processes on {len(nodes)} nodes "
              f"({', '.join(nodes)}); {resume}", flush=True)
        if kernel_problem:
            print(f"launch check: this node could not run the GPU work: {kernel_problem} (the verdict "
                  "above is the launch's alone, not the run's)", flush=True)
    torch.distributed.destroy_process_group()
    if problems:
        raise SystemExit(1)


def report_to_torchrun(message: str) -> None:
    """Under torchrun, `message` written as this process's error (torchelastic's error file):
    torchrun's failure summary, the last thing it prints, then ends with it instead of a link to
    its docs, and the error is not buried above the summary."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            json.dump({"message": message, "timestamp": str(int(time.time()))}, f)
