"""bench/workload.py's report of what keeps memory alive between the bench's two modes (CPU:
the same search over CPU tensors)."""

import argparse

import pytest
import torch

from bench.workload import largest_live_tensors


class ExpertWeights:
    """Holds its tensor in a dict, as a module holds its parameters."""

    def __init__(self, weight: torch.Tensor):
        self.tensors = {"weight": weight}


def test_the_largest_live_storages_are_named_with_their_holders():
    storage = torch.UntypedStorage(24 << 20)  # 24 MiB
    part = ExpertWeights(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (1 << 20,)))  # made first
    whole = ExpertWeights(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (24 << 20,)))
    listed = largest_live_tensors("cpu", 50)
    ours = [row for row in listed if "ExpertWeights" in row["held_by"]]
    assert ours == [{"gib": 24 / 1024, "shape": [24 << 20], "dtype": "torch.uint8", "held_by": ["ExpertWeights"]}]
    assert part.tensors["weight"].untyped_storage().data_ptr() == whole.tensors["weight"].untyped_storage().data_ptr()


def test_the_largest_storages_come_first():
    small, large = torch.empty(3 << 20, dtype=torch.uint8), torch.empty(5 << 20, dtype=torch.uint8)
    holders = [ExpertWeights(small), ExpertWeights(large)]
    listed = largest_live_tensors("cpu", 1000)
    sizes = [row["gib"] for row in listed]
    ours = [row["gib"] for row in listed if row["held_by"] == ["ExpertWeights"]]
    assert sizes == sorted(sizes, reverse=True) and ours == [5 / 1024, 3 / 1024]
    del holders  # alive until the search is done


def test_a_bi_report_whose_parity_is_not_0_exits_1_after_it_is_written():
    from bench.workload import check_bi_parity

    check_bi_parity({"bi": {"parity_max": 0.0}, "default": {"parity_max": 0.5}})
    check_bi_parity({"default": {"parity_max": 0.5}})  # default mode alone (--bench-mode default)
    with pytest.raises(SystemExit, match=r"BI parity broken: engine vs trainer max \|diff\| 0.25"):
        check_bi_parity({"bi": {"parity_max": 0.25}})


class Parameter:
    """Holds a view of a buffer as an attribute, as megatron-core's parameters hold `main_grad`."""

    def __init__(self, main_grad: torch.Tensor):
        self.main_grad = main_grad


def test_a_buffer_only_its_views_hold_is_named_by_the_views_holders():
    """megatron-core's gradient buffer: no Python object holds the buffer's own tensor, each
    parameter a view of it (an H100's bench named its 11.6 GiB buffer held by nobody)."""
    buffer = torch.empty(20 << 20, dtype=torch.uint8)
    parameters = [Parameter(buffer[i << 20:(i + 1) << 20]) for i in range(2)]
    del buffer
    ours = [row for row in largest_live_tensors("cpu", 50) if row["gib"] == 20 / 1024]
    assert ours == [{"gib": 20 / 1024, "shape": [20 << 20], "dtype": "torch.uint8", "held_by": ["Parameter"]}]
    assert len(parameters) == 2


@pytest.mark.parametrize("flags,modes", [([], [True, False]), (["--bench-default-first"], [False, True]),
                                         (["--bench-mode", "default"], [False]), (["--bench-mode", "bi"], [True])])
def test_the_modes_run_in_order_on_the_first_s_weights_and_the_weights_travel_by_file(tmp_path, monkeypatch,
                                                                                         flags, modes):
    from bench import workload

    loaded = tmp_path / "in.pt"
    torch.save({"w": torch.tensor([1.0, 2.0])}, loaded)
    saved = tmp_path / "out.pt"
    argv = ["--bench-weights", str(loaded), "--bench-save-weights", str(saved), *flags]
    args = workload.add_workload_args(argparse.ArgumentParser()).parse_args(argv)
    args.seed, args.cuda_graph_impl = 1, "none"
    monkeypatch.setattr(workload, "parse_args", lambda extra_args_provider: args)
    for name in ("validate_batch_invariance", "validate_installed_kernels", "print_arguments",
                 "initialize_distributed"):
        monkeypatch.setattr(workload, name, lambda *a, **k: None)
    monkeypatch.setattr(workload.torch.distributed, "destroy_process_group", lambda: None)
    seen = []
    monkeypatch.setattr(workload, "release_first_mode", lambda: seen.append("released"))

    def measure(args, batch_invariant, weights):
        seen.append((batch_invariant, weights["w"].tolist()))
        return {"parity_max": 0.0}, {"w": weights["w"] + 1}

    _, report = workload.run_modes(None, measure)
    assert seen.count("released") == len(modes) - 1 and seen[0] != "released"  # before the second mode
    seen = [entry for entry in seen if entry != "released"]
    assert [mode for mode, _ in seen] == modes
    assert [w for _, w in seen] == [[1.0 + i, 2.0 + i] for i in range(len(modes))]  # each on the one before's
    assert torch.load(saved)["w"].tolist() == [1.0 + len(modes), 2.0 + len(modes)]
    assert sorted(k for k in report if k in ("bi", "default")) == sorted("bi" if m else "default" for m in modes)

