"""Several models behind one routerd (issue 15): each endpoint serves a set of models (configured
or read from its own /v1/models), a request goes only to endpoints serving its model, policy
state is per model, /v1/models is the union, an unknown model is 404 before any dispatch."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import aiohttp
import pytest

from daemon_fakes import FakeBackend, sample, start_daemon
from routerd.daemon.config import Settings
from routerd.daemon.discovery import DiscoveredEndpoint
from routerd.daemon.models import parse_models
from stack_processes import poll_until

#: Every servable policy gets the 1,000-request load below; these two also check the listing and the 404.
POLICIES = ["round_robin", "late_binding"]


async def _post(s, base: str, model: str) -> tuple[int, str | None]:
    body = {"model": model, "prompt": "p", "max_tokens": 2}
    async with s.post(base + "/v1/completions", json=body) as r:
        await r.read()
        return r.status, r.headers.get("x-backend")


async def _stop_all(d, backs) -> None:
    await d.stop()
    for x in backs:
        await x.stop()


@pytest.mark.parametrize("policy", POLICIES)
def test_requests_go_only_to_endpoints_serving_their_model(policy):
    """Target: 0 requests sent to an endpoint that does not serve their model, in a mixed load."""
    async def main():
        a = [await FakeBackend(f"a{i}", models=("model-a",)).start() for i in range(2)]
        b = [await FakeBackend(f"b{i}", models=("model-b", "model-b-lora")).start() for i in range(2)]
        d = await start_daemon([*a, *b], models=[], policy={"name": policy}, router={"tie_break_seed": 3})
        base = f"http://127.0.0.1:{d.http_port}"
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(base + "/v1/models") as r:
                    assert sorted(m["id"] for m in (await r.json())["data"]) == ["model-a", "model-b",
                                                                                 "model-b-lora"]
                wanted = ["model-a", "model-b", "model-b-lora"] * 40
                got = []
                for i in range(0, len(wanted), 12):  # concurrent, so load-aware policies see load
                    got += await asyncio.gather(*(_post(s, base, m) for m in wanted[i:i + 12]))
                wrong = [(m, where) for m, (_, where) in zip(wanted, got)
                         if not where or (where[0] == "a") != (m == "model-a")]
                assert [st for st, _ in got] == [200] * len(wanted)
                assert wrong == []
                # Backends saw only their own models.
                for back in (*a, *b):
                    seen = {json.loads(x)["model"] for x in back.bodies}
                    assert seen <= set(back.models), (back.name, seen)
                status, _ = await _post(s, base, "model-c")
                assert status == 404
            assert sample(d, "phasewise_rejections_total", reason="not_found") == 1
            assert sum(b_.started for b_ in (*a, *b)) == len(wanted)  # the 404 reached nobody
        finally:
            await _stop_all(d, (*a, *b))

    asyncio.run(main())


def test_round_robin_position_is_per_model():
    async def main():
        a = [await FakeBackend(f"a{i}", models=("model-a",)).start() for i in range(2)]
        b = [await FakeBackend(f"b{i}", models=("model-b",)).start() for i in range(3)]
        d = await start_daemon([*a, *b], models=[], policy={"name": "round_robin"})
        base = f"http://127.0.0.1:{d.http_port}"
        try:
            async with aiohttp.ClientSession() as s:
                order = [await _post(s, base, m) for m in ["model-a", "model-b"] * 6]
            a_seq = [w for (m, (_, w)) in zip(["model-a", "model-b"] * 6, order) if m == "model-a"]
            b_seq = [w for (m, (_, w)) in zip(["model-a", "model-b"] * 6, order) if m == "model-b"]
            assert a_seq == ["a0", "a1"] * 3 and b_seq == ["b0", "b1", "b2"] * 2
        finally:
            await _stop_all(d, (*a, *b))

    asyncio.run(main())


def test_configured_models_need_no_discovery_and_a_404_refreshes_the_list():
    async def main():
        a = await FakeBackend("a0", models=("model-a",)).start()
        b = await FakeBackend("b0", models=("model-b",)).start()
        d = await start_daemon([], models=[], endpoints=[{"name": "a0", "url": a.url, "models": ["model-a"]},
                                                         {"name": "b0", "url": b.url}])
        base = f"http://127.0.0.1:{d.http_port}"
        try:
            async with aiohttp.ClientSession() as s:
                assert (await _post(s, base, "model-b"))[1] == "b0"
                # b0 swaps its model; the next /v1/models read (here: forced) routes by the new one.
                b.models = ["model-b2"]
                await d.model_lister.refresh()
                assert sorted(d.model_names()) == ["model-a", "model-b2"]
                assert (await _post(s, base, "model-b2"))[1] == "b0"
                assert (await _post(s, base, "model-b"))[0] == 404
        finally:
            await _stop_all(d, (a, b))

    asyncio.run(main())


@pytest.mark.parametrize("body, ok", [
    (b'{"object": "list", "data": [{"id": "m", "object": "model"}, {"id": "lora-1"}]}', ["m", "lora-1"]),
    (b'{"data": []}', []),
    (b'not json', None), (b'{"data": {"id": "m"}}', None), (b'{"data": [{"name": "m"}]}', None), (b'[]', None),
])
def test_parse_models(body, ok):
    if ok is None:
        with pytest.raises(ValueError):
            parse_models(body)
    else:
        assert parse_models(body) == ok


def test_decisions_are_spread_per_model_with_counters():
    async def main():
        a = [await FakeBackend(f"a{i}", models=("model-a",)).start() for i in range(3)]
        d = await start_daemon(a, models=[], policy={"name": "join_shortest_queue"}, router={"tie_break_seed": 5})
        base = f"http://127.0.0.1:{d.http_port}"
        try:
            async with aiohttp.ClientSession() as s:
                got = [await _post(s, base, "model-a") for _ in range(30)]
            assert Counter(w for _, w in got).keys() == {"a0", "a1", "a2"}
        finally:
            await _stop_all(d, a)

    asyncio.run(main())


# -- fail closed (an endpoint whose list is not known serves nothing while several models are possible) --

@pytest.mark.parametrize("models, status", [(["model-a", "model-b"], 401), (["model-a", "model-b"], 403),
                                            ([], 401), (["model-a", "model-b"], 500)])
def test_an_endpoint_whose_list_is_unreadable_serves_nothing(models, status):
    """x's /v1/models answers 401/403/500 (vLLM's --api-key, a broken server): x takes no request,
    neither for the top-level models nor for any other, until its list is known. With ``models``
    empty, c0's model-c is the evidence that several models are possible (an unknown list alone
    is none)."""
    async def main():
        a = await FakeBackend("a0", models=("model-a",)).start()
        x = await FakeBackend("x0", models=("model-b",)).start()
        x.models_status = status
        c = [] if models else [await FakeBackend("c0", models=("model-c",)).start()]
        d = await start_daemon([a, x, *c], models=models)
        base = f"http://127.0.0.1:{d.http_port}"
        try:
            async with aiohttp.ClientSession() as s:
                got = [await _post(s, base, "model-a") for _ in range(6)]
                assert got == [(200, "a0")] * 6
                if models:  # model-b is configured but no known list has it: 503, sent nowhere
                    assert (await _post(s, base, "model-b"))[0] == 503
                assert x.started == 0
                # Once x's list can be read, x serves what it lists.
                x.models_status = 200
                await d.model_lister.refresh()
                assert await _post(s, base, "model-b") == (200, "x0")
        finally:
            await _stop_all(d, (a, x, *c))

    asyncio.run(main())


def test_a_list_that_becomes_unreadable_is_forgotten_and_a_single_model_goes_everywhere():
    async def main():
        a = await FakeBackend("a0", models=("model-a",)).start()
        b = await FakeBackend("b0", models=("model-b",)).start()
        d = await start_daemon([a, b], models=["model-a", "model-b"])
        base = f"http://127.0.0.1:{d.http_port}"
        try:
            async with aiohttp.ClientSession() as s:
                assert await _post(s, base, "model-b") == (200, "b0")
                b.models_status = 401  # the answer says "not for you": b's models are unknown now
                await d.model_lister.refresh()
                assert (await _post(s, base, "model-b"))[0] == 503
                assert b.started == 1
        finally:
            await _stop_all(d, (a, b))

    asyncio.run(main())


def test_one_configured_model_and_nothing_discovered_goes_to_every_endpoint():
    """Today's single-model behaviour: no /v1/models read, every endpoint takes the model."""
    async def main():
        backs = [await FakeBackend(f"e{i}", models=("other",)).start() for i in range(2)]
        d = await start_daemon(backs, models=["m"], policy={"name": "round_robin"})
        base = f"http://127.0.0.1:{d.http_port}"
        try:
            async with aiohttp.ClientSession() as s:
                got = [await _post(s, base, "m") for _ in range(4)]
            assert [w for _, w in got] == ["e0", "e1", "e0", "e1"]
            assert [b_.models_reads for b_ in backs] == [0, 0]
        finally:
            await _stop_all(d, backs)

    asyncio.run(main())


def _settings(d, **changes) -> Settings:
    return Settings.model_validate({**d.settings.model_dump(), **changes})


def test_configured_models_replace_discovered_ones_across_reloads():
    async def main():
        b = await FakeBackend("b0", models=("model-b",)).start()
        a = await FakeBackend("a0", models=("model-a",)).start()
        d = await start_daemon([a, b], models=[])
        base = f"http://127.0.0.1:{d.http_port}"
        eps = [{"name": "a0", "url": a.url}, {"name": "b0", "url": b.url}]
        try:
            async with aiohttp.ClientSession() as s:
                assert await _post(s, base, "model-b") == (200, "b0")
                # b0 is now configured to serve model-c: its discovered model-b must not survive.
                assert await d.reload(_settings(d, endpoints=[eps[0], {**eps[1], "models": ["model-c"]}]))
                assert sorted(d.model_names()) == ["model-a", "model-c"]
                assert (await _post(s, base, "model-b"))[0] == 404
                assert await _post(s, base, "model-c") == (200, "b0")
                # Configured models gone: b0 is read again at once (not after model_refresh_s = 30 s).
                reads = b.models_reads
                assert await d.reload(_settings(d, endpoints=eps))
                await poll_until(lambda: b.models_reads, lambda n: n > reads, 30.0, "b0's /v1/models read again")
                await poll_until(d.model_names, lambda n: sorted(n) == ["model-a", "model-b"], 30.0,
                                 "model-b learned again")
                assert await _post(s, base, "model-b") == (200, "b0")
            assert b.started == 3 and a.started == 0
        finally:
            await _stop_all(d, (a, b))

    asyncio.run(main())


def test_a_change_of_models_on_reload_reads_every_list_at_once():
    async def main():
        a = await FakeBackend("a0", models=("model-a",)).start()
        b = await FakeBackend("b0", models=("model-b",)).start()
        d = await start_daemon([a, b], models=["model-a"])  # one model: nothing is read
        try:
            assert (a.models_reads, b.models_reads) == (0, 0)
            assert await d.reload(_settings(d, models=["model-a", "model-b"]))
            await poll_until(lambda: (a.models_reads, b.models_reads), lambda n: min(n) >= 1, 30.0,
                             "both lists read after the reload")
            base = f"http://127.0.0.1:{d.http_port}"
            async with aiohttp.ClientSession() as s:
                await poll_until(lambda: _post(s, base, "model-b"), lambda r: r == (200, "b0"), 30.0,
                                 "model-b routed to b0")
                assert [await _post(s, base, "model-a") for _ in range(3)] == [(200, "a0")] * 3
            # Back to one model: the lists learned meanwhile are dropped (nothing refreshes them).
            assert await d.reload(_settings(d, models=["model-a"]))
            assert [ep.discovered_models for ep in d.router.endpoints] == [None, None]
        finally:
            await _stop_all(d, (a, b))

    asyncio.run(main())


# -- the sidecar's one model name never narrows what an endpoint serves --------------------------

@pytest.mark.parametrize("models, asked", [(["alias"], "alias"), (["base", "base-lora"], "base-lora")])
def test_the_sidecars_model_name_does_not_narrow_the_configured_models(models, asked):
    """vLLM's metrics carry its first served name only ("base"): an alias or a LoRA adapter in
    ``models`` (listed by the endpoint's /v1/models) must still route."""
    from daemon_fakes import FakeSidecar

    async def main():
        b = await FakeBackend("b0", models=("base", "alias", "base-lora")).start()
        side = await FakeSidecar("b0").start()
        side.set(models=["base"])
        d = await start_daemon([], models=models,
                               endpoints=[{"name": "b0", "url": b.url, "state_address": side.address}])
        base = f"http://127.0.0.1:{d.http_port}"
        try:
            await poll_until(lambda: d.router.by_name["b0"].snapshot, lambda st: st is not None and st.models,
                             30.0, "the sidecar's state received")
            async with aiohttp.ClientSession() as s:
                assert await _post(s, base, asked) == (200, "b0")
                # The sidecar's name is routable when it is configured; otherwise 404 like any other.
                assert await _post(s, base, "base") == ((200, "b0") if "base" in models else (404, None))
        finally:
            await _stop_all(d, (side, b))

    asyncio.run(main())


def test_without_a_list_the_sidecars_name_is_all_an_endpoint_serves_among_several():
    """/v1/models unreadable (401) with several models: the sidecar's name is certainly served
    (a lower bound), the configured adapter is not known to be: 503, sent nowhere."""
    from daemon_fakes import FakeSidecar

    async def main():
        b = await FakeBackend("b0", models=("base", "base-lora")).start()
        b.models_status = 401
        side = await FakeSidecar("b0").start()
        side.set(models=["base"])
        d = await start_daemon([], models=["base", "base-lora"],
                               endpoints=[{"name": "b0", "url": b.url, "state_address": side.address}])
        base = f"http://127.0.0.1:{d.http_port}"
        try:
            await poll_until(lambda: d.router.by_name["b0"].snapshot, lambda st: st is not None and st.models,
                             30.0, "the sidecar's state received")
            async with aiohttp.ClientSession() as s:
                assert await _post(s, base, "base") == (200, "b0")
                assert (await _post(s, base, "base-lora"))[0] == 503
            assert b.started == 1
        finally:
            await _stop_all(d, (side, b))

    asyncio.run(main())


# -- gRPC Route without a model ---------------------------------------------------------------------

def test_grpc_route_without_a_model_is_refused_among_several_and_defaults_to_the_only_one():
    import grpc

    from routerd.api.v1 import router_pb2, router_pb2_grpc

    async def main():
        a = await FakeBackend("a0", models=("model-a",)).start()
        b = await FakeBackend("b0", models=("model-b",)).start()
        d = await start_daemon([a, b], models=[])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{d.grpc_port}") as ch:
                stub = router_pb2_grpc.RouterServiceStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Route(router_pb2.RouteRequest(request_id="r1", prompt_tokens=5))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert e.value.details() == ("model is required: this routerd serves several models "
                                             "(model-a, model-b)")
                ok = await stub.Route(router_pb2.RouteRequest(request_id="r2", model="model-b", prompt_tokens=5))
                assert (ok.decision, ok.instance) == (router_pb2.RouteResponse.DISPATCH, "b0")
                # One model left (a reload configures b0 to serve model-a too): it is the default.
                assert await d.reload(_settings(d, endpoints=[{"name": "a0", "url": a.url},
                                                               {"name": "b0", "url": b.url, "models": ["model-a"]}]))
                await poll_until(d.model_names, lambda n: n == ["model-a"], 30.0, "model-a the only model")
                got = [await stub.Route(router_pb2.RouteRequest(request_id=f"s{i}", prompt_tokens=5))
                       for i in range(4)]
                assert {g.instance for g in got} == {"a0", "b0"}
                assert all(g.decision == router_pb2.RouteResponse.DISPATCH for g in got)
                assert {d._grpc.servicer.inflight[f"s{i}"][0].model for i in range(4)} == {"model-a"}
        finally:
            await _stop_all(d, (a, b))

    asyncio.run(main())


# -- what serves which model is computed when it changes, not per request ----------------------------

class _CountingList(list):
    """A list that counts how often it is iterated (the endpoint table, scanned or not per request)."""

    iterations = 0

    def __iter__(self):
        _CountingList.iterations += 1
        return super().__iter__()


def test_no_request_scans_the_endpoint_table_while_nothing_changes():
    async def main():
        a = [await FakeBackend(f"a{i}", models=("model-a",)).start() for i in range(2)]
        b = [await FakeBackend(f"b{i}", models=("model-b",)).start() for i in range(2)]
        d = await start_daemon([*a, *b], models=[], policy={"name": "round_robin"})
        base = f"http://127.0.0.1:{d.http_port}"
        try:
            async with aiohttp.ClientSession() as s:
                for m in ("model-a", "model-b"):  # warm the candidate caches
                    assert (await _post(s, base, m))[0] == 200
                d.router.endpoints = _CountingList(d.router.endpoints)
                _CountingList.iterations = 0
                got = [await _post(s, base, m) for m in ["model-a", "model-b"] * 5]
                assert [st for st, _ in got] == [200] * 10
                assert _CountingList.iterations == 0
                assert d.router.several_models is True
                assert {m: [ep.name for ep in eps] for m, eps in d.router._by_model.items()} == {
                    "model-a": ["a0", "a1"], "model-b": ["b0", "b1"]}
        finally:
            await _stop_all(d, (*a, *b))

    asyncio.run(main())


# -- a request held for one model does not block another's ------------------------------------------

def _router(policy: str, eps):
    from routerd.daemon.config import PolicyConfig, RouterConfig
    from routerd.daemon.discovery import DiscoveredEndpoint
    from routerd.daemon.metrics import Metrics
    from routerd.daemon.router import Router, build_routing_policy
    from routerd.profiles import get_profile

    prof = get_profile("llama2-7b-v100")
    router = Router(profile=prof, policy=build_routing_policy(PolicyConfig(name=policy), prof, len(eps)),
                    policy_name=policy, metrics=Metrics(), config=RouterConfig(tie_break_seed=1), state_max_age_s=2.0)
    router.set_endpoints([DiscoveredEndpoint(n, f"http://10.0.0.{i}:8000", models=ms) for i, (n, ms) in enumerate(eps)])
    return router, prof


def test_a_held_request_of_one_model_does_not_block_another_model():
    async def main():
        router, prof = _router("late_binding", [("a0", ("model-a",)), ("b0", ("model-b",))])
        a0 = router.by_name["a0"]
        for _ in range(prof.max_num_seqs):  # a0 full: late_binding holds model-a's requests
            a0.add(router.new_request(10, 0, model="model-a"), 0.0)
        held = asyncio.ensure_future(router.dispatch(router.new_request(10, 0, model="model-a")))
        await asyncio.sleep(0)
        assert not held.done() and len(router.queue) == 1
        # HTTP (queued) and gRPC (decided at once) requests for model-b are not behind it.
        ep = await asyncio.wait_for(router.dispatch(router.new_request(10, 0, model="model-b")), 30.0)
        assert ep.name == "b0"
        ep = router.try_dispatch_now(router.new_request(10, 0, model="model-b"))
        assert ep is not None and ep.name == "b0"
        # ...while a gRPC request for model-a still waits its turn behind the held one (FIFO per model).
        assert router.try_dispatch_now(router.new_request(10, 0, model="model-a")) is None
        assert not held.done() and len(router.queue) == 1
        router.finish(next(iter(a0.requests.values())))  # room on a0: the held one goes
        assert (await asyncio.wait_for(held, 30.0)).name == "a0"
        assert len(router.queue) == 0
        router.close()

    asyncio.run(main())


# -- each model's policy is built fresh from the registry ---------------------------------------------

def test_each_models_policy_is_built_fresh_with_its_own_count_and_seed():
    import hashlib

    from routerd.policies.base import ClusterView

    def seed_of(model: str) -> int:  # independent of routerd's code: blake2b-32 of "0\0<model>"
        return int.from_bytes(hashlib.blake2b(f"0\0{model}".encode(), digest_size=4).digest(), "big")

    async def main():
        eps = [(f"a{i}", ("model-a",)) for i in range(3)] + [(f"b{i}", ("model-b",)) for i in range(2)]
        router, _ = _router("round_robin", eps)
        # The base policy has moved on (as a live one would have); a copy of it would start at a1.
        router.policy.pick(None, ClusterView(0.0, router.endpoints, 1))
        got = []
        for m in ["model-a", "model-b"] * 3:
            r = router.new_request(10, 0, model=m)
            got.append(router.try_dispatch_now(r).name)
            router.finish(r)
        assert got == ["a0", "b0", "a1", "b1", "a2", "b0"]
        pa, pb = router._policy_for("model-a"), router._policy_for("model-b")
        assert pa is not router.policy and pb is not pa
        assert (pa.ctx.num_instances, pb.ctx.num_instances) == (3, 2)
        assert (pa.ctx.seed, pb.ctx.seed) == (seed_of("model-a"), seed_of("model-b"))
        router.close()
        # Seeded per model: a random policy picks the same sequence in every run.
        seqs = []
        for _ in range(2):
            router, _ = _router("random", eps)
            seq = []
            for _ in range(8):
                r = router.new_request(10, 0, model="model-a")
                seq.append(router.try_dispatch_now(r).name)
                router.finish(r)
            seqs.append(seq)
            assert router._policy_for("model-a").ctx.seed == seed_of("model-a")
            router.close()
        assert seqs[0] == seqs[1] and set(seqs[0]) <= {"a0", "a1", "a2"} and len(set(seqs[0])) > 1

    asyncio.run(main())


# -- the target: 0 misrouted in a mixed-model load of 1,000 requests, under every policy ----------------

def _servable_policies() -> list[str]:
    from routerd.policies.registry import POLICIES

    return [name for name, cls in POLICIES.items() if not cls.oracle]


#: Which backend serves what: two models on two instances each, one with a LoRA adapter too.
_SERVES = {"a0": ("model-a",), "a1": ("model-a",), "b0": ("model-b", "model-b-lora"), "b1": ("model-b", "model-b-lora")}
_MIX = ["model-a", "model-b", "model-b-lora", "model-a"]
#: Parameters for policies whose defaults pace dispatches in wall time: max_capacity_usage sends
#: in windows every 1 s (the paper's grid), which would take minutes for 1,000 requests here.
_PARAMS = {"max_capacity_usage": {"interval_s": 0.001}}


@pytest.mark.parametrize("policy", _servable_policies())
def test_a_thousand_mixed_requests_are_never_misrouted(policy):
    """600 HTTP completions and 400 gRPC Route decisions, concurrent, over 3 model names: every
    one answered, none sent to an endpoint that does not serve its model (the backends answer
    404 to a model they do not serve, as vLLM does, and count those), each list read once."""
    import grpc

    from routerd.api.v1 import router_pb2, router_pb2_grpc

    async def main():
        backs = {n: await FakeBackend(n, models=ms).start() for n, ms in _SERVES.items()}
        for b_ in backs.values():
            b_.reject_unknown_models = True
        d = await start_daemon(list(backs.values()), models=[], policy={"name": policy,
                                                                        "params": _PARAMS.get(policy, {})},
                               router={"tie_break_seed": 7, "action_interval_s": 0.005},
                               # No periodic re-read inside the run, however slow a loaded
                               # machine makes it: each list is read exactly once (asserted).
                               model_refresh_s=3600.0)
        base = f"http://127.0.0.1:{d.http_port}"
        sem = asyncio.Semaphore(48)
        http_wrong, grpc_wrong, answered = [], [], Counter()

        async def http_one(i: int, s) -> None:
            m = _MIX[i % len(_MIX)]
            async with sem:
                status, where = await _post(s, base, m)
            answered[("http", status)] += 1
            if where is None or m not in _SERVES[where]:
                http_wrong.append((m, where, status))

        async def grpc_one(i: int, stub) -> None:
            m = _MIX[i % len(_MIX)]
            rid = f"g{i}"
            async with sem:
                for _ in range(2000):  # a held request asks again (bounded)
                    r = await stub.Route(router_pb2.RouteRequest(request_id=rid, model=m, prompt_tokens=8))
                    if r.decision != router_pb2.RouteResponse.HOLD:
                        break
                    await asyncio.sleep(r.retry_after_s)
                answered[("grpc", r.decision)] += 1
                if r.decision == router_pb2.RouteResponse.DISPATCH and m not in _SERVES[r.instance]:
                    grpc_wrong.append((m, r.instance))
                await stub.ReportCompletion(router_pb2.CompletionReport(request_id=rid, generated_tokens=1))

        try:
            async with aiohttp.ClientSession() as s, grpc.aio.insecure_channel(f"127.0.0.1:{d.grpc_port}") as ch:
                stub = router_pb2_grpc.RouterServiceStub(ch)
                load = asyncio.gather(*(http_one(i, s) for i in range(600)), *(grpc_one(i, stub) for i in range(400)))
                try:
                    await asyncio.wait_for(load, 300.0)  # a hang, not a speed bound: ~2 s when quiet
                except asyncio.TimeoutError:
                    raise AssertionError(f"policy {policy}: 1000 requests not all answered within 300 s; "
                                         f"answered so far: {dict(answered)}") from None
            misrouted = sum(b_.misrouted for b_ in backs.values())
            print(f"policy {policy}: misrouted {misrouted + len(grpc_wrong)} of 1000")
            assert (http_wrong, grpc_wrong, misrouted) == ([], [], 0)
            assert answered == {("http", 200): 600, ("grpc", router_pb2.RouteResponse.DISPATCH): 400}
            assert sum(b_.started for b_ in backs.values()) == 600
            assert {n: b_.models_reads for n, b_ in backs.items()} == {n: 1 for n in backs}
        finally:
            await _stop_all(d, list(backs.values()))

    asyncio.run(main())


# -- one model, lists unknown: routed as before lists existed (no evidence of several) -----------------

@pytest.mark.parametrize("both_sidecars", [False, True])
def test_one_model_without_lists_goes_everywhere_and_needs_no_model_in_grpc(both_sidecars):
    """Servers without /v1/models (404, not vLLM), sidecars reporting the one model m on e0 (and
    e1): one model is all the evidence shows, so e1 without a sidecar still takes its share, gRPC
    Route without a model takes m, and a 404 list is not re-read every retry_s."""
    import grpc

    from daemon_fakes import FakeSidecar
    from routerd.api.v1 import router_pb2, router_pb2_grpc

    async def main():
        backs = [await FakeBackend(f"e{i}", models=("m",)).start() for i in range(2)]
        for b_ in backs:
            b_.models_status = 404
        sides = [await FakeSidecar(f"e{i}").start() for i in range(2)]
        for sd in sides:
            sd.set(models=["m"])
        eps = [{"name": "e0", "url": backs[0].url, "state_address": sides[0].address},
               {"name": "e1", "url": backs[1].url, **({"state_address": sides[1].address} if both_sidecars else {})}]
        d = await start_daemon([], models=[], endpoints=eps, policy={"name": "round_robin"})
        base = f"http://127.0.0.1:{d.http_port}"
        try:
            for name in (["e0", "e1"] if both_sidecars else ["e0"]):
                await poll_until(lambda n=name: d.router.by_name[n].snapshot, lambda st: st is not None and st.models,
                                 30.0, f"{name}'s sidecar state received")
            assert d.router.several_models is False
            async with aiohttp.ClientSession() as s:
                got = [await _post(s, base, "m") for _ in range(8)]
            assert Counter(got) == {(200, "e0"): 4, (200, "e1"): 4}
            async with grpc.aio.insecure_channel(f"127.0.0.1:{d.grpc_port}") as ch:
                stub = router_pb2_grpc.RouterServiceStub(ch)
                r = await stub.Route(router_pb2.RouteRequest(request_id="x1", prompt_tokens=5))
                assert r.decision == router_pb2.RouteResponse.DISPATCH and r.instance in {"e0", "e1"}
                assert d._grpc.servicer.inflight["x1"][0].model == "m"
            # The lister's fast-retry set drives the every-retry_s reads: a 404 is not in it.
            assert (d.model_lister._failing, d.model_lister._no_list) == (set(), {"e0", "e1"})
            assert [b_.models_reads for b_ in backs] == [1, 1]
        finally:
            await _stop_all(d, (*sides, *backs))

    asyncio.run(main())


def test_one_model_with_an_endpoint_not_up_yet_is_not_several():
    """e1 refuses connections at start (vLLM still loading): its list is unknown, which is no
    evidence of a second model: gRPC Route without a model takes e0's only model."""
    import socket

    import grpc

    from routerd.api.v1 import router_pb2, router_pb2_grpc

    async def main():
        e0 = await FakeBackend("e0", models=("m",)).start()
        sk = socket.socket()
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
        sk.close()  # nothing listens there
        d = await start_daemon([], models=[], endpoints=[{"name": "e0", "url": e0.url},
                                                         {"name": "e1", "url": f"http://127.0.0.1:{port}"}])
        try:
            assert (d.router.several_models, d.model_names()) == (False, ["m"])
            async with grpc.aio.insecure_channel(f"127.0.0.1:{d.grpc_port}") as ch:
                stub = router_pb2_grpc.RouterServiceStub(ch)
                r = await stub.Route(router_pb2.RouteRequest(request_id="x", prompt_tokens=5))
                assert (r.decision, r.instance) == (router_pb2.RouteResponse.DISPATCH, "e0")
        finally:
            await _stop_all(d, (e0,))

    asyncio.run(main())


class _GatedList(FakeBackend):
    """A backend whose /v1/models answers only once :attr:`list_gate` is set (a slow or hung list)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.list_gate = asyncio.Event()
        self.list_asked = 0
        """``GET /v1/models`` requests received, answered or still waiting at the gate."""

    async def _models(self, request):
        self.list_asked += 1
        await self.list_gate.wait()
        return await super()._models(request)


# -- a moved endpoint's list is the new server's, not the old one's ----------------------------------

def test_an_endpoint_moved_to_another_url_serves_nothing_until_its_new_list_is_read():
    """A reload keeps the name a1 but points it at a model-b server whose /v1/models hangs: the
    model-a list read from the old URL is dropped, a1 takes no model-a request while the new
    list is unknown (however long), then serves what the new server lists."""
    async def main():
        a0 = await FakeBackend("a0", models=("model-a",)).start()
        a1 = await FakeBackend("a1", models=("model-a",)).start()
        b = await _GatedList("b", models=("model-b",)).start()
        for x in (a0, a1, b):
            x.reject_unknown_models = True
        d = await start_daemon([a0, a1], models=[], policy={"name": "round_robin"}, model_refresh_s=3600.0)
        base = f"http://127.0.0.1:{d.http_port}"
        try:
            assert await d.reload(_settings(d, endpoints=[{"name": "a0", "url": a0.url},
                                                          {"name": "a1", "url": b.url}]))
            assert d.router.by_name["a1"].discovered_models is None
            async with aiohttp.ClientSession() as s:
                got = [await _post(s, base, "model-a") for _ in range(10)]
                assert got == [(200, "a0")] * 10
                assert b.misrouted == 0 and b.started == 0
                b.list_gate.set()
                await poll_until(d.model_names, lambda n: sorted(n) == ["model-a", "model-b"], 30.0,
                                 "b's list read for a1")
                assert await _post(s, base, "model-b") == (200, "b")
                assert [await _post(s, base, "model-a") for _ in range(3)] == [(200, "a0")] * 3
        finally:
            await _stop_all(d, (a0, a1, b))

    asyncio.run(main())


def test_a_list_read_from_an_old_url_is_not_reported():
    """The endpoint moves while its old URL's read is in flight: that answer is not its list."""
    from routerd.daemon.models import ModelLister

    async def main():
        old = await _GatedList("old", models=("model-a",)).start()
        new = await FakeBackend("new", models=("model-b",)).start()
        where = {"e": old.url}
        got = []
        lister = ModelLister(lambda: list(where.items()), lambda n, ids: got.append((n, ids)))
        try:
            t = asyncio.ensure_future(lister.refresh())
            await poll_until(lambda: old.list_asked, lambda n: n == 1, 30.0, "the old URL's read started")
            where["e"] = new.url
            old.list_gate.set()
            await asyncio.wait_for(t, 30.0)
            assert got == []
            await lister.refresh()
            assert got == [("e", ["model-b"])]
        finally:
            await lister.close()
            await old.stop()
            await new.stop()

    asyncio.run(main())


# -- a model whose endpoint's list is still being read is 503 (retryable), not 404 -------------------

def test_a_model_served_by_an_endpoint_whose_list_is_being_read_is_503_not_404():
    """A reload replaces b0 (model-b) by b1 whose /v1/models has not answered yet: model-b (and
    any unknown name) is 503 no_endpoint with Retry-After, sent nowhere, while b1's list is
    unknown; once read, model-b goes to b1 and an unknown name is 404."""
    import grpc

    from routerd.api.v1 import router_pb2, router_pb2_grpc

    async def main():
        a0 = await FakeBackend("a0", models=("model-a",)).start()
        b0 = await FakeBackend("b0", models=("model-b",)).start()
        b1 = await _GatedList("b1", models=("model-b",)).start()
        d = await start_daemon([a0, b0], models=[], model_refresh_s=3600.0)
        base = f"http://127.0.0.1:{d.http_port}"
        body = {"model": "model-b", "prompt": "p", "max_tokens": 2}
        try:
            assert await d.reload(_settings(d, endpoints=[{"name": "a0", "url": a0.url},
                                                          {"name": "b1", "url": b1.url}]))
            async with aiohttp.ClientSession() as s:
                for m in ("model-b", "model-z"):
                    async with s.post(base + "/v1/completions", json={**body, "model": m}) as r:
                        doc = await r.json()
                        assert (r.status, r.headers.get("Retry-After"), r.headers.get("x-phasewise-reject-reason"),
                                doc["error"]["type"], doc["error"]["code"]) == (
                            503, "1", "no_endpoint", "service_unavailable", "no_endpoint"), (m, doc)
                async with grpc.aio.insecure_channel(f"127.0.0.1:{d.grpc_port}") as ch:
                    stub = router_pb2_grpc.RouterServiceStub(ch)
                    got = await stub.Route(router_pb2.RouteRequest(request_id="g", model="model-b", prompt_tokens=5))
                    assert (got.decision, got.reason) == (router_pb2.RouteResponse.REJECT, "no_endpoint")
                assert b1.started == 0 and a0.started == 0
                b1.list_gate.set()
                await poll_until(d.model_names, lambda n: sorted(n) == ["model-a", "model-b"], 30.0,
                                 "b1's list read")
                assert await _post(s, base, "model-b") == (200, "b1")
                assert await _post(s, base, "model-z") == (404, None)
        finally:
            await _stop_all(d, (a0, b0, b1))

    asyncio.run(main())


def test_with_a_grace_a_request_waits_for_the_list_being_read():
    """router.no_endpoint_grace_s > 0: a model-b request arriving while b1's list is being read
    waits for it (as for a ready endpoint) and goes to b1."""
    async def main():
        a0 = await FakeBackend("a0", models=("model-a",)).start()
        b1 = await _GatedList("b1", models=("model-b",)).start()
        d = await start_daemon([a0], models=[], model_refresh_s=3600.0, router={"no_endpoint_grace_s": 60.0})
        base = f"http://127.0.0.1:{d.http_port}"
        try:
            assert await d.reload(_settings(d, endpoints=[{"name": "a0", "url": a0.url},
                                                          {"name": "b1", "url": b1.url}]))
            async with aiohttp.ClientSession() as s:
                t = asyncio.ensure_future(_post(s, base, "model-b"))
                await poll_until(lambda: len(d.router._models_waiters), lambda n: n == 1, 30.0,
                                 "the request waiting for the lists")
                assert not t.done()
                b1.list_gate.set()
                assert await asyncio.wait_for(t, 30.0) == (200, "b1")
        finally:
            await _stop_all(d, (a0, b1))

    asyncio.run(main())


def test_grpc_route_reusing_a_request_id_for_another_model_is_refused():
    """Route is idempotent for the same request; a request_id in flight for model-a reused for
    model-b must not get model-a's endpoint (a0 does not serve model-b)."""
    import grpc

    from routerd.api.v1 import router_pb2, router_pb2_grpc

    async def main():
        a = await FakeBackend("a0", models=("model-a",)).start()
        b = await FakeBackend("b0", models=("model-b",)).start()
        d = await start_daemon([a, b], models=[])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{d.grpc_port}") as ch:
                stub = router_pb2_grpc.RouterServiceStub(ch)
                r1 = await stub.Route(router_pb2.RouteRequest(request_id="x", model="model-a", prompt_tokens=5))
                assert (r1.decision, r1.instance) == (router_pb2.RouteResponse.DISPATCH, "a0")
                again = await stub.Route(router_pb2.RouteRequest(request_id="x", model="model-a", prompt_tokens=5))
                assert (again.decision, again.instance) == (router_pb2.RouteResponse.DISPATCH, "a0")
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Route(router_pb2.RouteRequest(request_id="x", model="model-b", prompt_tokens=5))
                assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
                assert e.value.details() == ("request_id 'x' is in flight for the model 'model-a'; this Route "
                                             "names the model 'model-b'")
                assert list(d._grpc.servicer.inflight) == ["x"] and d.router.in_flight == 1
        finally:
            await _stop_all(d, (a, b))

    asyncio.run(main())


# -- a /v1/models answer is bounded ------------------------------------------------------------------

@pytest.mark.parametrize("chunked", [False, True])
def test_an_oversized_model_list_is_not_buffered_and_leaves_the_list_unknown(chunked):
    """A /v1/models answer over MAX_LIST_BYTES (with or without Content-Length): reported as no
    usable list (None), and the server stops being read before the end of its body."""
    from aiohttp import web

    from daemon_fakes import serve_app
    from routerd.daemon.models import MAX_LIST_BYTES, ModelLister

    sent = []

    async def huge(request):
        head, tail = b'{"object":"list","data":[{"id":"', b'"}]}'
        n = 4 * MAX_LIST_BYTES
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        if not chunked:
            resp.content_length = len(head) + n + len(tail)
        await resp.prepare(request)
        await resp.write(head)
        try:
            for _ in range(n // (256 * 1024)):
                await resp.write(b"x" * (256 * 1024))
                sent.append(256 * 1024)
            await resp.write(tail)
        except (ConnectionError, asyncio.CancelledError):
            pass
        return resp

    async def main():
        app = web.Application()
        app.router.add_get("/v1/models", huge)
        runner, port = await serve_app(app, handler_cancellation=True)
        got = []
        lister = ModelLister(lambda: [("e", f"http://127.0.0.1:{port}")], lambda n, ids: got.append((n, ids)))
        try:
            await lister.refresh()
            assert got == [("e", None)]
            assert (lister._failing, lister._no_list) == (set(), {"e"})  # not re-read every retry_s
            assert sum(sent) < 4 * MAX_LIST_BYTES
        finally:
            await lister.close()
            await runner.cleanup()

    asyncio.run(main())


def test_model_ids_over_the_length_limit_are_ignored():
    from routerd.daemon.models import MAX_ID_CHARS

    ok, long_ = "m" * MAX_ID_CHARS, "m" * (MAX_ID_CHARS + 1)
    body = json.dumps({"object": "list", "data": [{"id": "a"}, {"id": long_}, {"id": ok}]}).encode()
    assert parse_models(body) == ["a", ok]


# -- an adapter unloaded on one endpoint, loaded on another ------------------------------------------

def test_a_backend_404_for_an_unloaded_adapter_is_retried_on_another_endpoint_serving_it():
    """b0 unloads model-b-lora (its list still has it): its 404 is not relayed, the request goes
    to b1, which serves it, and b0's list is read again, after which b0 gets none."""
    async def main():
        b0 = await FakeBackend("b0", models=("model-b", "model-b-lora")).start()
        b1 = await FakeBackend("b1", models=("model-b", "model-b-lora")).start()
        a0 = await FakeBackend("a0", models=("model-a",)).start()
        for x in (a0, b0, b1):
            x.reject_unknown_models = True
        d = await start_daemon([a0, b0, b1], models=[], policy={"name": "round_robin"}, model_refresh_s=3600.0)
        base = f"http://127.0.0.1:{d.http_port}"
        try:
            async with aiohttp.ClientSession() as s:
                assert [await _post(s, base, "model-b-lora") for _ in range(2)] == [(200, "b0"), (200, "b1")]
                b0.models = ["model-b"]
                assert await _post(s, base, "model-b-lora") == (200, "b1")
                assert b0.misrouted == 1  # it did reach b0, whose 404 the client never saw
                await poll_until(lambda: d.router.by_name["b0"].discovered_models,
                                 lambda m: m == frozenset({"model-b"}), 30.0, "b0's list read again")
                assert [await _post(s, base, "model-b-lora") for _ in range(3)] == [(200, "b1")] * 3
                assert b0.misrouted == 1
            assert sample(d, "phasewise_requests_total", code="404") == 0
        finally:
            await _stop_all(d, (a0, b0, b1))

    asyncio.run(main())


def test_a_request_for_an_unknown_model_reads_the_lists_again_before_its_404(monkeypatch):
    """lora-new is loaded on b1 after the lists were read: the first request for it triggers a
    re-read of every list and is served; a name no list has is 404, and a burst of them causes
    one re-read, not one per request."""
    import routerd.daemon.app as app_mod

    # The 1 s bound on the wait is for production; a loaded test machine must not turn it into a 404.
    monkeypatch.setattr(app_mod, "UNKNOWN_MODEL_WAIT_S", 60.0)

    async def main():
        a0 = await FakeBackend("a0", models=("model-a",)).start()
        b1 = await FakeBackend("b1", models=("model-b",)).start()
        d = await start_daemon([a0, b1], models=[], model_refresh_s=3600.0)
        base = f"http://127.0.0.1:{d.http_port}"
        try:
            async with aiohttp.ClientSession() as s:
                b1.models = ["model-b", "lora-new"]
                assert await _post(s, base, "lora-new") == (200, "b1")
                assert (a0.models_reads, b1.models_reads) == (2, 2)
                d._unknown_refresh_at = float("-inf")  # the rate limit's window over, without waiting 2 s
                got = await asyncio.gather(*(_post(s, base, "nope") for _ in range(5)))
                assert got == [(404, None)] * 5
                assert (a0.models_reads, b1.models_reads) == (3, 3)
        finally:
            await _stop_all(d, (a0, b1))

    asyncio.run(main())


# -- per-model state goes with the model -------------------------------------------------------------

def test_a_models_policy_is_dropped_when_no_endpoint_serves_it_any_more():
    """Adapters under ever new names, each used once and unloaded: no policy outlives its model;
    one still served keeps its policy (and its round-robin position)."""
    from routerd.daemon.discovery import DiscoveredEndpoint

    async def main():
        router, _ = _router("round_robin", [])
        router.set_endpoints([DiscoveredEndpoint(f"e{i}", f"http://10.0.0.{i}:8000") for i in range(2)])
        for k in range(50):
            ad = f"tenant-{k}-lora"
            router.set_discovered_models("e0", ["base", ad])
            router.set_discovered_models("e1", ["base", "other"])  # two models stay: several throughout
            r = router.new_request(10, 0, model=ad)
            assert router.try_dispatch_now(r).name == "e0"
            router.finish(r)
            r = router.new_request(10, 0, model="base")
            assert router.try_dispatch_now(r).name == ["e0", "e1"][k % 2]  # base's own position survives
            router.finish(r)
            assert set(router._model_policies) == {"base", ad}
            router.set_discovered_models("e0", ["base"])  # unloaded
            assert set(router._model_policies) == {"base"}
        assert set(router._rr) <= {"base"} and set(router._fallbacks_seen) <= {"base"}
        router.close()

    asyncio.run(main())


# -- a client's long model name is cut in error messages ---------------------------------------------

def test_shown_name_cuts_long_names():
    from routerd.daemon.router import SHOWN_NAME_CHARS, shown_name

    assert shown_name("model-a") == "'model-a'"
    assert shown_name("m" * SHOWN_NAME_CHARS) == "'" + "m" * SHOWN_NAME_CHARS + "'"
    assert shown_name("m" * (SHOWN_NAME_CHARS + 1)) == "'" + "m" * SHOWN_NAME_CHARS + "…'"


def test_an_unknown_100_kb_model_name_is_not_found_with_a_short_message():
    """HTTP 404 and gRPC NOT_FOUND (not RESOURCE_EXHAUSTED: a status message over the metadata
    limit) for a 100,000-character unknown name, each message quoting at most 200 characters."""
    import grpc

    from routerd.api.v1 import router_pb2, router_pb2_grpc

    async def main():
        a = await FakeBackend("a0", models=("model-a",)).start()
        b = await FakeBackend("b0", models=("model-b",)).start()
        d = await start_daemon([a, b], models=[])
        base = f"http://127.0.0.1:{d.http_port}"
        name = "x" * 100_000
        want = "'" + "x" * 200 + "…'"
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(base + "/v1/completions", json={"model": name, "prompt": "p"}) as r:
                    doc = await r.json()
                assert (r.status, doc["error"]["message"]) == (404, f"the model {want} does not exist; see GET "
                                                                    "/v1/models")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{d.grpc_port}") as ch:
                stub = router_pb2_grpc.RouterServiceStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Route(router_pb2.RouteRequest(request_id="r", model=name, prompt_tokens=3))
                assert (e.value.code(), e.value.details()) == (grpc.StatusCode.NOT_FOUND, f"model {want} is not served")
        finally:
            await _stop_all(d, (a, b))

    asyncio.run(main())


# -- /v1/models keeps the engines' cards (issue 31) ---------------------------------------------


def _card(mid: str, max_len, parent=None, root=None) -> dict:
    """A model card as vLLM 0.32 lists it (``vllm/entrypoints/openai/models/serving.py``)."""
    return {"id": mid, "object": "model", "created": 1796000000, "owned_by": "vllm", "root": root or f"/models/{mid}",
            "parent": parent, "max_model_len": max_len,
            "permission": [{"id": f"modelperm-{mid}", "object": "model_permission", "allow_sampling": True}]}


class CardBackend(FakeBackend):
    """A :class:`FakeBackend` whose ``/v1/models`` lists vLLM's full cards (``cards``)."""

    def __init__(self, name: str, cards: list[dict]) -> None:
        super().__init__(name, models=[c["id"] for c in cards])
        self.cards = cards

    async def _models(self, request):
        from aiohttp import web

        self.models_reads += 1
        return web.json_response({"object": "list", "data": self.cards})


def test_merge_cards_first_card_wins_and_max_model_len_is_the_smallest():
    from routerd.daemon.models import merge_cards

    a = {"m": _card("m", 4096, root="/a/m"), "l1": _card("l1", None, parent="m")}
    b = {"m": _card("m", 2048, root="/b/m"), "l1": _card("l1", None, parent="m"), "x": _card("x", 1024)}
    got = merge_cards(["m", "l1", "x", "configured"], [a, b], created=7)
    assert got[0] == {**a["m"], "max_model_len": 2048}  # a's card (root /a/m), b's smaller length
    assert got[1] == a["l1"] and got[1]["max_model_len"] is None  # an adapter's null stays null
    assert got[2] == b["x"]
    assert got[3] == {"id": "configured", "object": "model", "created": 7, "owned_by": "phasewise"}
    assert a["m"]["max_model_len"] == 4096  # the lists are not changed
    assert merge_cards([], [a], 7) == []


def test_parse_model_cards_keeps_every_field():
    from routerd.daemon.models import parse_model_cards

    cards = [_card("m", 2048), _card("l1", None, parent="m")]
    assert parse_model_cards(json.dumps({"object": "list", "data": cards}).encode()) == cards


def test_v1_models_through_routerd_keeps_the_engines_cards_merged():
    """Two endpoints list the base model with other max_model_len and one adapter each; routerd's
    /v1/models has each card as listed (ready endpoint first), the smallest max_model_len, and
    the official client reads it."""
    import openai

    async def main():
        a = await CardBackend("a0", [_card("m", 4096, root="/a/m"),
                                     _card("l1", None, parent="m", root="/a/l1")]).start()
        b = await CardBackend("b0", [_card("m", 2048, root="/b/m"),
                                     _card("l2", None, parent="m", root="/b/l2")]).start()
        d = await start_daemon([a, b], models=[])
        base = f"http://127.0.0.1:{d.http_port}"
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(base + "/v1/models") as r:
                    doc = await r.json()
            by_id = {c["id"]: c for c in doc["data"]}
            assert doc["object"] == "list" and sorted(by_id) == ["l1", "l2", "m"]
            assert by_id["m"] == {**a.cards[0], "max_model_len": 2048}
            assert by_id["l1"] == a.cards[1] and by_id["l2"] == b.cards[1]
            # a0 no longer ready (by its source): b0, ready, lists first, so its card is the one shown.
            d.router.set_endpoints([DiscoveredEndpoint("a0", a.url, ready=False), DiscoveredEndpoint("b0", b.url)],
                                   lists_read=True)
            client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
            listed = {m.id: m for m in (await client.models.list()).data}
            await client.close()
            assert listed["m"].model_extra["root"] == "/b/m" and listed["m"].model_extra["max_model_len"] == 2048
            assert listed["l1"].model_extra["parent"] == "m" and listed["m"].owned_by == "vllm"
        finally:
            await _stop_all(d, (a, b))

    asyncio.run(main())


def test_v1_models_with_configured_models_reads_the_cards_from_the_ready_endpoints():
    """Lists routerd does not read (``endpoints[].models`` configured): a configured model's card is
    asked of the ready endpoints when /v1/models is served (smallest max_model_len); a configured
    model no endpoint lists gets routerd's own card; a model an endpoint lists but ``models`` does
    not name is not shown."""
    async def main():
        a = await CardBackend("a0", [_card("m", 4096), _card("hidden", 100)]).start()
        b = await CardBackend("b0", [_card("m", 1024)]).start()
        d = await start_daemon([], models=["m", "n"], endpoints=[{"name": "a0", "url": a.url, "models": ["m", "n"]},
                                                                 {"name": "b0", "url": b.url, "models": ["m"]}])
        base = f"http://127.0.0.1:{d.http_port}"
        try:
            assert a.models_reads == b.models_reads == 0  # configured: no list is read
            async with aiohttp.ClientSession() as s:
                async with s.get(base + "/v1/models") as r:
                    doc = await r.json()
            assert doc["data"] == [{**a.cards[0], "max_model_len": 1024},
                                   {"id": "n", "object": "model", "created": int(d.started_at_unix),
                                    "owned_by": "phasewise"}]
        finally:
            await _stop_all(d, (a, b))

    asyncio.run(main())
