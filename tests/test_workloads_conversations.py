"""The multi-turn conversation generator (``routerd.workloads.conversations``).

Checked: reproducibility by seed (and that a larger ``n`` only appends), history growth (every
turn's prefix units extend the previous turn's by its answer and a new message), bursty quantized
arrivals (many requests per timestamp), bounds (context cap, answer cap, ids, ordering), the
default's calibration against the statistics it was set to (PROVENANCE §1b, within loose bands),
the registry name with its ``conversations:SPEC`` syntax, and that the simulator runs it.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routerd.workloads import (
    CONVERSATION_PRESETS,
    ConversationParams,
    WorkloadError,
    conversations,
    load_workload,
)
from routerd.workloads.traces import mean_rate

sys.path.insert(0, str(Path(__file__).parent))
from prefix_reference import infinite_cache_reuse  # noqa: E402

DEFAULT = CONVERSATION_PRESETS["default"][0]


def previous_turns(reqs, k_sys: int = DEFAULT.system_prompts):
    """``(request, its previous turn)`` for every request whose previous turn is in ``reqs``.

    A prompt is ``[system prompt] m_1 a_1 ... a_{k-1} m_k`` (system prompt ids < ``k_sys``), so
    the unit before the last is the previous turn's answer, found by its ``response_id``."""
    by_answer = {r.response_id: r for r in reqs}
    pairs = []
    for r in reqs:
        body = [u for u in r.prefix if u[0] >= k_sys]
        if len(body) >= 3 and body[-2][0] in by_answer:
            pairs.append((r, by_answer[body[-2][0]]))
    return pairs


def test_same_seed_same_requests_other_seed_other_requests():
    a = conversations(DEFAULT, 600, 7)
    assert a == conversations(DEFAULT, 600, 7)
    b = conversations(DEFAULT, 600, 8)
    assert [r.prefix for r in a] != [r.prefix for r in b]
    assert [r.arrival_s for r in a] != [r.arrival_s for r in b]
    # A larger n only appends: the first requests are the same requests.
    assert conversations(DEFAULT, 900, 7)[:600] == a


def test_each_turn_extends_the_previous_turn():
    for params in (DEFAULT, CONVERSATION_PRESETS["long-sessions"][0]):
        reqs = conversations(params, 1500, 3)
        pairs = previous_turns(reqs)
        assert len(pairs) > 150  # multi-turn sessions are there (and most of their turns in the window)
        for r, prev in pairs:
            k = len(prev.prefix)
            assert r.prefix[:k] == prev.prefix  # the whole previous prompt, unit for unit
            assert r.prefix[k] == (prev.response_id, prev.output_tokens)  # then its answer
            assert len(r.prefix) == k + 2  # then one new message
            assert r.prompt_tokens == prev.prompt_tokens + prev.output_tokens + r.prefix[-1][1]
            assert r.arrival_s >= prev.arrival_s and r.id > prev.id
        # Sessions of 3+ turns: some request's previous turn has a previous turn too.
        answers_of = {id(r): p for r, p in pairs}
        assert any(id(p) in answers_of for _, p in pairs)


def test_arrivals_are_bursty_and_quantized():
    reqs = conversations(DEFAULT, 2000, 0)
    t = [r.arrival_s for r in reqs]
    assert t[0] >= 0 and all(a <= b for a, b in zip(t, t[1:]))
    assert all(x == math.floor(x / 3.0) * 3.0 for x in t)  # multiples of the 3 s step
    counts = Counter(t)
    same = sum(1 for a, b in zip(t, t[1:]) if a == b) / (len(t) - 1)
    assert same > 0.8  # the Mooncake conversation trace: 90% share the previous timestamp
    assert max(counts.values()) >= 20
    # Before quantization, session starts still cluster: inter-arrival CV well above Poisson's 1.
    raw = conversations(DEFAULT.model_copy(update={"quantum_s": 0.0}), 2000, 0)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(raw, raw[1:])]
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) > 1.3
    # Without bursts (one session per burst, no window) the same statistic is near Poisson's.
    flat = DEFAULT.model_copy(update={"quantum_s": 0.0, "sessions_per_burst": 1.0, "burst_rate": 2.2,
                                      "burst_window_s": 0.0})
    fl = conversations(flat, 2000, 0)
    fgaps = [b.arrival_s - a.arrival_s for a, b in zip(fl, fl[1:])]
    assert statistics.pstdev(fgaps) / statistics.fmean(fgaps) < statistics.pstdev(gaps) / statistics.fmean(gaps)


@settings(max_examples=25, deadline=None)
@given(
    cap=st.integers(min_value=64, max_value=20000),
    max_answer=st.integers(min_value=1, max_value=3000),
    sys_share=st.floats(min_value=0.0, max_value=1.0),
    k_sys=st.integers(min_value=1, max_value=5),
    scale=st.floats(min_value=0.3, max_value=5.0),
    quantum=st.sampled_from([0.0, 0.5, 3.0]),
    n=st.integers(min_value=1, max_value=300),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_bounds(cap, max_answer, sys_share, k_sys, scale, quantum, n, seed):
    p = ConversationParams(max_context_tokens=cap, max_answer_tokens=max_answer, system_share=sys_share,
                           system_prompts=k_sys, turns_scale=scale, quantum_s=quantum, warmup_s=300.0)
    reqs = conversations(p, n, seed)
    assert len(reqs) == n and [r.id for r in reqs] == list(range(n))
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:])) and reqs[0].arrival_s >= 0
    ids = set()
    for r in reqs:
        assert r.prompt_tokens == sum(t for _, t in r.prefix) >= 1
        assert 1 <= r.output_tokens <= max_answer
        assert r.prompt_tokens + r.output_tokens <= cap
        assert r.prompt_tokens <= p.max_prompt_tokens()
        assert all(t >= 1 and u >= 0 for u, t in r.prefix)
        assert all(u >= k_sys for u, _ in r.prefix[1:])  # a system prompt only comes first
        assert r.response_id is not None and r.response_id >= k_sys and r.response_id not in ids
        ids.add(r.response_id)
        if quantum:
            assert r.arrival_s == math.floor(r.arrival_s / quantum) * quantum


def test_default_matches_what_it_was_calibrated_to():
    """Loose bands around PROVENANCE §1b's conversation-trace figures (the docstring gives the exact
    values of 12,000 requests): input mean 12,035 / median 6,909, output mean 343, 3.40 req/s,
    ~40% of prompt tokens reusable by an infinite cache; answers cached too change little."""
    reqs = conversations(DEFAULT, 6000, 1)
    inp = [r.prompt_tokens for r in reqs]
    assert 9_000 < statistics.fmean(inp) < 16_000
    assert 5_000 < statistics.median(inp) < 9_500
    assert 300 < statistics.fmean(r.output_tokens for r in reqs) < 420
    assert 2.8 < mean_rate(reqs) < 4.2
    reuse = infinite_cache_reuse(reqs).token_hit_rate
    assert 0.30 < reuse < 0.50
    long = conversations(CONVERSATION_PRESETS["long-sessions"][0], 6000, 1)
    assert infinite_cache_reuse(long).token_hit_rate > reuse + 0.2


def test_context_cap_ends_sessions_instead_of_truncating_history():
    p = DEFAULT.model_copy(update={"max_context_tokens": 3000, "first_message_tokens": 800, "turns_scale": 4.0})
    reqs = conversations(p, 800, 2)
    pairs = previous_turns(reqs)
    assert pairs  # sessions still continue while they fit
    for r, prev in pairs:
        assert r.prefix[:len(prev.prefix)] == prev.prefix
    assert max(r.prompt_tokens + r.output_tokens for r in reqs) <= 3000


def test_argument_errors():
    with pytest.raises(WorkloadError, match="n must be"):
        conversations(DEFAULT, 0, 0)
    with pytest.raises(WorkloadError, match="n must be"):
        conversations(DEFAULT, True, 0)
    with pytest.raises(WorkloadError, match="params must be ConversationParams"):
        conversations({"turns_scale": 1.0}, 5, 0)


def test_registry_conversations():
    w = load_workload("conversations", n=80, seed=3)
    assert w.requests == conversations(DEFAULT, 80, 3)
    assert w.native_rate == pytest.approx(mean_rate(w.requests)) and "conversations" in w.description
    assert len(load_workload("conversations").requests) == 2000
    w = load_workload("conversations:long-sessions,think_median_s=10", n=50, seed=1)
    assert w.requests == conversations(CONVERSATION_PRESETS["long-sessions"][0].model_copy(
        update={"think_median_s": 10.0}), 50, 1)
    short = load_workload("conversations:chat-8k", n=500).requests
    assert load_workload("conversations,chat-8k", n=30).requests == short[:30]
    assert max(r.prompt_tokens + r.output_tokens for r in short) <= 8192
    # A rate rescales the native clock: equal timestamps stay equal.
    native = load_workload("conversations", n=300, seed=2).requests
    fast = load_workload("conversations", n=300, seed=2, rate=30.0).requests
    assert mean_rate(fast) == pytest.approx(30.0)
    assert [a.arrival_s == b.arrival_s for a, b in zip(native, native[1:])] == \
        [a.arrival_s == b.arrival_s for a, b in zip(fast, fast[1:])]
    assert load_workload("conversations", n=300, seed=2, limit=40).requests == native[:40]


@pytest.mark.parametrize(("name", "words"), [
    ("conversations:nope", "unknown conversations preset 'nope'; valid: chat-8k, default, long-sessions"),
    ("conversations:default,colour=red", "conversations option 'colour' is not a parameter; valid: turns_scale,"),
    ("conversations:max_turns=x", "conversations option max_turns='x': Input should be a valid integer"),
    ("conversations:system_share=2", "conversations option system_share='2': Input should be less than"),
    ("conversations:default,max_turns", "conversations option 'max_turns' is not field=value"),
])
def test_registry_conversations_bad_spec(name, words):
    with pytest.raises(WorkloadError) as ei:
        load_workload(name)
    assert str(ei.value).startswith(words) and "\n" not in str(ei.value)


def test_seeds_redraw_the_generator_and_the_simulator_runs_it():
    from routerd.bench import load_to_rate, run_bench, seed_workloads
    from routerd.profiles import get_profile

    wls = seed_workloads("conversations", [0, 1], limit=60, n=60)
    assert [len(w.requests) for w in wls] == [60, 60]
    assert wls[0].requests != wls[1].requests and wls[0].requests == conversations(DEFAULT, 60, 0)
    prof = get_profile("llama3.1-8b-h100")
    reqs, cap, rate = load_to_rate(wls[0].requests, prof, 2, 1.0)
    assert rate == pytest.approx(cap) and mean_rate(reqs) == pytest.approx(rate)
    bench = run_bench(reqs, prof, 2, ["round_robin", "lmetric"], workload_name="conversations")
    assert bench.requests == 60 and bench.rejected == 0
    for r in bench.results:
        assert r.summary.requests == 60 and r.summary.e2e_mean > 0
