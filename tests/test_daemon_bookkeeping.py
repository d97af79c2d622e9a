"""routerd's incremental aggregates equal a recount of the residents, and drop to zero when requests end.

Random event sequences (dispatch, first token, tokens, finish or abort, retry, sidecar
snapshots, staleness) drive two endpoints. After each event every O(1) answer is
compared with the scanning helper applied to a :class:`StaticInstanceView` holding the
same residents, so the reference never touches the counters under test.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import toy_profile
from routerd.api.v1.instance_state_pb2 import InstanceState
from routerd.daemon.state import EndpointState, Inflight
from routerd.policies.base import ClusterView, PolicyContext, RequestFeatures, summarize_residents
from routerd.policies.join_shortest_queue import JoinShortestQueue, outstanding_tokens
from routerd.policies.kv_headroom import LateBinding, waiting_kv_blocks
from routerd.policies.static_view import StaticInstanceView
from routerd.prefix.index import pending_prefill_tokens, pending_prefill_work

# Bucket midpoints (exact in binary) and one length with no exact binary form, which
# must make the view fall back to the scan.
PREDICTIONS = (125.0, 625.0, 2500.0, 6000.0, 100.1)
MAX_AGE_S = 2.0


def scanned(ep: EndpointState) -> StaticInstanceView:
    """A plain view with ``ep``'s counts and residents: its helpers can only scan."""
    return StaticInstanceView(ep.index, ep.num_running, ep.num_waiting, ep.kv_used_blocks, ep.kv_total_blocks,
                              ep.block_size, tuple(ep.residents()))


def assert_matches_scan(ep: EndpointState) -> None:
    ref = scanned(ep)
    assert ep.load_summary() == summarize_residents(ref.requests)
    assert ep.waiting_kv_blocks() == waiting_kv_blocks(ref)
    assert outstanding_tokens(ep) == outstanding_tokens(ref)
    assert not hasattr(ref, "pending_prefill_work")  # the reference scans the residents
    assert ep.pending_prefill_work() == pending_prefill_work(ep) == pending_prefill_work(ref)
    assert ep.pending_prefill_tokens() == pending_prefill_tokens(ref)
    kept = ep.outstanding_tokens()
    inexact = any(r.predicted_output_tokens == 100.1 for r in ref.requests)
    blind = [r for r in ep.requests.values() if r.blind and not r.first_token]
    # With blind requests the O(1) figure exists when all or none of the requests before their
    # first token have running slots (num_running against the requests already decoding).
    before_first = sum(not r.first_token for r in ep.requests.values())
    slots = ep.num_running - (len(ep.requests) - before_first)
    partial = bool(blind) and 0 < slots < before_first
    assert (kept is None) == (inexact or partial)
    if kept is not None:
        assert kept == outstanding_tokens(ref)


def assert_released(ep: EndpointState) -> None:
    """No request left: every counter is back where an empty scan puts it."""
    empty = scanned(ep)
    assert empty.requests == ()
    assert ep.load_summary() == summarize_residents(())
    assert ep.outstanding_tokens() == outstanding_tokens(empty)
    assert ep.waiting_kv_blocks() == waiting_kv_blocks(empty)
    assert (ep._prefill, ep._prefill_blocks, ep._sum_tokens, ep._sum_pred, ep._outstanding, ep._n_inexact,
            ep._n_blind, ep._prefill_prompt, ep._prefill_prompt_sq) == ({}, 0, 0, 0.0, 0.0, 0, 0, 0, 0)
    assert all(not g.members for g in ep._groups.values())
    assert (ep._blind_bins, ep._blind_groups, ep._blind_u, ep._blind_uu, ep._blind_prefill) == ([0, 0, 0], {}, 0, 0, 0)


ops = st.lists(st.tuples(st.sampled_from(["add", "first", "tokens", "finish", "retry", "snapshot", "age"]),
                         st.integers(0, 11), st.integers(0, 1), st.integers(0, 13), st.integers(0, 300)),
               max_size=120)


@settings(max_examples=150, deadline=None)
@given(ops, st.randoms(use_true_random=False))
def test_o1_aggregates_equal_a_scan_after_every_event_and_return_to_zero(seq, rnd):
    prof = toy_profile(max_model_len=1024, max_num_batched_tokens=1024)  # 64 blocks of 16, max_num_seqs 8
    eps = [EndpointState(i, f"e{i}", f"http://h:{i}", "h:9", True, prof) for i in range(2)]
    ctx = PolicyContext(profile=prof, num_instances=2)
    jsq, late = JoinShortestQueue(ctx), LateBinding(ctx)
    reqs: dict[int, Inflight] = {}
    now = 0.0
    for op, k, e, a, n in seq:
        r = reqs.get(k)
        if op == "add" and r is None:
            r = reqs[k] = Inflight(k, k, 1 + n, a % 4, PREDICTIONS[a % len(PREDICTIONS)], now)
            r.blind = n % 3 == 0  # a non-streaming request: its first token is seen only at the end
            eps[e].add(r, now)
        elif op == "first" and r is not None:
            r.endpoint.on_first_token(r)
        elif op == "tokens" and r is not None:  # before the first token too: the stream may race it
            r.endpoint.on_tokens(r, n)
        elif op == "finish" and r is not None:  # finish and abort release alike
            assert r.endpoint.remove(reqs.pop(k)) and not r.endpoint.remove(r)
        elif op == "retry" and r is not None:  # failed before the first byte: sent again, maybe elsewhere
            r.endpoint.remove(r)
            r.reset_for_retry()
            eps[e].add(r, now)
        elif op == "snapshot":
            eps[e].set_snapshot(InstanceState(healthy=True, num_requests_running=a, num_requests_waiting=n % 7,
                                              kv_cache_usage=n / 300), now)
        elif op == "age":
            now += MAX_AGE_S + 1.0  # every snapshot goes stale: routerd's own counts
        for ep in eps:
            ep.refresh(now, MAX_AGE_S)
            assert_matches_scan(ep)
            if not ep.requests:
                assert_released(ep)
        req = RequestFeatures(-1, now, 1 + n, a % 4, PREDICTIONS[a % 4])
        refs = [scanned(ep) for ep in eps]
        assert jsq.pick(req, ClusterView(now, eps, 1)) == jsq.pick(req, ClusterView(now, refs, 1))
        assert late.pick(req, ClusterView(now, eps, 1)) == late.pick(req, ClusterView(now, refs, 1))
    left = list(reqs.values())
    rnd.shuffle(left)
    for r in left:
        ep = r.endpoint
        assert ep.remove(r)
        ep.refresh(now, MAX_AGE_S)
        assert_matches_scan(ep)
    for ep in eps:
        assert_released(ep)


def test_waiting_blocks_count_the_last_prefills_in_dispatch_order():
    # Four prefills of 20, 40, 60 and 80 prompt tokens (2, 3, 4, 5 blocks of 16) and one
    # decoding request; a snapshot says 3 run, so 2 prefills run and the last two wait.
    ep = EndpointState(0, "e", "http://h:1", "h:2", True, toy_profile())
    reqs = [Inflight(i, i, 20 * (i + 1), 0, 125.0, 0.0) for i in range(4)]
    dec = Inflight(9, 9, 10, 0, 125.0, 0.0)
    for r in (dec, *reqs):
        ep.add(r, 0.0)
    ep.on_first_token(dec)
    for running, expected in ((3, 4 + 5), (2, 3 + 4 + 5), (1, 2 + 3 + 4 + 5), (4, 5), (5, 0), (9, 0)):
        ep.set_snapshot(InstanceState(healthy=True, num_requests_running=running), 0.0)
        ep.refresh(0.0, MAX_AGE_S)
        assert ep.waiting_kv_blocks() == expected == waiting_kv_blocks(scanned(ep))


def test_load_summary_is_shared_until_the_next_event():
    ep = EndpointState(0, "e", "http://h:1", None, True, toy_profile())
    r = Inflight(1, 1, 10, 0, 125.0, 0.0)
    ep.add(r, 0.0)
    ep.on_first_token(r)
    first = ep.load_summary()
    assert ep.load_summary() is first
    ep.on_tokens(r, 5)
    ep.refresh(0.0, MAX_AGE_S)
    assert ep.load_summary() is not first
    assert ep.load_summary() == summarize_residents(ep.residents())


def test_non_streaming_requests_in_running_slots_count_as_decoding():
    """routerd never sees a non-streaming request's first token. While vLLM counts it as
    running it is decoding in the observation (as in the simulator); beyond the running
    count it waits. Streaming requests keep the first-token rule."""
    from routerd.policies.base import LoadSummary

    ep = EndpointState(0, "e", "http://h:1", "h:2", True, toy_profile())
    blind = [Inflight(i, i, 100, 0, 125.0, 0.0) for i in range(3)]  # bin 0 (< 256 tokens)
    streamed = Inflight(7, 7, 100, 2, 2500.0, 0.0)  # bin 2, no first token yet
    for r in blind:
        r.blind = True
        ep.add(r, 0.0)
    ep.add(streamed, 0.0)
    ep.set_snapshot(InstanceState(healthy=True, num_requests_running=2, num_requests_waiting=2), 0.0)
    ep.refresh(0.0, MAX_AGE_S)
    # Running slots go in dispatch order: blind 0 and 1 decode; blind 2 and the stream wait.
    assert ep.load_summary() == LoadSummary(2, (2, 0, 0), 125.0, 4, 4 * 100 + 3 * 125.0 + 2500.0)
    ep.set_snapshot(InstanceState(healthy=True, num_requests_running=4), 0.0)
    ep.refresh(0.0, MAX_AGE_S)
    # All four run: the three blind ones decode, the stream is in prefill until its first token.
    assert ep.load_summary() == LoadSummary(1, (3, 0, 0), 125.0, 4, 4 * 100 + 3 * 125.0 + 2500.0)
    ep.on_first_token(streamed)
    assert ep.load_summary() == LoadSummary(0, (3, 0, 1), 125.0, 4, 4 * 100 + 3 * 125.0 + 2500.0)
    for r in (*blind, streamed):
        ep.remove(r)
    ep.refresh(0.0, MAX_AGE_S)
    assert_released(ep)
