"""The whole data plane as real processes on loopback, driven by the official ``openai`` client.

One stack for the module (issue 5, deliverable 8): three emulators (``phasewise emulate``,
profile llama2-7b-a100, so max_model_len 4096), a sidecar beside each, and routerd
(default settings: round robin, 2 MiB body limit, 2 s state age limit) with the three as
static endpoints whose state comes from the sidecars (see ``stack_processes.Stack``).

The stack tests run in file order and share the stack: the emulator kill comes last but
one, and the last of them checks the books over everything sent before: every in-flight
gauge back at zero and routerd's request counter, by status code, equal to what the
tests sent through it. Every wait polls a condition with a generous deadline (a loaded
2-core machine) instead of sleeping. A finalizer stops the stack and checks that no
process it started (found by an environment marker) is left.

Two tests pin bugs found here and fixed: the token count of chat streams without a usage
event, and a fully read stream counted as a client disconnect (a race in the stack;
pinned deterministically by the last test, with an in-process routerd).
"""

from __future__ import annotations

import asyncio
import json
import math
import signal
import time
from collections import Counter
from typing import Any, Callable

import aiohttp
import grpc
import openai
import pytest

from routerd.api.v1 import router_pb2, router_pb2_grpc
from stack_processes import (Stack, aclient, await_until, client, http_get, http_post,
                             metric_by, metric_sum, routerd_metrics, scrape, wait_until)

MODEL = "llama-2-7b"
PROFILE = "llama2-7b-a100"
MAX_MODEL_LEN = 4096  # of the profile: prompt + output, tokens
BODY_LIMIT = 2 * 1024 * 1024  # routerd's default max_body_bytes
VICTIM = 1  # the emulator killed mid-stream
TIMEOUT_S = 60.0  # per request, and for every condition polled: far above what a loaded machine needs


# -- the stack -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(tmp_path_factory, request):
    s = Stack(tmp_path_factory.mktemp("stack"), n=3, emulator_flags=("--profile", PROFILE))
    s.expected = Counter()  # HTTP status -> inference requests the tests sent through routerd
    s.rejected = Counter()  # reason -> requests among them that routerd refuses itself
    s.start_for(request)
    wait_until(lambda: router_state(s), lambda st: _all_fresh(s, st), TIMEOUT_S,
               "routerd holding fresh sidecar state of every endpoint")
    return s


def _all_fresh(s: Stack, st) -> bool:
    return (sorted(e.instance for e in st.endpoints) == s.names
            and all(e.ready and not e.stale and e.instance_state.healthy and e.instance_state.sequence > 0
                    for e in st.endpoints))


def router_state(s: Stack):
    """routerd's ``RouterService.GetState`` over gRPC."""
    with grpc.insecure_channel(s.grpc_address) as channel:
        return router_pb2_grpc.RouterServiceStub(channel).GetState(router_pb2.GetRouterStateRequest(), timeout=10)


def emulator_load(url: str) -> tuple[float, float]:
    """(vllm:num_requests_running, vllm:num_requests_waiting) of an emulator."""
    m = scrape(url + "/metrics")
    return metric_sum(m, "vllm:num_requests_running"), metric_sum(m, "vllm:num_requests_waiting")


def alive_emulator_urls(s: Stack) -> list[str]:
    return [url for p, url in zip(s.emulators, s.emulator_urls) if p.alive()]


async def apoll(probe: Callable[[], Any], ok: Callable[[Any], bool], what: str, timeout_s: float = TIMEOUT_S) -> Any:
    """:func:`stack_processes.await_until` with this module's deadline."""
    return await await_until(probe, ok, timeout_s, what)


def _error_of(e: openai.APIStatusError) -> dict:
    """The OpenAI ``error`` object of a failed call (the client keeps ``body`` as the error or the whole body)."""
    body = e.body
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body["error"]
    assert isinstance(body, dict), body
    return body


def _check_completion(r, n: int, chat: bool) -> None:
    assert r.model == MODEL
    assert r.usage.completion_tokens == n, r.usage
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    text = choice.message.content if chat else choice.text
    if chat:
        assert choice.message.role == "assistant"
    assert len(text.split()) == n  # the filler is one word per token


def _stream_kwargs(n: int, usage: bool) -> dict:
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": n, "stream": True}
    if usage:
        kw["stream_options"] = {"include_usage": True}
    return kw


def _chunk_tokens(ch, chat: bool) -> tuple[int, str | None]:
    """(the output tokens a chunk carries, its finish_reason). The emulator's text is one filler
    word per token (``routerd/routerd/emulator/openai_api.py``), and one chunk may carry several
    tokens, as vLLM's do when its API server falls behind: tokens are words, never chunks."""
    if not ch.choices:
        return 0, None
    c = ch.choices[0]
    piece = c.delta.content if chat else c.text
    return len(piece.split()) if piece else 0, c.finish_reason


# -- the tests ---------------------------------------------------------------------------

def test_routerd_state_comes_from_the_sidecars(stack):
    # Fresh when the fixture looked; a scrape late on a loaded machine may make one stale
    # for a moment since, so wait for the state asserted below rather than read it once.
    st = wait_until(lambda: router_state(stack), lambda st: _all_fresh(stack, st), TIMEOUT_S,
                    "routerd holding fresh sidecar state of every endpoint")
    assert st.policy == "round_robin" and st.queue_depth == 0
    by = {e.instance: e for e in st.endpoints}
    assert sorted(by) == stack.names
    now = time.time()
    for name, url in zip(stack.names, stack.emulator_urls):
        e = by[name]
        assert (e.endpoint, e.ready, e.stale, e.in_flight) == (url, True, False, 0)
        s = e.instance_state
        assert (s.instance, s.endpoint, s.healthy, s.error) == (name, url, True, "")
        assert list(s.models) == [MODEL]
        assert s.sequence > 0
        assert now - s.scraped_at_unix_s < 5.0  # routerd's own staleness verdict (2 s) is `stale` above
        assert (s.num_requests_running, s.num_requests_waiting, s.kv_cache_usage) == (0, 0, 0)
    # Not a one-off: newer snapshots keep coming from every sidecar.
    seq = {e.instance: e.instance_state.sequence for e in st.endpoints}
    wait_until(lambda: router_state(stack),
               lambda st2: all(e.instance_state.sequence > seq[e.instance] and not e.stale for e in st2.endpoints),
               TIMEOUT_S, "newer sidecar snapshots of every endpoint")
    fresh_gauges = ({n: 0.0 for n in stack.names}, {n: 1.0 for n in stack.names})
    wait_until(lambda: routerd_metrics(stack),
               lambda m: (metric_by(m, "phasewise_endpoint_state_stale", "endpoint"),
                          metric_by(m, "phasewise_endpoint_ready", "endpoint")) == fresh_gauges,
               TIMEOUT_S, "routerd's gauges phasewise_endpoint_state_stale 0 and phasewise_endpoint_ready 1 "
               "for every endpoint")
    assert http_get(stack.url + "/readyz")[0] == 200
    # The served model is the one the sidecars report (routerd has no --model).
    with client(stack) as c:
        assert [m.id for m in c.models.list()] == [MODEL]


def test_non_streaming_completion_and_chat(stack):
    with client(stack) as c:
        for n in (1, 7, 32):
            stack.expected[200] += 1
            raw = c.completions.with_raw_response.create(model=MODEL, prompt="Say something.", max_tokens=n)
            assert raw.status_code == 200
            _check_completion(raw.parse(), n, chat=False)
            stack.expected[200] += 1
            raw = c.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=n)
            assert raw.status_code == 200
            _check_completion(raw.parse(), n, chat=True)


def _stream_once(s: Stack, c: openai.OpenAI, n: int, chat: bool, usage: bool) -> None:
    """One streamed completion or chat through routerd, checked token by token."""
    if chat:
        stream = c.chat.completions.create(messages=[{"role": "user", "content": "Count"}], **_stream_kwargs(n, usage))
    else:
        stream = c.completions.create(prompt="Count.", **_stream_kwargs(n, usage))
    assert stream.response.status_code == 200
    assert stream.response.headers["content-type"].startswith("text/event-stream")
    tokens, finish, usages = 0, [], []
    with stream:
        for ch in stream:
            assert ch.model == MODEL
            k, fr = _chunk_tokens(ch, chat)
            tokens += k
            if fr is not None:
                finish.append(fr)
            if ch.usage is not None:
                usages.append(ch.usage.completion_tokens)
    assert (tokens, finish, usages) == (n, ["length"], [n] if usage else []), (chat, usage)


def _counters(s: Stack) -> tuple[float, float]:
    m = routerd_metrics(s)
    return metric_sum(m, "phasewise_generation_tokens_total"), metric_sum(m, "phasewise_client_disconnects_total")


def _routerd_count(s: Stack, send: Callable[[], None]) -> float:
    """Generated tokens routerd counted for the one stream ``send()`` reads to its end (routerd adds
    them as the stream ends); the stream must not count as a client disconnect."""
    before = _counters(s)
    send()
    after = wait_until(lambda: _counters(s), lambda v: v[0] != before[0], TIMEOUT_S,
                       "routerd counting the stream")
    assert after[1] == before[1], "a stream read to its end counted as a client disconnect"
    return after[0] - before[0]


def test_streaming_completion_and_chat(stack):
    counted = {}
    with client(stack) as c:
        for n in (1, 9, 40):
            for usage in (True, False):
                for chat in (False, True):
                    stack.expected[200] += 1
                    counted[n, chat, usage] = _routerd_count(stack, lambda: _stream_once(stack, c, n, chat, usage))
    # routerd counts the generated tokens of a stream from its usage event, which it asks the
    # instance for when the client did not (and takes out of that client's stream).
    assert counted == {k: k[0] for k in counted}


def test_routerd_counts_the_tokens_of_chat_streams_without_usage(stack):
    with client(stack) as c:
        counted = []
        for n in (1, 9, 40):
            stack.expected[200] += 1
            counted.append((_routerd_count(stack, lambda: _stream_once(stack, c, n, chat=True, usage=False)), n))
    measured = [(got, n) for got, n in counted if got is not None]
    assert measured and all(got == n for got, n in measured), counted


def test_200_concurrent_requests_all_answered(stack):
    before = metric_by(routerd_metrics(stack), "phasewise_decisions_total", "endpoint")

    async def one(c: openai.AsyncOpenAI, i: int) -> int:
        n = 4 + i % 13
        kind = i % 4
        chat = kind >= 2
        msgs = [{"role": "user", "content": f"request {i}"}]
        if kind in (0, 2):
            if chat:
                raw = await c.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, max_tokens=n)
            else:
                raw = await c.completions.with_raw_response.create(model=MODEL, prompt=f"request {i}", max_tokens=n)
            assert raw.status_code == 200
            _check_completion(raw.parse(), n, chat)
            return n
        usage = i % 8 < 4
        if chat:
            stream = await c.chat.completions.create(messages=msgs, **_stream_kwargs(n, usage))
        else:
            stream = await c.completions.create(prompt=f"request {i}", **_stream_kwargs(n, usage))
        assert stream.response.status_code == 200
        tokens, usages = 0, []
        async with stream:
            async for ch in stream:
                tokens += _chunk_tokens(ch, chat)[0]
                if ch.usage is not None:
                    usages.append(ch.usage.completion_tokens)
        assert (tokens, usages) == (n, [n] if usage else [])
        return n

    async def main() -> list:
        async with aclient(stack) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(200)), return_exceptions=True),
                                          2 * TIMEOUT_S)

    stack.expected[200] += 200
    t0 = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - t0
    failed = [(i, repr(r)) for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert not failed, f"{len(failed)} of 200 failed, e.g. {failed[:5]}"
    after = metric_by(routerd_metrics(stack), "phasewise_decisions_total", "endpoint")
    spread = sorted(after[n] - before.get(n, 0) for n in stack.names)
    # Round robin over three ready endpoints spreads them evenly (exactly, unless a fail-open
    # decision on stale state interleaves with the policy's own turn).
    assert sum(spread) == 200 and spread[0] >= 50, (spread, elapsed)


def test_malformed_json_gets_400_in_the_openai_shape(stack):
    for path in ("/v1/completions", "/v1/chat/completions"):
        for body in (b'{"model": "llama-2-7b", "prompt": "hi"', b"not json", b"\xff\xfe\x00"):
            stack.expected[400] += 1
            stack.rejected["bad_request"] += 1
            status, headers, raw = http_post(stack.url + path, body)
            assert status == 400, raw
            assert headers["Content-Type"].startswith("application/json")
            err = json.loads(raw)["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json", err
            assert "JSON" in err["message"]


def test_unknown_model_gets_404(stack):
    with client(stack) as c:
        stack.expected[404] += 1
        stack.rejected["not_found"] += 1
        with pytest.raises(openai.NotFoundError) as ei:
            c.completions.create(model="no-such-model", prompt="hi", max_tokens=3)
        assert ei.value.status_code == 404
        assert _error_of(ei.value)["code"] == "model_not_found"
        stack.expected[404] += 1
        stack.rejected["not_found"] += 1
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=3, stream=True)


def test_1mb_prompt_is_forwarded_and_answered_by_the_instance(stack):
    """A 1 MB prompt fits routerd's body limit, so routerd forwards it; the instance (like vLLM)
    refuses it with a 400 naming its context length, and routerd passes that answer on."""
    prompt = ("The quick brown fox jumps over the lazy dog. " * 23000)[:1_000_000]
    assert len(prompt.encode()) == 1_000_000
    with client(stack) as c:
        for stream in (False, True):
            stack.expected[400] += 1
            with pytest.raises(openai.BadRequestError) as ei:
                c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, stream=stream)
            err = _error_of(ei.value)
            assert ei.value.status_code == 400
            assert f"maximum context length is {MAX_MODEL_LEN} tokens" in err["message"], err
            assert err["type"] == "BadRequestError"  # the emulator's (vLLM's) error type, not routerd's
        stack.expected[400] += 1
        with pytest.raises(openai.BadRequestError) as ei:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=8)
        assert "maximum context length" in _error_of(ei.value)["message"]


def test_body_over_the_limit_gets_413(stack):
    huge = "x" * (BODY_LIMIT + 1)
    with client(stack) as c:
        stack.expected[413] += 1
        stack.rejected["too_large"] += 1
        with pytest.raises(openai.APIStatusError) as ei:
            c.completions.create(model=MODEL, prompt=huge, max_tokens=1)
        assert ei.value.status_code == 413
        assert _error_of(ei.value)["code"] == "request_too_large"

    async def chunked() -> tuple[int, dict]:
        async def body():
            piece = b"x" * 65536
            yield b'{"model": "llama-2-7b", "prompt": "'
            for _ in range(BODY_LIMIT // len(piece) + 2):
                yield piece
            yield b'"}'

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as session:
            async with session.post(stack.url + "/v1/completions", data=body(),
                                    headers={"Content-Type": "application/json"}) as resp:
                return resp.status, await resp.json()

    stack.expected[413] += 1  # no Content-Length: caught while reading
    stack.rejected["too_large"] += 1
    status, payload = asyncio.run(chunked())
    assert status == 413 and payload["error"]["code"] == "request_too_large", payload


def test_client_disconnects_cancel_the_upstream_request(stack):
    """Clients that go away mid-stream, or while waiting for a non-streamed answer, make routerd
    close its upstream request: the instances stop generating (num_requests_running back to 0)."""
    urls = stack.emulator_urls
    n_streams, n_plain = 6, 3
    disconnects_before = metric_sum(routerd_metrics(stack), "phasewise_client_disconnects_total")

    def total_running() -> float:
        return sum(emulator_load(u)[0] for u in urls)

    def all_idle() -> list[tuple[float, float]]:
        return [emulator_load(u) for u in urls]

    async def main() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as session:
            streams = []
            for i in range(n_streams):
                chat = i % 2 == 1
                body: dict[str, Any] = {"model": MODEL, "max_tokens": 3000, "stream": True}
                if chat:
                    body["messages"] = [{"role": "user", "content": "tell me everything"}]
                else:
                    body["prompt"] = "tell me everything"
                stack.expected[499] += 1
                resp = await session.post(stack.url + ("/v1/chat/completions" if chat else "/v1/completions"),
                                          json=body)
                streams.append(resp)
                assert resp.status == 200
                first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), TIMEOUT_S)
                assert first.startswith(b"data: {")
            # Every stream is generating, and routerd sees that load through the sidecars too.
            await apoll(total_running, lambda v: v == n_streams, "streams running on the emulators")
            await apoll(lambda: router_state(stack),
                        lambda st: sum(e.instance_state.num_requests_running for e in st.endpoints) == n_streams
                        and sum(e.in_flight for e in st.endpoints) == n_streams,
                        "routerd's sidecar-fed view of the running streams")
            for resp in streams:
                resp.close()  # drop the connection mid-stream
            await apoll(all_idle, lambda loads: all(x == (0, 0) for x in loads),
                        "emulators idle after the streaming clients left")

            async def plain(i: int) -> None:
                stack.expected[499] += 1
                await session.post(stack.url + "/v1/completions",
                                   json={"model": MODEL, "prompt": f"long answer {i}", "max_tokens": 3000})

            tasks = [asyncio.create_task(plain(i)) for i in range(n_plain)]
            await apoll(total_running, lambda v: v == n_plain, "non-streamed requests running on the emulators")
            for t in tasks:
                t.cancel()  # closes the client connection before any answer
            await asyncio.gather(*tasks, return_exceptions=True)
            await apoll(all_idle, lambda loads: all(x == (0, 0) for x in loads),
                        "emulators idle after the waiting clients left")

    asyncio.run(main())
    m = wait_until(lambda: routerd_metrics(stack),
                   lambda m: metric_sum(m, "phasewise_client_disconnects_total") - disconnects_before
                   >= n_streams + n_plain and metric_sum(m, "phasewise_in_flight_requests") == 0,
                   TIMEOUT_S, "routerd counting the disconnects and releasing them")
    assert metric_sum(m, "phasewise_client_disconnects_total") - disconnects_before == n_streams + n_plain


def test_emulator_killed_mid_stream(stack):
    """SIGKILL one emulator while streams run through all three: every client gets its whole
    completion or an explicit error, none hangs; afterwards new requests succeed on the other two."""
    victim_name, victim_url = stack.names[VICTIM], stack.emulator_urls[VICTIM]
    k, n = 12, 600  # 600 tokens last seconds at the profile's pace: the kill lands mid-stream
    others = [u for u in stack.emulator_urls if u != victim_url]

    def kill_when_every_stream_runs() -> float:
        """SIGKILL the victim as soon as all k streams are generating; returns the victim's share.

        Runs in a thread: the event loop, busy with k streams, could delay a kill decided there."""
        elsewhere, here = wait_until(
            lambda: (sum(sum(emulator_load(u)) for u in others), sum(emulator_load(victim_url))),
            lambda v: sum(v) == k, TIMEOUT_S, f"all {k} streams on the emulators (elsewhere, victim)",
            interval_s=0.02)
        stack.emulators[VICTIM].signal(signal.SIGKILL)
        return here

    async def main() -> tuple[list, float]:
        started = [asyncio.Event() for _ in range(k)]

        async def consume(c: openai.AsyncOpenAI, i: int) -> tuple[str, int, Any]:
            chat = i % 2 == 1
            tokens, usages = 0, []
            try:
                if chat:
                    stream = await c.chat.completions.create(
                        messages=[{"role": "user", "content": f"stream {i}"}], **_stream_kwargs(n, True))
                else:
                    stream = await c.completions.create(prompt=f"stream {i}", **_stream_kwargs(n, True))
                async with stream:
                    async for ch in stream:
                        got = _chunk_tokens(ch, chat)[0]
                        if got:
                            tokens += got
                            started[i].set()
                        if ch.usage is not None:
                            usages.append(ch.usage.completion_tokens)
            except openai.APIError as e:
                return "error", tokens, e
            finally:
                started[i].set()
            return ("full" if (tokens, usages) == (n, [n]) else "truncated"), tokens, usages

        async with aclient(stack) as c:
            tasks = [asyncio.create_task(asyncio.wait_for(consume(c, i), 2 * TIMEOUT_S)) for i in range(k)]
            # Every client is reading its stream, and every stream is generating on an instance.
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), TIMEOUT_S)
            on_victim = await asyncio.to_thread(kill_when_every_stream_runs)
            return await asyncio.gather(*tasks, return_exceptions=True), on_victim

    results, on_victim = asyncio.run(main())
    assert stack.emulators[VICTIM].wait(10) == -signal.SIGKILL
    hung = [i for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert not hung, f"streams that hung or failed outside the API: {[repr(results[i]) for i in hung]}"
    outcomes = Counter(r[0] for r in results)
    stack.expected[200] += outcomes["full"]
    stack.expected[502] += outcomes["error"]
    assert outcomes["truncated"] == 0, [r for r in results if r[0] == "truncated"]
    assert on_victim >= 1 and outcomes["error"] == on_victim, (outcomes, on_victim)
    for kind, tokens, e in results:
        if kind == "error":
            assert tokens < n
            assert isinstance(e, openai.APIConnectionError) or "broke off" in str(e), repr(e)

    # New requests succeed: routerd keeps the dead instance out after its first refused connect.
    m0 = routerd_metrics(stack)
    t0 = time.monotonic()
    with client(stack) as c:
        for i in range(12):
            stack.expected[200] += 1
            if i % 3 == 2:
                with c.completions.create(prompt="after", **_stream_kwargs(4, True)) as stream:
                    assert [ch.usage.completion_tokens for ch in stream if ch.usage is not None] == [4]
            elif i % 3 == 1:
                _check_completion(c.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "after"}], max_tokens=4), 4, chat=True)
            else:
                _check_completion(c.completions.create(model=MODEL, prompt="after", max_tokens=4), 4, chat=False)
    elapsed = time.monotonic() - t0
    m1 = routerd_metrics(stack)

    def delta(name: str, **labels: str) -> float:
        return metric_sum(m1, name, **labels) - metric_sum(m0, name, **labels)

    picks = {name: delta("phasewise_decisions_total", endpoint=name) for name in stack.names}
    refused = delta("phasewise_upstream_errors_total", endpoint=victim_name, kind="connect")
    # Every pick of the dead instance failed on connect and was retried on a live one...
    assert picks[victim_name] == refused == delta("phasewise_upstream_retries_total"), (picks, refused)
    assert sum(v for name, v in picks.items() if name != victim_name) == 12
    # ... and after each refusal it sits out a doubling cooldown (1 s, 2 s, 4 s, ...).
    assert picks[victim_name] <= 2 + math.log2(1 + elapsed), (picks, elapsed)
    assert http_get(stack.url + "/readyz")[0] == 200

    # Its sidecar now reports it unhealthy; routerd marks its state stale, the others stay fresh.
    def victim_stale(st) -> bool:
        by = {e.instance: e for e in st.endpoints}
        v = by[victim_name]
        return (v.stale and not v.instance_state.healthy and v.instance_state.error != ""
                and all(not by[x].stale for x in stack.names if x != victim_name))

    wait_until(lambda: router_state(stack), victim_stale, TIMEOUT_S, "the dead instance's state marked stale")


def test_afterwards_gauges_are_zero_and_every_request_is_counted(stack):
    expected = {str(code): float(n) for code, n in stack.expected.items() if n}
    sent = sum(stack.expected.values())
    assert sent > 0

    def books():
        m = routerd_metrics(stack)
        return {"in_flight": metric_by(m, "phasewise_in_flight_requests", "endpoint"),
                "queue_depth": metric_sum(m, "phasewise_router_queue_depth"),
                "requests": metric_by(m, "phasewise_requests_total", "code"),
                "rejections": metric_by(m, "phasewise_rejections_total", "reason")}

    b = wait_until(books, lambda b: all(v == 0 for v in b["in_flight"].values()) and b["queue_depth"] == 0
                   and sum(b["requests"].values()) == sent, TIMEOUT_S,
                   f"routerd idle with {sent} requests counted")
    assert sorted(b["in_flight"]) == stack.names
    # Every request answered, with the status the test saw; never a 500.
    assert b["requests"] == expected
    assert metric_sum(routerd_metrics(stack), "phasewise_client_disconnects_total") == expected.get("499", 0)
    # Refused by routerd itself: the malformed bodies, the unknown models, the oversized bodies.
    assert {r: v for r, v in b["rejections"].items() if v} == {r: float(v) for r, v in stack.rejected.items() if v}
    st = router_state(stack)
    assert st.queue_depth == 0 and [e.in_flight for e in st.endpoints] == [0] * len(stack.names)
    for url in alive_emulator_urls(stack):
        assert wait_until(lambda: emulator_load(url), lambda x: x == (0, 0), TIMEOUT_S,
                          f"{url} idle") == (0, 0)
    for p in stack.all_processes():
        assert "Traceback" not in p.log_text(), f"{p.name} logged an exception:\n{p.log_text()[-4000:]}"


def test_a_client_closing_right_after_done_is_not_a_disconnect():
    """In-process routerd (no stack needed) in front of an instance that ends its body 0.5 s after
    ``[DONE]``; the official client reads the stream and closes at ``[DONE]``."""
    from aiohttp import web

    from daemon_fakes import sample, start_daemon

    ended = asyncio.Event()

    async def upstream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        await resp.write(b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":'
                         b'[{"index":0,"text":" hi","logprobs":null,"finish_reason":"length"}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(0.5)
        try:
            await resp.write_eof()
        except ConnectionError:
            pass  # routerd closed the connection already (the bug)
        finally:
            ended.set()
        return resp

    async def main() -> dict[str, float]:
        app = web.Application()
        app.router.add_post("/v1/completions", upstream)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        d = await start_daemon(endpoints=[{"name": "e0", "url": f"http://127.0.0.1:{port}"}])
        try:
            async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{d.http_port}/v1", api_key="x",
                                          max_retries=0, timeout=TIMEOUT_S) as c:
                stream = await c.completions.create(model="m", prompt="p", max_tokens=1, stream=True)
                assert [ch.choices[0].text async for ch in stream] == [" hi"]
            await asyncio.wait_for(ended.wait(), TIMEOUT_S)

            def books() -> dict[str, float]:
                return {k: sample(d, k, **lab) for k, lab in (
                    ("phasewise_requests_total", {"code": "200"}), ("phasewise_client_disconnects_total", {}),
                    ("phasewise_generation_tokens_total", {}), ("phasewise_request_e2e_seconds_count", {}))}

            # routerd's handler ends right after the instance's body and counts the request
            # then: wait for that count, after which the disconnect counter is final.
            def counted(b: dict[str, float]) -> bool:
                return b["phasewise_requests_total"] >= 1 and b["phasewise_request_e2e_seconds_count"] >= 1

            return await await_until(books, counted, TIMEOUT_S, "routerd counting the request "
                                     "(phasewise_requests_total and phasewise_request_e2e_seconds_count)")
        finally:
            await d.stop()
            await runner.cleanup()

    assert asyncio.run(main()) == {"phasewise_requests_total": 1, "phasewise_client_disconnects_total": 0,
                                   "phasewise_generation_tokens_total": 1, "phasewise_request_e2e_seconds_count": 1}
