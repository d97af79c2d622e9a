"""A stream that ends without vLLM's terminal ``data: [DONE]`` is broken, not a success (issue 31):
routerd counts it in ``phasewise_streams_broken_total{endpoint,reason}`` and as a 502, never in the
completion metrics (``phasewise_requests_total{code="200"}``, E2E, tokens), marks the endpoint for
passive health, and tells the client (an SSE error event and no ``[DONE]``: the official ``openai``
client raises ``openai.APIError``; a cut inside an event drops the connection:
``openai.APIConnectionError``). Upstreams here: a raw asyncio server ending its body cleanly
(chunked end, Content-Length, close) without ``[DONE]``, and :class:`FakeBackend` dying or stalling
mid-stream."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from daemon_fakes import FakeBackend, openai_client, sample, start_daemon
from routerd.daemon.proxy import ends_with_done
from stack_processes import poll_until

TEXTS = ["alpha", " beta", " gamma"]


def _event(text: str) -> bytes:
    obj = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
           "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class RawUpstream:
    """An HTTP/1.1 server on 127.0.0.1 answering every request with 200 ``text/event-stream`` of the
    :data:`TEXTS` events, framed as ``framing`` says: ``chunked`` (one chunk per event, then the
    terminating chunk), ``length`` (Content-Length), ``close`` (read until close), ``chunked-cut``
    (chunked, the last event cut in half, then the terminating chunk). ``done``: end with
    ``data: [DONE]`` as vLLM does."""

    def __init__(self, framing: str, done: bool = False) -> None:
        self.framing = framing
        self.done = done
        self.requests = 0
        self.server: asyncio.AbstractServer | None = None
        self.url = ""

    def _events(self) -> list[bytes]:
        evs = [_event(t) for t in TEXTS]
        if self.framing == "chunked-cut":
            evs[-1] = evs[-1][:20]
        if self.done:
            evs.append(b"data: [DONE]\n\n")
        return evs

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        await reader.readexactly(length)
        self.requests += 1
        evs = self._events()
        status = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        if self.framing in ("chunked", "chunked-cut"):
            writer.write(status + b"transfer-encoding: chunked\r\n\r\n")
            for ev in evs:
                writer.write(b"%x\r\n%s\r\n" % (len(ev), ev))
                await writer.drain()
                await asyncio.sleep(0.002)
            writer.write(b"0\r\n\r\n")
        elif self.framing == "length":
            body = b"".join(evs)
            writer.write(status + b"content-length: %d\r\n\r\n%s" % (len(body), body))
        else:
            writer.write(status + b"connection: close\r\n\r\n" + b"".join(evs))
        await writer.drain()
        writer.close()

    async def start(self) -> "RawUpstream":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def _stream(d) -> tuple[list[str], BaseException | None]:
    """Stream a completion through routerd with the official client: (texts read, what it raised)."""
    client = openai_client(d)
    got: list[str] = []
    try:
        stream = await client.completions.create(model="m", prompt="p", max_tokens=3, stream=True)
        async for ch in stream:
            got += [c.text for c in ch.choices]
    except openai.APIError as e:
        return got, e
    finally:
        await client.close()
    return got, None


def _assert_counted_broken(d, name: str, reason: str) -> None:
    assert sample(d, "phasewise_streams_broken_total", endpoint=name, reason=reason) == 1
    others = [r for r in ("closed", "malformed", "timeout", "no_done") if r != reason]
    assert [sample(d, "phasewise_streams_broken_total", endpoint=name, reason=r) for r in others] == [0, 0, 0]
    assert sample(d, "phasewise_requests_total", code="502") == 1
    assert sample(d, "phasewise_requests_total", code="200") == 0
    assert sample(d, "phasewise_request_e2e_seconds_count") == 0
    assert sample(d, "phasewise_generation_tokens_total") == 0
    kind = "timeout" if reason == "timeout" else "stream"
    assert sample(d, "phasewise_upstream_errors_total", endpoint=name, kind=kind) == 1
    assert d.router.by_name[name].consecutive_errors == 1  # passive health saw the failure


@pytest.mark.parametrize("framing, error", [("chunked", openai.APIError), ("length", openai.APIError),
                                            ("close", openai.APIError),
                                            ("chunked-cut", openai.APIConnectionError)])
def test_a_stream_that_ends_cleanly_without_done_is_broken(framing, error):
    async def main():
        up = await RawUpstream(framing).start()
        d = await start_daemon(endpoints=[{"name": "up", "url": up.url}], predictor="none")
        try:
            texts, exc = await _stream(d)
            await poll_until(lambda: d.router.in_flight, lambda n: n == 0, 10, "the request released")
            assert up.requests == 1
            assert type(exc) is error, exc
            if error is openai.APIError:  # the event at a boundary: the client got every whole event
                assert texts == TEXTS
                assert exc.body["code"] == "upstream_stream_broken" and "data: [DONE]" in exc.body["message"]
            else:  # cut inside an event: the connection is dropped
                assert texts == TEXTS[:2]
            _assert_counted_broken(d, "up", "no_done")
        finally:
            await d.stop()
            await up.stop()

    asyncio.run(main())


def test_the_same_stream_with_done_is_a_completion():
    async def main():
        up = await RawUpstream("chunked", done=True).start()
        d = await start_daemon(endpoints=[{"name": "up", "url": up.url}], predictor="none")
        try:
            texts, exc = await _stream(d)
            await poll_until(lambda: d.router.in_flight, lambda n: n == 0, 10, "the request released")
            assert (texts, exc) == (TEXTS, None)
            assert sample(d, "phasewise_requests_total", code="200") == 1
            assert sample(d, "phasewise_requests_total", code="502") == 0
            assert sample(d, "phasewise_generation_tokens_total") == 3  # 3 events (no usage event)
            assert sample(d, "phasewise_request_e2e_seconds_count") == 1
            for r in ("closed", "malformed", "timeout", "no_done"):
                assert sample(d, "phasewise_streams_broken_total", endpoint="up", reason=r) == 0
        finally:
            await d.stop()
            await up.stop()

    asyncio.run(main())


@pytest.mark.parametrize("mid_event", [False, True])
def test_an_upstream_that_dies_mid_stream_is_broken_closed(mid_event):
    async def main():
        b = await FakeBackend("b0", die_after=2, die_mid_event=mid_event).start()
        d = await start_daemon([b], predictor="none")
        try:
            texts, exc = await _stream(d)
            await poll_until(lambda: d.router.in_flight, lambda n: n == 0, 10, "the request released")
            assert len(texts) == 2
            assert type(exc) is (openai.APIConnectionError if mid_event else openai.APIError), exc
            _assert_counted_broken(d, "b0", "closed")
        finally:
            await d.stop()
            await b.stop()

    asyncio.run(main())


def test_an_upstream_that_stalls_mid_stream_is_broken_timeout():
    async def main():
        b = FakeBackend("b0")
        b.between_tokens_gate = asyncio.Event()  # never set: the stream stops after its first token
        await b.start()
        d = await start_daemon([b], predictor="none", upstream={"read_timeout_s": 0.3})
        try:
            texts, exc = await _stream(d)
            await poll_until(lambda: d.router.in_flight, lambda n: n == 0, 10, "the request released")
            assert len(texts) == 1 and type(exc) is openai.APIError and exc.body["code"] == "upstream_stream_broken"
            _assert_counted_broken(d, "b0", "timeout")
        finally:
            b.between_tokens_gate.set()
            await d.stop()
            await b.stop()

    asyncio.run(main())


@pytest.mark.parametrize("tail, ok", [
    (b'data: {"usage": {}}\n\ndata: [DONE]\n\n', True), (b"data:[DONE]\r\n\r\n", True), (b"data: [DONE]", True),
    (b'data: {"a": 1}\n\n', False), (b"data: [DONE]\n\ndata: {}\n\n", False), (b"", False),
    (b'data: {"text": "data: [DONE]"}\n\n', False), (b"xdata: [DONE]\n\n", False),
])
def test_ends_with_done(tail, ok):
    assert ends_with_done(tail) is ok
