"""bi.autotune (CPU): while the switch is on, Triton's autotuner keeps the first candidate that
runs, whatever the timings say, and reads no pick made otherwise. The autotuner is Triton's own;
the kernel behind it is a stand-in that records the configuration it ran with."""

import threading
import time

import pytest
from triton import Config
from triton.runtime.autotuner import Autotuner
from triton.runtime.errors import OutOfResources

from megatron_rl_bi import bi

# The stand-in benchmark's time of each candidate (by BLOCK): 64 is the fastest.
TIMES = {16: 3.0, 32: 2.0, 64: 1.0}


class StandInKernel:
    """What an autotuner wraps (a JIT function's `run`); BLOCK in `too_big` does not fit the GPU."""

    def __init__(self, too_big=()):
        self.fn = lambda x, BLOCK: None  # the autotuner looks for the Python function under it
        self.ran, self.too_big = [], set(too_big)

    def run(self, *args, BLOCK, **options):
        if BLOCK in self.too_big:
            raise OutOfResources(required=BLOCK, limit=0, name="shared memory")
        self.ran.append(BLOCK)


def autotuner(kernel: StandInKernel) -> Autotuner:
    tuner = Autotuner(kernel, ["x"], [Config({"BLOCK": b}) for b in TIMES], key=["x"],
                      reset_to_zero=None, restore_value=None)
    tuner.cache_results = True  # as fla asks (Triton's interpreter, the CPU tests', turns it off)
    # the timed path's benchmark, by the stand-in's table (the candidate about to run is the
    # last one the kernel was asked to run)
    def timed(kernel_call, quantiles):
        kernel_call()
        return [TIMES[kernel.ran[-1]]] * len(quantiles)
    tuner.__dict__["do_bench"] = timed
    return tuner


@pytest.fixture
def switch_off():
    bi.disable()
    yield
    bi.disable()


def picked(tuner: Autotuner, kernel: StandInKernel, x: int) -> int:
    kernel.ran.clear()
    tuner.run(x)
    return kernel.ran[-1]  # the call after tuning runs the pick


def test_off_the_fastest_candidate_wins_on_the_switch_the_first(switch_off, monkeypatch):
    monkeypatch.setattr(Autotuner, "check_disk_cache", lambda *a: pytest.fail("disk cache read in this test"))
    kernel = StandInKernel()
    tuner = autotuner(kernel)
    tuner.cache_results = False
    assert picked(tuner, kernel, 1) == 64
    bi.enable()
    assert picked(tuner, kernel, 1) == 16  # not the pick made with the switch off
    assert kernel.ran == [16, 16]  # tuned by running the first alone (the later never compiled)
    assert picked(tuner, kernel, 2) == 16
    bi.disable()
    assert picked(tuner, kernel, 1) == 64 and kernel.ran == [64]  # its own pick kept, no retuning


def test_a_candidate_that_cannot_run_is_passed_over(switch_off):
    kernel = StandInKernel(too_big={16})
    tuner = autotuner(kernel)
    bi.enable()
    assert picked(tuner, kernel, 1) == 32 and kernel.ran == [32, 32]  # 64 not run


def test_a_pass_that_launches_nothing_keeps_no_pick(switch_off):
    """models/compile_ahead.py's pass: nothing launches there, so the first candidate always seems
    to run; kept, the run would take a candidate its GPU cannot run."""
    kernel = StandInKernel(too_big={16})
    tuner = autotuner(kernel)
    bi.enable()
    kernel.too_big.clear()  # the pass: every candidate "runs"
    with bi.autotune.picks_not_kept():
        assert picked(tuner, kernel, 1) == 16
    kernel.too_big.add(16)
    assert picked(tuner, kernel, 1) == 32  # the run's own pick


def test_on_the_switch_the_disk_cache_is_neither_read_nor_written(switch_off, monkeypatch):
    asked = []

    def disk_cache(self, key, configs, benchmark):  # stands in for the read, the tuning, the write
        asked.append(key)
        benchmark()
        return False
    monkeypatch.setattr(Autotuner, "check_disk_cache", disk_cache)
    kernel = StandInKernel()
    tuner = autotuner(kernel)
    bi.enable()
    picked(tuner, kernel, 1)
    assert asked == [] and tuner.cache_results  # the autotuner's own setting is back after the call
    bi.disable()
    assert picked(tuner, kernel, 1) == 64 and len(asked) == 1


def test_the_switch_installs_and_removes_it(switch_off):
    from megatron_rl_bi.bi import autotune

    assert not autotune.installed()
    bi.enable()
    assert autotune.installed()
    bi.disable()
    assert not autotune.installed()


class InterleavingKernel(StandInKernel):
    """The run of thread "first" waits (at most 0.5 s) until thread "second" runs too; the run
    of "second" then waits until "first" has ended: a tuning still under way when a second thread
    calls the same autotuner (the engine generating ahead beside the trainer), and ending after."""

    def __init__(self):
        super().__init__()
        self.second_runs, self.first_ended = threading.Event(), threading.Event()

    def run(self, *args, BLOCK, **options):
        if threading.current_thread().name == "first":
            self.second_runs.wait(0.5)
        else:
            self.second_runs.set()
            self.first_ended.wait(0.5)
        super().run(*args, BLOCK=BLOCK, **options)


def test_two_threads_tuning_at_once_leave_the_autotuner_as_it_was(switch_off):
    """One untimed tuning at a time: interleaved, the second saves the first's swapped-in state
    as the autotuner's own and puts it back last, and the switch off then keeps untimed picks."""
    kernel = InterleavingKernel()
    tuner = autotuner(kernel)
    tuner.cache_results = False
    bi.enable()

    def first():
        tuner.run(1)
        kernel.first_ended.set()

    threads = [threading.Thread(target=first, name="first"), threading.Thread(target=tuner.run, args=(2,),
                                                                               name="second")]
    threads[0].start()
    time.sleep(0.05)  # the first is tuning
    threads[1].start()
    for thread in threads:
        thread.join()
    bi.disable()
    assert picked(tuner, kernel, 3) == 64  # timed again: the autotuner's own state is back
