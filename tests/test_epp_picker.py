"""``phasewise epp`` against a direct ext_proc gRPC client (as llm-d tests its picker hermetically):
message order, destination header and metadata with fallbacks, the subset hint, ImmediateResponses,
holds, cancellation, the served endpoint, health, and efficient mode's access-log completion."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2", reason="needs xds-protos")

from envoy.config.core.v3 import address_pb2, base_pb2  # noqa: E402
from envoy.data.accesslog.v3 import accesslog_pb2  # noqa: E402
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc  # noqa: E402
from google.protobuf import struct_pb2  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from daemon_fakes import in_flight_samples, sample  # noqa: E402
from routerd.daemon.discovery import DiscoveredEndpoint  # noqa: E402
from routerd.daemon.proxy import with_usage  # noqa: E402
from routerd.epp.server import EppServer  # noqa: E402

ENDPOINTS = [{"name": "e0", "url": "http://127.0.0.1:9"}, {"name": "e1", "url": "http://127.0.0.2:10"},
             {"name": "e2", "url": "http://127.0.0.3:11"}]
ADDR = {"e0": "127.0.0.1:9", "e1": "127.0.0.2:10", "e2": "127.0.0.3:11"}
SERVING = health_pb2.HealthCheckResponse.SERVING


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class Picker:
    """A daemon without its HTTP front plus the picker's servers, on loopback ports 0."""

    def __init__(self, **settings) -> None:
        self.settings = settings

    async def __aenter__(self) -> "Picker":
        from routerd.daemon.app import Daemon
        from routerd.daemon.config import Settings

        cfg = {"models": ["m"], "endpoints": ENDPOINTS, "grpc": {"enabled": False}, "reload": {"watch": False},
               "predictor": "none", "log_level": "warning",
               "epp": {"host": "127.0.0.1", "port": 0, "health_port": 0, "metrics_port": None}}
        self.d = Daemon(Settings.model_validate(_merge(cfg, self.settings)), http_front=False)
        await self.d.start()
        self.epp = EppServer(self.d)
        await self.epp.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.epp.port}")
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()
        await self.epp.stop()
        await self.d.stop()

    def outcome(self, name: str) -> float:
        return sample(self.d, "phasewise_epp_streams_total", outcome=name)


def headers(d: dict[str, str], eos: bool = False) -> pb.HttpHeaders:
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in d.items()]), end_of_stream=eos)


def req_headers(path: str = "/v1/completions", body: bytes = b"", subset=None) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest(request_headers=headers({":path": path, ":method": "POST",
                                                         "content-type": "application/json",
                                                         "content-length": str(len(body))}))
    if subset is not None:
        s = struct_pb2.Struct()
        s["x-gateway-destination-endpoint-subset"] = subset
        msg.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(s)
    return msg


def body_msg(data: bytes, eos: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))


def completion(**over) -> bytes:
    return json.dumps({"model": "m", "prompt": "x" * 400, "max_tokens": 8, "stream": True, **over}).encode()


def set_headers(resp: pb.ProcessingResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode()
            for h in resp.request_headers.response.header_mutation.set_headers}


async def send_request(call, body: bytes, path: str = "/v1/completions", subset=None, chunks: int = 1) -> None:
    await call.write(req_headers(path, body, subset))
    step = max(1, -(-len(body) // chunks))
    for i in range(0, len(body), step):
        await call.write(body_msg(body[i:i + step], eos=i + step >= len(body)))


def sent_on(body: bytes) -> bytes:
    """The body a full-duplex picker sends on for ``body``: with ``stream_options.include_usage``
    when it is a stream whose client did not ask for the usage event (routerd's proxy does the same,
    ``routerd.daemon.proxy.with_usage``)."""
    try:
        payload = json.loads(body)
    except ValueError:
        return body
    if not isinstance(payload, dict) or payload.get("stream") is not True:
        return body
    return with_usage(body, payload) or body


async def read_decision(call, body: bytes, efficient: bool = False) -> tuple[pb.ProcessingResponse, bytes]:
    """The HeadersResponse, and the body the BodyResponses carry back (asserting their shape): the
    client's own in efficient mode, else :func:`sent_on`'s."""
    first = await call.read()
    assert first.WhichOneof("response") == "request_headers"
    echoed = b""
    while True:
        m = await call.read()
        assert m.WhichOneof("response") == "request_body"
        sr = m.request_body.response.body_mutation.streamed_response
        echoed += sr.body
        if sr.end_of_stream:
            break
    assert echoed == (body if efficient else sent_on(body))
    return first, echoed


def test_message_order_destination_metadata_fallbacks_and_response_echo():
    async def main():
        async with Picker(epp={"max_fallbacks": 2}) as p:
            body = completion()
            call = p.stub.Process()
            await send_request(call, body, chunks=3)
            first, echoed = await read_decision(call, body)
            hs = set_headers(first)
            dest = hs["x-gateway-destination-endpoint"].split(",")
            # Round robin: the first decision goes to e0; fallbacks are the two others.
            assert dest[0] == ADDR["e0"] and sorted(dest[1:]) == sorted([ADDR["e1"], ADDR["e2"]])
            assert b'"stream_options":{"include_usage":true}' in echoed
            assert hs["content-length"] == str(len(echoed)) and "transfer-encoding" not in hs
            assert hs["x-phasewise-request-id"]
            assert first.request_headers.response.clear_route_cache
            md = first.dynamic_metadata.fields["envoy.lb"].struct_value.fields
            assert md["x-gateway-destination-endpoint"].string_value == hs["x-gateway-destination-endpoint"]
            assert in_flight_samples(p.d)["e0"] == 1
            # Response: headers, 3 token events, [DONE]. The picker asked for the usage event (none
            # comes here): it echoes whole events, an event split across chunks with the chunk that ends it.
            await call.write(pb.ProcessingRequest(response_headers=headers(
                {":status": "200", "content-type": "text/event-stream"})))
            assert (await call.read()).WhichOneof("response") == "response_headers"
            chunks = [b'data: {"choices":[{"text":"a"}]}\n', b'\ndata: {"choices":[{"text":"b"}]}\n\ndata: {"cho',
                      b'ices":[{"text":"c"}]}\n\n', b"data: [DONE]\n\n"]
            echoes = [b"", b'data: {"choices":[{"text":"a"}]}\n\ndata: {"choices":[{"text":"b"}]}\n\n',
                      b'data: {"choices":[{"text":"c"}]}\n\n', b"data: [DONE]\n\n"]
            for i, c in enumerate(chunks):
                await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=c, end_of_stream=i == 3)))
                r = await call.read()
                sr = r.response_body.response.body_mutation.streamed_response
                assert (sr.body, sr.end_of_stream) == (echoes[i], i == 3)
            await call.write(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
            assert (await call.read()).WhichOneof("response") == "response_trailers"
            await call.done_writing()
            assert await call.read() == grpc.aio.EOF
            assert p.d.router.in_flight == 0
            assert sample(p.d, "phasewise_generation_tokens_total") == 3
            assert sample(p.d, "phasewise_requests_total", code="200") == 1
            assert p.outcome("completed") == 1 and p.outcome("cancelled") == 0
            assert sample(p.d, "phasewise_epp_decision_seconds_count") == 1
    asyncio.run(main())


def test_non_streaming_chat_tokens_from_usage_and_request_trailers():
    async def main():
        async with Picker(epp={"max_fallbacks": 0}) as p:
            body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
            call = p.stub.Process()
            await call.write(req_headers("/v1/chat/completions", body))
            await call.write(body_msg(body, eos=False))
            await call.write(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
            first, _ = await read_decision(call, body)
            assert set_headers(first)["x-gateway-destination-endpoint"] == ADDR["e0"]  # no fallbacks
            assert (await call.read()).WhichOneof("response") == "request_trailers"
            await call.write(pb.ProcessingRequest(response_headers=headers(
                {":status": "200", "content-type": "application/json"})))
            await call.read()
            answer = b'{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 17}}'
            await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=answer, end_of_stream=True)))
            await call.read()
            await call.done_writing()
            assert p.d.router.in_flight == 0
            assert sample(p.d, "phasewise_generation_tokens_total") == 17
    asyncio.run(main())


def test_subset_hint_restricts_and_refuses():
    async def main():
        async with Picker() as p:
            body = completion()
            call = p.stub.Process()
            await send_request(call, body, subset=[ADDR["e2"]])
            first, _ = await read_decision(call, body)
            # Only e2 is in the subset: no fallbacks outside it.
            assert set_headers(first)["x-gateway-destination-endpoint"] == ADDR["e2"]
            assert in_flight_samples(p.d)["e2"] == 1
            call.cancel()
            for subset in ([], ["10.9.9.9:8000"], "10.9.9.9:8000,10.9.9.8:8000"):
                c = p.stub.Process()
                await send_request(c, body, subset=subset)
                r = await c.read()
                assert r.immediate_response.status.code == 503, subset
                err = json.loads(r.immediate_response.body)["error"]
                assert err["code"] == "no_endpoint" and "subset" in err["message"]
            await asyncio.wait_for(_until(lambda: p.d.router.in_flight == 0), 5)
    asyncio.run(main())


async def _until(cond, step: float = 0.01) -> None:
    while not cond():
        await asyncio.sleep(step)


@pytest.mark.parametrize("path,body,status,code", [
    ("/v1/completions", b"not json", 400, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, "invalid_json"),
    ("/v1/completions", json.dumps({"model": "m"}).encode(), 400, "bad_request"),
    ("/v1/chat/completions", json.dumps({"model": "other", "messages": [{"role": "user", "content": "x"}]}).encode(),
     404, "model_not_found"),
    ("/v1/completions", completion(prompt="y" * 3000), 413, "request_too_large"),
])
def test_immediate_responses_have_openai_json_bodies(path, body, status, code):
    async def main():
        async with Picker(epp={"max_body_bytes": 2048}) as p:
            call = p.stub.Process()
            await send_request(call, body, path=path, chunks=2)
            r = await call.read()
            ir = r.immediate_response
            assert ir.status.code == status
            err = json.loads(ir.body)["error"]
            assert err["code"] == code and err["type"] and err["message"]
            hs = {h.header.key: h.header.raw_value.decode() for h in ir.headers.set_headers}
            assert hs["content-type"] == "application/json" and hs["x-phasewise-reject-reason"]
            assert await call.read() == grpc.aio.EOF
            assert p.d.router.in_flight == 0 and p.outcome("refused") == 1
            assert sample(p.d, "phasewise_requests_total", code=str(status)) == 1
    asyncio.run(main())


def test_hold_until_dispatch_then_429_when_the_queue_is_full_and_503_when_draining():
    async def main():
        async with Picker(endpoints=[], router={"no_endpoint_grace_s": 10, "queue_limit": 1}) as p:
            body = completion()
            held = p.stub.Process()
            await send_request(held, body)
            read = asyncio.ensure_future(held.read())
            await asyncio.wait_for(_until(lambda: len(p.d.router.queue) == 1), 5)
            assert not read.done()  # no endpoint yet: the stream is not answered
            full = p.stub.Process()
            await send_request(full, body)
            r = await full.read()
            assert r.immediate_response.status.code == 429
            assert json.loads(r.immediate_response.body)["error"]["code"] == "queue_full"
            p.d.apply_endpoints([DiscoveredEndpoint("late", "http://127.0.0.4:12", None, True)])
            first = await asyncio.wait_for(read, 5)
            assert set_headers(first)["x-gateway-destination-endpoint"] == "127.0.0.4:12"
            held.cancel()
            await asyncio.wait_for(_until(lambda: p.d.router.in_flight == 0), 5)
            assert p.outcome("cancelled") == 1
            p.d.router.begin_drain()
            c = p.stub.Process()
            await send_request(c, body)
            r = await c.read()
            assert r.immediate_response.status.code == 503
            assert json.loads(r.immediate_response.body)["error"]["code"] == "draining"
    asyncio.run(main())


def test_a_picker_bug_answers_500_json_and_releases_the_booking():
    async def main():
        async with Picker() as p:
            def broken(*a, **k):
                raise RuntimeError("boom")
            p.d.router.candidates = broken  # fails after dispatch, while the answer is built
            call = p.stub.Process()
            await send_request(call, completion())
            r = await call.read()
            assert r.immediate_response.status.code == 500
            assert json.loads(r.immediate_response.body)["error"]["code"] == "internal_error"
            assert p.d.router.in_flight == 0 and sample(p.d, "phasewise_decisions_total", endpoint="e0") == 1
    asyncio.run(main())


def test_no_endpoint_is_503():
    async def main():
        async with Picker(endpoints=[]) as p:
            call = p.stub.Process()
            await send_request(call, completion())
            r = await call.read()
            assert r.immediate_response.status.code == 503
            assert json.loads(r.immediate_response.body)["error"]["code"] == "no_endpoint"
    asyncio.run(main())


def test_stream_cancelled_mid_response_releases_its_booking_once():
    async def main():
        async with Picker() as p:
            body = completion()
            call = p.stub.Process()
            await send_request(call, body)
            await read_decision(call, body)
            await call.write(pb.ProcessingRequest(response_headers=headers(
                {":status": "200", "content-type": "text/event-stream"})))
            await call.read()
            await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: {}\n\n")))
            await call.read()
            assert in_flight_samples(p.d)["e0"] == 1
            call.cancel()  # Envoy resets the stream (client gone)
            await asyncio.wait_for(_until(lambda: p.d.router.in_flight == 0), 5)
            await asyncio.sleep(0.05)
            assert p.outcome("cancelled") == 1 and p.outcome("completed") == 0
            assert sample(p.d, "phasewise_requests_total", code="499") == 1
            assert in_flight_samples(p.d) == {"e0": 0, "e1": 0, "e2": 0, "queue": 0}
    asyncio.run(main())


def test_served_endpoint_metadata_moves_the_booking():
    async def main():
        async with Picker() as p:
            body = completion()
            call = p.stub.Process()
            await send_request(call, body)
            first, _ = await read_decision(call, body)
            assert set_headers(first)["x-gateway-destination-endpoint"].startswith(ADDR["e0"])
            msg = pb.ProcessingRequest(response_headers=headers({":status": "200",
                                                                 "content-type": "text/event-stream"}))
            served = struct_pb2.Struct()
            served["x-gateway-destination-endpoint-served"] = ADDR["e1"]
            msg.metadata_context.filter_metadata["envoy.lb"].CopyFrom(served)
            await call.write(msg)
            await call.read()
            counts = in_flight_samples(p.d)
            assert (counts["e0"], counts["e1"]) == (0, 1)
            assert sample(p.d, "phasewise_epp_served_moves_total") == 1
            await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: {}\n\ndata: [DONE]\n\n",
                                                                            end_of_stream=True)))
            await call.read()
            assert p.d.router.in_flight == 0 and sample(p.d, "phasewise_generation_tokens_total") == 1
    asyncio.run(main())


def test_health_services_follow_readiness():
    async def main():
        async with Picker() as p:
            for name in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
                await asyncio.wait_for(_until_async(p, name, SERVING), 5)
            p.d.router.begin_drain()
            for name in ("", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
                await asyncio.wait_for(_until_async(p, name, health_pb2.HealthCheckResponse.NOT_SERVING), 5)
            r = await p.health.Check(health_pb2.HealthCheckRequest(service="liveness"))
            assert r.status == SERVING
    asyncio.run(main())


async def _until_async(p: Picker, service: str, status) -> None:
    while (await p.health.Check(health_pb2.HealthCheckRequest(service=service))).status != status:
        await asyncio.sleep(0.02)


def _entry(rid: str, status: int, *, events: int = 0, tail: bytes = b"", sse: bool = True, served: str = "",
           path: str = "/v1/completions") -> accesslog_pb2.HTTPAccessLogEntry:
    e = accesslog_pb2.HTTPAccessLogEntry()
    e.request.request_headers["x-phasewise-request-id"] = rid
    e.request.path = path
    e.response.response_code.value = status
    cp = e.common_properties
    cp.start_time.GetCurrentTime()
    cp.time_to_last_downstream_tx_byte.FromMilliseconds(0)
    if served:
        host, port = served.rsplit(":", 1)
        cp.upstream_remote_address.CopyFrom(address_pb2.Address(socket_address=address_pb2.SocketAddress(
            address=host, port_value=int(port))))
    md = struct_pb2.Struct()
    md.update({"events": events, "sse": sse, "tail": tail.decode()})
    cp.metadata.filter_metadata["phasewise"].CopyFrom(md)
    return e


def test_efficient_mode_completes_on_the_access_log_entry():
    async def main():
        async with Picker(epp={"mode": "efficient", "completion_timeout_s": 0.3}) as p:
            als = als_pb2_grpc.AccessLogServiceStub(p.channel)
            body = completion()
            rids = []
            for _ in range(3):
                call = p.stub.Process()
                await send_request(call, body)
                first, _ = await read_decision(call, body, efficient=True)
                rids.append(set_headers(first)["x-phasewise-request-id"])
                await call.done_writing()  # Envoy ends the stream after the request phase
                assert await call.read() == grpc.aio.EOF
            assert len(set(rids)) == 3
            assert p.d.router.in_flight == 3  # booked until their entries arrive
            tail = b'data: {"usage": {"completion_tokens": 42}}\n\ndata: [DONE]\n\n'
            entries = [_entry(rids[0], 200, events=44, tail=tail),
                       _entry(rids[1], 200, events=6, tail=b"data: {}\n\ndata: [DONE]\n\n", served=ADDR["e2"]),
                       _entry("unknown", 200)]
            stream = als.StreamAccessLogs()
            await stream.write(als_pb2.StreamAccessLogsMessage(
                http_logs=als_pb2.StreamAccessLogsMessage.HTTPAccessLogEntries(log_entry=entries)))
            await asyncio.wait_for(_until(lambda: p.d.router.in_flight == 1), 5)
            # 42 from the usage event; 6 events less [DONE] = 5.
            assert sample(p.d, "phasewise_generation_tokens_total") == 47
            assert sample(p.d, "phasewise_epp_served_moves_total") == 1
            assert sample(p.d, "phasewise_epp_access_log_unknown_total") == 1
            assert sample(p.d, "phasewise_epp_completion_delay_seconds_count") == 2
            # The third never gets an entry: released completion_timeout_s after its stream ended.
            await asyncio.wait_for(_until(lambda: p.d.router.in_flight == 0), 5)
            assert p.outcome("unreported") == 1 and p.outcome("completed") == 2
            await stream.done_writing()
            await stream
    asyncio.run(main())


def test_a_full_duplex_picker_behind_the_efficient_envoy_config_says_so_once(caplog):
    # Only the efficient Envoy configuration sends access-log entries: a full-duplex picker that
    # receives them is behind the wrong configuration (its requests would all count 499).
    async def main():
        async with Picker() as p:
            als = als_pb2_grpc.AccessLogServiceStub(p.channel)
            stream = als.StreamAccessLogs()
            await stream.write(als_pb2.StreamAccessLogsMessage(
                http_logs=als_pb2.StreamAccessLogsMessage.HTTPAccessLogEntries(
                    log_entry=[_entry("a", 200), _entry("b", 200)])))
            await asyncio.wait_for(_until(lambda: sample(p.d, "phasewise_epp_access_log_unknown_total") == 2), 5)
            await stream.done_writing()
            await stream
    with caplog.at_level("WARNING", logger="routerd.epp"):
        asyncio.run(main())
    said = [r for r in caplog.records if "epp.mode is full-duplex but Envoy sends access-log entries" in r.message]
    assert len(said) == 1


def test_efficient_mode_counts_an_upstream_that_died_mid_stream_as_502_stream_error():
    async def main():
        async with Picker(epp={"mode": "efficient"}) as p:
            als = als_pb2_grpc.AccessLogServiceStub(p.channel)
            body = completion()
            rids = []
            for _ in range(2):
                call = p.stub.Process()
                await send_request(call, body, subset=[ADDR["e1"]])
                first, _ = await read_decision(call, body, efficient=True)
                rids.append(set_headers(first)["x-phasewise-request-id"])
                await call.done_writing()
                assert await call.read() == grpc.aio.EOF
            calls = []
            orig_failure, orig_success = p.d.router.note_failure, p.d.router.note_success
            p.d.router.note_failure = lambda ep, kind: (calls.append(("failure", ep.name, kind)),
                                                         orig_failure(ep, kind))[1]
            p.d.router.note_success = lambda ep: (calls.append(("success", ep.name)), orig_success(ep))[1]
            # Envoy's entry for a backend that closed its connection mid-body: 200, flag UC.
            died = _entry(rids[0], 200, events=2, tail=b"data: {}\n\n", served=ADDR["e1"])
            died.common_properties.response_flags.upstream_connection_termination = True
            died.response.response_code_details = "upstream_reset_after_response_started{connection_termination}"
            # One whose details say so without a flag: a remote reset.
            reset = _entry(rids[1], 200, events=1, tail=b"data: {}\n\n", served=ADDR["e1"])
            reset.response.response_code_details = "upstream_reset_after_response_started{remote_reset}"
            stream = als.StreamAccessLogs()
            await stream.write(als_pb2.StreamAccessLogsMessage(
                http_logs=als_pb2.StreamAccessLogsMessage.HTTPAccessLogEntries(log_entry=[died, reset])))
            await asyncio.wait_for(_until(lambda: p.d.router.in_flight == 0), 5)
            assert sample(p.d, "phasewise_requests_total", code="502") == 2
            assert sample(p.d, "phasewise_requests_total", code="200") == 0
            assert sample(p.d, "phasewise_upstream_errors_total", endpoint="e1", kind="stream") == 2
            assert calls == [("failure", "e1", "stream")] * 2
            assert sample(p.d, "phasewise_generation_tokens_total") == 0
            await stream.done_writing()
            await stream
    asyncio.run(main())


@pytest.mark.parametrize("hint", [1.5, True, False, 0, {"a": "127.0.0.3:11"}, "null"])
def test_a_malformed_subset_hint_is_refused_503_no_endpoint(hint):
    async def main():
        async with Picker() as p:
            body = completion()
            call = p.stub.Process()
            msg = req_headers(body=body, subset=hint)
            if hint == "null":
                msg.metadata_context.filter_metadata["envoy.lb.subset_hint"].fields[
                    "x-gateway-destination-endpoint-subset"].null_value = struct_pb2.NULL_VALUE
            await call.write(msg)
            await call.write(body_msg(body))
            r = await call.read()
            ir = r.immediate_response
            assert ir.status.code == 503, hint
            err = json.loads(ir.body)["error"]
            assert err["code"] == "no_endpoint" and "subset" in err["message"]
            assert sample(p.d, "phasewise_requests_total", code="500") == 0
            assert sample(p.d, "phasewise_rejections_total", reason="no_endpoint") == 1
            assert p.d.router.in_flight == 0
    asyncio.run(main())


def test_413_is_counted_as_a_too_large_rejection():
    async def main():
        async with Picker(epp={"max_body_bytes": 2048}) as p:
            call = p.stub.Process()
            await send_request(call, completion(prompt="y" * 3000), chunks=2)
            r = await call.read()
            assert r.immediate_response.status.code == 413
            assert sample(p.d, "phasewise_rejections_total", reason="too_large") == 1
            assert sample(p.d, "phasewise_requests_total", code="413") == 1
    asyncio.run(main())


def test_reload_of_restart_only_epp_fields_warns_once_and_keeps_the_running_values(caplog):
    import logging

    async def main():
        async with Picker() as p:
            new = p.d.settings.model_copy(update={"epp": p.d.settings.epp.model_copy(
                update={"mode": "efficient", "port": 19999, "metrics_port": 19998, "max_fallbacks": 1})})
            with caplog.at_level(logging.WARNING, logger="routerd"):
                assert await p.d.reload(new)
            warned = [r.getMessage() for r in caplog.records if "takes effect at restart" in r.getMessage()]
            assert len(warned) == 1 and "epp.mode" in warned[0] and "epp.port" in warned[0]
            assert "epp.metrics_port" in warned[0] and "max_fallbacks" not in warned[0]
            # The running servicer's mode and the settings agree; a hot field was applied.
            assert p.d.settings.epp.mode == "full-duplex" and p.epp.ext_proc.efficient is False
            assert p.d.settings.epp.port == 0 and p.d.settings.epp.max_fallbacks == 1
    asyncio.run(main())


def test_start_up_line_names_the_picker_front(caplog):
    import logging

    async def main():
        with caplog.at_level(logging.INFO, logger="routerd"):
            async with Picker():
                pass
    asyncio.run(main())
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("routerd listening on"))
    assert "ext_proc" in line and "full-duplex" in line, line
