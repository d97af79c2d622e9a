"""``least_outstanding_tokens``: least in-flight token load as a router's own counters see it.

Imitates llm-d's ``token-load-scorer`` fed by the ``inflight-load-producer``: the
router adds a request's prompt tokens (and, with ``addEstimatedOutputTokens``, its
estimated output tokens) to an instance's counter when it dispatches the request
and subtracts them when the response completes. The load of an instance (tokens)
is therefore, summed over its residents::

    prompt_tokens + predicted_output_tokens        (count_predicted_output=True)
    prompt_tokens                                  (count_predicted_output=False)

How it differs from ``join_shortest_queue``: no progress discount. JSQ counts only
what is *left* (a prefilled prompt and the tokens already generated drop out);
here a request weighs its full size until it finishes, so an instance full of
nearly-done long requests looks busier than under JSQ.
"""

from __future__ import annotations

import random

from routerd.policies.base import (
    ClusterView,
    PolicyContext,
    PolicyParams,
    RequestFeatures,
    RoutingPolicy,
    pick_near_best,
)


class Params(PolicyParams):
    """Parameters of ``least_outstanding_tokens``."""

    count_predicted_output: bool = True
    """Add each resident's predicted output tokens to its prompt tokens (llm-d's
    ``addEstimatedOutputTokens``); False counts prompt tokens only."""


class LeastOutstandingTokens(RoutingPolicy):
    """Least router-side in-flight tokens; ties to the first in view order (near-ties at random
    with ``ctx.near_tie``); never holds."""

    name = "least_outstanding_tokens"
    Params = Params
    params: Params

    def __init__(self, ctx: PolicyContext, params: PolicyParams | None = None) -> None:
        super().__init__(ctx, params)
        self._rng = random.Random(ctx.seed)

    def pick(self, request: RequestFeatures, view: ClusterView) -> int | None:
        with_output = self.params.count_predicted_output
        scored: list[tuple[float, int]] = []
        for inst in view.instances:
            load = 0.0
            for r in inst.residents():
                load += r.prompt_tokens
                if with_output:
                    load += r.predicted_output_tokens
            scored.append((load, inst.index))
        return pick_near_best(scored, self.ctx.near_tie, self._rng)
