"""routerd's gRPC API on loopback: RouterService (Route, ReportCompletion, GetState, ListDecisions) and health."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from daemon_fakes import FakeSidecar, sample, start_daemon
from stack_processes import poll_until
from routerd.api.v1 import router_pb2, router_pb2_grpc
from routerd.daemon.discovery import DiscoveredEndpoint

RR = router_pb2.RouteResponse
ENDPOINTS = [{"name": "e0", "url": "http://127.0.0.1:9"}, {"name": "e1", "url": "http://127.0.0.1:10"}]


class Api:
    def __init__(self, **settings):
        self.settings = settings

    async def __aenter__(self):
        self.d = await start_daemon(**{"endpoints": ENDPOINTS, **self.settings})
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.d.grpc_port}")
        self.stub = router_pb2_grpc.RouterServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        return self

    async def __aexit__(self, *exc):
        await self.channel.close()
        await self.d.stop()


def test_route_report_state_and_decisions():
    async def main():
        async with Api(predictor="none") as a:
            r1 = await a.stub.Route(router_pb2.RouteRequest(request_id="a", model="m", prompt="x" * 400))
            assert (r1.decision, r1.instance, r1.endpoint) == (RR.DISPATCH, "e0", "http://127.0.0.1:9")
            assert r1.policy == "round_robin" and not r1.fallback and r1.predicted_bucket == -1
            again = await a.stub.Route(router_pb2.RouteRequest(request_id="a", model="m"))
            assert again.instance == "e0"  # idempotent while in flight
            r2 = await a.stub.Route(router_pb2.RouteRequest(request_id="b", prompt_tokens=7, predicted_bucket=2))
            assert r2.instance == "e1" and r2.predicted_bucket == 2
            state = await a.stub.GetState(router_pb2.GetRouterStateRequest())
            assert state.policy == "round_robin" and state.queue_depth == 0 and state.queue_limit == 1024
            assert [(e.instance, e.ready, e.stale, e.in_flight) for e in state.endpoints] == \
                [("e0", True, False, 1), ("e1", True, False, 1)]
            dec = await a.stub.ListDecisions(router_pb2.ListDecisionsRequest(limit=5))
            # Newest first; 400 characters -> 100 prompt tokens (4 bytes per token).
            assert [(x.request_id, x.instance, x.prompt_tokens, x.predicted_bucket) for x in dec.decisions] == \
                [("b", "e1", 7, 2), ("a", "e0", 100, -1)]
            ack = await a.stub.ReportCompletion(router_pb2.CompletionReport(
                request_id="a", status=router_pb2.CompletionReport.OK, generated_tokens=300, ttft_s=0.1, e2e_s=3.1))
            assert ack.known
            assert not (await a.stub.ReportCompletion(router_pb2.CompletionReport(request_id="a"))).known
            assert sample(a.d, "phasewise_generation_tokens_total") == 300
            assert sample(a.d, "phasewise_request_tpot_seconds_sum") == pytest.approx(3.0 / 299)
            assert sample(a.d, "phasewise_predicted_bucket_total", predicted="none", actual="1") == 1
            await a.stub.ReportCompletion(router_pb2.CompletionReport(
                request_id="b", status=router_pb2.CompletionReport.CANCELLED))
            assert a.d.router.in_flight == 0
            assert sample(a.d, "phasewise_in_flight_requests", endpoint="e1") == 0
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await a.stub.Route(router_pb2.RouteRequest(model="m"))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await a.stub.Route(router_pb2.RouteRequest(request_id="z", model="other"))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await a.stub.Route(router_pb2.RouteRequest(request_id="z", predicted_bucket=9))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    asyncio.run(main())


def test_route_predicts_with_the_shipped_model_by_default():
    """Settings without ``predictor``: Route answers, and ListDecisions records, the shipped
    model's bucket for the prompt (a caller's own predicted_bucket still wins)."""
    from routerd.predictor import load_predictor
    from routerd.tokens import count_text_tokens

    text = "Write a complete Python implementation of a web server with tests, docs and examples."
    want = int(load_predictor("default").predict([(text, count_text_tokens(text), None)])[0])

    async def main():
        async with Api() as a:
            assert a.d.settings.predictor == "default"
            r = await a.stub.Route(router_pb2.RouteRequest(request_id="p", model="m", prompt=text))
            assert r.decision == RR.DISPATCH and r.predicted_bucket == want >= 0
            r2 = await a.stub.Route(router_pb2.RouteRequest(request_id="q", model="m", prompt=text, predicted_bucket=3))
            assert r2.predicted_bucket == 3
            dec = await a.stub.ListDecisions(router_pb2.ListDecisionsRequest(limit=5))
            assert [(x.request_id, x.predicted_bucket) for x in dec.decisions] == [("q", 3), ("p", want)]
            for rid in ("p", "q"):
                await a.stub.ReportCompletion(router_pb2.CompletionReport(
                    request_id=rid, status=router_pb2.CompletionReport.OK, generated_tokens=300))
            assert sample(a.d, "phasewise_predicted_bucket_total", predicted=str(want), actual="1") == \
                1 + (want == 3)
            assert sample(a.d, "phasewise_predicted_bucket_total", predicted="none", actual="1") == 0
            assert a.d.router.in_flight == 0
    asyncio.run(main())


class HoldAll:
    def pick(self, request, view):
        return None

    def on_complete(self, *a):
        pass


def test_hold_reject_and_health():
    async def main():
        async with Api(endpoints=[], router={"action_interval_s": 0.05, "hold_idle_limit_s": 60}) as a:
            a.d.apply_endpoints([DiscoveredEndpoint("e0", "http://127.0.0.1:9")])
            check = await poll_until(
                lambda: a.health.Check(health_pb2.HealthCheckRequest(service="phasewise.v1.RouterService")),
                lambda c: c.status == health_pb2.HealthCheckResponse.SERVING, 10.0,
                "gRPC health of phasewise.v1.RouterService SERVING with a ready endpoint")
            assert check.status == health_pb2.HealthCheckResponse.SERVING
            a.d.router.set_policy(HoldAll(), "hold_all")
            r = await a.stub.Route(router_pb2.RouteRequest(request_id="h"))
            assert r.decision == RR.HOLD and r.retry_after_s == pytest.approx(0.05) and r.policy == "hold_all"
            assert a.d.router.in_flight == 0
            a.d.apply_endpoints([DiscoveredEndpoint("e0", "http://127.0.0.1:9", ready=False)])
            r = await a.stub.Route(router_pb2.RouteRequest(request_id="h"))
            assert r.decision == RR.REJECT and r.reason == "no_endpoint"
            check = await poll_until(lambda: a.health.Check(health_pb2.HealthCheckRequest(service="")),
                                     lambda c: c.status == health_pb2.HealthCheckResponse.NOT_SERVING, 10.0,
                                     "gRPC server health NOT_SERVING with no ready endpoint")
            assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
    asyncio.run(main())


def test_an_unreported_grpc_request_is_released_after_the_timeout():
    async def main():
        async with Api(grpc={"host": "127.0.0.1", "port": 0, "report_timeout_s": 0.2}) as a:
            r = await a.stub.Route(router_pb2.RouteRequest(request_id="lost", prompt_tokens=5))
            assert r.decision == RR.DISPATCH and a.d.router.in_flight == 1
            await poll_until(lambda: a.d.router.in_flight, lambda n: n == 0, 10.0,
                             "the unreported request released after report_timeout_s (router in_flight 0)")
            assert sample(a.d, "phasewise_grpc_unreported_total") == 1
            assert not (await a.stub.ReportCompletion(router_pb2.CompletionReport(request_id="lost"))).known
    asyncio.run(main())


def test_sidecar_state_reaches_get_state_and_goes_stale():
    async def main():
        sc = await FakeSidecar("e0").start()
        sc.set(num_requests_running=3, num_requests_waiting=1, kv_cache_usage=0.5, models=["m"])
        try:
            async with Api(endpoints=[{"name": "e0", "url": "http://127.0.0.1:9", "state_address": sc.address}],
                           state={"max_age_s": 0.3}) as a:
                st = await poll_until(lambda: a.stub.GetState(router_pb2.GetRouterStateRequest()),
                                      lambda s: not s.endpoints[0].stale, 10.0,
                                      "endpoint e0's sidecar state received (not stale)")
                e = st.endpoints[0]
                assert not e.stale and e.instance_state.num_requests_running == 3
                assert e.instance_state.kv_cache_usage == 0.5
                await sc.stop()  # the sidecar dies: its state goes stale after max_age_s
                await poll_until(lambda: a.stub.GetState(router_pb2.GetRouterStateRequest()),
                                 lambda s: s.endpoints[0].stale, 10.0, "endpoint e0 reported stale")
                assert sample(a.d, "phasewise_endpoint_state_stale", endpoint="e0") == 0  # until refreshed
                a.d.refresh_gauges()
                assert sample(a.d, "phasewise_endpoint_state_stale", endpoint="e0") == 1
        finally:
            await sc.stop()
    asyncio.run(main())
