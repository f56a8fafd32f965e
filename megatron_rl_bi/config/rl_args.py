"""RL flags for pretrain_rl.py: Megatron's own RL flags (--grpo-*, --rl-default-*,
--rl-importance-sampling-*) plus this package's, `--rl-loss` presets, and YAML recipes.

Precedence, lowest first: Megatron's defaults < this package's defaults < the model flags of
`--hf-checkpoint DIR` < the `--rl-loss` preset < the recipe (`--recipe FILE`, keys are flag names
with '_' or '-') < the command line; a model flag that contradicts the checkpoint is an error.
"""

import argparse
import difflib
import importlib.util
import os
import sys

import yaml

from megatron_rl_bi.checkpoints.hf.config import megatron_flags, read_hf_model
from megatron_rl_bi.checkpoints.megatron import resolve_checkpoint_dir
from megatron_rl_bi.compiling.workers import DEFAULT_WORKERS, WORKERS_FLAG
from megatron_rl_bi.config.hf_args import add_hf_args, checkpoint_flag_errors
from megatron_rl_bi.config.megatron_args import build_parser, parse_args, raise_if_invalid
from megatron_rl_bi.envs.recording import read_recording
from megatron_rl_bi.inference.engine import PREFIX_CACHING_ON_HYBRID

RL_DEFAULTS = dict(
    # Megatron's RL flags, with defaults for a synchronous on-policy loop.
    grpo_prompts_per_step=8,
    grpo_group_size=8,
    grpo_iterations=1,
    grpo_clamp_eps_lower=0.2,
    grpo_clamp_eps_upper=0.2,
    grpo_kl_beta=0.0,
    rl_default_top_k=0,
    lr=1e-5,
    train_iters=100,
    # Megatron's data-loader batch flag; the RL step packs by --rl-micro-batch-tokens instead.
    micro_batch_size=1,
    # RL runs usually keep the learning rate constant; Megatron's default decays it linearly.
    lr_decay_style="constant",
)

LOSS_PRESETS = {
    # GRPO: symmetric clip, each completion weighs the same.
    "grpo": dict(grpo_clamp_eps_upper=0.2, rl_loss_aggregation="sequence"),
    # DAPO: clip-higher, token-level loss, dynamic sampling, no KL.
    "dapo": dict(
        grpo_clamp_eps_upper=0.28,
        rl_loss_aggregation="token",
        grpo_filter_groups_with_same_reward=True,
        grpo_kl_beta=0.0,
    ),
}


def _add_entry_args(group) -> None:
    group.add_argument("--recipe", default=None, help="YAML file of flag values (CLI overrides)")
    group.add_argument("--help-all", action="store_true", help="show every flag, Megatron's too, and exit")


def _add_record_args(group) -> None:
    """What a run writes beside its checkpoints: metrics, rollouts' text, how many kept."""
    group.add_argument("--rl-metrics-jsonl", default=None, help="per-step metrics file")
    group.add_argument("--rl-samples-jsonl", default=None, metavar="FILE",
                       help="a few rollouts a step as text (prompt, the model's turns and the environment's "
                            "answers apart, reward, advantage): reporting/samples.py")
    group.add_argument("--rl-samples-per-step", type=int, default=4, metavar="N",
                       help="--rl-samples-jsonl: rank 0's first N rollouts of each step")
    group.add_argument("--rl-keep-last-k", type=int, default=0,
                       help="keep only the newest K checkpoints under --save (0: all)")


def _add_compile_ahead_args(group) -> None:
    group.add_argument(WORKERS_FLAG, type=int, default=DEFAULT_WORKERS, metavar="N",
                       help="BI mode: N processes compile the trainer's Triton and FlashAttention-4 kernels, "
                       "and the engine's FlashAttention-4 kernels, before the first step, sent by a forward "
                       "and backward that launches nothing (models/compile_ahead.py); 0: the first step "
                       "compiles them. The count is read from "
                       "the command line: the processes start before the run's imports (a recipe's 0 "
                       "still ends them)")


def add_rl_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("megatron_rl_bi")
    _add_entry_args(group)
    group.add_argument("--rl-loss", choices=sorted(LOSS_PRESETS), default="grpo",
                       help="loss preset: grpo (symmetric clip, sequence mean) or dapo "
                       "(clip-higher 0.28, token mean, dynamic sampling)")
    group.add_argument("--rl-loss-aggregation", choices=["token", "sequence"], default="sequence",
                       help="average the loss over tokens (DAPO) or per completion (GRPO)")
    group.add_argument("--rl-task", choices=["sort", "countdown", "lookup", "jsonl", "terminal"], default="sort",
                       help="sort, countdown, lookup (a key's value that only --rl-env search finds), "
                       "jsonl (prompts of --rl-dataset) or terminal (--rl-dataset's tasks, --rl-env terminal)")
    group.add_argument("--rl-dataset", default=None, help="JSONL file for --rl-task jsonl or terminal")
    group.add_argument("--rl-reward-fn", default=None, metavar="MODULE:FUNCTION",
                       help="score completions with this callable (prompt, completion, example) "
                       "-> float instead of the task's verifier (MODULE importable, or FILE.py)")
    group.add_argument("--rl-eval-dataset", default=None,
                       help="held-out JSONL ({prompt, answer} lines, math verifier) scored every "
                       "--eval-interval steps as validation_reward/mean")
    group.add_argument("--rl-tokenizer", default="char",
                       help="'char' (built in) or hf:PATH (default with --hf-checkpoint: its own)")
    group.add_argument("--rl-no-chat-template", action="store_true",
                       help="encode prompts as plain text, not through the tokenizer's chat "
                       "template (base models)")
    group.add_argument("--rl-max-new-tokens", type=int, default=16, help="completion budget")
    group.add_argument("--rl-overlong-buffer", type=int, default=0,
                       help="DAPO overlong shaping over the last N tokens of the budget; 0 = off")
    group.add_argument("--rl-overlong-penalty", type=float, default=1.0,
                       help="reward at (and past) the full budget under overlong shaping")
    group.add_argument("--rl-dynamic-sampling-max-rounds", type=int, default=4,
                       help="generation rounds per step to refill dropped groups")
    group.add_argument("--rl-no-advantage-std", action="store_true",
                       help="do not divide advantages by the group's reward std")
    group.add_argument("--rl-micro-batch-tokens", type=int, default=8192,
                       help="tokens per packed trainer forward")
    group.add_argument("--rl-sft-warmup-steps", type=int, default=0,
                       help="supervised steps on the task's reference answers before RL "
                       "(skipped when resuming)")
    group.add_argument("--rl-sft-batch-size", type=int, default=64)
    group.add_argument("--rl-sft-lr", type=float, default=None,
                       help="learning rate of the warm-up (default: --lr)")
    _add_record_args(group)
    group.add_argument("--rl-keep-old-weights", type=int, default=0, metavar="N",
                       help="with --rl-generation-lag: keep the newest N weight versions on the CPU "
                       "and recompute stale rollouts under the weights that sampled them "
                       "(bit_wise_versioned/*)")
    group.add_argument("--rl-generator-ranks", type=int, default=0, metavar="K",
                       help="the last K of the launched processes only generate, each with its own "
                       "engine, and the others only train; weights go to the generators after each "
                       "update (--refit-method gloo|nccl), batches come back within the window of "
                       "--rl-generation-lag")
    group.add_argument("--rl-generator-timeout", type=float, default=1800.0,
                       help="seconds a trainer waits for a generator's batch, and a generator for the "
                       "weights (the first wait includes the model build and any warm-up); past it "
                       "the run stops with an error naming the rank")
    group.add_argument("--rl-kv-cache-memory-fraction", type=float, default=None, metavar="F",
                       help="size the engine's KV cache as this fraction of the GPU memory free while "
                       "it generates (instead of --inference-dynamic-batching-buffer-size-gb)")
    _add_compile_ahead_args(group)
    return add_multi_turn_args(parser)


def add_multi_turn_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("megatron_rl_bi multi-turn")
    group.add_argument("--rl-env", default=None, metavar="MODULE:CLASS",
                       help="multi-turn rollouts: each sample a conversation with this environment "
                       "class (reset(example) -> text, step(text) -> (text, reward, done), "
                       "stop_strings), which scores it instead of the task's verifier; built in: "
                       "'search' (BM25 over a corpus), 'code' (Python in a sandbox) and 'terminal' "
                       "(shell commands in the sandbox, over --rl-task terminal's files)")
    group.add_argument("--rl-search-corpus", default=None,
                       help="--rl-env search: the JSONL corpus ('contents' or 'text' a line; default: "
                       "the task's own, for --rl-task lookup)")
    group.add_argument("--rl-search-url", default=None, metavar="URL",
                       help="--rl-env search: a retrieval server in Search-R1's protocol (POST URL, e.g. "
                       "http://host:8000/retrieve; tools/retrieval_server.py serves one) instead of a "
                       "corpus of this process's own")
    group.add_argument("--rl-search-timeout", type=float, default=10.0,
                       help="--rl-search-url: seconds one request may take before it is retried")
    group.add_argument("--rl-search-retries", type=int, default=3,
                       help="--rl-search-url: retries of a failed request (waiting 0.5 s, then twice as "
                       "long each time); then its samples score 0 and are counted as environment failures")
    group.add_argument("--rl-search-top-k", type=int, default=3, help="--rl-env search: passages a search returns")
    group.add_argument("--rl-code-time-limit", type=float, default=5.0,
                       help="--rl-env code: seconds a program may run (wall clock; CPU time likewise); "
                       "--rl-env terminal: a command likewise")
    group.add_argument("--rl-code-memory-mb", type=int, default=1024,
                       help="--rl-env code and terminal: a process's address space, MiB")
    group.add_argument("--rl-code-python", default=None, metavar="PATH",
                       help="--rl-env code and terminal: the Python the sandbox runs programs (and a terminal's keeper) with, bound into it "
                       "read-only (default: this process's base interpreter, not its virtual environment)")
    group.add_argument("--rl-code-without-isolation", action="store_true",
                       help="--rl-env code: run programs WITHOUT the sandbox's namespaces (as this user, "
                       "with its files and network; only the limits hold), where bubblewrap or user "
                       "namespaces are missing. Not a sandbox: for trusted code only")
    group.add_argument("--rl-max-turns", type=int, default=4, help="sampled turns of a conversation at most")
    group.add_argument("--rl-max-context-tokens", type=int, default=None,
                       help="tokens of a conversation at most, prompt included "
                       "(default: --inference-max-seq-length)")
    group.add_argument("--rl-tool-output-tokens", type=int, default=512,
                       help="tokens of one environment answer at most; the rest is cut")
    group.add_argument("--rl-tool-format", choices=("tags", "chat"), default="tags",
                       help="how tool calls and answers are written: 'tags', the environment's own "
                       "(<search>query</search>, its answer as text in the same turn; Search-R1's), "
                       "or 'chat', the chat template's tool calling (Qwen's <tool_call>, the answer "
                       "in a tool message), for checkpoints trained on it")
    group.add_argument("--rl-env-timeout", type=float, default=30.0,
                       help="seconds one environment call may take; a call that takes longer, or "
                       "raises, scores its sample 0 and is counted")
    group.add_argument("--rl-env-workers", type=int, default=None, metavar="N",
                       help="environment calls run at once, on a pool of N threads; the others wait "
                       "their turn (default: 8 per CPU this process may use)")
    add_env_recording_args(group)
    return parser


def add_env_recording_args(group) -> None:
    group.add_argument("--rl-env-record", default=None, metavar="FILE",
                       help="write every answer of the environment (observations, rewards, failures, "
                       "timeouts) to FILE (JSONL, appended; gzip when it ends in .gz), for "
                       "--rl-env-replay")
    group.add_argument("--rl-env-replay", default=None, metavar="FILE",
                       help="call no environment in the conversations: play back the answers a "
                       "--rl-env-record run wrote to FILE, to repeat that run bit for bit where its "
                       "environment does not repeat itself (a terminal's concurrent processes, a rebuilt "
                       "retrieval index); the run stops at the first model turn that differs from the "
                       "recording's, naming it")


def _scan(argv: list[str], flag: str) -> str | None:
    """The value of `flag` on the command line, before the full parse."""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _recipe_value(action: argparse.Action, value):
    """`value` (each item of a list, for a multi-value flag) as the command line would have made
    it: strings through the flag's type, numbers checked against it (12.5 is not an int), a string
    flag given a string, every item against its choices; null is refused."""
    if isinstance(value, list) and action.nargs not in (None, 0, "?"):
        return [_recipe_item(action, item) for item in value]
    return _recipe_item(action, value)


def _recipe_item(action: argparse.Action, value):
    if value is None:  # `key: null` or an empty `key:`; the command line cannot give None either
        raise ValueError("null is not a value (leave the key out to keep the default)")
    if action.type in (None, str) and not isinstance(value, str):
        raise ValueError(f"{value!r} is not a string")
    if isinstance(value, str) and action.type is not None:
        value = action.type(value)
    elif action.type is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{value!r} is not an integer")
    elif action.type is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{value!r} is not a number")
        value = float(value)
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{value!r} is not one of {list(action.choices)}")
    return value


def _switch_value(action: argparse.Action, key: str, value: bool, flag_form: bool) -> dict:
    """A switch in a recipe: `flag: true` as if given on the command line; `flag: false` sets a
    store_true flag's destination false (undoing a preset) and leaves a store_false flag
    (`no-rope-fusion`, `disable-bias-linear`) out; a destination key takes the value itself."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return {action.dest: value != key.startswith("no-")}
    if flag_form and action.const is False:
        return {action.dest: False} if value else {}
    return {action.dest: value}


def load_recipe(path: str, parser: argparse.ArgumentParser) -> dict:
    """Recipe keys are flag names (`disable-bias-linear: true`, as on the command line) or
    argument destinations (`add_bias_linear: false`). Values are checked as the command line's
    are (type, choices); a switch set to false undoes a default or preset that set it."""
    try:
        with open(path) as f:
            recipe = yaml.safe_load(f) or {}
    except OSError as exc:
        raise ValueError(f"--recipe {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"--recipe {path}: not YAML: {exc}") from exc
    if not isinstance(recipe, dict):
        raise ValueError(f"{path}: a recipe is a mapping of flag names to values")
    by_flag = {opt: a for a in parser._actions for opt in a.option_strings}
    by_dest = {a.dest: a for a in parser._actions}
    values = {}
    for key, value in recipe.items():
        name = str(key).lstrip("-")
        action = by_flag.get("--" + name) or by_dest.get(str(key).replace("-", "_"))
        if action is None:
            raise ValueError(f"{path}: unknown flag '{key}' in recipe")
        if action.dest == "recipe":  # it would be read as a value and ignored
            raise ValueError(f"{path}: '{key}': a recipe cannot include another recipe")
        if action.nargs == 0:
            if not isinstance(value, bool):
                raise ValueError(f"{path}: '{key}' is a switch; give true or false")
            values.update(_switch_value(action, name, value, flag_form="--" + name in by_flag))
            continue
        try:
            values[action.dest] = _recipe_value(action, value)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            raise ValueError(f"{path}: '{key}': {exc}") from exc
    return values


# Megatron flags whose meaning pretrain_rl.py does not implement, and what does the job instead.
UNUSED_MEGATRON_FLAGS = {
    "--global-batch-size": "an RL step trains on --grpo-prompts-per-step x --grpo-group-size "
                           "completions per data-parallel rank",
    "--rampup-batch-size": "the RL batch is --grpo-prompts-per-step x --grpo-group-size",
    "--train-samples": "the run is --train-iters RL steps",
    "--data-path": "prompts come from --rl-task / --rl-dataset",
    "--train-data-path": "prompts come from --rl-task / --rl-dataset",
    "--eval-iters": "--rl-eval-dataset is evaluated whole every --eval-interval steps",
    "--save-retain-interval": "--rl-keep-last-k keeps the newest checkpoints",
    "--async-save": "checkpoints are written synchronously, then renamed into place",
    "--rl-offload-inference-model-weights-when-idle": "the engine shares the trainer's weights",
    "--inference-dynamic-batching-prefix-caching-mamba-gb": "prefix caching is for dense models here "
                                                            "(--inference-dynamic-batching-prefix-caching)",
    "--inference-dynamic-batching-prefix-caching-eviction-policy": "a conversation's next turn reuses blocks "
                                                                   "its last turn released: always lru here",
    "--rl-training-cuda-graphs": "the trainer runs eagerly; CUDA graphs are the engine's",
    "--rl-inference-tensor-model-parallel-size": "the engine runs on the trainer's module (TP = 1)",
    "--rl-profile": "each step's phase times and peak memory are in --rl-metrics-jsonl; --profile traces steps",
    "--nvtx-ranges": "no NVTX ranges are added; --profile marks the traced steps for nsys",
    "--record-shapes": "it is for NVTX ranges, which are not added (--pytorch-profiler-collect-shapes)",
    "--pytorch-profiler-collect-chakra": "--use-pytorch-profiler writes a trace and an op table",
}


def given_flags(argv: list[str], recipe: dict) -> set[str]:
    """The flags given on the command line or in the recipe, each with its leading dashes."""
    given = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    return given | {"--" + key.replace("_", "-") for key in recipe}


def unused_flag_errors(given: set[str]) -> list[str]:
    """An error for each flag of UNUSED_MEGATRON_FLAGS among those `given` (silently ignoring it
    would run another job than the one asked for), for a flag given without the one it goes with,
    and for two flags that size the KV cache."""
    errors = [f"{flag}: not used by pretrain_rl.py ({why})"
              for flag, why in UNUSED_MEGATRON_FLAGS.items() if flag in given]
    if "--refit-method" in given and "--rl-generator-ranks" not in given:
        errors.append("--refit-method: weights are sent only to generator ranks (--rl-generator-ranks); "
                      "without them the engine runs on the trainer's own module")
    if "--memory-snapshot-path" in given and "--record-memory-history" not in given:
        errors.append("--memory-snapshot-path: a snapshot is written only with --record-memory-history")
    if {"--rl-kv-cache-memory-fraction", "--inference-dynamic-batching-buffer-size-gb"} <= given:
        errors.append("--rl-kv-cache-memory-fraction and --inference-dynamic-batching-buffer-size-gb "
                      "both size the KV cache: give one")
    return errors


def unknown_flag_errors(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """One line for each flag no parser takes, with the closest flags that exist (argparse would
    print its whole usage, hundreds of lines, before saying which)."""
    known = list(parser._option_string_actions)
    errors = []
    for token in argv:
        if token == "--":  # the rest are values
            break
        flag = token.split("=", 1)[0]
        # a token with a space is a value to argparse (e.g. a quoted list of flags)
        if flag.startswith("--") and " " not in flag and flag not in parser._option_string_actions:
            close = difflib.get_close_matches(flag, known, n=3, cutoff=0.8)
            errors.append(f"{flag}: no such flag" + (f" (did you mean {' or '.join(close)}?)" if close else ""))
    return errors


MOST_NAMED_MEGATRON_FLAGS = ("--batch-invariant-mode", "--flash-attention-version", "--train-iters", "--lr",
                             "--seed", "--save", "--save-interval", "--load")


def short_help(parser: argparse.ArgumentParser, program: str = "pretrain_rl.py") -> str:
    """--help: this package's flag groups (megatron_rl_bi...), then a line on Megatron's own,
    which --help-all lists (thousands of lines: model, parallelism, optimizer, checkpoints)."""
    formatter = parser._get_formatter()
    formatter.add_usage(f"{program} [--recipe YAML] [FLAG ...]", [], [])
    ours = [g for g in parser._action_groups if (g.title or "").startswith("megatron_rl_bi")]
    for group in ours:
        formatter.start_section(group.title)
        formatter.add_arguments(group._group_actions)
        formatter.end_section()
    formatter.start_section("Megatron's flags a run names most")
    formatter.add_arguments([parser._option_string_actions[flag] for flag in MOST_NAMED_MEGATRON_FLAGS])
    formatter.end_section()
    others = len(parser._actions) - sum(len(g._group_actions) for g in ours) - len(MOST_NAMED_MEGATRON_FLAGS)
    formatter.add_text(f"and {others} flags of Megatron's own (--num-layers, --hidden-size, --micro-batch-size, "
                       "...): "
                       f"python {program} --help-all")
    return formatter.format_help()


def parse_rl_args(argv: list[str] | None = None, extra_args_provider=None,
                  program: str = "pretrain_rl.py") -> argparse.Namespace:
    """pretrain_rl.py's flags (and a tool's own, from `extra_args_provider`; `program` names the
    tool in --help), recipe and --hf-checkpoint applied, then every check."""
    argv = sys.argv[1:] if argv is None else argv

    def flags(parser):
        add_hf_args(add_rl_args(parser))
        return extra_args_provider(parser) if extra_args_provider else parser

    if {"-h", "--help"} & set(argv) and "--help-all" not in argv:
        print(short_help(build_parser(flags), program))
        raise SystemExit(0)
    argv = ["--help" if arg == "--help-all" else arg for arg in argv]
    recipe_path = _scan(argv, "--recipe")
    model_flags, flag_names = {}, {}

    def provider(parser):
        flags(parser)
        flag_names.update({a.dest: a.option_strings[0] for a in parser._actions if a.option_strings})
        parser.set_defaults(**RL_DEFAULTS)
        recipe = load_recipe(recipe_path, parser) if recipe_path else {}
        hf_checkpoint = _scan(argv, "--hf-checkpoint") or recipe.get("hf_checkpoint")
        if hf_checkpoint:
            model_flags.update(megatron_flags(read_hf_model(hf_checkpoint)))
            parser.set_defaults(**model_flags, rl_tokenizer=f"hf:{hf_checkpoint}",
                                seq_length=model_flags["max_position_embeddings"])
        loss = _scan(argv, "--rl-loss") or recipe.get("rl_loss", "grpo")
        if loss not in LOSS_PRESETS:
            raise ValueError(f"--rl-loss {loss}: expected one of {sorted(LOSS_PRESETS)}")
        parser.set_defaults(**LOSS_PRESETS[loss])
        parser.set_defaults(**recipe)
        unused = [] if {"-h", "--help"} & set(argv) else unused_flag_errors(given_flags(argv, recipe))
        raise_if_invalid(unknown_flag_errors(argv, parser) + unused)  # before Megatron's checks trip on them
        return parser

    args = parse_args(argv, extra_args_provider=provider)
    validate_rl_args(args, checkpoint_flag_errors(args, model_flags, flag_names))
    return args


# Sizes and counts (>= 1), and the intervals, counts, rates and durations where 0 means off or
# none (>= 0): a negative interval would fire at every step. --save-interval is Megatron's check
# (validate_save_interval).
AT_LEAST_ONE = ("grpo_prompts_per_step", "grpo_iterations", "rl_max_new_tokens", "rl_micro_batch_tokens",
                "train_iters", "rl_sft_batch_size", "rl_dynamic_sampling_max_rounds", "rl_max_turns",
                "rl_tool_output_tokens", "rl_search_top_k", "rl_code_memory_mb", "rl_samples_per_step")
NOT_NEGATIVE = ("rl_search_retries", "rl_sft_warmup_steps", "rl_keep_last_k", "rl_keep_old_weights", "rl_sft_lr", "rl_overlong_penalty",
                "save_hf_interval", "eval_interval", "exit_interval", "exit_duration_in_mins")


def bound_errors(args: argparse.Namespace) -> list[str]:
    """An error for each flag of AT_LEAST_ONE and NOT_NEGATIVE below its minimum (NaN too). Unset
    (None) is an error for AT_LEAST_ONE, whose flags the run needs, and allowed for NOT_NEGATIVE,
    where it means off."""
    errors = []
    for minimum, destinations, unset_allowed in ((1, AT_LEAST_ONE, False), (0, NOT_NEGATIVE, True)):
        for dest in destinations:
            value = getattr(args, dest)
            if value is None and unset_allowed:
                continue
            if value is None or not value >= minimum:
                errors.append(f"--{dest.replace('_', '-')} must be >= {minimum}, got {value}")
    return errors


def input_path_errors(args: argparse.Namespace) -> list[str]:
    """An error for each JSONL flag whose path is not a file (its lines are checked when read; a
    recording to replay, now), for a --rl-env-record with nowhere to go, and for a
    --pretrained-checkpoint that is no checkpoint: found now, not after the model is built on the
    GPU."""
    errors = []
    for flag, path in (("--rl-dataset", args.rl_dataset), ("--rl-eval-dataset", args.rl_eval_dataset),
                       ("--rl-search-corpus", args.rl_search_corpus), ("--rl-env-replay", args.rl_env_replay)):
        if path and os.path.isdir(path):
            errors.append(f"{flag} {path}: is a directory")
        elif path and not os.path.exists(path):
            errors.append(f"{flag} {path}: no such file")
    if args.rl_env_replay and os.path.isfile(args.rl_env_replay):
        try:
            read_recording(args.rl_env_replay)
        except (OSError, ValueError, EOFError) as exc:
            errors.append(f"--rl-env-replay {exc}" if str(exc).startswith(args.rl_env_replay)
                          else f"--rl-env-replay {args.rl_env_replay}: {exc}")
    if args.rl_env_record and not os.path.isdir(os.path.dirname(os.path.abspath(args.rl_env_record))):
        errors.append(f"--rl-env-record {args.rl_env_record}: its directory does not exist")
    if args.pretrained_checkpoint:
        try:
            resolve_checkpoint_dir(args.pretrained_checkpoint)
        except (OSError, ValueError) as exc:
            errors.append(str(exc))
    return errors


def logger_package_errors(args: argparse.Namespace) -> list[str]:
    """The metrics sinks asked for whose packages are missing (imported only when the logger is
    built, after the model and the engine)."""
    return [f"{flag} needs `pip install {package}`"
            for flag, value, package in (("--tensorboard-dir", args.tensorboard_dir, "tensorboard"),
                                         ("--wandb-project", args.wandb_project, "wandb"))
            if value and importlib.util.find_spec(package) is None]


def memory_lever_errors(args: argparse.Namespace) -> list[str]:
    """The memory levers this loop cannot honour, and why."""
    errors = []
    fraction = args.rl_kv_cache_memory_fraction
    if fraction is not None and not 0 < fraction <= 1:
        errors.append(f"--rl-kv-cache-memory-fraction must be in (0, 1], got {fraction}")
    if args.rl_kv_cache_management_mode == "offload":
        errors.append("--rl-kv-cache-management-mode offload keeps the cache's contents on the CPU "
                      "through training, and every generation here starts from an empty cache: "
                      "use recompute, which frees the same memory without the copies")
    if args.rl_offload_optimizer_during_inference and not (args.bf16 or args.fp16):
        errors.append("--rl-offload-optimizer-during-inference needs --bf16 or --fp16: without them "
                      "the optimizer updates the model's own fp32 weights, which the engine needs")
    if args.inference_dynamic_batching_enable_prefix_caching and args.hybrid_layer_pattern:
        errors.append(PREFIX_CACHING_ON_HYBRID)
    if args.rl_persist_cuda_graphs and args.rl_kv_cache_management_mode != "persist":
        errors.append("--rl-persist-cuda-graphs with --rl-kv-cache-management-mode "
                      f"{args.rl_kv_cache_management_mode} needs the cache at the same addresses "
                      "after it is reallocated (torch_memory_saver or unified memory, not set up "
                      "here): leave it out, and the engine captures its graphs again each step")
    return errors


def profile_errors(args: argparse.Namespace) -> list[str]:
    """megatron's profiling flags that would trace nothing, or nowhere."""
    start, end = args.profile_step_start, args.profile_step_end
    if not args.profile:
        return ["--use-pytorch-profiler needs --profile (with --profile-step-start and --profile-step-end: "
                "the steps to trace)"] if args.use_pytorch_profiler else []
    errors = []
    if not 1 <= start < end:
        errors.append(f"--profile-step-start {start} --profile-step-end {end}: the steps traced are "
                      "[start, end), 1 <= start < end")
    elif start > args.train_iters:
        errors.append(f"--profile-step-start {start} is after the last step (--train-iters {args.train_iters}): "
                      "nothing would be traced")
    if args.use_pytorch_profiler and not args.tensorboard_dir:
        errors.append("--use-pytorch-profiler writes each rank's trace and op table to --tensorboard-dir: give one")
    return errors


def generator_rank_errors(args: argparse.Namespace) -> list[str]:
    """What cannot work with --rl-generator-ranks."""
    errors = []
    if args.rl_generator_ranks < 0:
        errors.append(f"--rl-generator-ranks must be >= 0, got {args.rl_generator_ranks}")
    if not args.rl_generator_timeout > 0:
        errors.append(f"--rl-generator-timeout must be > 0 seconds, got {args.rl_generator_timeout}")
    if args.refit_method not in ("gloo", "nccl"):
        errors.append(f"--refit-method {args.refit_method}: gloo or nccl")
    return errors


def _same_path(a: str, b: str | None) -> bool:
    return b is not None and os.path.abspath(a) == os.path.abspath(b)


def multi_turn_errors(args: argparse.Namespace) -> list[str]:
    """The environment flags' errors: each read by its environment only, times and sizes in range."""
    errors = []
    if args.rl_tool_format == "chat" and not args.rl_env:
        errors.append("--rl-tool-format chat writes an environment's tool calls: it needs --rl-env")
    errors += [f"{flag} is read by --rl-env search only" for flag, value in
               (("--rl-search-corpus", args.rl_search_corpus), ("--rl-search-url", args.rl_search_url))
               if value and args.rl_env != "search"]
    if args.rl_search_corpus and args.rl_search_url:
        errors.append("--rl-search-corpus and --rl-search-url: give one (a corpus searched here, or a server)")
    if args.rl_search_url and not args.rl_search_url.startswith(("http://", "https://")):
        errors.append(f"--rl-search-url {args.rl_search_url}: expected an http:// or https:// URL")
    if not args.rl_search_timeout > 0:
        errors.append(f"--rl-search-timeout must be > 0 seconds, got {args.rl_search_timeout}")
    if args.rl_code_python and args.rl_env not in ("code", "terminal"):
        errors.append("--rl-code-python is read by --rl-env code or terminal only")
    if args.rl_code_without_isolation and args.rl_env != "code":
        errors.append("--rl-code-without-isolation is read by --rl-env code only (a terminal has no unisolated mode)")
    if (args.rl_task == "terminal") != (args.rl_env == "terminal"):
        errors.append("--rl-task terminal and --rl-env terminal go together: the environment runs the task's files")
    if not 0 < args.rl_code_time_limit < args.rl_env_timeout:
        errors.append(f"--rl-code-time-limit must be > 0 and below --rl-env-timeout ({args.rl_env_timeout}), "
                      f"got {args.rl_code_time_limit}")
    if not args.rl_env_timeout > 0:
        errors.append(f"--rl-env-timeout must be > 0 seconds, got {args.rl_env_timeout}")
    if args.rl_env_record and args.rl_env_replay:
        errors.append("--rl-env-record and --rl-env-replay exclude each other: a replayed run calls no environment")
    for flag, path, verb in (("--rl-env-record", args.rl_env_record, "records"),
                             ("--rl-env-replay", args.rl_env_replay, "plays back")):
        if path and not args.rl_env:
            errors.append(f"{flag} {verb} the answers of --rl-env, which is not set")
    if args.rl_env_workers is not None and args.rl_env_workers < 1:
        errors.append(f"--rl-env-workers must be >= 1, got {args.rl_env_workers}")
    if args.rl_max_context_tokens is not None and not args.rl_max_context_tokens >= 2:
        errors.append(f"--rl-max-context-tokens must be >= 2, got {args.rl_max_context_tokens}")
    return errors


def validate_rl_args(args: argparse.Namespace, errors: list[str] = ()) -> None:
    """One ValueError listing every bad RL flag (and `errors` found elsewhere)."""
    errors = [*errors, *bound_errors(args), *input_path_errors(args), *logger_package_errors(args),
              *memory_lever_errors(args), *profile_errors(args)]
    if args.rl_env and args.rl_reward_fn:
        errors.append("--rl-reward-fn with --rl-env: the environment scores each conversation")
    if args.rl_task == "lookup" and args.rl_env != "search":
        errors.append("--rl-task lookup needs --rl-env search: its values are found only by searching its corpus")
    if args.rl_generation_lag < 0:
        errors.append(f"--rl-generation-lag must be >= 0, got {args.rl_generation_lag}")
    if args.rl_generation_lag and not args.rl_partial_rollouts:
        errors.append("--rl-generation-lag needs --rl-partial-rollouts (megatron-core's rule)")
    errors += [*generator_rank_errors(args), *multi_turn_errors(args)]
    if args.rl_dataset and args.rl_task not in ("jsonl", "terminal"):
        errors.append(f"--rl-dataset is read by --rl-task jsonl or terminal only (the task is {args.rl_task})")
    early_exit = [flag for flag, value in (("--exit-interval", args.exit_interval),
                                           ("--exit-duration-in-mins", args.exit_duration_in_mins),
                                           ("--exit-signal-handler", args.exit_signal_handler)) if value]
    if early_exit and not args.save:
        errors.append(f"{', '.join(early_exit)} stop the run with a checkpoint: give --save DIR")
    if args.grpo_group_size < 2:
        errors.append("--grpo-group-size must be >= 2: advantages compare completions of a prompt")
    if args.rl_inference_logprobs_is_correction and not args.rl_importance_sampling_truncation_coef:
        errors.append("--rl-inference-logprobs-is-correction needs "
                      "--rl-importance-sampling-truncation-coef (the TIS cap)")
    if not 0 <= args.rl_overlong_buffer <= args.rl_max_new_tokens:
        errors.append("--rl-overlong-buffer must be in [0, --rl-max-new-tokens]")
    if args.grpo_kl_beta < 0 or args.grpo_entropy_term_weight < 0:
        errors.append("--grpo-kl-beta and --grpo-entropy-term-weight must be >= 0")
    if args.grpo_kl_beta > 0 and args.rl_sft_warmup_steps > 0:
        errors.append("--grpo-kl-beta > 0 with --rl-sft-warmup-steps: the KL reference is the "
                      "starting policy (--pretrained-checkpoint), not the warmed-up one; warm up "
                      "in a separate run and pass its checkpoint")
    if args.save_interval and not args.save:
        errors.append("--save-interval needs --save DIR")
    # --save D --load D on a first run starts fresh (a cluster job's "resume if there is
    # something to resume"); a --load of its own that is missing is a typo
    if args.load and not os.path.isdir(args.load) and not _same_path(args.load, args.save):
        errors.append(f"--load {args.load}: no such directory (an existing empty directory, or the "
                      "--save directory, starts a fresh run)")
    if bool(args.eval_interval) != bool(args.rl_eval_dataset):
        errors.append("--eval-interval and --rl-eval-dataset go together")
    if args.rl_default_top_k > 0 or args.rl_default_top_p > 0:
        errors.append("--rl-default-top-k / --rl-default-top-p: the trainer's logprobs are of the "
                      "temperature-scaled distribution only, so the policy ratio and TIS would "
                      "refer to a distribution the tokens were not sampled from; sample with "
                      "--rl-default-temperature alone")
    if args.rl_default_temperature <= 0:
        errors.append("--rl-default-temperature must be > 0")
    raise_if_invalid(errors)
