"""Multi-turn rollouts: each sample a conversation between the engine and an environment
(envs.environment). A turn samples until one of the environment's stop strings, end-of-document
or the turn's token budget; the environment answers the turn's text, and its answer joins the
sample as tokens it wrote (context: no loss, no parity); the next turn continues the same tokens.
Tokens stay tokens: nothing sampled is decoded and encoded again.

Each turn of every open conversation is one engine generation over the conversation so far (the
engine prefills what it already computed in an earlier turn, or with prefix caching reuses the
blocks an earlier turn prefilled: batch invariance makes those rows equal to the decode rows they
repeat, so the logprobs of every sampled token are the ones the trainer recomputes). The
environment's calls of a turn run together on the pool (envs.environment), or are played back
from a recording (envs.recording: --rl-env-replay).
"""

import functools
import math
import time
from collections import Counter
from dataclasses import dataclass, field

from megatron_rl_bi.envs.recording import EnvironmentCalls
from megatron_rl_bi.envs.tool_format import TagTurns, build_tool_format
from megatron_rl_bi.inference import Generation, Generator, Sampling


@dataclass(frozen=True)
class TurnConfig:
    max_turns: int = 4
    """Sampled turns a conversation takes at most (--rl-max-turns)."""
    max_context_tokens: int | None = None
    """Tokens a conversation holds at most, prompt included (--rl-max-context-tokens; None: the
    engine's --inference-max-seq-length)."""
    observation_tokens: int = 512
    """An environment answer's tokens at most; the rest is cut (--rl-tool-output-tokens)."""
    env_timeout_s: float = 30.0
    """Seconds each environment call may take (--rl-env-timeout)."""
    env_workers: int | None = None
    """Environment calls at once (--rl-env-workers; None: envs.environment.default_workers())."""
    tool_format: str = "tags"
    """How tool calls and answers are written: the environment's tags, or the chat template's
    tool calling (--rl-tool-format; envs.tool_format)."""
    record: str | None = None
    """Write the environment's answers to this file (--rl-env-record; envs.recording)."""
    replay: str | None = None
    """Play the environment's answers back from this recording, calling none (--rl-env-replay)."""


@dataclass
class Conversation:
    """One sample: the prompt the environment opened with, then every token after it, each
    sampled (with the engine's logprob) or written by the environment."""

    environment: object
    """None when it failed to open, or when its answers are played back (--rl-env-replay)."""
    prompt_tokens: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    over: bool = False
    stopped_on_eod: bool = False
    problem: str | None = None
    scored_when_cut: bool = False
    """Its environment has `finish`, which scores it when the turn or context limit cuts it."""

    def add(self, tokens: list[int], logprobs: list[float] | None) -> None:
        """Sampled tokens with their logprobs, or (logprobs None) the environment's tokens."""
        self.tokens += tokens
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)
        self.sampled += [logprobs is not None] * len(tokens)

    def end(self, problem: str | None = None) -> None:
        """Over; a problem (the environment failed or timed out) scores the sample 0."""
        self.over = True
        if problem is not None:
            self.problem, self.reward = problem, 0.0

    def generation(self, max_new_tokens: int) -> Generation:
        return Generation(prompt_tokens=self.prompt_tokens, completion_tokens=self.tokens,
                          completion_logprobs=self.logprobs, completion_sampled=self.sampled,
                          stopped_on_eod=self.stopped_on_eod, max_new_tokens=max_new_tokens)


def tokens_through_stop(tokens: list[int], tokenizer, stop_strings: tuple[str, ...]) -> int:
    """How many of a turn's `tokens` it keeps: through the first token whose text completes a
    stop string, or all of them. A prefix that holds a stop string stays holding it as it grows,
    so the first such prefix is found by bisection (a few decodes, not one per token)."""
    def stops(k: int) -> bool:
        text = tokenizer.decode(tokens[:k])
        return any(stop in text for stop in stop_strings)

    if not stops(len(tokens)):
        return len(tokens)
    low, high = 1, len(tokens)  # stops(high); the answer is the least k with stops(k)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if stops(middle) else (middle + 1, high)
    return high


def run_conversations(generator: Generator, examples: list, environment: type, tokenizer,
                      sampling: Sampling, config: TurnConfig) -> tuple[list[Generation], list[tuple], Counter]:
    """One conversation per example (a group's samples repeat its example): their generations,
    their scores (reward, problem): the sum of the environment's rewards, or 0 and FAILED or
    TIMED_OUT when it failed), and the counts of what happened (turns and the most of one
    conversation, environment problems and seconds, conversations cut by the turn or context
    limit)."""
    turn_format = build_tool_format(config.tool_format, tokenizer, environment)
    # A sample whose environment fails to open keeps the example's prompt and samples nothing.
    conversations = [Conversation(None, turn_format.prompt(e.prompt)) for e in examples]
    context = min(config.max_context_tokens or generator.config.max_sequence_length,
                  generator.config.max_prompt_tokens)
    calls = EnvironmentCalls(sampling.seed, config.env_timeout_s, config.env_workers, config.record, config.replay)
    opened = calls("open", [e.prompt for e in examples],
                   [functools.partial(_open, environment, e, turn_format) for e in examples],
                   encode=lambda opened: opened[1:], decode=lambda opened: (None, *opened))
    for conversation, outcome in zip(conversations, opened):
        if outcome.problem:
            conversation.end(outcome.problem)
        else:
            conversation.environment, conversation.prompt_tokens, conversation.scored_when_cut = outcome.value
    counts = Counter()
    with generator.conversation():  # with prefix caching, a turn reuses what earlier turns prefilled
        for _ in range(config.max_turns):
            open_ = [c for c in conversations if not c.over and len(c.prompt_tokens) + len(c.tokens) < context]
            if not open_:
                break
            _turn(generator, open_, tokenizer, turn_format, sampling, config, context, calls, counts)
    _finish_cut(conversations, calls, counts)
    calls.close()
    counts.update(c.problem for c in conversations if c.problem)
    counts.update(turns=sum(c.turns for c in conversations),
                  truncated=sum(not c.over for c in conversations))
    counts["turns_max"] = max(c.turns for c in conversations)
    generations = [c.generation(context - len(c.prompt_tokens)) for c in conversations]
    return generations, [(c.reward, c.problem) for c in conversations], counts


def _turn(generator: Generator, conversations: list[Conversation], tokenizer, turn_format: TagTurns,
          sampling: Sampling, config: TurnConfig, context: int, calls: EnvironmentCalls,
          counts: Counter) -> None:
    """One sampled turn of each conversation, then the environment's answers (their wall time
    added to counts["env_seconds"])."""
    requests = [c.prompt_tokens + c.tokens for c in conversations]
    budgets = [min(sampling.max_new_tokens, context - len(r)) for r in requests]
    texts = []
    for conversation, generation in zip(conversations, generator.generate(requests, sampling, budgets)):
        kept = tokens_through_stop(generation.completion_tokens, tokenizer, turn_format.stop_strings)
        conversation.add(generation.completion_tokens[:kept], generation.completion_logprobs[:kept])
        conversation.turns += 1
        conversation.stopped_on_eod = generation.stopped_on_eod and kept == len(generation.completion_tokens)
        turn = generation.completion_tokens[:kept]
        texts.append(tokenizer.decode(turn[:-1] if conversation.stopped_on_eod else turn))
    started = time.monotonic()
    answers = calls("step", texts, [functools.partial(_step, c.environment, text, turn_format, config.observation_tokens)
                                    for c, text in zip(conversations, texts)], decode=tuple)
    counts["env_seconds"] += time.monotonic() - started
    for conversation, outcome in zip(conversations, answers):
        if outcome.problem:
            conversation.end(outcome.problem)
            continue
        observation, reward, done = outcome.value
        conversation.reward += reward
        if done or conversation.stopped_on_eod:
            conversation.end()
        else:
            conversation.add(observation, None)


def _finish_cut(conversations: list[Conversation], calls: EnvironmentCalls, counts: Counter) -> None:
    """The conversations the turn or context limit cut, scored by their environment's `finish`
    where it has one (a terminal's task tests); they stay counted as cut."""
    indices = [i for i, c in enumerate(conversations) if not c.over and c.scored_when_cut]
    if not indices:
        return
    cut = [conversations[i] for i in indices]
    started = time.monotonic()
    scores = calls("finish", indices, [functools.partial(_finish, c.environment) for c in cut])
    counts["env_seconds"] += time.monotonic() - started
    for conversation, outcome in zip(cut, scores):
        if outcome.problem:
            conversation.problem, conversation.reward = outcome.problem, 0.0
        else:
            conversation.reward += outcome.value


def _finish(environment) -> float:
    """The environment's finish, checked on the call's own thread as `_step`'s answer is."""
    reward = float(environment.finish())
    if not math.isfinite(reward):
        raise ValueError(f"finish returned {reward}: expected a finite reward")
    return reward


def _open(environment_class: type, example, turn_format: TagTurns) -> tuple[object, list[int], bool]:
    """A sample's environment, built, its first observation as the prompt's tokens (through the
    chat template), and whether it scores a cut conversation (has `finish`); on the call's own
    thread: a constructor that raises fails that sample."""
    environment = environment_class()
    observation = environment.reset(example)
    if not isinstance(observation, str):
        raise TypeError(f"reset returned {type(observation).__name__}, not the first observation's text")
    return environment, turn_format.prompt(observation), hasattr(environment, "finish")


def _step(environment, text: str, turn_format: TagTurns, max_tokens: int) -> tuple[list[int], float, bool]:
    """The environment's answer to a turn as tokens (at most `max_tokens` of its text), its
    reward and whether it is over; checked and encoded on the call's own thread, so a malformed
    answer, or one the tokenizer cannot encode, fails that sample only."""
    observation, reward, done = environment.step(turn_format.action(text))
    reward = float(reward)
    if not isinstance(observation, str) or not math.isfinite(reward):
        raise ValueError(f"step returned ({observation!r:.40}, {reward}, {done}): expected (text, finite reward, done)")
    return turn_format.observation(observation, max_tokens), reward, bool(done)
