"""How routerd consumes a sidecar: one long-lived WatchState stream per instance, reconnected on failure."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Callable

import grpc

from routerd.api.v1 import instance_state_pb2_grpc
from routerd.api.v1.instance_state_pb2 import InstanceState, WatchStateRequest

__all__ = ["InstanceStateWatcher", "CHANNEL_OPTIONS"]

log = logging.getLogger("routerd.sidecar.client")

_sleep = asyncio.sleep  # the backoff wait; tests record the delays through it

CHANNEL_OPTIONS = (
    # Notice a sidecar that vanished without closing the connection (node lost, network
    # partition) within ~15 s; routerd's staleness check covers the time in between.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
)
"""gRPC channel options of the watcher (the sidecar's ``SERVER_OPTIONS`` accept these pings)."""


class InstanceStateWatcher:
    """Subscribes to one sidecar's WatchState stream; reconnects with exponential backoff.

    ``address`` is the sidecar's ``host:port``. ``on_state`` is called on the event-loop
    thread with each snapshot, in the order the sidecar sent them; an exception it raises
    is logged and the watcher goes on. ``min_interval_s`` (s) asks the sidecar for at most
    one snapshot per that interval (0: every scrape). ``backoff_s`` is (first, max) wait in
    seconds before reconnecting: it doubles after each failed attempt up to max and goes
    back to first once a stream delivered a message. Each attempt uses a fresh channel,
    so a sidecar restarted on the same port is found at the next attempt, not after
    gRPC's own (up to 2 min) reconnect backoff.
    """

    def __init__(self, address: str, on_state: Callable[[InstanceState], None], *, min_interval_s: float = 0.0,
                 backoff_s: tuple[float, float] = (0.05, 2.0)) -> None:
        first, most = backoff_s
        if not (math.isfinite(min_interval_s) and min_interval_s >= 0):
            raise ValueError(f"min_interval_s must be a finite number of seconds >= 0, got {min_interval_s}")
        if not (0 < first <= most < math.inf):
            raise ValueError(f"backoff_s must be (first, max) seconds with 0 < first <= max, got {backoff_s}")
        self.address = address
        self._on_state = on_state
        self._min_interval_s = min_interval_s
        self._backoff = (first, most)
        self._connected = False
        self._closed = False
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task | None = None
        self.reconnects = 0
        """Streams that ended or failed and were retried (for metrics and tests)."""
        self.last_error: str = ""
        """Why the last stream ended ("" before any failure)."""

    @property
    def connected(self) -> bool:
        """True while a stream is delivering (from its first message until it fails or ends)."""
        return self._connected

    async def run(self) -> None:
        """Watch until cancelled or :meth:`aclose`: connect, WatchState, ``on_state`` per message.

        Never returns on its own; any stream error or end leads to a reconnect after the
        backoff. CancelledError propagates after the channel is closed.
        """
        if self._task is not None:
            raise RuntimeError(f"InstanceStateWatcher({self.address!r}).run() is already running")
        self._task = asyncio.current_task()
        delay = self._backoff[0]
        failures = 0  # attempts in a row that delivered nothing
        try:
            while not self._closed:
                delivered = await self._stream_once()
                self.reconnects += 1
                if delivered:
                    delay, failures = self._backoff[0], 0
                else:
                    failures += 1
                    if failures == 1:  # once per outage, not per retry
                        log.warning("cannot watch instance state at %s (%s); retrying with backoff up to %g s",
                                    self.address, self.last_error, self._backoff[1])
                await _sleep(delay)
                delay = min(delay * 2, self._backoff[1])
        finally:
            self._connected = False
            await self._close_channel()
            self._task = None

    async def aclose(self) -> None:
        """Stop for good: cancel the task running :meth:`run`, wait for it to end, close the channel."""
        self._closed = True
        task = self._task
        if task is not None and task is not asyncio.current_task() and not task.done():
            task.cancel()
            await asyncio.wait([task])  # unlike `await task`, does not swallow our own cancellation
        await self._close_channel()

    async def _stream_once(self) -> bool:
        """One connection and stream, until it fails or ends; True if it delivered a message."""
        delivered = False
        channel = self._channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        try:
            stub = instance_state_pb2_grpc.InstanceStateServiceStub(channel)
            call = stub.WatchState(WatchStateRequest(min_interval_s=self._min_interval_s))
            async for state in call:
                if not delivered:
                    delivered = True
                    self._connected = True
                    log.info("instance-state stream from %s connected", self.address)
                try:
                    self._on_state(state)
                except Exception:
                    log.exception("on_state for %s raised; the watcher goes on", self.address)
            self.last_error = "stream ended by the sidecar"
        except grpc.aio.AioRpcError as e:
            self.last_error = f"{e.code().name}: {e.details()}"
        except Exception as e:  # anything else from gRPC: retry like a failed stream, never die
            self.last_error = f"{type(e).__name__}: {e}"
            log.debug("instance-state stream from %s failed", self.address, exc_info=True)
        finally:
            was_connected, self._connected = self._connected, False
            await self._close_channel()
        if was_connected:
            log.warning("instance-state stream from %s lost (%s); reconnecting", self.address, self.last_error)
        return delivered

    async def _close_channel(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()
