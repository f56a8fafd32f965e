"""Compile ahead (CPU): the compile workers (compiling/) and the pass that feeds them
(models/compile_ahead.py). Triton compiles for sm_90a without a GPU; the launches go through
Triton's own launch path with a driver that names the target and has no device, in a process
of their own without Triton's interpreter (the CPU tests' conftest turns it on)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from triton.backends.compiler import GPUTarget

from megatron_rl_bi.compiling import workers as compile_workers
from megatron_rl_bi.models.compile_ahead import KernelSender, dry_batches, dry_lengths, sending
from tests import REPO
from tests.sm90_spills import compiling_environment

from .conftest import run_after_loading_pretrain_rl

TARGET = GPUTarget("cuda", 90, 32)  # an H100's, as the run's driver names it

KERNELS = textwrap.dedent("""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_kernel(x, y, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + offsets, tl.load(x + offsets, mask=offsets < n), mask=offsets < n)
""")

LAUNCHES = textwrap.dedent("""
    import json
    import torch
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    from megatron_rl_bi.compiling.workers import CompileWorkers
    from megatron_rl_bi.models.compile_ahead import KernelSender
    from copy_kernels import copy_kernel  # the workers import it by its module's name

    TARGET = GPUTarget("cuda", 90, 32)

    class NoDevice:  # what a launch asks of the driver before it compiles
        def get_current_device(self): return 0
        def get_current_stream(self, device=None): return 0
        def get_current_target(self): return TARGET
        def get_active_torch_device(self): return torch.device("cpu")

    driver.set_active(NoDevice())
    compiled = []
    knobs.compilation.listener = lambda *, times, cache_hit, **_: compiled.append(cache_hit)
    workers = CompileWorkers(2)
    sender = KernelSender(workers, TARGET)
    knobs.runtime.jit_cache_hook = sender.triton_launch
    x, y = torch.ones(128), torch.zeros(128)
    for n in (128, 33, 128):  # two specializations: n a multiple of 16 and not
        copy_kernel[(1,)](x, y, n, BLOCK=128)
    knobs.runtime.jit_cache_hook = None
    in_sender = {"compiled": len(compiled), "y_sum": float(y.sum())}
    outcome = workers.wait()
    workers.close()
    specializations = [json.loads(job)["specialization"] for job in sender.sent]
    for specialization in specializations:  # Triton's own path from a specialization to a kernel
        copy_kernel.preload(specialization)
    print(json.dumps({"in_sender": in_sender, "sent": len(sender.sent), "jobs": outcome["jobs"],
                      "failed": outcome["failed"], "cache_hits_after": compiled}))
""")


# The compile workers' driver in these tests, set by the kernels' module, which a worker imports at
# its first job (after the package's modules, whose imports would take it for a GPU's): it names the
# target, has no device, and writes down each launcher it builds.
WORKERS_DRIVER = textwrap.dedent("""
    import json
    import os
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class WrittenDown:
        def __init__(self, src, metadata):
            with open(os.environ["LAUNCHERS_BUILT"], "a") as built:
                built.write(json.dumps({"kernel": metadata.name, "signature": src.signature,
                                        "attrs": str(src.attrs)}) + "\\n")

    class NoDevice:
        launcher_cls = WrittenDown
        def get_current_target(self): return GPUTarget("cuda", 90, 32)

    driver.set_active(NoDevice())
""")


def run_script(tmp_path, script: str) -> dict:
    path = tmp_path / "script.py"
    path.write_text(script)
    (tmp_path / "copy_kernels.py").write_text(KERNELS + WORKERS_DRIVER)
    environment = compiling_environment(TRITON_CACHE_DIR=str(tmp_path / "triton"), PYTHONPATH=f"{REPO}:{tmp_path}",
                                        LAUNCHERS_BUILT=str(tmp_path / "launchers.jsonl"))
    done = subprocess.run([sys.executable, str(path)], env=environment, cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_workers_compile_what_the_launches_would_and_nothing_compiles_or_runs_in_the_sender(tmp_path):
    result = run_script(tmp_path, LAUNCHES)
    assert result["in_sender"] == {"compiled": 0, "y_sum": 0.0}  # no compilation, no launch
    assert result["sent"] == 2 and result["jobs"] == 2 and result["failed"] == []  # the repeat sent once
    assert result["cache_hits_after"] == [True, True]  # Triton's own compile of each finds the workers'
    built = [json.loads(line) for line in (tmp_path / "launchers.jsonl").read_text().splitlines()]
    assert [launcher["kernel"] for launcher in built] == ["copy_kernel", "copy_kernel"]  # each job's launcher
    assert len({launcher["attrs"] for launcher in built}) == 2  # of each specialization


def test_a_failed_job_is_reported_and_the_others_go_on(tmp_path):
    workers = compile_workers.CompileWorkers(1)
    try:
        workers.submit({"kind": "triton", "name": "nowhere.kernel", "target": ["cuda", 90, 32],
                        "specialization": json.dumps({"name": "nowhere.kernel"})})
        workers.submit({"kind": "flash_attention_5", "name": "unknown kind"})
        outcome = workers.wait(timeout=120)
    finally:
        workers.close()
    assert outcome["jobs"] == 2
    assert outcome["failed"] == ["nowhere.kernel: ModuleNotFoundError: no module holds nowhere.kernel",
                                 "unknown kind: KeyError: 'flash_attention_5'"]


def test_a_worker_that_dies_fails_its_job_and_the_others_take_the_rest(tmp_path):
    workers = compile_workers.CompileWorkers(2)
    try:
        workers.submit({"kind": "unknown", "name": "first"})  # to the first worker, still importing
        dead = workers.processes[0]
        dead.kill()
        dead.wait()
        for name in ("second", "third"):
            workers.submit({"kind": "unknown", "name": name})
        outcome = workers.wait(timeout=120)
    finally:
        workers.close()
    assert outcome["jobs"] == 3
    assert outcome["failed"][0] == "worker exited with code -9 on first"  # the dead one's
    assert sorted(outcome["failed"][1:]) == ["second: KeyError: 'unknown'", "third: KeyError: 'unknown'"]


def test_without_workers_left_the_jobs_fail_and_the_wait_ends():
    workers = compile_workers.CompileWorkers(1)
    workers.submit({"kind": "unknown", "name": "first"})
    workers.processes[0].kill()
    workers.processes[0].wait()
    workers.submit({"kind": "unknown", "name": "second"})
    outcome = workers.wait(timeout=60)
    workers.close()
    assert outcome["failed"] == ["worker exited with code -9 on first", "no worker left for second"]


@pytest.mark.parametrize("argv, count", [([], compile_workers.DEFAULT_WORKERS),
                                         (["--rl-compile-ahead-workers", "3"], 3),
                                         (["--lr", "1", "--rl-compile-ahead-workers=0"], 0),
                                         (["--rl-compile-ahead-workers"], compile_workers.DEFAULT_WORKERS)])
def test_the_count_comes_from_the_command_line(argv, count):
    assert compile_workers.workers_on_command_line(argv) == count


def test_workers_start_on_a_gpu_machine_in_its_first_process_only(monkeypatch):
    gpu = {"/dev/nvidiactl": True}
    monkeypatch.setattr(compile_workers.os.path, "exists", lambda path: gpu.get(path, False))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    started = compile_workers.start_compile_workers(["--rl-compile-ahead-workers", "2"])
    assert len(started.processes) == 2
    for name in ("first", "second"):  # each worker past its imports (a loaded host's took over 10 s)
        started.submit({"kind": "unknown", "name": name})
    started.wait(timeout=300)
    started.close()
    assert all(process.returncode == 0 for process in started.processes)  # ended by their input's end
    assert compile_workers.start_compile_workers(["--rl-compile-ahead-workers", "0"]) is None
    assert compile_workers.start_compile_workers(["--help"]) is None
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert compile_workers.start_compile_workers([]) is None
    monkeypatch.setenv("LOCAL_RANK", "0")
    gpu.clear()
    assert compile_workers.start_compile_workers([]) is None


@pytest.mark.parametrize("max_length", [64, 4096])
def test_the_pass_batches_meet_each_class_in_each_pairing(max_length):
    batches = dry_batches(vocab_size=50, max_length=max_length)
    classes = [(b.input_ids.numel() % 16 == 0, b.num_sequences % 16 == 0, b.max_seqlen <= 32) for b in batches]
    assert sorted(classes[:2]) == [(False, False, False), (True, False, False)]  # sequences of several blocks
    assert sorted(classes[2:4]) == [(False, True, True), (True, True, True)]  # sequences of one block
    assert max(b.max_seqlen for b in batches) == min(300, max_length)
    assert all(int(b.input_ids.max()) < 50 for b in batches)


@pytest.mark.parametrize("max_length", [64, 4096])
def test_the_pass_batches_meet_each_gemm_tile_with_both_token_count_classes(max_length):
    """The BI GEMM's tile follows the token count (a decode step's few rows among them): each tile
    of bi.gemm.TILE_CONFIGS meets a count that is a multiple of 16 and one that is not, also when
    the model's sequences are short (a recipe's 64 tokens: the SFT warm-up's ~1,500-token batches
    then compiled the widest tile in the run)."""
    from megatron_rl_bi.bi.gemm import tile_config

    met = {(tile_config(b.input_ids.numel(), 0), b.input_ids.numel() % 16 == 0)
           for b in dry_batches(vocab_size=50, max_length=max_length)}
    tiles = {tile_config(m, 0) for m in (1, 100, 10_000)}
    assert len(tiles) == 3 and met == {(tile, divisible) for tile in tiles for divisible in (False, True)}


@pytest.mark.parametrize("shape, max_length, lengths", [
    ((37, 300, 5), 4096, [300] + [8] * 35 + [17]),  # 597 tokens: 5 modulo 16
    ((2, 300, 3), 64, [64, 19]),  # the first cut to the model's length, the residue kept
    ((16, 8, 5), 12, [8] * 15 + [12])])  # the last cut too: the residue as it comes
def test_the_last_sequence_grows_to_make_the_token_counts_residue(shape, max_length, lengths):
    assert dry_lengths(*shape, max_length) == lengths


def test_no_pass_sequence_is_longer_than_the_model_takes():
    assert max(b.max_seqlen for b in dry_batches(vocab_size=50, max_length=12)) == 12


class RecordingWorkers:
    def __init__(self):
        self.jobs = []

    def submit(self, job):
        self.jobs.append(job)


class Core:
    def __init__(self):
        self.varlen = self.own_varlen

    def own_varlen(self, *args, **kwargs):
        raise AssertionError("the pass ran the attention")


def test_a_flash_attention_call_is_sent_once_with_its_shapes_and_answered_with_empty_tensors():
    workers = RecordingWorkers()
    sender = KernelSender(workers, TARGET)
    q = torch.randn(12, 4, 8, requires_grad=True)
    kv = torch.randn(12, 16, 2).transpose(1, 2).requires_grad_()  # [12, 2, 16], not contiguous
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    core = Core()
    with sending([core], sender):
        outs = [core.varlen(q, kv[..., :8], kv, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7, max_seqlen_k=7,
                            causal=True, num_splits=1) for _ in range(2)]
    assert core.varlen == core.own_varlen  # put back
    assert outs[0].shape == (12, 4, 16)
    outs[0].sum().backward()
    assert q.grad.shape == q.shape and kv.grad.shape == kv.shape
    forward, backward = workers.jobs  # its two parts, each a job of its own
    assert (forward["part"], backward["part"]) == ("forward", "backward")
    for job in (forward, backward):
        assert job["kind"] == "flash_attention" and job["grad"] is True and job["first"] is True
        assert job["tensors"]["q"] == {"shape": [12, 4, 8], "stride": [32, 8, 1], "dtype": "float32"}
        assert job["tensors"]["v"] == {"shape": [12, 2, 16], "stride": [32, 1, 2], "dtype": "float32"}
        assert job["kwargs"] == {"cu_seqlens_q": {"values": [0, 5, 12], "dtype": "int32"},
                                 "cu_seqlens_k": {"values": [0, 5, 12], "dtype": "int32"},
                                 "max_seqlen_q": 7, "max_seqlen_k": 7, "causal": True, "num_splits": 1}
    assert forward["kernel_class"] != backward["kernel_class"]  # the two parts compile side by side


def test_integer_tensors_of_either_width_are_sent_by_value():
    workers = RecordingWorkers()
    q = torch.randn(4, 2, 8)
    KernelSender(workers, TARGET).flash_attention(q, q, q, seqused_k=torch.tensor([3, 1]),
                                                  page_table=torch.tensor([[0, 1]], dtype=torch.int32))
    assert workers.jobs[0]["kwargs"] == {"seqused_k": {"values": [3, 1], "dtype": "int64"},
                                         "page_table": {"values": [[0, 1]], "dtype": "int32"}}


def _attention_jobs(calls) -> list[dict]:
    """The jobs a sender makes of FlashAttention-4 calls (tokens, heads, grad)."""
    workers, core = RecordingWorkers(), Core()
    with sending([core], KernelSender(workers, TARGET)):
        for tokens, heads, grad in calls:
            q = torch.randn(tokens, heads, 8, requires_grad=grad)
            cu = torch.tensor([0, tokens // 2, tokens], dtype=torch.int32)
            core.varlen(q, q[:, :2], q[:, :2], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7, max_seqlen_k=7)
    return workers.jobs


def test_a_call_without_gradients_sends_its_forward_only():
    with torch.no_grad():
        jobs = _attention_jobs([(12, 4, True)])
    assert [(job["part"], job["grad"]) for job in jobs] == [("forward", False)]


def test_calls_that_differ_in_token_counts_only_are_one_class():
    jobs = _attention_jobs([(12, 4, False), (20, 4, False), (12, 6, False), (12, 4, True)])
    assert len(jobs) == 5  # each call is sent: its kernel may differ all the same
    classes = [job["kernel_class"] for job in jobs]
    assert classes[0] == classes[1]  # 12 and 20 tokens
    assert len({classes[0], *classes[2:]}) == 4  # other heads; with gradients (another forward), its backward


class Pipe:
    def __init__(self):
        self.lines = []

    def write(self, line):
        self.lines.append(json.loads(line))


def _pool(running: list) -> compile_workers.CompileWorkers:
    """A pool without processes whose workers hold `running` (None: free), their input recorded."""
    pool = compile_workers.CompileWorkers(0)
    pool.current = {type("Process", (), {"stdin": Pipe()})(): job for job in running}
    return pool


def test_long_jobs_are_queued_ahead_of_the_others_in_their_order():
    pool = _pool([])
    for name, first in (("a", True), ("b", True), ("c", False), ("d", True), ("e", False)):
        pool.submit({"name": name, "first": first})
    assert [job["name"] for job in pool.queued] == ["a", "b", "d", "c", "e"]


def test_the_first_job_of_a_class_runs_alone_and_the_others_side_by_side_after_it():
    pool = _pool([{"name": "x1", "kernel_class": "x"}, None, None, None, None])
    for name, cls in (("x2", "x"), ("x3", "x"), ("y1", "y"), ("y2", "y"), ("z", None)):
        pool.queued.append({"name": name, "kernel_class": cls})
    pool._dispatch()
    x_holder, y_holder, z_holder, free, other_free = pool.current
    assert [p.stdin.lines for p in (y_holder, z_holder, free)] == [[{"name": "y1", "kernel_class": "y"}],
                                                                   [{"name": "z", "kernel_class": None}], []]
    assert [job["name"] for job in pool.queued] == ["x2", "x3", "y2"]  # x1 and y1 run: their classes wait
    pool._ended(z_holder, {"name": "z", "seconds": 1.0})  # a job without a class opens none
    pool._dispatch()
    assert [job["name"] for job in pool.queued] == ["x2", "x3", "y2"]
    pool._ended(x_holder, {"name": "x1", "seconds": 4.0})  # x compiled: x2 and x3 go at once
    pool._dispatch()
    assert [x_holder.stdin.lines[-1]["name"], z_holder.stdin.lines[-1]["name"]] == ["x2", "x3"]
    assert [job["name"] for job in pool.queued] == ["y2"] and not free.stdin.lines
    assert pool.results == [{"name": "z", "seconds": 1.0}, {"name": "x1", "seconds": 4.0}]


def test_the_outcome_names_the_longest_job(tmp_path):
    workers = compile_workers.CompileWorkers(2)
    try:
        for name in ("first", "second"):
            workers.submit({"kind": "unknown", "name": name})
        outcome = workers.wait(timeout=300)
    finally:
        workers.close()
    longest = max(result["seconds"] for result in workers.results)
    assert outcome["longest"]["seconds"] == longest and outcome["longest"]["name"] in ("first", "second")


def test_the_outcome_sums_every_jobs_seconds_and_names_the_longest_answered_one():
    pool = _pool([])
    pool.results = [{"name": "a", "seconds": 1.5}, {"name": "b", "error": "b: KeyError: 'x'", "seconds": 2.0},
                    {"error": "worker exited with code -9 on c", "seconds": 0.0}]
    outcome = pool.wait()
    assert (outcome["jobs"], outcome["compile_s"], outcome["longest"]) == (3, 3.5, {"name": "b", "seconds": 2.0})
    assert outcome["failed"] == ["b: KeyError: 'x'", "worker exited with code -9 on c"]
    pool.results = [{"error": "worker exited with code -9 on c", "seconds": 0.0}]
    assert pool.wait()["longest"] is None  # a dead worker's job has no answer


def test_a_worker_answers_each_job_with_its_seconds_and_error_until_the_end_job(monkeypatch):
    import io
    import types

    from megatron_rl_bi.compiling import worker

    answers = io.StringIO()
    monkeypatch.setattr(worker, "os", types.SimpleNamespace(dup=lambda fd: fd, dup2=lambda *_: None,
                                                            fdopen=lambda *_, **__: answers))
    monkeypatch.setattr(worker, "import_kernel_modules", lambda: None)

    def failing(job):
        raise ValueError("no")
    monkeypatch.setattr(worker, "COMPILERS", {"triton": lambda job: None, "flash_attention": failing})
    clock = iter([1.0, 3.5, 4.0, 4.25])
    monkeypatch.setattr(worker, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    jobs = [{"kind": "triton", "name": "a"}, {"kind": "flash_attention", "name": "b"}, {"kind": "end"},
            {"kind": "triton", "name": "after the end"}]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(json.dumps(job) + "\n" for job in jobs)))
    worker.main()
    assert [json.loads(line) for line in answers.getvalue().splitlines()] == [
        {"name": "a", "seconds": 2.5}, {"name": "b", "error": "b: ValueError: no", "seconds": 0.25}]


def test_sending_puts_back_the_hook_and_the_cores_after_an_error():
    from triton import knobs

    before, core = knobs.runtime.jit_cache_hook, Core()
    sender = KernelSender(None, TARGET)
    with pytest.raises(RuntimeError), sending([core], sender):
        assert knobs.runtime.jit_cache_hook == sender.triton_launch
        raise RuntimeError
    assert knobs.runtime.jit_cache_hook is before and core.varlen == core.own_varlen


def test_the_worker_module_runs_alone():
    """`python -m megatron_rl_bi.compiling.worker` ends at its input's end, answering nothing."""
    done = subprocess.run([sys.executable, "-m", "megatron_rl_bi.compiling.worker", str(os.getpid())], input="",
                          capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert done.returncode == 0 and done.stdout == ""


def test_close_ends_the_workers_while_a_forked_process_keeps_their_input_open():
    """pretrain_rl forks megatron-core's save-results Manager after the workers start: it holds a
    copy of their pipes, so the end of their input never came (80 s of waits per run on an H100)."""
    workers = compile_workers.CompileWorkers(2)
    for name in ("first", "second"):  # each worker past its imports, as at a run's close
        workers.submit({"kind": "unknown", "name": name})
    workers.wait(timeout=300)
    holder = os.fork()
    if holder == 0:
        time.sleep(60)
        os._exit(0)
    try:
        started = time.perf_counter()
        workers.close()
        assert time.perf_counter() - started < 5  # none waited for 10 s and was killed
        assert [process.returncode for process in workers.processes] == [0, 0]
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)


RUN_THAT_DIES = textwrap.dedent("""
    import os
    from megatron_rl_bi.compiling.workers import CompileWorkers
    import time
    workers = CompileWorkers(1)
    workers.submit({"kind": "unknown", "name": "first"})
    workers.wait(timeout=300)  # the worker running, past its start
    holder = os.fork()  # keeps the workers' input open, as the save-results Manager does
    if holder == 0:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)  # not the test's pipes, which its wait for this process reads to their end
        os.dup2(null, 2)
        time.sleep(30)
        os._exit(0)
    print(workers.processes[0].pid, holder, flush=True)
    os._exit(3)  # no close: a crash
""")


def test_the_workers_end_with_the_run_however_it_ends():
    done = subprocess.run([sys.executable, "-c", RUN_THAT_DIES], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    worker, holder = map(int, done.stdout.split())
    try:
        for _ in range(100):
            if not os.path.exists(f"/proc/{worker}") or " Z " in open(f"/proc/{worker}/stat").read():
                return
            time.sleep(0.1)
        os.kill(worker, signal.SIGKILL)
        raise AssertionError("the worker outlived its run by 10 s")
    finally:
        os.kill(holder, signal.SIGKILL)


class FakeDDP(torch.nn.Module):
    """What the pass asks of megatron-core's DDP, with a weight whose gradient lands in a buffer."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3))
        self.calls = []

    @contextlib.contextmanager
    def no_sync(self):
        self.calls.append("no_sync")
        yield

    def zero_grad_buffer(self):
        self.calls.append("zero_grad_buffer")
        self.weight.grad = None


@pytest.fixture
def cpu_pass(monkeypatch):
    """compile_ahead on the CPU: stand-ins for the CUDA generator's state and the tracker's."""
    from megatron_rl_bi.models import compile_ahead as module

    tracker = type("Tracker", (), {"states": {"model-parallel": 7}, "cuda": "cuda 7"})()
    tracker.get_states = lambda: dict(tracker.states)
    tracker.set_states = lambda states: setattr(tracker, "states", states)
    monkeypatch.setattr(module, "get_cuda_rng_tracker", lambda: tracker)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: tracker.cuda)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state: setattr(tracker, "cuda", state))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(torch.distributed, "barrier", lambda: None)
    driver = type("Driver", (), {"get_current_target": lambda self: TARGET})()
    monkeypatch.setattr(module, "driver", type("Drivers", (), {"active": driver})())
    return module, tracker


def test_the_pass_leaves_no_trace(cpu_pass, monkeypatch):
    module, tracker = cpu_pass
    ddp, seen = FakeDDP(), []

    def forward(model, batch):  # draws from the generators, as a model with dropout would
        seen.append((batch.input_ids.numel(), torch.rand(1).item(), module.autotune._keep_picks))
        tracker.states, tracker.cuda = {"model-parallel": 8}, "cuda 8"
        return (model.weight * batch.input_ids.numel()).sum().unsqueeze(0), None
    monkeypatch.setattr(module, "forward_logprobs", forward)
    rng = torch.get_rng_state()
    workers = type("Workers", (), {"wait": lambda self: {"jobs": 0}, "submit": lambda self, job: None})()
    assert module.compile_ahead(ddp, workers, vocab_size=50, max_length=64) == {"jobs": 0}
    assert len(seen) == len(module.DRY_SHAPES) and not any(keep for _, _, keep in seen)  # autotuners kept nothing meanwhile
    assert torch.equal(torch.get_rng_state(), rng) and tracker.states == {"model-parallel": 7}
    assert tracker.cuda == "cuda 7"
    assert ddp.calls == ["no_sync", "zero_grad_buffer"] and ddp.weight.grad is None
    assert module.autotune._keep_picks


def test_the_engines_kernels_are_sent_first_where_the_engine_runs_in_the_process(cpu_pass, monkeypatch):
    module, _ = cpu_pass
    sent = []
    monkeypatch.setattr(module, "send_engine_kernels", lambda ddp, sender, *pages: sent.append(pages))
    monkeypatch.setattr(module, "forward_logprobs", lambda model, batch: (sent.append("batch") or
                                                                          model.weight.sum().unsqueeze(0), None))
    workers = type("Workers", (), {"wait": lambda self: {"jobs": 0}, "submit": lambda self, job: None})()
    module.compile_ahead(FakeDDP(), workers, vocab_size=50, max_length=64, engine_pages=(256, 1024))
    assert sent == [(256, 1024)] + ["batch"] * len(module.DRY_SHAPES)
    sent.clear()
    module.compile_ahead(FakeDDP(), workers, vocab_size=50, max_length=64)  # an engine in processes of its own
    assert sent == ["batch"] * len(module.DRY_SHAPES)


def test_the_pass_runs_the_model_in_training_mode(cpu_pass, monkeypatch):
    module, _ = cpu_pass
    ddp, modes = FakeDDP().eval(), []
    monkeypatch.setattr(module, "forward_logprobs", lambda model, batch: (modes.append(model.training) or
                                                                          model.weight.sum().unsqueeze(0), None))
    module.compile_ahead(ddp, None, vocab_size=50, max_length=64)
    assert modes == [True] * len(module.DRY_SHAPES)


def test_every_rank_meets_the_others_after_the_workers_are_done(cpu_pass, monkeypatch):
    module, _ = cpu_pass
    events = []
    monkeypatch.setattr(module, "forward_logprobs", lambda model, batch: (model.weight.sum().unsqueeze(0), None))
    monkeypatch.setattr(torch.distributed, "barrier", lambda: events.append("barrier"))
    workers = type("Workers", (), {"wait": lambda self: events.append("wait") or {"jobs": 0},
                                   "submit": lambda self, job: None})()
    module.compile_ahead(FakeDDP(), workers, vocab_size=50, max_length=64)
    module.compile_ahead(FakeDDP(), None, vocab_size=50, max_length=64)  # a rank without workers
    assert events == ["wait", "barrier", "barrier"]


def test_a_moe_model_is_left_to_its_first_step():
    from megatron_rl_bi.models.compile_ahead import compile_ahead_problem

    model = torch.nn.Linear(1, 1)
    model.config = type("Config", (), {"num_moe_experts": None})()
    assert compile_ahead_problem(model) is None
    model.config.num_moe_experts = 4
    assert compile_ahead_problem(model).startswith("a MoE router")


def test_a_pass_that_fails_still_zeroes_the_gradients_and_puts_everything_back(cpu_pass, monkeypatch):
    from triton import knobs

    module, tracker = cpu_pass
    ddp, hook = FakeDDP(), knobs.runtime.jit_cache_hook

    def forward(model, batch):
        model.weight.sum().backward()
        raise RuntimeError("a kernel the pass could not take")
    monkeypatch.setattr(module, "forward_logprobs", forward)
    with pytest.raises(RuntimeError, match="could not take"):
        module.compile_ahead(ddp, None, vocab_size=50, max_length=64)
    assert ddp.calls == ["no_sync", "zero_grad_buffer"] and ddp.weight.grad is None
    assert knobs.runtime.jit_cache_hook is hook and module.autotune._keep_picks


def _attention_layer(megatron_attention):
    """megatron-core's SelfAttention with what its flash_decode_and_prefill reads, and no weights:
    8 query heads over 2 groups of 64 channels, FlashAttention-4, BI mode."""
    layer = object.__new__(megatron_attention.SelfAttention)
    torch.nn.Module.__init__(layer)
    layer.config = type("Config", (), {"window_size": None, "window_attn_skip_freq": None,
                                       "params_dtype": torch.bfloat16})()
    layer.layer_number, layer.flash_attention_version, layer.batch_invariant_mode = 3, 4, True
    layer.num_attention_heads_per_partition, layer.num_query_groups_per_partition = 8, 2
    layer.hidden_size_per_attention_head = 64
    return layer


def test_the_engines_attention_is_sent_from_megatron_cores_own_call(monkeypatch):
    """The engine's prefill (long and short prompts) and decode calls, as megatron-core's
    Attention.flash_decode_and_prefill makes them (BI mode's one split among its keywords), over
    pages of the engine's block size: jobs without a backward; the layer's mode and megatron-core's
    FlashAttention-4 function put back."""
    from megatron.core.transformer import attention as megatron_attention

    from megatron_rl_bi.models.compile_ahead import send_engine_attention

    monkeypatch.setattr(megatron_attention, "HAVE_FA4", True)
    monkeypatch.setattr(megatron_attention, "flash_attn4_varlen_func", "FlashAttention-4", raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    workers, model = RecordingWorkers(), torch.nn.Sequential(_attention_layer(megatron_attention)).train()
    send_engine_attention(model, KernelSender(workers, TARGET), block_size=256, max_length=1000)
    assert model[0].training and megatron_attention.flash_attn4_varlen_func == "FlashAttention-4"
    assert [(job["part"], job["grad"]) for job in workers.jobs] == [("forward", False)] * 3
    queries = [job["kwargs"]["cu_seqlens_q"]["values"] for job in workers.jobs]
    assert queries == [[0, 300, 308], [0, 8, 16], [0, 1, 2]]  # a long prompt, short ones, a decode step
    assert [job["kwargs"]["seqused_k"]["values"] for job in workers.jobs] == [[300, 8], [8, 8], [301, 9]]
    for job in workers.jobs:
        assert job["tensors"]["q"]["shape"][1:] == [8, 64]
        assert job["tensors"]["k"] == {"shape": [8, 256, 2, 64], "stride": [32768, 128, 64, 1], "dtype": "bfloat16"}
        assert job["kwargs"]["page_table"]["values"] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # 1,000 tokens: 4 pages
        assert job["kwargs"]["num_splits"] == 1 and job["kwargs"]["causal"] is True


def test_each_attention_layers_kv_append_is_sent_at_each_token_count_class(monkeypatch):
    """megatron-core's KV append of each attention layer (FlashAttention-4's or not), at one token,
    a multiple of 16 and another, into a cache whose layer slice has the strides of the engine's
    (megatron-core's memory buffer: key and value, layers, pages, page, groups, channels), with
    the bookkeeping's index dtypes; the layers' modes put back."""
    from megatron.core.transformer import attention as megatron_attention

    from megatron_rl_bi.models import compile_ahead

    monkeypatch.setattr(megatron_attention, "HAVE_FA4", True)
    monkeypatch.setattr(megatron_attention, "flash_attn4_varlen_func", "FlashAttention-4", raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    appends = []
    monkeypatch.setattr(compile_ahead, "triton_append_key_value_cache", lambda *args: appends.append(args))
    layers = [_attention_layer(megatron_attention), _attention_layer(megatron_attention)]
    layers[1].flash_attention_version = 3
    model = torch.nn.Sequential(*layers).train()
    compile_ahead.send_engine_kernels(model, KernelSender(RecordingWorkers(), TARGET), block_size=256, max_length=1024)
    assert all(layer.training for layer in layers)
    assert [args[4] for args in appends] == [1, 16, 17] * 2
    engine_layer_slice = torch.empty(2, 3, 5, 256, 2, 64)[0, 1]
    for layer_number, key, value, cache, tokens, pages, positions in appends:
        assert key.shape == value.shape == (tokens, 1, 2, 64) and key.dtype == torch.bfloat16
        assert cache[0, layer_number].stride() == engine_layer_slice.stride()
        assert (pages.dtype, positions.dtype) == (torch.int64, torch.int32) and len(pages) == tokens


def test_each_gdn_layers_state_stores_are_sent_in_eval_mode_and_its_mode_put_back(monkeypatch):
    from megatron_rl_bi.models import compile_ahead
    from megatron_rl_bi.models.gdn import SwitchedGatedDeltaNet

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    stores, layers = [], [object.__new__(SwitchedGatedDeltaNet) for _ in range(2)]
    for layer in layers:
        torch.nn.Module.__init__(layer)
        layer.dry_state_stores = lambda device, layer=layer: stores.append((layer, device, layer.training))
    model = torch.nn.Sequential(*layers).train()
    layers[1].eval()
    compile_ahead.send_engine_kernels(model, KernelSender(RecordingWorkers(), TARGET), block_size=256, max_length=1024)
    assert stores == [(layers[0], "cpu", False), (layers[1], "cpu", False)]
    assert [layer.training for layer in layers] == [True, False]


def test_no_engine_call_is_longer_than_the_engine_takes():
    from megatron_rl_bi.models.compile_ahead import engine_steps

    steps = engine_steps(64)
    assert max(n for queries, _, _ in steps for n in queries) == 63  # a prompt leaves room for a token
    assert max(n for _, keys, _ in steps for n in keys) == 64


@pytest.fixture
def flash_attention_4(monkeypatch):
    """FlashAttention-4's varlen function as the worker meets it (flash_attn.cute, its interface's
    forward kernel call, an autograd function), on the CPU: the kernels it calls recorded."""
    import types

    from megatron_rl_bi.compiling import worker

    calls = []

    def forward_kernel(q, k, v, cu_seqlens_q=None, **_):
        calls.append("forward")
        return torch.zeros(*q.shape[:-1], v.shape[-1]), torch.zeros(q.shape[1], q.shape[0]), None, None, None

    class Varlen(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, cu_seqlens_q):
            out, lse, *_ = interface._flash_attn_fwd(q, k, v, cu_seqlens_q=cu_seqlens_q)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, grad):
            q, k, v, out, lse = ctx.saved_tensors
            calls.append(("backward", list(out.shape), list(lse.shape)))
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None

    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_fwd = forward_kernel
    cute = types.ModuleType("flash_attn.cute")
    cute.interface = interface
    cute.flash_attn_varlen_func = lambda q, k, v, cu_seqlens_q=None, **_: (Varlen.apply(q, k, v, cu_seqlens_q), None)
    for name, module in (("flash_attn", types.ModuleType("flash_attn")), ("flash_attn.cute", cute),
                         ("flash_attn.cute.interface", interface)):
        monkeypatch.setitem(sys.modules, name, module)

    def on_the_cpu(description, requires_grad):
        if "values" in description:
            return torch.tensor(description["values"], dtype=getattr(torch, description["dtype"]))
        return torch.randn(description["shape"]).requires_grad_(requires_grad)
    monkeypatch.setattr(worker, "_tensor", on_the_cpu)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    return worker, interface, forward_kernel, calls


@pytest.mark.parametrize("part, kernels", [("forward", ["forward"]), ("backward", [("backward", [12, 4, 16], [4, 12])])])
def test_a_flash_attention_job_runs_its_part_alone(flash_attention_4, part, kernels):
    """The forward job runs the forward kernel; the backward job the backward kernel, after a
    forward whose kernel call is skipped (its output and log-sum-exp of the shapes it gives)."""
    worker, interface, forward_kernel, calls = flash_attention_4
    job = {"part": part, "grad": True, "kwargs": {"cu_seqlens_q": {"values": [0, 5, 12], "dtype": "int32"}},
           "tensors": {"q": {"shape": [12, 4, 8]}, "k": {"shape": [12, 2, 8]}, "v": {"shape": [12, 2, 16]}}}
    worker.compile_flash_attention(job)
    assert calls == kernels and interface._flash_attn_fwd is forward_kernel


def test_without_flash_attention_4_layers_the_engine_sends_nothing(monkeypatch):
    """FlashAttention-3's kernels come compiled, and megatron-core then has no FA4 function."""
    from megatron.core.transformer import attention as megatron_attention

    from megatron_rl_bi.models.compile_ahead import send_engine_attention

    monkeypatch.delattr(megatron_attention, "flash_attn4_varlen_func", raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    layer = _attention_layer(megatron_attention)
    layer.flash_attention_version = 3
    workers = RecordingWorkers()
    send_engine_attention(torch.nn.Sequential(layer), KernelSender(workers, TARGET), block_size=256, max_length=1024)
    assert workers.jobs == []


COMPILE_KERNELS_AHEAD = textwrap.dedent("""
    import argparse, json
    class Workers:
        processes = [1, 2]
        closed = 0
        def close(self): Workers.closed += 1
    def failing(*_):
        raise RuntimeError("no")
    def ran(*_):
        return {"jobs": 3, "failed": [], "compile_s": 4.0, "longest": None, "wall_s": 2.5}
    args = argparse.Namespace(batch_invariant_mode=True, rl_compile_ahead_workers=2, seq_length=64)
    found = []
    for problem, compile_ahead in ((None, ran), (None, failing), ("a MoE router", ran)):
        pretrain_rl.compile_ahead_problem = lambda ddp: problem
        pretrain_rl.compile_ahead = compile_ahead
        found.append(pretrain_rl.compile_kernels_ahead(args, None, Workers(), 100, None))
    pretrain_rl.compile_ahead_problem = lambda ddp: None
    args.rl_compile_ahead_workers = 0
    found.append(pretrain_rl.compile_kernels_ahead(args, None, Workers(), 100, None))
    args.batch_invariant_mode, args.rl_compile_ahead_workers = False, 2
    found.append(pretrain_rl.compile_kernels_ahead(args, None, Workers(), 100, None))
    for record in found:
        assert record.pop("time/startup_compile_ahead_s") >= 0
    print(json.dumps({"records": found, "closed": Workers.closed}))
""")


def test_the_start_up_record_has_the_wait_for_the_workers_and_their_work_apart():
    """compile_kernels_ahead's record: its seconds, of them the workers' wait, and the workers'
    jobs and compiling seconds (the outcome's); no wait and no work when the pass failed, was off
    for the model, or did not run (default mode, or no workers asked for). The workers are ended
    wherever the pass was on (where it was not, main ends them)."""
    found = json.loads(run_after_loading_pretrain_rl(COMPILE_KERNELS_AHEAD))
    ran = {"time/startup_compile_ahead_wait_s": 2.5, "compile_ahead/jobs": 3, "time/compile_ahead_workers_s": 4.0}
    assert found["records"] == [ran] + [{"time/startup_compile_ahead_wait_s": 0.0}] * 4
    assert found["closed"] == 3
