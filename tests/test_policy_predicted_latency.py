"""``predicted_latency`` (routerd/policies/predicted_latency.py): its forward model by hand, its
choices, its invariants (hypothesis) and its split of work on a mixed pool.

TOY (tests/test_policies.py): overhead 0.01 s, prefill 1e-4 s/token, no prefill attention,
decode 1e-3 s/request + 1e-6 s/context token per step, 2,048-token budget, 16-token blocks,
max_num_seqs 4. The request: 160 prompt tokens, 50 predicted output tokens.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_policies import TOY, inst, req, res, view

from routerd.bench import run_bench
from routerd.model import PREDICTOR_BUCKET_EDGES as EDGES
from routerd.model import Request
from routerd.policies import PolicyContext, build_policy
from routerd.policies.kv_headroom import blocks_for, kv_deficit_blocks, predicted_footprint_tokens
from routerd.policies.predicted_latency import forecast, kv_wait_s, remaining_decode_steps
from routerd.profiles import get_profile

_TIME_FIELDS = ("overhead_s", "prefill_per_token_s", "prefill_attn_s", "decode_per_seq_s", "decode_per_ctx_token_s")


def scaled(profile, name, factor):
    """``profile`` with every latency coefficient times ``factor`` (a GPU 1/factor as fast)."""
    return profile.model_copy(update={"name": name, **{f: getattr(profile, f) * factor for f in _TIME_FIELDS}})


TOY_FAST = scaled(TOY, "toy-fast", 0.25)


def make(profiles, seed=0, **params):
    return build_policy("predicted_latency", params,
                        PolicyContext(profiles[0], len(profiles), seed=seed, profiles=tuple(profiles)))


# --- the forward model, by hand --------------------------------------------------------------


def test_idle_instance_is_the_lone_request_time():
    # One prefill step (160 tokens fit the budget), then 49 decode steps with contexts 161..209:
    # 0.026 + 49 * 0.011 + 1e-6 * (49 * 161 + 48 * 49 / 2) = 0.574065 s; nothing to delay.
    assert forecast(TOY, [], 160, 50, edges=EDGES) == pytest.approx((0.574065, 0.0), abs=1e-12)
    assert forecast(TOY, [], 160, 50, edges=EDGES)[0] == pytest.approx(TOY.lone_request_time(160, 50), rel=1e-12)
    h100 = get_profile("llama3.1-8b-h100")
    assert forecast(h100, [], 500, 200, edges=EDGES)[0] == pytest.approx(h100.lone_request_time(500, 200), rel=1e-9)


def test_one_decoding_resident_by_hand():
    # Resident: 100 prompt tokens, 100 predicted to go (B = 1, S = 100).
    # Step 1 (its prefill, 160 tokens): 0.01 + 0.016 + 0.001 + 1e-4 = 0.0271 s; the resident waits
    #   1e-4 * 160 = 0.016 s longer.
    # Steps 2-50 (B = 2, S = 101 + 161 = 262, both contexts growing): 49 * (0.012 + 262e-6) +
    #   1e-6 * 2 * 49 * 48 / 2 = 0.60319 s; the resident waits 49 * (1e-3 + 161e-6) + 1e-6 * 1176 =
    #   0.058065 s longer (the request's decode in each of its steps).
    e2e, delay = forecast(TOY, [res(100, pred=100)], 160, 50, edges=EDGES)
    assert e2e == pytest.approx(0.0271 + 0.60319, abs=1e-12)
    assert delay == pytest.approx(0.016 + 0.058065, abs=1e-12)


def test_a_full_batch_makes_it_wait_for_a_seat():
    # max_num_seqs 4 with 4 decoders (10, 100, 100, 100 tokens to go): no prefill until the first
    # finishes. 10 steps at B = 4, S = 400: 10 * 0.0144 + 1e-6 * 4 * 45 = 0.14418 s.
    # Its prefill step (B = 3, S = 330): 0.01 + 0.016 + 0.003 + 330e-6 = 0.02933 s; delay 3 * 0.016.
    # 49 decode steps at B = 4, S = 494: 49 * 0.014494 + 1e-6 * 4 * 1176 = 0.71491 s; each of the
    # 3 others waits 49 * (1e-3 + 161e-6) + 1e-6 * 1176 = 0.058065 s longer.
    rs = [res(100, pred=10)] + [res(100, pred=100) for _ in range(3)]
    e2e, delay = forecast(TOY, rs, 160, 50, edges=EDGES)
    assert e2e == pytest.approx(0.14418 + 0.02933 + 0.71491, abs=1e-12)
    assert delay == pytest.approx(3 * 0.016 + 3 * 0.058065, abs=1e-12)


def test_remaining_decode_steps():
    assert remaining_decode_steps(res(100, 30, pred=100), EDGES) == 70
    # Past its prediction (625, bucket 1 = 250-1000): half of what is left below 1000.
    assert remaining_decode_steps(res(100, 700, pred=625, bucket=1), EDGES) == 150
    assert remaining_decode_steps(res(100, 300, pred=125, bucket=0), EDGES) == 1  # past the bucket too
    assert remaining_decode_steps(res(100, 300, pred=125), EDGES) == 1  # no bucket known


def test_the_horizon_only_makes_it_pessimistic():
    rs = [res(100, pred=p) for p in (10, 20, 30)]
    full = forecast(TOY, rs, 160, 50, edges=EDGES)
    short = forecast(TOY, rs, 160, 50, edges=EDGES, max_events=1)
    assert short[0] > full[0] and short[1] > full[1]
    # Its prefill and the three completions are all the events before it finishes.
    assert forecast(TOY, rs, 160, 50, edges=EDGES, max_events=4) == full
    assert forecast(TOY, rs, 160, 50, edges=EDGES, max_events=3) != full


# --- choices ---------------------------------------------------------------------------------


def test_a_busy_fast_instance_beats_an_idle_slow_one():
    # All of TOY_FAST's coefficients are TOY's / 4, so its forecast is TOY's / 4:
    # (0.63029 + 0.074065) / 4 = 0.17609 s < 0.574065 s on the idle TOY instance.
    v = view(inst(0), inst(1, res(100, pred=100)))
    assert make([TOY, TOY_FAST]).pick(req(160, 50), v) == 1
    # On two TOY instances the same state sends it to the idle one (0.574 < 0.704 s).
    assert make([TOY, TOY]).pick(req(160, 50), v) == 0
    # delay_weight 0 compares own E2E only: still 0.1576 s < 0.574 s.
    assert make([TOY, TOY_FAST], delay_weight=0.0).pick(req(160, 50), v) == 1


def test_holds_only_when_nothing_fits():
    # KV: 160 + 50 tokens need 14 blocks; usable = floor(100 * 0.95) = 95, used 90 -> deficit 9.
    full = inst(0, total=100, used=90)
    assert make([TOY, TOY]).pick(req(160, 50), view(full, inst(1, total=100, used=90))) is None
    assert make([TOY, TOY]).pick(req(160, 50), view(full, inst(1, total=100))) == 1
    # hold=false: the cheapest, unfit ones priced with their recompute (equal deficits: the faster).
    assert make([TOY, TOY_FAST], hold=False).pick(req(160, 50), view(full, inst(1, total=100, used=90))) == 1
    # A full set of sequences (max_num_seqs 4) is unfit too.
    seats = inst(0, *[res(10, pred=10) for _ in range(4)])
    assert make([TOY, TOY]).pick(req(160, 50), view(seats, inst(1, total=100, used=90))) is None


def test_kv_wait_by_hand():
    # Decoding: 100 + 10 to go (holds blocks(100) = 7 now), 200 + 50 to go (holds 13); a
    # prefilling resident frees nothing first. Step now: 0.01 + 2 * 1e-3 + 1e-6 * 300 = 0.0123 s.
    # At 10 steps the first ends: 7 released, the other grown by up to ceil(10 / 16) = 1: 6 free.
    # At 50 steps both have ended: 7 + 13 = 20.
    rs = [res(100, pred=10), res(200, pred=50), res(500, pred=5, state="prefill")]
    assert kv_wait_s(TOY, rs, 5, 16) == pytest.approx(10 * 0.0123, abs=1e-12)
    assert kv_wait_s(TOY, rs, 6, 16) == pytest.approx(10 * 0.0123, abs=1e-12)
    assert kv_wait_s(TOY, rs, 7, 16) == pytest.approx(50 * 0.0123, abs=1e-12)
    assert kv_wait_s(TOY, rs, 20, 16) == pytest.approx(50 * 0.0123, abs=1e-12)
    assert kv_wait_s(TOY, rs, 21, 16) == math.inf
    assert kv_wait_s(TOY, rs, 0, 16) == 0.0
    assert kv_wait_s(TOY, [res(500, state="waiting")], 1, 16) == math.inf
    # Past its prediction a resident has no predicted end: it is never counted on (it was once
    # promised one step away for as long as it ran), and it still grows: 18 steps for the other to
    # end and release 13, less the long one's growth of ceil(18 / 16) = 2 blocks.
    long = res(200, 300, pred=125, bucket=0)
    assert kv_wait_s(TOY, [long], 1, 16) == math.inf
    two = [long, res(200, pred=18)]
    step2 = 0.01 + 2e-3 + 1e-6 * (500 + 200)
    assert kv_wait_s(TOY, two, 11, 16) == pytest.approx(18 * step2, abs=1e-12)
    assert kv_wait_s(TOY, two, 12, 16) == math.inf


def test_waits_for_a_fast_instance_about_to_have_room():
    # The slow instance has room: 0.574065 s there. The fast one lacks 9 blocks (14 needed, 95
    # usable, 90 used) but its one decode (200 + 10 to go) ends in 10 steps of
    # (0.01 + 1e-3 + 200e-6) / 4 = 0.0028 s (it holds blocks(200) = 13 now): 0.028 s, plus about
    # 0.17 s there, is cheaper: hold.
    slow = inst(0, total=100)
    soon = inst(1, res(200, pred=10), total=100, used=90)
    assert make([TOY, TOY_FAST]).pick(req(160, 50), view(slow, soon)) is None
    assert make([TOY, TOY_FAST], wait_for_kv=False).pick(req(160, 50), view(slow, soon)) == 0
    # 2,000 steps to go (5.6 s) is not worth waiting for; nor is anything with hold off.
    late = inst(1, res(200, pred=2000), total=100, used=90)
    assert make([TOY, TOY_FAST]).pick(req(160, 50), view(slow, late)) == 0
    # One past its prediction is never waited for, however close its bucket says its end is.
    past = inst(1, res(200, 140, pred=125, bucket=0), total=100, used=90)
    assert make([TOY, TOY_FAST]).pick(req(160, 50), view(slow, past)) == 0
    assert make([TOY, TOY_FAST], hold=False).pick(req(160, 50), view(slow, soon)) == 0


def test_exact_ties_are_seeded_random():
    v = view(inst(0), inst(1))
    picks = {make([TOY, TOY], seed=s).pick(req(160, 50), v) for s in range(20)}
    assert picks == {0, 1}
    assert [make([TOY, TOY], seed=7).pick(req(160, 50), v) for _ in range(3)] == \
        [make([TOY, TOY], seed=7).pick(req(160, 50), v) for _ in range(3)]


# --- invariants ------------------------------------------------------------------------------

_resident = st.builds(
    lambda p, g, pred, state, b: res(p, g, pred=pred, state=state, bucket=b),
    st.integers(1, 3000), st.integers(0, 3000), st.sampled_from([125.0, 625.0, 2500.0, 6000.0]),
    st.sampled_from(["decode", "prefill", "waiting"]), st.one_of(st.none(), st.integers(0, 3)))


@st.composite
def _cluster(draw):
    n = draw(st.integers(1, 4))
    insts = []
    for i in range(n):
        rs = sorted(draw(st.lists(_resident, max_size=8)), key=lambda r: r.waiting)
        total = draw(st.integers(50, 2000))
        insts.append(inst(i, *rs, total=total, used=draw(st.integers(0, total))))
    profiles = [draw(st.sampled_from([TOY, TOY_FAST])) for _ in range(n)]
    return insts, profiles


@settings(max_examples=150, deadline=None)
@given(_cluster(), st.integers(1, 4000), st.sampled_from([125.0, 625.0, 2500.0]), st.booleans(),
       st.integers(1, 64))
def test_always_a_valid_index_or_a_justified_hold(cluster, prompt, out, hold, max_events):
    insts, profiles = cluster
    p = make(profiles, hold=hold, max_events=max_events)
    choice = p.pick(req(prompt, out), view(*insts))
    need = blocks_for(predicted_footprint_tokens(prompt, out, TOY.max_model_len), 16)
    fits = [kv_deficit_blocks(v, need, 0.05) <= 0 and v.num_running + v.num_waiting < TOY.max_num_seqs
            for v in insts]
    if choice is None:
        assert hold
        if any(fits):
            # Held for an instance without room now whose wait plus cost beats every one with room.
            costs = [sum(x * w for x, w in zip(forecast(prof, v.residents(), prompt, out, edges=EDGES,
                                                        max_events=max_events), (1.0, 1.0)))
                     for v, prof in zip(insts, profiles)]
            waited = [c + kv_wait_s(prof, v.residents(), kv_deficit_blocks(v, need, 0.05), 16)
                      for c, v, prof, f in zip(costs, insts, profiles, fits) if not f]
            assert min(waited) < min(c for c, f in zip(costs, fits) if f)
    else:
        assert type(choice) is int and 0 <= choice < len(insts)
        assert fits[choice] or not any(fits)
    for v, prof in zip(insts, profiles):
        e2e, delay = forecast(prof, v.residents(), prompt, out, edges=EDGES, max_events=max_events)
        idle, _ = forecast(prof, [], prompt, out, edges=EDGES)
        # Load never makes the request faster; the delay it adds is never negative.
        assert math.isfinite(e2e) and e2e >= idle - 1e-9 and delay >= 0.0


# --- a mixed pool in the simulator -----------------------------------------------------------


def test_work_is_split_in_proportion_to_speed_near_saturation():
    # Decode-bound toy GPUs without batching gain (step time = per-sequence cost): the slow one
    # decodes 500 tokens/s, the fast one 1,000. 14 req/s of 100 output tokens is 93% of the
    # 1,500 tokens/s the two serve together, so a good split is close to 2:1 (2/3 to the fast one).
    slow = TOY.model_copy(update=dict(name="toy-slow", overhead_s=1e-4, prefill_per_token_s=2e-5,
                                      decode_per_seq_s=2e-3, decode_per_ctx_token_s=0.0, max_num_seqs=64,
                                      kv_capacity_tokens=160_000))
    fast = scaled(slow, "toy-fast", 0.5)
    rng = random.Random(5)
    t, reqs = 0.0, []
    for i in range(2000):
        t += rng.expovariate(14.0)
        reqs.append(Request(id=i, arrival_s=t, prompt_tokens=16, output_tokens=100))
    b = run_bench(reqs, (slow, fast), 2, ["round_robin", "predicted_latency"], seed=0)
    rr, pl = b.results
    share = float((pl.records["instance"] == 1).mean())
    assert float((rr.records["instance"] == 1).mean()) == 0.5
    assert 0.63 <= share <= 0.71
    assert pl.summary.e2e_mean < 0.2 * rr.summary.e2e_mean  # round robin overloads the slow one
