"""The faster ``featurize`` writes the same ``pw-obs-v1`` bits as the original implementation.

``featurize_v1_reference`` is the implementation before the memoized rounding, kept
verbatim: checkpoints were trained on its output, so any difference, even in the last
bit of a float32, is a change of the observation layout.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import toy_profile
from routerd.daemon.state import EndpointState, Inflight
from routerd.policies.base import ClusterView, LoadSummary, RequestFeatures, ResidentRequest
from routerd.policies.dqn import features
from routerd.policies.dqn.features import featurize, obs_dim
from routerd.policies.static_view import StaticInstanceView


def featurize_v1_reference(request, view, decode_token_time_s, num_buckets=4, out=None):
    m = len(view.instances)
    x = out if out is not None else np.empty(obs_dim(m), dtype=np.float32)
    q = view.queue_len
    x[0] = (q if q < 512 else 512) / 512
    p = request.prompt_tokens / 1024.0
    x[1] = p if p < 8.0 else 8.0
    b = request.predicted_bucket
    x[2] = 0.0 if b is None else b / max(1, num_buckets - 1)
    j = 3
    for inst in view.instances:
        s = inst.load_summary()
        x[j] = s.in_prefill / 32.0
        d = s.decode_bins
        x[j + 1] = d[0] / 32.0
        x[j + 2] = d[1] / 32.0
        x[j + 3] = d[2] / 32.0
        x[j + 4] = round(1.0 - inst.kv_usage, 2)
        rem = s.min_predicted_remaining
        x[j + 5] = 0.0 if rem is None else round(max(rem, 0.0) * decode_token_time_s, 2) / 10.0
        j += 6
    return x


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype == np.float32 and np.array_equal(a.view(np.uint32), b.view(np.uint32))


resident = st.builds(
    ResidentRequest,
    prompt_tokens=st.integers(0, 9000),
    generated_tokens=st.integers(0, 9000),
    predicted_bucket=st.one_of(st.none(), st.integers(0, 3)),
    # Midpoints, arbitrary floats (e.g. a regression predictor), exact zeros of the remaining decode.
    predicted_output_tokens=st.one_of(st.sampled_from([125.0, 625.0, 2500.0, 6000.0]),
                                      st.floats(0.0, 10000.0), st.integers(0, 9000).map(float)),
    in_prefill=st.booleans(),
    waiting=st.booleans(),
)


@st.composite
def instance(draw, index: int) -> StaticInstanceView:
    total = draw(st.integers(1, 5000))
    return StaticInstanceView(index, draw(st.integers(0, 300)), draw(st.integers(0, 300)),
                              draw(st.integers(0, total)), total, 16, tuple(draw(st.lists(resident, max_size=10))))


@st.composite
def states(draw):
    m = draw(st.integers(1, 6))
    view = ClusterView(0.0, [draw(instance(i)) for i in range(m)], draw(st.integers(0, 2000)))
    req = RequestFeatures(0, 0.0, draw(st.integers(0, 20000)), draw(st.one_of(st.none(), st.integers(0, 3))),
                          125.0)
    dt = draw(st.one_of(st.sampled_from([0.02, 0.035, 0.0437]), st.floats(1e-5, 1.0)))
    return req, view, dt, draw(st.integers(1, 6))


@settings(max_examples=400, deadline=None)
@given(states())
def test_featurize_is_bit_identical_to_v1(state):
    req, view, dt, buckets = state
    ref = featurize_v1_reference(req, view, dt, buckets)
    for _ in range(2):  # the second call reads the memoized roundings
        assert same_bits(featurize(req, view, dt, buckets), ref)
    out = np.full(obs_dim(len(view.instances)), np.nan, dtype=np.float32)
    assert featurize(req, view, dt, buckets, out=out) is out and same_bits(out, ref)


@settings(max_examples=100, deadline=None)
@given(states())
def test_featurize_is_bit_identical_to_v1_while_the_memo_is_evicted(state):
    req, view, dt, buckets = state
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(features, "_ROUNDED", {})
        mp.setattr(features, "_ROUNDED_MAX", 3)
        for _ in range(2):
            assert same_bits(featurize(req, view, dt, buckets), featurize_v1_reference(req, view, dt, buckets))
            assert len(features._ROUNDED) <= 3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "first", "tokens", "finish"]), st.integers(0, 9),
                          st.integers(0, 3), st.integers(1, 400)), max_size=80))
def test_featurize_of_routerd_endpoints_is_bit_identical_to_v1(seq):
    prof = toy_profile()
    eps = [EndpointState(i, f"e{i}", f"http://h:{i}", None, True, prof) for i in range(4)]
    reqs: dict[int, Inflight] = {}
    for op, k, a, n in seq:
        r = reqs.get(k)
        if op == "add" and r is None:
            reqs[k] = r = Inflight(k, k, n, a, [125.0, 625.0, 2500.0, 6000.0][a], 0.0)
            eps[k % 4].add(r, 0.0)
        elif op == "first" and r is not None:
            r.endpoint.on_first_token(r)
        elif op == "tokens" and r is not None:
            r.endpoint.on_tokens(r, n)
        elif op == "finish" and r is not None:
            r.endpoint.remove(reqs.pop(k))
        for ep in eps:
            ep.refresh(0.0, 2.0)
        req = RequestFeatures(0, 0.0, n, a, 125.0)
        view = ClusterView(0.0, eps, k)
        assert same_bits(featurize(req, view, prof.decode_token_time_s), featurize_v1_reference(
            req, view, prof.decode_token_time_s))


@pytest.mark.parametrize("v", [0.0, -0.0, math.inf, -math.inf, math.nan, 0.005, 1.005, 2.675, -0.125, 1e300])
def test_memoized_round_returns_what_round_returns(v):
    for _ in range(2):
        got, want = features._round2(v), round(v, 2)
        assert repr(got) == repr(want) and math.copysign(1.0, got) == math.copysign(1.0, want)


class _Stub:
    """An instance whose summary and KV usage are given directly (values no scan produces)."""

    def __init__(self, rem: float | None, kv_usage: float) -> None:
        self.kv_usage = kv_usage
        self._s = LoadSummary(1, (2, 3, 4), rem, 10, 0.0)

    def load_summary(self) -> LoadSummary:
        return self._s


def test_featurize_matches_v1_on_signed_zeros_and_non_finite_values():
    specials = [0.0, -0.0, math.nan, math.inf, -math.inf, -2.5, 3.0, None]
    kv = [0.0, 1.0, 0.5, 1.0 + 1e-16, math.nan]
    req = RequestFeatures(0, 0.0, 100, 1, 125.0)
    for _ in range(2):  # the second pass meets whatever the first one memoized
        for rem in specials:
            for u in kv:
                view = ClusterView(0.0, [_Stub(rem, u), _Stub(-0.0, u)], 3)
                assert same_bits(featurize(req, view, 0.02), featurize_v1_reference(req, view, 0.02))
