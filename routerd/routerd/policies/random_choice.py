"""``random``: a uniformly random instance from a generator seeded by ``ctx.seed``.

Source: the ``random`` policy of the SGLang gateway, AIBrix and Dynamo; a floor for
any load-aware policy.
"""

from __future__ import annotations

import random

from routerd.policies.base import ClusterView, PolicyContext, PolicyParams, RequestFeatures, RoutingPolicy


class Params(PolicyParams):
    """Random choice has no parameters (the seed comes from the context)."""


class RandomChoice(RoutingPolicy):
    """Uniform over the instances; never holds. Same seed and call sequence, same picks."""

    name = "random"
    Params = Params

    def __init__(self, ctx: PolicyContext, params: PolicyParams | None = None) -> None:
        super().__init__(ctx, params)
        self._rng = random.Random(ctx.seed)

    def pick(self, request: RequestFeatures, view: ClusterView) -> int | None:
        instances = view.instances
        return instances[self._rng.randrange(len(instances))].index
