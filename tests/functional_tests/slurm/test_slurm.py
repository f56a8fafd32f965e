"""The slurm launchers under a real Slurm (CPU, no GPU): a local cluster of two emulated nodes
(cluster.sh), the example scripts submitted as a user would, with --launch-check, which does
everything up to the first GPU work. Checked: `sbatch --nodes 2` gives 4 processes, every rank
once, the data-parallel group a run needs, on both nodes, and the log lands in the submit
directory under the name the script's header gives; a process that fails on one node ends the
whole job with no process left behind; pointed at a checkpoint (a requeued job's --save/--load),
the check reports the step it would resume from, and refuses one written by another number of
ranks. What only a GPU cluster can test (NCCL across nodes, the GPU work itself) is not here."""

import os
import pathlib
import re
import subprocess
import time

import pytest
import torch

from ... import REPO

pytestmark = pytest.mark.slurm

CLUSTER = pathlib.Path(__file__).with_name("cluster.sh")
TINY = ["--recipe", "examples/recipes/tiny_sort.yaml", "--batch-invariant-mode", "--flash-attention-version", "4"]
# The scripts' documented environment; no GPU here: the jobs ask for none, as on CPU nodes.
ENV = {"VENV": str(pathlib.Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv"))), "GPUS_PER_NODE": "2"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    installed = subprocess.run(["bash", str(CLUSTER), "install"], capture_output=True, text=True)
    if installed.returncode:
        pytest.skip(f"no local Slurm cluster: {installed.stderr.strip()}")
    directory = tmp_path_factory.mktemp("slurm")
    subprocess.run(["bash", str(CLUSTER), "start", str(directory)], check=True)
    try:
        yield {**os.environ, **ENV, "SLURM_CONF": str(directory / "slurm.conf")}
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop", str(directory)], check=False)


def _submit(env, script: str, *args: str, sbatch: tuple[str, ...] = ()) -> tuple[str, str, str]:
    """Submits from the repository's root (as the scripts say); (job id, final state, log text).
    The log is removed from the submit directory once read."""
    job = subprocess.run(["sbatch", "--parsable", *sbatch, script, *args], cwd=REPO, env=env, check=True,
                         capture_output=True, text=True).stdout.strip()
    for _ in range(240):  # 2 minutes
        state = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
        found = re.search(r"JobState=(\w+)", state)
        if found and found.group(1) not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            break
        time.sleep(0.5)
    else:
        subprocess.run(["scancel", job], env=env)
        pytest.fail(f"job {job} did not end within 2 minutes")
    name = re.search(r"#SBATCH --job-name=(\S+)", (REPO / script).read_text()).group(1)
    log = REPO / f"{name}-{job}.out"  # the header's --output=%x-%j.out, in the submit directory
    assert log.is_file(), f"no {log.name} in the submit directory"
    text = log.read_text()
    log.unlink()
    return job, found.group(1), text


def _processes(log: str) -> list[tuple[int, int, str, str]]:
    return [(int(rank), int(world), node, group) for rank, world, node, group in re.findall(
        r"launch check: rank (\d+) of (\d+) on (\S+) \(local rank \d+\), data-parallel group (\[[\d, ]+\])", log)]


def test_two_nodes_of_two_processes(cluster):
    job, state, log = _submit(cluster, "examples/slurm/pretrain_rl.sbatch", *TINY, "--launch-check",
                              sbatch=("--nodes", "2"))
    assert state == "COMPLETED", log[-3000:]
    processes = _processes(log)
    assert sorted(p[0] for p in processes) == [0, 1, 2, 3] and {p[1] for p in processes} == {4}
    assert sorted(p[2] for p in processes) == ["node1", "node1", "node2", "node2"]
    assert {p[3] for p in processes} == {"[0, 1, 2, 3]"}
    assert "launch check passed: 4 processes on 2 nodes (node1, node2); no --load: would start a fresh run" in log


def test_without_gpus_per_node_a_node_runs_one_process(cluster):
    """The header asks for no GPUs (a CPU node's pre-flight needs none); without GPUS_PER_NODE and
    without GPUs given, one process a node."""
    env = {k: v for k, v in cluster.items() if k != "GPUS_PER_NODE"}
    job, state, log = _submit(env, "examples/slurm/pretrain_rl.sbatch", *TINY, "--launch-check",
                              sbatch=("--nodes", "2"))
    assert state == "COMPLETED", log[-3000:]
    assert "launch check passed: 2 processes on 2 nodes (node1, node2)" in log


def test_the_parity_script(cluster):
    job, state, log = _submit(cluster, "examples/slurm/check_parity.sbatch", "--launch-check")
    assert state == "COMPLETED", log[-3000:]
    assert "launch check passed: 1 processes on 1 nodes" in log


def test_a_process_failing_on_one_node_ends_the_job(cluster, tmp_path):
    """Every Python process of node2 exits at start (sitecustomize); node1's processes, which
    would wait for their peers, are ended by srun --kill-on-bad-exit."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('SLURMD_NODENAME') == 'node2':\n    os._exit(3)\n")
    env = {**cluster, "PYTHONPATH": str(tmp_path)}
    started = time.time()
    job, state, log = _submit(env, "examples/slurm/pretrain_rl.sbatch", *TINY, "--launch-check",
                              sbatch=("--nodes", "2"))
    assert state == "FAILED" and time.time() - started < 100
    assert "launch check passed" not in log
    for _ in range(20):  # srun's kill reaches node1's processes a moment after the job's end
        left = subprocess.run(["pgrep", "-a", "-f", "pretrain_rl.py"], capture_output=True, text=True).stdout
        if not left:
            break
        time.sleep(0.5)
    assert left == "", f"processes left behind 10 s after the job's end: {left}"


def _checkpoint(root: pathlib.Path, step: int, ranks: int) -> None:
    (root / f"iter_{step:07d}").mkdir(parents=True)
    torch.save({"step": step, "ranks": [{"step": step, "seed": 1234}] * ranks},
               root / f"iter_{step:07d}" / "rl_state.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(f"{step}\n")


def test_a_requeued_job_reports_the_step_it_resumes_from(cluster, tmp_path):
    _checkpoint(tmp_path / "ckpt", 7, ranks=4)
    flags = ("--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"))
    job, state, log = _submit(cluster, "examples/slurm/pretrain_rl.sbatch", *TINY, *flags, "--launch-check",
                              sbatch=("--nodes", "2"))
    assert state == "COMPLETED", log[-3000:]
    assert f"would resume from {tmp_path / 'ckpt' / 'iter_0000007'} (step 7)" in log
    _checkpoint(tmp_path / "other", 3, ranks=2)
    flags = ("--save", str(tmp_path / "other"), "--load", str(tmp_path / "other"))
    job, state, log = _submit(cluster, "examples/slurm/pretrain_rl.sbatch", *TINY, *flags, "--launch-check",
                              sbatch=("--nodes", "2"))
    assert state == "FAILED"
    assert "was written by 2 data-parallel ranks; this launch has 4" in log
