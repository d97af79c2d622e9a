"""routerd.daemon.kv_events: a real ZMQ publisher on loopback sending vLLM-format batches to the subscriber.

The publisher is an XPUB socket (a PUB that also hands its user the subscriptions it receives), so a
test knows when the subscriber's subscription has arrived and nothing it publishes after is lost to
ZMQ's slow-joiner window; no sleeps stand in for synchronisation, only polling for a condition with a
deadline.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
import warnings

import pytest
import zmq

from routerd.daemon.kv_events import KVEventSubscriber
from routerd.prefix.engine_index import EngineBlockIndex
from routerd.prefix.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, encode_batch, frames
from routerd.prefix.text import token_prefix_blocks

BS = 16
A, B, C = list(range(100, 116)), list(range(200, 216)), list(range(300, 316))
DEADLINE_S = 20.0


def req(*blocks):
    return token_prefix_blocks([t for b in blocks for t in b], BS)


def stored(hashes, parent, *blocks):
    return BlockStored(list(hashes), parent, [t for b in blocks for t in b], BS, None, "GPU", None)


class Publisher:
    """One vLLM-like publisher process: numbered batches on a PUB socket bound on loopback."""

    def __init__(self, port: int | None = None, topic: bytes = b""):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # queue everything: the tests count what arrives
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, a reopened socket's too
        if port is None:
            self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        else:
            self.port = port
            for _ in range(200):  # the previous publisher's listener may take a moment to go
                try:
                    self.sock.bind(f"tcp://127.0.0.1:{port}")
                    break
                except zmq.ZMQError:
                    time.sleep(0.01)
            else:
                raise RuntimeError(f"port {port} stayed busy")
        self.topic = topic
        self.seq = 0

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    async def wait_for(self, prefix: bytes) -> bytes:
        """The next (un)subscription message starting with ``prefix`` (1: subscribe, 0: unsubscribe)."""
        end = time.monotonic() + DEADLINE_S
        while time.monotonic() < end:
            try:
                msg = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                await asyncio.sleep(0.002)
                continue
            if msg.startswith(prefix):
                return msg
        raise AssertionError(f"no message {prefix!r}... from the subscriber within {DEADLINE_S} s")

    def send(self, *events, seq: int | None = None, layout: str = "map"):
        if seq is not None:
            self.seq = seq
        payload = encode_batch(EventBatch(time.time(), list(events), 0), layout)
        self.sock.send_multipart(frames(self.topic, self.seq, payload))
        self.seq += 1

    def raw(self, parts):
        self.sock.send_multipart(parts)

    def close(self):
        self.sock.close(linger=0)
        self.ctx.term()


async def until(cond, what: str):
    end = time.monotonic() + DEADLINE_S
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


def index(**kw) -> EngineBlockIndex:
    kw.setdefault("stale_after_s", None)
    return EngineBlockIndex(BS, **kw)


async def subscribed(sub: KVEventSubscriber, pub: Publisher, name: str, idx: EngineBlockIndex, topic: str = ""):
    sub.add(name, pub.address, topic, idx)
    await pub.wait_for(b"\x01" + topic.encode())


def run(coro_fn):
    """Run an async test; afterwards nothing ZMQ-made may be left to collect (no ResourceWarning)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(coro_fn())
        gc.collect()
    leaks = [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert not leaks, [str(w.message) for w in leaks]


# --- tests ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["array", "map", "map-batch"])
def test_stored_blocks_show_in_cached_blocks(layout):
    async def main():
        pub, sub, idx = Publisher(), KVEventSubscriber(), index()
        try:
            await subscribed(sub, pub, "e0", idx)
            pub.send(layout=layout)  # seq 0: a publisher that just started
            pub.send(stored([11, 12], None, A, B), layout=layout)
            pub.send(stored([13], 12, C), BlockRemoved([999], "GPU"), layout=layout)
            await until(lambda: idx.batches_applied == 3, "3 batches")
            assert idx.stale_reason is None
            assert idx.cached_blocks(req(A, B, C)) == 3 and idx.cached_blocks(req(B)) == 0
            assert sub.stats("e0").messages == 3 and sub.stats("e0").malformed == 0
        finally:
            await sub.close()
            pub.close()

    run(main)


def test_a_topic_filters_and_two_endpoints_feed_their_own_index():
    async def main():
        p1, p2 = Publisher(topic=b"kv@10.0.0.1@m"), Publisher()
        sub = KVEventSubscriber()
        i1, i2 = index(), index()
        try:
            await subscribed(sub, p1, "e1", i1, topic="kv@10.0.0.1")
            await subscribed(sub, p2, "e2", i2)
            p1.send(stored([1], None, A))  # seq 0
            p2.send(stored([1], None, B))
            await until(lambda: i1.batches_applied == 1 and i2.batches_applied == 1, "one batch each")
            assert (i1.cached_blocks(req(A)), i1.cached_blocks(req(B))) == (1, 0)
            assert (i2.cached_blocks(req(A)), i2.cached_blocks(req(B))) == (0, 1)
            assert sub.names() == ["e1", "e2"] and "e1" in sub
        finally:
            await sub.close()
            p1.close()
            p2.close()

    run(main)


def test_a_sequence_gap_marks_the_index_stale():
    async def main():
        pub, sub, idx = Publisher(), KVEventSubscriber(), index()
        try:
            await subscribed(sub, pub, "e0", idx)
            pub.send(stored([1], None, A))
            pub.send(stored([2], 1, B))
            pub.send(BlockRemoved([1]), seq=5)  # 2, 3, 4 never sent: as if ZMQ had dropped them
            await until(lambda: idx.batches_applied == 3, "3 batches")
            assert idx.stale_reason == "gap" and idx.batches_missed == 3
            assert idx.cached_blocks(req(A)) is None
        finally:
            await sub.close()
            pub.close()

    run(main)


def test_a_restarted_publisher_on_the_same_port_is_detected():
    async def main():
        pub, sub, idx = Publisher(), KVEventSubscriber(), index()
        try:
            await subscribed(sub, pub, "e0", idx)
            pub.send(stored([1], None, A))
            pub.send(stored([2], 1, B))
            await until(lambda: idx.batches_applied == 2, "2 batches")
            assert idx.cached_blocks(req(A, B)) == 2
            port = pub.port
            pub.close()  # the engine dies; a new one binds the same port and numbers from 0
            pub = Publisher(port)
            await pub.wait_for(b"\x01")  # ZMQ reconnected the subscriber by itself
            pub.send(stored([7], None, C))
            await until(lambda: idx.restarts == 1, "the restart")
            assert idx.stale_reason is None
            assert idx.cached_blocks(req(A)) == 0 and idx.cached_blocks(req(C)) == 1
            # The socket's monitor saw the connection close: stale and cleared at once
            # (disconnected), then the new process's batch 0 made it exact again.
            assert idx.stale_transitions["disconnected"] == 1
            assert idx.recoveries["fresh_start"] == 2
        finally:
            await sub.close()
            pub.close()

    run(main)


def test_a_message_over_the_size_limit_reconnects_and_a_batch_over_the_batch_limit_is_skipped():
    async def main():
        pub, sub, idx = Publisher(), KVEventSubscriber(max_message_bytes=64 * 1024, max_batch_bytes=8 * 1024), index()
        try:
            await subscribed(sub, pub, "e0", idx)
            pub.send(stored([1], None, A))  # seq 0
            await until(lambda: idx.batches_applied == 1, "the first batch")
            pub.raw([b"", (1).to_bytes(8, "big"), b"\x00" * 10_000])  # over the batch limit: skipped
            await until(lambda: idx.batches_malformed == 1, "the large batch counted as malformed")
            assert idx.stale_reason == "malformed" and sub.stats("e0").messages == 2
            pub.raw([b"", (2).to_bytes(8, "big"), b"\x00" * 100_000])  # over MAXMSGSIZE: libzmq drops us
            await until(lambda: sub.stats("e0").reopened == 1, "the dropped connection noticed, the socket reopened")
            assert idx.stale_reason == "disconnected" and idx.size == 0  # stale and cleared
            await pub.wait_for(b"\x01")  # the new socket subscribed
            pub.send(AllBlocksCleared(), stored([5], None, B), seq=3)
            await until(lambda: idx.stale_reason is None, "the index exact again after the clear")
            assert idx.cached_blocks(req(B)) == 1 and idx.cached_blocks(req(A)) == 0
        finally:
            await sub.close()
            pub.close()
        assert sub.open_sockets() == 0

    run(main)


def test_malformed_messages_are_counted_logged_once_and_do_not_stop_later_ones(caplog):
    caplog.set_level(logging.DEBUG, logger="routerd.kv_events")

    async def main():
        pub, sub, idx = Publisher(), KVEventSubscriber(), index()
        try:
            await subscribed(sub, pub, "e0", idx)
            pub.send(stored([1], None, A))  # seq 0
            pub.raw([b"", (1).to_bytes(8, "big")])  # two frames
            pub.raw([b"", b"\x00\x01", b"\x90"])  # a 2-byte sequence frame
            pub.raw([b"", (1).to_bytes(8, "big"), b"\xc1"])  # not msgpack
            pub.raw([b"", (2).to_bytes(8, "big"), b"\x93\xa1x\x90\xc0"])  # ts not a number
            pub.send(AllBlocksCleared(), stored([5], None, B), seq=3)
            await until(lambda: idx.batches_applied == 2, "the good batch after the garbage")
            st = sub.stats("e0")
            assert (st.messages, st.malformed, idx.batches_malformed) == (6, 4, 4)
            assert idx.stale_reason is None and idx.recoveries["cleared"] == 1  # AllBlocksCleared: exact again
            assert idx.cached_blocks(req(B)) == 1 and idx.cached_blocks(req(A)) == 0
            assert idx.batches_missed == 0  # the numbered malformed ones kept the sequence
        finally:
            await sub.close()
            pub.close()

    run(main)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    msg = warned[0].getMessage()
    assert "e0" in msg and "stale (malformed)" in msg and "expected 3 frames" in msg


async def _flood(n: int, **sub_kw) -> int:
    """Publish ``n`` alternating store/remove batches from a thread; returns how many times a
    concurrent task was scheduled while the subscriber absorbed them."""
    pub, idx = Publisher(), index()
    sub = KVEventSubscriber(**sub_kw)
    ticks = 0
    done = asyncio.Event()

    async def ticker():
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0)

    store = encode_batch(EventBatch(1.0, [stored([1], None, A)], 0))
    remove = encode_batch(EventBatch(1.0, [BlockRemoved([1], "GPU")], 0))

    def flood():  # the publisher's own thread, as in vLLM: the event loop stays free
        for i in range(n):
            pub.sock.send_multipart(frames(b"", i, remove if i % 2 else store))

    try:
        await subscribed(sub, pub, "e0", idx)
        t = asyncio.get_running_loop().create_task(ticker())
        th = threading.Thread(target=flood)
        th.start()
        try:
            await until(lambda: idx.batches_applied == n, f"{n} batches")
        finally:
            th.join()
            done.set()
            await t
        assert idx.batches_missed == 0 and idx.stale_reason is None and idx.size == 0
        assert sub.stats("e0").messages == n
    finally:
        await sub.close()
        pub.close()
    return ticks


def test_a_flood_is_absorbed_while_other_tasks_keep_running():
    n, burst = 50_000, 64
    ticks = []
    run(lambda: _flood_into(ticks, n, max_per_wake=burst))
    # At most `burst` messages per loop iteration, and the ticker runs in every iteration.
    assert ticks[0] >= n // burst - 2, ticks


def test_the_time_budget_ends_a_burst_early():
    n = 2_000
    ticks = []
    run(lambda: _flood_into(ticks, n, max_per_wake=10_000, burst_s=1e-9))  # one message per wake-up
    assert ticks[0] >= n - 2, ticks


async def _flood_into(out: list, n: int, **kw) -> None:
    out.append(await _flood(n, **kw))


def test_remove_stops_consumption_and_close_leaves_nothing_behind():
    async def main():
        pub, sub, idx = Publisher(), KVEventSubscriber(), index()
        try:
            await subscribed(sub, pub, "e0", idx)
            pub.send(stored([1], None, A))
            await until(lambda: idx.batches_applied == 1, "a batch")
            assert sub.open_sockets() == 1
            assert await sub.remove("e0") is True
            assert await sub.remove("e0") is False
            assert "e0" not in sub and sub.names() == [] and sub.open_sockets() == 0
            assert asyncio.all_tasks() == {asyncio.current_task()}
            await pub.wait_for(b"\x00")  # the publisher saw the subscriber go
            pub.send(stored([2], 1, B))
            assert idx.batches_applied == 1
            sub.add("e0", pub.address, "", idx)  # the name can be used again
            await pub.wait_for(b"\x01")
            with pytest.raises(ValueError, match="already subscribed"):
                sub.add("e0", pub.address, "", idx)
            with pytest.raises(ValueError, match=r"'bad'.*'nowhere:1'"):
                sub.add("bad", "nowhere:1", "", index())
            assert sub.open_sockets() == 1
        finally:
            await sub.close()
            pub.close()
        assert sub.closed and sub.open_sockets() == 0
        assert asyncio.all_tasks() == {asyncio.current_task()}
        with pytest.raises(RuntimeError, match="closed"):
            sub.add("e1", pub.address, "", index())
        await sub.close()  # idempotent

    run(main)


def test_silence_is_noticed_while_nothing_arrives(caplog):
    caplog.set_level(logging.WARNING, logger="routerd.kv_events")
    now = [0.0]

    async def main():
        pub, idx = Publisher(), index(stale_after_s=5.0, clock=lambda: now[0])
        sub = KVEventSubscriber(check_interval_s=0.01)
        try:
            await subscribed(sub, pub, "e0", idx)
            pub.send(stored([1], None, A))
            await until(lambda: idx.batches_applied == 1, "a batch")
            idx.note_dispatch(4)
            now[0] = 6.0  # nothing published for 6 s of the index's clock
            await until(lambda: any("stale (silent)" in r.getMessage() for r in caplog.records),
                        "the silent warning, without any request asking the index")
            assert idx.stale_reason == "silent"
            pub.send(stored([2], 1, B))
            await until(lambda: idx.stale_reason is None, "the resume")
            assert idx.recoveries["resumed"] == 1
        finally:
            await sub.close()
            pub.close()

    run(main)
