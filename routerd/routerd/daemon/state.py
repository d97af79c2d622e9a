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

Aggregates for :meth:`EndpointState.load_summary` are kept incrementally, so a decision
reads each instance in O(1) (the per-decision budget is 100 µs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from routerd.policies.base import LoadSummary, ResidentRequest, load_bin

if TYPE_CHECKING:
    from routerd.profiles import HardwareProfile


def url_target(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, path prefix) of a base URL (port defaults to 80/443)."""
    u = urlsplit(url)
    port = u.port or (443 if u.scheme == "https" else 80)
    return u.scheme, u.hostname or "", port, u.path.rstrip("/")


class Inflight:
    """One request routerd dispatched to an instance and has not seen finish.

    Token counts are in tokens; times are ``time.monotonic()`` seconds.
    """

    __slots__ = ("rid", "label", "prompt_tokens", "predicted_bucket", "predicted_output", "load_bin",
                 "generated", "first_token", "endpoint", "dispatched_at", "arrived_at", "group", "done",
                 "features", "exclude", "enqueued_at", "waiter", "error", "fallback")

    def __init__(self, rid: int, label: Any, prompt_tokens: int, predicted_bucket: int | None,
                 predicted_output: float, arrived_at: float) -> None:
        self.rid = rid
        self.label = label
        """Request id shown in decision records: an int for HTTP, the caller's string for gRPC."""
        self.prompt_tokens = prompt_tokens
        self.predicted_bucket = predicted_bucket
        self.predicted_output = predicted_output
        """Point estimate of the output length from the predicted bucket (tokens)."""
        self.load_bin = load_bin(predicted_output)
        self.generated = 0
        """Output tokens counted so far."""
        self.first_token = False
        self.endpoint: EndpointState | None = None
        self.dispatched_at = 0.0
        self.arrived_at = arrived_at
        self.group: _DecodeGroup | None = None
        self.done = False
        # Router-queue fields (set by the router).
        self.features: Any = None
        self.exclude: Any = frozenset()
        self.enqueued_at = arrived_at
        self.waiter: Any = None
        self.error: Any = None
        self.fallback = False

    def reset_for_retry(self) -> None:
        """Forget the failed attempt (the request was released from its endpoint) before re-dispatch."""
        self.endpoint = None
        self.done = False
        self.generated = 0
        self.first_token = False
        self.group = None


class _DecodeGroup:
    """Decoding requests sharing one predicted output length, for the smallest predicted remaining.

    ``min over members of (predicted - generated) = predicted - max generated``; the
    maximum only grows while members decode, and is rescanned lazily after the member
    holding it leaves.
    """

    __slots__ = ("predicted", "members", "max_generated", "dirty")

    def __init__(self, predicted: float) -> None:
        self.predicted = predicted
        self.members: dict[int, Inflight] = {}
        self.max_generated = 0
        self.dirty = False

    def max_gen(self) -> int:
        if self.dirty:
            self.max_generated = max((r.generated for r in self.members.values()), default=0)
            self.dirty = False
        return self.max_generated


class EndpointState:
    """One instance: identity, readiness, own bookkeeping, sidecar snapshot; an ``InstanceView``.

    ``num_running``, ``num_waiting`` and ``kv_used_blocks`` are plain attributes that
    :meth:`refresh` sets right before each decision.

    With a fresh snapshot (``s``) taken when routerd had ``n0`` requests there and has
    ``n`` now, ``d = n - n0`` requests arrived (d > 0, counted as waiting) or finished
    (d < 0, taken off the running count) since; KV usage is the snapshot's. Without one,
    the first ``profile.max_num_seqs`` of routerd's requests count as running and the rest
    as waiting (vLLM admits up to ``max_num_seqs``), and the KV in use is the blocks of
    their prompt + generated tokens.
    """

    def __init__(self, index: int, name: str, url: str, state_address: str | None, ready: bool,
                 profile: "HardwareProfile") -> None:
        self.index = index
        self.name = name
        self.url = url
        self.target = url_target(url)
        """(scheme, host, port, path prefix) of ``url`` for the upstream pool."""
        self.state_address = state_address
        self.ready = ready
        self.removed = False
        """Gone from the endpoint source: no new requests, dropped once its requests finish."""
        self.block_size = profile.block_size
        self.kv_total_blocks = max(1, profile.num_blocks)
        self.max_num_seqs = profile.max_num_seqs
        self.requests: dict[int, Inflight] = {}
        self.num_running = 0
        self.num_waiting = 0
        self.kv_used_blocks = 0
        self._n_prefill = 0
        self._bins = [0, 0, 0]
        self._sum_pred = 0.0
        self._sum_tokens = 0
        self._groups: dict[float, _DecodeGroup] = {}
        self._residents: list[ResidentRequest] | None = None
        self.snapshot: Any = None
        """Latest ``InstanceState`` from the sidecar, or None."""
        self.snapshot_at = -1e18
        self._own_at_snapshot = 0
        self.down_until = 0.0
        """Monotonic time until which a failed connect keeps new requests away."""
        self.connect_failures = 0
        self.idle_since = 0.0
        self.m: Any = None
        """Pre-resolved metric children (:class:`routerd.daemon.metrics.EndpointMetrics`)."""

    # -- InstanceView ------------------------------------------------------------
    @property
    def kv_usage(self) -> float:
        """Used / total KV blocks, 0..1."""
        return self.kv_used_blocks / self.kv_total_blocks

    def residents(self) -> list[ResidentRequest]:
        """routerd's requests here, running first then waiting (O(requests)).

        Built once per decision (:meth:`refresh` starts a new one): policies such as
        ``late_binding`` read it several times per instance.
        """
        cached = self._residents
        if cached is not None:
            return cached
        running: list[ResidentRequest] = []
        waiting: list[ResidentRequest] = []
        slots = self.num_running - sum(1 for r in self.requests.values() if r.first_token)
        for r in self.requests.values():
            if r.first_token:
                running.append(ResidentRequest(r.prompt_tokens, r.generated, r.predicted_bucket,
                                               r.predicted_output, False, False))
            elif slots > 0:
                slots -= 1
                running.append(ResidentRequest(r.prompt_tokens, r.generated, r.predicted_bucket,
                                               r.predicted_output, True, False))
            else:
                waiting.append(ResidentRequest(r.prompt_tokens, r.generated, r.predicted_bucket,
                                               r.predicted_output, True, True))
        self._residents = running + waiting
        return self._residents

    def load_summary(self) -> LoadSummary:
        """Aggregates of :meth:`residents` in O(distinct predicted lengths)."""
        min_rem: float | None = None
        for g in self._groups.values():
            if g.members:
                rem = g.predicted - g.max_gen()
                if min_rem is None or rem < min_rem:
                    min_rem = rem
        b = self._bins
        return LoadSummary(self._n_prefill, (b[0], b[1], b[2]), min_rem, len(self.requests), self._sum_pred)

    # -- bookkeeping -------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Requests routerd dispatched here that have not finished."""
        return len(self.requests)

    def add(self, r: Inflight, now: float) -> None:
        """Record ``r`` as dispatched here at ``now``."""
        r.endpoint = self
        r.dispatched_at = now
        self.requests[r.rid] = r
        self._n_prefill += 1
        self._sum_pred += r.prompt_tokens + r.predicted_output
        self._sum_tokens += r.prompt_tokens

    def on_first_token(self, r: Inflight) -> None:
        """``r`` produced its first token: it moves from prefill to decode."""
        if r.first_token or r.done:
            return
        r.first_token = True
        self._n_prefill -= 1
        self._bins[r.load_bin] += 1
        g = self._groups.get(r.predicted_output)
        if g is None:
            g = self._groups[r.predicted_output] = _DecodeGroup(r.predicted_output)
        g.members[r.rid] = r
        r.group = g
        if r.generated > g.max_generated:
            g.max_generated = r.generated

    def on_tokens(self, r: Inflight, n: int) -> None:
        """``n`` more output tokens of ``r`` were seen."""
        if r.done:
            return
        r.generated += n
        self._sum_tokens += n
        g = r.group
        if g is not None and r.generated > g.max_generated:
            g.max_generated = r.generated

    def remove(self, r: Inflight) -> bool:
        """Forget ``r`` (finished, failed or cancelled); False if it was not here."""
        if r.done or self.requests.pop(r.rid, None) is None:
            return False
        r.done = True
        self._sum_pred -= r.prompt_tokens + r.predicted_output
        self._sum_tokens -= r.prompt_tokens + r.generated
        if r.first_token:
            self._bins[r.load_bin] -= 1
            g = r.group
            if g is not None:
                del g.members[r.rid]
                if r.generated >= g.max_generated:
                    g.dirty = True
        else:
            self._n_prefill -= 1
        if not self.requests:
            # Reset the float sum so rounding errors cannot accumulate over a long run.
            self._sum_pred = 0.0
            self._sum_tokens = 0
        return True

    # -- sidecar state -----------------------------------------------------------
    def set_snapshot(self, state: Any, now: float) -> None:
        """Store a sidecar ``InstanceState`` received at ``now``."""
        self.snapshot = state
        self.snapshot_at = now
        self._own_at_snapshot = len(self.requests)

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
