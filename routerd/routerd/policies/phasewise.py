"""``phasewise``: cache affinity priced in seconds, with the costs none of the anchors counts.

For each instance the policy estimates, in seconds, what sending the request there costs:
its own latency (queueing behind the prefill work already there, its uncached prefill,
its decode at that instance's batch) plus the delay its uncached prefill adds to the requests
decoding there (every step that carries one of its chunks is slower for each of them); it
sends the request to the cheapest instance that has KV headroom for it and holds it at the
router while none has (late binding, where cached free blocks count as free: vLLM evicts
them on demand). Every term comes from the instance's latency model (the hardware profile,
``routerd/profiles.py``), so a cache hit is worth exactly the prefill it saves on *that*
instance, and a hit is traded against load in the same unit.

Terms, for instance ``i`` with ``B`` decoding requests whose contexts sum to ``S`` tokens,
``P`` prompt tokens still to prefill, and ``h`` blocks of this request's prompt cached:

* step time with the batch: ``t_dec = overhead + decode_per_seq * B + decode_per_ctx * S``;
* prefill seconds per token, the decodes riding along (chunked prefill shares each step of
  ``max_num_batched_tokens`` tokens with the decode batch):
  ``k = prefill_per_token + t_dec / max_num_batched_tokens``;
* uncached tokens ``u = prompt - block_size * h`` (at least 1: the last token is computed);
* ``ttft = k * (P + u) + prefill_attn * (A + u * (block_size * h + u))`` (prefill attention is
  quadratic in what a chunk attends: the cached prefix plus itself; ``A`` is the same sum over
  the prefill work queued there, ``sum u_j * (c_j + u_j)``, so a long prompt ahead weighs what
  it costs, not just its length);
* ``decode = predicted_output * (t_dec + decode_per_seq + decode_per_ctx * (prompt + predicted_output / 2))``;
* ``interference = B * (prefill_per_token * u + prefill_attn * u * (block_size * h + u))``:
  the delay its prefill adds to each request decoding there (the "cost of prefill that a
  cache miss adds to the requests already decoding", the paper's prefill/decode mixing
  concern, arXiv 2408.13510 §4, priced by the latency model instead of the paper's
  gradients);
* ``cost = ttft + decode_weight * decode + interference_weight * interference``, plus, on an
  instance without KV headroom, ``preemption_weight * k * block_size * deficit`` (the KV
  deficit in blocks: what vLLM would preempt and recompute to make room).

Admission (as ``late_binding``, ``routerd/policies/kv_headroom.py``): instance ``i`` fits when
``blocks(prompt + predicted_output) - h <= (1 - reserve_fraction) * total - used - waiting``,
with ``used`` the blocks in use (cached free blocks are not used), and
``num_running + num_waiting < max_num_seqs``. With no instance fitting it holds
(``hold=True``) or takes the cheapest anyway.

Prefix source: ``precise`` reads what the engines' KV events report (the simulator's view
offers it; routerd through the KV-event index), ``approximate`` its own dispatch history
(:class:`routerd.prefix.index.PrefixIndex`, llm-d's approximate producer). Ties go to the
lowest cost, then a seeded random choice.

Parameters were chosen on the training windows of ``benchmarks/prefix_table.py`` only (seed 0
of each workload, never the evaluation seeds); see ``docs/prefix.md``.
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
    pick_cheapest,
)
from routerd.policies.kv_headroom import blocks_for, predicted_footprint_tokens, waiting_kv_blocks
from routerd.prefix.index import PrefixIndex, PrefixSource, cached_blocks, pending_prefill_work


class Params(PolicyParams):
    """Parameters of ``phasewise``."""

    prefix_source: PrefixSource = "precise"
    """Where cache hits come from: ``precise`` (the engines' KV events) or ``approximate``
    (the router's own dispatch history)."""
    interference_weight: float = Field(default=0.1, ge=0.0)
    """Weight of the delay the request's prefill adds to the requests decoding there
    (seconds of theirs per second of its own latency). 0.1 from the training windows (seed 0
    of ``benchmarks/prefix_table.py``, 4 x ``llama3.1-8b-h100``): 1.0 cut Mooncake's mean E2E
    most at 1.5x but doubled its p90 TTFT at 0.8x; 0 gave up the gain at 1.5x and the hit rate
    on shared prefixes; 0.1 had the highest capacity at SLO of 0, 0.1 and 0.25 on both prefix
    workloads. See docs/prefix.md."""
    decode_weight: float = Field(default=0.0, ge=0.0)
    """Weight of the request's own predicted decode time at the instance's batch. 0 by
    default: on the training windows 0.3 lowered the hit rate (0.74 -> 0.58 on
    shared-prefix:llmd-capacity at 0.8x) and raised p90 TTFT, the load term already
    counting the decode batch through ``t_dec``."""
    reserve_fraction: float = Field(default=0.05, ge=0.0, lt=1.0)
    """Fraction of each instance's KV blocks kept as a margin for outputs longer than predicted."""
    hold: bool = False
    """Hold the request at the router while no instance has KV headroom for it (late binding);
    False sends it to the cheapest instance anyway. Instances with headroom are always
    preferred. Off by default: on the training window (shared-prefix:llmd-capacity, 4 x
    H100-class, 1.5x) holding cut mean E2E 5% but tripled mean TTFT (11.7 s -> 37.3 s)."""
    preemption_weight: float = Field(default=4.0, ge=0.0)
    """Weight of the recompute an instance without KV headroom would pay: its KV deficit in
    tokens times the prefill seconds per token there (it only ranks instances when none fits).
    4 from the bundled Azure sample on 4 x ``llama2-7b-v100`` (mean E2E against round robin:
    +3.5% with 0, +1.0% with 1, -2.7% with 4); no effect on the prefix training windows."""
    index_capacity_blocks: int = Field(default=31_250, gt=0)
    """Approximate index: blocks remembered per instance (llm-d's LRU default)."""


class Phasewise(RoutingPolicy):
    """Least estimated latency cost in seconds, cache hits included, with KV-headroom holding."""

    name = "phasewise"
    Params = Params
    params: Params

    def __init__(self, ctx: PolicyContext, params: PolicyParams | None = None) -> None:
        super().__init__(ctx, params)
        self._rng = random.Random(ctx.seed)
        self._index = PrefixIndex(self.params.index_capacity_blocks)

    def pick(self, request: RequestFeatures, view: ClusterView) -> int | None:
        p = self.params
        prof = self.ctx.profile
        bs = prof.block_size
        a, k_pf, k_attn = prof.overhead_s, prof.prefill_per_token_s, prof.prefill_attn_s
        k_seq, k_ctx = prof.decode_per_seq_s, prof.decode_per_ctx_token_s
        budget = prof.max_num_batched_tokens
        max_seqs = prof.max_num_seqs
        prompt = request.prompt_tokens
        out = request.predicted_output_tokens
        prefix = request.prefix
        need_full = blocks_for(predicted_footprint_tokens(prompt, out, prof.max_model_len), bs)
        own_step = k_seq + k_ctx * (prompt + 0.5 * out)
        fit: list[tuple[float, int]] = []
        unfit: list[tuple[float, int]] = []
        w_dec, w_int, w_pre = p.decode_weight, p.interference_weight, p.preemption_weight
        keep = 1.0 - p.reserve_fraction
        index, source = self._index, p.prefix_source
        # pending_prefill_work and waiting_kv_blocks inlined (their views' fast paths): this loop
        # is most of a decision's cost (benchmarks/prefix_decision_cost.py); a pick at 8 instances
        # costs 0.90x the helpers' version (alternated in one process, session 28).
        for inst in view.instances:
            h = cached_blocks(inst, prefix, index, source) if prefix is not None else 0
            cached = bs * h
            u = prompt - cached
            if u < 1:
                u = 1
                cached = prompt - 1
            s = inst.load_summary()
            bins = s.decode_bins
            B = bins[0] + bins[1] + bins[2]
            t_dec = a + k_seq * B + k_ctx * s.sum_prompt_and_predicted
            k = k_pf + t_dec / budget
            attn = k_attn * u * (cached + u)
            ppw = getattr(inst, "pending_prefill_work", None)
            if ppw is not None:
                q_tokens, q_attended = ppw()
                q_tokens, q_attended = int(q_tokens), int(q_attended)  # as the helper: ties stay exact
            else:
                q_tokens, q_attended = pending_prefill_work(inst)
            ttft = k * (q_tokens + u) + k_attn * q_attended + attn
            cost = ttft + w_dec * out * (t_dec + own_step) + w_int * B * (k_pf * u + attn)
            usable = int(inst.kv_total_blocks * keep)
            need = need_full - h
            if need > usable:
                need = usable
            wkv = getattr(inst, "waiting_kv_blocks", None)
            deficit = need - usable + inst.kv_used_blocks + (wkv() if wkv is not None else waiting_kv_blocks(inst))
            if deficit > 0:
                # vLLM makes room by preempting and later recomputing about as many tokens.
                cost += w_pre * deficit * bs * k
                unfit.append((cost, inst.index))
            elif inst.num_running + inst.num_waiting < max_seqs:
                fit.append((cost, inst.index))
            else:
                unfit.append((cost, inst.index))
        # Exact ties (1e-12 s) always at random; near-ties too with ctx.near_tie.
        scored = fit or (None if p.hold else unfit)
        if not scored:
            return None
        choice = pick_cheapest(scored, self.ctx.near_tie, self._rng)
        if prefix is not None:
            index.insert(choice, prefix, view.now)
        return choice
