"""The decision core of routerd, free of HTTP and gRPC: router queue, policy calls, bookkeeping.

Requests wait in one bounded FIFO router queue. The policy decides on the queue head
when a request arrives, after every completion, and every ``action_interval_s`` while
requests are held (the simulator's rule, ``routerd.sim.cluster``), so a policy may hold
(``pick`` returns None; ``late_binding``, ``dqn``). Only ready endpoints are candidates: ready
by their source (config, EndpointSlice conditions) and not reported unhealthy by their sidecar
(:meth:`Router.is_ready`). Fail open: while every ready endpoint serving the model is reported
unhealthy, they are all candidates again (a sidecar whose scrapes time out under load must not
empty the pool); their state is then stale, so the request goes round robin, counted in
``phasewise_fallbacks_total{reason="stale_state"}``.

Fail open: when the policy raises, returns something that is not a candidate, or every
candidate's sidecar state is stale, the request goes round robin and
``phasewise_fallbacks_total{reason}`` counts it. A policy that keeps holding while every
candidate is idle for ``hold_idle_limit_s`` is overridden the same way.

Status codes follow llm-d-router#2046: 429 when the queue is full (back-pressure),
503 when no endpoint is ready (at once, or after ``no_endpoint_grace_s``) or while
draining.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import operator
import os
import random
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Sequence

from routerd.errors import ConfigError
from routerd.model import PREDICTOR_BUCKET_EDGES, bucket_mid_tokens
from routerd.policies.base import ClusterView, PolicyContext, RequestFeatures, RoutingPolicy
from routerd.daemon.discovery import DiscoveredEndpoint
from routerd.daemon.state import EndpointState, Inflight, url_target
from routerd.prefix.index import PrefixIndex

if TYPE_CHECKING:
    from routerd.daemon.config import OutlierConfig, PolicyConfig, RouterConfig
    from routerd.daemon.metrics import Metrics
    from routerd.prefix.chain import PrefixBlocks
    from routerd.profiles import HardwareProfile

log = logging.getLogger("routerd.router")

#: Longest connect-failure cooldown of an endpoint (s).
MAX_COOLDOWN_S = 30.0


class RejectedError(Exception):
    """A request the router will not dispatch; ``status`` is the HTTP code to answer."""

    status = 503
    reason = "unavailable"
    error_type = "service_unavailable"


class QueueFullError(RejectedError):
    """The router queue holds ``queue_limit`` requests already."""

    status = 429
    reason = "queue_full"
    error_type = "rate_limit_exceeded"


class NoEndpointError(RejectedError):
    """No endpoint is ready to take the request."""

    reason = "no_endpoint"


class DrainingError(RejectedError):
    """routerd is shutting down and takes no new requests."""

    reason = "draining"


class CheckpointConfigError(ConfigError):
    """The ``dqn`` policy's checkpoint is missing, corrupt or made for another observation layout."""


def build_routing_policy(cfg: "PolicyConfig", profile: "HardwareProfile", num_endpoints: int,
                         bucket_edges: tuple[int, ...] = PREDICTOR_BUCKET_EDGES, *, seed: int = 0,
                         near_tie: float = 0.0) -> RoutingPolicy:
    """The policy named in ``cfg`` for a cluster of ``num_endpoints`` instances, its random
    choices seeded by ``seed`` (``PolicyContext.seed``), near-ties as ``near_tie``
    (``PolicyContext.near_tie``, routerd's ``router.near_tie``).

    A ``dqn`` policy is built for its checkpoint's instance count whatever the current
    count: while the live count differs it routes round robin itself (counted in its
    ``fallbacks``) instead of refusing to start when an endpoint leaves or joins.

    Raises:
        ConfigError: unknown policy, invalid parameter (``policy: ...``);
            :class:`CheckpointConfigError` for an unusable ``dqn`` checkpoint.
    """
    from routerd.policies.registry import PolicyError, build_policy

    n = max(1, num_endpoints)
    if cfg.name == "dqn":
        from routerd.policies.dqn.checkpoint import DEFAULT_CHECKPOINT, CheckpointError, load_checkpoint

        try:
            n = load_checkpoint(str(cfg.params.get("checkpoint", DEFAULT_CHECKPOINT))).num_instances
        except CheckpointError as e:
            raise CheckpointConfigError(f"policy: dqn: {e}") from None
    ctx = PolicyContext(profile=profile, num_instances=n, seed=seed, bucket_edges=tuple(bucket_edges),
                        near_tie=near_tie)
    try:
        return build_policy(cfg.name, dict(cfg.params), ctx)
    except PolicyError as e:
        raise ConfigError(f"policy: {e}") from None


class RouterQueue:
    """The router queue: one FIFO per model (one in all while a single model is possible).

    Requests of one model are decided in arrival order; the heads of different models are
    offered oldest first, and a head the policy holds (or that waits for an endpoint) holds
    only its own model's requests. ``len`` counts every queued request (the ``queue_limit``
    and ``phasewise_router_queue_depth`` are over all models).
    """

    __slots__ = ("by_key", "n", "_seq")

    def __init__(self) -> None:
        self.by_key: dict[Any, deque[Inflight]] = {}
        self.n = 0
        self._seq = 0

    def __len__(self) -> int:
        return self.n

    def __bool__(self) -> bool:
        return self.n > 0

    def __iter__(self):
        """Every queued request, oldest first (retries, queued at a front, count as oldest)."""
        return iter(sorted((r for q in self.by_key.values() for r in q), key=lambda r: r.seq))

    def push(self, r: Inflight, key: Any, front: bool = False) -> None:
        """Queue ``r`` under ``key``, at the back (or the front: a retry keeps its turn)."""
        self._seq += 1
        q = self.by_key.get(key)
        if q is None:
            q = self.by_key[key] = deque()
        if front:
            r.seq = -self._seq
            q.appendleft(r)
        else:
            r.seq = self._seq
            q.append(r)
        self.n += 1

    def head(self, key: Any) -> Inflight | None:
        q = self.by_key.get(key)
        return q[0] if q else None

    def pop_head(self, key: Any) -> Inflight:
        q = self.by_key[key]
        r = q.popleft()
        self.n -= 1
        if not q:
            del self.by_key[key]
        return r

    def remove(self, r: Inflight) -> bool:
        """Take ``r`` out wherever it is queued; False when it is not."""
        for key, q in self.by_key.items():
            try:
                q.remove(r)
            except ValueError:
                continue
            self.n -= 1
            if not q:
                del self.by_key[key]
            return True
        return False

    def oldest_key(self, skip: set | None) -> Any:
        """The key whose head came first, among keys not in ``skip``; :data:`_NO_KEY` if none."""
        best, best_seq = _NO_KEY, 0
        for key, q in self.by_key.items():
            if skip is not None and key in skip:
                continue
            seq = q[0].seq
            if best is _NO_KEY or seq < best_seq:
                best, best_seq = key, seq
        return best

    def take_all(self) -> list[Inflight]:
        """Every queued request, oldest first, leaving the queue empty."""
        out = list(self)
        self.by_key.clear()
        self.n = 0
        return out


#: :meth:`RouterQueue.oldest_key`'s "no key".
_NO_KEY = object()

def model_seed(base_seed: int, model: str) -> int:
    """The policy seed of ``model``'s own policy: the first 4 bytes (big-endian) of the
    BLAKE2b digest of ``"<base_seed>\0<model>"``. Deterministic across processes and runs
    (unlike ``hash``), and different per model, so two models' random policies do not pick in
    lockstep."""
    return int.from_bytes(hashlib.blake2b(f"{base_seed}\0{model}".encode(), digest_size=4).digest(), "big")


class _PolicySpec:
    """A policy's registry name and parameters, as :func:`build_routing_policy` reads them."""

    __slots__ = ("name", "params")

    def __init__(self, name: str, params: dict[str, Any]) -> None:
        self.name = name
        self.params = params


#: Candidate-cache key of the models no list names (see :meth:`Router._candidates`).
_UNLISTED = object()


#: Longest model name quoted in an error message (characters): a client may send any length,
#: and a gRPC status message must fit the metadata limit (8 KiB by default; a 100 KB name
#: turned NOT_FOUND into RESOURCE_EXHAUSTED).
SHOWN_NAME_CHARS = 200


def shown_name(name: str | None, limit: int = SHOWN_NAME_CHARS) -> str:
    """``repr(name)`` for an error message, its text cut after ``limit`` characters with an
    ellipsis (``'mmm…'``) so that the message stays short whatever the client sent."""
    if name is not None and len(name) > limit:
        return repr(name[:limit] + "…")
    return repr(name)


def _no_endpoint(model: str | None) -> str:
    return "no ready endpoint" if model is None else f"no ready endpoint serves the model {shown_name(model)}"


def _as_index(choice: Any) -> int:
    """A policy's choice as an int (numpy integers are fine); -2 for anything else."""
    if isinstance(choice, bool):
        return -2
    try:
        return operator.index(choice)
    except TypeError:
        return -2


def prefix_indexes(policy: Any) -> tuple[PrefixIndex, ...]:
    """The approximate prefix indexes a policy keeps (its :class:`PrefixIndex` attributes:
    ``llmd``, ``sglang_cache_aware``, ``dynamo_kv`` and ``lmetric`` as ``index``, ``phasewise`` as
    ``_index``). A policy without one never reads ``RequestFeatures.prefix``, so routerd hashes
    no prompt for it (``tests/test_daemon_prefix.py`` checks both over the registry)."""
    attrs = getattr(policy, "__dict__", None) or {}
    return tuple(v for v in attrs.values() if isinstance(v, PrefixIndex))


class Router:
    """Router queue, endpoint table and policy; all methods run on one event loop.

    Args:
        profile: hardware profile of the instances (KV blocks, ``max_num_seqs``).
        policy: the routing policy; ``policy_name`` labels its decisions.
        metrics: the daemon's metrics.
        config: queue limit, action interval, hold and grace limits.
        state_max_age_s: sidecar snapshots older than this are stale (s).
        bucket_edges: predictor bucket edges (tokens).
        clock: monotonic clock (s).
    """

    def __init__(self, *, profile: "HardwareProfile", policy: RoutingPolicy, policy_name: str,
                 metrics: "Metrics", config: "RouterConfig", state_max_age_s: float,
                 bucket_edges: tuple[int, ...] = PREDICTOR_BUCKET_EDGES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.profile = profile
        self.policy = policy
        self.policy_name = policy_name
        self.metrics = metrics
        self.clock = clock
        self.bucket_edges = tuple(bucket_edges)
        self._mids = [bucket_mid_tokens(b, self.bucket_edges) for b in range(len(self.bucket_edges) + 1)]
        self.endpoints: list[EndpointState] = []
        self.by_name: dict[str, EndpointState] = {}
        self.queue = RouterQueue()
        self.decisions: deque[tuple] = deque(maxlen=config.decisions_kept)
        self.fallbacks_total = 0
        self.draining = False
        self._next_id = 0
        self._rr: dict[Any, int] = {}
        """Per queue key (model): the fallback round robin's last position."""
        self._tick: asyncio.TimerHandle | None = None
        self._idle_hold_since: dict[Any, float] = {}
        """Per queue key (model): since when the policy holds while every candidate is idle."""
        self._policy_fallbacks = getattr(policy, "fallbacks", None)
        self._fallback_warned_for: int | None = None
        """Ready-endpoint count for which the policy's own fallback was last logged."""
        self._idle_waiters: list[asyncio.Future] = []
        self._bad_profiles: set[tuple[str, str]] = set()
        self._profile_files: dict[str, tuple[tuple[int, int, int] | None, "HardwareProfile"]] = {}
        """Endpoint profiles by spec, with the file's stat when read (:meth:`_profile_of`)."""
        """Endpoint profiles that failed to load at runtime (each said once)."""
        self._cands: dict[Any, tuple[list[EndpointState], float, float]] | None = None
        """Per model: candidates without exclusions and the times between which they stay valid
        (see :meth:`_candidates`); None after anything they depend on changed."""
        self._model_policies: dict[str, RoutingPolicy] = {}
        """One policy per model while several are possible (:meth:`_build_model_policy`)."""
        self._fallbacks_seen: dict[str | None, Any] = {}
        self.default_models: frozenset[str] = frozenset()
        """The top-level ``models`` setting (:meth:`set_default_models`)."""
        self._several = False
        self._all: list[EndpointState] = []
        """Present (not removed) endpoints, in index order."""
        self._by_model: dict[str, list[EndpointState]] = {}
        """Per model some list or ``models`` names: the present endpoints serving it."""
        self._unlisted: list[EndpointState] = []
        """The endpoints serving a model no list names: those without a list, with one model possible."""
        self._known: frozenset[str] = frozenset()
        self._pending = False
        """Some present endpoint's list is being read (``EndpointState.models_pending``)."""
        self._models_waiters: list[asyncio.Future] = []
        """Woken when what serves which model was recomputed (:meth:`wait_models_change`)."""
        self._known_sorted: list[str] = []
        self.failure_cooldown_s = 1.0
        """First connect-failure cooldown of an endpoint (s); doubles per further failure."""
        self.outlier: "OutlierConfig | None" = None
        """Passive health settings (``upstream.outlier``); None = no ejection."""
        self.tie_seed = 0
        """Seed of the random candidate order (``router.tie_break_seed``, or drawn at start)."""
        self._tie_seed_configured = False
        self._rng: random.Random | None = None
        self.on_ready_change: Callable[[], None] | None = None
        """Called when the number of ready endpoints may have changed (health status)."""
        self.prefix_capacity_blocks: int | None = None
        """``prefix.index_capacity_blocks``: bound on every policy's approximate prefix index per
        endpoint (blocks); None: the policies' own capacities (:meth:`configure_prefix`)."""
        self._prefix_match = metrics.prefix_match_blocks.labels("approximate")
        """The policies' own indexes' beliefs; :attr:`_prefix_match_precise`: an engine's KV events."""
        self._prefix_match_precise = metrics.prefix_match_blocks.labels("precise")
        self._indexes: weakref.WeakKeyDictionary[Any, tuple[PrefixIndex, ...]] = weakref.WeakKeyDictionary()
        """Per live policy (the one, and each model's): its prefix indexes, found once."""
        self._flush_pending = False
        """A flush of the prefix indexes' deferred inserts is scheduled (:meth:`_flush_soon`)."""
        # Gauges read at scrape time from the bookkeeping itself: nothing to update per
        # request, and they cannot drift from it.
        metrics.queue_depth.set_function(self.queue.__len__)
        self.configure(config, state_max_age_s)
        self._adopt(policy)

    # -- configuration -----------------------------------------------------------
    def configure(self, config: "RouterConfig", state_max_age_s: float) -> None:
        """Apply queue and timing settings (hot reload keeps queued requests)."""
        self.queue_limit = config.queue_limit
        self.action_interval_s = config.action_interval_s
        self.hold_idle_limit_s = config.hold_idle_limit_s
        self.no_endpoint_grace_s = config.no_endpoint_grace_s
        self.state_max_age_s = state_max_age_s
        if self.decisions.maxlen != config.decisions_kept:
            self.decisions = deque(self.decisions, maxlen=config.decisions_kept)
        seed = config.tie_break_seed
        if seed is None:
            if self._rng is not None and not self._tie_seed_configured:
                return  # a reload keeps the process's own seed
            seed = int.from_bytes(os.urandom(4), "big")
        elif self._rng is not None and self._tie_seed_configured and seed == self.tie_seed:
            return
        self.tie_seed = seed
        self._tie_seed_configured = config.tie_break_seed is not None
        self._rng = random.Random(seed)

    # -- prefix indexes ----------------------------------------------------------
    def _adopt(self, policy: RoutingPolicy) -> RoutingPolicy:
        """Find ``policy``'s prefix indexes and bound them by :attr:`prefix_capacity_blocks`."""
        found = self._indexes.get(policy)
        if found is None:
            try:
                found = self._indexes[policy] = prefix_indexes(policy)
            except TypeError:  # not weakly referenceable: looked up at each use instead
                found = prefix_indexes(policy)
        for ix in found:
            ix.limit_capacity(self.prefix_capacity_blocks)
            ix.defer_updates = True  # updated after the decision: _flush_soon
        return policy

    def _flush_soon(self, indexes: tuple[PrefixIndex, ...]) -> None:
        """Apply this decision's index insert (``PrefixIndex.defer_updates``) on the next event-loop
        turn, after the request is on its way: a decision that sends a long prompt where it was
        not cached inserts and evicts about as many entries as the prompt has chunks, most of the
        pick's cost (``benchmarks/prefix_decision_cost.py``)."""
        if self._flush_pending or not any(ix.due for ix in indexes):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on a loop (a direct call): at once
            self._flush_indexes(indexes)
            return
        self._flush_pending = True
        loop.call_soon(self._flush_indexes)

    def _flush_indexes(self, indexes: "tuple[PrefixIndex, ...] | list[PrefixIndex] | None" = None) -> None:
        """Apply the deferred inserts of ``indexes`` (None: every live policy's), timed in
        ``phasewise_prefix_index_update_seconds``."""
        if indexes is None:
            self._flush_pending = False
            indexes = self._live_indexes()
        t0 = time.perf_counter()
        for ix in indexes:
            ix.flush()
        self.metrics.prefix_update_time.observe(time.perf_counter() - t0)

    def _indexes_of(self, policy: RoutingPolicy) -> tuple[PrefixIndex, ...]:
        found = self._indexes.get(policy)
        return found if found is not None else prefix_indexes(policy)

    def _live_indexes(self) -> list[PrefixIndex]:
        """Every prefix index of the live policies (the one and each model's)."""
        out = list(self._indexes_of(self.policy))
        for p in self._model_policies.values():
            out.extend(self._indexes_of(p))
        return out

    @property
    def reads_prefix(self) -> bool:
        """Whether the live policy keeps a prefix index (reads ``RequestFeatures.prefix``)."""
        return bool(self._indexes_of(self.policy))

    def configure_prefix(self, capacity_blocks: int | None) -> None:
        """Apply ``prefix.index_capacity_blocks`` to every live policy's prefix index (evicting
        what exceeds it now) and to policies built later."""
        self.prefix_capacity_blocks = capacity_blocks
        for ix in self._live_indexes():
            ix.limit_capacity(capacity_blocks)

    def prefix_index_blocks(self, ep: EndpointState) -> int:
        """Blocks the live policies' prefix indexes hold for ``ep`` (``phasewise_prefix_index_blocks``)."""
        i = ep.index
        return sum(ix.size(i) for ix in self._live_indexes())

    def forget_cached(self, name: str, cause: str) -> None:
        """Endpoint ``name``'s engine lost its prefix cache (``cause``: a restart, a reset, a refused
        connect): every live policy's approximate index forgets what it believed cached there, so
        no request is scored against blocks the engine no longer has (the engine index clears
        itself). Counted in ``phasewise_prefix_engine_cache_lost``."""
        ep = self.by_name.get(name)
        if ep is None:
            return
        self._forget_prefixes(ep.index)
        ep.pending.clear()
        self.metrics.count_engine_loss(name, cause)

    def _forget_prefixes(self, index: int) -> None:
        for ix in self._live_indexes():
            ix.forget(index)

    def set_policy(self, policy: RoutingPolicy, name: str) -> None:
        """Swap the policy; queued and in-flight requests are kept (their bookkeeping is not the policy's)."""
        self._adopt(policy)
        self.policy = policy
        self.policy_name = name
        self._policy_fallbacks = getattr(policy, "fallbacks", None)
        self._model_policies = {}
        self._fallbacks_seen = {}
        self._fallback_warned_for = None
        self._idle_hold_since = {}
        self._sync_profiles()
        self._decide()

    def set_endpoints(self, discovered: Sequence[DiscoveredEndpoint], *, lists_read: bool = False) -> None:
        """Make the endpoint table match ``discovered`` (the complete current set).

        New endpoints join; known ones take the new URL, state address and readiness;
        missing ones stop receiving requests at once and are dropped when their in-flight
        requests have finished. Their metric series go with them. A new URL drops the list
        read from the old one (it is another server's).

        ``lists_read``: the caller reads the ``/v1/models`` of every endpoint without configured
        models (it pokes the lister); those that are new, moved or just lost their configured
        models then wait for that read (:attr:`EndpointState.models_pending`) until
        :meth:`set_discovered_models` or :meth:`forget_discovered_models`.
        """
        seen: set[str] = set()
        for d in discovered:
            seen.add(d.name)
            ep = self.by_name.get(d.name)
            fresh = ep is None
            prof = self._profile_of(d)
            if ep is None:
                ep = EndpointState(len(self.endpoints), d.name, d.url, d.state_address, d.ready, prof)
                ep.clock = self.clock
                ep.m = self.metrics.endpoint(d.name, ep.requests.__len__,
                                             lambda ep=ep: 1.0 if ep.ejected_until > self.clock() else 0.0,
                                             lambda ep=ep: float(self.prefix_index_blocks(ep)))
                # Its index number may be a departed endpoint's: nothing learned there applies here.
                self._forget_prefixes(ep.index)
                ep.idle_since = self.clock()
                self.endpoints.append(ep)
                self.by_name[d.name] = ep
            else:
                if ep.state_address != d.state_address:
                    ep.snapshot = None
                if ep.url != d.url:
                    ep.url, ep.target = d.url, url_target(d.url)
                    # Another server now: what the old one listed or cached says nothing about it.
                    ep.discovered_models = None
                    self._forget_prefixes(ep.index)
                    fresh = True
                ep.state_address, ep.ready, ep.removed = d.state_address, d.ready, False
                if ep.profile is not prof:
                    ep.set_profile(prof)
            ep.kv_events = d.kv_events
            configured = frozenset(d.models)
            if configured != ep.configured_models:
                ep.configured_models = configured
                # A list read before is of another configuration: read it again (the caller
                # pokes the lister), and serve nothing from it meanwhile.
                ep.discovered_models = None
                fresh = True
            if fresh and lists_read and not configured:
                ep.models_pending = True
            ep.m.ready.set(1 if self.is_ready(ep) else 0)
        self._cands = None
        for ep in list(self.endpoints):
            if ep.name not in seen and not ep.removed:
                ep.removed = True
                ep.ready = False
                ep.m.ready.set(0)
        # Said-once records of endpoints that are gone (pod names change with every rollout).
        self._bad_profiles = {k for k in self._bad_profiles if k[0] in seen}
        self._drop_removed()
        self._rebuild_models()
        self._sync_profiles()
        if self.on_ready_change is not None:
            self.on_ready_change()
        self._decide()

    def _profile_of(self, d: DiscoveredEndpoint) -> "HardwareProfile":
        """``d``'s own profile (``endpoints[].profile``, checked when the settings were loaded), or
        routerd's. One that cannot be loaded now (a file gone since) is routerd's, said once.

        A profile file is parsed once per content: it is kept with its file's stat (mtime, size,
        inode) and read again only when that changes, since every EndpointSlice update asks this
        for every endpoint on the event loop (parsing and checking one file: about 1-5 ms)."""
        if not d.profile:
            return self.profile
        from routerd.profiles import ProfileError, get_profile

        spec = d.profile
        try:
            stamp = None
            if spec.endswith((".yaml", ".yml")) or "/" in spec:  # get_profile's rule for a path
                try:
                    st = os.stat(spec)
                except OSError as e:
                    raise ProfileError(f"cannot read {spec}: {e.strerror}") from None
                stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            hit = self._profile_files.get(spec)
            if hit is not None and hit[0] == stamp:
                return hit[1]
            prof = get_profile(spec)
            if hit is not None and hit[1] == prof:
                prof = hit[1]  # same content rewritten: the same object, so no endpoint changes
            self._profile_files[spec] = (stamp, prof)
            return prof
        except ProfileError as e:
            if (d.name, d.profile) not in self._bad_profiles:
                self._bad_profiles.add((d.name, d.profile))
                self.metrics.profile_fallbacks.inc()
                log.warning("endpoint %s: profile %s cannot be loaded (%s); using %s", d.name, d.profile, e,
                            self.profile.name)
            return self.profile

    def _sync_profiles(self) -> None:
        """Give every live policy each endpoint's profile by its index (``PolicyContext.profiles``),
        after the endpoint table changed or a policy was built."""
        profiles = tuple(ep.profile for ep in self.endpoints)
        for p in (self.policy, *self._model_policies.values()):
            ctx = getattr(p, "ctx", None)
            if hasattr(ctx, "profiles") and ctx.profiles != profiles:
                ctx.profiles = profiles

    def _drop_removed(self) -> None:
        gone = [ep for ep in self.endpoints if ep.removed and not ep.requests]
        if not gone:
            return
        self._cands = None
        for ep in gone:
            del self.by_name[ep.name]
            self.metrics.remove_endpoint(ep.name)
        self.endpoints = [ep for ep in self.endpoints if not (ep.removed and not ep.requests)]
        moved = {}
        for i, ep in enumerate(self.endpoints):
            moved[ep.index] = i
            ep.index = i
        # The policies' prefix indexes follow the renumbering; the departed endpoints' entries go,
        # so an endpoint that later takes one of their numbers starts empty.
        for ix in self._live_indexes():
            ix.renumber(moved)
        self._rebuild_models()
        self._sync_profiles()

    def update_state(self, name: str, state: Any) -> None:
        """Store a sidecar ``InstanceState`` for endpoint ``name`` (ignored if unknown)."""
        ep = self.by_name.get(name)
        if ep is not None:
            before = ep.snapshot.models if ep.snapshot is not None else None
            now = self.clock()
            was_unhealthy = ep.sidecar_unhealthy(now, self.state_max_age_s)
            ep.set_snapshot(state, now)
            if list(state.models) != (list(before) if before is not None else None):
                self._rebuild_models()  # the models it serves may have changed
                self._cands = None
            if ep.sidecar_unhealthy(now, self.state_max_age_s) != was_unhealthy:
                self._health_changed(ep, state)
            if self.queue:
                self._decide()

    def _health_changed(self, ep: EndpointState, state: Any) -> None:
        """``ep``'s sidecar turned it unhealthy or healthy again: candidates, the ready gauge and
        readiness (``/readyz``, gRPC health) follow at once; said once per change."""
        self._cands = None
        ep.m.ready.set(1 if self.is_ready(ep) else 0)
        if state.healthy:
            log.info("endpoint %s: its sidecar reports it healthy again", ep.name)
        else:
            log.warning("endpoint %s: its sidecar reports it unhealthy (%s): not ready, no new requests while "
                        "another endpoint serving its models is ready", ep.name, state.error or "no reason given")
        if self.on_ready_change is not None:
            self.on_ready_change()

    def set_discovered_models(self, name: str, models: Sequence[str] | None) -> None:
        """What endpoint ``name``'s ``/v1/models`` listed; None: it answered without a usable list
        (401/403, not a model list), so its models are unknown again (fail closed).

        Ignored for an unknown endpoint and for one with configured ``endpoints[].models``
        (those replace whatever it lists; a read started before a reload may end after it).
        """
        ep = self.by_name.get(name)
        if ep is None or ep.configured_models:
            return
        new = frozenset(models) if models is not None else None
        if new != ep.discovered_models or ep.models_pending:
            ep.discovered_models = new
            ep.models_pending = False
            self._models_changed()

    def forget_discovered_models(self, names: Sequence[str]) -> None:
        """Drop what the endpoints ``names`` listed, and stop waiting for their lists (nothing
        reads or refreshes those lists any more)."""
        changed = False
        for name in names:
            ep = self.by_name.get(name)
            if ep is not None and (ep.discovered_models is not None or ep.models_pending):
                ep.discovered_models = None
                ep.models_pending = False
                changed = True
        if changed:
            self._models_changed()

    def set_default_models(self, models: Sequence[str]) -> None:
        """The top-level ``models`` setting: the models requests may name (empty: any known)."""
        new = frozenset(models)
        if new != self.default_models:
            self.default_models = new
            self._models_changed()

    def _models_changed(self) -> None:
        self._rebuild_models()
        self._cands = None
        if self.queue:
            self._decide()

    def _rebuild_models(self) -> None:
        """Recompute which endpoint serves which model, after anything it depends on changed.

        An endpoint's list is its ``endpoints[].models`` if configured, else what its own
        ``/v1/models`` listed. Its sidecar's names (vLLM's ``model_name`` label: the first
        served name only, never an alias or a LoRA adapter) are no list: they never narrow
        what it serves. Several models are possible only on evidence: ``models`` names more
        than one, or (``models`` empty) the configured lists, the read lists and the sidecar
        names together name more than one. An unknown list is no such evidence: a single-model
        pool of servers without ``/v1/models`` (or one not up yet) must route as it did before
        lists existed. While several are possible, an endpoint without a list serves only what
        its sidecar names (which it certainly serves), nothing without a sidecar: fail closed,
        a request must never reach an endpoint that may not serve its model. With one possible
        model, an endpoint without a list serves every model (the single-model deployment,
        which needs no lists; ``models: [alias]`` routes whatever name vLLM's metrics carry),
        except one whose list is being read (``models_pending``: it joined or moved): that
        one serves its sidecar's names only until the read answers, as it may be another
        model's server (a reload moving an endpoint name to a new URL).
        """
        present = [ep for ep in self.endpoints if not ep.removed]
        lists: dict[str, frozenset[str] | None] = {}
        sides: dict[str, frozenset[str]] = {}
        names: set[str] = set()
        evidence: set[str] = set()
        for ep in present:
            listed = ep.configured_models or ep.discovered_models
            s = ep.snapshot
            side = frozenset(s.models) if s is not None and s.models else frozenset()
            lists[ep.name] = listed
            sides[ep.name] = side
            names |= side if listed is None else listed
            evidence |= side
        evidence |= names
        default = self.default_models
        several = len(default) > 1 if default else len(evidence) > 1
        pending = False
        for ep in present:
            if lists[ep.name] is None and (several or ep.models_pending):
                lists[ep.name] = sides[ep.name]
            pending = pending or ep.models_pending
        self._pending = pending
        if several != self._several and self.queue:
            # Queued requests move to the queues of the new mode (per model, or one), in order.
            queued = self.queue.take_all()
            for r in queued:
                self.queue.push(r, r.model if several else None)
        self._several = several
        self._all = present
        self._unlisted = [ep for ep in present if lists[ep.name] is None]
        self._by_model = {m: [ep for ep in present if lists[ep.name] is None or m in lists[ep.name]]  # type: ignore[operator]
                          for m in names | default}
        self._known = frozenset(names)
        self._known_sorted = sorted(names)
        self._drop_model_state()
        if self._models_waiters:
            waiters, self._models_waiters = self._models_waiters, []
            for f in waiters:
                if not f.done():
                    f.set_result(None)

    def _drop_model_state(self) -> None:
        """Forget the policy (and round-robin position, fallback count, hold timer) of every
        model no present endpoint serves any more and with no request queued, or of every
        model when one model is possible: adapters come and go under ever new names, and each
        policy may hold a prefix index. A request in flight keeps the policy that placed it
        (``Inflight.policy``) for its ``on_complete``; a model served again starts fresh."""
        keep = self._several
        for state in (self._model_policies, self._fallbacks_seen, self._rr, self._idle_hold_since):
            for key in [k for k in state if k is not None]:
                if not keep or (not self._by_model.get(key) and self.queue.head(key) is None):
                    del state[key]

    @property
    def several_models(self) -> bool:
        """Whether more than one model is possible (see :meth:`_rebuild_models`): a request
        must then name its model."""
        return self._several

    def _several_models(self) -> bool:
        return self._several

    def known_models(self) -> list[str]:
        """Every model some present endpoint is known to serve, sorted."""
        return list(self._known_sorted)

    def model_verdict(self, model: str) -> str:
        """Whether requests for ``model`` are taken: ``"ok"``; ``"unknown"`` (404: not in
        ``models`` when set, else in no list while every list is known; any model is taken
        while no model at all is known); ``"pending"`` (in no known list, but some endpoint's
        list is still being read, e.g. a replacement pod in a rolling update: retryable 503)."""
        allowed = self.default_models
        if allowed:
            return "ok" if model in allowed else "unknown"
        known = self._known
        if model in known or (not known and not self._pending):
            return "ok"
        return "pending" if self._pending else "unknown"

    async def wait_models_change(self, timeout_s: float) -> None:
        """Return when what serves which model is next recomputed (a list read, an endpoint
        change), or after ``timeout_s`` (s), whichever is first."""
        fut = asyncio.get_running_loop().create_future()
        self._models_waiters.append(fut)
        try:
            await asyncio.wait((fut,), timeout=max(0.0, timeout_s))
        finally:
            if not fut.done():
                fut.cancel()
                try:
                    self._models_waiters.remove(fut)
                except ValueError:
                    pass

    def _eps_for(self, model: str | None) -> list[EndpointState]:
        """The present endpoints that serve ``model`` (None: every one), precomputed by
        :meth:`_rebuild_models`; callers must not modify the list."""
        if model is None:
            return self._all
        return self._by_model.get(model, self._unlisted)

    # -- queries -----------------------------------------------------------------
    def is_ready(self, ep: EndpointState, now: float | None = None) -> bool:
        """Whether ``ep`` takes new requests at ``now`` (default: the clock): ready by its source and
        not reported unhealthy by its sidecar (:meth:`EndpointState.sidecar_unhealthy`). Connect
        cooldowns and ejections are apart (passive health, see :meth:`_candidates`)."""
        return ep.ready and not ep.sidecar_unhealthy(self.clock() if now is None else now, self.state_max_age_s)

    @property
    def ready_count(self) -> int:
        """Endpoints that take new requests (:meth:`is_ready`)."""
        now = self.clock()
        return sum(1 for ep in self.endpoints if self.is_ready(ep, now))

    @property
    def in_flight(self) -> int:
        """Requests dispatched and not finished, over all endpoints."""
        return sum(len(ep.requests) for ep in self.endpoints)

    def has_candidate(self, exclude: frozenset[str] | set[str] = frozenset(), model: str | None = None) -> bool:
        """True if some ready endpoint not in ``exclude`` serves ``model`` (None: any)."""
        for ep in self._eps_for(model):
            if ep.ready and ep.name not in exclude:
                return True
        return False

    def candidates(self, model: str | None = None,
                   exclude: frozenset[str] | set[str] = frozenset()) -> list[EndpointState]:
        """The endpoints a request for ``model`` (None: any) could go to now, ``exclude`` left
        out: ready, serving it, and not cooling down nor ejected (all ready ones if every one
        is). A fresh list the caller may keep (the endpoint picker's fallbacks)."""
        return list(self._candidates(exclude, self.clock(), model))

    @property
    def known(self) -> frozenset[str]:
        """Every model some present endpoint is known to serve (precomputed)."""
        return self._known

    # -- requests ----------------------------------------------------------------
    def new_request(self, prompt_tokens: int, predicted_bucket: int | None, task: str | None = None,
                    label: Any = None, model: str | None = None,
                    prefix: "PrefixBlocks | None" = None) -> Inflight:
        """A request as the router sees it before dispatch (prompt in tokens, its leading KV blocks
        as ``prefix`` or None: :mod:`routerd.daemon.prefix`); it goes only to endpoints serving
        ``model`` (None: any). A prefix that counted the prompt's tokens exactly (precise mode
        tokenized all of it: ``EngineKeyed.prompt_tokens``) replaces the front's estimate."""
        exact = getattr(prefix, "prompt_tokens", None)
        if exact:
            prompt_tokens = exact
        rid = self._next_id
        self._next_id = rid + 1
        now = self.clock()
        pred = self._mids[predicted_bucket if predicted_bucket is not None else 0]
        r = Inflight(rid, rid if label is None else label, prompt_tokens, predicted_bucket, pred, now)
        r.features = RequestFeatures(rid, now, prompt_tokens, predicted_bucket, pred, task, prefix)
        r.model = model
        return r

    async def dispatch(self, r: Inflight, exclude: frozenset[str] | set[str] = frozenset(), *,
                       retry: bool | None = None) -> EndpointState:
        """Queue ``r`` and wait for its endpoint; ``r`` is then in that endpoint's bookkeeping.

        The caller must call :meth:`finish` exactly once afterwards. A retry after a failed
        connect passes the endpoints to avoid in ``exclude`` and goes to the queue front.
        ``retry`` (default: ``exclude`` is not empty) says whether ``r`` is such a retry: the
        endpoint picker excludes the endpoints outside a gateway's subset hint for a new
        request (``retry=False``), which queues, drains and is shed like any other.

        Raises:
            QueueFullError, NoEndpointError, DrainingError: the request is not dispatched.
            asyncio.CancelledError: the caller was cancelled; nothing stays booked.
        """
        if retry is None:
            retry = bool(exclude)
        if self.draining and not retry:
            raise DrainingError("routerd is shutting down")
        q = self.queue
        if not retry and len(q) >= self.queue_limit:
            raise QueueFullError(f"router queue is full ({self.queue_limit} requests)")
        if self.no_endpoint_grace_s <= 0.0 and not self.has_candidate(exclude, r.model):
            raise NoEndpointError(_no_endpoint(r.model))
        r.exclude = exclude
        r.enqueued_at = self.clock()
        r.waiter = None
        r.error = None
        q.push(r, self._key(r.model), front=retry)
        # An arrival is a decision point even when it is not the head (the simulator's rule):
        # the held head may fit now.
        self._decide()
        if r.endpoint is not None and not r.done:
            return r.endpoint
        if r.error is not None:
            raise r.error
        fut = r.waiter = asyncio.get_running_loop().create_future()
        try:
            await fut
        except asyncio.CancelledError:
            if r.endpoint is None:
                q.remove(r)
                self._maybe_idle()
            else:
                self.finish(r)
            raise
        if r.error is not None:
            raise r.error
        return r.endpoint  # type: ignore[return-value]

    def try_dispatch_now(self, r: Inflight) -> EndpointState | None:
        """Decide on ``r`` at once without queueing it (the gRPC ``Route``); None = hold.

        A request asks again after a hold; FIFO fairness is kept by holding it while HTTP
        requests for its model wait in the queue (another model's do not hold it).

        Raises:
            NoEndpointError, DrainingError.
        """
        if self.draining:
            raise DrainingError("routerd is shutting down")
        if not self.has_candidate(model=r.model):
            raise NoEndpointError(_no_endpoint(r.model))
        key = self._key(r.model)
        if self.queue.head(key) is not None:
            return None
        r.exclude = frozenset()
        r.enqueued_at = r.arrived_at
        self.queue.push(r, key)
        try:
            self._decide(only=key)
        finally:
            if self.queue.head(key) is r:
                self.queue.pop_head(key)
        if r.error is not None:
            raise r.error
        return r.endpoint

    def finish(self, r: Inflight) -> bool:
        """Release ``r`` from its endpoint's bookkeeping (every path must call it once).

        Returns False when it was already released. Tells the policy, then decides on the
        queue head: a completion may free room for a held request.
        """
        ep = r.endpoint
        if ep is None or not ep.remove(r):
            return False
        if r.pending is not None:
            ep.end_pending(r.pending)
            r.pending = None
        now = self.clock()
        if not ep.requests:
            ep.idle_since = now
            if ep.removed:
                self._drop_removed()
        try:
            # The policy that placed it (the model's own), even if the mode changed since.
            (r.policy if r.policy is not None else self.policy).on_complete(ep.index, r.rid, now)
        except Exception:  # noqa: BLE001 - a policy bug must not leak the request's bookkeeping
            log.exception("policy %s: on_complete failed", self.policy_name)
        if self.queue:
            self._decide()
        self._maybe_idle()
        return True

    def move(self, r: Inflight, ep: EndpointState) -> bool:
        """Book ``r`` on ``ep`` instead of the endpoint it was dispatched to: a gateway served it on
        a fallback (the endpoint picker's served-endpoint report). The old endpoint is released as
        at :meth:`finish` (its policy told), and ``r`` keeps its first-token and token counts.
        Returns False when ``r`` is finished or already on ``ep``."""
        old = r.endpoint
        if old is None or old is ep or r.done or ep.removed:
            return False
        first, generated = r.first_token, r.generated
        if not old.remove(r):
            return False
        if r.pending is not None:
            # Its blocks are on their way to the engine that served it, not the one first picked.
            for k in r.pending:
                old.pending.pop(k, None)
            ep.note_pending(r.pending)
        now = self.clock()
        if not old.requests:
            old.idle_since = now
            if old.removed:
                self._drop_removed()
        try:
            (r.policy if r.policy is not None else self.policy).on_complete(old.index, r.rid, now)
        except Exception:  # noqa: BLE001 - a policy bug must not leak the request's bookkeeping
            log.exception("policy %s: on_complete failed", self.policy_name)
        # Not through finish(): the request stays in flight, so drain must not see a moment idle.
        r.reset_for_retry()
        ep.add(r, now)
        if first:
            ep.on_first_token(r)
        if generated:
            ep.on_tokens(r, generated)
        if self.queue:
            self._decide()
        return True

    def note_connect_failure(self, ep: EndpointState) -> None:
        """An upstream connect failed: keep new requests off ``ep`` for a doubling cooldown. The
        engine is down, so what it cached is gone: its engine index and every policy's approximate
        index forget it (:meth:`forget_cached`)."""
        ep.connect_failures += 1
        self._cands = None
        if ep.engine_index is not None:
            ep.engine_index.engine_down()  # its on_loss calls forget_cached
        else:
            self.forget_cached(ep.name, "engine_down")
        base = self.failure_cooldown_s
        if base > 0:
            # The exponent is capped: 2.0 ** 1024 overflows a float (issue 15: every request then
            # failed with 500 once an endpoint had refused 1024 connects).
            ep.down_until = self.clock() + min(MAX_COOLDOWN_S, base * 2.0 ** min(ep.connect_failures - 1, 32))
            if self.on_ready_change is not None:
                self.on_ready_change()
        self.note_failure(ep, "connect")

    def note_success(self, ep: EndpointState) -> None:
        """An upstream answered (not with a 5xx): clear the connect-failure cooldown and the
        consecutive-error count, and end a probation after an ejection."""
        ep.consecutive_errors = 0
        if ep.probation:
            ep.probation = False
            ep.ejections = 0
        if ep.connect_failures:
            ep.connect_failures = 0
            ep.down_until = 0.0
            self._cands = None
            if self.on_ready_change is not None:
                self.on_ready_change()

    def note_failure(self, ep: EndpointState, kind: str) -> None:
        """A request to ``ep`` failed (``kind``: connect, timeout, status (5xx) or stream).

        ``upstream.outlier.consecutive_errors`` failures in a row, or one while on probation
        after an ejection, eject ``ep``: no new requests for ``base_ejection_s`` times the
        number of ejections in a row, at most ``max_ejection_s`` (Envoy's outlier detection,
        ``source/extensions/clusters/common/outlier_detection_impl.cc``: ejection time =
        base * number of ejections, capped). At most ``max_ejected_percent`` of the known
        endpoints are ejected at once, and always one may be.
        """
        cfg = self.outlier
        if cfg is None or not cfg.enabled or ep.removed:
            return
        ep.consecutive_errors += 1
        now = self.clock()
        if ep.ejected_until > now or ep.consecutive_errors < (1 if ep.probation else cfg.consecutive_errors):
            return
        known = [e for e in self.endpoints if not e.removed]
        ejected = sum(1 for e in known if e.ejected_until > now)
        if ejected >= max(1, int(len(known) * cfg.max_ejected_percent / 100.0)):
            self.metrics.ejections_capped.inc()
            return
        ep.ejections += 1
        ep.consecutive_errors = 0
        ep.probation = True
        duration = min(cfg.max_ejection_s, cfg.base_ejection_s * ep.ejections)
        ep.ejected_until = now + duration
        ep.m.ejections.inc()
        self._cands = None
        log.warning("endpoint %s ejected for %.0f s after failed requests (last: %s; ejection %d in a row)",
                    ep.name, duration, kind, ep.ejections)
        if self.on_ready_change is not None:
            self.on_ready_change()

    # -- the decision loop -------------------------------------------------------
    def _policy_for(self, model: str | None) -> RoutingPolicy:
        """The policy deciding ``model``'s requests: while several models are possible, one per
        model, so that state a policy keeps (a round-robin position, a predictor's history, a
        prefix index) is that model's alone; else the one policy, as before."""
        if model is None or not self._several:
            return self.policy
        p = self._model_policies.get(model)
        if p is None:
            p = self._model_policies[model] = self._build_model_policy(model)
            self._fallbacks_seen[model] = getattr(p, "fallbacks", None)
            self._sync_profiles()
        return p

    def _build_model_policy(self, model: str) -> RoutingPolicy:
        """A fresh policy for ``model`` from the registry: the live policy's name and parameters,
        built for the model's endpoint count, seeded by :func:`model_seed` of the live policy's
        seed. Fresh, not a copy of the live one, so that no other model's history leaks in.
        Built at the model's first decision; the count is not updated when endpoints come and
        go (as the live policy's is not: a ``dqn`` routes round robin while the sizes differ).
        A build that fails (it did not for the live policy) logs why and routes round robin."""
        base = self.policy
        n = len(self._eps_for(model))
        seed = model_seed(getattr(base.ctx, "seed", 0), model)
        edges = tuple(getattr(base.ctx, "bucket_edges", self.bucket_edges))
        near_tie = getattr(base.ctx, "near_tie", 0.0)
        try:
            return self._adopt(build_routing_policy(_PolicySpec(base.name, base.params.model_dump()), self.profile,
                                                    n, edges, seed=seed, near_tie=near_tie))  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - a model without its policy still routes
            log.error("policy %s for model %r cannot be built (%s); routing it round robin", self.policy_name,
                      model, e)
            return build_routing_policy(_PolicySpec("round_robin", {}), self.profile, n, edges,
                                        seed=seed)  # type: ignore[arg-type]

    def _candidates(self, exclude, now: float, model: str | None = None) -> list[EndpointState]:
        """Ready endpoints (:meth:`is_ready`) not in ``exclude`` and not cooling down (all ready ones
        if every one is). Fail open twice: every endpoint ready by its source but reported unhealthy
        by its sidecar -> those; every one of them cooling down or ejected -> those.

        Without exclusions the list is reused until the endpoint table, a cooldown or a sidecar's
        health changes, or the earliest cooldown or unhealthy snapshot ends: it is rebuilt at most
        that often instead of at every decision. Callers must not modify it.
        """
        # Keyed by the endpoint list, not the raw name: with no lists known any model name is
        # accepted, and a cache per client-chosen name would grow without bound.
        key = model if model is None or model in self._by_model else _UNLISTED
        if not exclude and self._cands is not None:
            c = self._cands.get(key)
            if c is not None and c[1] <= now < c[2]:
                return c[0]
        listed = [ep for ep in self._eps_for(model) if ep.ready and ep.name not in exclude]
        max_age = self.state_max_age_s
        ready: list[EndpointState] = []
        unhealthy = False
        for ep in listed:
            if ep.sidecar_unhealthy(now, max_age):
                unhealthy = True
            else:
                ready.append(ep)
        # Every one reported unhealthy: try them anyway (fail open, see the module docstring).
        ready = ready or listed
        # Every ready endpoint cooling down or ejected: try them anyway (the ejection cap keeps
        # this rare); a request is better sent than refused.
        cands = [ep for ep in ready if ep.down_until <= now and ep.ejected_until <= now] or ready
        if not exclude:
            # Not kept while one is reported unhealthy: that also ends with time (its snapshot ages),
            # and such spells are rare enough to rebuild the list at each decision meanwhile.
            until = now if unhealthy else min(
                (t for ep in ready for t in (ep.down_until, ep.ejected_until) if t > now), default=float("inf"))
            if self._cands is None:
                self._cands = {}
            self._cands[key] = (cands, now, until)
        return cands

    def _key(self, model: str | None) -> Any:
        """The queue key (and per-model state key) of a request for ``model``: the model while
        several are possible, else None (one FIFO, one policy, as with one model)."""
        return model if self._several else None

    def _round_robin(self, cands: list[EndpointState], key: Any = None) -> EndpointState:
        i = (self._rr.get(key, -1) + 1) % len(cands)
        self._rr[key] = i
        return cands[i]

    def _decide(self, only: Any = _NO_KEY) -> None:
        """Offer queue heads to the policy, oldest first, until each model's head is held (or
        waits for an endpoint) or the queue empties. ``only``: decide once on that key's head
        (:meth:`try_dispatch_now`), without scheduling a tick."""
        q = self.queue
        metrics = self.metrics
        blocked: set | None = None
        while q:
            if only is not _NO_KEY:
                key = only
                if q.head(key) is None:
                    return
            else:
                key = q.oldest_key(blocked)
                if key is _NO_KEY:
                    break
            r = q.head(key)
            assert r is not None
            w = r.waiter
            if w is not None and w.done():  # the client went away while queued
                q.pop_head(key)
                continue
            now = self.clock()
            cands = self._candidates(r.exclude, now, r.model)
            if not cands:
                if self.no_endpoint_grace_s <= 0.0 or now - r.enqueued_at >= self.no_endpoint_grace_s:
                    q.pop_head(key)
                    self._reject(r, NoEndpointError(_no_endpoint(r.model)))
                    continue
                if only is not _NO_KEY:
                    return
                # This model waits for an endpoint; the others' heads may go.
                blocked = blocked or set()
                blocked.add(key)
                continue
            policy = self._policy_for(key)
            max_age = self.state_max_age_s
            all_stale = True
            for ep in cands:
                if not ep.refresh(now, max_age):
                    all_stale = False
            reason = None
            prefix_ix: tuple[PrefixIndex, ...] = ()
            if all_stale:
                ep = self._round_robin(cands, key)
                reason = "stale_state"
            else:
                prefix_ix = self._indexes_of(policy) if r.features.prefix is not None else ()
                for ix in prefix_ix:
                    ix.last_insert = None
                t0 = time.perf_counter()
                seen = cands
                if len(cands) > 1 and not getattr(policy, "order_sensitive", True):
                    # Random order: "first among equals" is then a random one (no herding of
                    # several replicas onto the lowest index).
                    seen = cands[:]
                    self._rng.shuffle(seen)  # type: ignore[union-attr]  # set by configure
                try:
                    # The queue length this model's policy sees is its own model's.
                    choice = policy.pick(r.features, ClusterView(now, seen, len(q.by_key[key])))
                except Exception:  # noqa: BLE001 - fail open, never fail the request
                    log.exception("policy %s failed; routing round robin", self.policy_name)
                    choice = -1
                metrics.decision_time.observe(time.perf_counter() - t0)
                if choice is None:
                    if self._hold_allowed(cands, now, key):
                        metrics.holds.inc()
                        if only is not _NO_KEY:
                            return
                        blocked = blocked or set()
                        blocked.add(key)
                        continue
                    ep = self._round_robin(cands, key)
                    reason = "hold_idle"
                else:
                    if type(choice) is not int:
                        choice = _as_index(choice)
                    ep = self.endpoints[choice] if 0 <= choice < len(self.endpoints) else None
                    if ep is None or ep not in cands:
                        if choice != -1:
                            log.warning("policy %s returned %r, not a candidate; routing round robin",
                                        self.policy_name, choice)
                        ep = self._round_robin(cands, key)
                        reason = "policy_error" if choice == -1 else "invalid_choice"
                    elif self._policy_fallbacks is not None:
                        fb = policy.fallbacks  # type: ignore[attr-defined]
                        seen_fb = self._fallbacks_seen.get(key, self._policy_fallbacks)
                        if fb != seen_fb:
                            self._fallbacks_seen[key] = fb
                            reason = "policy_fallback"
                            if self._fallback_warned_for != len(cands):
                                # Once per cluster size: the counter says how often.
                                self._fallback_warned_for = len(cands)
                                log.warning("policy %s was built for %s instances and %d are ready; routing "
                                            "round robin while the sizes differ (counted in "
                                            "phasewise_fallbacks_total{reason=\"policy_fallback\"})",
                                            self.policy_name, policy.ctx.num_instances, len(cands))
            q.pop_head(key)
            self._idle_hold_since.pop(key, None)
            r.policy = policy
            r.cached_tokens = r.uncached_blocks = 0
            if r.features.prefix is not None:
                idx = ep.engine_index
                m = None
                cached: int | None = None  # tokens, in the engine's own blocks
                if idx is not None:
                    # Blocks this request adds to the engine: its KV events should follow once it
                    # is prefilled (the index's "silent" rule, started at its first token, so an
                    # engine that refuses it does not look silent); engine keys only.
                    cached = ep.engine_match(r.features.prefix)
                    if cached is not None:
                        ebs = idx.block_size or r.features.prefix.block_size
                        ids = getattr(r.features.prefix, "ids", None)
                        total = (len(ids) // ebs if ids is not None else r.features.prefix.num_blocks)
                        r.uncached_blocks = total - cached // ebs
                        r.kv_batches = idx.batches_applied
                        if r.uncached_blocks > 0:
                            # Its blocks count as cached there until its events come (or it ends).
                            keyed = r.features.prefix.at(ebs) if ids is not None else r.features.prefix
                            r.pending = [k for k, _ in keyed.extents]
                            ep.note_pending(r.pending)
                        # vLLM computes the last prompt token whatever is cached and counts hits in
                        # whole blocks below it (vllm/v1/core/kv_cache_manager.py, get_computed_blocks).
                        cached = min(cached, max(0, (r.prompt_tokens - 1) // ebs * ebs))
                if reason is None:
                    if cached is not None:
                        self._prefix_match_precise.observe(cached // ep.block_size)  # what the engine holds
                    else:
                        m = self._observe_prefix(prefix_ix, ep.index)
                        if m:
                            cached = min(m * ep.block_size, r.prompt_tokens - 1)
                if cached:
                    # Its prefill backlog there is what the cache does not hold (the simulator's
                    # views count it net of hits too).
                    r.cached_tokens = cached
            self._assign(r, ep, now, reason)
            if prefix_ix:
                self._flush_soon(prefix_ix)
            if only is not _NO_KEY:
                return
        if only is not _NO_KEY:
            return
        if q and self._tick is None:
            self._tick = asyncio.get_running_loop().call_later(self.action_interval_s, self._on_tick)

    def _observe_prefix(self, indexes: tuple[PrefixIndex, ...], chosen: int) -> int | None:
        """``phasewise_prefix_match_blocks``: the blocks the policy's index believed cached on the
        chosen endpoint, as its insert at this decision found them (``PrefixIndex.last_insert``);
        returns them (None: no index recorded an insert there)."""
        for ix in indexes:
            li = ix.last_insert
            if li is not None and li[0] == chosen:
                self._prefix_match.observe(li[1])
                return li[1]
        return None

    def _hold_allowed(self, cands: list[EndpointState], now: float, key: Any = None) -> bool:
        for ep in cands:
            if ep.requests or ep.num_running or ep.num_waiting:
                self._idle_hold_since.pop(key, None)
                return True
        since = self._idle_hold_since.setdefault(key, now)
        return now - since < self.hold_idle_limit_s

    def _on_tick(self) -> None:
        self._tick = None
        self._decide()

    def _assign(self, r: Inflight, ep: EndpointState, now: float, reason: str | None) -> None:
        ep.add(r, now)
        m = ep.m
        m.decisions.inc()
        metrics = self.metrics
        wait = now - r.enqueued_at
        metrics.router_wait.observe(wait)
        if reason is not None:
            self.fallbacks_total += 1
            metrics.fallback_children[reason].inc()
        self.decisions.append((r.label, time.time(), ep.name, r.prompt_tokens, r.predicted_bucket, wait,
                               self.policy_name, reason is not None))
        r.fallback = reason is not None
        w = r.waiter
        if w is not None:
            w.set_result(None)

    def _reject(self, r: Inflight, err: RejectedError) -> None:
        r.error = err
        w = r.waiter
        if w is not None and not w.done():
            w.set_result(None)
        self._maybe_idle()

    # -- drain -------------------------------------------------------------------
    def begin_drain(self) -> None:
        """Refuse new requests from now on; queued and in-flight ones continue."""
        self.draining = True
        if self.on_ready_change is not None:
            self.on_ready_change()
        if not self.queue and not self.in_flight:
            self._wake_idle()

    async def wait_idle(self) -> None:
        """Return once no request is queued or in flight."""
        if not self.queue and not self.in_flight:
            return
        fut = asyncio.get_running_loop().create_future()
        self._idle_waiters.append(fut)
        await fut

    def _maybe_idle(self) -> None:
        if self._idle_waiters and not self.queue and not self.in_flight:
            self._wake_idle()

    def _wake_idle(self) -> None:
        waiters, self._idle_waiters = self._idle_waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    def reject_queued(self, err: RejectedError) -> int:
        """Answer every queued request with ``err`` (drain timeout); returns how many."""
        n = 0
        for r in self.queue.take_all():
            self._reject(r, err)
            n += 1
        return n

    def close(self) -> None:
        """Cancel the pending decision timer."""
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
