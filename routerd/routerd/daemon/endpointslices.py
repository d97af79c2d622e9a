"""The Kubernetes endpoint source: routerd's instances from a Service's EndpointSlices.

:class:`EndpointSliceWatcher` lists the EndpointSlices labelled
``kubernetes.io/service-name=<service>`` and then watches them from the list's
resourceVersion. Whenever the watch fails -- a dropped connection, an API-server restart,
``410 Gone`` for a resourceVersion that is too old -- it lists again before watching
again, with exponential backoff. A watch that merely reconnects without listing loses
whatever happened while it was away (a deleted pod stays routed forever:
vllm-project/production-stack#1091); listing again cannot.

Every slice of the service is merged into one endpoint set and, when the set differs from
the one last delivered, handed complete to the :data:`~routerd.daemon.discovery.EndpointsCallback`
from the watcher's thread. :func:`endpoints_from_slices` is that translation, a pure function.

RBAC: the ServiceAccount needs ``list`` and ``watch`` on ``endpointslices`` in the API group
``discovery.k8s.io`` of the Service's namespace.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import random
import socket
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from routerd.daemon.discovery import DiscoveredEndpoint, EndpointsCallback

log = logging.getLogger("routerd.daemon.endpointslices")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"

# Dual-stack Services have one slice per address family listing the same pods: the IPv4
# address wins for a pod that appears in both.
_FAMILY_ORDER = {"IPv4": 0, "IPv6": 1, "FQDN": 2}


def _port(ports: Sequence[Mapping[str, Any]], name: str | None) -> int | None:
    """The number of the slice port called ``name``. A slice whose only port is unnamed (a
    Service with a single unnamed port) serves it under any name."""
    if name is None:
        return None
    for p in ports:
        if (p.get("name") or "") == name and p.get("port"):
            return int(p["port"])
    if len(ports) == 1 and not ports[0].get("name") and ports[0].get("port"):
        return int(ports[0]["port"])
    return None


def _is_ip(address: object) -> bool:
    if not isinstance(address, str):
        return False
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def endpoints_from_slices(
    slices: Iterable[Mapping[str, Any]],
    *,
    http_port_name: str = "http",
    state_port_name: str | None = "state",
    kv_events_port_name: str | None = "kv-events",
    skipped: list[str] | None = None,
    profile_label: str | None = None,
    profiles: Mapping[str, str] | None = None,
) -> list[DiscoveredEndpoint]:
    """Merge EndpointSlices (API JSON, camelCase) into routerd's endpoint set, sorted by name.

    An entry whose first address is not an IP address (empty, a host name, garbage: the API
    server checks only the slice's ``addressType`` loosely) is skipped, never dialled; one line
    per skipped entry naming the slice and the address is appended to ``skipped`` if given.

    - Each endpoint uses its first address (the API's rule for IPv4/IPv6 slices) and the
      slice's port called ``http_port_name``; a slice without that port contributes nothing.
      ``url`` is ``http://ip:port`` (IPv6 in brackets).
    - ``state_address`` is ``ip:port`` of the slice's ``state_port_name`` port, or None when
      the slice has no such port (or ``state_port_name`` is None).
    - ``kv_events`` is ``tcp://ip:port`` of the slice's ``kv_events_port_name`` port (vLLM's
      KV-event publisher), or None when it has none (the daemon then dials the pod's address
      at ``prefix.kv_events.port``).
    - ``ready`` is False when ``conditions.ready`` is False or ``conditions.terminating`` is
      True; a missing condition counts as ready / not terminating, as the API specifies.
    - ``name`` is ``targetRef.name`` (the pod), or the address when there is no targetRef.
    - ``profile`` is ``profiles[v]`` where the slice's label ``profile_label`` has value ``v``
      (the Service's labels are copied to its slices: one Service per engine group), else None
      (routerd's profile).
    - An endpoint listed more than once (in two slices while the controller moves it, or
      once per address family in a dual-stack Service) is kept once: the IPv4 copy first,
      then the copy in the slice whose name sorts first, as kube-proxy does.
    """
    def order(s: Mapping[str, Any]) -> tuple:
        return (_FAMILY_ORDER.get(s.get("addressType", ""), 3),
                (s.get("metadata") or {}).get("name", ""))

    out: dict[str, DiscoveredEndpoint] = {}
    for s in sorted(slices, key=order):
        ports = s.get("ports") or []
        http_port = _port(ports, http_port_name)
        if http_port is None:
            continue
        state_port = _port(ports, state_port_name)
        if state_port == http_port and (state_port_name or "") != http_port_name:
            state_port = None  # the single-unnamed-port fallback must not pose as the sidecar
        kv_port = _port(ports, kv_events_port_name)
        if kv_port == http_port and (kv_events_port_name or "") != http_port_name:
            kv_port = None  # nor as the KV-event publisher
        profile = None
        if profile_label and profiles:
            profile = profiles.get(((s.get("metadata") or {}).get("labels") or {}).get(profile_label))
        for ep in s.get("endpoints") or []:
            addresses = ep.get("addresses") or []
            if not addresses:
                continue
            addr = addresses[0]
            if not _is_ip(addr):
                if skipped is not None:
                    slice_name = (s.get("metadata") or {}).get("name", "?")
                    skipped.append(f"EndpointSlice {slice_name}: endpoint address {addr!r} is not an IP address")
                continue
            name = (ep.get("targetRef") or {}).get("name") or addr
            if name in out:
                continue
            cond = ep.get("conditions") or {}
            ready = cond.get("ready") is not False and cond.get("terminating") is not True
            out[name] = DiscoveredEndpoint(
                name=name,
                url=f"http://{_host(addr)}:{http_port}",
                state_address=None if state_port is None else f"{_host(addr)}:{state_port}",
                ready=ready,
                kv_events=None if kv_port is None else f"tcp://{_host(addr)}:{kv_port}",
                profile=profile,
            )
    return [out[k] for k in sorted(out)]


class WatchError(RuntimeError):
    """A watch answered with an HTTP error status, or streamed an ``ERROR`` event."""

    def __init__(self, status, reason: str) -> None:
        super().__init__(f"HTTP {status} {reason}")
        self.status = status
        self.reason = reason


class EndpointSliceWatcher:
    """Watch a Service's EndpointSlices in a daemon thread and report its endpoint set.

    ``on_update`` gets the complete set (sorted by name) after the first list, and again
    each time it changes; it is called from the watcher's thread. ``api_client`` is a
    ``kubernetes.client.ApiClient`` whose configuration the watcher copies into a client of
    its own (closed by :meth:`stop`; the caller's stays the caller's); by default one is
    built from the in-cluster service account, or else from the kubeconfig.
    """

    def __init__(
        self,
        namespace: str,
        service: str,
        on_update: EndpointsCallback,
        *,
        http_port_name: str = "http",
        state_port_name: str | None = "state",
        kv_events_port_name: str | None = "kv-events",
        api_client=None,
        watch_timeout_s: int = 300,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        on_skip: Callable[[str], None] | None = None,
        selector: str | None = None,
        profile_label: str | None = None,
        profiles: Mapping[str, str] | None = None,
    ) -> None:
        self.namespace = namespace
        self.service = service
        self.selector = selector
        """Label selector of the slices to watch; None: ``service``'s own."""
        self.source = service if not selector else f"EndpointSlices[{selector}]"
        """What the logs call the watched set."""
        self.profile_label = profile_label
        self.profiles = dict(profiles or {})
        """Profile by the value of the slices' ``profile_label`` (:func:`endpoints_from_slices`)."""
        self.on_update = on_update
        self.http_port_name = http_port_name
        self.state_port_name = state_port_name
        self.kv_events_port_name = kv_events_port_name
        self.watch_timeout_s = watch_timeout_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self._api_client = api_client
        self._owns_client = api_client is None
        """Whether :meth:`stop` closes the client: one this watcher built itself, from the
        environment or as a private copy of ``api_client``'s configuration (never the caller's)."""
        self.on_skip = on_skip
        """Called (from the watcher's thread) once per newly skipped entry, with its description."""
        self._skipped: set[str] = set()
        self._slices: dict[str, dict] = {}
        self._delivered: tuple[DiscoveredEndpoint, ...] | None = None
        self._stop = threading.Event()
        self._synced = threading.Event()
        self._resp = None
        """The open watch response, if any (guarded by ``_resp_lock``)."""
        self._resp_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        #: Lists done (the first one and every recovery), for tests and metrics.
        self.lists = 0

    # ---- lifecycle

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("EndpointSliceWatcher already started")
        if self._api_client is None:
            self._api_client = _default_api_client()
        else:
            private = _private_client(self._api_client)
            if private is not None:
                self._api_client, self._owns_client = private, True
        from kubernetes import client

        self._api = client.DiscoveryV1Api(self._api_client)
        self._thread = threading.Thread(
            target=self._run, name=f"endpointslices-{self.namespace}/{self.source}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop watching; no callback runs after this returns (unless it timed out)."""
        self._stop.set()
        t = self._thread
        if t is None or t is threading.current_thread():
            return
        end = time.monotonic() + timeout
        while t.is_alive() and time.monotonic() < end:
            # Repeated: a watch that is still connecting has no response to shut down yet.
            self._shut_down_watch()
            t.join(0.05)
        if t.is_alive():
            log.warning("EndpointSlice watcher of %s/%s did not stop within %.0f s",
                        self.namespace, self.source, timeout)
        if self._owns_client and not t.is_alive() and self._api_client is not None:
            # Its pooled TLS connections would otherwise be closed only by the garbage
            # collector, with a ResourceWarning.
            self._api_client.close()
            self._api_client = None

    def wait_synced(self, timeout: float | None = None) -> bool:
        """Wait until the first list has been delivered."""
        return self._synced.wait(timeout)

    @property
    def endpoints(self) -> tuple[DiscoveredEndpoint, ...]:
        """The set last delivered (empty before the first list)."""
        return self._delivered or ()

    # ---- the loop

    def _run(self) -> None:
        backoff = self.backoff_initial_s
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                rv = self._list()
                while not self._stop.is_set():
                    # A watch that ends normally (its server-side timeout) resumes from the
                    # last resourceVersion seen; any error leaves this loop and lists again.
                    rv = self._watch_from(rv)
                    backoff = self.backoff_initial_s
            except Exception as e:  # noqa: BLE001 -- any failure: list again after a pause
                if self._stop.is_set():
                    break
                if time.monotonic() - started > self.backoff_max_s:
                    backoff = self.backoff_initial_s  # it had been healthy for a while
                delay = backoff * (0.5 + random.random())
                log.warning("EndpointSlices of %s/%s: %s; listing again in %.1f s",
                            self.namespace, self.source, _describe(e), delay)
                self._stop.wait(delay)
                backoff = min(backoff * 2, self.backoff_max_s)

    def _selector(self) -> str:
        return self.selector or f"{SERVICE_NAME_LABEL}={self.service}"

    def _list(self) -> str:
        slices: dict[str, dict] = {}
        cont = None
        while True:
            kw = {"label_selector": self._selector(), "limit": 500,
                  "_preload_content": False, "_request_timeout": 30}
            if cont:
                kw["_continue"] = cont
            resp = self._api.list_namespaced_endpoint_slice(self.namespace, **kw)
            try:
                body = json.loads(resp.data)
            finally:
                resp.release_conn()
            for s in body.get("items") or []:
                slices[s["metadata"]["name"]] = s
            cont = (body.get("metadata") or {}).get("continue")
            if not cont:
                break
        self._slices = slices
        self.lists += 1
        self._deliver()
        self._synced.set()
        return body["metadata"]["resourceVersion"]

    def _watch_from(self, rv: str) -> str:
        """Follow one watch from resourceVersion ``rv``; return the last one seen.

        The watch response is held here rather than through ``kubernetes.watch.Watch``:
        ``Watch.stream`` clears its stop flag when its generator first runs, so a ``stop()``
        that lands between this thread's check and that first step is lost and the new watch
        lives on. Here :meth:`stop` shuts the held response's socket down, and a response that
        arrives after ``stop()`` is closed at once; every response is closed in ``finally``.

        Raises whatever the request raises, :class:`WatchError` for a non-2xx answer or an
        ``ERROR`` event (410 Gone included: the caller lists again), ``RuntimeError`` for an
        event type it does not know.
        """
        from kubernetes.watch.watch import iter_resp_lines

        if self._stop.is_set():
            return rv
        # timeout_seconds bounds the watch server-side; the read timeout is a margin over it.
        timeout = int(self.watch_timeout_s * (1 + random.random() * 0.2))
        log.debug("watching EndpointSlices of %s/%s from resourceVersion %s for %d s",
                  self.namespace, self.source, rv, timeout)
        resp = self._api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=self._selector(), resource_version=rv,
            allow_watch_bookmarks=True, timeout_seconds=timeout, watch=True,
            _preload_content=False, _request_timeout=(10, timeout + 30))
        with self._resp_lock:
            self._resp = resp
        try:
            if self._stop.is_set():
                return rv
            if not 200 <= resp.status <= 299:
                raise WatchError(resp.status, resp.reason or "")
            for line in iter_resp_lines(resp):
                if not line:
                    continue
                ev = json.loads(line)
                kind, obj = ev.get("type"), ev.get("object") or {}
                if kind == "ERROR":  # a Status object; 410 Gone once etcd compacted past rv
                    raise WatchError(obj.get("code"), f"{obj.get('reason')}: {obj.get('message')}")
                rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                name = (obj.get("metadata") or {}).get("name")
                if kind in ("ADDED", "MODIFIED") and name:
                    self._slices[name] = obj
                elif kind == "DELETED" and name:
                    self._slices.pop(name, None)
                elif kind == "BOOKMARK":
                    log.debug("bookmark at resourceVersion %s", rv)
                    continue
                else:
                    raise RuntimeError(f"unexpected watch event {kind!r}")
                self._deliver()
                if self._stop.is_set():
                    break
            return rv
        finally:
            with self._resp_lock:
                self._resp = None
            # close() shuts the connection's socket unless the response already returned it,
            # healthy, to the pool (a watch the server ended cleanly); the pool closes those.
            resp.close()
            resp.release_conn()

    def _shut_down_watch(self) -> None:
        """Unblock a watch read in the watcher's thread (called from :meth:`stop`)."""
        with self._resp_lock:
            resp = self._resp
            conn = getattr(resp, "connection", None) if resp is not None else None
            sock = getattr(conn, "sock", None) if conn is not None else None
            if sock is not None:
                try:
                    # Closing would race the reader for the TLS object's lock; a shutdown makes
                    # its read return at once, and the thread then closes the response itself.
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed or never connected

    def _deliver(self) -> None:
        if self._stop.is_set():
            return
        skipped: list[str] = []
        eps = tuple(endpoints_from_slices(self._slices.values(), http_port_name=self.http_port_name,
                                          state_port_name=self.state_port_name,
                                          kv_events_port_name=self.kv_events_port_name, skipped=skipped,
                                          profile_label=self.profile_label, profiles=self.profiles))
        for why in skipped:
            if why not in self._skipped:  # say it once per entry, not at every slice event
                log.warning("%s/%s: skipped: %s", self.namespace, self.source, why)
                if self.on_skip is not None:
                    self.on_skip(why)
        self._skipped = set(skipped)
        if eps == self._delivered:
            return
        self._delivered = eps
        log.info("EndpointSlices of %s/%s: endpoints %d (ready %d)", self.namespace, self.source,
                 len(eps), sum(e.ready for e in eps))
        try:
            self.on_update(list(eps))
        except Exception:  # noqa: BLE001 -- a callback bug must not stop discovery
            log.exception("endpoints callback failed")


def _describe(e: Exception) -> str:
    status = getattr(e, "status", None)
    if status:
        return f"HTTP {status} {getattr(e, 'reason', '')}".strip()
    return f"{type(e).__name__}: {e}"


def _default_api_client():
    from kubernetes import client, config

    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException:
        config.load_kube_config(client_configuration=cfg)
    cfg.retries = False  # see _private_client
    return client.ApiClient(cfg)


def _private_client(given):
    """The watcher's own ``ApiClient`` on a copy of ``given``'s configuration, with urllib3's
    retries off; None when ``given`` has no ``kubernetes.client.Configuration`` (a test fake).

    Why: the watcher retries by itself (list again, with backoff), and urllib3's own retry of
    a request whose connection broke (``connectionpool.urlopen``'s "Retrying ... after
    connection broken") opened connections that were never closed: the chance
    ``ResourceWarning: unclosed <ssl.SSLSocket>`` of issue 19 was traced to a socket made by
    that retry inside a watch request, after the API server was killed under the watch. Its
    own client also lets :meth:`EndpointSliceWatcher.stop` close every pooled connection.
    """
    import copy

    from kubernetes import client

    cfg = getattr(given, "configuration", None)
    if not isinstance(cfg, client.Configuration):
        return None
    cfg = copy.deepcopy(cfg)
    cfg.retries = False
    return client.ApiClient(cfg)
