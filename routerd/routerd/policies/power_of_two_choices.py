"""``power_of_two_choices``: sample two distinct instances, take the one with less outstanding work.

Source: Mitzenmacher's power of two choices as shipped by the SGLang gateway,
vllm-project/router and AIBrix (``power_of_two``/``power-of-two``); the load metric
is the paper's JSQ metric (:func:`~routerd.policies.join_shortest_queue.outstanding_tokens`).
"""

from __future__ import annotations

import random

from routerd.policies.base import ClusterView, PolicyContext, PolicyParams, RequestFeatures, RoutingPolicy
from routerd.policies.join_shortest_queue import outstanding_tokens


class Params(PolicyParams):
    """Power of two choices has no parameters (the seed comes from the context)."""


class PowerOfTwoChoices(RoutingPolicy):
    """Two distinct seeded samples, the less loaded wins (tie: the lower index); never holds."""

    name = "power_of_two_choices"
    Params = Params

    def __init__(self, ctx: PolicyContext, params: PolicyParams | None = None) -> None:
        super().__init__(ctx, params)
        self._rng = random.Random(ctx.seed)

    def pick(self, request: RequestFeatures, view: ClusterView) -> int | None:
        instances = view.instances
        m = len(instances)
        if m == 1:
            return instances[0].index
        a, b = self._rng.sample(range(m), 2)
        if a > b:
            a, b = b, a
        wa = outstanding_tokens(instances[a])
        wb = outstanding_tokens(instances[b])
        return instances[b].index if wb < wa else instances[a].index
