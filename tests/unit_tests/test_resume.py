"""Resume on CPU with the real pieces: a tiny Megatron GPT model in megatron-core's DDP, its
optimizer and learning-rate schedule, saved by the loop's own save and restored by the loop's
own resume path (`rl.loop._resume_or_warm_up`) through megatron-core's dist checkpointing.
Everything a resumed run needs is checked to come back: weights, Adam state, schedule, prompt
position, seed, and every RNG. Where megatron-core hard-codes CUDA (a few `device='cuda'`
tensors, the CUDA RNG, stream syncs) the fixture puts the CPU in its place; no other part is
replaced."""

import dataclasses
import random

import pytest
import torch

from megatron_rl_bi import bi
from megatron_rl_bi.config import parse_rl_args
from megatron_rl_bi.config.from_args import loop_config_from_args
from megatron_rl_bi.envs import PromptSource, build_task
from megatron_rl_bi.envs.tokenizer import CharTokenizer
from megatron_rl_bi.inference import Generation
from megatron_rl_bi.models.build import build_model
from megatron_rl_bi.optimizer import build_ddp_and_optimizer, build_lr_scheduler
from megatron_rl_bi.rl import loop
from megatron_rl_bi.rl.generation_ahead import GenerationAhead
from megatron_rl_bi.rl.rollouts import Rollout

MODEL = ["--num-layers", "1", "--hidden-size", "16", "--ffn-hidden-size", "32",
         "--num-attention-heads", "2", "--seq-length", "32", "--max-position-embeddings", "32",
         "--micro-batch-size", "1", "--use-cpu-initialization", "--transformer-impl", "local",
         "--flash-attention-version", "4", "--lr", "0.01", "--lr-decay-style", "linear",
         "--lr-warmup-iters", "1", "--train-iters", "10", "--clip-grad", "0"]


ROLLOUT = Rollout(Generation(prompt_tokens=[5, 6], completion_tokens=[7, 8, 9], completion_logprobs=[-0.5, -0.25, -1.5],
                             completion_sampled=[True, False, True], stopped_on_eod=True, max_new_tokens=4),
                  reward=1.0, group_id=3, weight_version=1, advantage=-0.75)


def _update(ddp, optimizer, lr_scheduler) -> None:
    """One optimizer update on the gradient of sum(w^2): Adam state and schedule move."""
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    sum((p.float() ** 2).sum() for p in ddp.parameters()).backward()
    succeeded, _, _ = optimizer.step()
    assert succeeded
    lr_scheduler.step(1)


def _optimizer_tensors(optimizer) -> dict[tuple, torch.Tensor]:
    """Adam's state by (optimizer, group, parameter index, key)."""
    return {(i, g, p, key): value.clone()
            for i, inner in enumerate(optimizer.chained_optimizers)
            for g, group in enumerate(inner.optimizer.param_groups)
            for p, param in enumerate(group["params"])
            for key, value in inner.optimizer.state[param].items()}


def _everything(ddp, optimizer, lr_scheduler, source, rng) -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {"weights": {k: v.clone() for k, v in ddp.state_dict().items() if torch.is_tensor(v)},
            "adam": _optimizer_tensors(optimizer), "lr": optimizer.param_groups[0]["lr"],
            "schedule": lr_scheduler.state_dict(), "position": source.position,
            "python": random.getstate(), "torch": torch.get_rng_state(), "cuda": rng.get(),
            "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}}


def _differing(expected: dict, actual: dict) -> set[str]:
    """The names of `_everything` whose values are not equal (tensors by torch.equal)."""
    def same(a, b):
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return torch.equal(a, b) if torch.is_tensor(a) else a == b

    return {name for name in expected if not same(expected[name], actual[name])}


def _restart(rng):
    """What a restarted process has before it loads: other RNG states (and other initial weights,
    built from them), an empty Adam state, a fresh schedule, prompts from the start."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.seed(99)
    torch.manual_seed(99)
    rng.set(torch.full((16,), 7, dtype=torch.uint8))
    get_cuda_rng_tracker().set_states({"model-parallel-rng": torch.full((16,), 9, dtype=torch.uint8)})


def _build(flags):
    args = parse_rl_args(MODEL + flags)
    with bi.batch_invariant(False):
        model = build_model(args, CharTokenizer().vocab_size)
    ddp, optimizer = build_ddp_and_optimizer(args, model)
    return args, ddp, optimizer, build_lr_scheduler(args, optimizer)


def test_resume_restores_weights_optimizer_schedule_position_seed_and_rngs(tmp_path, cpu_training):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    ckpt = str(tmp_path / "ckpt")
    args, ddp, optimizer, lr_scheduler = _build(["--save", ckpt, "--save-interval", "5", "--seed", "3"])
    task = build_task("sort", args.seed)
    source = PromptSource(task, args.seed)
    for _ in range(2):
        _update(ddp, optimizer, lr_scheduler)
    source.take(5)
    random.seed(1)
    torch.manual_seed(2)
    cpu_training.set(torch.arange(16, dtype=torch.uint8))
    get_cuda_rng_tracker().set_states({"model-parallel-rng": torch.arange(16, 32, dtype=torch.uint8)})
    saved = _everything(ddp, optimizer, lr_scheduler, source, cpu_training)
    config = loop_config_from_args(args)
    ahead = GenerationAhead(2, 10, generate=None)  # a batch generated ahead, not yet trained on
    ahead.load_state_dict([{"groups": [[dataclasses.asdict(ROLLOUT)]], "stats": {"means": {"m": (1.5, 2)}}}])
    loop._save(3, 2, ddp, optimizer, lr_scheduler, source, ahead, config, hf_model=None, exiting=True)

    _restart(cpu_training)
    resume_args, ddp, optimizer, lr_scheduler = _build(["--load", ckpt, "--seed", "3"])
    source = PromptSource(task, resume_args.seed)
    resume = loop_config_from_args(resume_args)
    assert _differing(saved, _everything(ddp, optimizer, lr_scheduler, source, cpu_training)) == set(saved)
    resumed_ahead = GenerationAhead(2, 10, generate=None)
    step, weight_version = loop._resume_or_warm_up(ddp, optimizer, lr_scheduler, source, resumed_ahead, task,
                                                   CharTokenizer(), resume, logger=None)
    assert (step, weight_version) == (3, 2)
    [(groups, stats)] = resumed_ahead.pending  # neither lost nor to be generated again
    assert groups == [[ROLLOUT]] and stats.means == {"m": (1.5, 2)}
    assert len(saved["adam"]) > len(saved["weights"]) > 0
    assert _differing(saved, _everything(ddp, optimizer, lr_scheduler, source, cpu_training)) == set()

    other_seed = loop_config_from_args(parse_rl_args(MODEL + ["--load", ckpt, "--seed", "4"]))
    with pytest.raises(ValueError, match=r"--load .*ckpt: the checkpoint's run had --seed 3, this one 4"):
        loop._resume_or_warm_up(ddp, optimizer, lr_scheduler, source, resumed_ahead, task, CharTokenizer(),
                                other_seed, logger=None)


def test_a_corrupt_shard_names_the_checkpoint_and_the_way_out(tmp_path, cpu_training):
    """torch.distributed.checkpoint raises CheckpointException, a BaseException that named
    neither the checkpoint nor what to do."""
    ckpt = tmp_path / "ckpt"
    args, ddp, optimizer, lr_scheduler = _build(["--save", str(ckpt), "--save-interval", "1"])
    _update(ddp, optimizer, lr_scheduler)
    source = PromptSource(build_task("sort", args.seed), args.seed)
    config = loop_config_from_args(args)
    for step in (3, 5):
        loop._save(step, step, ddp, optimizer, lr_scheduler, source, GenerationAhead(0, 10, None), config,
                   hf_model=None, exiting=True)
    shards = sorted((ckpt / "iter_0000005").glob("*.distcp"))
    assert shards
    shards[0].write_bytes(b"garbage" * 100)
    resume = loop_config_from_args(parse_rl_args(MODEL + ["--load", str(ckpt)]))
    with pytest.raises(ValueError, match=(
            r"^.*ckpt/iter_0000005: cannot read the model/optimizer checkpoint \(rank 0: .*\); to resume "
            r"from an older checkpoint, write its step \(3\) into .*ckpt/latest_checkpointed_iteration.txt$")):
        loop._resume_or_warm_up(ddp, optimizer, lr_scheduler, source, GenerationAhead(0, 10, None), source.task,
                                CharTokenizer(), resume,
                                logger=None)
