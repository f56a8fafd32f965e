"""megatron-core's torch_dist save hands back what it wrote through a multiprocessing Manager's
queue; pretrain_rl and tools/convert_hf.py start that Manager forked at their start
(start_save_results_queue), not spawned at the first save, where it imported the main module
again. Checked in a process of its own that imports pretrain_rl as a run does, then saves and
loads a sharded tensor on gloo (CPU); and each entry point starts it before reading its inputs."""

import os
import sys
import textwrap

from .. import REPO
from .conftest import run_after_loading_pretrain_rl

PROGRAM = textwrap.dedent("""
    import sys, warnings
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
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    weights = torch.arange(12.0).reshape(3, 4)
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", weights)}, sys.argv[1])
    assert filesystem_async._results_queue is queue  # the save used the forked Manager's queue
    loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4))}, sys.argv[1])
    assert torch.equal(loaded["w"], weights)
    torch.distributed.destroy_process_group()
    print("saved through the forked queue")
""")


def test_the_save_results_queue_is_forked_at_the_start_and_used_by_the_save(tmp_path):
    (tmp_path / "checkpoint").mkdir()
    shown = run_after_loading_pretrain_rl(PROGRAM, args=(str(tmp_path / "checkpoint"),))
    assert shown == "saved through the forked queue"


def test_the_hf_import_tool_starts_the_queue_before_reading_its_inputs(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_hf", os.path.join(REPO, "tools", "convert_hf.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    order = []

    def read_inputs(mode, argv):
        order.append("inputs")
        raise ValueError("stop here")

    monkeypatch.setattr(tool, "start_save_results_queue", lambda: order.append("queue"))
    monkeypatch.setattr(tool, "read_inputs", read_inputs)
    monkeypatch.setattr(sys, "argv", ["convert_hf.py", "import"])
    try:
        tool.main()
    except SystemExit as exc:
        assert "stop here" in str(exc)
    assert order == ["queue", "inputs"]
