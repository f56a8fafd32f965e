"""pretrain_rl.py reads and checks every input before CUDA is touched (CPU): the tiny recipe gets
as far as the distributed set-up, and bad input ends the run with a message naming it, no
traceback."""

import importlib.util
import os

import pytest

from .. import REPO
from .conftest import free_port, run_after_loading_pretrain_rl

TINY = ["--recipe", os.path.join(REPO, "examples", "recipes", "tiny_sort.yaml"), "--flash-attention-version", "4"]


class ReachedTheGPU(Exception):
    pass


@pytest.fixture
def pretrain_rl(monkeypatch):
    spec = importlib.util.spec_from_file_location("pretrain_rl", os.path.join(REPO, "pretrain_rl.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "installed_kernel_problem", lambda args: None)  # FA4 is GPU-only
    # no Manager process forked from pytest's (test_checkpoint_save_queue.py runs the real one)
    monkeypatch.setattr(module, "start_save_results_queue", lambda: None)

    def initialize_distributed(seed, **kwargs):
        raise ReachedTheGPU(seed)

    monkeypatch.setattr(module, "initialize_distributed", initialize_distributed)
    return module


def test_the_tiny_recipe_reaches_the_gpu(pretrain_rl):
    with pytest.raises(ReachedTheGPU):
        pretrain_rl.main(TINY)


def test_triton_compilations_are_counted_from_mains_start_into_the_logs_records(pretrain_rl, monkeypatch, tmp_path):
    import types

    from triton import knobs

    from megatron_rl_bi.reporting.compiles import TritonCompiles

    monkeypatch.setattr(knobs.compilation, "listener", None)
    with pytest.raises(ReachedTheGPU):
        pretrain_rl.main(TINY)
    tally = knobs.compilation.listener
    assert isinstance(tally, TritonCompiles)
    monkeypatch.setattr(pretrain_rl.torch.distributed, "get_rank", lambda: 0)
    args = types.SimpleNamespace(train_iters=1, rl_metrics_jsonl=str(tmp_path / "m.jsonl"), tensorboard_dir=None,
                                 wandb_project=None, rl_samples_jsonl=None, batch_invariant_mode=False)
    logger = pretrain_rl.build_logger(args, {}, None, [])
    assert logger.compiles is tally
    logger.close()


def test_the_save_results_queue_starts_before_the_inputs_are_read(pretrain_rl, monkeypatch):
    """Forked before anything that might start a thread (a tokenizer, an environment)."""
    order = []
    read_inputs = pretrain_rl.read_inputs
    monkeypatch.setattr(pretrain_rl, "start_save_results_queue", lambda: order.append("queue"))
    monkeypatch.setattr(pretrain_rl, "read_inputs", lambda argv: order.append("inputs") or read_inputs(argv))
    with pytest.raises(ReachedTheGPU):
        pretrain_rl.main(TINY)
    assert order == ["queue", "inputs"]


def test_the_tiny_terminal_recipe_reaches_the_gpu(pretrain_rl, monkeypatch):
    """Its sandbox checked (bubblewrap runs /bin/sh) and every task's instruction encoded."""
    from ..sandbox_fixtures import sandbox_python

    recipe = os.path.join(REPO, "examples", "recipes", "tiny_terminal.yaml")
    monkeypatch.chdir(REPO)  # the recipe names its task file from the repository's root
    with pytest.raises(ReachedTheGPU):
        pretrain_rl.main(["--recipe", recipe, "--flash-attention-version", "4", "--rl-code-python", sandbox_python()])


def test_under_torchrun_the_input_error_ends_torchruns_summary():
    """torchrun prints its failure summary after the process's own output; the error must be its
    last line, not a link to torch's docs with the error far above."""
    import subprocess
    import sys

    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    done = subprocess.run([torchrun, "--nproc-per-node", "1", "--master-port", str(free_port()),
                           os.path.join(REPO, "pretrain_rl.py"), *TINY,
                           "--rl-max-new-token", "5"], capture_output=True, text=True, cwd=REPO, timeout=300)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip() and set(line) != {"="}]
    assert done.returncode != 0
    assert lines[-2] == "  traceback : pretrain_rl.py: error: invalid arguments:", lines[-3:]
    assert lines[-1].strip().startswith("--rl-max-new-token: no such flag (did you mean --rl-max-new-tokens")


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused_before_the_gpu(pretrain_rl):
    with pytest.raises(SystemExit, match=r"^pretrain_rl.py: error: --rl-tokenizer .* tokens, more than "
                                         r"the model's vocabulary \(10\)$"):
        pretrain_rl.main(TINY + ["--vocab-size", "10"])


def test_bad_flags_end_the_run_with_their_list(pretrain_rl, tmp_path):
    with pytest.raises(SystemExit, match=r"(?s)^pretrain_rl.py: error: invalid arguments:\n"
                                         r"  --eval-interval must be >= 0, got -1\n.*: is a directory$"):
        pretrain_rl.main(TINY + ["--eval-interval", "-1", "--rl-eval-dataset", str(tmp_path)])


def test_a_tool_format_the_tokenizer_cannot_write_is_refused_before_the_gpu(pretrain_rl):
    lookup = ["--recipe", os.path.join(REPO, "examples", "recipes", "tiny_lookup.yaml"),
              "--flash-attention-version", "4", "--rl-tool-format", "chat"]
    with pytest.raises(SystemExit, match=r"^pretrain_rl.py: error: --rl-tool-format chat needs a tokenizer "
                                         r"with a chat template"):
        pretrain_rl.main(lookup)


def test_an_hf_checkpoint_without_weights_is_refused_before_the_gpu(pretrain_rl, tmp_path):
    """tools/random_hf_checkpoint.py --config-only writes no weights: the launch check passed it."""
    import subprocess
    import sys

    subprocess.run([sys.executable, os.path.join(REPO, "tools", "random_hf_checkpoint.py"), "qwen3-0.6b",
                    str(tmp_path), "--config-only"], check=True, capture_output=True)
    with pytest.raises(SystemExit, match=r"^pretrain_rl.py: error: .*hf: neither model.safetensors.index.json "
                                         r"nor model.safetensors$"):
        pretrain_rl.main(["--recipe", os.path.join(REPO, "examples", "recipes", "qwen3_math_dapo.yaml"),
                          "--hf-checkpoint", str(tmp_path / "hf"), "--rl-dataset", str(tmp_path / "math.jsonl"),
                          "--save", str(tmp_path / "ckpt"), "--save-hf", str(tmp_path / "out")])


def test_a_recipe_without_a_model_names_hf_checkpoint(pretrain_rl):
    """The Qwen recipe without --hf-checkpoint ended in megatron-core's "either num-layers or
    encoder-num-layers should be specified"."""
    with pytest.raises(SystemExit, match=r"^pretrain_rl.py: error: no model: neither --num-layers nor "
                                         r"--hybrid-layer-pattern is given; .* takes them from --hf-checkpoint DIR$"):
        pretrain_rl.main(["--recipe", os.path.join(REPO, "examples", "recipes", "qwen3_math_dapo.yaml"),
                          "--rl-dataset", os.path.join(REPO, "README.md")])


def test_generator_ranks_that_leave_no_trainer_are_refused_before_the_gpu(pretrain_rl, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match=r"^pretrain_rl.py: error: --rl-generator-ranks 2 of 2 processes "
                                         r"leaves no trainer"):
        pretrain_rl.main(TINY + ["--rl-generator-ranks", "2"])


ARGUMENT_DUMP = "------------------------ arguments ------------------------"


def test_an_input_error_is_the_last_thing_printed(pretrain_rl, capsys):
    """megatron-core's ~900-line argument dump waits until the inputs are read: a bad input's
    message is not followed, or buried, by it."""
    with pytest.raises(SystemExit, match="--rl-tokenizer"):
        pretrain_rl.main(TINY + ["--vocab-size", "10"])
    assert ARGUMENT_DUMP not in capsys.readouterr().out


def test_a_run_that_starts_prints_the_arguments_once(pretrain_rl, capsys):
    with pytest.raises(ReachedTheGPU):
        pretrain_rl.main(TINY)
    assert capsys.readouterr().out.count(ARGUMENT_DUMP) == 1


def test_a_resumed_run_continues_with_its_checkpoints_seed(pretrain_rl, tmp_path, capsys):
    """The prompts and samples of a run are functions of its seed: a requeued job that passes
    another --seed continues the checkpoint's run, and says so."""
    import torch

    (tmp_path / "iter_0000003").mkdir()
    torch.save({"step": 3, "ranks": [{"step": 3, "seed": 1234}]}, tmp_path / "iter_0000003" / "rl_state.pt")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3\n")
    with pytest.raises(ReachedTheGPU) as reached:
        pretrain_rl.main(TINY + ["--load", str(tmp_path), "--seed", "5"])
    assert reached.value.args == (1234,)
    assert f"--load {tmp_path}/iter_0000003: continuing with the checkpoint's --seed 1234 (given 5)" in (
        capsys.readouterr().out)
    with pytest.raises(ReachedTheGPU) as reached:  # a checkpoint written before seeds were saved
        torch.save({"step": 3, "ranks": [{"step": 3}]}, tmp_path / "iter_0000003" / "rl_state.pt")
        pretrain_rl.main(TINY + ["--load", str(tmp_path), "--seed", "5"])
    assert reached.value.args == (5,)


def test_the_launch_check_runs_on_a_cpu_machine_and_says_what_it_lacks(capsys):
    """--launch-check: no GPU work; one process here (gloo), the verdict, and the kernels this
    machine could not run (FlashAttention is not installed on CPU)."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_rl.py"), *TINY, "--batch-invariant-mode",
                             "--launch-check"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "launch check: rank 0 of 1 on " in result.stdout
    assert "launch check passed: 1 processes on 1 nodes" in result.stdout
    assert "no --load: would start a fresh run" in result.stdout
    assert "this node could not run the GPU work: invalid arguments:" in result.stdout
    assert "(the verdict above is the launch's alone, not the run's)" in result.stdout


def test_the_launch_check_says_each_process_role_with_generators_apart():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(free_port()), os.path.join(REPO, "pretrain_rl.py"), *TINY,
                             "--batch-invariant-mode", "--rl-generator-ranks", "1", "--launch-check"],
                            capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "launch check: rank 0 of 2 on " in result.stdout and "data-parallel group [0]" in result.stdout
    assert "launch check: rank 1 of 2 on " in result.stdout and "generator for trainer ranks [0]" in result.stdout
    assert "launch check passed: 2 processes on 1 nodes" in result.stdout


OFFLOADED = TINY + ["--optimizer-cpu-offload", "--use-precision-aware-optimizer"]


def _offloaded_host_need(pretrain_rl) -> int:
    """The tiny recipe's optimizer on the CPU: the host bytes one training process takes, 16 a
    parameter."""
    from megatron_rl_bi.config.from_args import levers_from_args, memory_run_from_args
    from megatron_rl_bi.memory import host_optimizer_bytes, parameter_count

    args = pretrain_rl.parse_rl_args(OFFLOADED)
    run = memory_run_from_args(args, pretrain_rl.model_vocab_size(args, pretrain_rl.build_tokenizer(
        args.rl_tokenizer, chat_template=False)), 1, 0)
    params = parameter_count(run.model)
    need = host_optimizer_bytes(params, run.model, levers_from_args(args), 1)
    assert need == 16 * params
    return need


def test_optimizers_that_the_node_s_memory_cannot_hold_end_the_run_before_the_gpu(pretrain_rl, monkeypatch, capsys):
    """--optimizer-cpu-offload keeps 16 bytes a parameter on the host: two training processes of
    the tiny model on a node of 1.5x one's need are refused, naming the flags; one is not, and is
    warned on a node of 1.05x its need."""
    need = _offloaded_host_need(pretrain_rl)
    monkeypatch.setattr(pretrain_rl, "node_memory_bytes", lambda: int(1.5 * need))
    with pytest.raises(ReachedTheGPU):
        pretrain_rl.main(OFFLOADED)
    assert "warning: the optimizers" not in capsys.readouterr().out
    monkeypatch.setattr(pretrain_rl, "node_memory_bytes", lambda: int(1.05 * need))
    with pytest.raises(ReachedTheGPU):
        pretrain_rl.main(OFFLOADED)
    assert "warning: the optimizers of this node's 1 training process(es) take" in capsys.readouterr().out
    monkeypatch.setattr(pretrain_rl, "node_memory_bytes", lambda: int(1.5 * need))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match=r"the optimizer takes .* GiB of host memory a training process .* "
                                         r"for this node's 2; the node has .* \(--use-distributed-optimizer\)"):
        pretrain_rl.main(OFFLOADED)


def test_the_host_memory_check_counts_this_node_s_trainers_and_rank_0_warns(pretrain_rl, monkeypatch, capsys):
    """Two nodes of two processes, the second node's two generators (--rl-generator-ranks 2): the
    first node's two trainers do not fit 1.5x one's need, the second node has none to hold. On a
    node of 1.05x one's need, one trainer a node (data parallel 2), only rank 0 prints the warning."""
    need = _offloaded_host_need(pretrain_rl)
    monkeypatch.setattr(pretrain_rl, "node_memory_bytes", lambda: int(1.5 * need))
    monkeypatch.setattr(pretrain_rl, "join_world", lambda *a, **k: None)
    split = OFFLOADED + ["--rl-generator-ranks", "2"]
    for name, value in (("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "2"), ("GROUP_RANK", "0"), ("RANK", "0")):
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit, match=r"for this node's 2; the node has"):
        pretrain_rl.main(split)
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ReachedTheGPU):
        pretrain_rl.main(split)

    monkeypatch.setattr(pretrain_rl, "node_memory_bytes", lambda: int(1.05 * need))
    for name, value in (("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "1"), ("GROUP_RANK", "1"), ("RANK", "1")):
        monkeypatch.setenv(name, value)
    with pytest.raises(ReachedTheGPU):
        pretrain_rl.main(OFFLOADED)
    assert "warning: the optimizers" not in capsys.readouterr().out
    monkeypatch.setenv("GROUP_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ReachedTheGPU):
        pretrain_rl.main(OFFLOADED)
    assert "warning: the optimizers of this node's 1 training process(es)" in capsys.readouterr().out


def test_the_seconds_before_main_count_from_the_process_start():
    """A process that spends 1 s before its main (as imports do), then 3 s in it, reports the
    first second and its interpreter's start, not the 3 s after."""
    shown = run_after_loading_pretrain_rl("print(pretrain_rl.seconds_before_main(started))",
                                          before="import time; time.sleep(1.0); started = time.perf_counter(); "
                                                 "time.sleep(3.0)")
    assert 1.0 <= float(shown) < 3.0
