"""routerd's decision core without HTTP: bookkeeping, sidecar merge, hold/redecide, fail-open, limits."""

from __future__ import annotations

import asyncio
import time

import pytest
from pydantic import ValidationError
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import policy_params, toy_profile
from stack_processes import poll_until
from routerd.api.v1.instance_state_pb2 import InstanceState
from routerd.daemon.config import PolicyConfig, RouterConfig
from routerd.daemon.discovery import DiscoveredEndpoint
from routerd.daemon.metrics import Metrics
from routerd.daemon.router import NoEndpointError, QueueFullError, Router, build_routing_policy
from routerd.daemon.state import EndpointState, Inflight
from routerd.errors import ConfigError
from routerd.policies.base import summarize_residents


class HoldAll:
    """A policy that always holds (the router must override it where the cluster would idle)."""

    def pick(self, request, view):
        return None

    def on_complete(self, *a):
        pass


def make_router(policy="round_robin", params=None, n=2, clock=None, profile=None, **cfg):
    profile = profile or toy_profile()
    pol = build_routing_policy(PolicyConfig(name=policy, params=params or {}), profile, n)
    r = Router(profile=profile, policy=pol, policy_name=policy, metrics=Metrics(),
               config=RouterConfig(**cfg), state_max_age_s=2.0, clock=clock or time.monotonic)
    r.set_endpoints([DiscoveredEndpoint(f"e{i}", f"http://127.0.0.1:{9000 + i}") for i in range(n)])
    return r


def value(router, name, **labels):
    v = router.metrics.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


# -- bookkeeping -------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "first", "tokens", "remove"]), st.integers(0, 7),
                          st.integers(0, 3), st.integers(1, 300)), max_size=80))
def test_incremental_load_summary_equals_a_full_recount(ops):
    ep = EndpointState(0, "e", "http://h:1", None, True, toy_profile())
    reqs: dict[int, Inflight] = {}
    for op, k, bucket, n in ops:
        if op == "add" and k not in reqs:
            reqs[k] = r = Inflight(k, k, n, bucket, [125.0, 625.0, 2500.0, 6000.0][bucket], 0.0)
            ep.add(r, 0.0)
        elif k in reqs and op == "first":
            ep.on_first_token(reqs[k])
        elif k in reqs and op == "tokens":
            ep.on_tokens(reqs[k], n)
        elif k in reqs and op == "remove":
            assert ep.remove(reqs.pop(k))
        ep.refresh(0.0, 2.0)
        assert ep.load_summary() == summarize_residents(ep.residents())
        assert ep.in_flight == len(reqs) == ep.num_running + ep.num_waiting


def test_own_bookkeeping_counts_running_waiting_and_kv_blocks_by_hand():
    prof = toy_profile()  # 16-token blocks, 64 blocks, max_num_seqs 8
    ep = EndpointState(0, "e", "http://h:1", None, True, prof)
    reqs = [Inflight(i, i, 20, 0, 125.0, 0.0) for i in range(10)]
    for r in reqs:
        ep.add(r, 0.0)
    ep.on_first_token(reqs[0])
    ep.on_tokens(reqs[0], 13)
    assert ep.refresh(0.0, 2.0) is False  # no sidecar: never stale
    # 10 requests: 8 run (max_num_seqs), 2 wait; KV = ceil((10*20 + 13) / 16) = 14 blocks.
    assert (ep.num_running, ep.num_waiting, ep.kv_used_blocks) == (8, 2, 14)
    s = ep.load_summary()
    assert s.in_prefill == 9 and s.decode_bins == (1, 0, 0) and s.min_predicted_remaining == 125.0 - 13
    assert [r.waiting for r in ep.residents()] == [False] * 8 + [True] * 2


def test_a_fresh_sidecar_snapshot_is_merged_with_requests_dispatched_since():
    ep = EndpointState(0, "e", "http://h:1", "h:2", True, toy_profile())
    assert ep.refresh(0.0, 2.0) is True  # a sidecar but no snapshot yet: stale
    ep.add(Inflight(1, 1, 10, None, 125.0, 0.0), 0.0)
    ep.set_snapshot(InstanceState(healthy=True, num_requests_running=5, num_requests_waiting=1,
                                  kv_cache_usage=0.25), now=10.0)
    for i in (2, 3):  # two more dispatched after the snapshot
        ep.add(Inflight(i, i, 10, None, 125.0, 0.0), 10.5)
    assert ep.refresh(11.0, 2.0) is False
    assert (ep.num_running, ep.num_waiting, ep.kv_used_blocks) == (5, 3, 16)  # 0.25 * 64 blocks
    # Older than the age limit: routerd's own bookkeeping only (3 requests, 30 prompt tokens -> 2 blocks).
    assert ep.refresh(12.5, 2.0) is True
    assert (ep.num_running, ep.num_waiting, ep.kv_used_blocks) == (3, 0, 2)
    # An unhealthy scrape is stale at once.
    ep.set_snapshot(InstanceState(healthy=False, num_requests_running=1), now=13.0)
    assert ep.refresh(13.0, 2.0) is True


# -- decisions ---------------------------------------------------------------------------


def test_round_robin_books_each_request_and_finish_releases_it():
    async def main():
        r = make_router()
        eps = []
        for _ in range(3):
            req = r.new_request(10, None)
            eps.append((await r.dispatch(req)).name)
            assert req.endpoint is not None
        assert eps == ["e0", "e1", "e0"]
        assert r.in_flight == 3 and value(r, "phasewise_in_flight_requests", endpoint="e0") == 2
        for ep in r.endpoints:
            for req in list(ep.requests.values()):
                assert r.finish(req) and not r.finish(req)  # a second release is a no-op
        assert r.in_flight == 0 and value(r, "phasewise_in_flight_requests", endpoint="e0") == 0
        assert [d[2] for d in r.decisions] == eps
    asyncio.run(main())


def test_late_binding_holds_until_a_completion_frees_kv_then_redecides():
    async def main():
        # One instance with 64 blocks of 16 tokens; late_binding keeps 5% in reserve (60 usable).
        prof = toy_profile(max_model_len=1024, max_num_batched_tokens=1024)
        r = make_router("late_binding", n=1, profile=prof, action_interval_s=0.01, hold_idle_limit_s=60)
        big = r.new_request(700, 0)  # 700 + 125 predicted -> 52 blocks
        await r.dispatch(big)
        second = r.new_request(300, 0)  # 300 + 125 -> 27 blocks: does not fit beside the first
        task = asyncio.create_task(r.dispatch(second))
        # Decided again on each action interval.
        await poll_until(lambda: value(r, "phasewise_holds_total"), lambda n: n >= 2, 10.0,
                         "two hold decisions (phasewise_holds_total >= 2)")
        assert not task.done() and len(r.queue) == 1
        released = r.clock()
        r.finish(big)  # the completion frees the KV: decided at once
        ep = await asyncio.wait_for(task, 10.0)
        assert ep.name == "e0" and len(r.queue) == 0
        assert r.decisions[-1][5] >= released - second.enqueued_at > 0  # router wait recorded: the whole hold
        r.finish(second)
        r.close()
    asyncio.run(main())


def test_holding_an_idle_cluster_is_overridden_after_the_limit():
    async def main():
        r = make_router(action_interval_s=0.01, hold_idle_limit_s=0.05)
        r.set_policy(HoldAll(), "hold_all")
        req = r.new_request(5, None)
        ep = await asyncio.wait_for(r.dispatch(req), 10.0)
        assert ep.name in ("e0", "e1")
        assert value(r, "phasewise_fallbacks_total", reason="hold_idle") == 1
        assert r.decisions[-1][7] is True and r.decisions[-1][5] >= 0.05
        r.finish(req)
        r.close()
    asyncio.run(main())


def test_every_sidecar_stale_routes_round_robin_and_counts_it():
    async def main():
        class Never:
            def pick(self, request, view):
                raise AssertionError("the policy must not be asked on stale state")

            def on_complete(self, *a):
                pass

        r = make_router()
        r.set_endpoints([DiscoveredEndpoint(f"e{i}", f"http://h:{i + 1}", state_address=f"h:{i + 100}")
                         for i in range(2)])
        r.set_policy(Never(), "never")
        got = [(await r.dispatch(r.new_request(5, None))).name for _ in range(4)]
        assert sorted(got) == ["e0", "e0", "e1", "e1"]
        assert value(r, "phasewise_fallbacks_total", reason="stale_state") == 4
    asyncio.run(main())


def test_an_invalid_choice_fails_open():
    async def main():
        class Wrong:
            def pick(self, request, view):
                return 7

            def on_complete(self, *a):
                pass

        r = make_router()
        r.set_policy(Wrong(), "wrong")
        assert (await r.dispatch(r.new_request(5, None))).name in ("e0", "e1")
        assert value(r, "phasewise_fallbacks_total", reason="invalid_choice") == 1
    asyncio.run(main())


def test_candidates_follow_cooldowns_readiness_and_exclusions_at_each_decision():
    """The candidate list is reused between decisions: each change must still show at the next one."""
    shown: list[list[str]] = []

    class Record:
        def pick(self, request, view):
            shown.append([ep.name for ep in view.instances])
            return view.instances[0].index

        def on_complete(self, *a):
            pass

    t = [100.0]
    r = make_router(n=3, clock=lambda: t[0])
    r.set_policy(Record(), "record")
    e0, e1, e2 = r.endpoints

    def decide(exclude=frozenset()) -> list[str]:
        req = r.new_request(5, None)
        if exclude:  # a retry avoiding the endpoints that failed it
            asyncio.run(r.dispatch(req, exclude))
        else:
            assert r.try_dispatch_now(req) is not None
        r.finish(req)
        return shown[-1]

    assert decide() == ["e0", "e1", "e2"]
    r.note_connect_failure(e1)  # first failure: out for failure_cooldown_s = 1 s
    assert decide() == ["e0", "e2"]
    t[0] += 0.999
    assert decide() == ["e0", "e2"]
    t[0] += 0.002
    assert decide() == ["e0", "e1", "e2"]
    r.note_connect_failure(e1)  # second failure in a row: 2 s
    r.note_connect_failure(e2)  # 1 s
    assert decide() == ["e0"]
    assert decide(frozenset({"e0"})) == ["e1", "e2"]  # every other one cools down: tried anyway
    assert decide() == ["e0"]
    t[0] += 1.5  # e2's cooldown is over, e1's is not
    assert decide() == ["e0", "e2"]
    r.note_success(e1)
    assert decide() == ["e0", "e1", "e2"]
    r.set_endpoints([DiscoveredEndpoint("e0", "http://127.0.0.1:9000", ready=False),
                     DiscoveredEndpoint("e1", "http://127.0.0.1:9001"),
                     DiscoveredEndpoint("e2", "http://127.0.0.1:9002")])
    assert decide() == ["e1", "e2"]
    r.note_connect_failure(e2)  # its second failure in a row: out for 2 s
    t[0] += 3.0
    assert decide() == ["e1", "e2"]
    t[0] -= 2.5  # a clock that went back into the cooldown must not reuse the list built after it
    assert decide() == ["e1"]


def test_queue_limit_and_no_endpoint_are_refused_before_queueing():
    async def main():
        r = make_router(queue_limit=1, hold_idle_limit_s=60)
        r.set_policy(HoldAll(), "hold_all")
        first = asyncio.create_task(r.dispatch(r.new_request(5, None)))
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError) as e:
            await r.dispatch(r.new_request(5, None))
        assert e.value.status == 429
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert len(r.queue) == 0 and value(r, "phasewise_router_queue_depth") == 0
        r.set_endpoints([])
        with pytest.raises(NoEndpointError) as e:
            await r.dispatch(r.new_request(5, None))
        assert e.value.status == 503
        r.close()
    asyncio.run(main())


def test_dqn_is_built_for_its_checkpoint_and_rejects_a_bad_one(tmp_path):
    params = policy_params("dqn", 4)
    pol = build_routing_policy(PolicyConfig(name="dqn", params=params), toy_profile(), num_endpoints=2)
    assert pol.ctx.num_instances == 4  # routes round robin itself while the cluster has 2
    with pytest.raises(ConfigError, match="policy: dqn"):
        build_routing_policy(PolicyConfig(name="dqn", params={"checkpoint": str(tmp_path)}), toy_profile(), 2)
    # Unknown names and bad parameters are refused by the settings model itself (naming the
    # field and where it came from, test_daemon_config_safety.py); built without it, the
    # registry still refuses them.
    with pytest.raises(ValidationError, match="unknown policy 'nope'"):
        PolicyConfig(name="nope")
    with pytest.raises(ConfigError, match="unknown policy"):
        build_routing_policy(PolicyConfig.model_construct(name="nope", params={}), toy_profile(), 2)
    with pytest.raises(ConfigError, match="reserve_fraction"):
        build_routing_policy(PolicyConfig.model_construct(name="late_binding", params={"reserve_fraction": "2"}),
                             toy_profile(), 2)


def test_numpy_choices_are_accepted_and_dqn_on_another_cluster_size_is_counted(caplog):
    async def main():
        import numpy as np

        class NumpyPick:
            def pick(self, request, view):
                return np.int64(view.instances[-1].index)

            def on_complete(self, *a):
                pass

        r = make_router()
        r.set_policy(NumpyPick(), "numpy")
        assert (await r.dispatch(r.new_request(5, None))).name == "e1"
        assert value(r, "phasewise_fallbacks_total", reason="invalid_choice") == 0
        # A dqn checkpoint for 4 instances on a 2-instance cluster routes round robin itself.
        r2 = make_router("dqn", params=policy_params("dqn", 4))
        with caplog.at_level("WARNING", logger="routerd"):
            got = [(await r2.dispatch(r2.new_request(5, None))).name for _ in range(4)]
        assert got == ["e0", "e1", "e0", "e1"]
        assert value(r2, "phasewise_fallbacks_total", reason="policy_fallback") == 4
        # Said once per cluster size, naming both sizes.
        said = [m.getMessage() for m in caplog.records if "built for" in m.getMessage()]
        assert said == ["policy dqn was built for 4 instances and 2 are ready; routing round robin while the "
                        "sizes differ (counted in phasewise_fallbacks_total{reason=\"policy_fallback\"})"]
    asyncio.run(main())


def test_endpoints_of_mixed_gpus_get_their_own_profiles_and_predicted_latency_prefers_the_fast_one():
    # routerd's profile is the A100's; e1 declares the H100's (endpoints[].profile). Its view
    # reports the H100's KV blocks, every live policy sees both profiles by index, and
    # predicted_latency (which forecasts with each instance's own profile) sends a request to
    # the idle H100 rather than the idle A100. Moving e1 back to routerd's profile updates both.
    from routerd.profiles import get_profile

    a100, h100 = get_profile("llama3.1-8b-a100"), get_profile("llama3.1-8b-h100")
    assert h100.num_blocks != a100.num_blocks
    pol = build_routing_policy(PolicyConfig(name="predicted_latency"), a100, 2)
    r = Router(profile=a100, policy=pol, policy_name="predicted_latency", metrics=Metrics(),
               config=RouterConfig(), state_max_age_s=2.0)
    r.set_endpoints([DiscoveredEndpoint("e0", "http://127.0.0.1:9000"),
                     DiscoveredEndpoint("e1", "http://127.0.0.1:9001", profile="llama3.1-8b-h100")])
    e0, e1 = r.by_name["e0"], r.by_name["e1"]
    assert (e0.profile, e1.profile) == (a100, h100)
    assert (e0.kv_total_blocks, e1.kv_total_blocks) == (a100.num_blocks, h100.num_blocks)
    assert pol.ctx.profiles == (a100, h100)

    async def main():
        req = r.new_request(2000, 2)
        return (await r.dispatch(req)).name
    assert asyncio.run(main()) == "e1"

    r.set_endpoints([DiscoveredEndpoint("e0", "http://127.0.0.1:9000"), DiscoveredEndpoint("e1", "http://127.0.0.1:9001")])
    assert e1.profile is a100 and e1.kv_total_blocks == a100.num_blocks and pol.ctx.profiles == (a100, a100)


def test_an_endpoint_profile_that_cannot_be_loaded_falls_back_to_routerds_named_and_counted_once(tmp_path, caplog):
    # A profile file that went away (a ConfigMap key removed under a running routerd): the endpoint
    # keeps routing on routerd's own profile; said and counted once per endpoint, not per update.
    from routerd.profiles import get_profile

    a100 = get_profile("llama3.1-8b-a100")
    pol = build_routing_policy(PolicyConfig(name="round_robin"), a100, 2)
    m = Metrics()
    r = Router(profile=a100, policy=pol, policy_name="round_robin", metrics=m, config=RouterConfig(),
               state_max_age_s=2.0)
    gone = str(tmp_path / "profile-b.yaml")
    eps = [DiscoveredEndpoint("e0", "http://127.0.0.1:9000", profile=gone),
           DiscoveredEndpoint("e1", "http://127.0.0.1:9001", profile=gone)]
    with caplog.at_level("WARNING", logger="routerd"):
        r.set_endpoints(eps)
        r.set_endpoints(list(eps))
        r.set_endpoints([*eps, DiscoveredEndpoint("e2", "http://127.0.0.1:9002")])
    assert r.by_name["e0"].profile is a100 and r.by_name["e1"].profile is a100
    assert m.profile_fallbacks._value.get() == 2  # e0 and e1, once each
    said = [rec.getMessage() for rec in caplog.records if "cannot be loaded" in rec.getMessage()]
    assert len(said) == 2 and all(gone in s and "using llama3.1-8b-a100" in s for s in said)


def test_endpoint_profile_files_are_parsed_once_per_content(tmp_path, monkeypatch):
    # Every EndpointSlice update asks each endpoint's profile: a file is read again only when its
    # stat changes, and a rewrite with the same content keeps the same profile object.
    import routerd.profiles as profiles
    from routerd.profiles import get_profile

    a100 = get_profile("llama3.1-8b-a100")
    f = tmp_path / "profile-h100.yaml"
    f.write_text((profiles._profiles_dir() / "llama3.1-8b-h100.yaml").read_text())
    reads = []
    real = profiles.load_profile_file
    monkeypatch.setattr(profiles, "load_profile_file", lambda p: reads.append(p) or real(p))
    pol = build_routing_policy(PolicyConfig(name="round_robin"), a100, 2)
    r = Router(profile=a100, policy=pol, policy_name="round_robin", metrics=Metrics(), config=RouterConfig(),
               state_max_age_s=2.0)
    eps = [DiscoveredEndpoint(f"e{i}", f"http://127.0.0.1:{9000 + i}", profile=str(f)) for i in range(8)]
    for ready in (True, False, True):
        r.set_endpoints([DiscoveredEndpoint(e.name, e.url, ready=ready, profile=e.profile) for e in eps])
    assert len(reads) == 1
    first = r.by_name["e0"].profile
    assert first.num_blocks == get_profile("llama3.1-8b-h100").num_blocks
    import os
    os.utime(f, ns=(1, 1))  # touched, same content: read again, the same object kept
    r.set_endpoints(eps)
    assert len(reads) == 2 and r.by_name["e3"].profile is first
    f.write_text(f.read_text().replace("max_num_seqs: 1024", "max_num_seqs: 128"))
    r.set_endpoints(eps)
    assert len(reads) == 3 and r.by_name["e3"].profile.max_num_seqs == 128
