"""``join_shortest_queue``: the instance with the fewest prompt + decode tokens still to process.

Source: the paper's JSQ baseline (arXiv 2408.13510 A.2: "fewest prompt + decode
tokens still to process"; +0.46% vs round robin). The decode side uses the
predicted output length, since the router never knows the true one.

The outstanding work of an instance (tokens) is, summed over its residents::

    remaining prefill = prompt + generated   while the request still needs a prefill
                        (in_prefill or waiting; a preempted request recomputes its
                        generated tokens too), else 0
    remaining decode  = max(0, predicted_output_tokens - generated_tokens)

A chunked prefill in progress counts in full: the view does not say how much of it
is done. :func:`outstanding_tokens` is shared with ``power_of_two_choices`` and
``late_binding``.
"""

from __future__ import annotations

import random

from routerd.policies.base import (
    ClusterView,
    InstanceView,
    PolicyContext,
    PolicyParams,
    RequestFeatures,
    ResidentRequest,
    RoutingPolicy,
    pick_near_best,
)


def remaining_prefill_tokens(r: ResidentRequest) -> int:
    """Prompt tokens (plus recomputed generated tokens) not yet prefilled (tokens)."""
    if r.in_prefill or r.waiting:
        return r.prompt_tokens + r.generated_tokens
    return 0


def remaining_decode_tokens(r: ResidentRequest) -> float:
    """Predicted output tokens not yet generated (tokens, >= 0)."""
    rest = r.predicted_output_tokens - r.generated_tokens
    return rest if rest > 0.0 else 0.0


def outstanding_tokens(instance: InstanceView) -> float:
    """The JSQ metric: remaining prefill + predicted remaining decode tokens of all residents (tokens).

    Read from the view's own ``outstanding_tokens()`` when it keeps one (O(1) in routerd),
    else counted from ``residents()``.
    """
    fast = getattr(instance, "outstanding_tokens", None)
    if fast is not None:
        kept = fast()
        if kept is not None:
            return kept
    total = 0.0
    for r in instance.residents():
        if r.in_prefill or r.waiting:
            total += r.prompt_tokens + r.generated_tokens
        rest = r.predicted_output_tokens - r.generated_tokens
        if rest > 0.0:
            total += rest
    return total


class Params(PolicyParams):
    """JSQ has no parameters."""


class JoinShortestQueue(RoutingPolicy):
    """Least outstanding (predicted) work in tokens; ties to the first in view order (near-ties
    at random with ``ctx.near_tie``); never holds."""

    name = "join_shortest_queue"
    Params = Params

    def __init__(self, ctx: PolicyContext, params: Params | None = None) -> None:
        super().__init__(ctx, params)
        self._rng = random.Random(ctx.seed)

    def pick(self, request: RequestFeatures, view: ClusterView) -> int | None:
        scored = [(outstanding_tokens(inst), inst.index) for inst in view.instances]
        return pick_near_best(scored, self.ctx.near_tie, self._rng)
