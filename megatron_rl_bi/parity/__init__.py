"""Engine-vs-trainer parity: the `bit_wise/*` (and MoE `routing/*`) metrics and the harness that generates,
recomputes and compares (used by tools/check_parity.py, the benches, the GPU tests and the RL
step)."""

from megatron_rl_bi.parity.metrics import RoutingCompared, parity_metrics, parity_terms, routing_terms

__all__ = ["RoutingCompared", "parity_metrics", "parity_terms", "routing_terms"]
