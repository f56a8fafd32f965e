"""pretrain_rl.py reads and checks every input before CUDA is touched (CPU): the tiny recipe gets
as far as the distributed set-up, and bad input ends the run with a message naming it, no
traceback."""

import importlib.util
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--recipe", os.path.join(REPO, "examples", "recipes", "tiny_sort.yaml"), "--flash-attention-version", "4"]


class ReachedTheGPU(Exception):
    pass


@pytest.fixture
def pretrain_rl(monkeypatch):
    spec = importlib.util.spec_from_file_location("pretrain_rl", os.path.join(REPO, "pretrain_rl.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "validate_installed_kernels", lambda args: None)  # FA4 is GPU-only

    def initialize_distributed(*args, **kwargs):
        raise ReachedTheGPU

    monkeypatch.setattr(module, "initialize_distributed", initialize_distributed)
    return module


def test_the_tiny_recipe_reaches_the_gpu(pretrain_rl):
    with pytest.raises(ReachedTheGPU):
        pretrain_rl.main(TINY)


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused_before_the_gpu(pretrain_rl):
    with pytest.raises(SystemExit, match=r"^pretrain_rl.py: error: --rl-tokenizer .* tokens, more than "
                                         r"the model's vocabulary \(10\)$"):
        pretrain_rl.main(TINY + ["--vocab-size", "10"])


def test_bad_flags_end_the_run_with_their_list(pretrain_rl, tmp_path):
    with pytest.raises(SystemExit, match=r"(?s)^pretrain_rl.py: error: invalid arguments:\n"
                                         r"  --eval-interval must be >= 0, got -1\n.*: is a directory$"):
        pretrain_rl.main(TINY + ["--eval-interval", "-1", "--rl-eval-dataset", str(tmp_path)])
