"""The launch check's verdict (CPU): every rank once, one world size, data-parallel groups of all
ranks; and where a --load would resume (tests/functional_tests/slurm runs it under Slurm); a
plain process's process group beside another on torch's default port."""

import os
import socket
import subprocess
import sys

import torch

from megatron_rl_bi.distributed import launch_problems
from megatron_rl_bi.launch import resume_line


def _process(rank, world=4, group=None):
    return {"rank": rank, "world_size": world, "local_rank": rank % 2, "node": f"node{rank // 2}",
            "data_parallel_group": list(range(world)) if group is None else group}


def test_a_whole_launch_has_no_problem():
    assert launch_problems([_process(r) for r in range(4)]) == []


def test_a_missing_or_doubled_rank_another_world_size_or_group_is_named():
    assert launch_problems([_process(r) for r in (0, 1, 1, 3)]) == ["ranks [0, 1, 1, 3], expected 0..3 once each"]
    assert launch_problems([_process(0), _process(1), _process(2), _process(3, world=5)]) == [
        "world sizes [4, 5] differ between ranks",
        "rank 3: data-parallel group [0, 1, 2, 3, 4], expected all 4 ranks"]
    assert launch_problems([_process(0), _process(1, group=[1]), _process(2), _process(3)]) == [
        "rank 1: data-parallel group [1], expected all 4 ranks"]


def test_where_a_load_would_resume(tmp_path):
    assert resume_line(None, 1) == ("no --load: would start a fresh run", [])
    assert resume_line(str(tmp_path), 1) == (f"--load {tmp_path}: no checkpoint yet, would start a fresh run", [])
    (tmp_path / "iter_0000005").mkdir()
    torch.save({"step": 5, "ranks": [{"step": 5}]}, tmp_path / "iter_0000005" / "rl_state.pt")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5\n")
    assert resume_line(str(tmp_path), 1) == (f"--load {tmp_path}: would resume from {tmp_path}/iter_0000005 (step 5)", [])
    torch.save({"step": 5, "ranks": [{"step": 5}] * 2}, tmp_path / "iter_0000005" / "rl_state.pt")
    assert resume_line(str(tmp_path), 1)[1] == [
        f"{tmp_path}/iter_0000005 was written by 2 data-parallel ranks; this launch has 1"]
    # with generator ranks apart only the trainers are data-parallel ranks
    assert resume_line(str(tmp_path), 2)[1] == []


def test_with_generator_ranks_the_check_matches_a_checkpoint_to_the_trainers(tmp_path, monkeypatch, capsys):
    """3 processes, the last generating apart: a checkpoint of 2 data-parallel ranks resumes."""
    from megatron_rl_bi import launch

    (tmp_path / "iter_0000005").mkdir()
    torch.save({"step": 5, "ranks": [{"step": 5}] * 2}, tmp_path / "iter_0000005" / "rl_state.pt")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5\n")
    monkeypatch.setattr(launch, "launch_processes", lambda: [_process(r, world=3) for r in range(3)])
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: None)
    launch.launch_check(str(tmp_path), generators=1)
    out = capsys.readouterr().out
    assert "rank 0 of 3 on node0 (local rank 0), data-parallel group [0, 1]" in out
    assert f"launch check passed: 3 processes on 2 nodes (node0, node1); --load {tmp_path}: would resume" in out


def _plain_process(statements: str) -> subprocess.CompletedProcess:
    """`statements` in a plain process (no launcher's variables) after its launch check's process
    group is up (`launch_processes()`'s result in `processes`). It ends as every tool does: a
    process that leaves gloo's group standing may abort at exit ("terminate called without an
    active exception", seen once in CI)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")}
    program = ("import os, torch; from megatron_rl_bi.distributed import launch_processes; "
               f"processes = launch_processes(); {statements}; torch.distributed.destroy_process_group()")
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300, env=env)


def test_a_plain_process_meets_beside_a_job_on_the_default_port():
    """A tool or GPU test run as one plain process must not need port 29500, which a torchrun job
    beside it holds (two GPU lanes on one machine failed with EADDRINUSE)."""
    with socket.socket() as job:
        job.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            job.bind(("127.0.0.1", 29500))
            job.listen()
        except OSError:
            pass  # held by something else already: as busy as the test wants it
        result = _plain_process("print(processes[0]['world_size'])")
    assert result.returncode == 0 and result.stdout.strip().endswith("1"), result.stderr[-2000:]


def test_a_plain_process_meets_itself_in_memory():
    """No port to race for: two plain processes started together took the same free port and
    one failed with EADDRINUSE (GPU tests side by side on an H100)."""
    result = _plain_process("from torch.distributed import distributed_c10d as c10d; "
                            "print(type(c10d._get_default_store().underlying_store).__name__, "
                            "'MASTER_PORT' in os.environ)")
    assert result.returncode == 0 and result.stdout.strip().endswith("HashStore False"), result.stderr[-2000:]
