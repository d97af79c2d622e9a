"""Exact token counts of streams whose events carry several tokens (vLLM coalesces them whenever its
API server falls behind): routerd asks the instance for the final usage event of every stream and
takes it out of what a client that did not ask for it receives.

The byte-exact checks compare what a client gets through routerd with what the same fake instance
sends to a client that talks to it directly with the client's own body: the instance's events are
deterministic (``FakeBackend``: fixed ids and times), so both must be the same bytes.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from daemon_fakes import FakeBackend, in_flight_samples, openai_client, sample, start_daemon
from routerd.daemon.proxy import _ASK_USAGE, _UsageStrip, choices_of, with_usage

FP = "vllm-0.32.0-c0101d4d"


class Cluster:
    """One fake instance and routerd in front of it."""

    def __init__(self, backend: FakeBackend) -> None:
        self.b = backend

    async def __aenter__(self) -> "Cluster":
        await self.b.start()
        self.d = await start_daemon([self.b])
        self.base = f"http://127.0.0.1:{self.d.http_port}"
        self.http = aiohttp.ClientSession()
        self.ep = self.d.router.by_name[self.b.name]
        self.counted: list[int] = []
        on_tokens = self.ep.on_tokens

        def counting(r, n: int) -> None:  # every increment routerd's bookkeeping gets
            self.counted.append(n)
            on_tokens(r, n)

        self.ep.on_tokens = counting
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.close()
        await self.d.stop()
        await self.b.stop()

    async def raw(self, base: str, path: str, body: bytes) -> bytes:
        """The whole body ``base`` answers a POST of ``body`` with, as bytes."""
        async with self.http.post(base + path, data=body, headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 200, await resp.read()
            return await resp.read()

    async def settled(self) -> None:
        for _ in range(500):
            if self.d.router.in_flight == 0 and all(v == 0 for v in in_flight_samples(self.d).values()):
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"bookkeeping not released: {in_flight_samples(self.d)}")


def _body(chat: bool, n: int, **extra) -> bytes:
    req = {"model": "m", "max_tokens": n, "stream": True, **extra}
    if chat:
        req["messages"] = [{"role": "user", "content": "hi"}]
    else:
        req["prompt"] = "p"
    return json.dumps(req).encode()


def _events(stream: bytes) -> list[bytes]:
    return [e for e in stream.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n\n") if e.strip()]


def _words(stream: bytes, chat: bool) -> int:
    """Tokens in a FakeBackend stream: one word ``tN`` per token in the events' text."""
    n = 0
    for ev in _events(stream):
        data = ev.strip()[5:].strip()
        if data == b"[DONE]":
            continue
        for c in json.loads(data)["choices"]:
            n += len((c["delta"]["content"] if chat else c["text"]).split())
    return n


async def _through_and_direct(c: Cluster, chat: bool, body: bytes) -> tuple[bytes, bytes]:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    via = await c.raw(c.base, path, body)
    direct = await c.raw(c.b.url, path, body)
    return via, direct


# -- the HTTP proxy ------------------------------------------------------------------------------

@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("knobs", [{}, {"split_events": True}, {"eol": b"\r\n", "split_events": True},
                                   {"eol": b"\r"}, {"split_usage": 9}, {"split_usage": 60}])
def test_a_client_without_usage_gets_the_instance_stream_and_routerd_counts_every_token(chat, knobs):
    """10 tokens in events of 3 (4 events): the client gets exactly the stream the instance sends
    without usage (no usage event; the fingerprint on the last chunk, where vLLM puts it then);
    routerd counts 10 tokens, not 4 events."""
    async def main():
        async with Cluster(FakeBackend("b0", coalesce=3, fingerprint=FP, **knobs)) as c:
            body = _body(chat, 10)
            via, direct = await _through_and_direct(c, chat, body)
            assert via == direct
            assert b'"usage"' not in via and via.count(FP.encode()) == 1 and _words(via, chat) == 10
            assert len(_events(via)) == 5  # 4 events of tokens and [DONE]
            sent = json.loads(c.b.bodies[0])
            assert sent["stream_options"] == {"include_usage": True}
            assert c.b.bodies[0] == body[:1] + _ASK_USAGE + body[1:]  # the client's bytes otherwise
            assert "stream_options" not in json.loads(c.b.bodies[1])  # the direct request
            await c.settled()
            assert sample(c.d, "phasewise_generation_tokens_total") == 10
            # Each event counted one while the stream ran (4 tokens' events, usage, [DONE]); the
            # usage event's 10 brought the bookkeeping up to them at the end.
            assert sum(c.counted[:-1]) == 6 and c.counted[-1] == 4
    asyncio.run(main())


@pytest.mark.parametrize("chat", [False, True])
def test_a_client_with_usage_gets_it_unchanged(chat):
    async def main():
        async with Cluster(FakeBackend("b0", coalesce=4, fingerprint=FP, split_usage=30)) as c:
            body = _body(chat, 9, stream_options={"include_usage": True})
            via, direct = await _through_and_direct(c, chat, body)
            assert via == direct
            assert c.b.bodies[0] == body  # asked already: forwarded as it is
            usage = json.loads(_events(via)[-2][5:])
            assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 9
            assert usage["system_fingerprint"] == FP and via.count(FP.encode()) == 1
            await c.settled()
            assert sample(c.d, "phasewise_generation_tokens_total") == 9
    asyncio.run(main())


@pytest.mark.parametrize("options, sent", [
    ({}, {"include_usage": True}),
    (None, {"include_usage": True}),
    ({"include_usage": False}, {"include_usage": True}),
    ({"include_usage": None, "continuous_usage_stats": True}, {"include_usage": True, "continuous_usage_stats": False}),
    ({"continuous_usage_stats": False}, {"continuous_usage_stats": False, "include_usage": True}),
])
def test_stream_options_without_include_usage(options, sent):
    """The body is serialized again with ``include_usage`` true and no running usage; the client
    still gets the stream without any usage."""
    async def main():
        async with Cluster(FakeBackend("b0", coalesce=2, fingerprint=FP)) as c:
            body = _body(False, 7, stream_options=options)
            via, direct = await _through_and_direct(c, False, body)
            assert via == direct and b'"usage"' not in via
            got = json.loads(c.b.bodies[0])
            assert got == {**json.loads(body), "stream_options": sent}
            assert list(got) == list(json.loads(body))  # members in the client's order
            await c.settled()
            assert sample(c.d, "phasewise_generation_tokens_total") == 7
    asyncio.run(main())


def test_the_official_client_without_usage_sees_no_usage_chunk():
    async def main():
        async with Cluster(FakeBackend("b0", coalesce=5, fingerprint=FP)) as c:
            async with openai_client(c.d) as oc:
                stream = await oc.completions.create(model="m", prompt="p", max_tokens=23, stream=True)
                chunks = [ch async for ch in stream]
            assert [ch.usage for ch in chunks] == [None] * 5
            assert [len(ch.choices[0].text.split()) for ch in chunks] == [5, 5, 5, 5, 3]
            assert [ch.system_fingerprint for ch in chunks] == [None] * 4 + [FP]
            await c.settled()
            assert sample(c.d, "phasewise_generation_tokens_total") == 23
    asyncio.run(main())


def test_a_non_streamed_request_goes_unchanged():
    async def main():
        async with Cluster(FakeBackend("b0")) as c:
            body = json.dumps({"model": "m", "prompt": "p", "max_tokens": 3}).encode()
            await c.raw(c.base, "/v1/completions", body)
            assert c.b.bodies == [body]
    asyncio.run(main())


# -- with_usage and the strip by themselves ----------------------------------------------------------

def _with(body: bytes):
    return with_usage(body, json.loads(body))


def test_with_usage_inserts_after_the_opening_brace():
    assert (_with(b'{"model":"m","stream":true}')
            == b'{"stream_options":{"include_usage":true},"model":"m","stream":true}')
    assert _with(b' \n\t{ "model": "m"}') == b' \n\t{"stream_options":{"include_usage":true}, "model": "m"}'
    bom = b'\xef\xbb\xbf{"model":"m"}'
    assert _with(bom) == b'\xef\xbb\xbf{"stream_options":{"include_usage":true},"model":"m"}'
    big = json.dumps({"model": "m", "prompt": "x" * 1_000_000, "stream": True}).encode()
    out = _with(big)
    assert out[:1] + out[1 + len(_ASK_USAGE):] == big and json.loads(out)["stream_options"] == {"include_usage": True}


def test_with_usage_reads_include_usage_as_vllm_does():
    for value in (False, 0, "no", "False", "off", None):
        assert json.loads(_with(json.dumps({"model": "m", "stream_options": {"include_usage": value}}).encode())) == {
            "model": "m", "stream_options": {"include_usage": True}}


def test_with_usage_serializes_again_when_bytes_cannot_take_it():
    utf16 = json.dumps({"model": "m", "stream": True}).encode("utf-16")
    assert json.loads(_with(utf16)) == {"model": "m", "stream": True, "stream_options": {"include_usage": True}}
    # Not ASCII-safe text and a lone surrogate survive (json.dumps escapes them).
    body = b'{"model":"m","prompt":"\\ud800 \xc3\xa9","stream_options":null}'
    assert json.loads(_with(body)) == {"model": "m", "prompt": "\ud800 \u00e9",
                                       "stream_options": {"include_usage": True}}


@pytest.mark.parametrize("options", [{"include_usage": True}, {"include_usage": "yes"}, {"include_usage": 1},
                                     {"include_usage": True, "continuous_usage_stats": True},
                                     {"include_usage": "maybe"}, {"continuous_usage_stats": 2}, "x", 3, []])
def test_with_usage_leaves_asked_or_refused_options_alone(options):
    """Asked (as pydantic reads vLLM's bool fields) or a value vLLM refuses: the body goes as it is."""
    assert with_usage(b"{}", {"model": "m", "stream_options": options}) is None


def test_choices_of():
    assert choices_of("completions", {"prompt": "p"}) == 1
    assert choices_of("completions", {"prompt": ["a", "b", "c"], "n": 2}) == 6
    assert choices_of("completions", {"prompt": [1, 2, 3]}) == 1
    assert choices_of("completions", {"prompt": [[1], [2]]}) == 2
    assert choices_of("chat", {"messages": [], "n": 3}) == 3
    assert choices_of("chat", {"messages": [], "n": True}) == 1


def _ev(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _chunk(i: int, finish: str | None, fp: str | None = None) -> dict:
    d = {"id": "c", "choices": [{"index": i, "text": "w", "finish_reason": finish}]}
    if fp is not None:
        d["system_fingerprint"] = fp
    return d


USAGE = {"id": "c", "choices": [], "usage": {"completion_tokens": 5}, "system_fingerprint": FP}
DONE = b"data: [DONE]\n\n"


def _feed_all(strip: _UsageStrip, pieces: list[bytes]) -> bytes:
    return b"".join(strip.feed(p) for p in pieces) + strip.flush()


def test_strip_of_several_choices_stamps_the_known_fingerprint_at_once():
    fps: dict[str, bytes] = {}
    # Unknown fingerprint: from the first finished choice everything waits for the usage event.
    s = _UsageStrip(fps, "e", 2)
    assert s.feed(_ev(_chunk(0, None)) + _ev(_chunk(0, "stop"))) == _ev(_chunk(0, None))
    assert s.feed(_ev(_chunk(1, None))) == b""
    assert s.feed(_ev(_chunk(1, "length"))) == b""
    assert s.feed(_ev(USAGE) + DONE) == (_ev(_chunk(0, "stop", FP)) + _ev(_chunk(1, None))
                                         + _ev(_chunk(1, "length", FP)) + DONE)
    assert fps == {"e": json.dumps(FP).encode()}
    # Known now: each finished choice goes at once, stamped.
    s = _UsageStrip(fps, "e", 2)
    assert s.feed(_ev(_chunk(0, "stop"))) == _ev(_chunk(0, "stop", FP))
    assert s.feed(_ev(_chunk(1, None))) == _ev(_chunk(1, None))
    assert _feed_all(s, [_ev(_chunk(1, "stop")), _ev(USAGE), DONE]) == _ev(_chunk(1, "stop", FP)) + DONE


def test_strip_releases_held_events_as_they_came_when_no_usage_event_comes():
    s = _UsageStrip({}, "e", 1)
    err = b'data: {"error":{"message":"x"}}\n\n'
    assert s.feed(_ev(_chunk(0, "length"))) == b""
    assert s.feed(err) == b""
    assert s.feed(DONE) == _ev(_chunk(0, "length")) + err + DONE
    # A stream that broke off while an event was held: flush gives it back as it is.
    s = _UsageStrip({}, "e", 1)
    assert s.feed(_ev(_chunk(0, "length")) + b"data: {\"cho") == b""
    assert s.flush() == _ev(_chunk(0, "length")) + b"data: {\"cho"


def test_strip_holds_a_final_cr_that_may_be_half_a_crlf():
    s = _UsageStrip({}, "e", 1)
    usage = _ev(USAGE).replace(b"\n", b"\r\n")
    tok = _ev(_chunk(0, None)).replace(b"\n", b"\r\n")
    assert s.feed(tok[:-1]) == b""  # ends "\r\n\r": the event may end with the "\n" still to come
    assert s.feed(tok[-1:] + usage[:-1]) == tok
    assert s.feed(usage[-1:] + b"data: [DONE]\r\n\r\n") == b"data: [DONE]\r\n\r\n"


def test_strip_keeps_an_event_that_only_looks_like_usage():
    s = _UsageStrip({}, "e", 1)
    text = _ev({"id": "c", "choices": [{"index": 0, "text": 'say "usage', "finish_reason": None}]})
    assert b'"usage"' in text
    cont = _ev({"id": "c", "choices": [{"index": 0, "text": "w", "finish_reason": None}], "usage": {"x": 1}})
    assert _feed_all(s, [text, cont, DONE]) == text + cont + DONE


# -- the endpoint picker in full-duplex mode ---------------------------------------------------------

def test_full_duplex_picker_asks_for_usage_and_takes_it_out_of_the_echo():
    pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2", reason="needs xds-protos")
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from test_epp_picker import Picker, completion, headers, read_decision, send_request, set_headers

    async def main():
        async with Picker(epp={"max_fallbacks": 0}) as p:
            body = completion()
            call = p.stub.Process()
            await send_request(call, body)
            first, echoed = await read_decision(call, body)
            assert echoed == body[:1] + _ASK_USAGE + body[1:]
            assert set_headers(first)["content-length"] == str(len(echoed))
            await call.write(pb.ProcessingRequest(response_headers=headers(
                {":status": "200", "content-type": "text/event-stream"})))
            assert (await call.read()).WhichOneof("response") == "response_headers"
            # 7 tokens in 2 events, the last finished; the usage event split across chunks.
            a = _ev({"id": "c", "choices": [{"index": 0, "text": " a b c", "finish_reason": None}]})
            b = _ev({"id": "c", "choices": [{"index": 0, "text": " d e f g", "finish_reason": "length"}]})
            usage = _ev({"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7},
                         "system_fingerprint": FP})
            chunks = [a, b + usage[:20], usage[20:], DONE]
            echoes = [a, b"", b[:-3] + b',"system_fingerprint":"' + FP.encode() + b'"}\n\n', DONE]
            for i, ch in enumerate(chunks):
                await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=ch, end_of_stream=i == 3)))
                sr = (await call.read()).response_body.response.body_mutation.streamed_response
                assert (sr.body, sr.end_of_stream) == (echoes[i], i == 3)
            await call.done_writing()
            assert p.d.router.in_flight == 0
            assert sample(p.d, "phasewise_generation_tokens_total") == 7
            assert p.outcome("completed") == 1
    asyncio.run(main())
