"""``phasewise``: cache affinity priced in seconds, with the costs none of the anchors counts.

For each instance the policy estimates, in seconds, what sending the request there adds to the
sum of all requests' latencies: its own latency there (queueing behind the prefill work already
there, its uncached prefill, then its decode at that instance's batch) plus the delay its
uncached prefill adds to every request sharing the instance with it (each step that carries one
of its chunks is slower for each of them). It sends the request to the cheapest instance that has KV headroom for it and
can hold it at the router while none has (late binding, where cached free blocks count as free:
vLLM evicts them on demand). Every term comes from that instance's latency model (its hardware
profile, ``routerd/profiles.py``; in a mixed pool each instance its own), so a cache hit is worth
exactly the prefill it saves on *that* instance, and a hit is traded against load in the same
unit.

Terms, for instance ``i`` with ``B`` decoding requests, ``W`` waiting or prefilling ones, ``S``
tokens of prompt + predicted output over its residents, ``P`` prompt tokens still to prefill
there, and ``h`` blocks of this request's prompt cached:

* step time with the batch: ``t_dec = overhead + decode_per_seq * B + decode_per_ctx * S``;
* prefill seconds per token, the decodes riding along (chunked prefill shares each step of
  ``max_num_batched_tokens`` tokens with the decode batch):
  ``k = prefill_per_token + t_dec / max_num_batched_tokens``;
* uncached tokens ``u = prompt - block_size * h`` (at least 1: the last token is computed);
* ``ttft = k * (P + u) + prefill_attn * (A + u * (block_size * h + u))`` (prefill attention is
  quadratic in what a chunk attends: the cached prefix plus itself; ``A`` is the same sum over
  the prefill work queued there, ``sum u_j * (c_j + u_j)``, so a long prompt ahead weighs what
  it costs, not just its length);
* ``interference = (B + W) * (prefill_per_token * u + prefill_attn * u * (block_size * h + u))``:
  the delay its prefill adds to each request there: those decoding now, and those waiting
  ahead of it, which will be decoding while it prefills (the "cost of prefill that a cache
  miss adds to the requests already decoding", the paper's prefill/decode mixing concern,
  arXiv 2408.13510 §4, priced by the latency model instead of the paper's gradients);
* ``decode = predicted_output * (t_dec + decode_per_seq + decode_per_ctx * (prompt +
  predicted_output / 2))``: its own decode at that batch, one more sequence in it;
* ``cost = ttft + decode_weight * decode + interference_weight * interference``, plus, on an
  instance without KV headroom, ``preemption_weight * k * block_size * deficit`` (the KV deficit
  in blocks: what vLLM would preempt and recompute to make room).

With both weights 1 (the defaults) the cost is the request's own E2E there plus the seconds its
prefill costs the others: the marginal change of the summed latency, the quantity a mean E2E
averages, so the weights are derived, not tuned (leave-one-workload-out on the robustness grid
kept them over the alternatives tried, ``docs/robustness.md``). This is what ``lmetric``'s score
``(P + u) * (B + W + 1)`` (``routerd/policies/lmetric.py``) approximates in tokens: new prefill
times everyone it delays, itself included. ``phasewise`` prices the same product in seconds and
adds what lmetric leaves out: the decode batch's slowing of prefill (``k``), prefill attention,
per-instance profiles, KV headroom. Measured on the robustness grid (``docs/robustness.md``):
where lmetric beat the previous default (weight 0.1, decoding requests only), it was by counting
the waiting requests and pricing the delay to others at par.

Admission (as ``late_binding``, ``routerd/policies/kv_headroom.py``): instance ``i`` fits when
``blocks(prompt + predicted_output) - h <= (1 - reserve_fraction) * total - used - waiting``,
with ``used`` the blocks in use (cached free blocks are not used), and
``num_running + num_waiting < max_num_seqs``. With no instance fitting it holds
(``hold=True``) or takes the cheapest anyway.

Prefix source: ``precise`` reads what the engines' KV events report, plus the blocks of prompts
dispatched there and not computed yet (the simulator's view offers both; routerd through the
KV-event index and its pending blocks), ``approximate`` its own dispatch history
(:class:`routerd.prefix.index.PrefixIndex`, llm-d's approximate producer). Ties go to the
lowest cost, then a seeded random choice.
"""

from __future__ import annotations

import math
import random
from typing import Literal, NamedTuple

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


#: Which residents an instance's prefill delays (``Params.interference_count``).
InterferenceCount = Literal["residents", "decoding"]


class Params(PolicyParams):
    """Parameters of ``phasewise``."""

    prefix_source: PrefixSource = "precise"
    """Where cache hits come from: ``precise`` (the engines' KV events, with the blocks of prompts
    dispatched there that are not computed yet) or ``approximate`` (the router's own dispatch
    history)."""
    interference_weight: float = Field(default=1.0, ge=0.0)
    """Seconds of latency the request's prefill adds to the requests sharing the instance with it,
    per second of its own. 1: every request's latency counts alike, so the cost is the request's
    marginal addition to the sum of latencies, which is what a mean E2E measures (the derived
    value, no tuning). Kept over 2 by leave-one-workload-out on the robustness grid
    (``benchmarks/robustness.py``, ``docs/robustness.md``: 2 won only the fold that held Mooncake
    out). The default until 2026-12 was 0.1 with ``interference_count=decoding``, chosen on windows
    of one trace; it lost to ``lmetric`` by up to 21% on a conversation trace it had not seen."""
    interference_count: InterferenceCount = "residents"
    """Who the request's prefill delays: ``residents`` (every request running or waiting there:
    those waiting ahead of it will be decoding while it prefills) or ``decoding`` (only the
    requests decoding now; the default until 2026-12)."""
    decode_weight: float = Field(default=1.0, ge=0.0)
    """Weight of the request's own predicted decode time at the instance's batch (seconds per
    second). 1: the request's own latency counts in full (its TTFT plus its decode there), which
    is what prices a faster GPU in a mixed pool and a lighter decode batch. Chosen over 0 (the
    default until 2026-12) by leave-one-workload-out on the robustness grid: 1 won in 6 of 7 folds
    (``docs/robustness.md``)."""
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


class _Consts(NamedTuple):
    """One instance's latency-model constants (its profile, ``routerd/profiles.py``)."""

    bs: int
    a: float
    k_pf: float
    k_attn: float
    k_seq: float
    k_ctx: float
    budget: int
    max_seqs: int
    max_model_len: int


class Phasewise(RoutingPolicy):
    """Least estimated latency cost in seconds, cache hits included, with KV-headroom holding."""

    name = "phasewise"
    Params = Params
    params: Params

    def __init__(self, ctx: PolicyContext, params: PolicyParams | None = None) -> None:
        super().__init__(ctx, params)
        self._rng = random.Random(ctx.seed)
        self._index = PrefixIndex(self.params.index_capacity_blocks)
        # Each instance priced by its own profile: in a mixed pool an older GPU's prefill second
        # is not a newer one's. Instances share one entry per distinct profile, so a decision
        # unpacks the constants once per profile, not once per instance.
        groups: dict[_Consts, int] = {}
        self._slot: list[int] = []
        for prof in ctx.profiles:
            c = _Consts(prof.block_size, prof.overhead_s, prof.prefill_per_token_s, prof.prefill_attn_s,
                        prof.decode_per_seq_s, prof.decode_per_ctx_token_s, prof.max_num_batched_tokens,
                        prof.max_num_seqs, prof.max_model_len)
            self._slot.append(groups.setdefault(c, len(groups)))
        self._groups = list(groups)

    def pick(self, request: RequestFeatures, view: ClusterView) -> int | None:
        p = self.params
        prompt = request.prompt_tokens
        out = request.predicted_output_tokens
        prefix = request.prefix
        fit: list[tuple[float, int]] = []
        unfit: list[tuple[float, int]] = []
        w_dec, w_int, w_pre = p.decode_weight, p.interference_weight, p.preemption_weight
        waiting_too = p.interference_count == "residents"
        keep = 1.0 - p.reserve_fraction
        index, source = self._index, p.prefix_source
        floor = math.inf  # the least own-decode term over the candidates (s)
        # Per profile, what does not depend on the instance's state: the request's KV footprint
        # (blocks) and its own decode step beyond the batch's (s).
        derived = [(c.bs, c.a, c.k_pf, c.k_attn, c.k_seq, c.k_ctx, c.budget, c.max_seqs,
                    blocks_for(predicted_footprint_tokens(prompt, out, c.max_model_len), c.bs),
                    c.k_seq + c.k_ctx * (prompt + 0.5 * out))
                   for c in self._groups]
        slot, n_slots = self._slot, len(self._slot)
        cur = -1
        # pending_prefill_work and waiting_kv_blocks inlined (their views' fast paths): this loop
        # is most of a decision's cost (benchmarks/prefix_decision_cost.py).
        for inst in view.instances:
            i = inst.index
            g = slot[i] if 0 <= i < n_slots else 0
            if g != cur:
                cur = g
                bs, a, k_pf, k_attn, k_seq, k_ctx, budget, max_seqs, need_full, own_step = derived[g]
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
            cost = (k * (q_tokens + u) + k_attn * q_attended + attn
                    + w_int * (B + s.in_prefill if waiting_too else B) * (k_pf * u + attn))
            if w_dec:
                own_decode = w_dec * out * (t_dec + own_step)
                cost += own_decode
                if own_decode < floor:
                    floor = own_decode
            usable = int(inst.kv_total_blocks * keep)
            need = need_full - h
            if need > usable:
                need = usable
            wkv = getattr(inst, "waiting_kv_blocks", None)
            deficit = need - usable + inst.kv_used_blocks + (wkv() if wkv is not None else waiting_kv_blocks(inst))
            if deficit > 0:
                # vLLM makes room by preempting and later recomputing about as many tokens.
                cost += w_pre * deficit * bs * k
                unfit.append((cost, i))
            elif inst.num_running + inst.num_waiting < max_seqs:
                fit.append((cost, i))
            else:
                unfit.append((cost, i))
        # Exact ties (1e-12 s) always at random; near-ties too with ctx.near_tie.
        scored = fit or (None if p.hold else unfit)
        if not scored:
            return None
        if self.ctx.near_tie and floor < math.inf:
            # The decode every candidate charges at least is no part of the difference between
            # them: near-ties are relative to what the choice changes, or routerd's 5% band would
            # span the cache hits (a 0.12 s prefill saved beside 2.5 s of decode).
            scored = [(cost - floor, i) for cost, i in scored]
        choice = pick_cheapest(scored, self.ctx.near_tie, self._rng)
        if prefix is not None:
            index.insert(choice, prefix, view.now)
        return choice
