"""Triton's autotuned kernels choose their configuration without timing while the switch is on.

fla's chunked gated-delta-rule kernels (the GDN backward of BI mode, every GDN kernel of default
mode) pick block sizes, warps and stages for each shape by timing every candidate (Triton's
`Autotuner`), and fla keeps those picks on disk for later processes. Block sizes change the
order of the sums, so two runs whose timings came out otherwise (a machine shared with other jobs,
another GPU, the first process to tune on a fresh machine) train on other bits, though the engine
and the trainer still agree (BI mode's GDN forward is fla's recurrent kernel, which is not tuned).
While the switch is on, every autotuner keeps, for each key, the first of its candidates that
compiles and runs; neither the disk's picks nor those made with the switch off are read, nor are
its own written there. The choice is then a function of the kernel, its key and what the GPU can
run, not of time. The first candidate is not always the fastest: that is the price; the
later candidates are not compiled, which is the gain (a first step tunes in one compile a kernel).
"""

import contextlib
import threading

from triton.runtime.autotuner import Autotuner

_timed_run = Autotuner.run
_lock = threading.RLock()  # an autotuner's state is swapped for the call: one call at a time
_keep_picks = True


def _first_that_runs():
    """An autotuner's benchmark that times nothing, for one tuning: candidates run once in order
    until one runs (one the GPU cannot run raises, and the autotuner passes it over); that one
    ties at 0 and the later ones, never compiled, lose at infinity. So the autotuner's min keeps
    the first that runs, and a tuning compiles one candidate where timing compiles them all."""
    found = False

    def bench(kernel_call, quantiles) -> list[float]:
        nonlocal found
        if found:
            return [float("inf")] * len(quantiles)
        kernel_call()
        found = True
        return [0.0] * len(quantiles)
    return bench


def _untimed_run(self: Autotuner, *args, **kwargs):
    with _lock:
        state = self.__dict__
        saved = {name: state[name] for name in ("cache", "cache_results", "do_bench") if name in state}
        state["cache"] = state.setdefault("_untimed_picks", {}) if _keep_picks else {}
        state["cache_results"] = False
        state["do_bench"] = _first_that_runs()
        try:
            return _timed_run(self, *args, **kwargs)
        finally:
            for name in ("cache", "cache_results", "do_bench"):
                state.pop(name, None)
            state.update(saved)


@contextlib.contextmanager
def picks_not_kept():
    """Autotuners pick as usual but keep no pick: for a pass whose launches do not run
    (models/compile_ahead.py), where the first candidate always seems to run; the run's own first
    call then picks the one that does."""
    global _keep_picks
    _keep_picks = False
    try:
        yield
    finally:
        _keep_picks = True


def install() -> None:
    Autotuner.run = _untimed_run


def uninstall() -> None:
    Autotuner.run = _timed_run


def installed() -> bool:
    return Autotuner.run is _untimed_run
