"""PrefixCache's listener: replaying its stored/removed/cleared calls reproduces ``cached`` exactly."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from routerd.prefix.cache import PrefixCache, PrefixState
from routerd.prefix.chain import chain_hash


class Replay:
    """Rebuilds ``cached`` from the calls alone, checking each call against the state it changes."""

    def __init__(self) -> None:
        self.cached: dict[int, int] = {}
        self.calls: list[tuple] = []

    def stored(self, h: int, lo: int, hi: int) -> None:
        assert 0 <= lo < hi and self.cached.get(h, 0) == lo, (h, lo, hi, self.cached.get(h))
        self.cached[h] = hi
        self.calls.append(("stored", h, lo, hi))

    def removed(self, h: int, lo: int, hi: int) -> None:
        assert 0 <= lo < hi and self.cached.get(h) == hi, (h, lo, hi, self.cached.get(h))
        if lo:
            self.cached[h] = lo
        else:
            del self.cached[h]
        self.calls.append(("removed", h, lo, hi))

    def cleared(self) -> None:
        self.cached.clear()
        self.calls.append(("cleared",))


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_replaying_the_listener_reproduces_cached(data):
    draw = data.draw
    nblocks = draw(st.integers(6, 40), label="blocks")
    rep = Replay()
    pc = PrefixCache(nblocks, listener=rep)
    free = nblocks
    roots = [draw(st.integers(1, 5)) for _ in range(3)]
    live: list[tuple[PrefixState, int, int]] = []  # (state, blocks held, sequence blocks)

    def random_ext():
        ext, h = [], 0
        for _ in range(draw(st.integers(1, 3))):
            h = chain_hash(h, draw(st.integers(0, 2)))
            ext.append((h, draw(st.sampled_from(roots)) + draw(st.integers(0, 2))))
        return ext

    for _ in range(draw(st.integers(1, 60), label="operations")):
        op = draw(st.sampled_from(["admit", "admit", "grow", "release", "release_final", "reset"]))
        if op == "admit":
            ext = random_ext()
            tokens = sum(n for _, n in ext) + draw(st.integers(0, 2))  # block size 1; a response tail
            st_ = PrefixState(ext, share=draw(st.sampled_from([1 << 62, 1, 2])))
            hit, hit_free = pc.lookup(ext, tokens - 1, free)
            first = draw(st.integers(hit + 1, tokens)) if hit < tokens else tokens
            if first - hit + hit_free > free:
                continue
            free -= first - hit + hit_free
            pc.admit(st_, hit, first, free)
            live.append((st_, first, tokens))
        elif op == "grow" and live:
            i = draw(st.integers(0, len(live) - 1))
            st_, have, tokens = live[i]
            if have < tokens:
                more = draw(st.integers(1, tokens - have))
                if more <= free:
                    free -= more
                    pc.register(st_, have + more, free)
                    live[i] = (st_, have + more, tokens)
        elif op.startswith("release") and live:
            st_, have, tokens = live.pop(draw(st.integers(0, len(live) - 1)))
            if op == "release_final":
                pc.register(st_, have, free, final=True)  # what SimInstance does as a request leaves
            free += pc.release(st_, have, free)
        elif op == "reset":
            done = pc.reset(free)
            assert done == (not live or all(s.held == 0 for s, _, _ in live))
        assert rep.cached == pc.cached
        pc._sync(free)  # evictions pending from the allocations just made
        assert rep.cached == pc.cached
        pc.check(free)
    for st_, have, _ in live:
        free += pc.release(st_, have, free)
    pc._sync(nblocks)
    assert free == nblocks and rep.cached == pc.cached


def test_listener_calls_by_hand():
    # 4 blocks of 1 token. A (extent 11, 3 blocks) is computed, freed tail first, then B (22, 3)
    # needs 3 blocks: the never-used block first, then a2 and a1 (a0 stays cached).
    rep = Replay()
    pc = PrefixCache(4, listener=rep)
    a = PrefixState([(11, 3)])
    free = 4 - 3
    pc.admit(a, 0, 3, free)
    assert rep.calls == [("stored", 11, 0, 3)]
    free += pc.release(a, 3, free)
    b = PrefixState([(22, 3)])
    free -= 3
    pc.admit(b, 0, 3, free)
    assert rep.calls[1:] == [("removed", 11, 1, 3), ("stored", 22, 0, 3)]
    assert pc.cached == {11: 1, 22: 3}
    assert not pc.reset(free)  # b holds its blocks
    free += pc.release(b, 3, free)
    assert pc.reset(free) and pc.cached == {} and rep.calls[-1] == ("cleared",)
    # After the reset nothing is a hit.
    assert pc.lookup([(22, 3)], 2, free) == (0, 0)


def test_without_listener_behaviour_is_unchanged():
    runs = []
    for listener in (None, Replay()):
        pc = PrefixCache(8, listener=listener)
        free = 8
        s1 = PrefixState([(5, 4)])
        free -= 4
        pc.admit(s1, 0, 4, free)
        free += pc.release(s1, 4, free)
        s2 = PrefixState([(5, 4)])
        hit, hit_free = pc.lookup(s2.ext, 3, free)
        runs.append((hit, hit_free, dict(pc.cached), pc.cached_free))
    assert runs[0] == runs[1] == (3, 3, {5: 4}, 4)
