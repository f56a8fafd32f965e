"""megatron_rl_bi: GRPO/DAPO on megatron-core where the trainer's logprobs equal the engine's bit for bit."""

__version__ = "0.1.0"
