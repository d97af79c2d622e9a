"""Table test of ``phasewise`` (routerd/policies/phasewise.py): costs by hand on TOY.

TOY (tests/test_policies.py): overhead 0.01 s, prefill 1e-4 s/token, no prefill attention,
decode 1e-3 s/request + 1e-6 s/context token, 2,048-token budget, 16-token blocks,
max_num_seqs 4. The request: 160 prompt tokens (10 blocks), 50 predicted output tokens.
"""

from __future__ import annotations

import pytest

from test_policies import make, res
from test_policies_prefix import Eng, P, cv, preq


def pw(**params):
    """``phasewise`` with its decode term off: the tests below check the prefill terms by hand
    (``test_the_default_prices_its_own_decode_at_each_batch`` checks the decode term)."""
    return make("phasewise", **{"decode_weight": 0.0, **params})


def eng(i, *residents, cached=0, pending=0, total=1000, used=None):
    used = sum(-(-(r.prompt_tokens + r.generated_tokens) // 16) for r in residents) if used is None else used
    running = sum(1 for r in residents if not r.waiting)
    return Eng(i, running, len(residents) - running, used, total, 16, tuple(residents), cached=cached, pending=pending)


def cost(cached_blocks, pending, B, S, interference=1.0, delayed=None):
    """The docstring's cost with decode_weight 0 (the default): ``delayed`` requests (default
    ``B``, the decoding ones; the default count adds those waiting or prefilling) each wait the
    request's prefill, ``1e-4 * u`` s."""
    t_dec = 0.01 + 1e-3 * B + 1e-6 * S
    k = 1e-4 + t_dec / 2048
    u = 160 - 16 * cached_blocks
    return k * (pending + u) + interference * (B if delayed is None else delayed) * 1e-4 * u


def test_costs_by_hand():
    # Instance 0: 8 of the 10 blocks cached, one decoding resident (100 prompt + 100 predicted:
    # B = 1, S = 200): 32 * (1e-4 + 0.0112 / 2048) + 1 * 1 * 1e-4 * 32 = 6.575e-3 s.
    # Instance 1: nothing cached, idle: 160 * (1e-4 + 0.01 / 2048) = 0.016781 s.
    assert cost(8, 0, 1, 200) == pytest.approx(32 * (1e-4 + 0.0112 / 2048) + 32e-4)
    assert cost(8, 0, 1, 200) == pytest.approx(6.575e-3, rel=1e-3)
    assert cost(8, 0, 1, 200) < cost(0, 0, 0, 0)
    p = pw()
    v = cv(eng(0, res(100, pred=100), cached=8), eng(1))
    assert p.pick(preq(160, P), v) == 0
    # 2,000 tokens of prefill queued on instance 0 outweigh the 128 cached tokens.
    assert cost(8, 2000, 1, 200) > cost(0, 0, 0, 0)
    v = cv(eng(0, res(100, pred=100), cached=8, pending=2000), eng(1))
    assert p.pick(preq(160, P), v) == 1


def test_interference_weight_moves_the_choice():
    # Three decoders on instance 0 (S = 600) with 2 blocks cached, against an idle instance 1.
    # Weight 1: 0.0140 + 3 * 1e-4 * 128 = 0.0524 > 0.0168 -> 1; weight 0: 0.0140 < 0.0168 -> 0.
    rs = [res(100, pred=100) for _ in range(3)]
    assert cost(2, 0, 3, 600, interference=1.0) > cost(0, 0, 0, 0) > cost(2, 0, 3, 600, interference=0.0)
    assert pw(interference_weight=1.0).pick(preq(160, P), cv(eng(0, *rs, cached=2), eng(1))) == 1
    assert pw(interference_weight=0.0).pick(preq(160, P), cv(eng(0, *rs, cached=2), eng(1))) == 0


def test_requests_waiting_there_count_as_delayed_by_default():
    # Instance 0: 2 blocks cached, one decoding and two waiting residents (S = 600, B = 1); its
    # engine reports no prefill pending, so only the interference term sees the waiting two.
    # residents: 128 * (1e-4 + 0.0116 / 2048) + 3 * 1e-4 * 128 = 0.05193 > 0.016781 (idle 1) -> 1;
    # decoding: 128 * (1e-4 + 0.0116 / 2048) + 1 * 1e-4 * 128 = 0.02633 > 0.016781 -> 1 too, so
    # with one cached block fewer the counts part: 144 tokens uncached, B = 1:
    # residents 0.05842 > 0.016781 -> 1; decoding with weight 0.1: 0.016656 < 0.016781 -> 0.
    rs = [res(100, pred=100), res(100, pred=100, state="waiting"), res(100, pred=100, state="waiting")]
    assert cost(2, 0, 1, 600, delayed=3) == pytest.approx(128 * (1e-4 + 0.0116 / 2048) + 3 * 128e-4)
    assert cost(1, 0, 1, 600, interference=0.1) < cost(0, 0, 0, 0) < cost(1, 0, 1, 600, delayed=3)
    v = cv(eng(0, *rs, cached=1), eng(1))
    assert pw().pick(preq(160, P), v) == 1
    assert pw(interference_weight=0.1, interference_count="decoding").pick(preq(160, P), v) == 0


def test_each_instance_is_priced_by_its_own_profile():
    from routerd.policies.base import PolicyContext
    from routerd.policies.registry import build_policy
    from test_policies import TOY

    # Instance 1's GPU prefills 4x slower (4e-4 s/token): idle, its 160 tokens cost
    # 160 * (4e-4 + 0.01 / 2048) = 0.06478 s; instance 0 with 2,000 tokens queued costs
    # 2160 * (1e-4 + 0.01 / 2048) = 0.2265 s; with 200 queued 360 * 1.0488e-4 = 0.03776 s < 0.06478.
    slow = TOY.model_copy(update={"prefill_per_token_s": 4e-4, "name": "toy-slow"})
    ctx = PolicyContext(profile=TOY, num_instances=2, seed=0, profiles=(TOY, slow))
    p = build_policy("phasewise", {"decode_weight": 0.0}, ctx)
    assert p.pick(preq(160, None), cv(eng(0, pending=200), eng(1))) == 0
    assert p.pick(preq(160, None), cv(eng(0, pending=2000), eng(1))) == 1
    # Priced as if both were TOY, 200 queued would lose to the idle instance (0.03776 > 0.016781).
    same = build_policy("phasewise", {"decode_weight": 0.0}, PolicyContext(profile=TOY, num_instances=2, seed=0))
    assert same.pick(preq(160, None), cv(eng(0, pending=200), eng(1))) == 1


def test_headroom_first_and_holding():
    # Instance 0 has the cache but no KV headroom: need = blocks(160 + 50) - 8 = 6 > 95 - 95.
    full = eng(0, cached=8, total=100, used=95)
    assert pw().pick(preq(160, P), cv(full, eng(1, total=100))) == 1
    # Nobody fits: the cheapest anyway, or hold with hold=true.
    both = cv(eng(0, cached=8, total=100, used=95), eng(1, total=100, used=99))
    assert pw().pick(preq(160, P), both) == 0
    assert pw(hold=True).pick(preq(160, P), both) is None


def test_no_prefix_and_seeded_ties():
    # Without prefix identity two idle instances cost the same: a seeded random choice.
    picks = {pw(seed=s).pick(preq(160, None), cv(eng(0), eng(1))) for s in range(20)}
    assert picks == {0, 1}
    a = [pw(seed=3).pick(preq(160, None), cv(eng(0), eng(1))) for _ in range(5)]
    b = [pw(seed=3).pick(preq(160, None), cv(eng(0), eng(1))) for _ in range(5)]
    assert a == b


def test_approximate_source_learns_from_its_own_dispatches():
    p = pw(prefix_source="approximate")
    # Both idle and unknown: a tie; whichever it picks, the same prompt goes there again
    # (the engine's own report, cached=0 here, is not used in approximate mode).
    first = p.pick(preq(160, P), cv(eng(0), eng(1)))
    assert all(p.pick(preq(160, P), cv(eng(0), eng(1))) == first for _ in range(5))


def test_without_headroom_the_smaller_kv_deficit_wins():
    # Neither fits. Instance 0 has the cache (need 14 - 8 = 6 blocks) but deficit
    # 6 - (95 - 100) = 11 blocks; instance 1 no cache (need 14) but deficit 14 - (95 - 85) = 4.
    # Costs with k = 1e-4 + 0.01 / 2048 (idle): 0: 32k + 4 * 11 * 16 k = 0.0772;
    # 1: 160k + 4 * 4 * 16 k = 0.0436 -> 1. Without the preemption term 0 is cheaper (32k).
    k = 1e-4 + 0.01 / 2048
    assert 32 * k + 4 * 11 * 16 * k > 160 * k + 4 * 4 * 16 * k
    v = cv(eng(0, cached=8, total=100, used=100), eng(1, total=100, used=85))
    assert pw().pick(preq(160, P), v) == 1
    assert pw(preemption_weight=0.0).pick(preq(160, P), v) == 0


def test_near_ties_of_cost_pick_at_random_within_the_relative_width():
    from routerd.policies.base import PolicyContext
    from routerd.policies.registry import build_policy
    from test_policies import TOY

    # 96 tokens of prefill queued on instance 0 (8 blocks cached, one decoding resident) cost
    # 128 * (1e-4 + 0.0112 / 2048) + 32e-4 = 0.016700 s, 0.49% under the idle instance 1's
    # 0.016781 s: a near-tie at 1%, not at 0.01%.
    c0, c1 = cost(8, 96, 1, 200), cost(0, 0, 0, 0)
    assert c0 == pytest.approx(0.0167, rel=1e-6)
    assert c0 < c1 < c0 * 1.005

    def picks(near_tie):
        got = set()
        for seed in range(40):
            p = build_policy("phasewise", {"decode_weight": 0.0},
                             PolicyContext(profile=TOY, num_instances=2, seed=seed, near_tie=near_tie))
            got.add(p.pick(preq(160, P), cv(eng(0, res(100, pred=100), cached=8, pending=96), eng(1))))
        return got

    assert picks(0.0) == {0}
    assert picks(0.0001) == {0}
    assert picks(0.01) == {0, 1}


def test_the_default_prices_its_own_decode_at_each_batch():
    # decode = 50 predicted tokens * (t_dec + 1e-3 + 1e-6 * (160 + 25)): joining instance 0's one
    # decoding resident (t_dec = 0.0112) costs 50 * 0.012385 = 0.61925 s, the idle instance 1
    # (t_dec = 0.01) 50 * 0.011185 = 0.55925 s. With 8 blocks cached on 0 its prefill terms are
    # 6.575e-3 s against 1's 0.016781 s, so with the decode term 1 wins (0.62583 > 0.57603), and
    # without it 0 (the cache hit).
    def decode(t_dec):
        return 50 * (t_dec + 1e-3 + 1e-6 * 185)

    c0, c1 = cost(8, 0, 1, 200) + decode(0.0112), cost(0, 0, 0, 0) + decode(0.01)
    assert c0 == pytest.approx(0.62583, abs=1e-5) and c1 == pytest.approx(0.57603, abs=1e-5)
    v = cv(eng(0, res(100, pred=100), cached=8), eng(1))
    assert make("phasewise").pick(preq(160, P), v) == 1
    assert pw().pick(preq(160, P), v) == 0


def test_near_ties_are_relative_to_what_the_choice_changes():
    from routerd.policies.base import PolicyContext
    from routerd.policies.registry import build_policy
    from test_policies import TOY

    # Both idle, 8 blocks cached on 0: prefill 32 * k = 0.003356 s against 160 * k = 0.016781 s
    # (k = 1e-4 + 0.01 / 2048), each plus the same decode, 50 * (0.01 + 1e-3 + 1e-6 * 185) =
    # 0.55925 s. Whole costs 0.56261 and 0.57603 are 2.4% apart, inside routerd's 5% band; what
    # the choice changes (0.003356 against 0.016781) is not, so the cache hit wins every time.
    k = 1e-4 + 0.01 / 2048
    dec = 50 * (0.01 + 1e-3 + 1e-6 * 185)
    assert (160 * k + dec) < 1.05 * (32 * k + dec) and 160 * k > 1.05 * 32 * k
    picks = {build_policy("phasewise", {}, PolicyContext(profile=TOY, num_instances=2, seed=s, near_tie=0.05))
             .pick(preq(160, P), cv(eng(0, cached=8), eng(1))) for s in range(40)}
    assert picks == {0}
