"""RL pieces downstream of the engine: packing, parity, advantages, losses, the loop."""
