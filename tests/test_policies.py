"""Table tests of every routing policy on hand-made states; expected picks computed by hand.

Conventions: ``res(...)`` is a resident request, ``inst(...)`` an instance built from
its residents (KV used = blocks of prompt + generated of the running ones), and
``TOY`` a profile with round numbers so the latency arithmetic can be done by hand:
overhead 0.01 s, prefill 1e-4 s/token, no prefill attention term, decode 1e-3
s/request and 1e-6 s/context token per iteration, 1000 blocks of 16 tokens.
"""

from __future__ import annotations

import pytest

from routerd.estimator import MixingParams, r_mixing
from routerd.policies import (
    ClusterView,
    OracleRequestFeatures,
    OracleResident,
    PolicyContext,
    PolicyError,
    RequestFeatures,
    ResidentRequest,
    StaticInstanceView,
    build_policy,
    build_policy_from_spec,
    parse_policy_spec,
    policy_names,
)
from routerd.policies.mixing_penalty import MixingPenalty
from routerd.profiles import HardwareProfile

TOY = HardwareProfile(
    name="toy",
    overhead_s=0.01,
    prefill_per_token_s=1e-4,
    prefill_attn_s=0.0,
    decode_per_seq_s=1e-3,
    decode_per_ctx_token_s=1e-6,
    kv_capacity_tokens=16000,
    block_size=16,
    max_num_seqs=4,
    max_num_batched_tokens=2048,
    chunked_prefill=True,
    max_model_len=4096,
    grad1=1e-4,
    grad2=1e-5,
    decode_token_time_s=0.02,
)


def res(p, g=0, pred=100.0, *, state="decode", bucket=None, out=None):
    """A resident; ``state`` is ``decode`` (running), ``prefill`` (running, prefilling) or ``waiting``."""
    kw = dict(
        prompt_tokens=p,
        generated_tokens=g,
        predicted_bucket=bucket,
        predicted_output_tokens=float(pred),
        in_prefill=state != "decode",
        waiting=state == "waiting",
    )
    return ResidentRequest(**kw) if out is None else OracleResident(**kw, output_tokens=out)


def inst(i, *residents, total=1000, used=None):
    return StaticInstanceView.from_residents(i, residents, kv_total_blocks=total, block_size=16, kv_used_blocks=used)


def view(*instances, now=0.0):
    return ClusterView(now=now, instances=list(instances), queue_len=1)


def req(p, pred, bucket=None, out=None):
    kw = dict(id=0, arrival_s=0.0, prompt_tokens=p, predicted_bucket=bucket, predicted_output_tokens=float(pred))
    return RequestFeatures(**kw) if out is None else OracleRequestFeatures(**kw, output_tokens=out)


def make(name, seed=0, m=2, **params):
    return build_policy(name, params, PolicyContext(profile=TOY, num_instances=m, seed=seed))


# --- round_robin, random ---------------------------------------------------------------


def test_round_robin_cycles_in_view_order():
    p = make("round_robin", m=3)
    v = view(inst(0), inst(1), inst(2))
    assert [p.pick(req(10, 10), v) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_random_is_seeded_and_covers_all_instances():
    v = view(inst(0), inst(1), inst(2))
    a, b, c = make("random", seed=7, m=3), make("random", seed=7, m=3), make("random", seed=8, m=3)
    pa = [a.pick(req(10, 10), v) for _ in range(300)]
    assert pa == [b.pick(req(10, 10), v) for _ in range(300)]
    assert pa != [c.pick(req(10, 10), v) for _ in range(300)]
    assert set(pa) == {0, 1, 2}


# --- join_shortest_queue ---------------------------------------------------------------

JSQ_CASES = [
    pytest.param(
        # 0: decode 250-50 = 200, plus a waiting prompt of 100 -> 300; 1: prefill 100 + decode 20 -> 120
        [res(200, 50, 250), res(100, 0, 0, state="waiting")],
        [res(100, 0, 20, state="prefill")],
        1,
        id="brief-example",
    ),
    pytest.param(
        # 0: preempted, waiting: recompute 100+60 = 160, decode 100-60 = 40 -> 200; 1: decode 190-10 = 180.
        # Without the recompute term 0 would be 140 and win.
        [res(100, 60, 100, state="waiting")],
        [res(500, 10, 190)],
        1,
        id="preempted-recompute",
    ),
    pytest.param(
        # 0: generated past the prediction -> 0 left; 1: empty -> 0; tie to the lower index
        [res(10, 300, 100)],
        [],
        0,
        id="overrun-ties-low",
    ),
]


@pytest.mark.parametrize("res0,res1,expected", JSQ_CASES)
def test_join_shortest_queue(res0, res1, expected):
    assert make("join_shortest_queue").pick(req(50, 50), view(inst(0, *res0), inst(1, *res1))) == expected


# --- least_outstanding_tokens ------------------------------------------------------------


@pytest.mark.parametrize(
    "res0,res1,with_output,expected",
    [
        # 0: 1000+1000 = 2000 (JSQ: 100 left); 1: 2*(300+200) = 1000 (JSQ: 1000) -> 1, JSQ would pick 0
        ([res(1000, 900, 1000)], [res(300, 0, 200, state="waiting")] * 2, True, 1),
        # prompt only: 0 -> 1000, 1 -> 600
        ([res(1000, 900, 1000)], [res(300, 0, 200, state="waiting")] * 2, False, 1),
        # 0: 100+1000 = 1100, 1: 500+10 = 510 -> 1; prompt only: 100 vs 500 -> 0
        ([res(100, 0, 1000)], [res(500, 0, 10)], True, 1),
        ([res(100, 0, 1000)], [res(500, 0, 10)], False, 0),
    ],
)
def test_least_outstanding_tokens(res0, res1, with_output, expected):
    p = make("least_outstanding_tokens", count_predicted_output=with_output)
    assert p.pick(req(50, 50), view(inst(0, *res0), inst(1, *res1))) == expected


def test_least_outstanding_tokens_differs_from_jsq():
    v = view(inst(0, res(1000, 900, 1000)), inst(1, *[res(300, 0, 200, state="waiting")] * 2))
    assert make("join_shortest_queue").pick(req(50, 50), v) == 0
    assert make("least_outstanding_tokens").pick(req(50, 50), v) == 1


# --- power_of_two_choices ----------------------------------------------------------------


def test_power_of_two_two_instances_is_jsq():
    # both are always sampled: JSQ loads 0 -> 300, 1 -> 120
    v = view(inst(0, res(200, 50, 250), res(100, 0, 0, state="waiting")), inst(1, res(100, 0, 20, state="prefill")))
    p = make("power_of_two_choices")
    assert {p.pick(req(10, 10), v) for _ in range(50)} == {1}


def test_power_of_two_never_picks_the_most_loaded():
    # JSQ loads 100, 50, 500: any pair holds a lighter one than 2; 0 wins only the pair (0, 2)
    v = view(inst(0, res(10, 0, 100, state="decode")), inst(1, res(10, 0, 50)), inst(2, res(10, 0, 500)), now=0.0)
    p = make("power_of_two_choices", seed=3, m=3)
    picks = [p.pick(req(10, 10), v) for _ in range(200)]
    assert 2 not in picks
    assert set(picks) == {0, 1}
    assert 30 < picks.count(0) < 110  # about 1/3 of 200


def test_power_of_two_single_instance():
    assert make("power_of_two_choices", m=1).pick(req(10, 10), view(inst(0))) == 0


# --- max_capacity_usage ------------------------------------------------------------------
# Instances of 100 blocks; the request p=160, pred=160 needs 320 tokens = 20 blocks.


def _mcu_view(now, used0=60, used1=20, extra1=()):
    return view(inst(0, total=100, used=used0), inst(1, *extra1, total=100, used=used1), now=now)


def test_max_capacity_usage_windows():
    p = make("max_capacity_usage")
    r = req(160, 160)
    # free 40 vs 80: the most free wins; the first decision opens the window at t=0
    assert p.pick(r, _mcu_view(0.0)) == 1
    assert p.pick(r, _mcu_view(0.0)) == 1  # same instant: keeps draining
    assert p.pick(r, _mcu_view(0.02)) is None  # between windows
    assert p.pick(r, _mcu_view(0.98)) is None
    assert p.pick(r, _mcu_view(1.01)) == 1  # next window (grid at 1 s)
    assert p.pick(r, _mcu_view(1.5)) is None


def test_max_capacity_usage_one_per_window():
    p = make("max_capacity_usage", max_per_interval=1, interval_s=0.5)
    r = req(160, 160)
    assert p.pick(r, _mcu_view(0.0)) == 1
    assert p.pick(r, _mcu_view(0.0)) is None
    assert p.pick(r, _mcu_view(0.5)) == 1


def test_max_capacity_usage_counts_waiting_demand():
    # instance 1: free 80 - a waiting prompt of 800 tokens (50 blocks) = 30 < 40 -> instance 0
    waiting = [res(800, 0, 10, state="waiting")]
    assert make("max_capacity_usage").pick(req(160, 160), _mcu_view(0.0, extra1=waiting)) == 0


def test_max_capacity_usage_holds_when_nothing_fits():
    p = make("max_capacity_usage")
    r = req(160, 160)
    # free 10 and 15 < 20 blocks: hold, even at the window
    assert p.pick(r, _mcu_view(0.0, used0=90, used1=85)) is None
    # room appears at 0.3 s, but the next window is at 1 s
    assert p.pick(r, _mcu_view(0.3)) is None
    assert p.pick(r, _mcu_view(1.0)) == 1


def test_max_capacity_usage_oversized_request_fits_an_empty_instance():
    # 4000+4000 capped at max_model_len 4096 = 256 blocks, capped at 100: only the empty one fits
    v = view(inst(0, total=100, used=1), inst(1, total=100, used=0))
    assert make("max_capacity_usage").pick(req(4000, 4000), v) == 1


# --- min_min -----------------------------------------------------------------------------
# Bucket upper edges (250, 1000, 4000): 0 -> 250, 1 -> 1000, 2 -> 4000, 3 -> 8000.


@pytest.mark.parametrize(
    "res0,res1,progress,expected",
    [
        # 0: 100+4000 = 4100; 1: 2*(100+250) = 700
        ([res(100, bucket=2)], [res(100, bucket=0), res(100, bucket=0)], False, 1),
        # 0: 100+1000 = 1100 whole, progress: 0 + (1000-900) = 100; 1: waiting 300+250 = 550 either way
        ([res(100, 900, bucket=1)], [res(300, bucket=0, state="waiting")], False, 1),
        ([res(100, 900, bucket=1)], [res(300, bucket=0, state="waiting")], True, 0),
        # no bucket: the point estimate. 0: 100+700 = 800; 1: 100+1000 = 1100
        ([res(100, pred=700)], [res(100, bucket=1)], False, 0),
    ],
)
def test_min_min(res0, res1, progress, expected):
    p = make("min_min", count_progress=progress)
    assert p.pick(req(50, 50, bucket=0), view(inst(0, *res0), inst(1, *res1))) == expected


# --- decode_balancer (oracle) ------------------------------------------------------------


def test_decode_balancer_uses_true_remaining_decode():
    # 0: 500-100 = 400; 1: 300 + (200-150) = 350 -> 1, though the predictions say otherwise
    v = view(
        inst(0, res(10, 100, pred=100, out=500)),
        inst(1, res(10, 0, pred=1000, out=300), res(10, 150, pred=1000, out=200)),
    )
    assert make("decode_balancer").pick(req(10, 10, out=10), v) == 1


def test_oracle_policies_refuse_plain_features():
    v = view(inst(0, res(10, 0, 10)), inst(1))
    with pytest.raises(TypeError, match="oracle"):
        make("decode_balancer").pick(req(10, 10), v)
    with pytest.raises(TypeError, match="oracle"):
        make("oracle").pick(req(10, 10), v)
    with pytest.raises(TypeError, match="oracle"):
        make("oracle").pick(req(10, 10, out=10), v)


# --- oracle -----------------------------------------------------------------------------


def test_oracle_is_jsq_with_true_lengths():
    # Predictions say instance 0 is nearly done (pred 110, generated 10 -> 100 tokens) and
    # instance 1 is long (pred 1000 -> 1000 tokens): JSQ picks 0.
    # Truth: 0 still has 2000 - 10 = 1990 decode tokens; 1 has 300 -> the oracle picks 1.
    v = view(
        inst(0, res(100, 10, pred=110, out=2000)),
        inst(1, res(100, 0, pred=1000, out=300)),
    )
    assert make("join_shortest_queue").pick(req(100, 11), v) == 0
    assert make("oracle").pick(req(100, 11, out=11), v) == 1
    # A waiting (preempted) request counts its recompute: 1 -> (100 + 50) + (300 - 50) = 400
    # vs 0 -> 390 (decoding, out 400, generated 10).
    v = view(
        inst(0, res(100, 10, pred=0, out=400)),
        inst(1, res(100, 50, pred=0, out=300, state="waiting")),
    )
    assert make("oracle").pick(req(1, 1, out=1), v) == 0


# --- queue_kv_scorer ---------------------------------------------------------------------


def _scorer_view():
    # waiting 4, 0, 2 -> queue scores 0, 1, 0.5; KV usage 0.5, 0.9, 0.2 -> KV scores 0.5, 0.1, 0.8
    return view(
        StaticInstanceView(0, num_waiting=4, kv_used_blocks=50, kv_total_blocks=100),
        StaticInstanceView(1, num_waiting=0, kv_used_blocks=90, kv_total_blocks=100),
        StaticInstanceView(2, num_waiting=2, kv_used_blocks=20, kv_total_blocks=100),
    )


@pytest.mark.parametrize(
    "weights,expected",
    [
        ({}, 2),  # 2*0 + 2*0.5 = 1.0; 2*1 + 2*0.1 = 2.2; 2*0.5 + 2*0.8 = 2.6
        ({"queue_weight": 4, "kv_weight": 1}, 1),  # 0.5; 4.1; 2.8
        ({"queue_weight": 0, "kv_weight": 1}, 2),  # 0.5; 0.1; 0.8
    ],
)
def test_queue_kv_scorer(weights, expected):
    assert make("queue_kv_scorer", m=3, **weights).pick(req(10, 10), _scorer_view()) == expected


def test_queue_kv_scorer_ties():
    # equal queues (neutral 1.0 each) and equal KV use: all tie
    v = view(*(StaticInstanceView(i, num_waiting=1, kv_used_blocks=10, kv_total_blocks=100) for i in range(3)))
    assert {make("queue_kv_scorer", m=3).pick(req(10, 10), v) for _ in range(5)} == {0}
    p = make("queue_kv_scorer", m=3, seed=1, tie_break="random")
    assert {p.pick(req(10, 10), v) for _ in range(100)} == {0, 1, 2}


# --- mixing_penalty ----------------------------------------------------------------------


def test_mixing_penalty_paper_example():
    # grad1 1e-4, grad2 1e-5, alpha 0.5, epsilon 0.1; new request p=100, d=50.
    # 0: [(200, 300)]: load 500, n 1. T_p = 1e-4*(100**2 + 500) = 1.05 > 0.1 -> r_p = 1/1.05 - 0.1 = 0.852381
    #    r_d = -1e-5*(500 + 1*150) = -0.0065 -> r = 0.5*0.852381 - 0.5*0.0065 = 0.4229405
    # 1: empty: T_p = 1.0 -> r_p = 0.9, r_d = 0 -> r = 0.45 -> 1
    v = view(inst(0, res(200, 0, 300)), inst(1))
    assert r_mixing(TOY, [(200, 300.0)], 100, 50) == pytest.approx(0.4229405, abs=1e-6)
    assert r_mixing(TOY, [], 100, 50) == pytest.approx(0.45)
    assert make("mixing_penalty").pick(req(100, 50), v) == 1


def test_mixing_penalty_paper_discontinuity_is_kept():
    # p=10, d=50. 0: empty: T_p = 1e-4*100 = 0.01 <= 0.1 -> r_p = 1 -> r = 0.5
    # 1: [(500, 500)]: T_p = 1e-4*(100 + 1000) = 0.11 -> r_p = 1/0.11 - 0.1 = 8.990909;
    #    r_d = -1e-5*(1000 + 60) = -0.0106 -> r = 4.4901545: the published form prefers the loaded one
    v = view(inst(0), inst(1, res(500, 0, 500)))
    assert r_mixing(TOY, [(500, 500.0)], 10, 50, MixingParams()) == pytest.approx(4.4901545, abs=1e-6)
    assert make("mixing_penalty").pick(req(10, 50), v) == 1
    # epsilon 0.2 removes the jump: T_p = 0.11 <= 0.2 -> r_p = 1 -> r = 0.5 - 0.0053 -> empty wins
    assert make("mixing_penalty", epsilon=0.2).pick(req(10, 50), v) == 0


def test_mixing_penalty_calibrated_example():
    # New request p=100, pred 11 -> n=10; t_pf(100) = 0.01.
    # 0: running p=1000 g=10 pred=110 -> c=1010, r=100, o=10; KV fits (70 of 1000 blocks committed).
    #    queue 0, prefill 0.01+0.01 = 0.02, stall 1*0.01
    #    decode 10*(0.011) + 1e-3*10 + 1e-6*(1045 + 10*1010 + 45) = 0.13119
    #    slow 10*(1e-3 + 1e-6*(100 + 4.5)) = 0.011045
    #    cost = 2*(0.5*0.03 + 0.5*0.142235) = 0.172235
    # 1: two waiting p=1500 pred=5 -> c=1500, r=5, o=5
    #    queue 2*0.15 = 0.3, prefill 0.02, stall 0
    #    decode 0.11 + 1e-3*10 + 1e-6*(1045 + 2*(7500+10)) = 0.136065
    #    slow 2*5*(1e-3 + 1e-6*102) = 0.01102
    #    cost = 0.32 + 0.147085 = 0.467085 -> 0
    i0 = inst(0, res(1000, 10, 110))
    i1 = inst(1, *[res(1500, 0, 5, state="waiting")] * 2)
    p = make("mixing_penalty", variant="calibrated")
    assert isinstance(p, MixingPenalty)
    r = req(100, 11)
    assert p.added_latency_s(r, i0) == pytest.approx(0.172235)
    assert p.added_latency_s(r, i1) == pytest.approx(0.467085)
    assert p.pick(r, view(i0, i1)) == 0


def test_mixing_penalty_calibrated_kv_wait():
    # 100 blocks. Running A: p=790 g=10 pred=410 -> footprint 1200 = 75 blocks, r=400;
    # B: p=190 g=10 pred=110 -> footprint 300 = 19 blocks, r=100. Committed 94, free 6.
    # New p=100 pred=100 -> 200 tokens = 13 blocks: short by 7. B frees 19 after 100 iterations of
    # decode_time(2, 1000) = 0.01 + 0.002 + 0.001 = 0.013 s -> wait 1.3 s, weighted 2*alpha = 1.
    a, b = res(790, 10, 410), res(190, 10, 110)
    p = make("mixing_penalty", variant="calibrated")
    r = req(100, 100)
    small = p.added_latency_s(r, inst(0, a, b, total=100))
    big = p.added_latency_s(r, inst(0, a, b, total=1000))
    assert small - big == pytest.approx(1.3)


# --- late_binding ------------------------------------------------------------------------
# Instances of 100 blocks; reserve 5% -> 95 usable. New request p=100 pred=100 -> 13 blocks.


def test_late_binding_holds_when_full():
    # each: footprint 1000+500 = 1500 tokens = 94 blocks committed -> headroom 1 < 13
    full = res(1000, 100, 500)
    v = view(inst(0, full, total=100), inst(1, full, total=100))
    assert make("late_binding", account_growth=True).pick(req(100, 100), v) is None
    # without growth: used = blocks(1100) = 69 each -> headroom 26 >= 13 -> instance 0
    assert make("late_binding").pick(req(100, 100), v) == 0


def test_late_binding_picks_least_work_among_fitting():
    full = res(1000, 100, 500)  # JSQ work 400, does not fit
    roomy = res(700, 0, 100)  # footprint 800 = 50 blocks, headroom 45; JSQ work 100
    roomier = res(300, 0, 300)  # footprint 600 = 38 blocks, headroom 57; JSQ work 300
    v = view(inst(0, full, total=100), inst(1, roomier, total=100), inst(2, roomy, total=100))
    assert make("late_binding", m=3).pick(req(100, 100), v) == 2


@pytest.mark.parametrize(
    "params,expected",
    [
        ({"account_growth": True}, None),
        # without growth (the default): used = blocks(1100) = 69 -> headroom 95-69 = 26 >= 13
        ({"account_growth": False}, 0),
    ],
)
def test_late_binding_growth(params, expected):
    v = view(inst(0, res(1000, 100, 500), total=100))
    assert make("late_binding", m=1, **params).pick(req(100, 100), v) == expected


@pytest.mark.parametrize("reserve,expected", [(0.05, None), (0.0, 0)])
def test_late_binding_reserve(reserve, expected):
    # footprint 1000+360 = 1360 = 85 blocks: headroom 95-85 = 10 < 13, or 100-85 = 15 >= 13
    v = view(inst(0, res(1000, 0, 360), total=100))
    p = make("late_binding", m=1, reserve_fraction=reserve, account_growth=True)
    assert p.pick(req(100, 100), v) == expected


@pytest.mark.parametrize("max_waiting,expected", [(0, None), (1, 0)])
def test_late_binding_waiting_cap(max_waiting, expected):
    v = view(inst(0, res(100, 0, 100, state="waiting"), total=100))
    assert make("late_binding", m=1, max_waiting=max_waiting).pick(req(100, 100), v) == expected


def test_late_binding_respects_max_num_seqs():
    # TOY.max_num_seqs = 4: four small running requests leave no seat
    v = view(inst(0, *[res(10, 1, 10)] * 4, total=100), inst(1, res(10, 1, 10), total=100))
    assert make("late_binding").pick(req(100, 100), v) == 1


def test_late_binding_oversized_request_goes_to_an_empty_instance():
    # 4000+4000 -> capped 4096 tokens = 256 blocks -> capped at 95 usable: only the empty one fits
    v = view(inst(0, res(10, 1, 10), total=100), inst(1, total=100))
    assert make("late_binding").pick(req(4000, 4000), v) == 1


# --- determinism ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["random", "power_of_two_choices", "queue_kv_scorer"])
def test_same_seed_same_picks(name):
    params = {"tie_break": "random"} if name == "queue_kv_scorer" else {}
    views = [
        view(*(StaticInstanceView(i, num_waiting=k % 2, kv_total_blocks=100) for i in range(4)), now=k * 0.02)
        for k in range(50)
    ]
    runs = []
    for _ in range(2):
        p = make(name, seed=42, m=4, **params)
        runs.append([p.pick(req(10, 10), v) for v in views])
    assert runs[0] == runs[1]


# --- registry ---------------------------------------------------------------------------


def test_parse_policy_spec():
    assert parse_policy_spec("round_robin") == ("round_robin", {})
    assert parse_policy_spec("max_capacity_usage: interval_s=0.5, max_per_interval=None") == (
        "max_capacity_usage",
        {"interval_s": "0.5", "max_per_interval": None},
    )
    for bad in ("", ":a=1", "x:a", "x:=1", "x:a=1,a=2"):
        with pytest.raises(PolicyError):
            parse_policy_spec(bad)


def test_build_policy_from_spec_converts_types():
    ctx = PolicyContext(profile=TOY, num_instances=2)
    p = build_policy_from_spec("late_binding:reserve_fraction=0.1,max_waiting=2,account_growth=false", ctx)
    assert (p.params.reserve_fraction, p.params.max_waiting, p.params.account_growth) == (0.1, 2, False)


def test_registry_errors_name_policy_and_field():
    ctx = PolicyContext(profile=TOY, num_instances=2)
    with pytest.raises(PolicyError, match="unknown policy 'nope'.*round_robin.*late_binding"):
        build_policy("nope", None, ctx)
    with pytest.raises(PolicyError, match="'max_capacity_usage': field interval_s"):
        build_policy("max_capacity_usage", {"interval_s": "-1"}, ctx)
    with pytest.raises(PolicyError, match="'late_binding': field resrve"):
        build_policy("late_binding", {"resrve": 0.1}, ctx)
    with pytest.raises(PolicyError, match="'mixing_penalty': field variant"):
        build_policy("mixing_penalty", {"variant": "magic"}, ctx)
    with pytest.raises(PolicyError) as e:
        build_policy("round_robin", {"x": 1}, ctx)
    assert "\n" not in str(e.value)


def test_policy_names_match_classes():
    from routerd.policies import POLICIES

    assert policy_names() == list(POLICIES)
    assert all(POLICIES[n].name == n for n in policy_names())


# --- near-ties (PolicyContext.near_tie, routerd's router.near_tie; issue 15) -------------------

# Work per instance (JSQ's outstanding tokens, by hand: a decoding resident's remaining
# predicted output): 100, 104, 120 tokens. Within 5% of 100: instances 0 and 1; 120 never.
NEAR = [res(10, 0, 100.0), res(10, 0, 104.0), res(10, 0, 120.0)]


@pytest.mark.parametrize("name", ["join_shortest_queue", "least_outstanding_tokens", "late_binding"])
@pytest.mark.parametrize("near_tie, allowed", [(0.0, {0}), (0.05, {0, 1}), (0.25, {0, 1, 2})])
def test_near_ties_pick_at_random_within_the_relative_width(name, near_tie, allowed):
    # least_outstanding_tokens counts prompt + predicted output: 110, 114, 130 -> the same sets
    # (4/110 = 3.6% <= 5%; 20/110 = 18% <= 25%).
    picks = set()
    for seed in range(40):
        pol = build_policy(name, {}, PolicyContext(profile=TOY, num_instances=3, seed=seed, near_tie=near_tie))
        picks.add(pol.pick(req(50, 50), view(*(inst(i, r) for i, r in enumerate(NEAR)))))
    assert picks == allowed


def test_near_ties_are_reproducible_for_a_seed():
    def seq(seed):
        pol = build_policy("join_shortest_queue", {},
                           PolicyContext(profile=TOY, num_instances=3, seed=seed, near_tie=0.05))
        return [pol.pick(req(50, 50), view(*(inst(i, r) for i, r in enumerate(NEAR)))) for _ in range(30)]

    assert seq(3) == seq(3) and set(seq(3)) == {0, 1}


def test_pick_near_best_zero_width_is_the_first_lowest():
    import random

    from routerd.policies.base import pick_near_best

    rng = random.Random(0)
    assert pick_near_best([(5.0, 2), (3.0, 0), (3.0, 1)], 0.0, rng) == 0  # first lowest in view order
    assert pick_near_best([], 0.3, rng) is None
    assert {pick_near_best([(0.0, 4), (0.0, 7), (1e-3, 9)], 0.5, rng) for _ in range(50)} == {4, 7}  # 0 * 1.5
