"""The approximate prefix index as routerd uses it: a hard bound per instance, entries dropped or
renumbered when endpoints leave, and the match at insert that routerd's metric observes.

Hand-made prefixes (small integer extent hashes) as in ``test_policies_prefix.py``; expected
values by hand in the comments, the match at insert checked against :meth:`PrefixIndex.match`
(an independent walk, ``chain.matched_blocks``) on random histories.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict

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


def assert_books(ix: PrefixIndex) -> None:
    """The index's books: each entry in exactly one non-empty run, found there by ``run_of``, each
    run's total and the instance's size the sums of their entries' blocks."""
    for i in ix.instances():
        idx = ix._inst[i]
        seen = [h for run in idx.lru for h in run.keys]
        assert len(seen) == len(set(seen)) == len(idx.blocks) == len(idx.run_of) and set(seen) == set(idx.blocks)
        for run in idx.lru:
            assert run.keys and all(idx.run_of[h] is run for h in run.keys)
            assert run.blocks == sum(idx.blocks[h] for h in run.keys)
        assert idx.size == sum(idx.blocks.values())


class FlatReference:
    """The index as first written, independent of its runs: per instance one ``OrderedDict`` LRU
    of extents, each insert one extent at a time tail first (head last, the most recent), LRU
    entries trimmed from their tail; TTL expiry and periodic sweeps as ``PrefixIndex`` documents."""

    def __init__(self, capacity, max_blocks_per_request=None, eviction_interval_s=None, ttl_s=None):
        self.cap, self.max_blocks, self.step, self.ttl = capacity, max_blocks_per_request, eviction_interval_s, ttl_s
        self.lru, self.times, self.size = {}, {}, {}
        self.now, self.next_sweep = -math.inf, eviction_interval_s or math.inf
        self.last_insert = None

    def _evict(self, i):
        lru = self.lru[i]
        while self.size[i] > self.cap:
            h, c = next(iter(lru.items()))
            excess = self.size[i] - self.cap
            if c <= excess:
                del lru[h], self.times[i][h]
                self.size[i] -= c
            else:
                lru[h] = c - excess
                self.size[i] -= excess

    def advance(self, now):
        if now <= self.now:
            return self.now
        self.now = now
        if self.ttl is not None:
            for i, lru in self.lru.items():
                while lru and self.times[i][next(iter(lru))] <= now - self.ttl:
                    h, c = lru.popitem(last=False)
                    del self.times[i][h]
                    self.size[i] -= c
        if now >= self.next_sweep:
            for i in self.lru:
                self._evict(i)
            self.next_sweep = (math.floor(now / self.step) + 1) * self.step
        return self.now

    def insert(self, i, prefix, now):
        now = self.advance(now)
        lru, times = self.lru.setdefault(i, OrderedDict()), self.times.setdefault(i, {})
        self.size.setdefault(i, 0)
        remaining = prefix.num_blocks if self.max_blocks is None else min(self.max_blocks, prefix.num_blocks)
        items = []
        for h, n in prefix.extents:
            if remaining <= 0:
                break
            items.append((h, min(n, remaining)))
            remaining -= min(n, remaining)
        matched = inserted = 0
        for h, m in reversed(items):
            inserted += m
            old = lru.get(h)
            if old is None:
                lru[h] = m
                self.size[i] += m
                matched = 0
            else:
                if m > old:
                    lru[h] = m
                    self.size[i] += m - old
                    matched = old
                else:
                    matched += m
                lru.move_to_end(h)
            times[h] = now
        self.last_insert = (i, matched, inserted)
        if self.step is None:
            self._evict(i)

    def entries(self, i):
        return list(self.lru.get(i, {}).items())


def _trie_prompt(rng, max_depth=40):
    ext, h = [], 0
    for _ in range(rng.randrange(1, max_depth)):
        h = h * 4 + rng.randrange(4) + 1  # a 4-ary trie: shared heads, branches at every depth
        ext.append((h, (1, 2, 4, 7)[h % 4]))  # a chain hash names its whole prefix, hence its blocks
    if rng.random() < 0.3:  # a partial last unit (Mooncake's last hash_id): fewer of its blocks
        h, c = ext[-1]
        ext[-1] = (h, rng.randrange(1, c + 1))
    return pb(*ext)


def _index_kinds(seed):
    """Index settings by ``seed % 4``: on-insert eviction, a cap per request, a TTL, periodic sweeps."""
    kind = seed % 4
    return dict(max_blocks_per_request=None if kind != 1 else 70, eviction_interval_s=25.0 if kind == 3 else None,
                ttl_s=40.0 if kind == 2 else None)


@pytest.mark.parametrize("seed", range(8))
def test_runs_keep_the_per_extent_lru_order(seed):
    # The index keeps runs of extents touched together; its entries, sizes, touch times and
    # matches at insert must be those of a per-extent LRU on random histories: shared heads
    # (splits), longer turns of earlier prompts (runs moved whole), partial last units, caps per
    # request, capacity trimming, TTL expiry and periodic sweeps.
    rng = random.Random(100 + seed)
    kw = _index_kinds(seed)
    a, b = PrefixIndex(300, **kw), FlatReference(300, **kw)
    earlier = []
    for t in range(1_500):
        if earlier and rng.random() < 0.3:  # the next turn: an earlier prompt and more
            q = rng.choice(earlier)
            h = q.extents[-1][0]
            more = [(h := h * 4 + rng.randrange(4) + 1, (1, 2, 4, 7)[h % 4]) for _ in range(rng.randrange(1, 6))]
            p = pb(*q.extents, *more)
        else:
            p = _trie_prompt(rng)
        earlier.append(p)
        i, now = rng.randrange(2), t * 0.5
        a.insert(i, p, now)
        b.insert(i, p, now)
        assert a.last_insert == b.last_insert, t
        assert a.entries(i) == b.entries(i) and a.size(i) == b.size[i] == sum(c for _, c in b.entries(i)), t
        assert a.touch_times(i) == b.times[i], t
        assert_books(a)


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


@pytest.mark.parametrize("seed", range(3))
def test_colliding_hashes_never_break_the_books(seed):
    # Hashes from a tiny set at any depth, repeated within a prompt (64-bit collisions, never
    # chain hashes): nothing raises, every entry is stored once, the size is the sum of the
    # entries and stays within the capacity, and a TTL still empties the index.
    rng = random.Random(seed)
    ix = PrefixIndex(50, ttl_s=30.0 if seed == 2 else None)
    for t in range(3_000):
        p = pb(*((rng.randrange(12), rng.randrange(1, 6)) for _ in range(rng.randrange(1, 25))))
        i = rng.randrange(2)
        ix.match(i, p)
        ix.insert(i, p, float(t))
        e = ix.entries(i)
        assert len({h for h, _ in e}) == len(e) and ix.size(i) == sum(c for _, c in e) <= 50, t
        assert set(ix.touch_times(i)) == {h for h, _ in e}
        assert_books(ix)
    if seed == 2:
        ix.advance(10_000.0)
        assert ix.size(0) == ix.size(1) == 0 and ix.entries(0) == []


def test_hinted_search_finds_the_boundary_whatever_the_hints():
    # The first extent not wholly cached, from any hints (right, wrong, out of range, repeated),
    # against the linear count on random cached heads with a partial extent at the boundary.
    from routerd.prefix.index import _wholly_cached

    rng = random.Random(7)
    for _ in range(3_000):
        n = rng.randrange(0, 70)
        ext = [(h, 1 + h % 3) for h in range(1, n + 1)]
        k = rng.randrange(0, n + 1)
        cached = {h: c for h, c in ext[:k]}
        if k < n and rng.random() < 0.5:
            cached[ext[k][0]] = ext[k][1] - 1 or None  # part of the boundary extent
        cached = {h: c for h, c in cached.items() if c}
        hints = [rng.randrange(-2, n + 3) for _ in range(rng.randrange(0, 5))]
        if rng.random() < 0.3:
            hints.append(k)
        assert _wholly_cached(ext, cached.get, hints) == k, (n, k, hints)


@pytest.mark.parametrize("seed", range(4))
def test_deferred_updates_decide_as_updates_at_insert(seed):
    # With defer_updates an insert leaves its work to flush(); the next match, insert, advance
    # or read flushes first, so every match and last_insert equals the undeferred index's, and
    # forgetting or renumbering an instance applies what was left first.
    rng = random.Random(200 + seed)
    kw = _index_kinds(seed)
    a, b = PrefixIndex(300, **kw), PrefixIndex(300, **kw)
    a.limit_capacity(250)
    b.limit_capacity(250)
    b.defer_updates = True
    prompts, left = [], 0
    for t in range(1_500):
        p = _trie_prompt(rng)
        prompts.append(p)
        i, now = rng.randrange(3), t * 0.5
        for q in rng.sample(prompts, min(4, len(prompts))):
            for j in (0, 1, 2):
                assert b.match(j, q) == a.match(j, q), (seed, t, j)
        a.insert(i, p, now)
        b.insert(i, p, now)
        left += b.due
        how = rng.random()
        if how < 0.2:  # read after the flush: the match is searched there and reported
            b.flush()
            assert b.last_insert == a.last_insert
        elif how < 0.4:  # never read (an observer resets it): the flush still stores the prompt
            b.last_insert = None
            assert b.last_insert is None
        else:  # read first: searched now, on the state the insert will meet
            assert b.last_insert == a.last_insert
        if rng.random() < 0.3:
            b.flush()
            assert not b.due and b._inst[i].size == a._inst[i].size
        if t % 500 == 499:  # an endpoint leaves: 2 is forgotten, 1 becomes 2, 0 stays
            a.renumber({0: 0, 1: 2})
            b.renumber({0: 0, 1: 2})
    assert left > 1_000  # the deferral was exercised
    assert [b.entries(i) for i in (0, 1, 2)] == [a.entries(i) for i in (0, 1, 2)]
    assert_books(b)


def test_deferral_is_exact_even_for_colliding_hashes():
    # Found by a break-it pass: the deferred insert took its match from match() (a walk up to 8
    # extents) while the insert searched by galloping, so with hashes against the chain invariant
    # last_insert differed; and galloping past an extent that was not stored left it out.
    a, b = PrefixIndex(), PrefixIndex()
    b.defer_updates = True
    for ix in (a, b):
        ix.insert(0, pb((1, 1), (2, 1)), 0.0)
        ix.insert(0, pb((9, 1), (4, 1), (5, 1)), 1.0)  # 4 and 5 also end the next prompt
    p = pb((1, 1), (2, 1), (3, 1), (4, 1), (5, 1))
    a.insert(0, p, 2.0)
    b.insert(0, p, 2.0)
    assert a.last_insert == b.last_insert == (0, 2, 5)  # the walk: (1,1), (2,1), then 3 is missing
    assert a.match(0, p) == 5 and a.entries(0) == b.entries(0)  # 3 stored now
    rng = random.Random(9)
    a, b = PrefixIndex(40), PrefixIndex(40)
    b.defer_updates = True
    for t in range(3_000):
        q = pb(*((rng.randrange(10), rng.randrange(1, 5)) for _ in range(rng.randrange(1, 14))))
        i = rng.randrange(2)
        a.insert(i, q, float(t))
        b.insert(i, q, float(t))
        assert a.last_insert == b.last_insert, t
        if t % 7 == 0:
            assert a.entries(i) == b.entries(i), t
    assert_books(b)


def test_an_extent_of_no_blocks_is_stored_as_one_at_a_time_would():
    # Outside what the hashers produce (every extent has a block), kept exact all the same.
    a, r = PrefixIndex(100), FlatReference(100)
    for x in (a, r):
        x.insert(0, pb((1, 2)), 0.0)
        x.insert(0, pb((1, 2), (2, 0), (3, 2)), 1.0)
    assert a.entries(0) == r.entries(0) == [(3, 2), (2, 0), (1, 2)]


@pytest.mark.parametrize("seed", range(3))
def test_uniform_extents_match_as_the_linear_walk(seed):
    # routerd's prompts have extents of one size (PrefixBlocks.unit), so a match's leading blocks
    # are k * unit. Checked against the linear walk and against the same prompts without unit
    # (the running-sum path), with a per-request cap that cuts an extent (seeds 1, 2), for
    # matches and for the match at insert.
    from routerd.prefix.chain import matched_blocks

    rng = random.Random(seed)
    unit = (1, 4, 3)[seed]
    cap = None if seed == 0 else 10 * unit + 1  # keeps 10 extents whole and 1 block of the 11th
    ix = PrefixIndex(400, max_blocks_per_request=cap)
    ref = PrefixIndex(400, max_blocks_per_request=cap)
    prompts = []
    for t in range(800):
        keys, h = [], 0
        for _ in range(rng.randrange(1, 40)):
            h = h * 4 + rng.randrange(4) + 1  # a 4-ary trie: many shared heads
            keys.append(h)
        p = PrefixBlocks(tuple((k, unit) for k in keys), unit * len(keys), 0, unit)
        prompts.append(p)
        for q in (p, *rng.sample(prompts, min(3, len(prompts)))):
            for i in (0, 1):
                want = matched_blocks(q.extents, dict(ix.entries(i)))
                if cap is not None:
                    want = min(want, cap)
                assert ix.match(i, q) == want == ref.match(i, PrefixBlocks(q.extents, q.num_blocks)), (seed, t, i)
        j = rng.randrange(2)
        ix.insert(j, p, float(t))
        ref.insert(j, PrefixBlocks(p.extents, p.num_blocks), float(t))
        assert ix.last_insert == ref.last_insert, (seed, t)


def test_routerd_prompts_carry_their_extent_size():
    # 3 chunks of 4 blocks of 16 tokens (256 bytes each): unit 4, 12 blocks.
    p = text_prefix_blocks("x" * (3 * 256 + 10), 16, chunk_blocks=4)
    assert (len(p.extents), p.num_blocks, p.unit) == (3, 12, 4)
