"""The routerd process: wires settings, router, HTTP front, gRPC API, state watchers, reload and drain.

Lifecycle: :meth:`Daemon.start` binds the HTTP and gRPC listeners and starts watching
each endpoint's sidecar; :meth:`Daemon.reload` swaps endpoints, policy (including a dqn
checkpoint), predictor and limits without touching queued or in-flight requests;
:meth:`Daemon.drain` stops accepting (``/readyz`` and gRPC health turn NOT_SERVING, new
requests get 503), lets queued and in-flight requests finish up to the drain timeout and
then :meth:`Daemon.stop` closes everything. :meth:`Daemon.serve_forever` adds the signal
handling of ``phasewise serve``: SIGTERM/SIGINT drain and exit, SIGHUP reloads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Sequence

from aiohttp import web

from routerd.errors import ConfigError
from routerd.model import PREDICTOR_BUCKET_EDGES, bucket_of
from routerd.daemon.collector import CollectorPacer
from routerd.daemon.config import PolicyConfig, Settings, load_settings
from routerd.daemon.discovery import DiscoveredEndpoint
from routerd.daemon.frontend import Frontend, effective_max_connections
from routerd.daemon.metrics import EngineIndexCollector, Metrics
from routerd.daemon.models import ModelLister
from routerd.daemon.predict_batch import PredictionBatcher
from routerd.daemon.prefix import PrefixInput, PromptInput, build_prefix_identity, kv_events_address
from routerd.daemon.proxy import Proxy
from routerd.daemon.state import url_target
from routerd.daemon.router import CheckpointConfigError, Router, build_routing_policy

log = logging.getLogger("routerd")

_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
#: Least time between two re-reads of every model list that requests for unknown models cause (s).
UNKNOWN_MODEL_REFRESH_S = 2.0
#: Longest a request for an unknown model waits for that re-read before its 404 (s).
UNKNOWN_MODEL_WAIT_S = 1.0


def load_profile(spec: str):
    """The hardware profile ``spec`` (name or YAML path). Raises ConfigError naming the field."""
    from routerd.profiles import ProfileError, get_profile

    try:
        return get_profile(spec)
    except ProfileError as e:
        raise ConfigError(f"profile: {e}") from None


#: Packages of the ``predictor-train`` extra (scikit-learn and what it imports); any other
#: missing package of a predictor belongs to the ``predictor`` extra (torch, transformers).
_TRAIN_EXTRA_PACKAGES = frozenset({"sklearn", "scipy", "joblib", "threadpoolctl"})


def load_length_predictor(spec: str):
    """The length predictor of ``spec`` (``Settings.predictor``), or None for ``none``.

    Raises:
        ConfigError: ``predictor: ...``, one line: an unknown spec, a broken folder, or a
            missing package with the extra that provides it (``predictor-train`` for the
            scikit-learn baselines ``length-only`` / ``length+task``, ``predictor`` for a
            transformer folder).
    """
    if not spec.strip():
        raise ConfigError("predictor: empty; give 'default' (the shipped model), 'none' (no prediction), "
                          "a baseline name or a model folder")
    if spec.strip().lower() == "none":
        return None
    from routerd.predictor import BASELINE_NAMES, PredictorError, load_predictor

    try:
        return load_predictor(spec)
    except PredictorError as e:
        raise ConfigError(f"predictor: {e}") from None
    except ModuleNotFoundError as e:
        top = (e.name or "").partition(".")[0]
        extra = "predictor-train" if spec.strip() in BASELINE_NAMES or top in _TRAIN_EXTRA_PACKAGES else "predictor"
        raise ConfigError(f"predictor: {spec!r} needs the Python package {e.name!r}; "
                          f"install the extra: pip install 'phasewise[{extra}]'") from None


def _with_prefix_source(cfg: PolicyConfig, source: str | None) -> PolicyConfig:
    """``cfg`` with its policy's ``prefix_source`` parameter following ``prefix.mode`` (``precise``
    when routerd reads KV events, else ``approximate``), unless the configuration sets it: one
    setting decides where every cache-aware policy's matches come from."""
    from routerd.policies.registry import POLICIES

    cls = POLICIES.get(cfg.name)
    if source is None or cls is None or "prefix_source" in cfg.params or "prefix_source" not in cls.Params.model_fields:
        return cfg
    return cfg.model_copy(update={"params": {**cfg.params, "prefix_source": source}})


#: Prompt characters from which a model tokenizer runs in a worker thread (~1 ms of encoding).
_THREAD_CHARS = 16_384


class _Built:
    """Everything derived from settings that can fail, built before anything is swapped.

    At startup (``startup=True``) a ``dqn`` policy whose checkpoint is missing, corrupt or
    made for another observation layout does not stop routerd: it routes round robin and
    logs why (issue #3, "Bad input"); ``policy_name`` then says ``round_robin``. On a
    reload the error is raised instead, so the running configuration is kept.
    """

    def __init__(self, settings: Settings, num_endpoints: int, *, startup: bool = False,
                 say_prefix: bool = True) -> None:
        self.profile = load_profile(settings.profile)
        self.prefix = build_prefix_identity(settings.prefix, self.profile.block_size, settings.profile,
                                            say=say_prefix)
        self.predictor = load_length_predictor(settings.predictor)
        self.edges = tuple(self.predictor.edges) if self.predictor is not None else PREDICTOR_BUCKET_EDGES
        self.policy_name = settings.policy.name
        try:
            self.policy = build_routing_policy(_with_prefix_source(settings.policy, self.prefix.source),
                                               self.profile, num_endpoints, self.edges,
                                               near_tie=settings.router.near_tie)
        except CheckpointConfigError as e:
            if not startup:
                raise
            log.warning("%s; routing round robin instead until the checkpoint is fixed and the "
                        "configuration reloaded", e)
            self.policy_name = "round_robin"
            self.policy = build_routing_policy(PolicyConfig(name="round_robin"), self.profile, num_endpoints,
                                               self.edges)


def file_signature(path: Path) -> tuple[int, int, int] | None:
    """(inode, size in bytes, modification time in ns) of ``path`` (symlinks followed, so a
    Kubernetes ConfigMap's ``..data`` swap shows), or None when it cannot be read."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class Daemon:
    """One routerd: an HTTP front and a gRPC API over a shared :class:`Router`.

    Args:
        settings: validated settings.
        config_path: the YAML file they came from (reloaded on SIGHUP or when it changes).
        reload_overrides: the command-line overrides to re-apply on each reload.

    Raises:
        ConfigError: the profile, predictor or policy cannot be built.
    """

    def __init__(self, settings: Settings, *, config_path: str | Path | None = None,
                 reload_overrides: dict[str, Any] | None = None,
                 reload_override_flags: dict[str, str] | None = None, http_front: bool = True) -> None:
        self.settings = settings
        self.http_front = http_front
        """Serve the OpenAI-compatible HTTP front (False for ``phasewise epp``, whose front is
        Envoy's ext_proc: :mod:`routerd.epp`)."""
        self.ready_listeners: list[Any] = []
        """Called with the new readiness (bool) whenever it may have changed (another front's health)."""
        self.config_path = Path(config_path) if config_path is not None else None
        self._overrides = reload_overrides or {}
        self._override_flags = reload_override_flags or {}
        built = _Built(settings, len(settings.endpoints), startup=True)
        n_policy = getattr(getattr(built.policy, "ctx", None), "num_instances", None)
        if built.policy_name == "dqn" and settings.endpoints and n_policy != len(settings.endpoints):
            log.warning("policy dqn: its checkpoint was trained for %s instances and %d endpoints are "
                        "configured; it routes round robin while the sizes differ", n_policy,
                        len(settings.endpoints))
        self.profile = built.profile
        self.predictor = built.predictor
        self._batcher = PredictionBatcher(self._is_blocking)
        self.metrics = Metrics()
        self.metrics.registry.register(EngineIndexCollector(self.engine_index_stats))
        self.router = Router(profile=self.profile, policy=built.policy, policy_name=built.policy_name,
                             metrics=self.metrics, config=settings.router, state_max_age_s=settings.state.max_age_s,
                             bucket_edges=built.edges)
        self.router.failure_cooldown_s = settings.upstream.failure_cooldown_s
        self.router.outlier = settings.upstream.outlier
        self.prefix = built.prefix
        self._wire_prefix()
        self.router.configure_prefix(settings.prefix.index_capacity_blocks)
        self.router.set_default_models(settings.models)
        self.router.on_ready_change = self._on_ready_change
        self.started_at_unix = time.time()
        self._static: list[DiscoveredEndpoint] = self._static_endpoints(settings)
        self._discovered: list[DiscoveredEndpoint] = []
        self._watchers: dict[str, tuple[str, Any, asyncio.Task]] = {}
        self._kv: Any = None
        """The KV-event subscriber (:class:`routerd.daemon.kv_events.KVEventSubscriber`), made
        the first time precise mode has an endpoint to read."""
        self._kv_subs: dict[str, tuple[tuple, Any]] = {}
        """Per endpoint name: (what it was subscribed with, its EngineBlockIndex)."""
        self._kv_dup_warned: set[tuple] = set()
        self._fallback_said: set[tuple[str, str]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._http_server: asyncio.AbstractServer | None = None
        self.frontend: Frontend | None = None
        self._site_port: int | None = None
        self._grpc: Any = None
        self._k8s: Any = None
        self._tasks: list[asyncio.Task] = []
        self._bg: set[asyncio.Future] = set()
        self._config_sig: tuple[int, int, int] | None = None
        self._stopping = False
        self.proxy = Proxy(self)
        self.model_lister = ModelLister(self._endpoints_to_list, self.router.set_discovered_models,
                                        refresh_s=settings.model_refresh_s)
        self._unknown_refresh: asyncio.Future | None = None
        self._unknown_refresh_at = float("-inf")
        """Monotonic start of the last refresh triggered by a request for an unknown model (s)."""

    # -- start / stop ------------------------------------------------------------
    async def start(self) -> None:
        """Bind the listeners, open the upstream pool, start state watchers and discovery."""
        self._loop = asyncio.get_running_loop()
        s = self.settings
        await self.proxy.open_pool()
        self._apply_all_endpoints()
        # What each endpoint serves, before the first request: with several models behind one
        # routerd, a request must never reach an endpoint that does not serve its model.
        await self.model_lister.refresh()
        self._tasks.append(asyncio.create_task(self.model_lister.run()))
        if self.http_front:
            await self._start_http()
        if s.grpc.enabled:
            from routerd.daemon.grpc_api import GrpcServer

            self._grpc = GrpcServer(self)
            await self._grpc.start(s.grpc.host, s.grpc.port)
        if s.kubernetes.enabled:
            self._start_kubernetes()
        if self.config_path is not None:
            self._config_sig = file_signature(self.config_path)
            if s.reload.watch:
                self._tasks.append(asyncio.create_task(self._watch_config()))
        self._on_ready_change()
        if not self.router.endpoints and not s.kubernetes.enabled:
            log.warning("no endpoints configured: every request will get 503 until a reload adds some")
        log.info("tie-break seed %d (router.tie_break_seed %s)", self.router.tie_seed,
                 "set" if s.router.tie_break_seed is not None else "unset: drawn for this process")
        self._log_prefix()
        log.info("routerd listening on %s%s; policy %s; predictor %s; endpoints: %d",
                 f"http://{s.http.host}:{self.http_port}" if self.http_front
                 else f"no HTTP front (endpoint picker: Envoy ext_proc on {s.epp.host}:{s.epp.port}, "
                      f"{s.epp.mode} mode)",
                 f", gRPC {s.grpc.host}:{self.grpc_port}" if self._grpc is not None else "",
                 s.policy.name if self.router.policy_name == s.policy.name
                 else f"{self.router.policy_name} (configured {s.policy.name}: its checkpoint is unusable)",
                 getattr(self.predictor, "name", "none") if self.predictor is not None else "none",
                 len(self.router.endpoints))

    async def _start_http(self) -> None:
        """Bind the OpenAI-compatible HTTP front (``http.host``/``http.port``)."""
        s = self.settings
        assert self._loop is not None
        app = self.proxy.build_app()
        limit = effective_max_connections(s.http.max_connections)
        if limit < s.http.max_connections:
            log.warning("http.max_connections %d lowered to %d (half the open-file limit)",
                        s.http.max_connections, limit)
        self.frontend = Frontend(header_timeout_s=s.http.header_timeout_s,
                                 keepalive_timeout_s=s.http.keepalive_timeout_s, max_connections=limit,
                                 on_close=lambda why: self.metrics.client_connections_closed.labels(why).inc())
        # The front-end limits own the waiting connections; aiohttp's keep-alive timer only backs them.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                                     shutdown_timeout=0.5, keepalive_timeout=self.frontend.aiohttp_keepalive_s)
        await self._runner.setup()
        self.metrics.client_connections.set_function(self.frontend.conns.__len__)
        # Our own listener rather than web.TCPSite: each connection is wrapped (frontend.py); aiohttp's
        # handler still registers with its server, so the graceful shutdown of runner.cleanup() holds.
        self._http_server = await self._loop.create_server(
            self.frontend.factory(self._runner.server), s.http.host, s.http.port, backlog=1024, reuse_address=True)
        self._site_port = self._http_server.sockets[0].getsockname()[1]

    @property
    def http_port(self) -> int:
        """The bound HTTP port (useful with port 0)."""
        assert self._site_port is not None, "not started"
        return self._site_port

    @property
    def grpc_port(self) -> int | None:
        """The bound gRPC port, or None when gRPC is disabled."""
        return self._grpc.port if self._grpc is not None else None

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Stop accepting, wait for queued and in-flight requests (at most ``timeout_s``).

        Returns True if everything finished in time; queued requests left at the timeout
        get 503 (in-flight ones are cut when the server stops).
        """
        from routerd.daemon.router import DrainingError

        timeout_s = self.settings.drain_timeout_s if timeout_s is None else timeout_s
        self.router.begin_drain()
        log.info("draining: %d queued, %d in flight (timeout %g s)", len(self.router.queue),
                 self.router.in_flight, timeout_s)
        try:
            await asyncio.wait_for(self.router.wait_idle(), timeout_s)
            return True
        except asyncio.TimeoutError:
            n = self.router.reject_queued(DrainingError("routerd is shutting down (drain timeout)"))
            log.warning("drain timeout: %d queued requests refused, %d in flight cut", n, self.router.in_flight)
            return False

    async def stop(self) -> None:
        """Close listeners, watchers, discovery and the upstream pool (idempotent)."""
        if self._stopping:
            return
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except asyncio.CancelledError:
                pass
        self._tasks.clear()
        if self._k8s is not None:
            k8s, self._k8s = self._k8s, None
            await asyncio.to_thread(k8s.stop)
        if self._grpc is not None:
            await self._grpc.stop(grace_s=0.5)
        if self._http_server is not None:
            self._http_server.close()  # no new connections; open ones end with runner.cleanup()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._http_server is not None:
            for c in list(self.frontend.conns if self.frontend is not None else ()):
                if c.transport is not None:
                    c.transport.abort()  # whatever cleanup's grace left open (slow or idle clients)
            await self._http_server.wait_closed()
            self._http_server = None
        if self.frontend is not None:
            self.frontend.close()
        for name in list(self._watchers):
            await self._stop_watcher(name)
        self._kv_subs.clear()
        if self._kv is not None:
            await self._kv.close()
        if self._bg:
            await asyncio.gather(*self._bg, return_exceptions=True)
        await self.model_lister.close()
        await self.proxy.close()
        self.router.close()

    # -- prefix ------------------------------------------------------------------
    def prefix_blocks(self, prompt: PromptInput, chat: bool = False) -> Any:
        """The request's :class:`~routerd.prefix.chain.PrefixBlocks` for the live policy, or None:
        ``prefix.mode`` off, no prompt, or a policy that keeps no prefix index (nothing is hashed
        for ``round_robin`` and the other load-only policies). ``prompt``: a
        :class:`~routerd.daemon.prefix.PrefixInput` (or bare text, ``chat``: a chat request's
        rendered messages). Observed in ``phasewise_prefix_prompt_blocks``."""
        ident = self.prefix
        if prompt is None or not ident.enabled or not self.router.reads_prefix:
            return None
        p = ident.blocks_for(prompt, chat)
        if p is not None:
            self.metrics.prefix_prompt_blocks.observe(p.num_blocks)
        return p

    def prefix_in_thread(self, prompt: PromptInput, chat: bool = False) -> bool:
        """Whether ``prompt`` goes to :meth:`prefix_blocks_in_thread`: a long text for a model's tokenizer."""
        ident = self.prefix
        tok = ident.tokenizer
        if tok is None or tok.name == "bytes" or not self.router.reads_prefix:
            return False
        if isinstance(prompt, PrefixInput):
            chat = prompt.chat
            size = len(prompt.chat_text or "") if chat else (len(prompt.prompt) if isinstance(prompt.prompt, str)
                                                            else 0)
        else:
            size = len(prompt) if isinstance(prompt, str) else 0
        return size >= _THREAD_CHARS and (not chat or ident.chat_keyed)

    async def prefix_blocks_in_thread(self, prompt: PromptInput, chat: bool = False) -> Any:
        """:meth:`prefix_blocks` in a worker thread, for a prompt :meth:`prefix_in_thread` says
        a model's tokenizer should encode there (the ``tokenizers`` package releases the GIL while
        it encodes): a 1 MB prompt takes about a second to tokenize, which on the event loop
        stalled every other request."""
        p = await asyncio.to_thread(self.prefix.blocks_for, prompt, chat)
        if p is not None:
            self.metrics.prefix_prompt_blocks.observe(p.num_blocks)
        return p

    def _log_prefix(self) -> None:
        ident, cfg = self.prefix, self.settings.prefix
        if not ident.enabled:
            log.info("prefix: mode off (the cache-aware policies route on load only)")
            return
        what = (f"token blocks ({ident.tokenizer.name} tokenizer)" if ident.tokenizer is not None else
                f"text chunks of {ident.chunk_blocks * ident.block_size * 4} bytes")
        reads = "" if self.router.reads_prefix else (f"; policy {self.router.policy_name} keeps no prefix index, "
                                                     "so no prompt is hashed")
        if ident.max_blocks == 0:
            log.warning("prefix.max_prompt_tokens %d is under one block of %d tokens: no prompt has a prefix",
                        cfg.max_prompt_tokens, ident.block_size)
        log.info("prefix: mode %s, %s, block size %d, at most %d blocks per prompt, index bound %d blocks per "
                 "endpoint%s", cfg.mode, what, ident.block_size, ident.max_blocks, cfg.index_capacity_blocks, reads)

    # -- endpoints ---------------------------------------------------------------
    @staticmethod
    def _static_endpoints(settings: Settings) -> list[DiscoveredEndpoint]:
        return [DiscoveredEndpoint(e.name, e.url, e.state_address, True, tuple(e.models), e.kv_events, e.profile)
                for e in settings.endpoints]

    def _with_kv_events(self, e: DiscoveredEndpoint) -> DiscoveredEndpoint:
        """``e`` with its KV-event publisher's address resolved (:func:`kv_events_address`)."""
        addr = kv_events_address(url_target(e.url)[1], e.kv_events, self.settings.prefix.kv_events.port)
        return e if addr == e.kv_events else dataclasses.replace(e, kv_events=addr)

    def apply_endpoints(self, endpoints: Sequence[DiscoveredEndpoint]) -> None:
        """Replace the discovered endpoint set (static endpoints stay); event-loop thread only.

        From another thread use :meth:`endpoints_callback` (an ``EndpointsCallback``).
        """
        self._discovered = list(endpoints)
        self._apply_all_endpoints()

    def endpoints_callback(self, endpoints: Sequence[DiscoveredEndpoint]) -> None:
        """Thread-safe :data:`~routerd.daemon.discovery.EndpointsCallback`: hops to the event loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(self.apply_endpoints, tuple(endpoints))

    def _endpoints_to_list(self) -> list[tuple[str, str]]:
        """Endpoints whose ``/v1/models`` is read: those without configured models, unless the
        top-level ``models`` names a single model (then every endpoint serves it, as before
        several models were supported, and no endpoint is asked)."""
        if len(self.settings.models) == 1:
            return []
        return [(ep.name, ep.url) for ep in self.router.endpoints if not ep.removed and not ep.configured_models]

    def _apply_all_endpoints(self) -> None:
        names = {e.name for e in self._static}
        merged = [self._with_kv_events(e) for e in
                  list(self._static) + [e for e in self._discovered if e.name not in names]]
        known = {ep.name: (ep.url, ep.configured_models) for ep in self.router.endpoints}
        # Lists are read (and new or moved endpoints wait for theirs) unless ``models`` names one.
        self.router.set_endpoints(merged, lists_read=len(self.settings.models) != 1)
        # A list nothing refreshes any more (the endpoint is configured now, or ``models`` names
        # one model) must not linger: it would be trusted long after it went stale.
        listed = {n for n, _ in self._endpoints_to_list()}
        self.router.forget_discovered_models(
            [ep.name for ep in self.router.endpoints
             if (ep.discovered_models is not None or ep.models_pending) and ep.name not in listed])
        if self._loop is not None and not self._stopping:
            self._sync_watchers()
            self._sync_kv_events()
            for e in merged:
                if e.name in listed and known.get(e.name) != (e.url, frozenset(e.models)):
                    # New, moved, or its configured models changed: ask it what it serves.
                    self.model_lister.poke(e.name)

    def _sync_watchers(self) -> None:
        wanted = {ep.name: ep.state_address for ep in self.router.endpoints if ep.state_address and not ep.removed}
        for name, (addr, _, _) in list(self._watchers.items()):
            if wanted.get(name) != addr:
                self._background(self._stop_watcher(name))
        for name, addr in wanted.items():
            if name not in self._watchers:
                self._start_watcher(name, addr)

    def _sync_kv_events(self) -> None:
        """Precise mode: one KV-event subscription and engine index per present endpoint with a
        publisher address; gone, moved or reconfigured ones are resubscribed with a fresh index
        (an index is exact only from an empty cache or a batch numbered 0). Every endpoint's
        view is pointed at its index (None outside precise mode: the approximate index answers)."""
        from routerd.prefix.engine_index import EngineBlockIndex

        cfg = self.settings.prefix
        wanted: dict[str, tuple] = {}
        if self.prefix.source == "precise" and not self._stopping:
            ke = cfg.kv_events
            wanted = {ep.name: (ep.kv_events, ke.topic, cfg.block_size, ke.max_blocks, ke.stale_after_s)
                      for ep in self.router.endpoints if not ep.removed and ep.kv_events}
            by_addr: dict[str, list[str]] = {}
            for name, key in wanted.items():
                by_addr.setdefault(key[0], []).append(name)
            for addr, names in by_addr.items():
                if len(names) > 1:
                    # Each would believe the other's cache: none of them reads it.
                    for name in names:
                        del wanted[name]
                    if (addr, tuple(names)) not in self._kv_dup_warned:
                        self._kv_dup_warned.add((addr, tuple(names)))
                        log.warning("prefix.mode precise: endpoints %s all name the KV-event publisher %s; none of "
                                    "them reads it (their prefix matches come from the approximate index): give "
                                    "each endpoint its own kv_events address", ", ".join(sorted(names)), addr)
        if wanted and self._kv is None:
            from routerd.daemon.kv_events import KVEventSubscriber

            self._kv = KVEventSubscriber()
        for name, (key, _) in list(self._kv_subs.items()):
            if wanted.get(name) != key:
                del self._kv_subs[name]
                self.metrics.engine_index(name, None)
                self._background(self._kv_replace(name, None))
        for name, key in wanted.items():
            if name in self._kv_subs:
                continue
            addr, topic, bs, max_blocks, stale_s = key
            idx = EngineBlockIndex(bs, max_blocks=max_blocks, stale_after_s=stale_s,
                                   on_block_size=lambda want, got, _n=name: self._engine_block_size(_n, want, got),
                                   on_loss=lambda cause, _n=name: self.router.forget_cached(_n, cause))
            self._kv_subs[name] = (key, idx)
            self.metrics.engine_index(name, idx)
            if name in self._kv:
                self._background(self._kv_replace(name, (addr, topic, idx)))  # the old one closes first
            else:
                self._kv_add(name, addr, topic, idx)
        for ep in self.router.endpoints:
            sub = self._kv_subs.get(ep.name)
            ep.engine_index = sub[1] if sub is not None else None
            ep.on_prefix_fallback = None if sub is None else (lambda reason, _n=ep.name: self._prefix_fallback(_n, reason))

    def _engine_block_size(self, name: str, expected: int | None, reported: int) -> None:
        """Endpoint ``name``'s engine publishes blocks of ``reported`` tokens: its index keys in them.
        A ``prefix.block_size`` that disagrees is a warning and
        ``phasewise_prefix_block_size_mismatch``; without one, an engine whose size differs from the
        profile's is said at INFO (the profile's size only counts KV capacity and matches)."""
        self.metrics.block_size_mismatch(name, expected, reported)
        prof = self.profile.block_size
        if expected is not None:
            log.warning("prefix.mode precise: %s's engine caches KV blocks of %d tokens but prefix.block_size is %d: "
                        "its blocks are keyed in %d-token blocks (phasewise_prefix_block_size_mismatch); set "
                        "prefix.block_size to %d or leave it unset", name, reported, expected, reported, reported)
        elif reported != prof:
            log.info("prefix.mode precise: %s's engine caches KV blocks of %d tokens (the profile %s says %d): its "
                     "KV events are keyed in %d-token blocks", name, reported, self.settings.profile, prof, reported)

    def _wire_prefix(self) -> None:
        """Connect the prefix identity to what the daemon knows: which models are LoRA adapters
        (their blocks are salted apart), and the metric of requests it could not key."""
        self.prefix.lora_of = self._lora_of
        self.prefix.on_problem = lambda reason: self.metrics.prefix_problems.labels(reason).inc()

    def _lora_of(self, model: str) -> str | None:
        """The adapter a request for ``model`` runs under: ``model`` when an endpoint's ``/v1/models``
        card gives it a ``parent`` (vLLM lists a LoRA adapter with its base model as parent,
        ``vllm/entrypoints/openai/models/serving.py``), else None (a base model, or models whose
        lists are not read: ``models`` names one, or ``endpoints[].models`` are configured)."""
        for _, cards in self.model_lister.cards.values():
            card = cards.get(model)
            if card is not None and card.get("parent") is not None:
                return model
        return None

    def _prefix_fallback(self, name: str, reason: str) -> None:
        """A policy's precise query for ``name`` answered by its approximate index: counted, and
        said once per endpoint and reason (``no_events`` above all, which no event announces: a
        wrong address, vLLM without ``--kv-events-config``)."""
        self.metrics.count_prefix_fallback(name, reason)
        if (name, reason) in self._fallback_said:
            return
        sub = self._kv_subs.get(name)
        if reason == "no_events":
            # Normal until the engine's first batch: an idle engine, or one that stored nothing
            # yet, publishes nothing. Said only once a request sent there had stale_after_s to
            # bring its events.
            waited = sub[1].awaiting_for if sub is not None else None
            if waited is None or waited < self.settings.prefix.kv_events.stale_after_s:
                return
            why = ("no KV events received yet: check that the engine runs with --kv-events-config and that its "
                   "endpoint binds (vLLM binds only an endpoint with '*', e.g. tcp://*:5557; tcp://HOST:PORT "
                   "connects instead)")
        else:
            why = reason
        self._fallback_said.add((name, reason))
        log.warning("prefix.mode precise: %s's KV-event index (%s) cannot answer (%s): its prefix matches come "
                    "from the approximate index (phasewise_prefix_fallbacks_total)", name,
                    sub[0][0] if sub is not None else "?", why)

    def _kv_add(self, name: str, address: str, topic: str, index: Any) -> None:
        try:
            self._kv.add(name, address, topic, index)
        except (ValueError, RuntimeError) as e:
            # Its index stays without events: stale from the start ("silent" once requests go
            # there), so the approximate index answers for it; said once.
            log.warning("%s; prefix matches for %s come from the approximate index", e, name)

    async def _kv_replace(self, name: str, new: tuple | None) -> None:
        """Unsubscribe ``name`` (awaited), then subscribe it again with ``new`` if given."""
        await self._kv.remove(name)
        if new is not None and not self._stopping and not self._kv.closed and self._kv_subs.get(name, (0, None))[1] is new[2]:
            self._kv_add(name, *new)

    def engine_index_stats(self) -> dict[str, Any]:
        """Per subscribed endpoint its EngineBlockIndex and its consumer's counters (or None):
        ``phasewise_prefix_kv_event_batches_total`` and the other ``EngineIndexCollector`` series."""
        out = {}
        for name, (_, idx) in self._kv_subs.items():
            stats = self._kv.stats(name) if self._kv is not None and name in self._kv else None
            out[name] = (idx, stats)
        return out

    def _background(self, coro) -> None:
        # Keep a reference: the event loop holds only weak ones to tasks.
        task = asyncio.ensure_future(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    def _start_watcher(self, name: str, address: str) -> None:
        from routerd.sidecar.client import InstanceStateWatcher

        router = self.router

        def on_state(state: Any, _name: str = name) -> None:
            router.update_state(_name, state)

        w = InstanceStateWatcher(address, on_state, min_interval_s=self.settings.state.min_interval_s)
        task = asyncio.create_task(w.run(), name=f"state-{name}")
        self._watchers[name] = (address, w, task)

    async def _stop_watcher(self, name: str) -> None:
        entry = self._watchers.pop(name, None)
        if entry is None:
            return
        _, w, task = entry
        await w.aclose()
        if not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    def _start_kubernetes(self) -> None:
        from routerd.daemon.endpointslices import EndpointSliceWatcher

        k = self.settings.kubernetes
        namespace = k.namespace
        if namespace is None:
            try:
                namespace = Path(_NAMESPACE_FILE).read_text().strip()
            except OSError:
                namespace = "default"
        watcher = EndpointSliceWatcher(namespace, k.service or "", self.endpoints_callback,
                                       http_port_name=k.http_port_name, state_port_name=k.state_port_name,
                                       kv_events_port_name=k.kv_events_port_name,
                                       on_skip=lambda _why: self.metrics.endpointslice_skipped.inc(),
                                       selector=k.selector, profile_label=k.profile_label, profiles=k.profiles)
        try:
            watcher.start()
        except Exception as e:  # noqa: BLE001 - no in-cluster credentials nor kubeconfig, typically
            raise ConfigError(f"kubernetes: cannot start EndpointSlice discovery: {type(e).__name__}: {e}") from None
        self._k8s = watcher

    # -- readiness and models ----------------------------------------------------
    def readiness(self) -> tuple[bool, str]:
        """(ready, why): config loaded, not draining, and an endpoint that is ready (by its source,
        and not reported unhealthy by its sidecar: :meth:`Router.is_ready`) and reachable (no
        connect-failure cooldown). ``why`` names the unhealthy endpoints when they are the reason."""
        router = self.router
        if router.draining:
            return False, "draining"
        now = router.clock()
        # An ejected endpoint still counts: with every one ejected, requests go to them anyway.
        if not any(router.is_ready(ep, now) and ep.down_until <= now for ep in router.endpoints):
            sick = self.unhealthy_endpoints(now)
            return False, "no ready endpoint" + (f" (reported unhealthy by their sidecars: {', '.join(sick)})"
                                                 if sick else "")
        return True, "ok"

    def unhealthy_endpoints(self, now: float | None = None) -> list[str]:
        """Names of the present endpoints their sidecars report unhealthy now, sorted."""
        router = self.router
        now = router.clock() if now is None else now
        age = self.settings.state.max_age_s
        return sorted(ep.name for ep in router.endpoints if not ep.removed and ep.sidecar_unhealthy(now, age))

    def _on_ready_change(self) -> None:
        ready = self.readiness()[0]
        if self._grpc is not None:
            self._grpc.set_serving(ready)
        for listener in self.ready_listeners:
            listener(ready)

    def model_names(self) -> list[str]:
        """Served model names: ``models`` if configured, else the union of what the endpoints serve
        (their configured models, their ``/v1/models``, their sidecars' reports)."""
        if self.settings.models:
            return list(self.settings.models)
        return self.router.known_models()

    def _refresh_for_unknown_model(self) -> asyncio.Future | None:
        """The refresh of every list that a request for an unknown model may wait for: the one
        under way, else a new one unless one started less than :data:`UNKNOWN_MODEL_REFRESH_S`
        ago (clients naming bad models must not turn into a read storm); None when none."""
        fut = self._unknown_refresh
        if fut is not None and not fut.done():
            return fut
        now = time.monotonic()
        if now - self._unknown_refresh_at < UNKNOWN_MODEL_REFRESH_S or not self._endpoints_to_list():
            return None
        self._unknown_refresh_at = now
        self._unknown_refresh = fut = self.model_lister.refresh_all_soon()
        return fut

    def model_allowed(self, model: str) -> bool:
        """Whether requests for ``model`` are accepted now (any model while none is known)."""
        return self.router.model_verdict(model) == "ok"

    async def settle_model(self, model: str) -> str:
        """:meth:`Router.model_verdict` of ``model``, once it is settled: while it is
        ``"pending"`` (a list still being read) wait for the lists up to
        ``router.no_endpoint_grace_s`` (s; 0 = answer at once), as a request waits for a ready
        endpoint. While it is ``"unknown"`` with ``models`` empty, every list is read again
        (at most every :data:`UNKNOWN_MODEL_REFRESH_S`; a request arriving meanwhile joins that
        read) and waited for up to :data:`UNKNOWN_MODEL_WAIT_S`, so a newly loaded adapter is
        found without waiting for ``model_refresh_s``. Returns ``"ok"``, ``"unknown"`` (answer
        404) or ``"pending"`` (answer 503)."""
        router = self.router
        verdict = router.model_verdict(model)
        if verdict == "unknown" and not router.default_models:
            # Perhaps an adapter loaded since the last read: read every list again (at most every
            # UNKNOWN_MODEL_REFRESH_S) and decide on the fresh lists if they come in time.
            fut = self._refresh_for_unknown_model()
            if fut is not None:
                await asyncio.wait((fut,), timeout=UNKNOWN_MODEL_WAIT_S)
                verdict = router.model_verdict(model)
        if verdict == "pending" and router.no_endpoint_grace_s > 0.0:
            deadline = router.clock() + router.no_endpoint_grace_s
            while verdict == "pending" and router.clock() < deadline:
                await router.wait_models_change(deadline - router.clock())
                verdict = router.model_verdict(model)
        return verdict

    # -- per-request helpers -----------------------------------------------------
    @staticmethod
    def _is_blocking(predictor: Any) -> bool:
        """Whether ``predictor.predict`` must run in a worker thread: only the transformer
        (``routerd.predictor.hf``, milliseconds of torch per request). The shipped n-gram
        model and the baselines are numpy and run on the event loop."""
        return predictor is not None and type(predictor).__module__.startswith("routerd.predictor.hf")

    async def predict(self, prompt: str | None, prompt_tokens: int, task: str | None,
                      max_tokens: int | None = None) -> int | None:
        """Predicted decode bucket of a request, or None (no predictor, or it failed).

        A prediction above the bucket of the request's ``max_tokens`` is lowered to it: the
        output cannot be longer than that.
        """
        p = self.predictor
        if p is None:
            return None
        try:
            # Requests parsed in the same loop iteration are predicted as one batch
            # (predict_batch.py); a transformer runs off the event loop.
            b = int(await self._batcher.predict(p, (prompt, prompt_tokens, task)))
        except Exception:  # noqa: BLE001 - a predictor failure must not fail the request
            log.exception("predictor failed; routing without a prediction")
            return None
        edges = self.router.bucket_edges
        if not 0 <= b <= len(edges):
            return None
        if max_tokens is not None and max_tokens > 0:
            cap = bucket_of(max_tokens, edges)
            if b > cap:
                b = cap
        return b

    def observe_finished(self, r: Any, t0: float, t_first: float | None, tokens: int) -> None:
        """Record the latency metrics of a request that completed (``tokens`` generated)."""
        m = self.metrics
        now = time.monotonic()
        e2e = now - t0
        m.e2e.observe(e2e)
        if t_first is not None:
            ttft = t_first - t0
            m.ttft.observe(ttft)
            if tokens > 1:
                m.tpot.observe((now - t_first) / (tokens - 1))
        m.generation_tokens.inc(tokens)
        m.count_bucket(r.predicted_bucket, bucket_of(tokens, self.router.bucket_edges))

    def refresh_gauges(self) -> None:
        """Update gauges that are read, not pushed (before a /metrics scrape)."""
        now = self.router.clock()
        age = self.settings.state.max_age_s
        for ep in self.router.endpoints:
            ep.m.state_stale.set(1 if ep.state_address is not None and ep.is_stale(now, age) else 0)
            # Also changes with time alone (an unhealthy snapshot ages out).
            ep.m.ready.set(1 if self.router.is_ready(ep, now) else 0)

    # -- reload ------------------------------------------------------------------
    async def reload(self, settings: Settings | None = None, *, expect: tuple[int, int, int] | None = None) -> bool:
        """Re-read the config file (or take ``settings``) and apply it without dropping requests.

        Endpoints, policy (and its checkpoint), predictor, models, router, state and
        upstream limits change at once (a cache-aware policy built from unchanged settings is
        kept, with what its prefix indexes learned); listener addresses, the event loop, the body limit
        and Kubernetes discovery settings need a restart (a warning says so). An invalid new
        configuration is logged and the running one kept. Returns True when applied.

        ``expect`` (the watcher's): the file's :func:`file_signature` when its change settled;
        a file that changed again while it was read is not applied (the next poll reads it).
        """
        try:
            if settings is None:
                if self.config_path is None:
                    log.info("reload: no config file to reload")
                    return False
                # Off the event loop: a large file takes seconds to parse, and requests keep flowing.
                settings = await asyncio.to_thread(load_settings, self.config_path, overrides=self._overrides,
                                                   override_flags=self._override_flags)
                if expect is not None and file_signature(self.config_path) != expect:
                    self._config_sig = None  # read again at the next poll
                    log.info("reload: %s changed while it was read; reading it again", self.config_path)
                    return False
            built = await asyncio.to_thread(_Built, settings, len(settings.endpoints) or len(self.router.endpoints),
                                            say_prefix=settings.prefix != self.settings.prefix)
        except ConfigError as e:
            self.metrics.reloads.labels("error").inc()
            log.error("reload refused, keeping the running configuration: %s", e)
            return False
        except Exception as e:  # noqa: BLE001 - a reload must never stop a serving routerd
            self.metrics.reloads.labels("error").inc()
            log.error("reload refused, keeping the running configuration: unexpected %s: %s", type(e).__name__, e)
            return False
        old = self.settings
        for key in ("http", "grpc", "event_loop", "max_body_bytes", "kubernetes"):
            if getattr(old, key) != getattr(settings, key):
                log.warning("reload: %s changed; it takes effect after a restart", key)
        # The picker's listeners and mode (phasewise epp) are fixed at start: the running values stay.
        epp_fixed = ("host", "port", "health_port", "metrics_port", "mode")
        changed = [f for f in epp_fixed if getattr(old.epp, f) != getattr(settings.epp, f)]
        if changed:
            log.warning("reload: %s changed; takes effect at restart", ", ".join(f"epp.{f}" for f in changed))
            settings = settings.model_copy(update={"epp": settings.epp.model_copy(
                update={f: getattr(old.epp, f) for f in changed})})
        self.settings = settings
        self.profile = built.profile
        self.router.profile = built.profile
        self.predictor = built.predictor
        self.router.bucket_edges = built.edges
        self.router.configure(settings.router, settings.state.max_age_s)
        self.router.failure_cooldown_s = settings.upstream.failure_cooldown_s
        self.router.outlier = settings.upstream.outlier
        self.model_lister.refresh_s = settings.model_refresh_s
        self.router.set_default_models(settings.models)
        self.proxy.reconfigure()
        live = self.router.policy
        # What a cache-aware policy learned (its prefix indexes) survives a reload that changes
        # nothing it was built from: a ConfigMap edit of a timeout must not cost every endpoint
        # its cache affinity.
        keep = (self.router.reads_prefix and built.policy_name == self.router.policy_name
                and settings.policy == old.policy and settings.prefix == old.prefix
                and settings.router.near_tie == old.router.near_tie and built.profile == live.ctx.profile
                and tuple(built.edges) == tuple(live.ctx.bucket_edges))
        self.prefix = built.prefix
        self._wire_prefix()
        self.router.configure_prefix(settings.prefix.index_capacity_blocks)
        if keep:
            log.info("reload: policy %s unchanged; its prefix indexes are kept", settings.policy.name)
        else:
            self.router.set_policy(built.policy, settings.policy.name)
        self._static = self._static_endpoints(settings)
        self._apply_all_endpoints()
        if old.models != settings.models:
            # Which endpoints are read, and what an unknown one serves, depend on ``models``:
            # read every list now rather than after model_refresh_s.
            self.model_lister.poke_all()
        self.metrics.reloads.labels("ok").inc()
        log.info("reloaded: policy %s, endpoints: %d", settings.policy.name, len(self.router.endpoints))
        if old.prefix != settings.prefix or old.policy.name != settings.policy.name:
            self._log_prefix()
        return True

    async def _watch_config(self) -> None:
        """Poll the file; read a change once it has settled (``reload.settle_s``), so that a file
        being written (truncated, then filled) is never applied half-way."""
        assert self.config_path is not None
        while True:
            await asyncio.sleep(self.settings.reload.poll_interval_s)
            sig = file_signature(self.config_path)
            if sig is None or sig == self._config_sig:
                continue  # a missing file keeps the running configuration
            since = time.monotonic()
            said = False
            while sig is not None:
                await asyncio.sleep(self.settings.reload.settle_s)
                again = file_signature(self.config_path)
                if again == sig:
                    break
                sig = again
                if not said and time.monotonic() - since > 10.0:
                    said = True  # once per streak: say why nothing is applied
                    log.info("reload: %s keeps changing; waiting until it stays the same for %g s",
                             self.config_path, self.settings.reload.settle_s)
            if sig is None:
                continue
            self._config_sig = sig
            try:
                await self.reload(expect=sig)
            except Exception:  # noqa: BLE001 - keep watching whatever one reload did
                log.exception("reload failed")

    # -- the process -------------------------------------------------------------
    async def serve_forever(self, fronts: Sequence[Any] = ()) -> int:
        """Start, then run until SIGTERM/SIGINT (drain, stop, return 0); SIGHUP reloads.

        ``fronts``: more fronts on this daemon (``start()`` after it, ``stop()`` before it: the
        endpoint picker, :class:`routerd.epp.server.EppServer`)."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        hup = asyncio.Event()
        collector = CollectorPacer()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGHUP, hup.set)
        try:
            await self.start()
            for front in fronts:
                await front.start()
            # Collections between callbacks, never inside a decision (collector.py).
            collector.start()
            while not stop.is_set():
                waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(hup.wait())]
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                for w in waiters:
                    w.cancel()
                if hup.is_set() and not stop.is_set():
                    hup.clear()
                    await self.reload()
            await self.drain()
            return 0
        finally:
            try:
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                    loop.remove_signal_handler(sig)
                for front in reversed(fronts):
                    await front.stop()
                await self.stop()
            finally:
                await collector.stop()  # whatever the stops raised: CPython's collector back
            log.info("routerd stopped (pid %d)", os.getpid())
