"""Processes that compile a run's kernels while it starts (issue 48's first step).

On a fresh machine the trainer's first forward and backward compile every Triton and
FlashAttention-4 kernel they launch, one after another in the run's process: the tiny hybrid
recipe's SFT warm-up took 29.4 s with empty caches and 3.1 s with filled ones (H100, 5e3990f).
These workers take those compilations as jobs (models/compile_ahead.py sends them: a Triton
launch's specialization, a FlashAttention-4 call's shapes), compile them side by side and write
them to the same disk caches, from which the run then loads them.

Standard library only: pretrain_rl.py starts the workers before its own imports, which theirs
(torch, Triton, FlashAttention-4: seconds) overlap. A worker takes one job at a time and asks for
the next, so a long compilation does not hold others back; it ends at the end job, and when the
run ends, however it ends.

Two marks a job may carry shape the order: "first" (a long job, FlashAttention-4's: queued ahead
of the others, so the longest start earliest) and "kernel_class" (jobs that mostly compile one
kernel: the first of a class runs alone, and the others wait for it to end, then run side by side,
loading the kernel it compiled from the disk cache instead of each compiling it again on a core of
its own; one after another, their loads had made the pass's longest wait).
"""

import ctypes
import json
import os
import selectors
import signal
import subprocess
import sys
import time

WORKERS_FLAG = "--rl-compile-ahead-workers"
DEFAULT_WORKERS = 8
END = "end"  # the kind of the job that ends a worker
PR_SET_PDEATHSIG = 1


def end_with_the_run(run_pid: int) -> None:
    """In a worker: killed when the run ends, however it ends (Linux's PR_SET_PDEATHSIG); the end
    of its input does not come while a process the run forked (megatron-core's save-results
    Manager) keeps a copy of the pipe."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != run_pid:  # the run ended before the line above
        sys.exit(0)


def workers_on_command_line(argv: list[str]) -> int:
    """The count the command line gives WORKERS_FLAG (read before the recipe: the workers start
    before the run's imports), else DEFAULT_WORKERS."""
    for index, arg in enumerate(argv):
        if arg == WORKERS_FLAG and index + 1 < len(argv):
            return int(argv[index + 1])
        if arg.startswith(WORKERS_FLAG + "="):
            return int(arg.split("=", 1)[1])
    return DEFAULT_WORKERS


class CompileWorkers:
    """`count` worker processes (`python -m megatron_rl_bi.compiling.worker`) fed JSON jobs, one
    at a time each; `wait` collects the outcome of every job sent. A worker that dies fails its
    job and takes no other: the run compiles what is left itself."""

    def __init__(self, count: int):
        self.processes = [subprocess.Popen([sys.executable, "-m", "megatron_rl_bi.compiling.worker", str(os.getpid())],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
                          for _ in range(count)]
        self.selector = selectors.DefaultSelector()
        self.current: dict[subprocess.Popen, dict | None] = {process: None for process in self.processes}
        for process in self.processes:
            os.set_blocking(process.stdout.fileno(), False)
            self.selector.register(process.stdout, selectors.EVENT_READ, process)
        self.queued: list[dict] = []
        self.results: list[dict] = []
        self.classes_compiled: set[str] = set()  # kernel classes whose first job has ended

    def submit(self, job: dict) -> None:
        """Queue `job` (after the jobs marked "first" when it is one, else last); it goes to the
        first worker free."""
        position = len(self.queued)
        if job.get("first"):
            position = next((i for i, queued in enumerate(self.queued) if not queued.get("first")), position)
        self.queued.insert(position, job)
        self._collect(timeout=0)
        self._dispatch()

    def _next_job(self, running_classes: set) -> dict | None:
        """The first queued job that may start, taken off the queue: one without a kernel class,
        of a class whose first job has ended, or the first of its class (none of it running)."""
        for index, job in enumerate(self.queued):
            kernel_class = job.get("kernel_class")
            if kernel_class is None or kernel_class in self.classes_compiled or kernel_class not in running_classes:
                return self.queued.pop(index)
        return None

    def _dispatch(self) -> None:
        running_classes = {job.get("kernel_class") for job in self.current.values() if job is not None}
        for process, held in self.current.items():
            if held is None and (job := self._next_job(running_classes)) is not None:
                running_classes.add(job.get("kernel_class"))
                self.current[process] = job
                try:
                    process.stdin.write(json.dumps(job) + "\n")
                except BrokenPipeError:
                    pass  # its end is read by _collect

    def _collect(self, timeout: float | None) -> None:
        for key, _ in self.selector.select(timeout):
            process, lines = key.data, key.fileobj.readlines()
            for line in lines:
                self._ended(process, json.loads(line))
            if not lines and process.poll() is not None:  # its end: the job it held fails
                self.selector.unregister(key.fileobj)
                job = self.current.pop(process)
                if job is not None:
                    self.results.append({"error": f"worker exited with code {process.returncode} on {job['name']}",
                                         "seconds": 0.0})

    def _ended(self, process: subprocess.Popen, answer: dict) -> None:
        """`process` answered for the job it held: the outcome kept, its kernel class compiled."""
        self.results.append(answer)
        if (job := self.current[process]) is not None and job.get("kernel_class") is not None:
            self.classes_compiled.add(job["kernel_class"])
        self.current[process] = None

    def wait(self, timeout: float = 900.0) -> dict:
        """Every job's outcome: {"jobs", "failed" (their messages), "compile_s" (the workers'
        seconds, summed), "longest" (the name and seconds of the longest job, or None), "wall_s"
        (this wait)}. Raises TimeoutError after `timeout` s."""
        started = time.perf_counter()
        while self.queued or any(job is not None for job in self.current.values()):
            if not self.current:
                self.results += [{"error": f"no worker left for {job['name']}", "seconds": 0.0} for job in self.queued]
                self.queued = []
                break
            if time.perf_counter() - started > timeout:
                raise TimeoutError(f"compile workers: jobs unfinished after {timeout} s")
            self._collect(timeout=1.0)
            self._dispatch()
        failed = [r["error"] for r in self.results if "error" in r]
        longest = max((r for r in self.results if "name" in r), key=lambda r: r["seconds"], default=None)
        return {"jobs": len(self.results), "failed": failed, "compile_s": sum(r["seconds"] for r in self.results),
                "longest": longest and {"name": longest["name"], "seconds": longest["seconds"]},
                "wall_s": time.perf_counter() - started}

    def close(self) -> None:
        """End the workers: the end job sent (the end of their input does not come while a process
        this one forked keeps the pipe), killed after 10 s."""
        for process in self.processes:
            try:
                process.stdin.write(json.dumps({"kind": END}) + "\n")
                process.stdin.close()
            except BrokenPipeError:
                pass  # a worker that died
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.selector.close()


def start_compile_workers(argv: list[str]) -> CompileWorkers | None:
    """The workers of this node's first process on a machine with an NVIDIA GPU (its other
    processes load what they compile), unless the command line gives WORKERS_FLAG 0."""
    count = workers_on_command_line(argv)
    first_on_node = os.environ.get("LOCAL_RANK", "0") == "0"
    asks_help = any(arg in ("-h", "--help", "--help-all") for arg in argv)
    if count <= 0 or asks_help or not first_on_node or not os.path.exists("/dev/nvidiactl"):
        return None
    return CompileWorkers(count)
