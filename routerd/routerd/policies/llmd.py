"""``llmd``: llm-d's default scheduling profile, queue + KV utilisation + prefix cache, max score wins.

Sources (``llm-d/llm-d-router``; ``shared/docs/prefix-routing.md`` §2):

* profile and weights: ``pkg/epp/config/loader/defaults.go`` (queue-scorer 2,
  kv-cache-utilization-scorer 2, prefix-cache-scorer 3, max-score picker);
* ``pkg/epp/framework/plugins/scheduling/scorer/queuedepth/queue.go``,
  ``.../scorer/kvcacheutilization/kvcache_utilization.go``,
  ``.../scorer/prefix/plugin.go`` (with ``prefixLengthWeight`` at its default 0);
* the index: ``pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/``
  (``types.go`` defaults, ``indexer.go`` per-pod LRU, updated in ``PreRequest`` with the chosen
  endpoint, no engine feedback).

Per instance, over all instances as candidates::

    queue  = (max_q - q) / (max_q - min_q)      q = waiting requests; 1 when all equal
    kv     = 1 - kv_usage
    prefix = matched_blocks / total_blocks       total = min(request blocks, cap); 0 if total = 0
    score  = 2 * queue + 2 * kv + 3 * prefix

then the highest score, ties broken uniformly at random (seeded by ``ctx.seed``).
``matched_blocks`` is the longest run of the request's leading blocks believed cached there:
from the router's approximate index (default, :class:`~routerd.prefix.index.PrefixIndex`) or,
with ``prefix_source=precise``, from the engine's KV events (the ``precise-prefix-cache-scorer``
setup; the approximate index answers where a view has no KV events). Without a prefix identity
every prefix score is 0 and this is llm-d's load-only part (``queue_kv_scorer`` with random ties).

Index defaults as ``types.go`` defines them: ``autoTune`` on, so each instance's LRU holds as
many blocks as the instance has GPU KV blocks (``kv_total_blocks``; 31,250 when unknown);
``maxPrefixTokensToMatch`` 131,072 tokens (8,192 blocks of 16). The older GIE defaults (256
blocks, a fixed 31,250-entry LRU) are ``max_prefix_tokens=4096,lru_capacity_blocks=31250``.
Never holds (flow control and the saturation detector are not modelled).
"""

from __future__ import annotations

import random

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
from routerd.prefix.index import PrefixIndex, PrefixSource, cached_blocks

#: llm-d's ``defaultLRUCapacityPerServer`` (entries = blocks), used when a pod reports no blocks.
LLMD_DEFAULT_LRU_CAPACITY = 31_250


class Params(PolicyParams):
    """Parameters of ``llmd`` (defaults: llm-d-router's default profile and producer config)."""

    queue_weight: float = Field(default=2.0, ge=0.0)
    """Weight of queue-scorer (llm-d default 2)."""
    kv_weight: float = Field(default=2.0, ge=0.0)
    """Weight of kv-cache-utilization-scorer (llm-d default 2)."""
    prefix_weight: float = Field(default=3.0, ge=0.0)
    """Weight of prefix-cache-scorer (llm-d default 3)."""
    prefix_source: PrefixSource = "approximate"
    """Where matched blocks come from: the router's own dispatch history (llm-d default,
    approx-prefix-cache-producer) or the engines' KV events (precise-prefix-cache-producer)."""
    max_prefix_tokens: int | None = Field(default=131_072, ge=1)
    """Only the first this many prompt tokens (as whole blocks) are indexed and scored
    (maxPrefixTokensToMatch, default 131,072); None: the whole prompt."""
    lru_capacity_blocks: int | None = Field(default=None, ge=1)
    """Approximate index capacity per instance (blocks). None: autoTune, the instance's
    kv_total_blocks (llm-d default); a number: lruCapacityPerServer with autoTune off."""


class LlmD(RoutingPolicy):
    """llm-d default profile: 2 x queue + 2 x KV-free + 3 x prefix match; max score, random ties."""

    name = "llmd"
    Params = Params
    params: Params

    def __init__(self, ctx: PolicyContext, params: PolicyParams | None = None) -> None:
        super().__init__(ctx, params)
        self._rng = random.Random(ctx.seed)
        p = self.params
        self._cap_blocks = None if p.max_prefix_tokens is None else max(1, p.max_prefix_tokens // ctx.profile.block_size)
        self.index = PrefixIndex(None, max_blocks_per_request=self._cap_blocks)

    def pick(self, request: RequestFeatures, view: ClusterView) -> int | None:
        p = self.params
        instances = view.instances
        prefix = request.prefix
        self.index.advance(view.now)
        total = 0
        if prefix is not None:
            total = prefix.num_blocks if self._cap_blocks is None else min(prefix.num_blocks, self._cap_blocks)
        best: list[int] = []
        best_score = 0.0
        for k, (inst, q) in enumerate(zip(instances, queue_scores(instances))):
            score = p.queue_weight * q + p.kv_weight * (1.0 - inst.kv_usage)
            if total:
                m = min(cached_blocks(inst, prefix, self.index, p.prefix_source), total)
                score += p.prefix_weight * (m / total)
            if not best or score > best_score:
                best, best_score = [k], score
            elif score == best_score:
                best.append(k)
        k = pick_tie(best, self._rng)
        chosen = instances[k]
        if prefix is not None:
            if not self.index.has_instance(chosen.index):
                cap = p.lru_capacity_blocks
                if cap is None:
                    cap = chosen.kv_total_blocks if chosen.kv_total_blocks > 0 else LLMD_DEFAULT_LRU_CAPACITY
                self.index.set_capacity(chosen.index, cap)
            self.index.insert(chosen.index, prefix, view.now)
        return chosen.index
