"""How far a result is from its reference, where bitwise equality is not the claim (gradients of
other kernels, an imported model's logits against transformers')."""

import torch


def relative_l2_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    """||got - reference|| / ||reference|| in fp32 (the RMS of the difference over the RMS of the
    reference)."""
    got, reference = got.float(), reference.float()
    return ((got - reference).norm() / reference.norm()).item()
