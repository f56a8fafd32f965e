"""RMSNorm for the non-TE specs whose kernel follows the BI switch.

Stands where megatron-core's local spec puts `WrappedTorchNorm` (a plain `torch.nn.RMSNorm`,
which megatron-core's BI mode does not patch). Same parameter name (`weight`), same builder
signature, so checkpoints and specs are interchangeable.
"""

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_rl_bi import bi


class RMSNorm(torch.nn.Module):
    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                 zero_centered_gamma: bool | None = None, **unused):
        """`zero_centered_gamma` (scale by 1 + weight) defaults to the config's
        (--apply-layernorm-1p); a spec may fix it for one norm."""
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(f"--normalization {config.normalization}: this norm is RMSNorm only")
        if zero_centered_gamma is None:
            zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.zero_centered_gamma = zero_centered_gamma
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.eps = eps
        # Megatron's optimizer reads this to group norm weights with sequence-parallel grads.
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bi.rms_norm(x, self.weight, self.eps, self.zero_centered_gamma)
