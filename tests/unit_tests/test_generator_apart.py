"""Generator ranks apart (--rl-generator-ranks) on CPU: a trainer process and a generator process,
each its own gloo world, joined by the bridge (a TCPStore and a gloo weights group). The
generator starts from other weights than the trainer's and samples with its own copy of the
model, so every rollout's logprobs equal the trainer's only if the weights arrived bit for bit.

The claims: with the same flags a run with the generator apart repeats the colocated run's step
records in every non-timing value, at --rl-generation-lag 0 and 2 (the window's bookkeeping,
staleness included); a run stopped early and resumed from its checkpoint repeats the
uninterrupted one (buffered batches neither lost nor generated twice); a generator that never
answers stops the trainer with an error naming it; the roles and the flags that cannot work."""

import os

import pytest
import torch

from megatron_rl_bi.bridge import Bridge, Roles, roles_from_environment
from megatron_rl_bi.config import parse_rl_args
from megatron_rl_bi.config.from_args import (
    loop_config_from_args,
    rollout_config_from_args,
    sampling_from_args,
    step_config_from_args,
)
from megatron_rl_bi.envs import build_task
from megatron_rl_bi.envs.tasks import JsonlTask
from megatron_rl_bi.optimizer import build_lr_scheduler
from megatron_rl_bi.reporting.metrics import MetricsLogger, is_machine_measurement, read_step_records
from megatron_rl_bi.rl.generator_apart import Schedule, rank_batches, rank_validation, serve_generation
from megatron_rl_bi.rl import loop
from megatron_rl_bi.rl.loop import run_rl

from .conftest import free_port
from .test_rl_loop import MODEL, TOK, ModelEngine, cpu_loop  # noqa: F401 - a fixture
from .test_rl_step import SGD, TinyDDP



def _args(tmp_path, name: str, flags: list[str]):
    return parse_rl_args(MODEL + ["--grpo-prompts-per-step", "2", "--grpo-group-size", "2", "--lr", "0.5",
                                  "--rl-metrics-jsonl", str(tmp_path / f"{name}.jsonl"), *flags])


def _on_cpu() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda: None
    torch.cuda.max_memory_allocated = lambda: 0
    torch.cuda.reset_peak_memory_stats = lambda: None
    torch.cuda.mem_get_info = lambda: (0, 0)


def _held_out(args) -> list | None:
    return JsonlTask(args.rl_eval_dataset).examples if args.rl_eval_dataset else None


def _train(args, generator=None, bridge=None) -> None:
    model = TinyDDP(vocab_size=TOK.vocab_size)
    optimizer = SGD(model)
    logger = MetricsLogger(total_steps=args.train_iters, jsonl_path=args.rl_metrics_jsonl)
    run_rl(ddp=model, optimizer=optimizer, generator=generator and generator(model), task=build_task("sort", 0),
           tokenizer=TOK, rollout_config=rollout_config_from_args(args), step_config=step_config_from_args(args),
           sampling=sampling_from_args(args, TOK.eod), config=loop_config_from_args(args), logger=logger,
           lr_scheduler=build_lr_scheduler(args, optimizer), bridge=bridge, eval_examples=_held_out(args))
    logger.close()


def _generate(bridge, args) -> None:
    """The generator process: its own model, zeroed (the trainer's weights must arrive), its engine."""
    model = TinyDDP(vocab_size=TOK.vocab_size)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    engine, sampling, rollouts = ModelEngine(model), sampling_from_args(args, TOK.eod), rollout_config_from_args(args)
    examples = _held_out(args)
    validate = examples and rank_validation(engine, examples, TOK, sampling, args.seed, rollouts, 1)
    serve_generation(bridge, model, build_task("sort", 0), args.seed, rank_batches(engine, TOK, sampling, rollouts),
                     validate or None)


def _save(save_dir, step, ddp, optimizer, rl_state, keep_last=0) -> None:
    """The loop's checkpoint, of the stand-in model (megatron-core's checkpointing of a real one
    is tested in test_resume)."""
    os.makedirs(save_dir, exist_ok=True)
    torch.save({"model": ddp.state_dict(), "optimizer": optimizer.inner.state_dict(), "rl": rl_state},
               os.path.join(save_dir, "latest.pt"))


def _load(load_dir, ddp, optimizer, load_optimizer=True) -> dict | None:
    path = os.path.join(load_dir, "latest.pt")
    if not os.path.exists(path):
        return None
    state = torch.load(path, weights_only=False)
    ddp.load_state_dict(state["model"])
    optimizer.inner.load_state_dict(state["optimizer"])
    return state["rl"]


def _process(index: int, ports: dict, args, silent_generator: bool) -> None:
    """Process 0 trains, process 1 generates; each is a gloo world of one."""
    _on_cpu()
    loop.save_checkpoint, loop.load_checkpoint = _save, _load
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[index]}", rank=0,
                                         world_size=1)
    bridge = Bridge(Roles(index, 2, 1), "gloo", 20.0 if not silent_generator else 3.0, "127.0.0.1", ports["bridge"])
    if index == 0:
        _train(args, bridge=bridge)
    elif not silent_generator:
        _generate(bridge, args)
    torch.distributed.destroy_process_group()


def _apart(args, silent_generator: bool = False) -> None:
    ports = {0: free_port(), 1: free_port(), "bridge": free_port()}
    torch.multiprocessing.spawn(_process, args=(ports, args, silent_generator), nprocs=2)


def _non_timing(records: dict) -> dict:
    return {step: {k: v for k, v in record.items() if not is_machine_measurement(k)}
            for step, record in records.items()}


@pytest.mark.parametrize("lag", [0, 2])
def test_a_generator_apart_repeats_the_colocated_run(tmp_path, cpu_loop, lag):
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text('{"prompt": "sort: cab\\n", "answer": "abc"}\n{"prompt": "sort: ba\\n", "answer": "ab"}\n')
    flags = ["--train-iters", "5", "--rl-partial-rollouts", "--rl-generation-lag", str(lag),
             "--rl-eval-dataset", str(held_out), "--eval-interval", "2"]
    colocated = _args(tmp_path, "colocated", flags)
    _train(colocated, generator=ModelEngine)
    apart = _args(tmp_path, "apart", flags + ["--rl-generator-ranks", "1"])
    _apart(apart)
    records = _non_timing(read_step_records(apart.rl_metrics_jsonl))
    assert records == _non_timing(read_step_records(colocated.rl_metrics_jsonl))
    assert [records[s]["bit_wise/logprob_diff/max"] == 0.0 for s in range(1, 6)] == [True] + [lag == 0] * 4
    if lag:
        assert [records[s]["rollouts/staleness"] for s in range(1, 6)] == [0, 1, 2, 2, 2]
    # validated by the generator with the weights it was sent after steps 2 and 4
    assert [("validation_reward/mean" in records[s]) for s in range(1, 6)] == [False, True, False, True, False]


def test_a_run_stopped_and_resumed_repeats_the_uninterrupted_one(tmp_path):
    flags = ["--train-iters", "6", "--rl-partial-rollouts", "--rl-generation-lag", "2", "--rl-generator-ranks", "1"]
    whole = _args(tmp_path, "whole", flags)
    _apart(whole)
    ckpt = str(tmp_path / "ckpt")
    first = _args(tmp_path, "first", flags + ["--save", ckpt, "--save-interval", "100", "--exit-interval", "3"])
    _apart(first)
    second = _args(tmp_path, "second", flags + ["--load", ckpt])
    _apart(second)
    records = _non_timing(read_step_records(whole.rl_metrics_jsonl))
    assert sorted(read_step_records(first.rl_metrics_jsonl)) == [1, 2, 3]
    resumed = _non_timing(read_step_records(second.rl_metrics_jsonl))
    assert sorted(resumed) == [4, 5, 6]
    assert resumed == {step: records[step] for step in (4, 5, 6)}


def test_a_generator_that_never_answers_stops_the_trainer_naming_it(tmp_path):
    args = _args(tmp_path, "silent", ["--train-iters", "2", "--rl-generator-ranks", "1"])
    with pytest.raises(Exception, match=r"generator rank 1 sent nothing for 'batch/1/0' within 3 s "
                                        r"\(--rl-generator-timeout\)"):
        _apart(args, silent_generator=True)


def test_roles_split_the_processes_and_each_trainer_has_one_generator(monkeypatch):
    roles = [Roles(rank, 7, 3) for rank in range(7)]
    assert [r.is_generator for r in roles] == [False] * 4 + [True] * 3
    assert [r.served_ranks() for r in roles[4:]] == [[0, 3], [1], [2]]
    assert [roles[0].generator_of(t) for t in range(4)] == [4, 5, 6, 4]
    # 3 nodes of 3 processes, the last 5 generating: 3 trainers on node 0, 1 on node 1, none on node 2
    assert [Roles(0, 9, 5).trainers_on_node(3, node) for node in range(3)] == [3, 1, 0]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="--rl-generator-ranks 2 of 2 processes leaves no trainer"):
        roles_from_environment(2)


@pytest.mark.parametrize("flags,message", [
    (["--rl-generator-ranks", "-1"], "--rl-generator-ranks must be >= 0"),
    (["--rl-generator-ranks", "1", "--rl-generator-timeout", "0"], "--rl-generator-timeout must be > 0"),
])
def test_generator_flags_that_cannot_work_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        parse_rl_args(MODEL + flags)


def test_the_weights_go_out_when_a_batch_or_a_validation_needs_them():
    schedule = Schedule(lag=2, last_step=10, eval_interval=4)
    # batches up to step 10 use the weights of steps up to 7; step 8 is validated
    assert [s for s in range(1, 11) if schedule.sends_after(s)] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert (schedule.next_send(7), schedule.next_send(8), schedule.next_send(0)) == (8, None, 1)
    assert [s for s in range(1, 11) if Schedule(lag=0, last_step=10).sends_after(s)] == list(range(1, 10))


class _Exchange:
    """A bridge's key-value exchange, in memory: trainer rank 0 and one generator."""

    def __init__(self, roles, shared):
        self.roles, self.shared = roles, shared

    def put(self, key, value):
        self.shared[key] = value

    def take(self, key, who):
        return self.shared[key]


@pytest.mark.parametrize("generator_tensors,message", [
    ({"w": torch.zeros(2, 3), "b": torch.zeros(3)}, None),
    ({"w": torch.zeros(3, 2), "b": torch.zeros(3)}, r"gen: its model has \('w', \(3, 2\), 'torch.float32'\), "
                                                    r"the trainer's \('w', \(2, 3\), 'torch.float32'\)"),
    ({"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}, r"\('b', \(3,\), 'torch.bfloat16'\)"),
    ({"w": torch.zeros(2, 3)}, "gen: its model has 1 tensors, the trainer's 2"),
])
def test_a_generator_built_otherwise_than_the_trainer_is_refused(generator_tensors, message):
    from megatron_rl_bi.bridge import check_layout

    shared = {}
    check_layout(_Exchange(Roles(0, 2, 1), shared), [("w", torch.zeros(2, 3)), ("b", torch.zeros(3))], "trainer")
    generator = _Exchange(Roles(1, 2, 1), shared)
    if message is None:
        check_layout(generator, list(generator_tensors.items()), "gen")
    else:
        with pytest.raises(ValueError, match=message):
            check_layout(generator, list(generator_tensors.items()), "gen")
