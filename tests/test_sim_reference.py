"""The event-skipping instance simulator agrees with the naive per-iteration one.

Two families of cases:

- ``offset_cases``: decimal latency terms and arrivals kept off iteration boundaries by a
  small offset (the closed-form segment times and the reference's summed ones may differ
  in the last bit there, so an exact tie could fall on either side of the boundary);
- ``tie_cases``: dyadic latency terms and arrivals (multiples of powers of two, so every
  sum and the simulator's closed form ``j * t1 + slope * j * (j - 1) / 2`` are exact in
  floating point), with extra requests placed exactly on iteration boundaries of the
  reference run, mostly decode-only ones (interior boundaries of the simulator's
  fast-forwarded decode segments). Issue 13: an arrival at such a boundary joins the step
  that starts there, as at a single-step boundary; there the results must be equal, not
  only close.
"""

from __future__ import annotations

import pytest
from conftest import toy_profile
from hypothesis import event, given, settings
from hypothesis import strategies as st
from sim_reference import reference_run

from routerd.model import Request
from routerd.policies.base import PolicyContext, RoutingPolicy
from routerd.sim import ClusterSimulator, prepare_requests


class _First(RoutingPolicy):
    name = "first"

    def pick(self, request, view):
        return 0


def _draw_profile(draw, terms):
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    blocks = draw(st.integers(4, 40))
    cap = bs * blocks
    max_len = draw(st.integers(2, min(cap, 80)))
    chunked = draw(st.booleans())
    seqs = draw(st.integers(1, 8))
    budget = draw(st.integers(max(seqs, 1 if chunked else max_len), 96))
    return toy_profile(
        block_size=bs, kv_capacity_tokens=cap, max_model_len=max_len, chunked_prefill=chunked,
        max_num_seqs=seqs, max_num_batched_tokens=budget,
        **{name: draw(st.sampled_from(values)) for name, values in terms.items()},
    )


def _draw_request(draw, prof, arrival):
    prompt = draw(st.integers(1, prof.max_model_len - 1))
    out = draw(st.integers(1, prof.max_model_len - prompt))
    return (arrival, prompt, out)


@st.composite
def offset_cases(draw):
    prof = _draw_profile(draw, {"prefill_attn_s": [0.0, 1e-5]})
    n = draw(st.integers(1, 25))
    reqs = []
    t = 0.0
    for i in range(n):
        t += draw(st.floats(0.0, 0.2))
        # The offset keeps arrivals off iteration boundaries (sums of multiples of 1e-5 s
        # here): at an exact tie, the closed-form and the summed boundary times may differ
        # in the last bit and put the arrival on different sides of it.
        reqs.append(_draw_request(draw, prof, round(t, 6) + 3.7e-9 * (i + 1)))
    gate = draw(st.sampled_from(["full", "chunk"]))
    return prof, reqs, gate, False


# Powers of two (s) or small multiples of them: every iteration time, boundary and
# arrival below is exact in binary floating point.
_DYADIC_TERMS = {
    "overhead_s": [2.0**-6, 2.0**-7, 3 * 2.0**-8],
    "prefill_per_token_s": [0.0, 2.0**-10, 2.0**-9],
    "prefill_attn_s": [0.0, 2.0**-16],
    "decode_per_seq_s": [0.0, 2.0**-9],
    "decode_per_ctx_token_s": [0.0, 2.0**-12],
}


@st.composite
def tie_cases(draw):
    prof = _draw_profile(draw, _DYADIC_TERMS)
    gate = draw(st.sampled_from(["full", "chunk"]))
    n = draw(st.integers(1, 20))
    reqs = []
    t = 0.0
    for _ in range(n):
        # A grid as coarse as the overhead: with the context terms at 0, many of these
        # arrivals fall on boundaries by themselves.
        t += draw(st.integers(0, 24)) * 2.0**-6
        reqs.append(_draw_request(draw, prof, t))
    # Requests placed on boundaries of the reference run. One arriving at b changes
    # nothing before b, so b stays a boundary; later ones go at or after it, so every
    # placed request ties.
    last = 0.0
    for _ in range(draw(st.integers(1, 3))):
        bounds: list[tuple[float, bool]] = []
        reference_run(prof, reqs, gate, boundaries=bounds)
        later = [b for b in bounds if b[0] >= last]
        decode_only = [b for b in later if b[1]]
        pool = decode_only if decode_only and draw(st.integers(0, 4)) > 0 else later
        if not pool:
            break
        last, in_decode = draw(st.sampled_from(pool))
        event("tie at a decode-only boundary" if in_decode else "tie at a mixed boundary")
        reqs.append(_draw_request(draw, prof, last))
        reqs.sort(key=lambda r: r[0])  # stable: the new request goes after earlier equal arrivals
    return prof, reqs, gate, True


def _check_against_reference(prof, reqs, gate, exact):
    ref, ref_preemptions, ref_free = reference_run(prof, reqs, gate)
    prep = prepare_requests(
        [Request(id=i, arrival_s=a, prompt_tokens=p, output_tokens=o) for i, (a, p, o) in enumerate(reqs)],
        prof,
    )
    sim = ClusterSimulator(prof, 1, _First(PolicyContext(prof, 1)), admission_gate=gate)
    run = sim.run(prep.requests)
    for r, q in zip(run.requests, ref):
        if exact:
            assert (r.id, r.first_token_s, r.finish_s) == (q.i, q.first, q.finish)
        else:
            assert r.first_token_s == pytest.approx(q.first, rel=1e-9, abs=1e-12)
            assert r.finish_s == pytest.approx(q.finish, rel=1e-9, abs=1e-12)
        assert r.preemptions == q.preemptions
    inst = run.instances[0]
    assert inst.preemptions == ref_preemptions
    assert inst.free_blocks == ref_free == inst.total_blocks


@settings(max_examples=300, deadline=None)
@given(offset_cases())
def test_matches_naive_reference(case):
    _check_against_reference(*case)


@settings(max_examples=300, deadline=None)
@given(tie_cases())
def test_matches_naive_reference_at_exact_ties(case):
    _check_against_reference(*case)
