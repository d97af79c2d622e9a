"""Real-time engines behind the emulator: when each output token of each request exists.

Two engines with one interface (:class:`Engine`), both pure of HTTP:

* :class:`SimEngine` drives the foundation's instance simulator
  (:class:`routerd.sim.instance.SimInstance`, vLLM V1 scheduling: continuous batching,
  KV blocks, preemption by recompute) with the event loop's clock as simulated time.
  Token ``k`` of a request exists at the wall time the simulator's iteration that
  produces it ends. One timer per engine iteration drives it: at each iteration end
  every running request's token count is read from the simulator (inside a decode
  segment, ``gen_base + D + j - dec_base``), so the cost is one callback per
  iteration plus one cheap check per running request, never one timer per token.
* :class:`FixedTimingEngine` gives every request the same time to first token and
  time per output token whatever the load (for load benchmarks of the router, where
  the backend must not be the variable). One timer for the earliest due token of all
  requests (a heap), again never a timer per request.

Timers: ``phasewise emulate`` runs on uvloop, whose timers are rounded to
milliseconds and may fire up to 0.5 ms before their deadline; the iteration is
still applied at its exact simulated time, so a token can leave up to 0.5 ms early.
Simulated time never runs backwards for later calls (see ``SimEngine._time``).

The HTTP layer consumes a :class:`TokenStream` per request: either it sets
``stream.sink`` (called with the token count once the engine's callback that produced
tokens has returned) or it awaits ``stream.wait(sent)``, which returns once more than
``sent`` tokens exist or the request has ended.

Coalescing, as vLLM's API server: vLLM's ``RequestOutputCollector``
(``vllm/v1/engine/output_processor.py``) merges a request's outputs while its consumer is
behind, and the server sends everything pending as one SSE event per wake-up, so a
stream may carry several tokens per event (a real 64-token stream came as 31-63 events).
Here tokens accumulate per stream and one ``loop.call_soon`` callback per burst hands
each dirty stream's sink its new count: when the loop keeps up, every engine iteration
is a timer callback of its own and each event holds one token; when the loop is late
(loaded, or iterations shorter than the timer's millisecond resolution) the iterations
applied in one callback reach the client as one event.

Prefix caching (vLLM V1's automatic prefix caching, on unless the profile or
``--no-enable-prefix-caching`` turns it off): :class:`SimEngine` gives each request the
prefix identity of its prompt's token ids (:func:`routerd.prefix.text.token_prefix_blocks`,
one key per full block of ``block_size`` tokens, the LoRA adapter's name and the request's
``cache_salt`` mixed in as vLLM's extra keys, :func:`routerd.prefix.text.request_extra_keys`,
so an adapter's or a salted request shares no block with the base model's), and the
simulator's prefix cache
(:mod:`routerd.prefix.cache`) does the rest: the longest cached prefix of whole blocks is
reused (the last prompt token is always computed), its prefill skipped, counted in
``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries`` (tokens, at a request's first
admission). Only prompt blocks have identity: the blocks holding generated tokens (and the
block that straddles the prompt's end) are never cached, unlike vLLM, which caches full
output blocks too. The emulator's output is filler words, one "token" each, with no token
ids of the byte tokenizer a later prompt could share: a later turn that resends an answer
renders it as text (``assistant: ...``), whose blocks are new prompt blocks anyway.
:class:`FixedTimingEngine` has no cache.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

from routerd.prefix.kv_wire import AllBlocksCleared
from routerd.prefix.text import request_extra_keys, token_prefix_blocks
from routerd.profiles import HardwareProfile
from routerd.sim.instance import SimInstance
from routerd.sim.request import DECODE, DONE, SimRequest

if TYPE_CHECKING:
    from routerd.emulator.kv_events import ZmqEventPublisher

#: Slack (s) added to a timer's own deadline when it fires: the simulator locates
#: iteration ends with floating-point sums, and a 1 ns margin guarantees the iteration
#: the timer was armed for counts as done.
_EPS = 1e-9


class TokenStream:
    """One request inside an engine: its token count and lifecycle times (event-loop seconds)."""

    __slots__ = ("id", "prompt_tokens", "max_tokens", "arrival_s", "first_token_s", "last_token_s",
                 "finish_s", "generated", "done", "aborted", "sink", "_waiter", "_wake_at", "_sim", "_dirty")

    def __init__(self, id: int, prompt_tokens: int, max_tokens: int, arrival_s: float) -> None:
        self.id = id
        self.prompt_tokens = prompt_tokens
        """Prompt length (tokens)."""
        self.max_tokens = max_tokens
        """Output length (tokens): the request ends after exactly this many (vLLM ``ignore_eos``)."""
        self.arrival_s = arrival_s
        self.first_token_s = -1.0
        self.last_token_s = -1.0
        self.finish_s = -1.0
        self.generated = 0
        """Output tokens that exist so far."""
        self.done = False
        """True once all ``max_tokens`` exist or the request was aborted."""
        self.aborted = False
        self.sink: Callable[[int], None] | None = None
        """When set, called with ``generated`` once per engine callback that produced tokens
        (all of them at once: see the module docstring on coalescing), instead of waking
        :meth:`wait` (a streaming response writes them out at once; waking a task per token
        cost about a third of the emulator's CPU)."""
        self._waiter: asyncio.Future[None] | None = None
        self._wake_at = 1
        self._sim: SimRequest | None = None
        self._dirty = False

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache at its first admission (vLLM's
        ``num_cached_tokens``, ``usage.prompt_tokens_details.cached_tokens``); 0 before it or
        without a prefix cache."""
        r = self._sim
        return r.cached_tokens if r is not None and r.cached_tokens > 0 else 0

    async def wait(self, sent: int) -> int:
        """Wait until more than ``sent`` tokens exist or the request ended; returns ``generated``."""
        if self.generated <= sent and not self.done:
            self._wake_at = sent + 1
            await self._park()
        return self.generated

    async def wait_done(self) -> None:
        """Wait until the request has ended (all tokens, or aborted); wakes once, not per token."""
        if not self.done:
            self._wake_at = self.max_tokens + 1  # only the end wakes it
            await self._park()

    async def _park(self) -> None:
        fut = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await fut
        finally:
            self._waiter = None

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)


class EngineObserver(Protocol):
    """Receives request-level timings (seconds of the event loop's clock) for metrics."""

    def first_token(self, s: TokenStream, t: float) -> None:
        """The first output token of ``s`` exists at ``t`` (TTFT = ``t - s.arrival_s``)."""

    def token(self, s: TokenStream, gap_s: float) -> None:
        """Another output token of ``s`` exists, ``gap_s`` after the previous one (inter-token latency)."""

    def finished(self, s: TokenStream, t: float) -> None:
        """``s`` produced its last token at ``t``."""


@dataclass
class EngineStats:
    """What an engine reports on ``/metrics`` (vLLM V1 scheduler and iteration stats)."""

    running: int = 0
    """Requests in the running batch (prefilling or decoding)."""
    waiting: int = 0
    """Requests waiting for admission, including preempted ones."""
    kv_usage: float = 0.0
    """Used / total KV-cache blocks (0..1)."""
    preemptions: int = 0
    prompt_tokens: int = 0
    """Prompt tokens of requests whose prefill completed (counted once per request)."""
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {"length": 0, "abort": 0})
    """Ended requests by vLLM finish reason."""
    prefix_queries: int = 0
    """Prompt tokens looked up in the prefix cache (``vllm:prefix_cache_queries``, tokens)."""
    prefix_hits: int = 0
    """Of those, tokens found cached (``vllm:prefix_cache_hits``, tokens)."""


class Engine(Protocol):
    """The interface the HTTP layer uses; see :class:`SimEngine` and :class:`FixedTimingEngine`."""

    prefix_caching: bool
    """True when :meth:`submit` uses the prompt's token ids (automatic prefix caching is on)."""
    block_size: int
    """KV block size (tokens)."""

    def submit(self, prompt_tokens: int, max_tokens: int, tokens: np.ndarray | None = None,
               lora: tuple[str, int] | None = None, cache_salt: str | None = None) -> TokenStream:
        """Start a request of ``prompt_tokens`` prompt tokens that generates ``max_tokens`` tokens.

        ``tokens``: the prompt's token ids (uint32, ``len == prompt_tokens``) when
        :attr:`prefix_caching`, for its prefix identity; None: no identity (never a hit).
        ``lora``: ``(name, id)`` of its LoRA adapter (None: the base model); ``cache_salt``: the
        request's salt. Both go into its blocks' identity (vLLM's extra keys).
        """

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (``POST /reset_prefix_cache``); False while requests hold blocks."""

    def abort(self, s: TokenStream) -> None:
        """The client went away: stop ``s`` and free what it holds (no-op once it ended)."""

    def stats(self) -> EngineStats:
        """Counters and gauges as of now."""

    def close(self) -> None:
        """Cancel the engine's timer."""


class _EmuRequest(SimRequest):
    __slots__ = ("stream", "keys")


class _EngineBase(ABC):
    """Shared bookkeeping: token delivery, request ends, counters and the one timer."""

    def __init__(self, observer: EngineObserver | None) -> None:
        self._loop = asyncio.get_running_loop()
        self._observer = observer
        self._timer: asyncio.TimerHandle | None = None
        self._timer_t = 0.0
        self._ids = itertools.count()
        self._stats = EngineStats()
        self._dirty: list[TokenStream] = []  # streams with a sink and tokens not yet handed to it

    def _tokens(self, s: TokenStream, n: int, t: float) -> None:
        """``s`` has ``n`` tokens at ``t`` (``n > s.generated``)."""
        obs = self._observer
        new = n - s.generated
        self._stats.generation_tokens += new
        if s.generated == 0:
            s.first_token_s = t
            self._stats.prompt_tokens += s.prompt_tokens
            if obs is not None:
                obs.first_token(s, t)
        elif obs is not None:
            obs.token(s, t - s.last_token_s)
            for _ in range(new - 1):
                obs.token(s, 0.0)
        s.generated = n
        s.last_token_s = t
        if s.sink is not None:
            if not s._dirty:
                s._dirty = True
                if not self._dirty:
                    self._loop.call_soon(self._flush)
                self._dirty.append(s)
        elif n >= s._wake_at:
            s._wake()

    def _flush(self) -> None:
        """Hand each stream's sink everything produced since its last call (one SSE event each).

        Runs once per burst of engine callbacks (``call_soon``), before any handler the same
        callbacks woke: a stream's last tokens are written before its end is.
        """
        dirty, self._dirty = self._dirty, []
        for s in dirty:
            s._dirty = False
            sink = s.sink
            if sink is not None:
                sink(s.generated)

    def _end(self, s: TokenStream, t: float) -> None:
        s.done = True
        s.finish_s = t
        self._stats.finished["length"] += 1
        if self._observer is not None:
            self._observer.finished(s, t)
        s._wake()

    def _abort_stream(self, s: TokenStream, now: float) -> None:
        s.done = s.aborted = True
        s.finish_s = now
        self._stats.finished["abort"] += 1
        s._wake()

    def _snapshot(self, running: int, waiting: int, kv_usage: float, preemptions: int, prefix_queries: int = 0,
                  prefix_hits: int = 0) -> EngineStats:
        st = self._stats
        return EngineStats(running, waiting, kv_usage, preemptions, st.prompt_tokens, st.generation_tokens,
                           dict(st.finished), prefix_queries, prefix_hits)

    def _set_timer(self, t: float | None) -> None:
        """Keep exactly one timer, at ``t`` (None: none)."""
        if self._timer is not None:
            if t is not None and self._timer_t == t:
                return
            self._timer.cancel()
            self._timer = None
        if t is not None:
            self._timer_t = t
            self._timer = self._loop.call_at(t, self._tick)

    @abstractmethod
    def _tick(self) -> None:
        """The timer fired: advance the engine to now and re-arm the timer."""

    def close(self) -> None:
        """Cancel the pending timer (the engine is unusable afterwards)."""
        self._set_timer(None)


class SimEngine(_EngineBase):
    """Real-time driver of one simulated vLLM instance (see the module docstring).

    Must be created and used inside a running event loop. Requests are validated by
    the caller (prompt + output <= ``profile.max_model_len``, which the profile
    guarantees fits the KV cache), so nothing is raised at run time.

    Args:
        profile: the hardware profile; its ``prefix_caching`` turns the prefix cache on.
        observer: receives request timings (the metrics).
        kv_events: publisher of vLLM's KV-cache events (:mod:`routerd.emulator.kv_events`), or
            None; one batch per engine step that changed the cache.
    """

    def __init__(self, profile: HardwareProfile, observer: EngineObserver | None = None,
                 kv_events: "ZmqEventPublisher | None" = None) -> None:
        super().__init__(observer)
        self.profile = profile
        self.inst = SimInstance(0, profile, self._on_event, self._on_first_token, self._on_finish)
        self.prefix_caching = self.inst.pc is not None
        self.bs = self.block_size = profile.block_size
        self._publisher = kv_events
        self._tracker = None
        if kv_events is not None and self.inst.pc is not None:
            from routerd.emulator.kv_events import BlockTracker

            self._tracker = BlockTracker(self.bs)
            self.inst.pc.listener = self._tracker
        self._leaving: list[_EmuRequest] = []  # aborted, tracked, not yet out of the cache
        self._j = 0  # iterations of the step or segment in flight already delivered
        self._ended: list[_EmuRequest] = []
        # Latest simulated time applied. A timer may fire a little before its deadline
        # (uvloop rounds to milliseconds) and its iteration is applied at the deadline;
        # later calls must not pass the simulator an earlier time, or a segment would be
        # cut behind iterations already delivered.
        self._now = 0.0

    # -- simulator callbacks (the timer is re-armed after every call into the instance)
    def _on_event(self, t: float, inst: SimInstance) -> None:
        pass

    def _on_first_token(self, r: SimRequest, t: float) -> None:
        pass

    def _on_finish(self, r: SimRequest, t: float) -> None:
        self._ended.append(r)  # type: ignore[arg-type]

    # -- driving
    def _advance(self, now: float) -> None:
        """Apply every iteration that has ended by ``now``, delivering tokens per iteration."""
        inst = self.inst
        if now > self._now:
            self._now = now
        while inst.busy:
            done = inst.iterations_done_at(now)
            for j in range(self._j + 1, min(done, inst.seg_K - 1) + 1):
                self._j = j
                self._deliver(inst.iteration_end_time(j))
            if done < inst.seg_K:
                return
            t = inst.seg_end
            inst.step_end(t)
            self._j = 0
            self._deliver(t)
            if self._tracker is not None:
                self._publish()

    def _deliver(self, t: float) -> None:
        inst = self.inst
        D = inst.D + self._j
        for r in inst.running:
            n = r.gen_base + D - r.dec_base if r.state == DECODE else r.generated
            s = r.stream  # type: ignore[attr-defined]
            if n > s.generated and not s.done:
                self._tokens(s, n, t)
        if self._ended:
            for r in self._ended:
                s = r.stream  # type: ignore[attr-defined]
                if s.done:
                    continue  # aborted while its last step was in flight
                if r.output > s.generated:
                    self._tokens(s, r.output, t)
                self._end(s, t)
                if r.keys is not None:
                    self._tracker.untrack(r.keys)  # type: ignore[union-attr]
                    r.keys = None
            self._ended.clear()

    def _publish(self) -> None:
        """Publish the cache's events since the last call as one batch (one engine step's)."""
        tr = self._tracker
        assert tr is not None and self._publisher is not None
        if self._leaving:
            keep = []
            for r in self._leaving:
                if r.state == DONE and r.keys is not None:
                    tr.untrack(r.keys)
                    r.keys = None
                elif r.keys is not None:
                    keep.append(r)
            self._leaving = keep
        if tr.events:
            self._publisher.publish(tr.take())

    def _arm(self) -> None:
        inst = self.inst
        if not inst.busy:
            self._set_timer(None)
            return
        j = self._j + 1
        self._set_timer(inst.seg_end if j >= inst.seg_K else inst.iteration_end_time(j))

    def _tick(self) -> None:
        self._timer = None
        self._advance(max(self._loop.time(), self._timer_t) + _EPS)
        self._arm()

    # -- API
    def _time(self) -> float:
        """Simulated now: the loop's clock, never behind what was already applied."""
        t = self._loop.time()
        return t if t > self._now else self._now

    def submit(self, prompt_tokens: int, max_tokens: int, tokens: np.ndarray | None = None,
               lora: tuple[str, int] | None = None, cache_salt: str | None = None) -> TokenStream:
        """Enqueue a request now; the simulator admits it at its next step (see :class:`SimInstance`).

        ``tokens`` (uint32 token ids of the prompt) give it prefix identity when caching is on,
        keyed apart per LoRA adapter ``lora`` (``(name, id)``) and ``cache_salt`` as vLLM's
        block hashes are (``vllm/v1/core/kv_cache_utils.py``, ``generate_block_hash_extra_keys``).
        """
        now = self._time()
        self._advance(now)
        s = TokenStream(next(self._ids), prompt_tokens, max_tokens, now)
        r = _EmuRequest(s.id, now, prompt_tokens, max_tokens, None, float(max_tokens))
        r.stream = s
        r.keys = None
        s._sim = r
        if tokens is not None and self.prefix_caching:
            extra = request_extra_keys(lora[0] if lora else None, cache_salt, len(tokens) // self.bs)
            pb = token_prefix_blocks(tokens, self.bs, extra_keys=extra)
            r.prefix = pb
            # The sequence's extents are the prompt's alone: output blocks stay hash-less.
            r.seq_ext = pb.extents
            if self._tracker is not None:
                r.keys = [h for h, _ in pb.extents]
                self._tracker.track(r.keys, tokens, extra, lora)
        self.inst.enqueue(r, now)
        self.inst.start(now)
        if self._tracker is not None:
            self._publish()
        self._arm()
        return s

    def abort(self, s: TokenStream) -> None:
        """Abort ``s``; its KV blocks are freed at the next step boundary (:meth:`SimInstance.abort`)."""
        if s.done:
            return
        now = self._time()
        self._advance(now)
        if s.done:
            return
        self._abort_stream(s, now)
        r = s._sim
        self.inst.abort(r, now)  # type: ignore[arg-type]
        if self._tracker is not None:
            if r.keys is not None:  # type: ignore[union-attr]
                self._leaving.append(r)  # type: ignore[arg-type]
            self._publish()
        self._arm()

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache``: drop every cached block, only when no request holds a block
        (it refuses otherwise, returning False); publishes ``AllBlocksCleared`` when it succeeds."""
        now = self._time()
        self._advance(now)
        inst = self.inst
        ok = not inst.running and inst.free_blocks == inst.total_blocks
        if ok and inst.pc is not None:
            if self._tracker is not None:
                self._publish()  # anything before the reset goes out first
            ok = inst.pc.reset(inst.free_blocks)  # the tracker queues AllBlocksCleared
        if ok and self._publisher is not None:
            if self._tracker is not None:
                self._publish()
            else:
                self._publisher.publish([AllBlocksCleared()])
        self._arm()
        return ok

    def stats(self) -> EngineStats:
        """Counters and gauges at the current time (applies due iterations first)."""
        now = self._time()
        self._advance(now)
        self._arm()
        inst = self.inst
        return self._snapshot(len(inst.running), len(inst.waiting), inst.used_blocks_at(now) / inst.total_blocks,
                              inst.preemptions, inst.prefix_queries, inst.prefix_hits)


class FixedTimingEngine(_EngineBase):
    """Every request: first token ``ttft_s`` after arrival, then one token every ``tpot_s``.

    Token ``k`` (1-based) of a request that arrived at ``a`` exists at
    ``a + ttft_s + (k - 1) * tpot_s`` whatever the load. KV usage is reported as the
    blocks the resident requests' tokens would occupy in ``profile``'s cache (capped
    at 1); nothing is ever preempted or queued.
    """

    prefix_caching = False

    def __init__(self, ttft_s: float, tpot_s: float, profile: HardwareProfile,
                 observer: EngineObserver | None = None) -> None:
        super().__init__(observer)
        self.block_size = profile.block_size
        self.ttft_s = ttft_s
        self.tpot_s = tpot_s
        self.profile = profile
        self._heap: list[tuple[float, int, TokenStream]] = []
        self._active: dict[int, TokenStream] = {}

    def _tick(self) -> None:
        self._timer = None
        now = max(self._loop.time(), self._timer_t) + _EPS
        heap = self._heap
        ttft, tpot = self.ttft_s, self.tpot_s
        while heap and heap[0][0] <= now:
            t, _, s = heapq.heappop(heap)
            if s.done:
                continue
            n = s.generated + 1
            self._tokens(s, n, t)
            if n >= s.max_tokens:
                del self._active[s.id]
                self._end(s, t)
            else:
                heapq.heappush(heap, (s.arrival_s + ttft + n * tpot, s.id, s))
        self._set_timer(heap[0][0] if heap else None)

    def submit(self, prompt_tokens: int, max_tokens: int, tokens: np.ndarray | None = None,
               lora: tuple[str, int] | None = None, cache_salt: str | None = None) -> TokenStream:
        """Start a request now (no admission control; ``tokens``, ``lora``, ``cache_salt`` unused:
        no prefix cache)."""
        now = self._loop.time()
        s = TokenStream(next(self._ids), prompt_tokens, max_tokens, now)
        self._active[s.id] = s
        heapq.heappush(self._heap, (now + self.ttft_s, s.id, s))
        if self._timer is None or self._heap[0][0] < self._timer_t:
            self._set_timer(self._heap[0][0])
        return s

    def abort(self, s: TokenStream) -> None:
        """Abort ``s`` (its heap entry is skipped when it comes due)."""
        if s.done:
            return
        self._active.pop(s.id, None)
        self._abort_stream(s, self._loop.time())

    def reset_prefix_cache(self) -> bool:
        """Nothing is cached: always succeeds."""
        return True

    def stats(self) -> EngineStats:
        """Counters and gauges now."""
        p = self.profile
        blocks = sum(p.blocks_for(s.prompt_tokens + s.generated) for s in self._active.values())
        return self._snapshot(len(self._active), 0, min(1.0, blocks / p.num_blocks), 0)
