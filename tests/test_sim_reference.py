"""The event-skipping instance simulator agrees with the naive per-iteration one."""

from __future__ import annotations

import pytest
from conftest import toy_profile
from hypothesis import given, settings
from hypothesis import strategies as st
from sim_reference import reference_run

from routerd.model import Request
from routerd.policies.base import PolicyContext, RoutingPolicy
from routerd.sim import ClusterSimulator, prepare_requests


class _First(RoutingPolicy):
    name = "first"

    def pick(self, request, view):
        return 0


@st.composite
def cases(draw):
    bs = draw(st.sampled_from([2, 4, 16]))
    blocks = draw(st.integers(4, 40))
    cap = bs * blocks
    max_len = draw(st.integers(2, min(cap, 80)))
    chunked = draw(st.booleans())
    seqs = draw(st.integers(1, 8))
    budget = draw(st.integers(max(seqs, 1 if chunked else max_len), 96))
    prof = toy_profile(
        block_size=bs, kv_capacity_tokens=cap, max_model_len=max_len, chunked_prefill=chunked,
        max_num_seqs=seqs, max_num_batched_tokens=budget,
        prefill_attn_s=draw(st.sampled_from([0.0, 1e-5])),
    )
    n = draw(st.integers(1, 25))
    reqs = []
    t = 0.0
    for i in range(n):
        t += draw(st.floats(0.0, 0.2))
        prompt = draw(st.integers(1, max_len - 1))
        out = draw(st.integers(1, max_len - prompt))
        # The offset keeps arrivals off iteration boundaries (sums of multiples of 1e-5 s
        # here): at an exact tie, the closed-form and the summed boundary times may differ
        # in the last bit and put the arrival on different sides of it.
        reqs.append((round(t, 6) + 3.7e-9 * (i + 1), prompt, out))
    gate = draw(st.sampled_from(["full", "chunk"]))
    return prof, reqs, gate


@settings(max_examples=300, deadline=None)
@given(cases())
def test_matches_naive_reference(case):
    prof, reqs, gate = case
    ref, ref_preemptions, ref_free = reference_run(prof, reqs, gate)
    prep = prepare_requests(
        [Request(id=i, arrival_s=a, prompt_tokens=p, output_tokens=o) for i, (a, p, o) in enumerate(reqs)],
        prof,
    )
    sim = ClusterSimulator(prof, 1, _First(PolicyContext(prof, 1)), admission_gate=gate)
    run = sim.run(prep.requests)
    for r, q in zip(run.requests, ref):
        assert r.first_token_s == pytest.approx(q.first, rel=1e-9, abs=1e-12)
        assert r.finish_s == pytest.approx(q.finish, rel=1e-9, abs=1e-12)
        assert r.preemptions == q.preemptions
    inst = run.instances[0]
    assert inst.preemptions == ref_preemptions
    assert inst.free_blocks == ref_free == inst.total_blocks
