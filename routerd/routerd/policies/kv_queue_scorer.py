"""``queue_kv_scorer``: llm-d's default load scorers, weighted and summed, max score wins.

Imitates the llm-d endpoint picker's default scheduling profile without its
prefix-cache scorer (the simulator has no prefix cache): ``queue-scorer`` and
``kv-cache-utilization-scorer``, both weight 2 in ``pkg/epp/config/loader/defaults.go``
(shared/docs/anchors.md §2.1), then the ``max-score`` picker. Per instance::

    queue_score = (max_waiting - waiting) / (max_waiting - min_waiting)   (1.0 when all equal)
    kv_score    = 1 - kv_usage
    score       = queue_weight * queue_score + kv_weight * kv_score

Ties: llm-d picks at random among equal scores; here ``tie_break="lowest_index"``
(default, deterministic without a generator) or ``"random"`` (seeded by ``ctx.seed``).
Never holds (llm-d's flow control and saturation detector are not modelled).
"""

from __future__ import annotations

import random
from typing import Literal

from pydantic import Field

from routerd.policies.base import (
    ClusterView,
    PolicyContext,
    PolicyParams,
    RequestFeatures,
    RoutingPolicy,
    pick_tie,
    queue_scores,
)


class Params(PolicyParams):
    """Parameters of ``queue_kv_scorer``."""

    queue_weight: float = Field(default=2.0, ge=0.0)
    """Weight of the queue-depth score (llm-d default 2)."""
    kv_weight: float = Field(default=2.0, ge=0.0)
    """Weight of the KV-cache free-fraction score (llm-d default 2)."""
    tie_break: Literal["lowest_index", "random"] = "lowest_index"
    """How equal top scores are resolved: lowest index, or uniformly at random (llm-d)."""


class QueueKvScorer(RoutingPolicy):
    """Argmax of weighted queue-depth and KV-free scores; never holds."""

    name = "queue_kv_scorer"
    Params = Params
    params: Params

    def __init__(self, ctx: PolicyContext, params: PolicyParams | None = None) -> None:
        super().__init__(ctx, params)
        self._rng = random.Random(ctx.seed)

    def pick(self, request: RequestFeatures, view: ClusterView) -> int | None:
        instances = view.instances
        wq = self.params.queue_weight
        wkv = self.params.kv_weight
        best: list[int] = []
        best_score = 0.0
        for inst, q in zip(instances, queue_scores(instances)):
            score = wq * q + wkv * (1.0 - inst.kv_usage)
            if not best or score > best_score:
                best, best_score = [inst.index], score
            elif score == best_score:
                best.append(inst.index)
        if self.params.tie_break == "random":
            return pick_tie(best, self._rng)
        return best[0]
