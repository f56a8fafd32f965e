"""Every recipe in examples/recipes parses with the flags its header says to add (CPU)."""

import os
import pathlib
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_checkpoints import save_qwen3, save_qwen35  # noqa: E402

from megatron_rl_bi.config import parse_rl_args  # noqa: E402

RECIPES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "recipes"


@pytest.mark.parametrize("name,save", [("qwen3_math_dapo.yaml", save_qwen3),
                                       ("qwen35_math_dapo.yaml", save_qwen35)])
def test_hf_math_recipes(tmp_path, name, save):
    save(str(tmp_path / "hf"))
    dataset = tmp_path / "math.jsonl"
    dataset.write_text('{"prompt": "what is 3 + 4", "answer": "7"}\n')
    args = parse_rl_args(["--recipe", str(RECIPES / name), "--hf-checkpoint", str(tmp_path / "hf"),
                          "--rl-dataset", str(dataset), "--rl-eval-dataset", str(dataset),
                          "--eval-interval", "5", "--save", str(tmp_path / "ckpt"),
                          "--save-hf", str(tmp_path / "out")])
    assert (args.grpo_clamp_eps_lower, args.grpo_clamp_eps_upper) == (0.2, 0.28)
    assert (args.grpo_prompts_per_step, args.grpo_group_size, args.rl_max_new_tokens) == (8, 16, 8192)
    assert args.lr == 1e-6 and args.rl_loss == "dapo" and args.rl_tokenizer.startswith("hf:")


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("tiny_*.yaml")))
def test_tiny_recipes(recipe):
    args = parse_rl_args(["--recipe", str(RECIPES / recipe)])
    tasks = {"tiny_lookup.yaml": "lookup", "tiny_countdown_code.yaml": "countdown", "tiny_terminal.yaml": "terminal"}
    assert args.rl_task == tasks.get(recipe, "sort") and args.train_iters == 120


def test_hf_flags_that_need_each_other(tmp_path):
    save_qwen3(str(tmp_path / "hf"))
    with pytest.raises(ValueError) as info:
        parse_rl_args(["--save-hf", str(tmp_path / "out"), "--save-hf-interval", "3",
                       "--eval-interval", "5", "--num-layers", "2", "--hidden-size", "64",
                       "--num-attention-heads", "4", "--seq-length", "64",
                       "--max-position-embeddings", "64"])
    message = str(info.value)
    assert "--save-hf needs --hf-checkpoint" in message
    assert "--eval-interval and --rl-eval-dataset go together" in message
    with pytest.raises(ValueError, match="both give the starting weights"):
        parse_rl_args(["--hf-checkpoint", str(tmp_path / "hf"), "--pretrained-checkpoint", "x"])


def test_math_recipe_names_missing_and_directory_datasets(tmp_path):
    save_qwen3(str(tmp_path / "hf"))
    with pytest.raises(ValueError) as info:
        parse_rl_args(["--recipe", str(RECIPES / "qwen3_math_dapo.yaml"), "--hf-checkpoint", str(tmp_path / "hf"),
                       "--rl-dataset", str(tmp_path / "typo.jsonl"), "--rl-eval-dataset", str(tmp_path),
                       "--eval-interval", "5", "--save", str(tmp_path / "ckpt"), "--save-hf", str(tmp_path / "out")])
    message = str(info.value)
    assert f"--rl-dataset {tmp_path}/typo.jsonl: no such file" in message
    assert f"--rl-eval-dataset {tmp_path}: is a directory" in message


def test_a_recipes_null_or_non_string_dataset_is_named(tmp_path):
    recipe = tmp_path / "r.yaml"
    for text, expected in (("rl-task: jsonl\nrl-dataset: 5\n", "'rl-dataset': 5 is not a string"),
                           ("rl-task: jsonl\nrl-dataset:\n", "'rl-dataset': null is not a value")):
        recipe.write_text(text)
        with pytest.raises(ValueError, match=f"^{recipe}: {expected}"):
            parse_rl_args(["--recipe", str(recipe)])
