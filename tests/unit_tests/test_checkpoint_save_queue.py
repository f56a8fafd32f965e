"""megatron-core's torch_dist save hands back what it wrote through a multiprocessing Manager's
queue; pretrain_rl starts that Manager forked at its start (start_save_results_queue), not
spawned at the first save, where it imported the main module again. Checked in a process of its
own that imports pretrain_rl as a run does, then saves and loads a sharded tensor on gloo (CPU)."""

import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROGRAM = textwrap.dedent("""
    import importlib.util, sys, warnings
    spec = importlib.util.spec_from_file_location("pretrain_rl", sys.argv[1] + "/pretrain_rl.py")
    pretrain_rl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pretrain_rl)  # every import of a run, before main starts
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fork of a process with threads warns
        pretrain_rl.start_save_results_queue()
    queue = filesystem_async._results_queue
    assert type(queue._manager._process).__name__ == "ForkProcess", type(queue._manager._process)
    torch.cuda.synchronize = lambda *a: None  # megatron-core's writer syncs the GPU; the CPU has none
    torch.cuda.current_device = lambda: "cpu"
    torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[3], rank=0, world_size=1)
    weights = torch.arange(12.0).reshape(3, 4)
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", weights)}, sys.argv[2])
    assert filesystem_async._results_queue is queue  # the save used the forked Manager's queue
    loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4))}, sys.argv[2])
    assert torch.equal(loaded["w"], weights)
    torch.distributed.destroy_process_group()
    print("saved through the forked queue")
""")


def test_the_save_results_queue_is_forked_at_the_start_and_used_by_the_save(tmp_path):
    from .conftest import free_port

    (tmp_path / "checkpoint").mkdir()
    done = subprocess.run([sys.executable, "-c", PROGRAM, REPO, str(tmp_path / "checkpoint"), str(free_port())],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0 and "saved through the forked queue" in done.stdout, done.stderr[-3000:]
