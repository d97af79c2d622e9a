"""Client-connection limits of routerd's HTTP front: header-read, idle keep-alive and body-read
timeouts, and a maximum number of client connections (issue 15).

aiohttp's server closes an idle keep-alive connection after its ``keepalive_timeout`` but has
no bound on a client that connects and then sends its request headers byte by byte, or
nothing at all: such connections stay open for ever and, with a low file limit, lock normal
clients out. Web servers bound this (nginx ``client_header_timeout`` and
``client_body_timeout``, 60 s each; Envoy ``request_headers_timeout``); so does this module:

- every client connection is wrapped in :class:`_Conn`, a forwarding ``asyncio.Protocol``
  that records when it opened and when its last request ended, and hands every event to
  aiohttp's own ``RequestHandler`` unchanged;
- :meth:`Frontend.request_started` / :meth:`Frontend.request_ended` (called by the proxy's
  middleware) mark a connection as busy while a request is being handled;
- a sweep aborts each connection that is not handling a request and has gone past its bound:
  ``header_timeout_s`` after it opened without a complete request, ``keepalive_timeout_s`` after
  its last response if nothing came since (idle), or ``header_timeout_s`` after the first byte of
  its next request (sending it too slowly). aiohttp's own keep-alive timer is set past these
  (``Frontend.aiohttp_keepalive_s``): it would close a connection whose next request is half
  sent at ``keepalive_timeout_s``, and uncounted. It runs at the earliest bound of the connections it saw (at most
  :data:`MIN_SWEEP_GAP_S` late, so a burst of connections is not one sweep each), and at least
  every ``min(timeouts) / 4`` (at most 1 s) for connections whose bound moved meanwhile;
- past ``max_connections`` open connections, a new one gets a ``503`` and is closed at once.

The body-read bound is enforced by the proxy around ``request.read()``: 408, and the connection
is closed by a sweep :data:`MIN_SWEEP_GAP_S` later (:meth:`Frontend.close_after_answer`).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any, Callable

log = logging.getLogger("routerd.frontend")

#: Least time between two sweeps (s): how late past its bound a connection may close.
MIN_SWEEP_GAP_S = 0.02

_BUSY_503 = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
             b"Retry-After: 1\r\nContent-Length: 116\r\n\r\n"
             b'{"error": {"message": "routerd: too many client connections", "type": "service_unavailable_error", '
             b'"code": "too_many_connections"}}')


def effective_max_connections(configured: int) -> int:
    """``configured``, lowered to half the process's soft open-file limit (the other half is left
    for the upstream connections, the gRPC server and files), but not below 16 for that reason."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return configured
    if soft == resource.RLIM_INFINITY:
        return configured
    return min(configured, max(16, soft // 2))


class _Conn(asyncio.Protocol):
    """One client connection: aiohttp's handler ``h`` plus the times the sweep needs."""

    __slots__ = ("h", "front", "transport", "opened_at", "idle_since", "next_at", "busy", "requests", "refused",
                 "doomed")

    def __init__(self, h: Any, front: "Frontend") -> None:
        self.h = h
        self.front = front
        self.transport: asyncio.Transport | None = None
        self.opened_at = self.idle_since = 0.0
        self.next_at: float | None = None
        """When the first byte of the next request came after a response (None: idle since)."""
        self.busy = 0
        self.requests = 0
        self.refused = False
        self.doomed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if not self.front.opened(self, transport):
            self.refused = True
            return
        self.h.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.refused:
            if self.requests and not self.busy and self.next_at is None:
                self.next_at = self.front.clock()  # its next request begins: the header bound runs
            self.h.data_received(data)

    def eof_received(self) -> bool | None:
        return None if self.refused else self.h.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.front.closed(self)
        if not self.refused:
            self.h.connection_lost(exc)

    def pause_writing(self) -> None:
        if not self.refused:
            self.h.pause_writing()

    def resume_writing(self) -> None:
        if not self.refused:
            self.h.resume_writing()


class Frontend:
    """Tracks routerd's client connections and enforces the limits of ``http`` settings.

    Args:
        header_timeout_s: bound on receiving a complete request after connecting (s).
        keepalive_timeout_s: idle time after a response before the connection is closed (s).
        max_connections: open client connections allowed (see :func:`effective_max_connections`).
        on_close: called with a reason (``header_timeout``, ``idle_timeout``, ``too_many``) for
            each connection this module closes (a metric).
        clock: monotonic clock (s).
    """

    def __init__(self, *, header_timeout_s: float, keepalive_timeout_s: float, max_connections: int,
                 on_close: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.header_timeout_s = header_timeout_s
        self.keepalive_timeout_s = keepalive_timeout_s
        self.max_connections = max_connections
        self.on_close = on_close
        self.clock = clock
        self.conns: set[_Conn] = set()
        self._by_transport: dict[Any, _Conn] = {}
        self._sweep: asyncio.TimerHandle | None = None
        self._warned_full = False
        self._closed = False

    # -- the protocol factory ------------------------------------------------------
    def factory(self, make_handler: Callable[[], Any]) -> Callable[[], _Conn]:
        """A protocol factory for ``loop.create_server`` wrapping aiohttp's ``make_handler``."""
        return lambda: _Conn(make_handler(), self)

    def opened(self, c: _Conn, transport: asyncio.BaseTransport) -> bool:
        if len(self.conns) >= self.max_connections:
            if not self._warned_full:
                self._warned_full = True
                log.warning("%d client connections open (http.max_connections, after the file limit): new ones "
                            "get 503 until some close", len(self.conns))
            try:
                transport.write(_BUSY_503)  # type: ignore[attr-defined]
            finally:
                transport.close()
            if self.on_close is not None:
                self.on_close("too_many")
            return False
        c.opened_at = c.idle_since = self.clock()
        self.conns.add(c)
        self._by_transport[transport] = c
        if self._sweep is None:
            self._arm()
        return True

    def closed(self, c: _Conn) -> None:
        self.conns.discard(c)
        if c.transport is not None:
            self._by_transport.pop(c.transport, None)
        if len(self.conns) < self.max_connections:
            self._warned_full = False

    # -- request marks (the proxy's middleware) --------------------------------------
    def request_started(self, transport: Any) -> None:
        c = self._by_transport.get(transport)
        if c is not None:
            c.busy += 1
            c.requests += 1

    def request_ended(self, transport: Any) -> None:
        c = self._by_transport.get(transport)
        if c is not None:
            c.busy -= 1
            c.idle_since = self.clock()
            c.next_at = None

    def close_after_answer(self, transport: Any) -> None:
        """Close this connection once its current answer is written (a sweep soon after): used after
        a 408, when the rest of a half-sent body must not be waited for (aiohttp would otherwise
        linger, reading it, for up to 10 s)."""
        c = self._by_transport.get(transport)
        if c is not None:
            c.doomed = True
            if self._closed:
                return
            # The answer is written when the handler returns, before any timer runs: a sweep
            # MIN_SWEEP_GAP_S from now closes it (not the next periodic one, up to 1 s away).
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop: the next sweep closes it
                return
            due = loop.time() + MIN_SWEEP_GAP_S
            if self._sweep is None or self._sweep.when() > due:
                if self._sweep is not None:
                    self._sweep.cancel()
                self._arm(MIN_SWEEP_GAP_S)

    # -- the sweep --------------------------------------------------------------------
    @property
    def aiohttp_keepalive_s(self) -> float:
        """The keep-alive timeout to give aiohttp's server (s): past every bound of this module, so
        only the sweep closes a waiting connection (with its reason counted); a backstop."""
        return self.keepalive_timeout_s + self.header_timeout_s + 1.0

    @property
    def sweep_interval_s(self) -> float:
        return min(1.0, self.header_timeout_s / 4, self.keepalive_timeout_s / 4)

    def _arm(self, delay_s: float | None = None) -> None:
        self._sweep = asyncio.get_running_loop().call_later(
            self.sweep_interval_s if delay_s is None else delay_s, self.sweep)

    def sweep(self) -> int:
        """Abort every connection past its bound; returns how many. Re-arms itself while any is
        open: at the earliest bound still ahead (no sooner than :data:`MIN_SWEEP_GAP_S`), at the
        latest after :attr:`sweep_interval_s` (a new connection's bound is at least
        ``header_timeout_s`` away, four intervals)."""
        self._sweep = None
        now = self.clock()
        hdr, idle = self.header_timeout_s, self.keepalive_timeout_s
        late = []
        nxt = now + self.sweep_interval_s
        for c in self.conns:
            if c.busy:
                continue
            if c.doomed:
                if c.transport is not None:
                    c.transport.close()  # flushes the answer already written, then closes
                continue
            if c.requests == 0:
                due, why = c.opened_at + hdr, "header_timeout"
            elif c.next_at is not None:
                due, why = c.next_at + hdr, "header_timeout"
            else:
                due, why = c.idle_since + idle, "idle_timeout"
            if now > due:
                late.append((c, why))
            elif due < nxt:
                nxt = due
        for c, why in late:
            if c.transport is not None:
                c.transport.abort()  # a slow client gets no more of our time or buffers
            if self.on_close is not None:
                self.on_close(why)
        if self.conns:
            # Just past the bound: a connection is late only once strictly past it.
            self._arm(max(MIN_SWEEP_GAP_S, nxt - now + 0.001))
        return len(late)

    def close(self) -> None:
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
