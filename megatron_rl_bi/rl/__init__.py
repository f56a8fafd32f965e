"""RL pieces downstream of the engine: rollouts, rewards, advantages, losses, the step, evaluation,
the SFT warm-up and the loop (packing is megatron_rl_bi.packing, parity megatron_rl_bi.parity)."""
