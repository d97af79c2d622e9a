"""The router tick grid: the next tick is strictly after ``now``, on the grid and at most one
interval away, whatever the float rounding at large simulated times (issue 32's livelock)."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routerd.bench import policy_context
from routerd.policies.registry import build_policy_from_spec
from routerd.profiles import get_profile
from routerd.sim import ClusterSimulator, prepare_requests
from routerd.sim.cluster import interval_ns, next_tick, tick_time
from routerd.workloads.registry import load_workload
from routerd.workloads.traces import rescale_to_rate


def _check(now: float, step_ns: int) -> None:
    k, t = next_tick(now, step_ns)
    exact = Fraction(k * step_ns, 10**9)
    # Strictly later than now.
    assert t > now
    # On the grid: t is the float nearest k * step_ns ns (within half an ulp of the exact value).
    assert abs(Fraction(t) - exact) <= Fraction(math.ulp(t)) / 2
    # The first such grid point: the one before is not after now ...
    assert tick_time(k - 1, step_ns) <= now
    # ... so t is at most one interval away (plus the rounding of t).
    assert Fraction(t) - Fraction(now) <= Fraction(step_ns, 10**9) + Fraction(math.ulp(t))


def test_issue_example_no_longer_ties_now():
    now = 527269.7
    # The old rule, floor(now / 0.02 + 1e-9) + 1 intervals, lands on now itself.
    assert now / 0.02 == 26363484.999999996
    assert (math.floor(now / 0.02 + 1e-9) + 1) * 0.02 == now
    k, t = next_tick(now, interval_ns(0.02))
    # 527269.7 s is grid point 26,363,485 exactly (in ns), so the next one is 26,363,486 * 20 ms.
    assert k == 26_363_486
    assert t == 527269.72
    _check(now, interval_ns(0.02))


def test_interval_ns_rounds_to_whole_nanoseconds():
    assert interval_ns(0.02) == 20_000_000
    assert interval_ns(1e-4) == 100_000
    assert interval_ns(1.0) == 10**9
    with pytest.raises(ValueError):
        interval_ns(math.inf)
    with pytest.raises(ValueError):
        interval_ns(0.0)


@settings(max_examples=3000, deadline=None)
@given(now=st.floats(min_value=0.0, max_value=1e9, allow_nan=False, allow_infinity=False),
       step_ns=st.integers(min_value=100_000, max_value=10 * 10**9))
def test_next_tick_property_random_times(now, step_ns):
    _check(now, step_ns)


@settings(max_examples=3000, deadline=None)
@given(k=st.integers(min_value=0, max_value=10**13),
       step_ns=st.integers(min_value=100_000, max_value=10 * 10**9),
       nudge=st.sampled_from((-1, 0, 1)))
def test_next_tick_property_on_and_beside_grid_points(k, step_ns, nudge):
    # Times on the grid (and one ulp either side) are where float division misrounds.
    now = tick_time(k, step_ns)
    if now > 1e9:
        now = tick_time(k % (10**18 // step_ns), step_ns)
    if nudge:
        now = math.nextafter(now, math.inf if nudge > 0 else -math.inf)
    now = max(now, 0.0)
    _check(now, step_ns)


def test_next_tick_seeded_loop_of_float_intervals():
    # Intervals given in seconds (as --action-interval is), times up to 1e9 s, a third of them on ticks.
    rng = random.Random(32)
    for _ in range(20_000):
        step = interval_ns(rng.choice((0.02, 0.05, 0.001, 1e-4, 0.1, 1.0, rng.uniform(1e-4, 5.0))))
        r = rng.random()
        if r < 1 / 3:
            now = tick_time(rng.randrange(0, 10**18 // step), step)
        elif r < 2 / 3:
            now = rng.uniform(0.0, 1e9)
        else:
            now = rng.uniform(0.0, 1e6)
        _check(now, step)


def test_a_holding_policy_at_a_very_low_rate_finishes():
    # The bundled sample's first 64 requests at 0.001 req/s, arriving in bursts of 32 at one
    # timestamp (as real traces quantize them), on a clock starting at 527000 s: late_binding
    # holds each burst's excess, ticking every 20 ms at times where the old rule put the next
    # tick at now (it looped forever, pushing ticks at one instant).
    prof = get_profile("llama2-7b-v100")
    reqs = rescale_to_rate(load_workload("sample", limit=64).requests, 0.001)
    reqs = [r.model_copy(update={"arrival_s": 527000.0 + reqs[32 * (i // 32)].arrival_s})
            for i, r in enumerate(reqs)]
    pol = build_policy_from_spec("late_binding", policy_context(prof, 4))
    prep = prepare_requests(reqs, prof)
    sim = ClusterSimulator(prof, 4, pol)
    gen = sim.steps(prep.requests)
    decisions = 0
    try:
        r = next(gen)
        while True:
            decisions += 1
            # A livelock never advances the clock: bound the decisions instead of hanging.
            assert decisions < 20_000, f"no progress at {sim.now} s"
            r = gen.send(pol.pick(r.features, sim.view(sim.now)))
    except StopIteration as stop:
        run = stop.value
    assert run.holds > 0  # the case exercises holding
    assert len(run.requests) == len(prep.requests) == sim.finished
    assert all(r.finish_s >= r.arrival_s >= 527000.0 for r in run.requests)
    assert run.end_s >= max(r.arrival_s for r in run.requests)
