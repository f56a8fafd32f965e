"""tools/memory_peak.py on a hand-made snapshot (the layout torch.cuda.memory._snapshot writes):
the peak found by replaying the events back from the live blocks, what was alive then, summed by
the code that allocated it, and the errors for a file that cannot answer."""

import importlib.util
import json
import pickle

import pytest

from .. import REPO


_spec = importlib.util.spec_from_file_location("memory_peak", f"{REPO}/tools/memory_peak.py")
memory_peak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(memory_peak)


def _frames(*sites: str) -> list[dict]:
    """Innermost first, as torch records them."""
    return [{"filename": f, "line": n, "name": fn} for f, n, fn in (s.split(":") for s in sites)]


WEIGHTS = _frames("/x/site-packages/torch/nn/modules/module.py:10:_apply",
                  "/w/megatron_rl_bi/models/build.py:42:build_model")
ACTIVATIONS = _frames("/x/site-packages/torch/autograd/function.py:5:apply",
                      "/x/site-packages/megatron/core/transformer/mlp.py:77:forward",
                      "/w/megatron_rl_bi/rl/step.py:9:train_step")
TEMPORARY = _frames("/x/site-packages/torch/optim/adamw.py:300:_multi_tensor_adamw")


def _event(action: str, addr: int, size: int, frames: list) -> dict:
    return {"action": action, "addr": addr, "size": size, "frames": frames, "stream": 0}


def _snapshot() -> dict:
    """Live at the snapshot: the weights (100 bytes) and the temporary's block allocated again (30).
    The window: activations (50) allocated, the temporary (30), the activations freed (a stream
    still used them: requested, then completed), the temporary freed, allocated again (30).
    Allocated bytes, event by event: 100 before the window, 150, 180, 130, 130, 100, 100 (a new
    segment is no allocation), 130."""
    events = [_event("alloc", 2, 50, ACTIVATIONS), _event("alloc", 3, 30, TEMPORARY),
              _event("free_requested", 2, 50, ACTIVATIONS), _event("free_completed", 2, 50, ACTIVATIONS),
              _event("free_requested", 3, 30, TEMPORARY), _event("free_completed", 3, 30, TEMPORARY),
              _event("segment_alloc", 9, 4096, []), _event("alloc", 3, 30, TEMPORARY)]
    blocks = [{"address": 1, "size": 100, "state": "active_allocated", "frames": WEIGHTS},
              {"address": 2, "size": 50, "state": "inactive"},
              {"address": 3, "size": 30, "state": "active_allocated", "frames": TEMPORARY}]
    other_device = {"device": 1, "blocks": [{"address": 7, "size": 999, "state": "active_allocated"}]}
    return {"segments": [{"device": 0, "blocks": blocks}, other_device], "device_traces": [events, []]}


def test_the_peak_is_found_by_replaying_the_events_back():
    allocated, before, live = memory_peak.peak(_snapshot(), 0)
    assert (allocated, before) == (180, 2)  # after the first two allocations
    assert {addr: size for addr, (size, _) in live.items()} == {1: 100, 2: 50, 3: 30}


def test_a_peak_at_the_snapshot_itself():
    snapshot = _snapshot()
    snapshot["device_traces"][0] = snapshot["device_traces"][0][-1:]  # the window: the last allocation
    allocated, before, live = memory_peak.peak(snapshot, 0)
    assert (allocated, before, sorted(live)) == (130, 1, [1, 3])


def test_the_live_blocks_are_summed_by_the_code_that_allocated_them():
    _, _, live = memory_peak.peak(_snapshot(), 0)
    assert memory_peak.by_site(live) == [
        ("/w/megatron_rl_bi/models/build.py:42:build_model", 100, 1),
        ("megatron/core/transformer/mlp.py:77:forward", 50, 1),  # megatron-core's frame is innermost
        ("torch/optim/adamw.py:300:_multi_tensor_adamw", 30, 1)]  # none of ours: the innermost
    assert memory_peak.allocation_site([]) == "(no stack recorded)"


def test_the_command_prints_and_writes_the_peak(tmp_path, capsys):
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(_snapshot()))
    memory_peak.main([str(path), "--top", "2", "--json", str(tmp_path / "peak.json")])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("peak: 0.000 GiB allocated, after 2 of the window's 8 events")
    assert len(lines) == 3 and lines[1].endswith("build.py:42:build_model")
    written = json.loads((tmp_path / "peak.json").read_text())
    assert written["peak_gib"] * 2**30 == 180 and [s["blocks"] for s in written["sites"]] == [1, 1, 1]


def test_files_that_cannot_answer_are_named(tmp_path):
    with pytest.raises(SystemExit, match="nope.pickle: no such file"):
        memory_peak.main([str(tmp_path / "nope.pickle")])
    path = tmp_path / "plain.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]]}))
    with pytest.raises(SystemExit, match="plain.pickle: no allocator events for device 0"):
        memory_peak.main([str(path)])
    with pytest.raises(SystemExit, match="no allocator events for device 3"):
        memory_peak.main([str(path), "--device", "3"])
