"""Table tests of the router-side prefix index and the anchors' cache-aware policies.

Expected picks and scores are computed by hand in the comments. Prefixes are hand-made
:class:`PrefixBlocks` (extent hashes are small integers), block size 16. ``Eng`` is an instance
view with the two optional methods the simulator offers (``engine_cached_blocks`` and
``pending_prefill_tokens``); plain :class:`StaticInstanceView` has neither, so the fallbacks run.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest

from test_policies import TOY, inst, make, req, res, view

from routerd.policies import ClusterView, RequestFeatures, StaticInstanceView
from routerd.prefix.chain import PrefixBlocks
from routerd.prefix.index import PrefixIndex, cached_blocks, engine_cached_blocks, pending_prefill_tokens


def pb(*extents):
    return PrefixBlocks(tuple(extents), sum(n for _, n in extents))


P = pb((1, 4), (2, 2), (3, 4))  # 10 blocks = 160 tokens
P8 = pb((1, 4), (2, 2), (3, 2))  # the first 8 blocks of P = 128 tokens


def preq(prompt, prefix, now=0.0):
    return RequestFeatures(
        id=0, arrival_s=now, prompt_tokens=prompt, predicted_bucket=None, predicted_output_tokens=50.0, prefix=prefix
    )


@dataclass(slots=True)
class Eng(StaticInstanceView):
    """A view whose engine reports cached blocks (KV events) and pending prefill tokens."""

    cached: int | None = 0
    pending: int = 0
    calls: list = field(default_factory=list)

    def engine_cached_blocks(self, prefix):
        self.calls.append(prefix)
        return self.cached

    def pending_prefill_tokens(self):
        return self.pending


def cv(*instances, now=0.0):
    return ClusterView(now=now, instances=list(instances), queue_len=1)


# --- the index --------------------------------------------------------------------------------


def test_index_match_by_hand():
    ix = PrefixIndex()
    ix.insert(0, pb((1, 4), (2, 2)), 0.0)
    assert ix.match(0, pb((1, 4), (3, 5))) == 4  # diverges after extent 1
    assert ix.match(0, pb((1, 2))) == 2  # shorter extent of the same hash: a prefix
    assert ix.match(0, pb((1, 4), (2, 1))) == 5
    assert ix.match(0, pb((1, 4), (2, 6), (9, 3))) == 6  # only 2 blocks of extent 2 are known
    assert ix.match(1, pb((1, 4))) == 0 and ix.match(0, None) == 0
    # A longer insert of the same extent grows it; a shorter one does not shrink it.
    ix.insert(0, pb((1, 4), (2, 5)), 1.0)
    ix.insert(0, pb((1, 4), (2, 1)), 2.0)
    assert ix.match(0, pb((1, 4), (2, 9))) == 9 and ix.size(0) == 9


def test_index_lru_eviction_by_hand():
    ix = PrefixIndex(8)
    ix.insert(0, pb((1, 4), (2, 2)), 0.0)  # tail touched first: LRU order [(2,2), (1,4)], 6 blocks
    assert ix.entries(0) == [(2, 2), (1, 4)]
    ix.insert(0, pb((1, 4), (5, 3)), 1.0)  # order [(2,2), (5,3), (1,4)], 9 > 8: trim 1 from (2,2)
    assert ix.entries(0) == [(2, 1), (5, 3), (1, 4)] and ix.size(0) == 8
    assert ix.match(0, pb((1, 4), (2, 2))) == 5
    assert ix.match(0, pb((1, 4), (5, 3))) == 7
    ix.insert(0, pb((7, 6)), 2.0)  # 14 blocks: drop (2,1) and (5,3), trim (1,4) to (1,2)
    assert ix.entries(0) == [(1, 2), (7, 6)] and ix.size(0) == 8
    assert ix.match(0, pb((1, 4), (2, 2))) == 2
    # Other instances are independent.
    assert ix.size(1) == 0


def test_index_capacity_per_instance_and_request_cap():
    ix = PrefixIndex(100, max_blocks_per_request=5)
    ix.insert(0, pb((1, 4), (2, 3)), 0.0)  # stores (1,4) and the first block of (2,3)
    assert ix.entries(0) == [(2, 1), (1, 4)]
    assert ix.match(0, pb((1, 4), (2, 3))) == 5
    ix.set_capacity(1, 3)
    ix.insert(1, pb((1, 4), (2, 3)), 0.0)  # 5 blocks under capacity 3: (2,1) dropped, (1,4) -> (1,3)
    assert ix.entries(1) == [(1, 3)]
    with pytest.raises(ValueError, match="capacity_blocks"):
        PrefixIndex(0)


def test_index_periodic_sweeps_and_ttl():
    ix = PrefixIndex(4, eviction_interval_s=10.0)
    ix.insert(0, pb((1, 6)), 1.0)
    assert ix.size(0) == 6  # no eviction between sweeps
    ix.advance(9.9)
    assert ix.match(0, pb((1, 6))) == 6
    ix.advance(10.0)  # the sweep at t = 10
    assert ix.match(0, pb((1, 6))) == 4
    ix.insert(0, pb((1, 6)), 12.0)
    ix.advance(19.0)
    assert ix.size(0) == 6
    ix.advance(35.0)  # sweeps at 20 and 30 are one sweep: nothing was inserted in between
    assert ix.size(0) == 4

    tx = PrefixIndex(ttl_s=5.0)
    tx.insert(0, pb((1, 2)), 0.0)
    tx.insert(0, pb((8, 3)), 3.0)
    tx.advance(5.0)  # (1,2) was last touched at 0 <= 5 - 5
    assert tx.entries(0) == [(8, 3)]
    tx.insert(0, pb((8, 3)), 6.0)  # refreshed
    tx.advance(10.0)
    assert tx.entries(0) == [(8, 3)]
    tx.advance(11.0)
    assert tx.entries(0) == []


def test_view_helpers_fall_back():
    plain = inst(0, res(100, state="prefill"), res(40, state="waiting"), res(500, 10))
    assert pending_prefill_tokens(plain) == 140  # prefill + waiting prompts, not the decoding one
    assert engine_cached_blocks(plain, P) is None
    e = Eng(0, cached=99, pending=7)
    assert pending_prefill_tokens(e) == 7
    assert engine_cached_blocks(e, P) == 10  # clamped to the prompt's blocks
    ix = PrefixIndex()
    ix.insert(0, P8, 0.0)
    assert cached_blocks(plain, P8, ix, "precise") == 8  # no KV events: the index answers
    assert cached_blocks(e, P8, ix, "approximate") == 8
    assert cached_blocks(Eng(0, cached=3), P8, ix, "precise") == 3
    stale = Eng(0, cached=None)  # a view whose event index is stale answers None
    assert engine_cached_blocks(stale, P8) is None
    assert cached_blocks(stale, P8, ix, "precise") == 8  # the approximate index answers for it


# --- llmd --------------------------------------------------------------------------------------


def llmd_view():
    # waiting 0 / 2 / 4 -> queue 1 / 0.5 / 0; KV usage 0.5 / 0 / 0.25 -> kv 0.5 / 1 / 0.75
    return view(
        StaticInstanceView(0, num_waiting=0, kv_used_blocks=500, kv_total_blocks=1000),
        StaticInstanceView(1, num_waiting=2, kv_used_blocks=0, kv_total_blocks=1000),
        StaticInstanceView(2, num_waiting=4, kv_used_blocks=250, kv_total_blocks=1000),
    )


@pytest.mark.parametrize(
    "primed,expected",
    [
        # 0: 2*1 + 2*0.5 + 0 = 3.0; 1: 2*0.5 + 2*1 + 3*8/8 = 6.0; 2: 0 + 1.5 + 0 = 1.5
        (P8, 1),
        # 1 with 4 of 8 blocks: 1 + 2 + 1.5 = 4.5 > 3.0
        (pb((1, 4)), 1),
        # 2 is primed instead: 0 + 1.5 + 3 = 4.5 > 3.0 = instance 0 = instance 1 (0.5*2+2)
        (None, 2),
    ],
)
def test_llmd_scores(primed, expected):
    p = make("llmd", m=3)
    if primed is None:
        p.index.insert(2, P8, 0.0)
    else:
        p.index.insert(1, primed, 0.0)
    assert p.pick(preq(128, P8), llmd_view()) == expected
    assert p.index.match(expected, P8) == 8  # the dispatch is recorded on the chosen instance


def test_llmd_partial_match_loses_to_load():
    # 0: waiting 0, KV 0 -> 2 + 2 = 4.0; 1: waiting 4, KV 0, half match -> 0 + 2 + 1.5 = 3.5
    p = make("llmd", m=2)
    p.index.insert(1, pb((1, 4)), 0.0)
    v = view(StaticInstanceView(0, kv_total_blocks=100), StaticInstanceView(1, num_waiting=4, kv_total_blocks=100))
    assert p.pick(preq(128, P8), v) == 0
    # With a 64-token cap only the first 4 blocks count: 1 scores 0 + 2 + 3*4/4 = 5.0 > 4.0
    q = make("llmd", m=2, max_prefix_tokens=64)
    q.index.insert(1, pb((1, 4)), 0.0)
    assert q.pick(preq(128, P8), v) == 1


def test_llmd_autotune_capacity_and_precise_mode():
    p = make("llmd", m=1)
    p.pick(preq(160, P), view(StaticInstanceView(0, kv_total_blocks=6)))
    assert p.index.size(0) == 6  # LRU sized from the instance's 6 GPU blocks
    fixed = make("llmd", m=1, lru_capacity_blocks=3)
    fixed.pick(preq(160, P), view(StaticInstanceView(0, kv_total_blocks=6)))
    assert fixed.index.size(0) == 3
    # Precise: the engine says 1 has all 8 blocks; the router's own history knows nothing.
    a = Eng(0, kv_total_blocks=100)
    b = Eng(1, num_waiting=4, kv_total_blocks=100, cached=8)  # 0 + 2 + 3 = 5.0 > 4.0
    assert make("llmd", m=2, prefix_source="precise").pick(preq(128, P8), view(a, b)) == 1
    assert make("llmd", m=2).pick(preq(128, P8), view(a, b)) == 0


def test_llmd_without_prefix_is_queue_kv_scorer_with_random_ties():
    rng = random.Random(3)
    p = make("llmd", seed=11, m=3)
    q = make("queue_kv_scorer", seed=11, m=3, tie_break="random")
    for _ in range(200):
        v = view(*[StaticInstanceView(i, num_waiting=rng.randrange(3), kv_used_blocks=rng.choice([0, 5, 10]),
                                      kv_total_blocks=10) for i in range(3)])
        assert p.pick(req(100, 50), v) == q.pick(req(100, 50), v)
    assert p.index.size(0) == p.index.size(1) == p.index.size(2) == 0


# --- sglang_cache_aware ---------------------------------------------------------------------------


def sg_view(*loads, now=0.0):
    return cv(*[StaticInstanceView(i, num_running=n, kv_total_blocks=100) for i, n in enumerate(loads)], now=now)


@pytest.mark.parametrize(
    "loads,primed,expected",
    [
        # balanced (diff 3 <= 64); 8 blocks of a 160-token prompt match on 0: 128/160 = 0.8 > 0.3
        ((3, 0), P8, 0),
        # match 2 blocks: 32/160 = 0.2 <= 0.3 -> least loaded
        ((3, 0), pb((1, 2)), 1),
        # diff 65 > 64 and 70 > 1.5*5: imbalanced -> least loaded despite the match
        ((70, 5), P8, 1),
        # diff 64 is not > 64: balanced -> cache
        ((70, 6), P8, 0),
        # diff 66 > 64 but 200 <= 1.5*134 = 201: balanced -> cache
        ((200, 134), P8, 0),
    ],
)
def test_sglang_decisions(loads, primed, expected):
    p = make("sglang_cache_aware", m=2)
    p.index.insert(0, primed, 0.0)
    assert p.pick(preq(160, P), sg_view(*loads)) == expected
    assert p.index.match(expected, P) == 10  # the text always goes into the chosen tree


def test_sglang_defaults_and_periodic_eviction():
    py = make("sglang_cache_aware", m=2)
    assert (py.cache_threshold, py.balance_abs, py.balance_rel) == (0.3, 64, 1.5)
    assert py.capacity_blocks == 2**26 // 64  # chars / (4 chars/token * 16 tokens/block)
    rs = make("sglang_cache_aware", m=2, defaults="rust")
    assert (rs.cache_threshold, rs.balance_abs, rs.balance_rel) == (0.5, 32, 1.1)
    assert rs.capacity_blocks == 156  # 10,000 / 64
    big = pb((5, 200))
    rs.pick(preq(3200, big), sg_view(0, 0, now=0.0))  # empty trees: least loaded, 0
    assert rs.index.match(0, big) == 200  # over capacity until the next sweep
    rs.pick(preq(10, None), sg_view(0, 0, now=29.0))
    assert rs.index.match(0, big) == 200
    rs.pick(preq(10, None), sg_view(0, 0, now=30.0))  # the sweep at 30 s
    assert rs.index.match(0, big) == 156
    over = make("sglang_cache_aware", m=2, defaults="rust", cache_threshold=0.9)
    assert over.cache_threshold == 0.9 and over.balance_abs == 32


def test_sglang_without_prefix_is_least_loaded():
    p = make("sglang_cache_aware", m=3)
    assert p.pick(preq(160, None), sg_view(2, 1, 1)) == 1  # lowest index among the least loaded
    assert p.pick(preq(160, None), sg_view(100, 0, 3)) == 1


def test_sglang_equal_best_matches_are_seeded_random():
    picks = []
    for seed in range(20):
        p = make("sglang_cache_aware", seed=seed, m=2)
        p.index.insert(0, P8, 0.0)
        p.index.insert(1, P8, 0.0)
        picks.append(p.pick(preq(160, P), sg_view(0, 0)))
    assert set(picks) == {0, 1}
    again = make("sglang_cache_aware", seed=4, m=2)
    again.index.insert(0, P8, 0.0)
    again.index.insert(1, P8, 0.0)
    assert again.pick(preq(160, P), sg_view(0, 0)) == picks[4]


# --- dynamo_kv -------------------------------------------------------------------------------------


def test_dynamo_cost_by_hand():
    # Prompt 160 tokens = 10 blocks.
    # 0: cached 8, used 100, pending 0:   prefill max(0, 160/16 - 8) = 2, decode 100 + 2 = 102 -> 104
    # 1: cached 0, used 50, pending 320:  prefill (320+160)/16 = 30,      decode 50 + 10 = 60 -> 90
    a = Eng(0, kv_used_blocks=100, kv_total_blocks=1000, cached=8)
    b = Eng(1, kv_used_blocks=50, kv_total_blocks=1000, pending=320)
    p = make("dynamo_kv", m=2)
    assert p.costs(preq(160, P), cv(a, b)) == [104.0, 90.0]
    assert p.pick(preq(160, P), cv(a, b)) == 1
    # 1 with 80 used: 30 + 90 = 120 > 104
    b80 = Eng(1, kv_used_blocks=80, kv_total_blocks=1000, pending=320)
    assert p.pick(preq(160, P), cv(a, b80)) == 0
    # Half credit: 0 -> max(0, 10 - 4) + 102 = 108; scale 2 on 1 -> 2*30 + 60 = 120 vs 0: 2*6 + 102 = 114
    assert make("dynamo_kv", m=2, overlap_score_credit=0.5).costs(preq(160, P), cv(a, b)) == [108.0, 90.0]
    assert make("dynamo_kv", m=2, overlap_score_credit=0.5, prefill_load_scale=2.0).costs(
        preq(160, P), cv(a, b)) == [114.0, 120.0]
    # 10 blocks per active request: 0 has 3 running -> 104 + 30 = 134; 1 none -> 90
    a3 = Eng(0, num_running=3, kv_used_blocks=100, kv_total_blocks=1000, cached=8)
    assert make("dynamo_kv", m=2, decode_active_request_weight=10.0).costs(preq(160, P), cv(a3, b)) == [134.0, 90.0]


def test_dynamo_approximate_and_fallback():
    # No KV events on plain views: the router's index answers even in precise mode.
    a = StaticInstanceView(0, kv_used_blocks=100, kv_total_blocks=1000)
    b = StaticInstanceView(1, kv_used_blocks=95, kv_total_blocks=1000)
    p = make("dynamo_kv", m=2)
    p.index.insert(0, P8, 0.0)
    # 0: prefill 10 - 8 = 2, decode 100 + 2 -> 104; 1: prefill 10, decode 95 + 10 -> 115
    assert p.costs(preq(160, P), cv(a, b)) == [104.0, 115.0]
    # The approximate entry expires 120 s after its dispatch: then 0 -> 10 + 110 = 120 > 115
    assert p.pick(preq(160, P), cv(a, b, now=120.0)) == 1
    # Approximate mode ignores the engine's report.
    e = Eng(0, kv_used_blocks=100, kv_total_blocks=1000, cached=8)
    q = make("dynamo_kv", m=2, prefix_source="approximate")
    assert q.costs(preq(160, P), cv(e, b)) == [120.0, 115.0] and e.calls == []


def test_dynamo_without_prefix_and_ties():
    # 0: 200/16 = 12.5 prefill + 10 + 12 blocks = 34.5; 1: 12.5 + 30 + 12 = 54.5
    a = StaticInstanceView(0, kv_used_blocks=10, kv_total_blocks=100)
    b = StaticInstanceView(1, kv_used_blocks=30, kv_total_blocks=100)
    p = make("dynamo_kv", m=2)
    assert p.costs(preq(200, None), cv(a, b)) == [34.5, 54.5]
    assert p.pick(preq(200, None), cv(a, b)) == 0
    # Equal costs: seeded uniform ties.
    a1 = StaticInstanceView(1, kv_used_blocks=10, kv_total_blocks=100)
    picks = [make("dynamo_kv", seed=s, m=2).pick(preq(200, None), cv(a, a1)) for s in range(30)]
    assert set(picks) == {0, 1}


def test_dynamo_temperature_samples_the_softmax():
    # costs 34.5 and 35.5 normalise to 0 and 1: p(0) = 1 / (1 + e^-1) = 0.731 at T = 1
    a = StaticInstanceView(0, kv_used_blocks=10, kv_total_blocks=100)
    b = StaticInstanceView(1, kv_used_blocks=11, kv_total_blocks=100)
    p = make("dynamo_kv", seed=5, m=2, router_temperature=1.0)
    n = 4000
    zeros = sum(p.pick(preq(200, None), cv(a, b)) == 0 for _ in range(n))
    expect = 1.0 / (1.0 + math.exp(-1.0))
    assert abs(zeros / n - expect) < 4 * math.sqrt(expect * (1 - expect) / n)


# --- lmetric ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "running0,pending1,expected",
    [
        # 0: cached 8 blocks = 128 of 160 -> new 32, (0 + 32) * (3 + 1) = 128; 1: 160 * 1 = 160
        (3, 0, 0),
        # 0 with 4 running: 32 * 5 = 160 = 1's 160: the lower load wins
        (4, 0, 1),
        # 0 with 9 running: 32 * 10 = 320 > 160
        (9, 0, 1),
        # 1 has 100 tokens queued for prefill: (100 + 160) * 1 = 260 < 320
        (9, 100, 1),
        (9, 200, 0),  # (200 + 160) * 1 = 360 > 320
    ],
)
def test_lmetric_scores(running0, pending1, expected):
    a = Eng(0, num_running=running0, kv_total_blocks=100, cached=8)
    b = Eng(1, kv_total_blocks=100, pending=pending1)
    p = make("lmetric", m=2, prefix_source="precise")
    assert p.pick(preq(160, P), cv(a, b)) == expected


def test_lmetric_approximate_index_and_fallback_backlog():
    # Plain views: backlog = prompts of residents in prefill; cached from the router's history.
    a = inst(0, res(500, 10), res(300, 0, state="waiting"))  # 2 in flight, 300 queued prefill tokens
    b = inst(1, res(100, 10))  # 1 in flight, nothing to prefill
    p = make("lmetric", m=2)
    p.index.insert(0, P8, 0.0)
    # 0: (300 + 32) * 3 = 996; 1: (0 + 160) * 2 = 320
    assert p.scores(preq(160, P), view(a, b)) == [(996, 2, 32, 0), (320, 1, 160, 1)]
    assert p.pick(preq(160, P), view(a, b)) == 1
    assert p.index.match(1, P) == 10
    # The next identical prompt on 1: (0 + 0) * 2 = 0
    assert p.scores(preq(160, P), view(a, b))[1][0] == 0


def test_lmetric_without_prefix_is_load_times_work():
    # 0: (0 + 100) * (1 + 1) = 200; 1: (100 + 100) * 1 = 200 -> tie on score, 1 has less load
    a = Eng(0, num_running=1, kv_total_blocks=10)
    b = Eng(1, kv_total_blocks=10, pending=100)
    p = make("lmetric", m=2)
    assert p.pick(preq(100, None), cv(a, b)) == 1
    assert p.index.size(0) == p.index.size(1) == 0


def test_all_prefix_policies_handle_a_prefix_and_none_in_turn():
    for name in ("llmd", "sglang_cache_aware", "dynamo_kv", "lmetric"):
        p = make(name, m=2)
        for t, prefix in enumerate([P, None, P8, None, P]):
            v = view(inst(0, res(100, 5)), inst(1), now=float(t))
            assert p.pick(preq(160, prefix, now=float(t)), v) in (0, 1)
    assert TOY.block_size == 16
