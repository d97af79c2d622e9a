"""The engine-side prefix cache (routerd.prefix.cache): hand cases, and random operations
against a per-block reference pool written from vLLM's description (one object per block,
a free queue of block ids, a hash -> block map)."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from routerd.prefix.cache import PrefixCache, PrefixState
from routerd.prefix.chain import PrefixBlocks, chain_hash, prefix_blocks, sequence_extents, unit_extents


# ---------------------------------------------------------------------------- chain
def test_extents_follow_the_unit_holding_each_blocks_last_token():
    # Units of 20, 5 and 30 tokens with 16-token blocks: block 0 (tokens 0-15) ends in unit A,
    # block 1 (16-31) ends in unit C (A covers 0-19, B 20-24, C 25-54), block 2 (32-47) in C;
    # tokens 48-54 are a partial block (not cached).
    ext, n, tail = unit_extents([(7, 20), (8, 5), (9, 30)], 16)
    ha = chain_hash(0, 7)
    hc = chain_hash(chain_hash(ha, 8), 9)
    assert ext == ((ha, 1), (hc, 2))
    assert n == 3 and tail == hc


def test_partial_last_unit_is_a_prefix_of_the_full_one():
    short = prefix_blocks([(1, 512), (2, 300)], 16)
    full = prefix_blocks([(1, 512), (2, 512), (3, 512)], 16)
    assert short.num_blocks == 32 + 18
    assert short.common_blocks(full) == 50
    other = prefix_blocks([(1, 512), (4, 512)], 16)
    assert other.common_blocks(full) == 32


def test_response_extent_takes_the_straddling_block():
    pb = prefix_blocks([(1, 40)], 16)  # 2 full blocks, 8 tokens in block 2
    ext = sequence_extents(pb, 40, 99, 30, 16)  # 70 tokens: blocks 0-3 full
    assert ext == pb.extents + ((chain_hash(pb.tail, 99), 2),)
    # The next turn resends the answer: its blocks 2 and 3 are the same blocks.
    turn2 = prefix_blocks([(1, 40), (99, 30), (5, 10)], 16)
    assert PrefixBlocks(ext, 4).common_blocks(turn2) == 4


# ---------------------------------------------------------------------------- by hand
def _admit(pc: PrefixCache, free: int, ext, tokens: int, bs: int = 1):
    """Admit a whole sequence of ``tokens`` (block size ``bs``); returns (state, hit, free after)."""
    st = PrefixState(ext)
    hit, hit_free = pc.lookup(ext, (tokens - 1) // bs, free)
    fresh = -(-tokens // bs) - hit
    free -= fresh + hit_free
    pc.acquire(st, hit)
    pc.register(st, tokens // bs, free)
    return st, hit, free


def test_hits_evictions_and_tail_first_freeing_by_hand():
    # 6 blocks of 1 token. A = extent a (3 blocks), B = extent b (3 blocks).
    pc = PrefixCache(6)
    a, b = [(11, 3)], [(22, 3)]
    st_a, hit, free = _admit(pc, 6, a, 3)
    assert hit == 0 and free == 3
    free += pc.release(st_a, 3, free)  # a2, a1, a0 enter the queue (tail first)
    assert free == 6 and pc.cached == {11: 3} and pc.cached_free == 3
    # B needs 3 fresh blocks: the 3 hash-less ones were freed first (never used): no eviction.
    st_b, hit, free = _admit(pc, free, b, 3)
    assert hit == 0 and free == 3 and pc.cached == {11: 3, 22: 3}
    # A second A reuses 2 blocks (the last token is always computed) and computes a2 again:
    # it needs one fresh block, popped from the queue head, which is a2 itself: evicted, and
    # then cached again as the new block fills (vLLM's cache_full_blocks).
    st_a2, hit, free = _admit(pc, free, a, 3)
    assert hit == 2 and free == 0
    assert pc.evicted == 1 and pc.cached == {11: 3, 22: 3} and pc.cached_free == 0
    assert st_a2.held == 3
    pc.check(free)
    free += pc.release(st_b, 3, free)
    free += pc.release(st_a2, 3, free)
    assert free == 6
    pc.check(free)


def test_a_shared_block_is_freed_by_its_last_holder():
    pc = PrefixCache(8)
    st1, _, free = _admit(pc, 8, [(5, 4)], 4)  # blocks 0-3
    st2, hit, free = _admit(pc, free, [(5, 4)], 4)
    assert hit == 3 and free == 3  # 3 shared, block 3 computed again as a private copy
    freed = pc.release(st1, 4, free)
    assert freed == 1  # only st1's block 3; blocks 0-2 are still held by st2
    free += freed
    freed = pc.release(st2, 4, free)
    assert freed == 4  # its private copy and the three shared blocks
    free += freed
    assert free == 8 and pc.cached == {5: 4}
    pc.check(free)


# ---------------------------------------------------------------------------- reference
class BlockPool:
    """Per-block reference with the same documented approximations (private copies unhashed,
    a request's unhashed blocks freed before its hashed ones)."""

    def __init__(self, n: int) -> None:
        self.key = [None] * n
        self.ref = [0] * n
        self.queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(n))
        self.map: dict[tuple[int, int], int] = {}

    @staticmethod
    def keys(ext):
        return [(h, k) for h, n in ext for k in range(n)]

    def match(self, ext) -> int:
        m = 0
        for key in self.keys(ext):
            if key not in self.map:
                break
            m += 1
        return m

    def alloc(self) -> int:
        b, _ = self.queue.popitem(last=False)
        key = self.key[b]
        if key is not None:
            del self.map[key]
            self.key[b] = None
            h, k = key
            j = k + 1
            while (h, j) in self.map and self.ref[self.map[(h, j)]] == 0:
                # blocks above a hole lose their hash (as PrefixCache._cut does)
                bb = self.map.pop((h, j))
                self.key[bb] = None
                j += 1
        self.ref[b] = 1
        return b

    def admit(self, req: dict, cap: int) -> int:
        keys = self.keys(req["ext"])
        hit = min(self.match(req["ext"]), cap)
        req["blocks"] = []
        for key in keys[:hit]:
            b = self.map[key]
            if self.ref[b] == 0:
                del self.queue[b]
            self.ref[b] += 1
            req["blocks"].append(b)
        req["priv_from"] = {}
        return hit

    def grow(self, req: dict, nblocks: int, full: int) -> None:
        keys = self.keys(req["ext"])
        while len(req["blocks"]) < nblocks:
            req["blocks"].append(self.alloc())
        for i in range(req.get("reg", 0), full):
            if i < len(keys) and not req["blocks_hashed"].get(i):
                key = keys[i]
                b = req["blocks"][i]
                if self.ref[b] > 1 or self.key[b] is not None:
                    continue  # a reused block
                h, k = key
                if req["priv_from"].get(h) is not None or key in self.map:
                    req["priv_from"].setdefault(h, k)
                    continue
                self.map[key] = b
                self.key[b] = key
        req["reg"] = max(req.get("reg", 0), full)

    def release(self, req: dict) -> None:
        blocks = req["blocks"]
        unhashed = [b for b in reversed(blocks) if self.key[b] is None]
        hashed = [b for b in reversed(blocks) if self.key[b] is not None]
        for b in unhashed + hashed:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.queue[b] = None


@pytest.mark.parametrize("seed", range(40))
def test_random_operations_match_the_per_block_pool(seed):
    rng = random.Random(seed)
    bs = 1
    nblocks = rng.randint(8, 40)
    pc = PrefixCache(nblocks)
    ref = BlockPool(nblocks)
    free = nblocks
    # A small tree of extents so that prompts share prefixes.
    roots = [rng.randint(1, 5) for _ in range(3)]
    live: list[tuple[PrefixState, dict, int]] = []

    def random_ext():
        ext = []
        h = 0
        for _ in range(rng.randint(1, 3)):
            h = chain_hash(h, rng.randint(0, 2))
            ext.append((h, rng.choice(roots) + rng.randint(0, 2)))
        return ext

    for _ in range(150):
        op = rng.random()
        if op < 0.55:
            ext = random_ext()
            tokens = sum(n for _, n in ext)
            cap = (tokens - 1) // bs
            st = PrefixState(ext)
            hit, hit_free = pc.lookup(ext, cap, free)
            req = {"ext": ext, "blocks_hashed": {}}
            # The reference decides admission the same way: enough free blocks.
            first = rng.randint(hit + 1, tokens) if hit < tokens else tokens  # first chunk's end
            fresh = first - hit
            if fresh + hit_free > free:
                assert ref.match(ext) >= 0
                continue
            assert hit == ref.admit(req, cap)
            free -= fresh + hit_free
            pc.acquire(st, hit)
            pc.register(st, first, free)
            ref.grow(req, first, first)
            live.append((st, req, tokens))
        elif op < 0.8 and live:
            st, req, tokens = rng.choice(live)
            have = len(req["blocks"])
            if have < tokens:
                more = rng.randint(1, tokens - have)
                if more <= free:
                    free -= more
                    pc.register(st, have + more, free)
                    ref.grow(req, have + more, have + more)
        elif live:
            st, req, tokens = live.pop(rng.randrange(len(live)))
            free += pc.release(st, len(req["blocks"]), free)
            ref.release(req)
        assert free == len(ref.queue)
        probe = random_ext()
        pc._sync(free)
        assert pc.match(probe) == ref.match(probe)
        pc.check(free)
