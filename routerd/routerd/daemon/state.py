"""Per-instance bookkeeping: what routerd knows about each serving instance.

Two sources are merged into the :class:`~routerd.policies.base.InstanceView` a policy
decides on (as Dynamo and llm-d do; scraped metrics alone lag by 50 ms to 30 s):

* routerd's own record of the requests it dispatched there and has not seen finish:
  prompt tokens, predicted decode bucket, tokens generated so far (counted from the
  stream) and whether the first token arrived (a request without it is waiting or
  prefilling);
* the latest snapshot from the instance's state sidecar (``vllm:num_requests_running``,
  ``..._waiting``, ``vllm:kv_cache_usage_perc``), used while it is younger than the
  staleness age. A stale or missing snapshot leaves routerd's own bookkeeping.

The request record and its incremental aggregates (what keeps a decision O(1) per
instance) are in :mod:`routerd.daemon.bookkeeping`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import urlsplit

from routerd.daemon.bookkeeping import Inflight, RequestBook
from routerd.daemon.prefix import EngineKeyed

if TYPE_CHECKING:
    from routerd.profiles import HardwareProfile

__all__ = ["EndpointState", "Inflight", "url_target"]


def url_target(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, path prefix) of a base URL (port defaults to 80/443)."""
    u = urlsplit(url)
    port = u.port or (443 if u.scheme == "https" else 80)
    return u.scheme, u.hostname or "", port, u.path.rstrip("/")


class EndpointState(RequestBook):
    """One instance: identity, readiness, own bookkeeping, sidecar snapshot; an ``InstanceView``.

    ``num_running``, ``num_waiting`` and ``kv_used_blocks`` are plain attributes that
    :meth:`refresh` sets right before each decision. The request events (``add``,
    ``on_first_token``, ``on_tokens``, ``remove``) and the aggregates policies read
    (``load_summary``, ``outstanding_tokens``, ``waiting_kv_blocks``) come from
    :class:`~routerd.daemon.bookkeeping.RequestBook`.

    With a fresh snapshot (``s``) taken when routerd had ``n0`` requests there and has
    ``n`` now, ``d = n - n0`` requests arrived (d > 0, counted as waiting) or finished
    (d < 0, taken off the running count) since; KV usage is the snapshot's. Without one,
    the first ``profile.max_num_seqs`` of routerd's requests count as running and the rest
    as waiting (vLLM admits up to ``max_num_seqs``), and the KV in use is the blocks of
    their prompt + generated tokens.
    """

    def __init__(self, index: int, name: str, url: str, state_address: str | None, ready: bool,
                 profile: "HardwareProfile") -> None:
        super().__init__(profile.block_size)
        self.index = index
        self.name = name
        self.url = url
        self.target = url_target(url)
        """(scheme, host, port, path prefix) of ``url`` for the upstream pool."""
        self.state_address = state_address
        self.kv_events: str | None = None
        """ZMQ address of its vLLM KV-event publisher (``DiscoveredEndpoint.kv_events``, resolved),
        or None; read in ``prefix.mode: precise``."""
        self.engine_index: Any = None
        """Its :class:`~routerd.prefix.engine_index.EngineBlockIndex` (precise mode, fed by the
        daemon's KV-event subscriber), or None."""
        self.on_prefix_fallback: Any = None
        """Called with a reason when its engine index cannot answer (``phasewise_prefix_fallbacks_total``)."""
        self.pending: OrderedDict[int, float] = OrderedDict()
        """Precise mode: engine-block keys of prompts dispatched here whose ``BlockStored`` events may
        not have come yet, with the monotonic time until which they count as cached (see
        :meth:`note_pending`)."""
        self.clock: Callable[[], float] = time.monotonic
        """The router's clock (s), for :attr:`pending`'s expiry."""
        self.ready = ready
        self.removed = False
        """Gone from the endpoint source: no new requests, dropped once its requests finish."""
        self.set_profile(profile)
        self.num_waiting = 0
        self.kv_used_blocks = 0
        self.snapshot: Any = None
        """Latest ``InstanceState`` from the sidecar, or None."""
        self.snapshot_at = -1e18
        self._own_at_snapshot = 0
        self.down_until = 0.0
        """Monotonic time until which a failed connect keeps new requests away."""
        self.connect_failures = 0
        self.consecutive_errors = 0
        """Failed requests in a row (connect, timeout, 5xx, broken stream); a success resets it."""
        self.ejections = 0
        """Ejections in a row: the next lasts this many + 1 base ejection times."""
        self.ejected_until = 0.0
        """Monotonic time until which passive health checking keeps new requests away."""
        self.probation = False
        """Back from an ejection without a success yet: one failure ejects it again."""
        self.idle_since = 0.0
        self.configured_models: frozenset[str] = frozenset()
        """Models its source says it serves (config ``endpoints[].models``)."""
        self.discovered_models: frozenset[str] | None = None
        """Models its own ``/v1/models`` listed at the last refresh; None before one succeeded."""
        self.models_pending = False
        """A read of its ``/v1/models`` is awaited (it joined, moved to another URL or lost its
        configured models) and has not been answered: until then it serves only its sidecar's
        names, whatever the number of models (see ``Router._rebuild_models``)."""
        self.m: Any = None
        """Pre-resolved metric children (:class:`routerd.daemon.metrics.EndpointMetrics`)."""

    def set_profile(self, profile: "HardwareProfile") -> None:
        """Its hardware profile (``endpoints[].profile`` or routerd's): the KV blocks and batch
        limit its view reports, and ``PolicyContext.profiles`` at its index. The block size is
        routerd's, one for all (checked at configuration)."""
        self.profile = profile
        self.kv_total_blocks = max(1, profile.num_blocks)
        self.max_num_seqs = profile.max_num_seqs

    @property
    def models(self) -> frozenset[str] | None:
        """Every model it is known to serve (configured, listed by ``/v1/models``, reported by its
        sidecar), or None when nothing is known yet."""
        known = self.configured_models
        if self.discovered_models is not None:
            known = known | self.discovered_models
        s = self.snapshot
        if s is not None and s.models:
            known = known | frozenset(s.models)
        if known or self.discovered_models is not None:
            return known
        return None

    def engine_cached_blocks(self, prefix: Any) -> int | None:
        """Leading blocks of ``prefix`` its engine caches, from its KV events
        (``routerd.prefix.index.engine_cached_blocks`` asks, in precise mode), in this view's blocks
        (``block_size``, the profile's), or None: no event index, a prefix not keyed from token ids
        (``routerd.daemon.prefix.EngineKeyed``: text chunks never match engine keys), or a stale
        index (counted with its reason). None makes the policy use its approximate index for this
        endpoint. The engine's own block size may differ (vLLM's CPU build caches in blocks of 128):
        its index answers in its blocks, converted here through tokens (rounded down)."""
        idx = self.engine_index
        if idx is None:
            return None  # approximate mode: asked of every candidate, so answered first
        if not isinstance(prefix, EngineKeyed):
            return None  # engine_match's answer, without its frame: this runs per candidate
        # Before the engine's first stored block its size is unknown: its (empty) index answers in
        # the request's own blocks.
        ebs = idx.block_size or prefix.block_size
        keyed = prefix if ebs == prefix.block_size else prefix.at(ebs)
        n = idx.cached_blocks(keyed)
        if n is None:
            if self.on_prefix_fallback is not None:
                self.on_prefix_fallback(idx.stale_reason or "stale")
            return None
        if self.pending:
            n = self._with_pending(keyed, n)
        return n if ebs == self.block_size else n * ebs // self.block_size

    # -- blocks on their way (precise mode) -----------------------------------------------------------
    #: Longest a dispatched prompt's blocks count as cached without their events (s), and how long
    #: after its request ended (s): vLLM publishes a step's ``BlockStored`` right after the step
    #: (``vllm/v1/core/sched/scheduler.py``, ``update_from_output``), so events are due by the
    #: first token; the grace covers their way through ZMQ and this event loop.
    PENDING_MAX_S = 60.0
    PENDING_GRACE_S = 2.0
    #: Most keys kept (the oldest go first): a bound on memory whatever the traffic.
    PENDING_MAX_KEYS = 65_536

    def note_pending(self, keys: list[int], until: float | None = None) -> None:
        """Prompt blocks (keys in the engine's block size) of a request dispatched here: they count as
        cached here until ``until`` (default: :attr:`PENDING_MAX_S` from now) or its events say
        otherwise. Without this, a request sharing a prefix with one dispatched a moment earlier
        (a burst on one system prompt, a client's quick next turn) finds nothing in the engine
        index, whose ``BlockStored`` events have not arrived yet, and is routed on load alone
        (seen on real vLLM: a repeat sent as soon as its first answer came found 0 estimated where
        vLLM had 256 tokens cached)."""
        p = self.pending
        now = self.clock()
        while p and next(iter(p.values())) <= now:  # the oldest noted first: drop what expired
            p.popitem(last=False)
        t = now + self.PENDING_MAX_S if until is None else until
        for k in keys:
            p[k] = t
            p.move_to_end(k)
        while len(p) > self.PENDING_MAX_KEYS:
            p.popitem(last=False)

    def end_pending(self, keys: list[int]) -> None:
        """The request whose blocks these are ended: its events have come or will within
        :attr:`PENDING_GRACE_S`; after that only the engine index speaks for them."""
        p = self.pending
        t = self.clock() + self.PENDING_GRACE_S
        for k in keys:
            if p.get(k, 0.0) > t:
                p[k] = t

    def _with_pending(self, keyed: Any, n: int) -> int:
        """``n`` (the engine index's leading run, in engine blocks) extended over keys still pending."""
        p = self.pending
        ext = keyed.extents
        now = self.clock()
        while n < len(ext):
            t = p.get(ext[n][0])
            if t is None:
                break
            if t <= now:
                del p[ext[n][0]]
                break
            n += 1
        return n


    def on_first_token(self, r: Inflight) -> None:
        """:meth:`RequestBook.on_first_token`, and in precise mode: ``r``'s new blocks are now
        computed, so their KV events are due; if no batch at all came since its dispatch, the
        index's ``silent`` clock starts (a request the engine refused never gets here, so it
        does not make a live publisher look silent)."""
        idx = self.engine_index
        if (not r.first_token and not r.done and r.uncached_blocks > 0 and idx is not None
                and idx.batches_applied == r.kv_batches):
            idx.note_dispatch(r.uncached_blocks)
        super().on_first_token(r)

    def engine_match(self, prefix: Any) -> int | None:
        """Prompt tokens of ``prefix`` its engine caches (tokens, whole engine blocks), for routerd's
        own bookkeeping at dispatch; None: no engine index, not engine-keyed, or stale. Not counted
        as a policy's fallback (``phasewise_prefix_fallbacks_total`` counts the policies' queries)."""
        idx = self.engine_index
        if idx is None or not isinstance(prefix, EngineKeyed):
            return None
        ebs = idx.block_size or prefix.block_size  # unknown before the engine's first stored block
        keyed = prefix if ebs == prefix.block_size else prefix.at(ebs)
        n = idx.cached_blocks(keyed)
        if n is None:
            return None
        if self.pending:
            n = self._with_pending(keyed, n)
        return n * ebs

    @property
    def kv_usage(self) -> float:
        """Used / total KV blocks, 0..1."""
        return self.kv_used_blocks / self.kv_total_blocks

    # -- sidecar state -----------------------------------------------------------
    def set_snapshot(self, state: Any, now: float) -> None:
        """Store a sidecar ``InstanceState`` received at ``now``."""
        self.snapshot = state
        self.snapshot_at = now
        self._own_at_snapshot = len(self.requests)

    def sidecar_unhealthy(self, now: float, max_age_s: float) -> bool:
        """True while its sidecar's latest snapshot, younger than ``max_age_s`` (s), says the engine is
        unhealthy (``healthy=False``: the sidecar's scrape of vLLM's ``/metrics`` failed: refused,
        timed out, not 200, not a metrics page; ``routerd.sidecar.scraper``). Such an endpoint is not
        ready (``Router.is_ready``). An older one says nothing any more (the sidecar itself is gone or
        silent): the endpoint is then only stale, as without a sidecar, and passive health judges it."""
        s = self.snapshot
        return (self.state_address is not None and s is not None and not s.healthy
                and now - self.snapshot_at <= max_age_s)

    def is_stale(self, now: float, max_age_s: float) -> bool:
        """True when the instance has a sidecar whose latest healthy snapshot is older than ``max_age_s``."""
        if self.state_address is None:
            return False
        s = self.snapshot
        return s is None or not s.healthy or now - self.snapshot_at > max_age_s

    def refresh(self, now: float, max_age_s: float) -> bool:
        """Set the view's counts for a decision at ``now``; returns :meth:`is_stale`."""
        self._residents = None
        n = len(self.requests)
        s = self.snapshot
        if self.state_address is not None and s is not None and s.healthy and now - self.snapshot_at <= max_age_s:
            running = int(s.num_requests_running)
            waiting = int(s.num_requests_waiting)
            d = n - self._own_at_snapshot
            if d > 0:
                waiting += d
            elif d < 0:
                running += d
                if running < 0:
                    waiting = max(0, waiting + running)
                    running = 0
            self.num_running = running
            self.num_waiting = waiting
            used = int(s.kv_cache_usage * self.kv_total_blocks + 0.5)
            stale = False
        else:
            ms = self.max_num_seqs
            self.num_running = n if n < ms else ms
            self.num_waiting = n - self.num_running
            used = -(-self._sum_tokens // self.block_size)
            stale = self.state_address is not None
        total = self.kv_total_blocks
        self.kv_used_blocks = used if 0 <= used <= total else (0 if used < 0 else total)
        return stale
