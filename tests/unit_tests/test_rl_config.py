"""RL flags: presets, recipes and validation (CPU, before any GPU work)."""

import importlib.util

import pytest

from megatron_rl_bi.config import parse_rl_args
from megatron_rl_bi.config.from_args import (
    rollout_config_from_args,
    sampling_from_args,
    step_config_from_args,
)

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1"]


def test_grpo_and_dapo_presets():
    grpo = parse_rl_args(MODEL)
    assert (grpo.grpo_clamp_eps_upper, grpo.rl_loss_aggregation) == (0.2, "sequence")
    assert not grpo.grpo_filter_groups_with_same_reward
    dapo = parse_rl_args(MODEL + ["--rl-loss", "dapo"])
    assert (dapo.grpo_clamp_eps_lower, dapo.grpo_clamp_eps_upper) == (0.2, 0.28)
    assert dapo.rl_loss_aggregation == "token" and dapo.grpo_filter_groups_with_same_reward
    # the command line beats the preset
    custom = parse_rl_args(MODEL + ["--rl-loss", "dapo", "--grpo-clamp-eps-upper", "0.3"])
    assert custom.grpo_clamp_eps_upper == 0.3


def test_recipe_precedence_and_switches(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rl-loss: dapo\nlr: 0.01\ndisable-bias-linear: true\ngrpo_group_size: 4\n")
    args = parse_rl_args(MODEL + ["--recipe", str(recipe), "--lr", "0.5"])
    assert args.rl_loss == "dapo" and args.grpo_clamp_eps_upper == 0.28  # preset from the recipe
    assert args.lr == 0.5  # CLI over recipe
    assert args.add_bias_linear is False  # store_false switch
    assert args.grpo_group_size == 4  # destination names work too


def test_recipe_errors_name_the_file_and_key(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("no-such-flag: 1\n")
    with pytest.raises(ValueError, match=r"r.yaml: unknown flag 'no-such-flag'"):
        parse_rl_args(MODEL + ["--recipe", str(recipe)])
    recipe.write_text("disable-bias-linear: 3\n")
    with pytest.raises(ValueError, match="'disable-bias-linear' is a switch"):
        parse_rl_args(MODEL + ["--recipe", str(recipe)])
    recipe.write_text("lr: 0.1\n  seed: [1\n")
    with pytest.raises(ValueError, match=r"(?s)--recipe .*r.yaml: not YAML: .*line 2"):
        parse_rl_args(MODEL + ["--recipe", str(recipe)])
    with pytest.raises(ValueError, match=r"--recipe .*missing.yaml: No such file or directory"):
        parse_rl_args(MODEL + ["--recipe", str(tmp_path / "missing.yaml")])
    recipe.write_text("recipe: other.yaml\n")  # was read as a value and ignored
    with pytest.raises(ValueError, match=r"r.yaml: 'recipe': a recipe cannot include another recipe"):
        parse_rl_args(MODEL + ["--recipe", str(recipe)])


def test_validation_lists_every_bad_flag():
    with pytest.raises(ValueError) as info:
        parse_rl_args(MODEL + ["--grpo-group-size", "1", "--rl-inference-logprobs-is-correction",
                               "--rl-default-temperature", "0", "--save-interval", "5"])
    message = str(info.value)
    assert "--grpo-group-size must be >= 2" in message
    assert "--rl-importance-sampling-truncation-coef" in message
    assert "--rl-default-temperature must be > 0" in message
    assert "--save-interval needs --save" in message


def test_rl_configs_map_flags():
    args = parse_rl_args(MODEL + ["--rl-inference-logprobs-is-correction",
                                  "--rl-importance-sampling-truncation-coef", "2.0",
                                  "--grpo-iterations", "2", "--rl-max-new-tokens", "9"])
    rollout = rollout_config_from_args(args)
    step = step_config_from_args(args)
    sampling = sampling_from_args(args, eod_id=2)
    assert step.loss.tis_cap == 2.0 and step.updates_per_step == 2
    assert sampling.max_new_tokens == 9 and sampling.eod_id == 2
    assert rollout.group_size == 8 and rollout.prompts_per_step == 8


def test_kl_with_warm_up_is_refused():
    with pytest.raises(ValueError, match="--grpo-kl-beta > 0 with --rl-sft-warmup-steps"):
        parse_rl_args(MODEL + ["--grpo-kl-beta", "0.01", "--rl-sft-warmup-steps", "10"])


def test_pretrained_checkpoint_resolution(tmp_path):
    from megatron_rl_bi.checkpoints.megatron import resolve_checkpoint_dir

    (tmp_path / "iter_0000042").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("42\n")
    assert resolve_checkpoint_dir(str(tmp_path)) == str(tmp_path / "iter_0000042")
    (tmp_path / "iter_0000042" / "metadata.json").write_text("{}")
    assert resolve_checkpoint_dir(str(tmp_path / "iter_0000042")) == str(tmp_path / "iter_0000042")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release\n")
    with pytest.raises(ValueError, match="names 'release'"):
        resolve_checkpoint_dir(str(tmp_path))
    with pytest.raises(ValueError, match="neither a dist checkpoint"):
        resolve_checkpoint_dir(str(tmp_path / "nowhere"))


def test_load_directory_must_exist(tmp_path):
    with pytest.raises(ValueError, match="--load .*typo: no such directory"):
        parse_rl_args(MODEL + ["--load", str(tmp_path / "typo")])
    assert parse_rl_args(MODEL + ["--load", str(tmp_path)]).load == str(tmp_path)  # a fresh run
    first_run = str(tmp_path / "run")  # --save D --load D before D exists: a fresh run too
    assert parse_rl_args(MODEL + ["--load", first_run, "--save", first_run + "/", "--save-interval", "5"]).load == first_run
    with pytest.raises(ValueError, match="--load .*typo: no such directory"):
        parse_rl_args(MODEL + ["--load", str(tmp_path / "typo"), "--save", first_run, "--save-interval", "5"])
    with pytest.raises(ValueError, match="--rl-keep-last-k must be >= 0"):
        parse_rl_args(MODEL + ["--rl-keep-last-k", "-1"])


def test_top_k_and_top_p_are_refused_and_temperature_reaches_both_sides():
    from megatron_rl_bi.config.from_args import engine_config_from_args

    for flags in (["--rl-default-top-k", "5"], ["--rl-default-top-p", "0.9"]):
        with pytest.raises(ValueError, match="--rl-default-top-k / --rl-default-top-p"):
            parse_rl_args(MODEL + flags)
    args = parse_rl_args(MODEL + ["--rl-default-temperature", "0.7"])
    assert step_config_from_args(args).temperature == 0.7
    assert sampling_from_args(args, eod_id=2).temperature == 0.7
    assert engine_config_from_args(args, temperature=args.rl_default_temperature).processed_logprobs
    assert not engine_config_from_args(parse_rl_args(MODEL)).processed_logprobs


def test_engine_cuda_graphs_come_from_megatrons_flags():
    from megatron_rl_bi.config.from_args import engine_config_from_args

    assert engine_config_from_args(parse_rl_args(MODEL)).cuda_graphs is None
    graphs = ["--cuda-graph-impl", "local", "--inference-cuda-graph-scope", "block"]
    config = engine_config_from_args(parse_rl_args(MODEL + graphs + [
        "--inference-dynamic-batching-num-cuda-graphs", "-1", "--decode-only-cuda-graphs"]))
    assert (config.cuda_graphs, config.cuda_graphs_decode_only) == (-1, True)


def test_engine_async_scheduling_comes_from_megatrons_flag():
    from megatron_rl_bi.config.from_args import engine_config_from_args

    assert not engine_config_from_args(parse_rl_args(MODEL)).async_scheduling
    flag = ["--inference-dynamic-batching-async-sched-mode", "async"]
    assert engine_config_from_args(parse_rl_args(MODEL + flag)).async_scheduling


def test_cuda_graphs_other_than_the_engines_block_graphs_are_refused_naming_each_flag():
    with pytest.raises(ValueError) as error:
        parse_rl_args(MODEL + ["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn",
                               "--hybrid-layer-pattern", "G-*-"])
    message = str(error.value)
    for expected in ("--inference-cuda-graph-scope None: use block", "--cuda-graph-modules",
                     "--cuda-graph-impl local with --hybrid-layer-pattern needs --decode-only-cuda-graphs"):
        assert expected in message
    with pytest.raises(ValueError, match="--cuda-graph-impl transformer_engine: only local"):
        parse_rl_args(MODEL + ["--cuda-graph-impl", "transformer_engine"])


def test_megatron_flags_the_rl_job_does_not_use_are_named(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("eval_iters: 10\n")
    with pytest.raises(ValueError) as error:
        parse_rl_args(MODEL + ["--recipe", str(recipe), "--global-batch-size", "256",
                               "--data-path=/data/x"])
    message = str(error.value)
    for expected in ("--global-batch-size: not used by pretrain_rl.py (an RL step trains on "
                     "--grpo-prompts-per-step x --grpo-group-size",
                     "--data-path: not used", "--eval-iters: not used"):
        assert expected in message
    assert "--train-samples" not in message


def test_train_samples_is_refused_by_name_before_megatrons_checks():
    """Megatron's own validation would stop on a bare AssertionError first."""
    with pytest.raises(ValueError, match="--train-samples: not used by pretrain_rl.py"):
        parse_rl_args(MODEL + ["--train-samples", "1000"])


def test_a_recipe_switch_set_false_undoes_the_preset(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rl-loss: dapo\ngrpo-filter-groups-with-same-reward: false\n")
    assert parse_rl_args(MODEL + ["--recipe", str(recipe)]).grpo_filter_groups_with_same_reward is False
    recipe.write_text("rl-loss: dapo\n")
    assert parse_rl_args(MODEL + ["--recipe", str(recipe)]).grpo_filter_groups_with_same_reward is True


@pytest.mark.parametrize("line, expected", [
    ("rl-loss-aggregation: tokens", "'rl-loss-aggregation': 'tokens' is not one of ['token', 'sequence']"),
    ("train-iters: 12.5", "'train-iters': 12.5 is not an integer"),
    ("hidden-size: abc", "'hidden-size': invalid literal for int()"),
    ("rl-task: sorting", "'rl-task': 'sorting' is not one of"),
    ("lr: fast", "'lr': could not convert string to float"),
    ("grpo-kl-beta: null", "'grpo-kl-beta': null is not a value"),
    ("rl-overlong-buffer:", "'rl-overlong-buffer': null is not a value"),  # an empty value is null
    ("rl-default-temperature: null", "'rl-default-temperature': null is not a value"),
    ("rl-keep-last-k:", "'rl-keep-last-k': null is not a value"),
    ("rl-sft-warmup-steps: null", "'rl-sft-warmup-steps': null is not a value"),
    ("rl-sft-lr: null", "'rl-sft-lr': null is not a value"),
    ("rl-tokenizer: 5", "'rl-tokenizer': 5 is not a string"),
    ("rl-reward-fn: 5", "'rl-reward-fn': 5 is not a string"),
    ("hybrid-layer-pattern: 5", "'hybrid-layer-pattern': 5 is not a string"),
    ("rl-metrics-jsonl: [a, b]", "'rl-metrics-jsonl': ['a', 'b'] is not a string"),
])
def test_recipe_values_are_checked_as_the_command_line_checks_them(tmp_path, line, expected):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(line + "\n")
    with pytest.raises(ValueError) as info:
        parse_rl_args(MODEL + ["--recipe", str(recipe)])
    assert str(info.value).startswith(f"{recipe}: ") and expected in str(info.value)


def test_recipe_numbers_become_the_flags_type(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("lr: 1\ntrain-iters: 7\n")
    args = parse_rl_args(MODEL + ["--recipe", str(recipe)])
    assert args.lr == 1.0 and isinstance(args.lr, float) and args.train_iters == 7


def test_more_bad_rl_flags_are_named(tmp_path):
    with pytest.raises(ValueError) as info:
        parse_rl_args(MODEL + ["--rl-sft-batch-size", "0", "--rl-dynamic-sampling-max-rounds", "0",
                               "--rl-sft-warmup-steps", "-3", "--rl-dataset", str(tmp_path / "d.jsonl"),
                               "--exit-interval", "5", "--rl-samples-per-step", "0"])
    message = str(info.value)
    for expected in ("--rl-sft-batch-size must be >= 1", "--rl-dynamic-sampling-max-rounds must be >= 1",
                     "--rl-samples-per-step must be >= 1",
                     "--rl-sft-warmup-steps must be >= 0",
                     "--rl-dataset is read by --rl-task jsonl or terminal only (the task is sort)",
                     "--exit-interval stop the run with a checkpoint: give --save DIR"):
        assert expected in message


def test_a_missing_tokenizer_directory_names_the_flag(tmp_path):
    from megatron_rl_bi.envs.tokenizer import build_tokenizer

    with pytest.raises(ValueError, match=f"--rl-tokenizer hf:{tmp_path}/none: no such directory"):
        build_tokenizer(f"hf:{tmp_path}/none")


@pytest.mark.parametrize("line, dest, expected", [
    ("no-rope-fusion: false", "apply_rope_fusion", False),           # store_false set false: left out
    ("disable-bias-linear: false", "add_bias_linear", True),         # (Megatron's default stays)
    ("add_bias_linear: true", "add_bias_linear", True),              # a destination takes the value
    ("no-rl-persist-cuda-graphs: true", "rl_persist_cuda_graphs", False),  # --no- of a BooleanOptionalAction
    ("rl-persist-cuda-graphs: true", "rl_persist_cuda_graphs", True),
])
def test_recipe_switch_forms(tmp_path, line, dest, expected):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(line + "\n")
    assert getattr(parse_rl_args(MODEL + ["--recipe", str(recipe)]), dest) is expected


@pytest.mark.parametrize("line", ["bf16: 'false'", "swiglu: 1", "no-rl-persist-cuda-graphs: 'yes'"])
def test_every_switch_form_takes_true_or_false_only(tmp_path, line):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(line + "\n")
    with pytest.raises(ValueError, match="is a switch; give true or false"):
        parse_rl_args(MODEL + ["--recipe", str(recipe)])


def test_negative_intervals_counts_and_rates_are_named():
    """A negative interval would fire at every step (step % -1 == 0), a negative duration at once."""
    with pytest.raises(ValueError) as info:
        parse_rl_args(MODEL + ["--save-hf-interval", "-1", "--eval-interval", "-1", "--exit-interval", "-3",
                               "--exit-duration-in-mins", "-2", "--rl-sft-lr", "-1", "--rl-overlong-penalty",
                               "-0.5", "--rl-keep-last-k", "-1", "--train-iters", "0"])
    message = str(info.value)
    for expected in ("--save-hf-interval must be >= 0, got -1", "--eval-interval must be >= 0, got -1",
                     "--exit-interval must be >= 0, got -3", "--exit-duration-in-mins must be >= 0, got -2",
                     "--rl-sft-lr must be >= 0, got -1.0", "--rl-overlong-penalty must be >= 0, got -0.5",
                     "--rl-keep-last-k must be >= 0, got -1", "--train-iters must be >= 1, got 0"):
        assert expected in message
    with pytest.raises(ValueError, match="--rl-sft-lr must be >= 0, got nan"):
        parse_rl_args(MODEL + ["--rl-sft-lr", "nan"])


def test_a_recipes_negative_interval_is_named(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("eval-interval: -1\n")
    with pytest.raises(ValueError, match="--eval-interval must be >= 0, got -1"):
        parse_rl_args(MODEL + ["--recipe", str(recipe)])


@pytest.mark.parametrize("flags", [["--rl-task", "jsonl", "--rl-dataset"],
                                   ["--eval-interval", "5", "--rl-eval-dataset"]])
def test_missing_dataset_files_and_directories_are_named(tmp_path, flags):
    flag = flags[-1]
    with pytest.raises(ValueError, match=f"{flag} {tmp_path}/none.jsonl: no such file"):
        parse_rl_args(MODEL + flags + [str(tmp_path / "none.jsonl")])
    with pytest.raises(ValueError, match=f"{flag} {tmp_path}: is a directory"):
        parse_rl_args(MODEL + flags + [str(tmp_path)])


def test_inputs_the_gpu_work_would_fail_on_late_are_named_at_parse_time(tmp_path, monkeypatch):
    """A missing --pretrained-checkpoint, or a metrics sink whose package is missing, failed only
    after the model (and the engine) were built."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "tensorboard") else find_spec(name, *a))
    with pytest.raises(ValueError) as info:
        parse_rl_args(MODEL + ["--pretrained-checkpoint", str(tmp_path / "typo"), "--wandb-project", "p",
                               "--tensorboard-dir", str(tmp_path / "tb")])
    for expected in (f"--pretrained-checkpoint {tmp_path / 'typo'}: neither a dist checkpoint",
                     "--wandb-project needs `pip install wandb`",
                     "--tensorboard-dir needs `pip install tensorboard`"):
        assert expected in str(info.value)


def test_an_unset_size_is_an_error_and_an_unset_interval_is_off():
    from megatron_rl_bi.config.rl_args import bound_errors

    args = parse_rl_args(MODEL)
    assert bound_errors(args) == []
    args.train_iters, args.exit_interval = None, None
    assert bound_errors(args) == ["--train-iters must be >= 1, got None"]


def test_an_unknown_flag_is_one_line_with_the_flags_it_is_close_to():
    with pytest.raises(ValueError) as info:
        parse_rl_args(MODEL + ["--rl-max-new-token", "5", "--no-such-thing=3"])
    message = str(info.value)
    assert "--rl-max-new-token: no such flag (did you mean --rl-max-new-tokens or" in message
    assert "--no-such-thing: no such flag\n" in message + "\n" and len(message.splitlines()) == 3
