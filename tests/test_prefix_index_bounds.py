"""The approximate prefix index as routerd uses it: a hard bound per instance, entries dropped or
renumbered when endpoints leave, and the match at insert that routerd's metric observes.

Hand-made prefixes (small integer extent hashes) as in ``test_policies_prefix.py``; expected
values by hand in the comments, the match at insert checked against :meth:`PrefixIndex.match`
(an independent walk, ``chain.matched_blocks``) on random histories.
"""

from __future__ import annotations

import random

import pytest

from routerd.prefix.chain import PrefixBlocks
from routerd.prefix.index import PrefixIndex
from routerd.prefix.text import text_prefix_blocks


def pb(*extents):
    return PrefixBlocks(tuple(extents), sum(n for _, n in extents))


def test_forget_drops_one_instance_only():
    ix = PrefixIndex(100)
    ix.insert(0, pb((1, 4), (2, 2)), 0.0)
    ix.insert(1, pb((1, 4)), 0.0)
    ix.set_capacity(2, 7)
    assert ix.forget(0) == 6
    assert ix.match(0, pb((1, 4), (2, 2))) == 0 and ix.size(0) == 0 and not ix.has_instance(0)
    assert ix.match(1, pb((1, 4))) == 4
    assert ix.forget(2) == 0 and not ix.has_instance(2)  # its capacity went with it
    assert ix.forget(9) == 0


def test_renumber_moves_entries_and_forgets_the_unmapped():
    ix = PrefixIndex()
    for i in range(3):
        ix.insert(i, pb((10 + i, 3)), 0.0)
    # Endpoint 1 left: 0 stays, 2 becomes 1; a new endpoint at index 2 starts empty.
    ix.renumber({0: 0, 2: 1})
    assert ix.match(0, pb((10, 3))) == 3
    assert ix.match(1, pb((12, 3))) == 3 and ix.match(1, pb((11, 3))) == 0
    assert ix.match(2, pb((12, 3))) == 0 and ix.size(2) == 0
    assert sorted(ix.instances()) == [0, 1]
    with pytest.raises(ValueError, match="two instances"):
        ix.renumber({0: 0, 1: 0})


def test_limit_clamps_every_capacity_and_evicts_now():
    ix = PrefixIndex(None)
    ix.insert(0, pb((1, 6), (2, 6)), 0.0)  # 12 blocks, unbounded
    ix.limit_capacity(8)
    assert ix.size(0) == 8 and ix.entries(0) == [(2, 2), (1, 6)]  # the tail extent trimmed first
    ix.set_capacity(1, 50)  # a policy asking for more gets the limit
    ix.insert(1, pb((3, 20)), 0.0)
    assert ix.size(1) == 8
    ix.set_capacity(1, 5)  # less than the limit is kept
    assert ix.size(1) == 5
    with pytest.raises(ValueError, match="limit"):
        ix.limit_capacity(0)


def test_limit_holds_between_periodic_sweeps():
    # SGLang's index grows past its capacity between sweeps; routerd's limit does not let it.
    ix = PrefixIndex(1_000, eviction_interval_s=60.0)
    ix.limit_capacity(10)
    for k in range(5):
        ix.insert(0, pb((100 + k, 4)), float(k))
        assert ix.size(0) <= 10
    assert ix.size(0) == 10 and ix.entries(0)[-1] == (104, 4)  # the newest kept whole


@pytest.mark.parametrize("periodic", [False, True])
def test_unique_prompt_stream_never_exceeds_the_bound(periodic):
    # A stream of unique prompts (distinct text from the first byte) of 1-64 blocks, as routerd
    # hashes them: no instance's size ever passes the bound, and each reaches it.
    bound = 500
    ix = PrefixIndex(None if not periodic else 10**9, eviction_interval_s=30.0 if periodic else None)
    ix.limit_capacity(bound)
    rng = random.Random(3)
    peak = [0, 0, 0, 0]
    for k in range(2_000):
        text = f"{k:08d} " + "x" * rng.randrange(60, 64 * 64)
        i = k % 4
        ix.insert(i, text_prefix_blocks(text, 16), k * 0.01)
        peak[i] = max(peak[i], ix.size(i))
        assert ix.size(i) <= bound
    assert peak == [bound] * 4


def test_match_at_insert_equals_match_before_insert():
    rng = random.Random(11)
    ix = PrefixIndex(60, max_blocks_per_request=25)
    ix.last_insert = None
    # Prompts share chains: extent hashes drawn from a small trie so that matches are partial;
    # a chain hash names its whole prefix, so its blocks are the key's (1-5).
    for t in range(3_000):
        depth = rng.randrange(1, 14)
        ext, h = [], 0
        for _ in range(depth):
            h = h * 3 + rng.randrange(3) + 1
            ext.append((h, h % 5 + 1))
        p = pb(*ext)
        i = rng.randrange(3)
        expect = ix.match(i, p)
        ix.insert(i, p, float(t))
        inst, matched, inserted = ix.last_insert
        assert (inst, matched, inserted) == (i, expect, min(p.num_blocks, 25)), (t, p)


def test_last_insert_by_hand():
    ix = PrefixIndex()
    ix.insert(0, pb((1, 4), (2, 2)), 0.0)
    assert ix.last_insert == (0, 0, 6)
    ix.insert(0, pb((1, 4), (2, 5), (3, 1)), 1.0)  # (1,4) whole, 2 of (2,5), then a miss
    assert ix.last_insert == (0, 6, 10)
    ix.insert(0, pb((1, 4), (2, 5)), 2.0)
    assert ix.last_insert == (0, 9, 9)
    ix.last_insert = None
    ix.insert(0, None, 3.0)
    ix.insert(0, pb(), 3.0)
    assert ix.last_insert is None  # nothing to insert: nothing observed


@pytest.mark.parametrize("seed", range(4))
def test_galloping_match_equals_the_linear_walk_on_random_histories(seed):
    # Long prompts (the galloping path: more than 8 extents) of unequal extents over a trie of
    # chains, inserted, evicted by capacity (trimming tails), expired by TTL, swept, capped per
    # request and bounded; every match is checked against chain.matched_blocks' linear walk.
    from routerd.prefix.chain import matched_blocks

    rng = random.Random(seed)
    kind = seed % 4
    ix = PrefixIndex(300 if kind != 2 else 10**6, max_blocks_per_request=None if kind != 1 else 70,
                     eviction_interval_s=25.0 if kind == 3 else None, ttl_s=40.0 if kind == 2 else None)
    if kind == 2:
        ix.limit_capacity(400)
    prompts = []
    for t in range(1_500):
        depth = rng.randrange(1, 40)
        ext, h = [], 0
        for _ in range(depth):
            h = h * 4 + rng.randrange(4) + 1  # a 4-ary trie: many shared heads
            # A chain hash names its whole prefix, hence its blocks: the count is the key's.
            ext.append((h, (1, 2, 4, 7)[h % 4]))
        if rng.random() < 0.3:  # a partial last unit (Mooncake's last hash_id): fewer of its blocks
            h, c = ext[-1]
            ext[-1] = (h, rng.randrange(1, c + 1))
        p = pb(*ext)
        prompts.append(p)
        i = rng.randrange(2)
        now = t * 0.5
        ix.advance(now)
        for q in (p, *rng.sample(prompts, min(3, len(prompts)))):
            for j in (0, 1):
                want = matched_blocks(q.extents, dict(ix.entries(j)))
                if ix.max_blocks is not None:
                    want = min(want, ix.max_blocks)
                assert ix.match(j, q) == want, (seed, t, j)
        ix.insert(i, p, now)


def _reference_insert(ix: PrefixIndex, instance: int, prefix: PrefixBlocks, now: float) -> None:
    """The insert as first written: one extent at a time, tail first (what the bulk insert must equal)."""
    now = ix.advance(now)
    if prefix is None or prefix.num_blocks == 0:
        return
    idx = ix._get(instance)
    remaining = prefix.num_blocks if ix.max_blocks is None else min(ix.max_blocks, prefix.num_blocks)
    items = []
    for h, n in prefix.extents:
        if remaining <= 0:
            break
        m = n if n < remaining else remaining
        items.append((h, m))
        remaining -= m
    matched = inserted = 0
    for h, m in reversed(items):
        inserted += m
        old = idx.blocks.get(h)
        if old is None:
            idx.blocks[h] = m
            idx.size += m
            matched = 0
        else:
            if m > old:
                idx.blocks[h] = m
                idx.size += m - old
                matched = old
            else:
                matched += m
            idx.blocks.move_to_end(h)
        if idx.touched is not None:
            idx.touched[h] = now
    ix.last_insert = (instance, matched, inserted)
    if ix.eviction_interval_s is None:
        idx.evict_to_capacity()
    elif ix.hard_limit is not None:
        idx.evict_to(ix.hard_limit)


@pytest.mark.parametrize("seed", range(4))
def test_bulk_insert_equals_the_one_at_a_time_insert(seed):
    rng = random.Random(100 + seed)
    kind = seed % 4
    kw = dict(max_blocks_per_request=None if kind != 1 else 70, eviction_interval_s=25.0 if kind == 3 else None,
              ttl_s=40.0 if kind == 2 else None)
    a, b = PrefixIndex(300, **kw), PrefixIndex(300, **kw)
    for t in range(1_500):
        ext, h = [], 0
        for _ in range(rng.randrange(1, 40)):
            h = h * 4 + rng.randrange(4) + 1
            ext.append((h, (1, 2, 4, 7)[h % 4]))
        if rng.random() < 0.3:
            h, c = ext[-1]
            ext[-1] = (h, rng.randrange(1, c + 1))
        p, i, now = pb(*ext), rng.randrange(2), t * 0.5
        a.insert(i, p, now)
        _reference_insert(b, i, p, now)
        assert a.last_insert == b.last_insert, t
        assert a.entries(i) == b.entries(i) and a.size(i) == b.size(i) == sum(c for _, c in b.entries(i)), t
        if kind == 2:
            assert a._inst[i].touched == b._inst[i].touched


def test_prompts_against_the_invariant_never_break_the_books():
    # Equal hashes with different block counts (impossible for chain hashes, short of a 64-bit
    # collision): matches may then differ from the walk, but nothing raises and the size stays
    # the sum of the entries, within the capacity.
    rng = random.Random(5)
    ix = PrefixIndex(60, max_blocks_per_request=25)
    for t in range(3_000):
        ext, h = [], 0
        for _ in range(rng.randrange(1, 20)):
            h = h * 3 + rng.randrange(3) + 1
            ext.append((h, rng.randrange(1, 6)))
        i = rng.randrange(3)
        ix.match(i, pb(*ext))
        ix.insert(i, pb(*ext), float(t))
        assert ix.size(i) == sum(c for _, c in ix.entries(i)) <= 60
