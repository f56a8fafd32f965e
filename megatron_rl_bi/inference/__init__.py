"""The generator: megatron-core's DynamicInferenceEngine over the trainer's own model object."""

from megatron_rl_bi.inference.engine import EngineConfig, Generation, Generator, Sampling

__all__ = ["EngineConfig", "Generation", "Generator", "Sampling"]
