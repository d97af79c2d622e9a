"""routerd's consumer of vLLM's KV-cache events: one ZMQ SUB socket per engine, feeding its index.

vLLM started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq"}'``
binds a PUB socket (default ``tcp://*:5557``, topic ``""``; ``vllm/config/kv_events.py``) and sends
one multipart message ``[topic, seq, payload]`` per scheduler step with cache events
(``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``; decoded by
:mod:`routerd.prefix.kv_wire`). :class:`KVEventSubscriber` connects a SUB socket to each engine
(``tcp://<pod ip>:5557``), subscribes to its topic, and applies every decoded batch, with its
sequence number, to that engine's :class:`~routerd.prefix.engine_index.EngineBlockIndex`, whose
rules decide when the index is stale (gaps, restarts, garbage, silence). llm-d's precise index
subscribes the same way (``llm-d/llm-d-kv-cache:pkg/kvevents/zmq_subscriber.go``); there a
subscriber feeds a worker pool, here the events are applied on routerd's event loop, where the
policies read the index, so no lock is needed.

Robustness, as a production router needs it:

* **garbage** (wrong frame count, a sequence frame not 8 bytes, a payload that is not a vLLM
  batch) is counted (:attr:`EndpointStats.malformed`) and marks the index stale through
  :meth:`EngineBlockIndex.record_malformed`; later good messages are applied as usual. Each
  stale reason is logged once per endpoint at WARNING (with the first malformed message's
  error), then at DEBUG; the first return to answering at INFO, later ones at DEBUG;
* **a flooding publisher** cannot starve the event loop: at most ``max_per_wake`` messages, and
  no more than ``burst_s`` of work (a batch of long prompts' blocks costs about 2 us per block
  to key), are handled per wake-up, then the consumer yields (``await asyncio.sleep(0)``) so
  routing, proxying and health checks run between bursts; ``RCVHWM`` bounds the messages queued in the
  socket (beyond it ZMQ drops at the publisher, which the index sees as a gap), and
  ``MAXMSGSIZE`` bounds one message (a larger one drops the connection; ZMQ reconnects);
* **a dead or restarted publisher**: the socket's monitor sees the connection close, and the
  index is cleared and stale at once (``disconnected``) until the publisher numbers from 0,
  clears or settles; ZMQ reconnects by itself (every 100 ms, backing off to
  ``reconnect_ivl_max_ms``; ZMTP heartbeats every 5 s notice a peer gone without a goodbye); a restarted vLLM numbers from 0 again, which the index detects;
  silence is checked every ``check_interval_s`` even when nothing arrives (the socket's receive
  timeout), so its ``silent`` transition is logged without a request asking;
* **teardown**: :meth:`remove` and :meth:`close` cancel the consumer task, close its socket with
  linger 0 (nothing pending is kept) and, for :meth:`close`, terminate the ZMQ context the
  subscriber made: no socket, task or context is left behind.

Call everything from routerd's event loop (asyncio; pyzmq's ``zmq.asyncio``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from zmq.utils.monitor import parse_monitor_message

from routerd.prefix.engine_index import EngineBlockIndex
from routerd.prefix.kv_wire import KVEventError, UnknownEventType, decode_batch, parse_frames

__all__ = ["EndpointStats", "KVEventSubscriber"]

log = logging.getLogger("routerd.kv_events")


@dataclass(slots=True)
class EndpointStats:
    """What one endpoint's consumer saw (counts since :meth:`KVEventSubscriber.add`)."""

    messages: int = 0
    """Multipart messages received, good or not."""
    malformed: int = 0
    """Messages that could not be decoded (bad frames or payload)."""
    errors: int = 0
    """Messages whose application failed unexpectedly (a bug; logged with its traceback once)."""
    reopened: int = 0
    """Sockets opened again after the publisher's connection closed (:meth:`KVEventSubscriber._watch`)."""
    unknown_events: int = 0
    """Batches refused whole for an event type the decoder does not know (counted in ``malformed`` too)."""


@dataclass(slots=True, eq=False)
class _Endpoint:
    name: str
    address: str
    topic: str
    index: EngineBlockIndex
    sock: zmq.asyncio.Socket
    shadow: zmq.Socket
    stats: EndpointStats = field(default_factory=EndpointStats)
    task: asyncio.Task | None = None
    last_reason: str | None = "no_events"
    logged: set[str] = field(default_factory=set)
    monitor: zmq.asyncio.Socket | None = None
    watch: asyncio.Task | None = None


class KVEventSubscriber:
    """Consumes vLLM KV events from many engines, one SUB socket and one task per engine.

    Args:
        rcvhwm: messages queued per socket before ZMQ stops reading (the publisher then drops
            them: the index sees a gap). vLLM's own PUB queue is 100,000 (``hwm``).
        max_per_wake: messages handled per event-loop wake-up before yielding.
        burst_s: seconds of work per wake-up after which the consumer yields even before
            ``max_per_wake`` messages (checked after each message).
        check_interval_s: how often (s) an idle endpoint's index checks its ``silent`` rule.
        max_message_bytes: largest message ZMQ receives (bytes, ``MAXMSGSIZE``); libzmq drops the
            connection on a larger one and does not reconnect by itself: the monitor
            (:meth:`_watch`) opens the socket again.
        max_batch_bytes: largest batch decoded (bytes); a larger one is counted as malformed
            (the index is stale) and skipped. A vLLM batch carries the token ids of the blocks
            cached in one scheduler step: tens of KB.
        reconnect_ivl_max_ms: most milliseconds between reconnection attempts (ZMQ backs off
            from 100 ms up to this).
        context: a ``zmq.asyncio.Context`` to use (not terminated by :meth:`close`); None: the
            subscriber makes its own.

    Raises:
        ValueError: a non-positive setting.
    """

    def __init__(
        self,
        *,
        rcvhwm: int = 10_000,
        max_per_wake: int = 256,
        burst_s: float = 0.002,
        check_interval_s: float = 1.0,
        max_message_bytes: int = 64 * 1024 * 1024,
        max_batch_bytes: int = 4 * 1024 * 1024,
        reconnect_ivl_max_ms: int = 5_000,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        for name, v in (("rcvhwm", rcvhwm), ("max_per_wake", max_per_wake), ("burst_s", burst_s),
                        ("check_interval_s", check_interval_s),
                        ("max_message_bytes", max_message_bytes), ("max_batch_bytes", max_batch_bytes),
                        ("reconnect_ivl_max_ms", reconnect_ivl_max_ms)):
            if not v > 0:
                raise ValueError(f"KVEventSubscriber: {name} must be > 0, got {v!r}")
        self.rcvhwm = rcvhwm
        self.max_per_wake = max_per_wake
        self.burst_s = burst_s
        self.check_interval_s = check_interval_s
        self.max_message_bytes = max_message_bytes
        self.max_batch_bytes = max_batch_bytes
        self.reconnect_ivl_max_ms = reconnect_ivl_max_ms
        self._own_ctx = context is None
        self._ctx = zmq.asyncio.Context() if context is None else context
        self._eps: dict[str, _Endpoint] = {}
        self._made: weakref.WeakSet[zmq.Socket] = weakref.WeakSet()
        self._closed = False

    # --- the endpoint set -------------------------------------------------------------------------

    def add(self, name: str, address: str, topic: str, index: EngineBlockIndex) -> None:
        """Subscribe to the engine ``name`` publishing at ``address`` (e.g. ``tcp://10.0.0.5:5557``)
        on ``topic`` (a prefix; ``""``: everything, vLLM's default), feeding ``index``.

        Connecting does not wait for the publisher: ZMQ connects (and reconnects) in the
        background. Needs a running event loop (the consumer is a task on it).

        Raises:
            ValueError: ``name`` already subscribed, or an address ZMQ cannot connect to
                (the message names the endpoint and the address).
            RuntimeError: after :meth:`close`, or with no running event loop.
        """
        if self._closed:
            raise RuntimeError("KVEventSubscriber is closed")
        loop = asyncio.get_running_loop()
        if name in self._eps:
            raise ValueError(f"kv events: endpoint {name!r} is already subscribed (remove it first)")
        sock = self._open(name, address, topic)
        ep = _Endpoint(name, address, topic, index, sock, zmq.Socket.shadow(sock.underlying))
        ep.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._eps[name] = ep
        ep.task = loop.create_task(self._consume(ep), name=f"kv-events:{name}")
        ep.watch = loop.create_task(self._watch(ep), name=f"kv-events-monitor:{name}")
        log.debug("kv events: %s subscribed to %s (topic %r)", name, address, topic)

    def _open(self, name: str, address: str, topic: str) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(zmq.SUB)
        self._made.add(sock)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, self.rcvhwm)
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, self.reconnect_ivl_max_ms)
            sock.setsockopt(zmq.RCVTIMEO, max(1, int(self.check_interval_s * 1000)))
            sock.setsockopt(zmq.IPV6, 1)
            # ZMTP heartbeats: a publisher that vanished without closing its connection (its
            # node lost) is noticed and reconnected to instead of waited on forever.
            sock.setsockopt(zmq.HEARTBEAT_IVL, 5_000)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 15_000)
            sock.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
            sock.connect(address)
        except (zmq.ZMQError, TypeError, ValueError) as e:
            sock.close(linger=0)
            raise ValueError(f"kv events: endpoint {name!r}: cannot connect to {address!r} ({e})") from None
        return sock

    async def _watch(self, ep: _Endpoint) -> None:
        """The connection's own events: a publisher that disconnected (an engine that died or
        restarted, or libzmq dropping a message over ``max_message_bytes``, after which it does not
        reconnect by itself) makes the index stale and cleared at once (``disconnected``: what it
        held may be gone, and batches sent meanwhile are lost), and the socket is opened again."""
        mon = ep.monitor
        try:
            while True:
                msg = await mon.recv_multipart()
                event = parse_monitor_message(msg)["event"]
                if event == zmq.EVENT_DISCONNECTED:
                    ep.index.engine_down("disconnected")
                    self._note(ep, detail="the publisher's connection closed")
                    self._reopen(ep)
                    return
        except (zmq.ZMQError, asyncio.CancelledError):
            return
        finally:
            mon.close(linger=0)

    def _reopen(self, ep: _Endpoint) -> None:
        """A fresh socket for ``ep`` (same address, topic, index and stats), from :meth:`_watch`."""
        if self._closed or self._eps.get(ep.name) is not ep:
            return
        old_task = ep.task
        if old_task is not None:
            old_task.cancel()  # its finally closes the old socket
        try:
            sock = self._open(ep.name, ep.address, ep.topic)
        except ValueError as e:
            log.warning("%s", e)
            return
        loop = asyncio.get_running_loop()
        ep.sock, ep.shadow = sock, zmq.Socket.shadow(sock.underlying)
        ep.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        ep.stats.reopened += 1
        ep.task = loop.create_task(self._consume(ep), name=f"kv-events:{ep.name}")
        ep.watch = loop.create_task(self._watch(ep), name=f"kv-events-monitor:{ep.name}")

    async def remove(self, name: str) -> bool:
        """Stop consuming ``name``'s events and close its socket; False if it was not subscribed."""
        ep = self._eps.pop(name, None)
        if ep is None:
            return False
        await self._stop(ep)
        return True

    async def close(self) -> None:
        """Remove every endpoint and terminate the ZMQ context the subscriber made. Idempotent."""
        if self._closed:
            return
        self._closed = True
        eps = list(self._eps.values())
        self._eps.clear()
        for ep in eps:
            await self._stop(ep)
        if self._own_ctx:
            self._ctx.destroy(linger=0)  # every socket is closed by now; destroy never waits on one

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    def names(self) -> list[str]:
        """Endpoints subscribed, in the order added."""
        return list(self._eps)

    def __contains__(self, name: object) -> bool:
        return name in self._eps

    def stats(self, name: str) -> EndpointStats:
        """``name``'s counters (the live object).

        Raises:
            KeyError: ``name`` is not subscribed.
        """
        return self._eps[name].stats

    def open_sockets(self) -> int:
        """Sockets this subscriber made that are still open (one per endpoint subscribed)."""
        return sum(1 for s in self._made if not s.closed)

    # --- consuming ----------------------------------------------------------------------------------

    async def _stop(self, ep: _Endpoint) -> None:
        tasks = [t for t in (ep.task, ep.watch) if t is not None]
        for task in tasks:
            task.cancel()
        # The consumers' CancelledError comes back as a result; our own cancellation propagates.
        await asyncio.gather(*tasks, return_exceptions=True)
        if ep.monitor is not None:
            ep.monitor.close(linger=0)
        ep.sock.close(linger=0)
        log.debug("kv events: %s unsubscribed from %s", ep.name, ep.address)

    async def _consume(self, ep: _Endpoint) -> None:
        sock, shadow, burst, budget = ep.sock, ep.shadow, self.max_per_wake, self.burst_s
        clock = time.perf_counter
        try:
            while True:
                try:
                    parts = await sock.recv_multipart()
                except zmq.Again:  # the receive timeout: nothing for check_interval_s
                    ep.index.check()
                    self._note(ep)
                    continue
                start = clock()
                self._handle(ep, parts)
                # Drain what is already queued without going back to the loop, up to the burst.
                for _ in range(burst - 1):
                    if clock() - start > budget:
                        break
                    try:
                        parts = shadow.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(ep, parts)
                self._note(ep)
                await asyncio.sleep(0)  # let the rest of routerd run between bursts
        except zmq.ZMQError as e:  # the socket itself failed (e.g. its context terminated)
            log.error("kv events: %s (%s): receiving stopped: %s", ep.name, ep.address, e)
        finally:
            sock.close(linger=0)

    def _handle(self, ep: _Endpoint, parts: list[bytes]) -> None:
        ep.stats.messages += 1
        seq: int | None = None
        try:
            _topic, seq, payload = parse_frames(parts)
            if len(payload) > self.max_batch_bytes:
                # Decoding and keying run on routerd's event loop: a batch this large would stall
                # every request for seconds (2.2 s for 13 MB). vLLM's batches hold one scheduler
                # step's blocks (max_num_batched_tokens / block_size, a few hundred): tens of KB.
                raise KVEventError(f"a batch of {len(payload)} bytes, over the {self.max_batch_bytes}-byte limit")
            batch = decode_batch(payload)
        except KVEventError as e:
            ep.stats.malformed += 1
            if isinstance(e, UnknownEventType):
                ep.stats.unknown_events += 1
            ep.index.record_malformed(seq)
            self._note(ep, detail=str(e))
            return
        try:
            ep.index.apply(batch, seq)
        except Exception:  # never let one batch stop the consumer; the index restarts from a loss
            ep.stats.errors += 1
            if "error" not in ep.logged:
                ep.logged.add("error")
                log.exception("kv events: %s (%s): applying batch %d failed", ep.name, ep.address, seq)
            ep.index.record_malformed(seq)

    def _note(self, ep: _Endpoint, detail: str | None = None) -> None:
        """Log the index's stale/answering transitions: each reason once at WARNING, then DEBUG."""
        reason = ep.index.stale_reason
        if reason == ep.last_reason:
            return
        ep.last_reason = reason
        if reason is None:
            first = "answering" not in ep.logged
            ep.logged.add("answering")
            log.log(logging.INFO if first else logging.DEBUG,
                    "kv events: %s (%s): precise prefix index up to date", ep.name, ep.address)
            return
        first = reason not in ep.logged
        ep.logged.add(reason)
        log.log(logging.WARNING if first else logging.DEBUG,
                "kv events: %s (%s): precise prefix index stale (%s)%s; its prefix matches fall back to "
                "the approximate index%s", ep.name, ep.address, reason, f": {detail}" if detail else "",
                "" if first else " (again)")
