"""``lmetric``: LMetric's multiplicative score, (queued prefill + new prefill) x (batch + 1), lowest wins.

Source: "Simple is Better: Multiplication May Be All You Need for LLM Request Scheduling"
(arXiv 2603.15202, §5.1), as read by
``wall96/sglang-router-simple-is-better:sgl-model-gateway/src/policies/lmetric.rs``; upstream
SGLang's ``sgl-project/sglang:sgl-model-gateway/src/policies/lmetric.rs`` gives the tie order.
No tuning parameters. Per instance::

    P_token = pending_prefill_tokens + (prompt_tokens - cached_blocks * block_size)
    score   = P_token * (running + waiting + 1)

lowest score wins; ties by lower load, then fewer new tokens, then lower index (upstream
SGLang's ``(score, load, new_prefill_work, idx)``).

``pending_prefill_tokens`` is the instance's queued prefill backlog: the paper drains it at
prefill completion, which is what the view's ``pending_prefill_tokens`` reports (the wall96
reading keeps a router-side counter drained at request completion, lacking that signal). The
batch size is the instance's in-flight requests, the gateway's ``worker.load()``.

Prefix source: the router's approximate index by default (both gateway implementations use
SGLang's approximate text tree, updated with the chosen worker on every dispatch), sized here to
the instance's KV capacity (``kv_total_blocks``) and evicted LRU on insert rather than by
SGLang's periodic sweeps; ``prefix_source=precise`` reads the engines' KV events instead.
Tokens are counted in whole cached blocks, not characters. Without a prefix identity the new
tokens are the whole prompt: the load-only score. Never holds.
"""

from __future__ import annotations

from routerd.policies.base import ClusterView, PolicyContext, PolicyParams, RequestFeatures, RoutingPolicy
from routerd.prefix.index import PrefixIndex, PrefixSource, cached_blocks, pending_prefill_tokens


class Params(PolicyParams):
    """Parameters of ``lmetric``: none to tune; only where cached blocks are read from."""

    prefix_source: PrefixSource = "approximate"
    """Cached blocks from the router's own dispatches (as the gateway implementations) or the
    engines' KV events."""


class LMetric(RoutingPolicy):
    """LMetric: argmin of (queued + new prefill tokens) x (in-flight requests + 1)."""

    name = "lmetric"
    Params = Params
    params: Params

    def __init__(self, ctx: PolicyContext, params: PolicyParams | None = None) -> None:
        super().__init__(ctx, params)
        self.index = PrefixIndex(None)

    def scores(self, request: RequestFeatures, view: ClusterView) -> list[tuple[int, int, int, int]]:
        """``(score, load, new tokens, position)`` per instance, in view order (tokens x requests)."""
        prefix = request.prefix
        src = self.params.prefix_source
        self.index.advance(view.now)
        out = []
        for k, inst in enumerate(view.instances):
            cached = cached_blocks(inst, prefix, self.index, src) * inst.block_size
            new = max(0, request.prompt_tokens - cached)
            load = inst.num_running + inst.num_waiting
            out.append(((pending_prefill_tokens(inst) + new) * (load + 1), load, new, k))
        return out

    def pick(self, request: RequestFeatures, view: ClusterView) -> int | None:
        k = min(self.scores(request, view))[3]
        chosen = view.instances[k]
        if request.prefix is not None:
            if not self.index.has_instance(chosen.index):
                self.index.set_capacity(chosen.index, max(1, chosen.kv_total_blocks))
            self.index.insert(chosen.index, request.prefix, view.now)
        return chosen.index
