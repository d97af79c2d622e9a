"""Hand-computed iteration times and latencies for tiny cases (one instance).

Toy profile (tests/conftest.py): iteration time =
0.01 + 0.001 * prefill tokens + 0.002 * decodes + 0.0001 * decode context tokens.
"""

from __future__ import annotations

import pytest
from conftest import toy_profile

from routerd.model import Request
from routerd.policies.base import PolicyContext, RoutingPolicy
from routerd.sim import ClusterSimulator, prepare_requests


class _First(RoutingPolicy):
    name = "first"

    def pick(self, request, view):
        return 0


def run_one_instance(profile, reqs):
    prep = prepare_requests([Request(id=i, arrival_s=t, prompt_tokens=p, output_tokens=d)
                             for i, (t, p, d) in enumerate(reqs)], profile)
    sim = ClusterSimulator(profile, 1, _First(PolicyContext(profile, 1)))
    run = sim.run(prep.requests)
    return run


def test_lone_request():
    prof = toy_profile()
    run = run_one_instance(prof, [(0.0, 10, 3)])
    r = run.requests[0]
    # prefill: 0.01 + 10 * 0.001 = 0.02
    assert r.first_token_s == pytest.approx(0.02)
    # decode 1: ctx 11 -> 0.01 + 0.002 + 0.0011 = 0.0131; decode 2: ctx 12 -> 0.0132
    assert r.finish_s == pytest.approx(0.02 + 0.0131 + 0.0132)
    assert r.finish_s == pytest.approx(prof.lone_request_time(10, 3))
    assert r.preemptions == 0
    assert run.instances[0].free_blocks == run.instances[0].total_blocks


def test_chunked_prefill_two_requests():
    prof = toy_profile(chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=8)
    run = run_one_instance(prof, [(0.0, 10, 2), (0.0, 6, 2)])
    a, b = run.requests
    # step 1: A chunk of 8 (budget 8): 0.01 + 0.008 = 0.018
    # step 2: A's last 2 tokens + B's 6: 0.01 + 0.008 = 0.018 -> both first tokens at 0.036
    assert a.first_token_s == pytest.approx(0.036)
    assert b.first_token_s == pytest.approx(0.036)
    # step 3: two decodes, contexts 11 + 7: 0.01 + 0.004 + 0.0018 = 0.0158
    assert a.finish_s == pytest.approx(0.0518)
    assert b.finish_s == pytest.approx(0.0518)


def test_no_chunking_budget_blocks_head():
    # Without chunking a prompt is prefilled whole; B (40 tokens) does not fit the
    # budget left after A (30 of 64), so it waits for the next step (head-of-line).
    prof = toy_profile(max_num_batched_tokens=64, max_model_len=64)
    run = run_one_instance(prof, [(0.0, 30, 1), (0.0, 40, 1)])
    a, b = run.requests
    assert a.finish_s == pytest.approx(0.01 + 0.030)  # output 1: done at its prefill
    assert b.first_token_s == pytest.approx(0.04 + 0.01 + 0.040)


def test_preemption_by_recompute():
    # 4 blocks of 4 tokens. A and B (prompt 4, output 6) both run; at their 5th decode
    # step (context 9) each needs a 3rd block and none is free: B (admitted last) is
    # preempted, A finishes, then B recomputes prompt + its 5 generated tokens (9 tokens)
    # and emits its 6th token.
    prof = toy_profile(block_size=4, kv_capacity_tokens=16, max_model_len=16)
    run = run_one_instance(prof, [(0.0, 4, 6), (0.0, 4, 6)])
    a, b = run.requests
    t = 0.01 + 0.008  # joint prefill of 8 tokens
    assert a.first_token_s == pytest.approx(t)
    assert b.first_token_s == pytest.approx(t)
    for ctx in (5, 6, 7, 8):  # four decode steps, two requests
        t += 0.01 + 0.004 + 0.0001 * 2 * ctx
    t += 0.01 + 0.002 + 0.0001 * 9  # A alone (B preempted), context 9
    assert a.finish_s == pytest.approx(t)
    t += 0.01 + 0.001 * 9  # B recomputes 9 tokens and emits its last token
    assert b.finish_s == pytest.approx(t)
    assert (a.preemptions, b.preemptions) == (0, 1)
    assert run.instances[0].preemptions == 1
    assert run.instances[0].prefill_tokens_done == 8 + 9
    assert run.instances[0].free_blocks == 4


def test_arrival_mid_decode_joins_next_step():
    prof = toy_profile()
    # A alone decodes; B arrives at 0.05, during A's decode step that ends at
    # 0.02 + 0.0131 * ... ; B's prefill joins the first step that starts after 0.05.
    run = run_one_instance(prof, [(0.0, 10, 10), (0.05, 5, 1)])
    a, b = run.requests
    t = 0.02
    ctx = 11
    while t <= 0.05:
        t += 0.01 + 0.002 + 0.0001 * ctx
        ctx += 1
    # the step after 0.05 mixes A's decode (context ctx) and B's 5-token prefill
    step = 0.01 + 0.005 + 0.002 + 0.0001 * ctx
    assert b.first_token_s == pytest.approx(t + step)
    assert b.finish_s == pytest.approx(t + step)


def test_arrival_on_an_interior_segment_boundary_joins_the_next_step():
    # Issue 13's minimal case. Iterations take 1/64 s whatever they hold. A: prefill
    # 4.796875 -> 4.8125 (first token), then a two-iteration decode segment ending at
    # 4.828125 and 4.84375. B arrives exactly at 4.828125, the segment's interior
    # boundary: like an arrival at a single-step boundary it joins the step that starts
    # then (A's 3rd token + B's 1-token prefill; KV 3 + 1 blocks of 1 token = all 4), so
    # B's only token comes at 4.84375, not one iteration later (4.859375). All times are
    # dyadic, so they are exact.
    prof = toy_profile(overhead_s=0.015625, prefill_per_token_s=0.0, decode_per_seq_s=0.0,
                       decode_per_ctx_token_s=0.0, kv_capacity_tokens=4, block_size=1, max_model_len=4)
    run = run_one_instance(prof, [(4.796875, 1, 3), (4.828125, 1, 1)])
    a, b = run.requests
    assert (a.first_token_s, a.finish_s) == (4.8125, 4.84375)
    assert (b.first_token_s, b.finish_s) == (4.84375, 4.84375)
    assert run.instances[0].iterations == 3
    assert run.instances[0].free_blocks == 4
