"""``predicted_latency``: run each instance's latency model forward and send the request where
it costs the least seconds in total.

Source: model-predictive routing as in Block (arXiv 2508.03611, "predictive scheduling with a
per-instance simulator") and Astrolabe (predicted E2E per candidate), done here with the
profile's closed-form iteration time (``routerd/profiles.py``) instead of a separate simulator,
so each instance is priced with *its own* hardware profile (``PolicyContext.profiles``): a
mixed pool's fast instances are seen as fast. Issue 18, deliverable 2.

For each candidate instance the policy replays, from the router's view of it (residents:
prompt, generated tokens, predicted output; ``routerd/policies/base.py``), what the engine
will do with the request appended at the tail of its queue, and reads off

* ``e2e``: when the request would finish there (s from now), and
* ``delay``: the seconds its presence adds to the completion of the requests already there,
  summed over them (every step that carries one of its prefill chunks, or its decode, is
  longer for each request still unfinished in that step).

``cost = e2e + delay_weight * delay``; with ``delay_weight`` 1 that is the growth of the sum of
all completion times the choice causes, which is what mean E2E measures (Little's law).

The forward model (one pass per instance, event-skipping; ``forecast``): an engine step with
``B`` decodes of contexts summing to ``S`` tokens and ``P`` prefill tokens takes
``t = overhead + prefill_per_token * P + decode_per_seq * B + decode_per_ctx_token * S`` (the
profile's iteration time). Prefill is FCFS in chunks: each step computes
``c = min(max_num_batched_tokens - B, Q)`` prefill tokens of the queue's ``Q`` (the decodes take
one token each, vLLM V1's scheduler order); a request is admitted only while
``B < max_num_seqs``. Between two events (a prefill finishing, a decode finishing) the batch is
fixed, so ``K`` steps take ``K * t + decode_per_ctx_token * B * K (K - 1) / 2`` (contexts grow by
one token per step): the loop jumps from event to event, never step by step. On an idle
instance this is exactly :meth:`HardwareProfile.lone_request_time` for a prompt within the budget. A prompt of ``u`` tokens adds the attention of
its chunks, ``prefill_attn * u * (u + c) / 2`` (the sum over chunks of ``chunk * (done + chunk)``),
when its prefill ends. Remaining decode of a resident: ``predicted - generated``; once a
request has passed its prediction, half of what is left of its predicted bucket
(``(upper edge - generated) / 2``, at least 1 token). A prefilling or waiting resident still
computes ``prompt + generated`` tokens (the view does not say how much of a chunked prefill is
done, as in ``join_shortest_queue``). The request itself costs nothing to the others until its
first chunk runs, and the others' progress in steps does not depend on it (it is the last in
FCFS order), so one pass with it yields both numbers.

Bounded horizon: after ``max_events`` events the residents are assumed never to finish (a
pessimistic batch) and only the queue ahead and the request itself are played out, so a
decision costs O(instances * (max_events + queue)) whatever the load. Approximations: the KV
cache is not replayed (admission by KV is the headroom test below), nor prefix-cache hits,
and chunking is fluid (a fractional number of steps).

Admission (as ``late_binding``, ``routerd/policies/kv_headroom.py``, on the instance's own
profile): an instance fits when ``num_running + num_waiting < max_num_seqs`` and
``blocks(min(prompt + predicted, max_model_len)) <= (1 - reserve_fraction) * total - used -
waiting``. Instances that fit are preferred; when none fits the policy holds (``hold=True``,
the default: every choice would preempt) or takes the cheapest, each unfit one priced with
``preemption_weight * k * block_size * deficit`` extra, the recompute its KV deficit would
cause (as ``phasewise``; ``k = prefill_per_token + t_dec / max_num_batched_tokens``). With
``wait_for_kv`` (the default) an instance without room is also priced as the wait until its
decodes free the request's KV deficit (``kv_wait_s``: the block count stepped to each predicted
end at the current step time, the others' growth counted, residents past their prediction never
counted on) plus its cost there, and the policy holds while that beats every instance with room:
a mixed pool's fast instance about to finish a decode can beat a slow one that has room now,
which ``late_binding`` (the first that fits) never waits for. Measured on the tuning window
(seed 0 of ``benchmarks/mixed_pools.py``, 2026-12-03): mean E2E -11.4% -> -18.7% (1.5x) and
-5.4% -> -14.4% (2x) against ``late_binding`` on azure-code, 2 x V100 + 2 x A100; unchanged
wherever KV was not what filled the instances. Exact ties (1e-12 s) go to a seeded random
choice; near-ties too with ``ctx.near_tie``.
"""

from __future__ import annotations

import heapq
import math
import random
from typing import Sequence

from pydantic import Field

from routerd.buckets import bucket_upper_tokens
from routerd.policies.base import (
    ClusterView,
    PolicyContext,
    PolicyParams,
    RequestFeatures,
    ResidentRequest,
    RoutingPolicy,
    pick_cheapest,
)
from routerd.policies.kv_headroom import blocks_for, kv_deficit_blocks, predicted_footprint_tokens
from routerd.profiles import HardwareProfile


def remaining_decode_steps(r: ResidentRequest, edges: tuple[int, ...]) -> float:
    """Predicted decode steps left for resident ``r`` (tokens, >= 1): ``predicted - generated``;
    past its prediction, half of what is left below its bucket's upper edge
    (:func:`routerd.buckets.bucket_upper_tokens`), at least 1."""
    rest = r.predicted_output_tokens - r.generated_tokens
    if rest >= 1.0:
        return rest
    if r.predicted_bucket is None:
        return 1.0
    left = 0.5 * (bucket_upper_tokens(r.predicted_bucket, edges) - r.generated_tokens)
    return left if left > 1.0 else 1.0


def forecast(
    profile: HardwareProfile,
    residents: Sequence[ResidentRequest],
    prompt_tokens: int,
    output_tokens: float,
    *,
    edges: tuple[int, ...],
    max_events: int = 64,
) -> tuple[float, float]:
    """``(e2e_s, delay_s)`` of a request of ``prompt_tokens`` and ``output_tokens`` (predicted)
    appended to an instance of ``profile`` holding ``residents`` (running first, then waiting,
    as :meth:`InstanceView.residents` lists them).

    ``e2e_s``: seconds from now until its last token; ``delay_s``: seconds it adds to the
    residents' completion times, summed over them. The model and its approximations are in
    the module docstring. O((residents + max_events) * log residents).
    """
    a = profile.overhead_s
    k_pf = profile.prefill_per_token_s
    k_attn = profile.prefill_attn_s
    k_seq = profile.decode_per_seq_s
    k_ctx = profile.decode_per_ctx_token_s
    budget = profile.max_num_batched_tokens
    max_seqs = profile.max_num_seqs

    # Decoding residents: a heap of (decode clock at which each finishes, its context minus the
    # clock), so its context at clock D is (offset + D) and the batch's context sum moves by B per step.
    fin: list[tuple[float, float]] = []
    B = 0
    S = 0.0
    # The prefill queue in FCFS order: (tokens to compute, context after it, decode steps after it).
    queue: list[tuple[float, float, float]] = []
    for r in residents:
        rest = remaining_decode_steps(r, edges)
        ctx = r.prompt_tokens + r.generated_tokens
        if r.in_prefill:
            queue.append((float(ctx), ctx + 1.0, rest - 1.0))  # the prefill yields one token
        else:
            fin.append((rest, float(ctx)))
            B += 1
            S += ctx
    heapq.heapify(fin)
    queue.append((float(prompt_tokens), prompt_tokens + 1.0, max(output_tokens, 1.0) - 1.0))
    own = len(queue) - 1  # the request's own position in the queue
    q_total = sum(q[0] for q in queue)  # prefill tokens still queued (the head's part: head_left)

    t = 0.0
    clock = 0.0  # decode steps elapsed
    delay = 0.0
    qi = 0
    head_left = queue[0][0]
    f_new = -1.0  # the request's finish clock once it decodes
    ctx_new_off = 0.0
    events = 0
    inf = math.inf
    while True:
        in_queue = qi < len(queue)
        K = inf
        c = 0.0
        if in_queue and B < max_seqs:
            c = min(budget - B if budget - B >= 1 else 1.0, q_total)
            K = head_left / c
        watch = events < max_events
        if watch and fin and fin[0][0] - clock < K:
            K = fin[0][0] - clock
        if f_new >= 0.0 and f_new - clock < K:
            K = f_new - clock
        if K == inf:
            # Past the horizon with the head waiting for a seat: admit it (the pessimistic batch).
            c = min(budget - B if budget - B >= 1 else 1.0, q_total)
            K = head_left / c
        if K < 0.0:
            K = 0.0
        # K steps of this batch: contexts grow by B tokens per step.
        grow = 0.5 * K * (K - 1.0) if K > 1.0 else 0.0
        dt = K * (a + k_pf * c + k_seq * B + k_ctx * S) + k_ctx * B * grow
        if c and qi == own:
            # Its chunks make each of these steps longer for every decoding resident.
            delay += K * k_pf * c * B
        elif f_new >= 0.0:
            per = K * (k_seq + k_ctx * (ctx_new_off + clock)) + k_ctx * grow
            delay += per * (B - 1)
        t += dt
        S += B * K
        clock += K
        if c:
            head_left -= K * c
            q_total -= K * c
            if head_left <= 1e-9:
                u, ctx_after, dec = queue[qi]
                lump = 0.5 * k_attn * u * (u + (c if c < u else u))
                t += lump
                if qi == own:
                    delay += lump * B
                    if dec <= 0.0:
                        return t, delay
                    f_new = clock + dec
                    ctx_new_off = ctx_after - clock
                    B += 1
                    S += ctx_after
                elif dec > 0.0:
                    heapq.heappush(fin, (clock + dec, ctx_after - clock))
                    B += 1
                    S += ctx_after
                q_total -= head_left  # rounding: what the head had left
                qi += 1
                head_left = queue[qi][0] if qi < len(queue) else 0.0
        if f_new >= 0.0 and f_new <= clock + 1e-9:
            return t, delay
        if watch:
            while fin and fin[0][0] <= clock + 1e-9:
                f, off = heapq.heappop(fin)
                B -= 1
                S -= off + f
            events += 1


def kv_wait_s(profile: HardwareProfile, residents: Sequence[ResidentRequest], deficit_blocks: int,
              block_size: int) -> float:
    """Seconds until the decoding ``residents`` of an instance of ``profile`` free
    ``deficit_blocks`` KV blocks (s; ``inf`` when the decodes whose end is predicted would not),
    at the current batch's step time.

    Stepping the block count forward to each predicted end ``K`` (decode steps from now, in
    order): a resident that finishes releases the blocks it holds now, ``blocks(prompt +
    generated)`` (what it grows by meanwhile is allocated and released with it); every resident
    still decoding takes up to ``ceil(K / block_size)`` more, counted in full (an upper bound on
    their growth, so the wait is never promised early on that account). Room comes at the first
    end where released minus grown reaches the deficit, after ``K`` steps of the batch as it is
    now (``overhead + decode_per_seq * B + decode_per_ctx_token * S``; finishing residents would
    shorten it). A resident already past its predicted length (``generated >= predicted``) has no
    predicted end: it grows and is never counted as freeing anything, so a misprediction cannot
    keep promising room one step away. Prefilling and waiting residents free nothing before
    they decode (their blocks count in :func:`kv_deficit_blocks`). 0 for a deficit of 0 or less.
    """
    if deficit_blocks <= 0:
        return 0.0
    ends: list[tuple[float, int]] = []
    growing = 0  # decoding residents, each growing by a token per step until it ends
    B = 0
    S = 0
    for r in residents:
        if r.in_prefill:
            continue
        ctx = r.prompt_tokens + r.generated_tokens
        B += 1
        S += ctx
        growing += 1
        rest = r.predicted_output_tokens - r.generated_tokens
        if rest > 0.0:
            ends.append((rest, blocks_for(ctx, block_size)))
    if not ends:
        return math.inf
    ends.sort()
    step = profile.overhead_s + profile.decode_per_seq_s * B + profile.decode_per_ctx_token_s * S
    released = 0
    for rest, blocks in ends:
        released += blocks
        growing -= 1
        if released - growing * math.ceil(rest / block_size) >= deficit_blocks:
            return rest * step
    return math.inf


class Params(PolicyParams):
    """Parameters of ``predicted_latency``."""

    delay_weight: float = Field(default=1.0, ge=0.0)
    """Weight of the seconds the request adds to the residents' completions, per second of its
    own E2E. 1: the cost is the growth of the sum of completion times (mean E2E by Little's law)."""
    hold: bool = True
    """Hold the request at the router while no instance has KV headroom and a free sequence slot
    for it (every choice would preempt); False sends it to the cheapest instance anyway."""
    reserve_fraction: float = Field(default=0.05, ge=0.0, lt=1.0)
    """Fraction of each instance's KV blocks kept as a margin for outputs longer than predicted
    (``late_binding``'s default)."""
    preemption_weight: float = Field(default=4.0, ge=0.0)
    """Weight of the recompute an instance without KV headroom would pay (``phasewise``'s
    default); ranks instances only when none fits and ``hold`` is off."""
    max_events: int = Field(default=64, ge=1)
    """Horizon of the forward model per instance: events (a prefill or a decode finishing)
    after which the residents still decoding are assumed to stay (see the module docstring)."""
    wait_for_kv: bool = True
    """Also price each instance without KV headroom as the wait until its decodes free the
    request's deficit (:func:`kv_wait_s`) plus its forecast there, and hold while such an
    instance is cheaper than every one that fits: in a mixed pool, a fast instance about to free
    room can beat a slow one that has room now (``late_binding`` takes the first that fits).
    Only with ``hold``: with ``hold=false`` the policy never holds, so it never waits. Residents
    past their predicted length are never counted on to free room (:func:`kv_wait_s`)."""


class PredictedLatency(RoutingPolicy):
    """Least predicted total latency cost (own E2E + delay to the residents), per-instance profiles."""

    name = "predicted_latency"
    Params = Params
    params: Params

    def __init__(self, ctx: PolicyContext, params: PolicyParams | None = None) -> None:
        super().__init__(ctx, params)
        self._rng = random.Random(ctx.seed)

    def pick(self, request: RequestFeatures, view: ClusterView) -> int | None:
        p = self.params
        ctx = self.ctx
        profiles = ctx.profiles
        edges = ctx.bucket_edges
        prompt = request.prompt_tokens
        out = request.predicted_output_tokens
        fit: list[tuple[float, int]] = []
        unfit: list[tuple[float, int]] = []
        wait_best = math.inf
        for inst in view.instances:
            i = inst.index
            # routerd may see more endpoints than the context was built for: those get ctx.profile.
            prof = profiles[i] if 0 <= i < len(profiles) else ctx.profile
            residents = inst.residents()  # a fresh list on routerd's views: read once
            e2e, delay = forecast(prof, residents, prompt, out, edges=edges, max_events=p.max_events)
            cost = e2e + p.delay_weight * delay
            need = blocks_for(predicted_footprint_tokens(prompt, out, prof.max_model_len), inst.block_size)
            deficit = kv_deficit_blocks(inst, need, p.reserve_fraction)
            fits = deficit <= 0 and inst.num_running + inst.num_waiting < prof.max_num_seqs
            if p.wait_for_kv and p.hold and not fits:  # without hold nothing waits
                # Waiting for a seat is in the forecast already; waiting for KV is not.
                waited = cost + kv_wait_s(prof, residents, deficit, inst.block_size)
                if waited < wait_best:
                    wait_best = waited
            if deficit > 0:
                s = inst.load_summary()
                bins = s.decode_bins
                t_dec = (prof.overhead_s + prof.decode_per_seq_s * (bins[0] + bins[1] + bins[2])
                         + prof.decode_per_ctx_token_s * s.sum_prompt_and_predicted)
                k = prof.prefill_per_token_s + t_dec / prof.max_num_batched_tokens
                cost += p.preemption_weight * deficit * inst.block_size * k
            (fit if fits else unfit).append((cost, i))
        scored = fit or (None if p.hold else unfit)
        if not scored:
            return None
        if fit and wait_best < min(fit)[0]:
            return None  # an instance that will have room is cheaper than every one with room now
        return pick_cheapest(scored, ctx.near_tie, self._rng)
