"""The RL loop end to end on CPU (one gloo rank, a scripted engine, a small stand-in model): warm-up,
steps, the validation reward at its interval, the learning-rate schedule, metrics records with
every key a step reports, and the weight version counting optimizer updates."""

import json
import os
import re
import signal
import types

import pytest
import torch

from megatron_rl_bi.config import parse_rl_args
from megatron_rl_bi.config.from_args import (
    loop_config_from_args,
    rollout_config_from_args,
    sampling_from_args,
    step_config_from_args,
)
from megatron_rl_bi.envs import build_task
from megatron_rl_bi.envs.tasks import JsonlTask
from megatron_rl_bi.envs.tokenizer import CharTokenizer
from megatron_rl_bi.inference import Generation
from megatron_rl_bi.models.logprobs import forward_logprobs
from megatron_rl_bi.optimizer import build_lr_scheduler
from megatron_rl_bi.packing import pack_sequences
from megatron_rl_bi.reporting.metrics import MetricsLogger, read_step_records
from megatron_rl_bi.rl import loop, step
from megatron_rl_bi.rl.loop import run_rl

from .conftest import ScriptedGenerator
from .test_rl_step import SGD, TinyDDP

TOK = CharTokenizer()
MODEL = ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1",
         "--seq-length", "64", "--max-position-embeddings", "64"]


class SortingEngine:
    """Completes 'sort: dcab' prompts: right for even requests, wrong for odd ones."""

    def generate(self, prompts, sampling, max_new_tokens=None):
        out = []
        for i, prompt in enumerate(prompts):
            letters = TOK.decode(prompt).split(": ")[-1].strip()
            text = "".join(sorted(letters)) if i % 2 == 0 else letters
            completion = TOK.encode(text) + [TOK.eod]
            out.append(Generation(list(prompt), completion, [-1.0] * len(completion),
                                  stopped_on_eod=True, max_new_tokens=sampling.max_new_tokens))
        return out


@pytest.fixture
def cpu_loop(gloo_group, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (0, 0))  # no GPU: nothing beyond torch


def _run(tmp_path, flags, eval_examples=None) -> dict[int, dict]:
    """A run of the stand-in model on the sorting task; its step records."""
    args = parse_rl_args(MODEL + ["--grpo-prompts-per-step", "2", "--grpo-group-size", "2",
                                  "--rl-metrics-jsonl", str(tmp_path / "m.jsonl"), *flags])
    model = TinyDDP(vocab_size=TOK.vocab_size)
    optimizer = SGD(model)
    logger = MetricsLogger(total_steps=args.train_iters, jsonl_path=args.rl_metrics_jsonl)
    run_rl(ddp=model, optimizer=optimizer, generator=SortingEngine(), task=build_task("sort", 0),
           tokenizer=TOK, rollout_config=rollout_config_from_args(args),
           step_config=step_config_from_args(args), sampling=sampling_from_args(args, TOK.eod),
           config=loop_config_from_args(args), logger=logger,
           lr_scheduler=build_lr_scheduler(args, optimizer), eval_examples=eval_examples)
    logger.close()
    return read_step_records(str(tmp_path / "m.jsonl"))


def test_a_run(tmp_path, cpu_loop):
    eval_path = tmp_path / "eval.jsonl"
    eval_path.write_text('{"prompt": "sort: 321\\n", "answer": "123"}\n')
    records = _run(tmp_path, [
        "--train-iters", "4", "--grpo-iterations", "2", "--lr", "0.1", "--lr-decay-style", "linear",
        "--rl-sft-warmup-steps", "2", "--rl-sft-batch-size", "2",
        "--rl-eval-dataset", str(eval_path), "--eval-interval", "2"],
        eval_examples=JsonlTask(str(eval_path)).examples)
    assert sorted(records) == [1, 2, 3, 4]
    assert [records[s]["weight_version"] for s in (1, 2, 3, 4)] == [2, 4, 6, 8]
    assert [records[s]["lr"] for s in (1, 2, 3, 4)] == pytest.approx([0.0875, 0.0625, 0.0375, 0.0125])
    assert records[1]["reward/task_mean"] == 0.5 and records[1]["rollouts/groups"] == 2
    assert "validation_reward/mean" not in records[1]
    assert records[2]["validation_reward/mean"] == 1.0  # request 0 of the eval set is answered right
    assert records[1]["time/startup_sft_s"] > 0  # the warm-up's time, in the first record alone
    assert not any("time/startup_sft_s" in records[s] for s in (2, 3, 4))
    header = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[0])
    assert "run" in header


def test_the_allocators_history_is_written_after_each_step(tmp_path, cpu_loop, monkeypatch):
    written = []
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda filename: written.append(filename) or
                        open(filename, "w").close())
    _run(tmp_path, ["--train-iters", "3", "--record-memory-history", "--memory-snapshot-path",
                    str(tmp_path / "snap" / "s.pickle")])
    assert written == [str(tmp_path / "snap" / "s.pickle.tmp")] * 3
    assert (tmp_path / "snap" / "s.pickle").exists()


def test_exit_interval_stops_with_a_checkpoint(tmp_path, cpu_loop, monkeypatch):
    saved = []
    monkeypatch.setattr(loop, "save_checkpoint", lambda root, step, *a, **k: saved.append(step))
    records = _run(tmp_path, ["--train-iters", "6", "--exit-interval", "2", "--save",
                              str(tmp_path / "ckpt"), "--save-interval", "100"])
    assert sorted(records) == [1, 2] and saved == [2]


def test_exit_duration_stops_after_the_step_that_ends_late(tmp_path, cpu_loop, monkeypatch):
    saved = []
    monkeypatch.setattr(loop, "save_checkpoint", lambda root, step, *a, **k: saved.append(step))
    clock = iter(range(10**6))  # every reading of the clock a second after the last
    monkeypatch.setattr(loop.time, "time", lambda: next(clock))
    records = _run(tmp_path, ["--train-iters", "20", "--exit-duration-in-mins", "1", "--save",
                              str(tmp_path / "ckpt"), "--save-interval", "100"])
    assert sorted(records) == list(range(1, len(records) + 1)) and len(records) < 20
    assert saved == [len(records)]


def test_exit_signal_stops_after_the_step_it_arrived_in(tmp_path, cpu_loop, monkeypatch):
    saved, generate = [], SortingEngine.generate
    monkeypatch.setattr(loop, "save_checkpoint", lambda root, step, *a, **k: saved.append(step))

    def generate_then_signal_on_step_3(self, prompts, sampling, max_new_tokens=None):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 3:
            os.kill(os.getpid(), signal.SIGUSR1)
        return generate(self, prompts, sampling, max_new_tokens)

    monkeypatch.setattr(SortingEngine, "generate", generate_then_signal_on_step_3)
    before = signal.getsignal(signal.SIGUSR1)
    records = _run(tmp_path, ["--train-iters", "6", "--exit-signal-handler", "--exit-signal",
                              "SIGUSR1", "--save", str(tmp_path / "ckpt"), "--save-interval", "100"])
    assert sorted(records) == [1, 2, 3] and saved == [3]
    assert signal.getsignal(signal.SIGUSR1) is before  # the handler is the run's only


def test_a_checkpoint_of_another_schedule_is_refused_naming_the_flags():
    def scheduler(train_iters):
        args = parse_rl_args(MODEL + ["--train-iters", str(train_iters), "--lr-decay-style", "linear"])
        return build_lr_scheduler(args, SGD(TinyDDP(vocab_size=TOK.vocab_size)))

    state = scheduler(10).state_dict()
    loop._restore_lr_schedule(scheduler(10), state, "ckpt")  # the same flags: restored
    with pytest.raises(ValueError, match=r"--load ckpt: .*--train-iters.*--exit-interval.*"
                                         r"--override-opt_param-scheduler"):
        loop._restore_lr_schedule(scheduler(5), state, "ckpt")


class LookupEngine(ScriptedGenerator):
    """Plays the lookup task turn by turn: searches for the key, then answers it, right for even
    requests and wrong for odd ones; the engine's logprob of each sampled token is -1."""

    def __init__(self, task):
        self.task = task
        self.config = types.SimpleNamespace(max_sequence_length=128, max_prompt_tokens=127)

    def generate(self, prompts, sampling, max_new_tokens=None):
        out = []
        for i, prompt in enumerate(prompts):
            text = TOK.decode(prompt)
            key = text.split()[1]
            answer = self.task.values[key] if i % 2 == 0 else "000"
            turn = f"<answer>{answer}</answer>" if "<information>" in text else f"<search>{key}</search>"
            completion = TOK.encode(turn)
            out.append(Generation(list(prompt), completion, [-1.0] * len(completion)))
        return out


def test_a_multi_turn_run_trains_on_sampled_tokens_only(tmp_path, cpu_loop, monkeypatch):
    trained = []  # (target ids, loss mask, sequence ids) of each micro-batch the loss weighs
    token_weights = step.token_weights

    def recording_token_weights(completion, sequence_ids, *rest):
        trained.append((packed_targets[-1], completion.clone(), sequence_ids.clone()))
        return token_weights(completion, sequence_ids, *rest)

    packed_targets, pack = [], step._pack

    def recording_pack(rollouts):
        packed, advantages = pack(rollouts)
        packed_targets.append(packed.batch.target_ids.clone())
        return packed, advantages

    monkeypatch.setattr(step, "token_weights", recording_token_weights)
    monkeypatch.setattr(step, "_pack", recording_pack)
    args = parse_rl_args(MODEL + ["--grpo-prompts-per-step", "2", "--grpo-group-size", "2",
                                  "--rl-task", "lookup", "--rl-env", "search", "--rl-search-top-k", "1",
                                  "--train-iters", "2", "--rl-sft-warmup-steps", "1", "--rl-sft-batch-size", "2",
                                  "--rl-metrics-jsonl", str(tmp_path / "m.jsonl")])
    task = build_task("lookup", 0)
    model, logger = TinyDDP(vocab_size=TOK.vocab_size), MetricsLogger(total_steps=2, jsonl_path=args.rl_metrics_jsonl)
    optimizer = SGD(model)
    run_rl(ddp=model, optimizer=optimizer, generator=LookupEngine(task), task=task, tokenizer=TOK,
           rollout_config=rollout_config_from_args(args, task), step_config=step_config_from_args(args),
           sampling=sampling_from_args(args, TOK.eod), config=loop_config_from_args(args), logger=logger,
           lr_scheduler=build_lr_scheduler(args, optimizer))
    logger.close()
    for record in read_step_records(str(tmp_path / "m.jsonl")).values():
        assert record["rollouts/turns"] == 2 and record["rollouts/turns_max"] == 2
        assert record["reward/task_mean"] == 0.5
        # each conversation: "<search>k1x</search>" (20) and "<answer>ddd</answer>" (20) sampled,
        # "\n<information>Doc 1: k1x is ddd</information>\n" (46) from the environment
        assert record["rollouts/sampled_tokens"] == 40 and record["rollouts/environment_tokens"] == 46
        assert record["bit_wise/tokens"] == 4 * 40  # parity over the sampled tokens alone
    # the loss weighs the tokens the model sampled, each conversation's two turns, and no other
    assert len(trained) == 2
    for targets, loss_mask, sequence_ids in trained:
        for sequence in range(4):
            text = TOK.decode(targets[loss_mask & (sequence_ids == sequence)].tolist())
            key, value = re.fullmatch(r"<search>(\w+)</search><answer>(\d+)</answer>", text).groups()
            assert value == (task.values[key] if sequence % 2 == 0 else "000")


class CountingSortingEngine(SortingEngine):
    def __init__(self):
        self.calls = 0

    def generate(self, prompts, sampling, max_new_tokens=None):
        self.calls += 1
        return super().generate(prompts, sampling, max_new_tokens)


def test_generation_ahead_records_each_rollouts_staleness(tmp_path, cpu_loop):
    engine = CountingSortingEngine()
    args = parse_rl_args(MODEL + ["--grpo-prompts-per-step", "2", "--grpo-group-size", "2", "--train-iters", "5",
                                  "--rl-partial-rollouts", "--rl-generation-lag", "2", "--lr", "0.1",
                                  "--rl-metrics-jsonl", str(tmp_path / "m.jsonl")])
    model, logger = TinyDDP(vocab_size=TOK.vocab_size), MetricsLogger(total_steps=5, jsonl_path=args.rl_metrics_jsonl)
    optimizer = SGD(model)
    run_rl(ddp=model, optimizer=optimizer, generator=engine, task=build_task("sort", 0), tokenizer=TOK,
           rollout_config=rollout_config_from_args(args), step_config=step_config_from_args(args),
           sampling=sampling_from_args(args, TOK.eod), config=loop_config_from_args(args), logger=logger,
           lr_scheduler=build_lr_scheduler(args, optimizer))
    logger.close()
    records = read_step_records(str(tmp_path / "m.jsonl"))
    # batches for steps 1-3 come from the starting weights; then each is generated two steps early
    assert [records[s]["rollouts/staleness"] for s in range(1, 6)] == [0, 1, 2, 2, 2]
    assert [records[s]["rollouts/staleness_max"] for s in range(1, 6)] == [0, 1, 2, 2, 2]
    assert engine.calls == 5  # nothing generated past the last step
    assert "bit_wise_stale/tokens" not in records[1]  # every rollout fresh: no split
    for step in range(2, 6):
        record = records[step]
        assert record["bit_wise_stale/tokens"] == record["bit_wise/tokens"] and record["bit_wise_fresh/tokens"] == 0


@pytest.mark.parametrize("flags,message", [
    (["--rl-generation-lag", "2"], "--rl-generation-lag needs --rl-partial-rollouts"),
    (["--rl-partial-rollouts", "--rl-generation-lag", "-1"], "--rl-generation-lag must be >= 0"),
])
def test_generation_lag_flags_that_cannot_work_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        parse_rl_args(MODEL + flags)


class ModelEngine(SortingEngine):
    """Completes like SortingEngine, with the logprobs `model` gives each completion token (one
    request at a time, as an engine would), so a trainer holding the same weights reproduces them."""

    def __init__(self, model):
        self.model = model

    def generate(self, prompts, sampling, max_new_tokens=None):
        out = []
        for generation in super().generate(prompts, sampling, max_new_tokens):
            batch = pack_sequences([generation.tokens], [len(generation.prompt_tokens)])
            with torch.no_grad():
                logprobs, _ = forward_logprobs(self.model, batch)
            generation.completion_logprobs = logprobs[batch.completion].tolist()
            out.append(generation)
        return out


def test_stale_rollouts_recomputed_under_their_own_weights_match_the_engine(tmp_path, cpu_loop):
    args = parse_rl_args(MODEL + ["--grpo-prompts-per-step", "2", "--grpo-group-size", "2", "--train-iters", "4",
                                  "--rl-partial-rollouts", "--rl-generation-lag", "2", "--rl-keep-old-weights", "3",
                                  "--lr", "0.5", "--rl-metrics-jsonl", str(tmp_path / "m.jsonl")])
    model, logger = TinyDDP(vocab_size=TOK.vocab_size), MetricsLogger(total_steps=4, jsonl_path=args.rl_metrics_jsonl)
    optimizer = SGD(model)
    run_rl(ddp=model, optimizer=optimizer, generator=ModelEngine(model), task=build_task("sort", 0), tokenizer=TOK,
           rollout_config=rollout_config_from_args(args), step_config=step_config_from_args(args),
           sampling=sampling_from_args(args, TOK.eod), config=loop_config_from_args(args), logger=logger,
           lr_scheduler=build_lr_scheduler(args, optimizer))
    logger.close()
    records = read_step_records(str(tmp_path / "m.jsonl"))
    assert records[1]["bit_wise/logprob_diff/max"] == 0.0  # fresh: the same weights on both sides
    for step in (2, 3, 4):
        record = records[step]
        assert record["bit_wise_stale/logprob_diff/max"] > 0  # the weights moved since sampling
        # under the weights that sampled them, every stale token matches again
        assert record["bit_wise_versioned/tokens"] == record["bit_wise_stale/tokens"] > 0
        assert record["bit_wise_versioned/logprob_diff/max"] == 0.0
