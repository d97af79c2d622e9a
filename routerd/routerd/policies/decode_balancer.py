"""``decode_balancer`` (ORACLE): balance the remaining true decode tokens per instance.

Source: the paper's Decode Balancer (arXiv 2408.13510 §4.4, Table 2): "knows the
total output tokens and balances the sum of decode tokens per instance". It reads
true output lengths, so it is an oracle: the simulator hands it
:class:`~routerd.policies.base.OracleResident` objects. The load of an instance is
``sum over residents of max(0, output_tokens - generated_tokens)`` (tokens); the new
request goes to the least loaded (lowest index on ties). Never holds.
"""

from __future__ import annotations

from routerd.policies.base import ClusterView, PolicyParams, RequestFeatures, RoutingPolicy


class Params(PolicyParams):
    """The decode balancer has no parameters."""


class DecodeBalancer(RoutingPolicy):
    """Least remaining true decode tokens; oracle."""

    name = "decode_balancer"
    Params = Params
    oracle = True

    def pick(self, request: RequestFeatures, view: ClusterView) -> int | None:
        best = None
        best_load = 0
        for inst in view.instances:
            load = 0
            for r in inst.residents():
                try:
                    rest = r.output_tokens - r.generated_tokens  # type: ignore[attr-defined]
                except AttributeError:
                    raise TypeError("decode_balancer is an oracle policy: it needs OracleResident residents") from None
                if rest > 0:
                    load += rest
            if best is None or load < best_load:
                best, best_load = inst.index, load
        return best
