"""Group-relative advantages (GRPO, DAPO): each completion is scored against the other
completions of the same prompt.

Worked example, one group of 4 completions with rewards [1, 0, 0, 1]:
mean 0.5, population std 0.5 -> advantages [1, -1, -1, 1] (with std normalization)
or [0.5, -0.5, -0.5, 0.5] (without). A group whose rewards are all equal has advantage 0 for
every completion: it carries no learning signal (DAPO's dynamic sampling drops such groups).

Departure from the GRPO paper: the population std (not the sample std) is used, so a group of
two with rewards [1, 0] gets [1, -1].
"""

import torch

from megatron_rl_bi.rl.rewards import groups_with_signal


def group_advantages(
    rewards: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """rewards [num_groups, group_size] -> advantages [num_groups, group_size]."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got {tuple(rewards.shape)}")
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    # Equal rewards center to exactly 0: the float mean of equal values can be an ulp off them
    # (eight 0.7s), and that residue over a std of the same size is ~0.06, not 0.
    signal = groups_with_signal(rewards).unsqueeze(1)
    centered = torch.where(signal, centered, torch.zeros_like(centered))
    if not normalize_std:
        return centered
    std = rewards.std(dim=1, unbiased=False, keepdim=True)
    return torch.where(std > 0, centered / (std + eps), torch.zeros_like(centered))
