"""The sidecar's gRPC server: ``phasewise.v1.InstanceStateService`` and ``grpc.health.v1``."""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import socket

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from routerd.api.v1 import instance_state_pb2, instance_state_pb2_grpc
from routerd.api.v1.instance_state_pb2 import InstanceState
from routerd.sidecar.board import StateBoard
from routerd.sidecar.scraper import DEFAULT_INTERVAL_S, DEFAULT_TIMEOUT_S, Scraper

__all__ = ["InstanceStateServicer", "Sidecar", "SERVICE_NAME", "SERVER_OPTIONS"]

log = logging.getLogger("routerd.sidecar")

SERVICE_NAME = instance_state_pb2.DESCRIPTOR.services_by_name["InstanceStateService"].full_name
"""``phasewise.v1.InstanceStateService``: the name the health service reports under (besides "")."""

SERVER_OPTIONS = (
    # Clients (InstanceStateWatcher) send keepalive pings every 10 s to notice a dead
    # peer; accept them, also between streams, instead of answering GOAWAY too_many_pings.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    # gRPC sets SO_REUSEPORT by default, so a second sidecar on a taken port would bind
    # silently and share its connections; fail at start instead.
    ("grpc.so_reuseport", 0),
)
"""gRPC server options that let :class:`~routerd.sidecar.client.InstanceStateWatcher` keepalives through."""


class InstanceStateServicer(instance_state_pb2_grpc.InstanceStateServiceServicer):
    """Serves the snapshots of a :class:`StateBoard`: GetState and WatchState.

    A watcher holds only an await on the board (no task, no queue), so when its client
    cancels, gRPC cancels the handler and nothing is left behind.
    """

    def __init__(self, board: StateBoard) -> None:
        self._board = board
        self._watchers = 0

    @property
    def watchers(self) -> int:
        """WatchState streams open now."""
        return self._watchers

    async def GetState(self, request, context) -> InstanceState:  # noqa: N802 (gRPC method name)
        """The latest snapshot (``healthy=False, error="not scraped yet"`` before the first scrape)."""
        return self._board.latest

    async def WatchState(self, request, context):  # noqa: N802
        """The latest snapshot at once, then each newer one, at most one per ``min_interval_s`` seconds.

        Right after start, the first message waits for the first scrape (at most the
        scrape timeout), so a watcher never sees the placeholder that GetState returns then.

        Between two sends only the newest snapshot is kept: the sidecar queues nothing per
        client beyond what gRPC's flow-control window buffers, and a slow client skips
        snapshots rather than falling further behind. Ends (status OK) when the server
        shuts down.
        An invalid ``min_interval_s`` (negative, NaN or infinite) is INVALID_ARGUMENT.
        """
        min_interval_s = request.min_interval_s
        if not (math.isfinite(min_interval_s) and min_interval_s >= 0):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"min_interval_s must be a finite number of seconds >= 0, got {min_interval_s}")
        self._watchers += 1
        try:
            state = self._board.latest
            if state.sequence == 0:
                # Not scraped yet (the sidecar just started): wait for the first real
                # snapshot rather than send the placeholder's zeros.
                state = await self._board.wait_newer(0)
                if state is None:
                    return
            yield state
            while True:
                if not await self._board.sleep(min_interval_s):
                    return
                newer = await self._board.wait_newer(state.sequence)
                if newer is None:
                    return
                state = newer
                yield state
        finally:
            self._watchers -= 1


class Sidecar:
    """A :class:`Scraper` of one vLLM instance plus the gRPC server that publishes its state.

    ``listen`` is ``HOST:PORT`` as gRPC takes it (``[::]:50051``, ``127.0.0.1:0`` for a
    free port). The health service reports NOT_SERVING until the first successful scrape,
    SERVING while scrapes succeed and NOT_SERVING while they fail, under both the empty
    service name and ``phasewise.v1.InstanceStateService``. State changes (healthy /
    unhealthy) are logged once each, not per scrape.
    """

    def __init__(
        self,
        metrics_url: str,
        *,
        listen: str,
        instance: str,
        endpoint: str = "",
        interval_s: float = DEFAULT_INTERVAL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.listen = listen
        self.scraper = Scraper(metrics_url, instance=instance, endpoint=endpoint, interval_s=interval_s,
                               timeout_s=timeout_s, on_health_change=self._health_changed)
        self.servicer = InstanceStateServicer(self.scraper.board)
        self._health = health_aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._scrape_task: asyncio.Task | None = None
        self.port: int | None = None
        """The bound port, once :meth:`start` returned."""

    async def start(self) -> int:
        """Bind, start serving and scraping; returns the bound port.

        Raises OSError when ``listen`` cannot be bound (address in use, bad host).
        """
        _check_bindable(self.listen)
        server = grpc.aio.server(options=SERVER_OPTIONS)
        instance_state_pb2_grpc.add_InstanceStateServiceServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            port = server.add_insecure_port(self.listen)
        except RuntimeError as e:  # grpc reports a failed bind as RuntimeError
            await server.stop(None)
            raise OSError(f"cannot bind: {e}") from None
        await server.start()
        self._server, self.port = server, port
        self._scrape_task = asyncio.create_task(self.scraper.run(), name=f"scrape {self.scraper.metrics_url}")
        log.info("instance %s: serving InstanceStateService and grpc.health.v1 on port %d, scraping %s every %g s",
                 self.scraper.instance, port, self.scraper.metrics_url, self.scraper.interval_s)
        return port

    async def serve_until(self, stop: asyncio.Event) -> None:
        """Wait until ``stop`` is set (e.g. by a signal handler), then :meth:`stop`.

        Re-raises the error if the scrape loop ever dies of one, after stopping: a sidecar
        that no longer scrapes must not go on serving its last state as fresh.
        """
        if self._scrape_task is None:
            raise RuntimeError("serve_until() before start()")
        scrape = self._scrape_task
        stop_waiter = asyncio.create_task(stop.wait(), name="sidecar stop")
        try:
            await asyncio.wait({stop_waiter, scrape}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_waiter.cancel()
            failure = scrape.exception() if scrape.done() and not scrape.cancelled() else None
            await self.stop()
        if failure is not None:
            raise failure

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop scraping, end every WatchState stream, report NOT_SERVING and stop the server.

        In-flight unary calls get up to ``grace_s`` seconds to finish.
        """
        task, self._scrape_task = self._scrape_task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])  # never raises: a loop that died of an error is serve_until's to report
            if not task.cancelled():
                task.exception()  # mark it retrieved
        self.scraper.board.close()
        await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None

    async def _health_changed(self, state: InstanceState) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if state.healthy else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)
        if state.healthy:
            log.info("instance %s: healthy (%s)", state.instance, self.scraper.metrics_url)
        else:
            log.warning("instance %s: unhealthy: %s", state.instance, state.error)


def _check_bindable(listen: str) -> None:
    """Raise OSError (with the system's reason) if ``HOST:PORT`` cannot be bound.

    gRPC would also fail, but only after logging its own multi-line C-core error; this
    gives the one-line reason first.
    """
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"cannot resolve {host!r}: {e.strerror}") from None
    family, type_, proto, _, addr = infos[0]
    try:
        with socket.socket(family, type_, proto) as s:
            # As gRPC does: connections of a previous server on this port in TIME_WAIT
            # must not block a restart, while a live listener still does.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
    except OSError as e:
        if e.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            error = OSError(f"cannot bind: {e.strerror}")
            error.errno = e.errno
            raise error from None
        # Anything else (e.g. "[::]" on a host without IPv6, where gRPC falls back to
        # IPv4) is left for gRPC to decide.
