"""``sglang_cache_aware``: SGLang model gateway's ``cache_aware`` policy.

Sources: ``sgl-project/sglang:sgl-model-gateway/src/policies/cache_aware.rs`` (the decision),
``.../policies/tree.rs`` (approximate radix tree, ``evict_tenant_by_size``), defaults in
``sgl-router/py_src/sglang_router/router_args.py`` (Python CLI) and ``CacheAwareConfig::default``
(Rust); restated in ``shared/docs/prefix-routing.md`` §2. Per request, with
``load = running + waiting`` (the gateway's in-flight count per worker)::

    imbalanced = max_load - min_load > balance_abs_threshold
                 and max_load > balance_rel_threshold * min_load
    imbalanced               -> least loaded (lowest index among equals)
    else match_rate = matched_tokens / prompt_tokens over the best-matching worker
         match_rate > cache_threshold -> that worker (seeded random among equal best matches)
         otherwise                    -> least loaded

and the prompt is always inserted into the chosen worker's tree. The tree is approximate
(dispatch history only) with SGLang's eviction: every ``eviction_interval_s`` each worker's
entries are trimmed, least recently used tails first, to ``max_tree_size`` characters.

Model differences: the tree is kept in 16-token blocks (:class:`~routerd.prefix.index.PrefixIndex`),
not characters, so a match is counted in whole blocks (``matched_blocks * block_size``) over the
prompt's tokens, and ``max_tree_size`` is converted at ``chars_per_token`` characters per token
(4, llm-d's own estimate for text). SGLang returns one arbitrary tenant of the deepest node; here
a seeded random choice among equal best matches.

Defaults: the **Python CLI** set (``defaults="python"``: cache_threshold 0.3, balance_abs 64,
balance_rel 1.5, eviction every 120 s, max_tree_size 2**26 chars), because that is what users
get from ``python -m sglang_router.launch_router`` and the SGLang docs; ``defaults="rust"``
selects ``CacheAwareConfig::default`` (0.5 / 32 / 1.1 / 30 s / 10,000 chars, i.e. about 156 blocks
per worker, a tree that forgets almost everything every 30 s). Any single field can be overridden.
Never holds.
"""

from __future__ import annotations

import random
from typing import Literal

from pydantic import Field

from routerd.policies.base import ClusterView, PolicyContext, PolicyParams, RequestFeatures, RoutingPolicy
from routerd.prefix.index import PrefixIndex

#: ``(cache_threshold, balance_abs_threshold, balance_rel_threshold, eviction_interval_s,
#: max_tree_size chars)`` of each SGLang default set.
SGLANG_DEFAULTS: dict[str, tuple[float, int, float, float, int]] = {
    "python": (0.3, 64, 1.5, 120.0, 2**26),
    "rust": (0.5, 32, 1.1, 30.0, 10_000),
}


class Params(PolicyParams):
    """Parameters of ``sglang_cache_aware`` (None: from the ``defaults`` set)."""

    defaults: Literal["python", "rust"] = "python"
    """Which SGLang default set fills the fields left None: the Python CLI's (router_args.py)
    or the Rust CacheAwareConfig::default."""
    cache_threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    """Match rate above which the best-matching worker wins (python 0.3, rust 0.5)."""
    balance_abs_threshold: int | None = Field(default=None, ge=0)
    """Imbalance needs max_load - min_load above this (requests; python 64, rust 32)."""
    balance_rel_threshold: float | None = Field(default=None, ge=0.0)
    """Imbalance also needs max_load above this times min_load (python 1.5, rust 1.1)."""
    eviction_interval_s: float | None = Field(default=None, gt=0.0)
    """Seconds between tree eviction sweeps (python 120, rust 30)."""
    max_tree_size: int | None = Field(default=None, ge=1)
    """Characters each worker's tree keeps after a sweep (python 2**26, rust 10,000)."""
    chars_per_token: float = Field(default=4.0, gt=0.0)
    """Characters per token to convert max_tree_size to blocks (4: English text estimate)."""


class SglangCacheAware(RoutingPolicy):
    """SGLang cache_aware: least loaded when imbalanced, else best prefix match above a threshold."""

    name = "sglang_cache_aware"
    Params = Params
    params: Params

    def __init__(self, ctx: PolicyContext, params: PolicyParams | None = None) -> None:
        super().__init__(ctx, params)
        p = self.params
        d = SGLANG_DEFAULTS[p.defaults]
        self.cache_threshold = d[0] if p.cache_threshold is None else p.cache_threshold
        self.balance_abs = d[1] if p.balance_abs_threshold is None else p.balance_abs_threshold
        self.balance_rel = d[2] if p.balance_rel_threshold is None else p.balance_rel_threshold
        interval = d[3] if p.eviction_interval_s is None else p.eviction_interval_s
        chars = d[4] if p.max_tree_size is None else p.max_tree_size
        self.capacity_blocks = max(1, int(chars / (p.chars_per_token * ctx.profile.block_size)))
        self.index = PrefixIndex(self.capacity_blocks, eviction_interval_s=interval)
        self._rng = random.Random(ctx.seed)

    def pick(self, request: RequestFeatures, view: ClusterView) -> int | None:
        instances = view.instances
        self.index.advance(view.now)
        loads = [inst.num_running + inst.num_waiting for inst in instances]
        lo, hi = min(loads), max(loads)
        least = loads.index(lo)
        k = least
        prefix = request.prefix
        if not (hi - lo > self.balance_abs and hi > self.balance_rel * lo) and prefix is not None:
            best: list[int] = []
            best_m = 0
            for j, inst in enumerate(instances):
                m = self.index.match(inst.index, prefix)
                if m > best_m:
                    best, best_m = [j], m
                elif m == best_m and m > 0:
                    best.append(j)
            if best and request.prompt_tokens > 0:
                rate = best_m * instances[best[0]].block_size / request.prompt_tokens
                if rate > self.cache_threshold:
                    k = best[self._rng.randrange(len(best))] if len(best) > 1 else best[0]
        chosen = instances[k].index
        self.index.insert(chosen, prefix, view.now)
        return chosen
