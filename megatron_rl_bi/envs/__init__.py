"""Prompt sources and exact verifiers: where RL prompts come from and how answers are scored."""

from megatron_rl_bi.envs.tasks import Example, PromptSource, build_task

__all__ = ["Example", "PromptSource", "build_task"]
