"""megatron-core's GatedDeltaNet with its rule chosen by the BI switch at call time.

BI on: `gdn_rule.recurrent_gated_delta_rule` (fla's recurrent kernel forward, the kernel the
engine runs for prefill and decode; chunked backward). BI off: megatron-core's own choice (fla's
chunked kernel). Everything else (projections, conv, gates, gated norm) is megatron-core's layer;
its norm and linears come from the spec.
"""

from megatron.core.ssm.gated_delta_net import GatedDeltaNet

from megatron_rl_bi import bi, compat
from megatron_rl_bi.models.gdn_rule import recurrent_gated_delta_rule


class SwitchedGatedDeltaNet(GatedDeltaNet):
    def _setup_variant_attrs(self):
        super()._setup_variant_attrs()
        self._stock_rule = self.gated_delta_rule
        self._chunk_backend = "fla" if compat.fla_chunk_backward_works() else "torch"
        self.gated_delta_rule = self._rule

    def _rule(self, q, k, v, g, beta, **kwargs):
        if bi.enabled():
            return recurrent_gated_delta_rule(
                q, k, v, g, beta, chunk_backend=self._chunk_backend, **kwargs
            )
        return self._stock_rule(q, k, v, g=g, beta=beta, **kwargs)
