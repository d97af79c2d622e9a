"""``round_robin``: instances 0, 1, ..., m-1, 0, ... regardless of state.

Source: the paper's reference baseline (arXiv 2408.13510 §4, A.1.4; every % in the
paper is against it) and the default of production-stack and the SGLang gateway.
"""

from __future__ import annotations

from routerd.policies.base import ClusterView, PolicyContext, PolicyParams, RequestFeatures, RoutingPolicy


class Params(PolicyParams):
    """Round robin has no parameters."""


class RoundRobin(RoutingPolicy):
    """Cycle through the instances in view order; never holds."""

    name = "round_robin"
    order_sensitive = True
    Params = Params

    def __init__(self, ctx: PolicyContext, params: PolicyParams | None = None) -> None:
        super().__init__(ctx, params)
        self._next = 0

    def pick(self, request: RequestFeatures, view: ClusterView) -> int | None:
        instances = view.instances
        pos = self._next % len(instances)
        self._next = pos + 1
        return instances[pos].index
