"""Configuration in one place: Megatron's parser with this package's defaults and parity checks
(`megatron_args`), this package's RL flags, `--rl-loss` presets and YAML recipes (`rl_args`), and
the mapping of parsed flags to each component's config dataclass (`from_args`).

`from_args` imports the components whose configs it builds; import it from entry points only.
"""

from megatron_rl_bi.config.hf_args import add_hf_args
from megatron_rl_bi.config.megatron_args import (
    build_parser,
    installed_kernel_problem,
    parse_args,
    print_arguments,
    raise_if_invalid,
    validate_batch_invariance,
    validate_installed_kernels,
)
from megatron_rl_bi.config.rl_args import add_rl_args, parse_rl_args

__all__ = ["add_hf_args", "add_rl_args", "build_parser", "installed_kernel_problem", "parse_args",
           "parse_rl_args", "print_arguments", "raise_if_invalid", "validate_batch_invariance",
           "validate_installed_kernels"]
