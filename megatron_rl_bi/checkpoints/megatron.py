"""Checkpoints: Megatron distributed checkpoint of model + optimizer, plus the RL state.

Layout under --save:
  iter_0000012/              megatron-core dist_checkpointing (model, optimizer), rl_state.pt
  latest_checkpointed_iteration.txt
Written atomically: everything goes to `iter_0000012.tmp/`, which is fsynced and renamed only
when complete (an existing `iter_0000012/` is set aside as `.old` and deleted only after), then
the `latest` file is replaced with os.replace. A crash mid-save leaves the previous checkpoint as
`latest`; the next save removes stale `.tmp` directories. `keep_last` (--rl-keep-last-k) bounds
how many checkpoints stay. Every read error names the file or directory.

RL state: step, weight version, the run's seed, the prompt source position, and the RNG states
(Python, torch CPU/CUDA, Megatron's CUDA RNG tracker). Prompts and per-step sampling seeds
derive from the seed and the step, so a resumed run repeats the uninterrupted one.
"""

import os
import random
import re
import shutil

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.utils import unwrap_model
from torch.distributed.checkpoint.api import CheckpointException

from megatron_rl_bi.checkpoints.hf.files import check_replaceable

LATEST = "latest_checkpointed_iteration.txt"
RL_STATE = "rl_state.pt"
# The files of a torch_dist checkpoint directory: metadata.json (dist_checkpointing's), .metadata
# and the *.distcp shards (torch.distributed.checkpoint's), common.pt (older megatron-core),
# integrity.json (saves with verify_integrity).
DIST_CHECKPOINT_FILES = ("metadata.json", ".metadata", "common.pt", "integrity.json")


def start_save_results_queue() -> None:
    """Starts, forked, the process through which megatron-core's torch_dist save hands back what
    each save wrote (a multiprocessing Manager's queue). Left to the first save it is spawned, and
    a spawned process imports the main module again: 5.3 s of the tiny hybrid run's one save on an
    H100, 5.4 s of a first save on a CPU where forked it took 0.03 s. Call it before any thread
    or CUDA starts, so that the fork copies neither."""
    filesystem_async.get_write_results_queue(mp_mode="fork")


def iteration_dir_name(step: int) -> str:
    """`iter_0000012`: the directory of a step, for checkpoints and exports alike."""
    return f"iter_{step:07d}"


def _sharded_state_dict(ddp, optimizer, is_loading: bool) -> dict:
    # The bare GPTModel's keys, as Megatron's own checkpoints have them (no DDP/Float16Module
    # prefixes), so checkpoints load into either wrapper and into Megatron-LM tools.
    # The distributed optimizer's checkpoint layout megatron-core's training writes by default
    # (checkpointing._build_sharded_state_dict_metadata); without it, a deprecated one that fails.
    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
                "distrib_optim_sharding_type": "dp_reshardable"}
    state = {"model": unwrap_model(ddp).sharded_state_dict(metadata=metadata)}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=metadata)
    return state


def _rng_state() -> dict:
    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    """Every file and directory under `root`, then `root`'s parent: on disk before publishing."""
    for directory, _, files in os.walk(root):
        for name in files:
            _fsync(os.path.join(directory, name))
        _fsync(directory)
    _fsync(os.path.dirname(os.path.abspath(root)))


def _publish(tmp: str, final: str) -> None:
    """`tmp` (complete, on disk) becomes `final`; an older `final` is set aside as `final.old`
    and deleted only once the new one is in place."""
    old = final + ".old"
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync(os.path.dirname(final))
    shutil.rmtree(old, ignore_errors=True)


def _write_latest(save_dir: str, step: int) -> None:
    latest_tmp = os.path.join(save_dir, LATEST + ".tmp")
    with open(latest_tmp, "w") as f:
        f.write(f"{step}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest_tmp, os.path.join(save_dir, LATEST))
    _fsync(save_dir)


def _tidy(save_dir: str) -> None:
    """Before a save: partial `.tmp` directories go; an `.old` copy left by a crash between the
    two renames of `_publish` is the complete checkpoint and goes back in place."""
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name)
        if name.endswith(".tmp") and os.path.isdir(path):
            shutil.rmtree(path)
        elif name.endswith(".old"):
            final = path.removesuffix(".old")
            shutil.rmtree(path) if os.path.exists(final) else os.replace(path, final)


def _prune(save_dir: str, keep_last: int, current: str) -> None:
    """Keeps the `keep_last` newest checkpoints (0: all); never the one just written."""
    steps = sorted(int(n[5:]) for n in os.listdir(save_dir) if re.fullmatch(r"iter_\d{7}", n))
    for step in steps[:-keep_last] if keep_last else []:
        path = os.path.join(save_dir, iteration_dir_name(step))
        if path != current:
            shutil.rmtree(path)


def save_checkpoint(save_dir: str, step: int, ddp, optimizer, rl_state: dict,
                    keep_last: int = 0) -> str:
    """Model, optimizer and RL state under `save_dir/iter_N`, published only when complete and
    on disk; then `latest` names it and checkpoints beyond the newest `keep_last` go."""
    rank = torch.distributed.get_rank()
    final = os.path.join(save_dir, iteration_dir_name(step))
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        _tidy(save_dir)
        os.makedirs(tmp)
    torch.distributed.barrier()
    dist_checkpointing.save(_sharded_state_dict(ddp, optimizer, is_loading=False), tmp)
    rank_states = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(rank_states, {**rl_state, "rng": _rng_state()})
    torch.distributed.barrier()  # every rank's shards are written
    if rank == 0:
        torch.save({"step": step, "ranks": rank_states}, os.path.join(tmp, RL_STATE))
        _fsync_tree(tmp)
        _publish(tmp, final)
        _write_latest(save_dir, step)
        _prune(save_dir, keep_last, final)
    torch.distributed.barrier()
    return final


def latest_step(load_dir: str) -> int | None:
    path = os.path.join(load_dir, LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ValueError(f"{path}: expected a step number, got {text!r}")
    return int(text)


def _checkpoint_path(load_dir: str, step: int) -> str:
    path = os.path.join(load_dir, iteration_dir_name(step))
    if os.path.isdir(path):
        return path
    if os.path.isdir(path + ".old"):  # a crash between the two renames of `_publish`
        return path + ".old"
    raise ValueError(f"{os.path.join(load_dir, LATEST)} names step {step}, but {path} is missing")


def _unreadable(path: str, what: str, reason: str) -> ValueError:
    """The error for a checkpoint that cannot be read: the path, why, and the way out (an older
    checkpoint beside it, or none kept)."""
    checkpoint_dir = path if os.path.isdir(path) else os.path.dirname(path)
    load_dir = os.path.dirname(os.path.abspath(checkpoint_dir))
    older = sorted((int(n[5:]) for n in os.listdir(load_dir) if re.fullmatch(r"iter_\d{7}", n)
                    and os.path.join(load_dir, n) != os.path.abspath(checkpoint_dir)), reverse=True)
    if older:
        way_out = (f"to resume from an older checkpoint, write its step ({', '.join(map(str, older))}) "
                   f"into {os.path.join(load_dir, LATEST)}")
    else:
        way_out = "no older checkpoint is kept there (--rl-keep-last-k N keeps the newest N, 0 all)"
    return ValueError(f"{path}: cannot read the {what} ({reason}); {way_out}")


def read_rl_state(path: str) -> list[dict]:
    """Every rank's RL state from checkpoint directory `path` (tensors and plain Python values
    only: nothing is unpickled)."""
    file = os.path.join(path, RL_STATE)
    try:
        return torch.load(file, weights_only=True)["ranks"]
    except Exception as exc:  # noqa: BLE001 - any unreadable file is named, whatever failed
        raise _unreadable(file, "RL state", f"{type(exc).__name__}: {exc}") from exc


def _failure_text(exc: BaseException) -> str:
    """What failed, per rank where torch.distributed.checkpoint gathered the ranks' exceptions."""
    if isinstance(exc, CheckpointException):
        return "; ".join(f"rank {rank}: {type(error).__name__}: {error}"
                         for rank, (error, _) in exc.failures.items())
    return f"{type(exc).__name__}: {exc}"


def latest_checkpoint(load_dir: str) -> str | None:
    """The directory of the checkpoint `load_dir`'s latest file names; None when there is none."""
    step = latest_step(load_dir)
    return None if step is None else _checkpoint_path(load_dir, step)


def load_checkpoint(load_dir: str, ddp, optimizer, load_optimizer: bool = True) -> dict | None:
    """Restores model (and optimizer) and this rank's RNG; returns this rank's RL state, or
    None when `load_dir` has no checkpoint yet."""
    path = latest_checkpoint(load_dir)
    if path is None:
        return None
    ranks = read_rl_state(path)
    if len(ranks) != torch.distributed.get_world_size():
        raise ValueError(
            f"{path} was written by {len(ranks)} data-parallel ranks; resuming needs the same "
            f"number (got {torch.distributed.get_world_size()})"
        )
    sharded = _sharded_state_dict(ddp, optimizer, is_loading=True)
    if not load_optimizer:
        sharded.pop("optimizer")
    try:
        state = dist_checkpointing.load(sharded, path)
    except (Exception, CheckpointException) as exc:  # a BaseException: name the checkpoint whatever failed
        raise _unreadable(path, "model/optimizer checkpoint", _failure_text(exc)) from exc
    unwrap_model(ddp).load_state_dict(state["model"])
    if load_optimizer:
        optimizer.load_state_dict(state["optimizer"])
    mine = ranks[torch.distributed.get_rank()]
    rng = mine.pop("rng")
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    torch.cuda.set_rng_state(rng["cuda"])
    get_cuda_rng_tracker().set_states(rng["tracker"])
    return mine


def resolve_checkpoint_dir(path: str, flag: str = "--pretrained-checkpoint") -> str:
    """A Megatron torch_dist checkpoint directory from PATH (given as `flag`): the directory
    itself (it holds metadata.json), or the one PATH/latest_checkpointed_iteration.txt names
    (iter_N or release)."""
    if os.path.exists(os.path.join(path, "metadata.json")):
        return path
    latest = os.path.join(path, LATEST)
    if not os.path.exists(latest):
        raise ValueError(f"{flag} {path}: neither a dist checkpoint "
                         f"(no metadata.json) nor a checkpoint root (no {LATEST})")
    with open(latest) as f:
        tag = f.read().strip()
    name = "release" if tag == "release" else iteration_dir_name(int(tag)) if tag.isdigit() else None
    if name is None or not os.path.isdir(os.path.join(path, name)):
        raise ValueError(f"{latest}: names {tag!r}, which is not a checkpoint under {path}")
    return os.path.join(path, name)


def _is_dist_checkpoint_file(name: str) -> bool:
    return name in DIST_CHECKPOINT_FILES or name.endswith(".distcp")


def check_weights_dir(path: str) -> None:
    """`path` may become a weights checkpoint (tools/convert_hf.py import --save): absent, empty,
    or an earlier torch_dist checkpoint."""
    check_replaceable(path, "--save", "a torch_dist checkpoint", _is_dist_checkpoint_file)


def save_weights(model, path: str) -> None:
    """Model weights only, as a torch_dist checkpoint directory that --pretrained-checkpoint
    reads; written to `path.tmp` and renamed when complete, replacing only an earlier one."""
    check_weights_dir(path)  # on every rank: all raise, none waits at the barrier
    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    tmp = path.rstrip("/") + ".tmp"
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    torch.distributed.barrier()
    dist_checkpointing.save({"model": unwrap_model(model).sharded_state_dict(metadata=metadata)}, tmp)
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    torch.distributed.barrier()


def load_pretrained_weights(path: str, model, flag: str = "--pretrained-checkpoint") -> None:
    """Model weights only (no optimizer, no RL state) from a Megatron torch_dist checkpoint
    (`path`, given as `flag`)."""
    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    bare = unwrap_model(model)
    state = dist_checkpointing.load({"model": bare.sharded_state_dict(metadata=metadata)},
                                    resolve_checkpoint_dir(path, flag))
    bare.load_state_dict(state["model"])
