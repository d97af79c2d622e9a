"""routerd's HTTP front against hostile clients and broken instances (regressions of adversarial tests).

Every error must be an OpenAI-style JSON error with the right status, never a 500, and
the bookkeeping must be back at zero afterwards.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp

from daemon_fakes import FakeBackend, in_flight_samples, sample, start_daemon
from test_daemon_proxy import _settle
from test_daemon_upstream import Scripted


def run(coro):
    return asyncio.run(coro)


class _ScriptedBackend:
    """A :class:`Scripted` server seen as a backend by ``start_daemon``."""

    def __init__(self, name: str, srv: Scripted) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{srv.target[2]}"


async def _raw(port: int, data: bytes) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(data)
    await w.drain()
    out = await asyncio.wait_for(r.read(), 10)
    w.close()
    return out


def _error_of(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"]


def test_deeply_nested_json_is_a_400_not_a_500():
    async def main():
        b = await FakeBackend("b0").start()
        d = await start_daemon([b])
        try:
            base = f"http://127.0.0.1:{d.http_port}"
            async with aiohttp.ClientSession() as s:
                for data in (b"[" * 100_000, b'{"model": "m", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"):
                    async with s.post(base + "/v1/completions", data=data) as r:
                        assert r.status == 400
                        err = (await r.json())["error"]
                        assert err["code"] == "invalid_json" and "nested" in err["message"]
            assert sample(d, "phasewise_requests_total", code="500") == 0
            assert b.started == 0
            await _settle(d)
        finally:
            await d.stop()
            await b.stop()
    run(main())


def test_client_header_values_of_any_bytes_are_forwarded_not_a_500():
    async def main():
        b = await FakeBackend("b0").start()
        d = await start_daemon([b])
        try:
            body = b'{"model": "m", "prompt": "x", "max_tokens": 1}'
            for value in ("日本".encode(), b"\xff\xfe"):
                raw = await _raw(d.http_port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Foo: " + value
                                 + b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
                assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
            assert b.headers[0]["X-Foo"] == "日本"
            assert sample(d, "phasewise_requests_total", code="500") == 0
            await _settle(d)
        finally:
            await d.stop()
            await b.stop()
    run(main())


def test_an_instance_sending_unrelayable_headers_gets_a_502_json_error():
    body = b'{"choices": [], "usage": {"completion_tokens": 2}}'
    bad = [
        b"HTTP/1.1 200 OK\r\nX-A: a\nInjected: b\r\nContent-Length: %d\r\n\r\n" % len(body) + body,
        b"HTTP/1.1 200 OK\r\nX-B: \x00\x01\r\nContent-Type: text/event-stream\r\nContent-Length: 6\r\n\r\ndata:\n",
        b"HTTP/1.1 200 OK\r\nX A(): v\r\nContent-Length: %d\r\n\r\n" % len(body) + body,
        b"HTTP/1.1 000 Zero\r\nContent-Length: %d\r\n\r\n" % len(body) + body,
    ]

    async def main():
        for reply in bad:
            async with Scripted([reply, reply]) as srv:
                d = await start_daemon([_ScriptedBackend("b0", srv)], upstream={"max_retries": 0})
                try:
                    base = f"http://127.0.0.1:{d.http_port}"
                    async with aiohttp.ClientSession() as s:
                        for stream in (False, True):
                            payload = {"model": "m", "prompt": "x", "stream": stream}
                            async with s.post(base + "/v1/completions", json=payload) as r:
                                assert r.status == 502, (reply, stream, r.status)
                                err = (await r.json())["error"]
                                assert err["code"] == "upstream_error"
                    assert sample(d, "phasewise_requests_total", code="502") == 2
                    assert sample(d, "phasewise_requests_total", code="500") == 0
                    await _settle(d)
                finally:
                    await d.stop()
    run(main())


def test_an_instance_stalling_mid_body_gets_a_504_and_response_timeout_bounds_the_head():
    async def main():
        stall = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"choi'
        async with Scripted([stall], linger=True) as srv:
            d = await start_daemon([_ScriptedBackend("b0", srv)], upstream={"read_timeout_s": 0.3})
            try:
                async with aiohttp.ClientSession() as s:
                    async with s.post(f"http://127.0.0.1:{d.http_port}/v1/completions",
                                      json={"model": "m", "prompt": "x"}) as r:
                        assert r.status == 504
                        assert (await r.json())["error"]["code"] == "upstream_timeout"
                await _settle(d)
            finally:
                await d.stop()
        # A non-streamed answer sends its head only at the end: response_timeout_s bounds that
        # wait even when read_timeout_s is long.
        b = await FakeBackend("b0", ttft_s=3.0).start()
        d = await start_daemon([b], upstream={"read_timeout_s": 30.0, "response_timeout_s": 0.3})
        try:
            t0 = asyncio.get_running_loop().time()
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://127.0.0.1:{d.http_port}/v1/completions",
                                  json={"model": "m", "prompt": "x", "max_tokens": 1}) as r:
                    assert r.status == 504
                    assert (await r.json())["error"]["code"] == "upstream_timeout"
            assert asyncio.get_running_loop().time() - t0 < 2.0
            await _settle(d)
            assert all(v == 0 for v in in_flight_samples(d).values())
        finally:
            await d.stop()
            await b.stop()
    run(main())
