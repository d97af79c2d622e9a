"""An endpoint whose sidecar reports it unhealthy is not ready (issue 31): not a candidate while
another endpoint is ready, not counted by ``/readyz``, ``phasewise_endpoint_ready``, gRPC
``GetState`` nor the health services; an old unhealthy snapshot says nothing any more; when every
endpoint is reported unhealthy, requests still go (fail open, round robin, counted as
``stale_state``) while ``/readyz`` answers 503 naming them."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc

from conftest import toy_profile
from daemon_fakes import FakeBackend, FakeSidecar, sample, start_daemon
from routerd.api.v1 import router_pb2, router_pb2_grpc
from routerd.api.v1.instance_state_pb2 import InstanceState
from routerd.daemon.config import PolicyConfig, RouterConfig
from routerd.daemon.discovery import DiscoveredEndpoint
from routerd.daemon.metrics import Metrics
from routerd.daemon.router import Router, build_routing_policy
from routerd.daemon.state import EndpointState
from stack_processes import poll_until


class Record:
    """A policy that records the candidates it is shown and picks the first."""

    def __init__(self) -> None:
        self.shown: list[list[str]] = []

    def pick(self, request, view):
        self.shown.append([ep.name for ep in view.instances])
        return view.instances[0].index

    def on_complete(self, *a):
        pass


def _state(healthy: bool) -> InstanceState:
    return InstanceState(healthy=healthy, error="" if healthy else "cannot connect to http://e/metrics")


def test_sidecar_unhealthy_needs_a_sidecar_and_a_snapshot_younger_than_the_age_limit():
    ep = EndpointState(0, "e", "http://h:1", "h:2", True, toy_profile())
    assert not ep.sidecar_unhealthy(0.0, 2.0)  # no snapshot yet: stale, not unhealthy
    ep.set_snapshot(_state(False), now=10.0)
    assert ep.sidecar_unhealthy(10.0, 2.0) and ep.sidecar_unhealthy(11.9, 2.0)
    assert not ep.sidecar_unhealthy(12.1, 2.0)  # older than the age: the sidecar says nothing any more
    ep.set_snapshot(_state(True), now=13.0)
    assert not ep.sidecar_unhealthy(13.0, 2.0)
    no_sidecar = EndpointState(0, "e", "http://h:1", None, True, toy_profile())
    no_sidecar.snapshot, no_sidecar.snapshot_at = _state(False), 0.0
    assert not no_sidecar.sidecar_unhealthy(0.0, 2.0)


def test_candidates_ready_count_and_gauge_follow_the_sidecars_health():
    t = [100.0]
    pol = build_routing_policy(PolicyConfig(name="round_robin"), toy_profile(), 3)
    r = Router(profile=toy_profile(), policy=pol, policy_name="round_robin", metrics=Metrics(),
               config=RouterConfig(), state_max_age_s=2.0, clock=lambda: t[0])
    r.set_endpoints([DiscoveredEndpoint(f"e{i}", f"http://127.0.0.1:{9000 + i}", state_address=f"127.0.0.1:{i + 1}")
                     for i in range(3)])
    rec = Record()
    r.set_policy(rec, "record")
    changes = []
    r.on_ready_change = lambda: changes.append(r.ready_count)

    def healthy(*names: str) -> None:
        for i in range(3):
            r.update_state(f"e{i}", _state(f"e{i}" in names))

    def ready_gauge() -> list[float]:
        return [r.metrics.registry.get_sample_value("phasewise_endpoint_ready", {"endpoint": f"e{i}"})
                for i in range(3)]

    def decide() -> str:
        req = r.new_request(5, None)
        ep = r.try_dispatch_now(req)
        assert ep is not None
        r.finish(req)
        return ep.name

    healthy("e0", "e1", "e2")
    decide()
    assert rec.shown[-1] == ["e0", "e1", "e2"] and changes == []
    healthy("e0", "e2")
    assert changes == [2]  # said at once, by the snapshot that turned e1 unhealthy
    assert r.ready_count == 2 and not r.is_ready(r.by_name["e1"]) and ready_gauge() == [1.0, 0.0, 1.0]
    for _ in range(3):
        decide()
        assert rec.shown[-1] == ["e0", "e2"]
    assert r.has_candidate(model=None)
    # e1's sidecar goes silent: its unhealthy snapshot ages out; it is a candidate again (stale).
    t[0] += 2.5
    r.update_state("e0", _state(True))
    r.update_state("e2", _state(True))
    decide()
    assert rec.shown[-1] == ["e0", "e1", "e2"] and r.ready_count == 3
    # Every one unhealthy: fail open, round robin over all of them (the policy is not asked).
    asked = len(rec.shown)
    healthy()
    assert r.ready_count == 0 and changes[-1] == 0 and ready_gauge() == [0.0, 0.0, 0.0]
    got = sorted(decide() for _ in range(3))
    assert got == ["e0", "e1", "e2"] and len(rec.shown) == asked
    assert r.metrics.registry.get_sample_value("phasewise_fallbacks_total", {"reason": "stale_state"}) == 3
    healthy("e1")
    assert changes[-1] == 1 and decide() == "e1" and rec.shown[-1] == ["e1"]
    r.close()


async def _get(s: aiohttp.ClientSession, url: str) -> tuple[int, dict]:
    async with s.get(url) as resp:
        return resp.status, await resp.json()


async def _post(s: aiohttp.ClientSession, base: str) -> tuple[int, str | None]:
    async with s.post(base + "/v1/completions", json={"model": "m", "prompt": "p", "max_tokens": 2}) as resp:
        await resp.read()
        return resp.status, resp.headers.get("x-backend")


def test_routerd_reports_and_routes_by_the_sidecars_health():
    async def main():
        backs = [await FakeBackend(f"b{i}").start() for i in range(2)]
        cars = [await FakeSidecar(f"b{i}").start() for i in range(2)]
        for c in cars:
            c.set()
        d = await start_daemon(endpoints=[{"name": b.name, "url": b.url, "state_address": c.address}
                                          for b, c in zip(backs, cars)],
                               policy={"name": "round_robin"}, predictor="none")
        base = f"http://127.0.0.1:{d.http_port}"
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{d.grpc_port}")
        stub = router_pb2_grpc.RouterServiceStub(channel)

        async def grpc_ready() -> dict[str, bool]:
            st = await stub.GetState(router_pb2.GetRouterStateRequest())
            return {e.instance: e.ready for e in st.endpoints}

        try:
            async with aiohttp.ClientSession() as s:
                await poll_until(lambda: all(ep.snapshot is not None for ep in d.router.endpoints), bool, 10,
                                 "both sidecars' first snapshots")
                assert await _get(s, base + "/readyz") == (200, {"status": "ready", "reason": "ok", "ejected": [],
                                                                 "unhealthy": []})
                cars[1].set(healthy=False, error="cannot connect to http://b1/metrics: Connection refused")
                await poll_until(lambda: d.unhealthy_endpoints(), lambda u: u == ["b1"], 10, "b1 reported unhealthy")
                got = [await _post(s, base) for _ in range(6)]
                assert got == [(200, "b0")] * 6 and backs[1].started == 0
                assert sample(d, "phasewise_upstream_errors_total", endpoint="b1", kind="connect") == 0
                status, body = await _get(s, base + "/readyz")
                assert status == 200 and body["unhealthy"] == ["b1"]
                async with s.get(base + "/metrics") as resp:
                    page = await resp.text()
                assert 'phasewise_endpoint_ready{endpoint="b1"} 0.0' in page
                assert 'phasewise_endpoint_ready{endpoint="b0"} 1.0' in page
                assert await grpc_ready() == {"b0": True, "b1": False}
                # Both unhealthy: not ready, yet a request is still sent (fail open).
                cars[0].set(healthy=False, error="scrape of http://b0/metrics timed out after 1 s")
                await poll_until(lambda: d.unhealthy_endpoints(), lambda u: u == ["b0", "b1"], 10, "both unhealthy")
                status, body = await _get(s, base + "/readyz")
                assert status == 503 and body["status"] == "not ready"
                assert body["reason"] == "no ready endpoint (reported unhealthy by their sidecars: b0, b1)"
                before = sample(d, "phasewise_fallbacks_total", reason="stale_state")
                got = [await _post(s, base) for _ in range(2)]
                assert sorted(got) == [(200, "b0"), (200, "b1")]
                assert sample(d, "phasewise_fallbacks_total", reason="stale_state") - before == 2
                # Healthy again: ready again.
                for c in cars:
                    c.set()
                await poll_until(lambda: d.readiness(), lambda r: r == (True, "ok"), 10, "ready again")
                assert await grpc_ready() == {"b0": True, "b1": True}
                assert json.loads(await (await s.get(base + "/readyz")).text())["unhealthy"] == []
        finally:
            await channel.close()
            await d.stop()
            for x in (*backs, *cars):
                await x.stop()

    asyncio.run(main())


def test_the_pickers_health_follows_the_sidecars():
    """``phasewise epp``: its readiness health service goes NOT_SERVING when every sidecar reports its
    endpoint unhealthy (the picker shares routerd's readiness)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from routerd.daemon.app import Daemon
    from routerd.daemon.config import Settings
    from routerd.epp.server import EppServer

    async def main():
        car = await FakeSidecar("e0").start()
        car.set()
        d = Daemon(Settings.model_validate({
            "models": ["m"], "endpoints": [{"name": "e0", "url": "http://127.0.0.1:9", "state_address": car.address}],
            "grpc": {"enabled": False}, "reload": {"watch": False}, "predictor": "none", "log_level": "warning",
            "epp": {"host": "127.0.0.1", "port": 0, "health_port": 0, "metrics_port": None}}), http_front=False)
        await d.start()
        epp = EppServer(d)
        await epp.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{epp.port}")
        health = health_pb2_grpc.HealthStub(channel)

        async def status() -> int:
            return (await health.Check(health_pb2.HealthCheckRequest(service="readiness"))).status

        try:
            await poll_until(status, lambda s: s == health_pb2.HealthCheckResponse.SERVING, 10, "SERVING")
            car.set(healthy=False, error="cannot connect")
            await poll_until(status, lambda s: s == health_pb2.HealthCheckResponse.NOT_SERVING, 10, "NOT_SERVING")
            car.set()
            await poll_until(status, lambda s: s == health_pb2.HealthCheckResponse.SERVING, 10, "SERVING again")
        finally:
            await channel.close()
            await epp.stop()
            await d.stop()
            await car.stop()

    asyncio.run(main())
