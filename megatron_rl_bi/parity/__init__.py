"""Engine-vs-trainer logprob parity: the `bit_wise/*` metrics and the harness that generates,
recomputes and compares (used by tools/check_parity.py, the benches, the GPU tests and the RL
step)."""

from megatron_rl_bi.parity.metrics import parity_metrics, parity_terms

__all__ = ["parity_metrics", "parity_terms"]
