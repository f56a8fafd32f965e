"""Triton's kernel compilations as a run meets them: how many kernels it compiled, the compiler's
seconds for them, and how many it loaded from Triton's disk cache instead. A fresh machine's first
step pays for its compilations (issue 48), and a later step that meets a new shape pays again;
each step record carries those since the record before."""

from triton import knobs


class TritonCompiles:
    """A Triton compilation listener (`triton.knobs.compilation.listener`) that tallies, then
    calls the listener it replaced, if any."""

    def __init__(self, replaced=None):
        self.replaced = replaced
        self.compiled, self.seconds, self.loaded = 0, 0.0, 0

    def __call__(self, *, times, cache_hit: bool, **compilation) -> None:
        if cache_hit:
            self.loaded += 1
        else:
            self.compiled += 1
            self.seconds += times.total / 1e6  # Triton's CompileTimes are in microseconds
        if self.replaced is not None:
            self.replaced(times=times, cache_hit=cache_hit, **compilation)

    def take(self) -> dict:
        """The tally since the last take, as step-record metrics (machine measurements: `time/`)."""
        taken = {"time/triton_compiles": self.compiled, "time/triton_compile_s": self.seconds,
                 "time/triton_cache_loads": self.loaded}
        self.compiled, self.seconds, self.loaded = 0, 0.0, 0
        return taken


def count_triton_compiles() -> TritonCompiles:
    """The process's tally, installed as Triton's compilation listener on the first call (main's
    start, before any kernel compiles); later calls return it."""
    if not isinstance(knobs.compilation.listener, TritonCompiles):
        knobs.compilation.listener = TritonCompiles(replaced=knobs.compilation.listener)
    return knobs.compilation.listener
