"""megatron_rl_bi: GRPO/DAPO on megatron-core where the trainer's logprobs equal the engine's bit for bit."""

__version__ = "0.1.0"

import os
import warnings

# megatron-core (and fla, on a machine without a GPU) warn at import about each optional package
# they do without: a dozen lines before a run's own output, and before its error. None is about a
# choice of this package's (--transformer-impl transformer_engine without TE is refused itself).
for _message in (r"Transformer Engine and Apex are not installed", r"Apex is not installed",
                 r"absl\.logging is not installed", r"Only transformer-engine>=1\.7\.0 supports MoE experts"):
    warnings.filterwarnings("ignore", message=_message, category=UserWarning, module=r"megatron\.")
warnings.filterwarnings("ignore", message=r"Triton is not supported on current platform", category=UserWarning,
                        module=r"fla\.")

# FlashAttention-4 compiles its kernels (CuTe DSL) at a process's first call of each shape and
# keeps them on disk only when asked: asked here (under TMPDIR, keyed by its sources and
# versions), so a second process on a machine starts warm. Set the variable to 0 to keep it off.
os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")

# Triton's autotuners time their candidates at each new key and keep the pick on disk only when
# asked (Triton's own TRITON_CACHE_AUTOTUNING, read as each autotuner is made: before megatron-core's
# and fla's kernel modules are imported): asked here, so a later default-mode process on the machine
# tunes nothing again (fla asks for its own kernels already). BI mode times nothing and reads no
# pick (bi/autotune.py). Set the variable to 0 to keep it off.
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
