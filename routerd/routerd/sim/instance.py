"""One simulated vLLM V1 instance: continuous batching, KV blocks, preemption by recompute.

Scheduling follows vLLM V1's ``Scheduler.schedule()`` (``vllm-and-simulators.md`` §1):

1. RUNNING first, in admission order, within the token budget
   ``max_num_batched_tokens``: a decode costs one token; an unfinished prefill
   continues, chunked to the remaining budget when chunked prefill is on.
2. When a running request cannot get a KV block, the most recently admitted running
   request is preempted (recompute): its blocks are freed, it goes to the *front* of the
   waiting queue, its generated tokens are kept and recomputed with the prompt when it
   is admitted again. If the victim is the request itself, running scheduling stops.
3. WAITING requests are admitted FCFS only if nothing was preempted this step; the
   head blocks the rest when it does not fit (blocks, ``max_num_seqs`` or, without
   chunked prefill, the budget). ``admission_gate="full"`` (vLLM's newer default
   ``scheduler_reserve_full_isl``) admits only if the whole current sequence fits in
   free blocks; ``"chunk"`` (older V1) checks only the first chunk.

Speed: a run of iterations in which only decodes execute and nothing can change the
batch (no prefill in flight, the waiting head cannot be admitted, no request finishes,
no KV block runs out) is simulated as one *segment* in O(block_size) time: iteration
times form an arithmetic series (each iteration adds one context token per decode) and
block allocations follow each request's position modulo the block size. The cost of a
simulation therefore grows with events (arrivals, admissions, completions,
preemptions), not with tokens.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Callable, Literal

from routerd.prefix.cache import PrefixCache, PrefixState
from routerd.prefix.chain import sequence_extents
from routerd.profiles import HardwareProfile
from routerd.sim.request import DECODE, DONE, PREFILL, WAITING, SimRequest

AdmissionGate = Literal["full", "chunk"]


class SimInstance:
    """A vLLM-like instance driven by an external event loop.

    The owner calls :meth:`enqueue` when the router dispatches a request and
    :meth:`step_end` when the event it was asked to schedule fires. The instance asks
    for events through ``schedule_event(time, instance)`` and reports through
    ``on_first_token(req, t)`` and ``on_finish(req, t)``.
    """

    def __init__(
        self,
        index: int,
        profile: HardwareProfile,
        schedule_event: Callable[[float, "SimInstance"], None],
        on_first_token: Callable[[SimRequest, float], None],
        on_finish: Callable[[SimRequest, float], None],
        admission_gate: AdmissionGate = "full",
    ) -> None:
        self.index = index
        self.profile = profile
        self._schedule_event = schedule_event
        self._on_first_token = on_first_token
        self._on_finish = on_finish
        self.full_gate = admission_gate == "full"
        p = profile
        self.bs = p.block_size
        self.total_blocks = p.num_blocks
        self.max_seqs = p.max_num_seqs
        self.budget = p.max_num_batched_tokens
        self.chunked = p.chunked_prefill
        self.a = p.overhead_s
        self.k_pf = p.prefill_per_token_s
        self.k_attn = p.prefill_attn_s
        self.k_seq = p.decode_per_seq_s
        self.k_ctx = p.decode_per_ctx_token_s

        self.running: list[SimRequest] = []
        self.waiting: deque[SimRequest] = deque()
        self.free_blocks = self.total_blocks
        self.D = 0  # decode iterations completed
        self.n_dec = 0  # decoding requests
        self.ctx_sum = 0  # sum over decoding requests of prompt + generated(D)
        self.phase = [0] * self.bs  # decoding requests by block-allocation residue
        self.fin_heap: list[tuple[int, int, int, SimRequest]] = []
        self.n_prefill = 0  # running requests still prefilling
        self.admit_seq = 0

        # The iteration (or segment of iterations) in flight.
        self.busy = False
        self.version = 0  # bumps when the pending event is replaced
        self.seg_t0 = 0.0
        self.seg_t1 = 0.0  # first iteration's duration
        self.seg_slope = 0.0  # growth of the iteration time per iteration
        self.seg_K = 0  # iterations in the segment
        self.seg_end = 0.0
        self.seg_decode_only = True
        self.step_chunks: list[tuple[SimRequest, int]] = []
        self.step_dec = False

        # Load aggregates, kept incrementally so a router decision costs O(instances)
        # (see routerd.policies.base.LoadSummary) and the RL reward O(1) per step.
        self.n_res = 0  # resident requests (running + waiting)
        self.sum_pd = 0.0  # sum over residents of prompt + predicted output tokens
        self.dec_hist = [0, 0, 0]  # decoding requests by predicted-output bin
        self.pred_heap: list[tuple[float, int, int, SimRequest]] = []  # predicted end (in D units)
        self.inv_T_sum = 0.0  # reward: sum of 1/T_j over residents
        self.fT_static = 0.0  # reward: sum of generated_j * w_j over non-decoding residents
        self.fT_A = 0.0  # reward: sum of w_j * (gen_base_j - dec_base_j) over decoding ones
        self.fT_W = 0.0  # reward: sum of w_j over decoding ones

        # Requests whose client went away while they were in the step in flight (see abort()).
        self._aborting: list[SimRequest] = []

        # Automatic prefix caching (vLLM V1), for requests with prefix identity.
        self.pc: PrefixCache | None = PrefixCache(self.total_blocks) if p.prefix_caching else None
        self.pending: dict[int, dict[int, int]] = {}
        """Blocks on their way: for each extent hash of a prompt dispatched here that has not had
        its first token (its blocks not all computed yet), ``{leading blocks: requests}``. A
        precise view counts them as cached, as routerd counts a dispatched prompt's blocks until
        their KV events come (``routerd.daemon.state.EndpointState.note_pending``): without it a
        burst sharing a prefix finds nothing cached anywhere until the first one is computed."""
        self.prefix_hits = 0
        """Prompt tokens served from the cache at first admissions (``vllm:prefix_cache_hits``)."""
        self.prefix_queries = 0
        """Prompt tokens looked up at first admissions (``vllm:prefix_cache_queries``)."""

        # Counters for reports and views.
        self.preemptions = 0
        self.iterations = 0
        self.busy_time = 0.0
        self.prefill_tokens_done = 0

    # ------------------------------------------------------------------ helpers
    def _elapsed(self, j: int) -> float:
        return j * self.seg_t1 + self.seg_slope * j * (j - 1) * 0.5

    def _iters_done(self, t: float) -> int:
        """Iterations of the current segment completed by time ``t`` (0..seg_K)."""
        if not self.busy:
            return 0
        e = t - self.seg_t0
        if e <= 0.0:
            return 0
        t1, s = self.seg_t1, self.seg_slope
        if s <= 0.0:
            j = int(e / t1)
        else:
            b = t1 - 0.5 * s
            j = int((-b + math.sqrt(b * b + 2.0 * s * e)) / s)
        # Guard against floating-point rounding at boundaries.
        while j > 0 and self._elapsed(j) > e:
            j -= 1
        while j < self.seg_K and self._elapsed(j + 1) <= e:
            j += 1
        return min(j, self.seg_K)

    def _allocs(self, K: int) -> int:
        """KV blocks the decoding requests allocate over the next ``K`` iterations."""
        if K <= 0 or self.n_dec == 0:
            return 0
        bs = self.bs
        full, rem = divmod(K, bs)
        total = full * self.n_dec
        ph = self.phase
        D = self.D
        for j in range(1, rem + 1):
            total += ph[(D + j) % bs]
        return total

    def _first_shortfall(self) -> int:
        """Index (1-based, from now) of the first iteration whose decode blocks do not fit."""
        n = self.n_dec
        if n == 0:
            return 1 << 60
        free = self.free_blocks
        q = free // n
        rem = free - q * n
        bs = self.bs
        ph = self.phase
        D = self.D
        cum = 0
        for j in range(1, bs + 1):
            cum += ph[(D + j) % bs]
            if cum > rem:
                return q * bs + j
        return q * bs + bs  # unreachable: a full cycle allocates n > rem blocks

    def _start_decode(self, r: SimRequest) -> None:
        r.state = DECODE
        r.dec_base = self.D
        r.gen_base = r.generated
        # New block at absolute iteration k iff (prompt + gen_base + k - 1 - dec_base - 1) % bs == 0.
        rho = -(r.prompt + r.generated - self.D - 2) % self.bs
        r.phase = rho
        self.phase[rho] += 1
        self.n_dec += 1
        self.ctx_sum += r.prompt + r.generated
        r.finish_D = self.D + (r.output - r.generated)
        heapq.heappush(self.fin_heap, (r.finish_D, r.id, r.epoch, r))
        self.dec_hist[r.hist_bin] += 1
        heap = self.pred_heap
        if len(heap) > 4 * self.n_dec + 64:
            # Nobody has read it for a while (stale entries pile up): rebuild from the live ones.
            heap[:] = [e for e in heap if e[2] == e[3].epoch and e[3].state == DECODE]
            heapq.heapify(heap)
        heapq.heappush(heap, (r.pred_tokens - r.generated + self.D, r.id, r.epoch, r))
        self.fT_A += r.w * (r.generated - self.D)
        self.fT_W += r.w

    def _stop_decode(self, r: SimRequest) -> None:
        """Remove a decoding request from the aggregates; returns nothing, updates ``generated``."""
        gen = r.gen_base + self.D - r.dec_base
        r.generated = gen
        self.phase[r.phase] -= 1
        self.n_dec -= 1
        self.ctx_sum -= r.prompt + gen
        r.epoch += 1  # invalidates its finish-heap and pred-heap entries
        self.dec_hist[r.hist_bin] -= 1
        self.fT_A -= r.w * (r.gen_base - r.dec_base)
        self.fT_W -= r.w

    def _held_blocks(self, r: SimRequest) -> int:
        if r.state == DECODE:
            # KV holds prompt + generated - 1 tokens (the newest token has no KV yet).
            return -(-(r.prompt + r.gen_base + self.D - r.dec_base - 1) // self.bs)
        return r.blocks

    def _give_back(self, r: SimRequest, blocks: int, kv_tokens: int) -> None:
        """``r`` (holding ``blocks`` blocks over ``kv_tokens`` tokens) leaves the running set."""
        pc = self.pc
        if pc is None:
            self.free_blocks += blocks
            return
        st = r.pst
        if st is not None and kv_tokens // self.bs > st.reg:
            # Its full decode blocks are hashed as they fill; nobody can hit them before it
            # leaves (only a later turn resends a response), so they are cached here at once,
            # with the blocks nobody else shares (PrefixCache.register).
            pc.register(st, kv_tokens // self.bs, self.free_blocks, final=True)
        self.free_blocks += pc.release(st, blocks, self.free_blocks)

    def _preempt(self, victim: SimRequest) -> None:
        freed = self._held_blocks(victim)
        if victim.state == DECODE:
            self._stop_decode(victim)
            self.fT_static += victim.generated * victim.w
            self._give_back(victim, freed, victim.prompt + victim.generated - 1)
        else:
            self.n_prefill -= 1
            self._give_back(victim, freed, victim.computed)
        victim.blocks = 0
        victim.state = WAITING
        victim.computed = 0
        victim.target = victim.prompt + victim.generated
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(victim)

    # ------------------------------------------------------------------ API
    def enqueue(self, r: SimRequest, now: float) -> None:
        """A request arrives from the router at ``now``; it is scheduled at the next step."""
        r.instance = self.index
        r.state = WAITING
        r.computed = 0
        r.target = r.prompt
        if self.pc is not None and r.prefix is not None and r.pst is None:
            if r.seq_ext is not None:
                r.pst = PrefixState(r.seq_ext, r.seq_share)
            else:
                rid = r.response_id if r.response_id is not None else -(r.id + 1)
                r.pst = PrefixState(sequence_extents(r.prefix, r.prompt, rid, r.output, self.bs))
        if self.pc is not None and r.prefix is not None and r.first_token_s < 0.0:
            self._note_pending(r.prefix.extents)
        self.waiting.append(r)
        self.n_res += 1
        self.sum_pd += r.prompt + r.pred_tokens
        self.inv_T_sum += r.inv_T
        self.fT_static += r.generated * r.w
        if not self.busy:
            return  # the owner calls start() once its decision round at ``now`` is over
        self._cut_segment(now)

    def _cut_segment(self, now: float) -> None:
        """End a long decode segment at the end of the iteration in flight at ``now`` (the batch
        changes there: an arrival may be admitted, an aborted request leaves)."""
        if self.seg_K > 1:
            j = self._iters_done(now)
            if j == 0 or self.seg_t0 + self._elapsed(j) < now:
                # The iteration in flight at `now` completes first. One that ends exactly at
                # `now` is a step boundary like any other: the batch changes there, as it does
                # after a single step (the cluster handles an arrival before a step end at
                # the same instant).
                j += 1
            if j < self.seg_K:
                self.seg_K = j
                self.seg_end = self.seg_t0 + self._elapsed(j)
                self.version += 1
                self._schedule_event(self.seg_end, self)

    def start(self, now: float) -> None:
        """Begin a step at ``now`` if the instance is idle (after a round of dispatches)."""
        if not self.busy:
            self._schedule(now)

    def step_end(self, now: float) -> None:
        """The pending iteration or segment has finished at ``now``; apply it and go on."""
        K = self.seg_K
        self.busy = False
        self.iterations += K
        self.busy_time += now - self.seg_t0
        if self.seg_decode_only:
            self.free_blocks -= self._allocs(K)
            self.D += K
            self.ctx_sum += self.n_dec * K
        else:
            if self.step_dec:
                # Blocks for this step's decodes were allocated at schedule time.
                self.D += 1
                self.ctx_sum += self.n_dec
            for r, n in self.step_chunks:
                r.computed += n
                self.prefill_tokens_done += n
                if r.computed >= r.target:
                    self.n_prefill -= 1
                    self.fT_static -= r.generated * r.w
                    r.generated += 1
                    if r.first_token_s < 0.0:
                        r.first_token_s = now
                        if r.prefix is not None and self.pc is not None:
                            self._end_pending(r.prefix.extents)
                        self._on_first_token(r, now)
                    if r.generated >= r.output:
                        self._finish(r, now, r.blocks)
                    else:
                        self._start_decode(r)
            self.step_chunks = []
        heap = self.fin_heap
        D = self.D
        while heap and heap[0][0] <= D:
            _, _, epoch, r = heapq.heappop(heap)
            if epoch != r.epoch or r.state != DECODE:
                continue
            blocks = self._held_blocks(r)
            self._stop_decode(r)
            self._finish(r, now, blocks)
        if self._aborting:
            self._drop_aborted()
        self._schedule(now)

    def _finish(self, r: SimRequest, now: float, blocks: int) -> None:
        r.state = DONE
        r.finish_s = now
        r.generated = r.output
        self._give_back(r, blocks, r.prompt + r.output - 1)
        r.blocks = 0
        self.running.remove(r)
        self.n_res -= 1
        self.sum_pd -= r.prompt + r.pred_tokens
        self.inv_T_sum -= r.inv_T
        self._on_finish(r, now)

    # ------------------------------------------------------------------ scheduling
    def _schedule(self, now: float) -> None:
        running = self.running
        if not running and not self.waiting:
            return
        bs = self.bs
        budget = self.budget
        preempted = False
        chunks: list[tuple[SimRequest, int]] = []
        need_dec = self.phase[(self.D + 1) % bs] if self.n_dec else 0

        fast = need_dec <= self.free_blocks
        if fast:
            self.free_blocks -= need_dec
            budget -= self.n_dec
            if self.n_prefill:
                # Only the last-admitted request can be mid-prefill (its chunk used the
                # whole remaining budget, so nothing was admitted after it).
                i = 0
                while i < len(running):
                    r = running[i]
                    i += 1
                    if r.state != PREFILL:
                        continue
                    n = r.target - r.computed
                    if n > budget:
                        n = budget
                    if n <= 0:
                        continue
                    need = -(-(r.computed + n) // bs) - r.blocks
                    while need > self.free_blocks:
                        victim = running.pop()
                        self._preempt(victim)
                        preempted = True
                        if victim is r:
                            break
                    if r.state != PREFILL:
                        break
                    self.free_blocks -= need
                    r.blocks += need
                    if r.pst is not None:
                        self.pc.register(r.pst, (r.computed + n) // bs, self.free_blocks)
                    budget -= n
                    chunks.append((r, n))
        else:
            budget, preempted = self._schedule_running_slow(chunks, budget)

        if not preempted:
            waiting = self.waiting
            pc = self.pc
            while waiting and budget > 0 and len(running) < self.max_seqs:
                r = waiting[0]
                st = r.pst
                if st is not None:
                    # Longest cached prefix; the last prompt token is always computed.
                    hit, hit_free = pc.lookup(st.ext, (r.target - 1) // bs, self.free_blocks)
                else:
                    hit = hit_free = 0
                done = hit * bs
                n = r.target - done
                if n > budget:
                    if not self.chunked:
                        break
                    n = budget
                # Reused blocks that are free leave the free pool too (vLLM's allocate_slots
                # counts them among the blocks it must find).
                need_gate = -(-(r.target if self.full_gate else done + n) // bs) - hit + hit_free
                if need_gate > self.free_blocks:
                    break
                waiting.popleft()
                need = -(-(done + n) // bs) - hit
                self.free_blocks -= need + hit_free
                r.blocks = need + hit
                r.computed = done
                if st is not None:
                    pc.admit(st, hit, (done + n) // bs, self.free_blocks)
                if pc is not None and r.cached_tokens < 0:
                    r.cached_tokens = done
                    self.prefix_hits += done
                    self.prefix_queries += r.target
                r.state = PREFILL
                self.n_prefill += 1
                if r.scheduled_s < 0.0:
                    r.scheduled_s = now
                running.append(r)
                budget -= n
                chunks.append((r, n))

        n_dec = self.n_dec
        if not chunks:
            if fast and n_dec and not preempted:
                # Pure decode: fast-forward until a finish, a block shortfall or an arrival.
                # need_dec <= free_blocks here, so the first shortfall is >= 2 iterations away.
                self.free_blocks += need_dec  # _allocs() accounts for the whole segment
                K = self.fin_heap[0][0] - self.D if self.fin_heap else 1
                K = min(K, self._first_shortfall() - 1)
                t1 = self.a + self.k_seq * n_dec + self.k_ctx * self.ctx_sum
                self._begin(now, max(K, 1), t1, self.k_ctx * n_dec, True, False)
                return
            if n_dec == 0:
                if self.waiting and preempted:
                    # Everything was preempted: the engine immediately schedules again
                    # (admission was skipped only for the step that preempted).
                    self._schedule(now)
                return
        pf_tokens = 0
        attn = 0
        for r, n in chunks:
            pf_tokens += n
            attn += n * (r.computed + n)
        t = (
            self.a
            + self.k_pf * pf_tokens
            + self.k_attn * attn
            + self.k_seq * n_dec
            + self.k_ctx * self.ctx_sum
        )
        self.step_chunks = chunks
        self._begin(now, 1, t, 0.0, False, n_dec > 0)

    def _schedule_running_slow(
        self, chunks: list[tuple[SimRequest, int]], budget: int
    ) -> tuple[int, bool]:
        """Walk RUNNING one by one, preempting from the tail when blocks run out."""
        running = self.running
        bs = self.bs
        k_next = (self.D + 1) % bs
        preempted = False
        i = 0
        while i < len(running):
            r = running[i]
            i += 1
            if r.state == DECODE:
                n = 1
                need = 1 if r.phase == k_next else 0
            else:
                n = min(r.target - r.computed, budget)
                if n <= 0:
                    continue
                need = -(-(r.computed + n) // bs) - r.blocks
            while need > self.free_blocks:
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is r:
                    break
            if r.state == WAITING:
                break  # it preempted itself: stop scheduling running requests
            self.free_blocks -= need
            budget -= n
            if r.state != DECODE:
                r.blocks += need
                if r.pst is not None:
                    self.pc.register(r.pst, (r.computed + n) // bs, self.free_blocks)
                chunks.append((r, n))
        return budget, preempted

    def _begin(self, now: float, K: int, t1: float, slope: float, decode_only: bool, step_dec: bool) -> None:
        self.busy = True
        self.seg_t0 = now
        self.seg_t1 = t1
        self.seg_slope = slope
        self.seg_K = K
        self.seg_decode_only = decode_only
        self.step_dec = step_dec
        self.seg_end = now + self._elapsed(K)
        self.version += 1
        self._schedule_event(self.seg_end, self)

    # ------------------------------------------------------------------ real-time driving
    def iteration_end_time(self, j: int) -> float:
        """End time (s) of the ``j``-th iteration (1-based, ``j <= seg_K``) of the step or segment in flight.

        A real-time driver (the emulator) emits each decode token at the end of its
        iteration; inside a decode segment, decoding request ``r`` has then generated
        ``generated_at(r, D + j)`` tokens.
        """
        return self.seg_t0 + self._elapsed(j)

    def iterations_done_at(self, t: float) -> int:
        """Iterations of the step or segment in flight that have ended by time ``t`` (0..``seg_K``).

        The same test :meth:`enqueue` and :meth:`abort` use to cut a segment, so a driver
        that emits tokens with it never gets ahead of a cut.
        """
        return self._iters_done(t)

    def abort(self, r: SimRequest, now: float) -> None:
        """Drop resident request ``r`` at ``now`` (its client went away); frees its KV blocks.

        As in vLLM, an abort takes effect between engine steps: a waiting request (or
        any request while the instance is idle) is removed at once; a request in the
        step in flight is removed when that step ends (a long decode segment is cut
        after the iteration in flight), so the step's timing stays what was scheduled.
        ``r`` ends in state ``DONE`` with ``finish_s`` unset (-1) and ``on_finish`` is not
        called. Aborting a finished or already aborted request does nothing.
        """
        if r.state == DONE or r in self._aborting:
            return
        if r.state == WAITING:
            self.waiting.remove(r)
            self._release(r, 0, 0)
            self.start(now)  # the head may have been blocking the rest
            return
        if not self.busy:
            self._aborting.append(r)
            self._drop_aborted()
            self.start(now)
            return
        self._aborting.append(r)
        self._cut_segment(now)

    def _drop_aborted(self) -> None:
        """Remove the requests of :meth:`abort` at a step boundary (before scheduling)."""
        for r in self._aborting:
            if r.state == DONE:
                continue  # it finished in the step that was in flight
            kv = 0
            if r.state == DECODE:
                blocks = self._held_blocks(r)
                self._stop_decode(r)
                kv = r.prompt + r.generated - 1
                self.running.remove(r)
            elif r.state == PREFILL:
                blocks = r.blocks
                kv = r.computed
                self.n_prefill -= 1
                self.fT_static -= r.generated * r.w
                self.running.remove(r)
            else:
                blocks = 0
                self.waiting.remove(r)
            self._release(r, blocks, kv)
        self._aborting.clear()

    def _release(self, r: SimRequest, blocks: int, kv_tokens: int) -> None:
        if r.first_token_s < 0.0 and r.prefix is not None and self.pc is not None:
            self._end_pending(r.prefix.extents)
        if r.state == WAITING:
            self.fT_static -= r.generated * r.w
        self._give_back(r, blocks, kv_tokens)
        r.state = DONE
        r.blocks = 0
        self.n_res -= 1
        self.sum_pd -= r.prompt + r.pred_tokens
        self.inv_T_sum -= r.inv_T

    # ------------------------------------------------------------------ blocks on their way
    def _note_pending(self, extents) -> None:
        pend = self.pending
        for h, n in extents:
            d = pend.get(h)
            if d is None:
                pend[h] = {n: 1}
            else:
                d[n] = d.get(n, 0) + 1

    def _end_pending(self, extents) -> None:
        pend = self.pending
        for h, n in extents:
            d = pend[h]
            c = d[n] - 1
            if c:
                d[n] = c
            else:
                del d[n]
                if not d:
                    del pend[h]

    def pending_match(self, extents) -> int:
        """Leading blocks of ``extents`` that prompts dispatched here and not yet prefilled hold
        (blocks): the longest run through extents some pending prompt has as far (see
        :attr:`pending`)."""
        pend = self.pending
        total = 0
        for h, n in extents:
            d = pend.get(h)
            if d is None:
                break
            c = max(d)
            if c >= n:
                total += n
                continue
            total += c
            break
        return total

    # ------------------------------------------------------------------ observation
    def observe(self, t: float) -> tuple[int, int]:
        """``(decode_iters_at(t), used_blocks_at(t))``, locating ``t`` in the segment once."""
        if self.busy and self.seg_decode_only:
            j = self._iters_done(t)
            return self.D + j, self.total_blocks - self.free_blocks + self._allocs(j)
        return self.D, self.total_blocks - self.free_blocks

    def decode_iters_at(self, t: float) -> int:
        """Decode-iteration counter ``D`` as of time ``t`` (inside the current segment)."""
        if self.busy and self.seg_decode_only:
            return self.D + self._iters_done(t)
        return self.D

    def used_blocks_at(self, t: float) -> int:
        """KV blocks in use at time ``t``."""
        used = self.total_blocks - self.free_blocks
        if self.busy and self.seg_decode_only:
            used += self._allocs(self._iters_done(t))
        return used

    def min_predicted_remaining(self, D: int) -> float | None:
        """Smallest predicted remaining decode (tokens) among decoding requests at counter ``D``."""
        heap = self.pred_heap
        while heap:
            key, _, epoch, r = heap[0]
            if epoch == r.epoch and r.state == DECODE:
                return key - D
            heapq.heappop(heap)
        return None

    def unfinished_penalty(self, D: int) -> float:
        """Reward term: sum over residents of (1/T_j)(1 - f_j), f_j = generated / predicted output."""
        return self.inv_T_sum - (self.fT_static + self.fT_A + self.fT_W * D)

    def generated_at(self, r: SimRequest, D: int) -> int:
        """Tokens ``r`` has generated when the instance's decode counter is ``D``."""
        if r.state == DECODE:
            return r.gen_base + D - r.dec_base
        return r.generated
