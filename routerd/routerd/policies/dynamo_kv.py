"""``dynamo_kv``: NVIDIA Dynamo's KV router cost, lowest cost wins.

Sources (``ai-dynamo/dynamo``): ``lib/kv-router/src/scheduling/selector/default.rs``
(``worker_logit``, ``minimum_cost_index``, ``softmax_sample_index``),
``lib/kv-router/src/scheduling/config.rs`` (``KvRouterConfig::default``), and the active-sequence
accounting in ``lib/kv-router/src/sequences`` (``potential_blocks_and_tokens``); restated in
``shared/docs/prefix-routing.md`` §2. Per instance, in KV blocks of ``block_size`` tokens::

    raw_prefill  = (pending_prefill_tokens + prompt_tokens) / block_size
    prefill_cost = prefill_load_scale * max(0, raw_prefill - overlap_score_credit * overlap)
    decode_cost  = kv_used_blocks + (request_blocks - overlap)
    cost         = prefill_cost + decode_cost + decode_active_request_weight * (running + waiting)

``overlap`` is the request's leading blocks cached on the instance (device tier; no host or disk
tiers here), ``request_blocks`` its full blocks. With the default credit 1 the prefill term is
the instance's queued prefill plus this request's uncached prompt, in blocks, as Dynamo's
``active_prefill_tokens + uncached_tokens``. Lowest cost wins, ties uniformly at random (seeded
by ``ctx.seed``); ``router_temperature > 0`` instead samples ``softmax(-(cost - min) / ((max -
min) * T))`` (uniform when all costs are equal), as ``softmax_sample_index`` does.

Where the terms come from: Dynamo runs on KV events, so ``prefix_source`` defaults to
``precise`` (the view's ``engine_cached_blocks``); ``approximate`` is Dynamo's
``use_kv_events=false`` mode: the router's own dispatches, forgotten ``router_ttl_secs`` (120 s)
after the last one. ``pending_prefill_tokens`` is the view's count of prompt tokens still to
prefill (Dynamo tracks it router-side until the first token). ``decode_cost`` uses the engine's
blocks in use (``kv_used_blocks``): Dynamo counts the unique blocks of its active requests'
prompts (``router_track_output_blocks`` false by default), so ours also counts output blocks
already generated and leaves out waiting requests' blocks; both exclude cached free blocks. The
new blocks a request adds are its blocks past ``overlap`` (Dynamo: past its overlap with active
sequences). Without a prefix identity ``overlap`` is 0 and ``request_blocks`` is
``prompt_tokens // block_size``: the load-only cost. Never holds (Dynamo's router queue,
``router_queue_threshold``, is not modelled).
"""

from __future__ import annotations

import math
import random

from pydantic import Field

from routerd.policies.base import (
    ClusterView,
    PolicyContext,
    PolicyParams,
    RequestFeatures,
    RoutingPolicy,
    pick_tie,
)
from routerd.prefix.index import PrefixIndex, PrefixSource, cached_blocks, pending_prefill_tokens

#: Dynamo's ``router_ttl_secs`` default (s): lifetime of an approximate (no KV events) entry.
DYNAMO_ROUTER_TTL_S = 120.0


class Params(PolicyParams):
    """Parameters of ``dynamo_kv`` (defaults: Dynamo's ``KvRouterConfig::default``)."""

    overlap_score_credit: float = Field(default=1.0, ge=0.0, le=1.0)
    """Prefill blocks credited per cached (device) block (default 1.0, range 0..1)."""
    prefill_load_scale: float = Field(default=1.0, ge=0.0)
    """Scale of the credited prefill blocks in the cost (default 1.0)."""
    decode_active_request_weight: float = Field(default=0.0, ge=0.0)
    """Block-equivalent cost per request already on the instance (default 0)."""
    router_temperature: float = Field(default=0.0, ge=0.0)
    """0: argmin with random ties; > 0: sample a softmax of the normalised costs (default 0)."""
    prefix_source: PrefixSource = "precise"
    """Cached blocks from the engines' KV events (Dynamo default) or the router's own dispatches."""
    router_ttl_s: float = Field(default=DYNAMO_ROUTER_TTL_S, gt=0.0)
    """Approximate entries expire this long after their last dispatch (s; Dynamo 120)."""


class DynamoKv(RoutingPolicy):
    """Dynamo KV router: argmin of credited prefill blocks + active decode blocks."""

    name = "dynamo_kv"
    Params = Params
    params: Params

    def __init__(self, ctx: PolicyContext, params: PolicyParams | None = None) -> None:
        super().__init__(ctx, params)
        self._rng = random.Random(ctx.seed)
        self.index = PrefixIndex(None, ttl_s=self.params.router_ttl_s)

    def costs(self, request: RequestFeatures, view: ClusterView) -> list[float]:
        """Each instance's cost (blocks), in view order."""
        p = self.params
        prefix = request.prefix
        self.index.advance(view.now)
        out = []
        for inst in view.instances:
            bs = inst.block_size
            blocks = prefix.num_blocks if prefix is not None else request.prompt_tokens // bs
            overlap = cached_blocks(inst, prefix, self.index, p.prefix_source)
            raw_prefill = (pending_prefill_tokens(inst) + request.prompt_tokens) / bs
            prefill = p.prefill_load_scale * max(0.0, raw_prefill - p.overlap_score_credit * overlap)
            decode = inst.kv_used_blocks + (blocks - overlap)
            out.append(prefill + decode + p.decode_active_request_weight * (inst.num_running + inst.num_waiting))
        return out

    def pick(self, request: RequestFeatures, view: ClusterView) -> int | None:
        costs = self.costs(request, view)
        t = self.params.router_temperature
        if t > 0.0:
            k = self._softmax_sample(costs, t)
        else:
            lo = min(costs)
            k = pick_tie([j for j, c in enumerate(costs) if c == lo], self._rng)
        chosen = view.instances[k].index
        self.index.insert(chosen, request.prefix, view.now)
        return chosen

    def _softmax_sample(self, costs: list[float], temperature: float) -> int:
        lo, hi = min(costs), max(costs)
        u = self._rng.random()
        if lo == hi:
            return min(int(u * len(costs)), len(costs) - 1)
        scale = 1.0 / ((hi - lo) * temperature)
        w = [math.exp(-(c - lo) * scale) for c in costs]
        total = sum(w)
        acc = 0.0
        for j, x in enumerate(w):
            acc += x / total
            if u <= acc:
                return j
        return len(costs) - 1
