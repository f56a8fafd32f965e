"""Checkpoints: Megatron distributed checkpoints of the run (model, optimizer, RL state) and
pretrained weights in."""
