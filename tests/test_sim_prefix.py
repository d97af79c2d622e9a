"""Prefix caching in the simulator: fidelity against the independent infinite-cache count,
hand-computed hits, invariants under random load, and no change for traces without prefixes."""

from __future__ import annotations

import random

import pytest

from prefix_reference import infinite_cache_reuse
from routerd.model import Request
from routerd.policies.base import PolicyContext
from routerd.policies.registry import build_policy_from_spec
from routerd.profiles import HardwareProfile, get_profile
from routerd.sim import ClusterSimulator, prepare_requests
from routerd.sim.report import summarize


def _profile(**kw) -> HardwareProfile:
    d = get_profile("llama2-7b-a100").model_dump()
    d.update(kw)
    return HardwareProfile.model_validate(d)


def _run(reqs, prof, m=1, policy="round_robin", seed=0):
    prep = prepare_requests(reqs, prof, seed=seed)
    run = ClusterSimulator(prof, m, build_policy_from_spec(policy, PolicyContext(prof, m, seed=seed))).run(prep.requests)
    return run


def test_mooncake_hits_equal_the_infinite_cache_reference(data_dir):
    from routerd.workloads.registry import load_workload

    reqs = load_workload("mooncake", data_dir=data_dir).requests
    # One instance, a cache larger than the trace, requests far apart (no overlap).
    spaced = [r.model_copy(update={"arrival_s": 1000.0 * i}) for i, r in enumerate(reqs)]
    prof = _profile(max_model_len=300_000, kv_capacity_tokens=10**8)
    run = _run(spaced, prof)
    ref = infinite_cache_reuse(spaced)
    sim_blocks = [r.cached_tokens // 16 for r in run.requests]
    assert sim_blocks == list(ref.hit_blocks)  # per request, exactly
    inst = run.instances[0]
    total_blocks = sum(r.prompt_tokens // 16 for r in spaced)
    assert abs(sum(sim_blocks) / total_blocks - 0.6515) < 0.005
    assert abs(inst.prefix_hits / inst.prefix_queries - 0.6512) < 0.005


def _sys_prompt_requests(gap: float):
    # A: system prompt (unit 1, 48 tokens) + question (unit 2, 16 tokens); B: the same system
    # prompt + another question (unit 3).
    a = Request(id=0, arrival_s=0.0, prompt_tokens=64, output_tokens=2, prefix=((1, 48), (2, 16)))
    b = Request(id=1, arrival_s=gap, prompt_tokens=64, output_tokens=2, prefix=((1, 48), (3, 16)))
    return [a, b]


def test_a_shared_system_prompt_skips_its_prefill_by_hand():
    # Only a per-token prefill cost (1 ms/token) and a 1 ms overhead: B reuses 3 blocks (48
    # tokens), so its prefill step computes 16 tokens: TTFT = 0.001 + 16 * 0.001 = 0.017 s;
    # without caching 0.001 + 64 * 0.001 = 0.065 s.
    kw = dict(overhead_s=0.001, prefill_per_token_s=0.001, prefill_attn_s=0.0, decode_per_seq_s=0.0,
              decode_per_ctx_token_s=0.0)
    reqs = _sys_prompt_requests(gap=10.0)
    on = _run(reqs, _profile(**kw)).requests
    off = _run(reqs, _profile(prefix_caching=False, **kw)).requests
    assert on[1].cached_tokens == 48 and on[0].cached_tokens == 0
    assert on[1].first_token_s - on[1].arrival_s == pytest.approx(0.017)
    assert off[1].first_token_s - off[1].arrival_s == pytest.approx(0.065)


def test_the_last_prompt_token_is_always_computed():
    r = Request(id=0, arrival_s=0.0, prompt_tokens=64, output_tokens=1, prefix=((7, 64),))
    same = [r, r.model_copy(update={"id": 1, "arrival_s": 5.0})]
    run = _run(same, _profile())
    assert run.requests[1].cached_tokens == 48  # (64 - 1) // 16 = 3 blocks
    inst = run.instances[0]
    assert (inst.prefix_hits, inst.prefix_queries) == (48, 128)


def test_multi_turn_reuses_the_previous_answer():
    # Turn 2 resends turn 1's answer (unit 9, 40 tokens): its blocks were cached as they filled.
    t1 = Request(id=0, arrival_s=0.0, prompt_tokens=40, output_tokens=40, prefix=((1, 40),), response_id=9)
    t2 = Request(id=1, arrival_s=60.0, prompt_tokens=100, output_tokens=4, prefix=((1, 40), (9, 40), (2, 20)))
    run = _run([t1, t2], _profile())
    # Turn 1 held 40 + 40 - 1 = 79 tokens of KV: 4 full blocks (64 tokens) are cached.
    assert run.requests[1].cached_tokens == 64


def test_no_prefix_identity_changes_nothing():
    rng = random.Random(1)
    reqs = [Request(id=i, arrival_s=i * 0.05, prompt_tokens=rng.randint(1, 3000), output_tokens=rng.randint(1, 800))
            for i in range(300)]
    for policy in ("round_robin", "late_binding", "phasewise"):
        on = _run(reqs, _profile(kv_capacity_tokens=16 * 2000), m=2, policy=policy)
        off = _run(reqs, _profile(kv_capacity_tokens=16 * 2000, prefix_caching=False), m=2, policy=policy)
        assert [(r.first_token_s, r.finish_s, r.preemptions) for r in on.requests] == \
            [(r.first_token_s, r.finish_s, r.preemptions) for r in off.requests]
        assert summarize(on).preemptions > 0 or policy != "round_robin"


@pytest.mark.parametrize("seed", range(8))
def test_invariants_under_random_shared_load(seed):
    # A small cache (evictions, preemptions), prompts drawn from a few shared prefixes.
    rng = random.Random(seed)
    prof = _profile(kv_capacity_tokens=16 * rng.randint(300, 900), max_model_len=4096, max_num_batched_tokens=512)
    reqs = []
    t = 0.0
    for i in range(200):
        t += rng.uniform(0.0, 0.05)
        units = [(rng.randint(0, 3), rng.choice((100, 512)))]
        units += [(rng.randint(4, 8), rng.randint(1, 700)) for _ in range(rng.randint(0, 2))]
        units.append((1000 + i, rng.randint(1, 300)))
        prompt = sum(n for _, n in units)
        reqs.append(Request(id=i, arrival_s=t, prompt_tokens=prompt,
                            output_tokens=rng.randint(1, 400), prefix=tuple(units),
                            response_id=rng.choice((None, 2000 + i))))
    policy = rng.choice(("round_robin", "phasewise", "llmd", "late_binding"))
    run = _run(reqs, prof, m=2, policy=policy, seed=seed)
    assert all(r.finish_s > 0 for r in run.requests)
    for r in run.requests:
        assert 0 <= r.cached_tokens <= r.prompt - 1 and r.cached_tokens % 16 == 0
    for inst in run.instances:
        assert inst.free_blocks == inst.total_blocks  # every block back in the free pool
        inst.pc.check(inst.free_blocks)  # runs partition the free cached blocks; no holders left
        assert not inst.pc.holders
        assert inst.pending == {}  # every dispatched prompt's pending blocks ended with its prefill
        assert 0 <= inst.prefix_hits <= inst.prefix_queries


def test_a_dispatched_prompt_counts_as_cached_before_its_blocks_are_computed():
    # A precise view sees what routerd sees: the engine's cached blocks plus those of prompts
    # dispatched there whose KV events have not come (routerd.daemon.state note_pending). Two
    # requests with the same 96-token system prompt (6 blocks) arrive together; when the second
    # is decided the first is waiting on instance 0 with nothing computed yet.
    from routerd.prefix.chain import prefix_blocks
    from routerd.sim.cluster import SimInstanceView

    prof = _profile()
    seen = []

    class Spy:
        def __init__(self, ctx):
            self.ctx = ctx

        def pick(self, request, view):
            seen.append([view.instances[i].engine_cached_blocks(request.prefix) for i in range(2)])
            return 0

        def on_complete(self, *a):
            pass

    a = Request(id=0, arrival_s=0.0, prompt_tokens=112, output_tokens=3, prefix=((1, 96), (2, 16)))
    b = Request(id=1, arrival_s=0.0, prompt_tokens=112, output_tokens=3, prefix=((1, 96), (3, 16)))
    prep = prepare_requests([a, b], prof, seed=0)
    sim = ClusterSimulator(prof, 2, Spy(PolicyContext(prof, 2)))
    run = sim.run(prep.requests)
    # a: nothing anywhere; b: a's 6 system-prompt blocks on instance 0 (pending), none on 1.
    assert seen == [[0, 0], [6, 0]]
    inst = run.instances[0]
    assert inst.pending == {} and run.requests[1].cached_tokens in (0, 96)
    # After both ran nothing is pending: the 6 system-prompt blocks come from the cache itself.
    view = SimInstanceView(inst, run.requests[1].finish_s, False)
    assert view.engine_cached_blocks(prefix_blocks(((1, 96), (4, 16)), 16)) == 6
    assert SimInstanceView(run.instances[1], 0.0, False).engine_cached_blocks(prefix_blocks(((1, 96),), 16)) == 0
