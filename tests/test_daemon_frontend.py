"""routerd's client-connection limits (issue 15), on loopback with raw sockets: clients that send
nothing, send their headers or body byte by byte, or sit idle on keep-alive are closed within
the configured bounds, past ``max_connections`` a client gets 503, and normal requests are
answered meanwhile."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from daemon_fakes import FakeBackend, sample, start_daemon

REQUEST = json.dumps({"model": "m", "prompt": "p", "max_tokens": 2}).encode()
HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(REQUEST))


async def _closed_within(reader: asyncio.StreamReader, bound_s: float) -> tuple[float, bytes]:
    """(seconds until routerd closed the connection, what it sent before); fails past ``bound_s``."""
    t0 = time.monotonic()
    try:
        data = await asyncio.wait_for(reader.read(), bound_s)
    except ConnectionResetError:
        # Closed while bytes the client sent were still unread on routerd's side (a header
        # dribbled in after the deadline): the kernel answers the close with a reset, not a FIN.
        data = b""
    return time.monotonic() - t0, data


async def _normal(base: str, n: int) -> list[int]:
    async with aiohttp.ClientSession() as s:
        async def one():
            async with s.post(base + "/v1/completions", data=REQUEST,
                              headers={"Content-Type": "application/json"}) as r:
                await r.read()
                return r.status
        return list(await asyncio.gather(*(one() for _ in range(n))))


def test_silent_slow_header_and_slow_body_clients_are_closed_and_normal_ones_served():
    async def main():
        b = await FakeBackend("b0").start()
        d = await start_daemon([b], http={"host": "127.0.0.1", "port": 0, "header_timeout_s": 1.0,
                                          "body_timeout_s": 1.0, "keepalive_timeout_s": 30.0})
        port = d.http_port
        base = f"http://127.0.0.1:{port}"
        opened: list = []  # every client connection, closed at the end whatever happened

        async def connect():
            opened.append(await asyncio.open_connection("127.0.0.1", port))
            return opened[-1]

        try:
            silent = [await connect() for _ in range(50)]
            slow_hdr_r, slow_hdr_w = await connect()
            slow_body_r, slow_body_w = await connect()
            slow_body_w.write(HEAD + REQUEST[:5])  # headers whole, then the body stalls

            async def dribble():  # one header byte per 0.2 s: 1 s lets through only 5 of them
                try:
                    for byte in HEAD:
                        slow_hdr_w.write(bytes([byte]))
                        await asyncio.sleep(0.2)
                except ConnectionError:
                    pass

            task = asyncio.create_task(dribble())
            # Served beside the slow ones. (No gauge read here: on a loaded machine the 20
            # requests can outlast the 1 s header timeout, and the gauge would already have
            # dropped; the closed counts below show that all 51 were open and timed out.)
            assert await _normal(base, 20) == [200] * 20
            # Closed within the bound plus a sweep (0.25 s); 8 s leaves room for a loaded machine.
            for r, _ in silent:
                _, data = await _closed_within(r, 8.0)
                assert data == b""  # aborted without an answer: they never asked anything
            await _closed_within(slow_hdr_r, 8.0)
            task.cancel()
            _, answer = await _closed_within(slow_body_r, 8.0)
            assert answer.startswith(b"HTTP/1.1 408 ") and b'"code": "request_timeout"' in answer
            assert sample(d, "phasewise_client_connections_closed_total", reason="header_timeout") == 51
            assert sample(d, "phasewise_rejections_total", reason="body_timeout") == 1
            assert sample(d, "phasewise_requests_total", code="408") == 1
            assert await _normal(base, 5) == [200] * 5
        finally:
            for _, w in opened:  # even when an assertion failed: no socket outlives the test
                w.close()
            await d.stop()
            await b.stop()

    asyncio.run(main())


def test_an_idle_keep_alive_connection_is_closed_after_its_timeout():
    async def main():
        b = await FakeBackend("b0").start()
        d = await start_daemon([b], http={"host": "127.0.0.1", "port": 0, "keepalive_timeout_s": 0.5,
                                          "header_timeout_s": 5.0})
        try:
            r, w = await asyncio.open_connection("127.0.0.1", d.http_port)
            w.write(HEAD + REQUEST)
            status = await asyncio.wait_for(r.readline(), 10)
            assert status.startswith(b"HTTP/1.1 200")
            took, _ = await _closed_within(r, 15.0)  # aiohttp's keep-alive timer (or our sweep) closes it
            assert took >= 0.3  # not at once: it was kept alive
            w.close()
        finally:
            await d.stop()
            await b.stop()

    asyncio.run(main())


def test_past_max_connections_a_client_gets_503_and_the_slots_free_up():
    async def main():
        b = await FakeBackend("b0").start()
        d = await start_daemon([b], http={"host": "127.0.0.1", "port": 0, "max_connections": 5,
                                          "header_timeout_s": 1.0})
        port = d.http_port
        try:
            hogs = [await asyncio.open_connection("127.0.0.1", port) for _ in range(5)]
            await asyncio.sleep(0.1)
            r, w = await asyncio.open_connection("127.0.0.1", port)
            _, answer = await _closed_within(r, 10.0)
            assert answer.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in answer
            assert sample(d, "phasewise_client_connections_closed_total", reason="too_many") == 1
            for hr, _ in hogs:  # the idle hogs are closed by the header timeout...
                await _closed_within(hr, 8.0)
            # ...and normal clients get in again.
            assert await _normal(f"http://127.0.0.1:{port}", 3) == [200] * 3
            for _, hw in [*hogs, (r, w)]:
                hw.close()
        finally:
            await d.stop()
            await b.stop()

    asyncio.run(main())


def test_the_connection_limit_follows_the_open_file_limit(monkeypatch):
    import resource

    from routerd.daemon import frontend

    monkeypatch.setattr(resource, "getrlimit", lambda _which: (1024, 4096))
    assert frontend.effective_max_connections(10_000) == 512  # half of 1024 left for the rest
    assert frontend.effective_max_connections(100) == 100
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (20, 20))
    assert frontend.effective_max_connections(10_000) == 16  # never below 16 for the file limit
    assert frontend.effective_max_connections(5) == 5  # a configured limit is kept


def test_the_sweep_rearms_at_the_earliest_bound_so_a_connection_closes_just_past_it():
    """The sweep's next run, from a fake clock: each connection's bound (header timeout after it
    opened without a request; keep-alive + header timeout after its last request), the earliest
    one still ahead, at least MIN_SWEEP_GAP_S and at most sweep_interval_s away."""
    from routerd.daemon.frontend import MIN_SWEEP_GAP_S, Frontend, _Conn

    class _Transport:
        def __init__(self) -> None:
            self.aborted = False

        def abort(self) -> None:
            self.aborted = True

    async def run() -> None:
        now = [100.0]
        closed: list[str] = []
        f = Frontend(header_timeout_s=2.0, keepalive_timeout_s=3.0, max_connections=10,
                     on_close=closed.append, clock=lambda: now[0])
        assert f.sweep_interval_s == 0.5  # min(1, 2/4, 3/4)

        def conn(opened: float, requests: int = 0, idle_since: float = 0.0) -> _Conn:
            c = _Conn(None, f)
            c.transport = _Transport()  # type: ignore[assignment]
            c.opened_at, c.requests, c.idle_since = opened, requests, idle_since or opened
            f.conns.add(c)
            return c

        loop = asyncio.get_running_loop()
        silent = conn(98.3)    # header bound at 100.3
        later = conn(99.9)     # header bound at 101.9
        idle = conn(90.0, requests=1, idle_since=97.2)  # idle bound 97.2 + 3 (keep-alive) = 100.2
        started = conn(90.0, requests=1, idle_since=99.5)  # its next request began at 99.9: bound 101.9
        started.next_at = 99.9
        assert f.sweep() == 0 and closed == []
        # The earliest bound ahead is idle's (100.2): 0.2 s away, plus 1 ms.
        assert abs((f._sweep.when() - loop.time()) - 0.201) < 0.01
        f.close()
        now[0] = 100.25
        assert f.sweep() == 1 and closed == ["idle_timeout"] and idle.transport.aborted
        f.conns.discard(idle)
        assert abs((f._sweep.when() - loop.time()) - 0.051) < 0.01  # silent's 100.3
        f.close()
        now[0] = 100.299  # a sweep that runs early: the next one is still not sooner than the gap
        assert f.sweep() == 0
        assert abs((f._sweep.when() - loop.time()) - MIN_SWEEP_GAP_S) < 0.01
        f.close()
        now[0] = 100.31
        assert f.sweep() == 1 and closed == ["idle_timeout", "header_timeout"] and silent.transport.aborted
        f.conns.discard(silent)
        # Only later's and started's bounds (101.9) are left, 1.59 s away: the interval (0.5 s) comes first.
        assert abs((f._sweep.when() - loop.time()) - 0.5) < 0.01
        assert not later.transport.aborted and not started.transport.aborted
        f.close()
        now[0] = 101.95  # both past: a silent first request and a next request sent too slowly
        assert f.sweep() == 2 and closed[2:] == ["header_timeout", "header_timeout"]
        f.close()

    asyncio.run(run())


def test_a_next_request_begun_before_the_keep_alive_bound_gets_the_header_timeout_and_idle_closes_count():
    """After a response, a connection with nothing sent is closed at ``keepalive_timeout_s``
    (counted ``idle_timeout``); one whose next request began before that has ``header_timeout_s``
    from its first byte to complete it, and is answered (aiohttp's own keep-alive timer used to
    close it half-sent at the keep-alive bound, uncounted)."""
    async def main():
        b = await FakeBackend("b0").start()
        d = await start_daemon([b], http={"host": "127.0.0.1", "port": 0, "keepalive_timeout_s": 2.0,
                                          "header_timeout_s": 5.0})
        try:
            idle_r, idle_w = await asyncio.open_connection("127.0.0.1", d.http_port)
            r, w = await asyncio.open_connection("127.0.0.1", d.http_port)
            for ww in (idle_w, w):
                ww.write(HEAD + REQUEST)
            for rr in (idle_r, r):  # the whole first answer, so the next read is the next answer
                head = await asyncio.wait_for(rr.readuntil(b"\r\n\r\n"), 10)
                assert head.startswith(b"HTTP/1.1 200")
                length = int(next(x.split(b":")[1] for x in head.split(b"\r\n")
                                  if x.lower().startswith(b"content-length:")))
                await asyncio.wait_for(rr.readexactly(length), 10)
            await asyncio.sleep(0.5)
            w.write(HEAD[:20])  # the next request begins...
            await asyncio.sleep(2.5)  # ...and is still unfinished past the keep-alive bound
            w.write(HEAD[20:] + REQUEST)
            data = await asyncio.wait_for(r.read(65536), 10)
            assert b"HTTP/1.1 200" in data, data
            await _closed_within(idle_r, 10.0)
            assert sample(d, "phasewise_client_connections_closed_total", reason="idle_timeout") >= 1
            for ww in (idle_w, w):
                ww.close()
        finally:
            await d.stop()
            await b.stop()

    asyncio.run(main())
