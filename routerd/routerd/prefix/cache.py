"""The engine-side prefix cache of one instance: vLLM V1 automatic prefix caching, on extents.

What vLLM V1 does (``vllm/v1/core/block_pool.py``, ``kv_cache_manager.py``,
``docs/design/prefix_caching.md``; restated in ``shared/docs/prefix-routing.md`` §1):

* Full blocks are keyed by a hash chain; a new request reuses its longest cached prefix of
  whole blocks, at most ``(tokens - 1) // block_size`` blocks (the last prompt token is always
  computed). Reused blocks are shared: their reference count goes up, and a reused block that
  was free leaves the free queue.
* Free blocks sit in one doubly linked free queue *with their hashes*: they are still hits
  until reallocated. Allocation pops the head (least recently freed first) and drops the
  popped block's hash (eviction).
* A request that finishes, is preempted or aborted frees its blocks in reverse order (its
  tail first), so its tail blocks are evicted before its head blocks.
* A block becomes a hit for others as soon as it is allocated for a chunk that fills it
  (``cache_full_blocks`` runs when the slots are allocated, before the step computes them).

How this module does it at the cost of extents, not blocks (:mod:`routerd.prefix.chain`):

* ``cached[h]``: leading blocks of extent ``h`` that the cache holds (in use or free). The
  cached blocks of an extent are always a prefix ``[0, cached[h])``: a holder of block ``k``
  holds blocks ``0 .. k-1`` too, requests free their tails first and a hit touches a prefix,
  so within an extent (and from an extent to the ones that extend its chain) higher blocks
  are always freed earlier and evicted first.
* ``holders[h]``: the lengths of the prefixes of ``h`` that running requests hold (a
  multiset ``{length: count}``). Block ``k`` of ``h`` is in use iff some holder's length is
  above ``k``, so the free blocks of ``h`` are ``[max holder, cached[h])``.
* The free queue is a queue of *runs*: ``[h, lo, hi]`` (blocks ``lo .. hi-1`` of ``h``, freed
  together, evicted from ``hi - 1`` down) or ``[None, 0, count]`` (blocks with no hash: partial
  tail blocks, requests without prefix identity, the never-used pool). A hit trims runs from
  below, an eviction from above; neither splits a run.
* Allocation does not touch the queue: the instance only lowers its free-block count, and
  the queue pops the difference (evicting) before the next operation that reads or changes it
  (:meth:`PrefixCache._sync`). Pops at the head commute with nothing but the operations that
  sync first, so this is exact, and an instance whose queue holds no hashed block (a trace
  without prefix identity) pays one comparison per operation.

A listener (``PrefixCache(num_blocks, listener)``) learns every change of ``cached``:
``stored(h, lo, hi)`` when blocks ``lo .. hi-1`` of ``h`` become cached (``cached[h]`` goes from
``lo`` to ``hi``), ``removed(h, lo, hi)`` when they stop being cached (from ``hi`` down to
``lo``: evicted, or cut off above an evicted block), ``cleared()`` at :meth:`PrefixCache.reset`.
Replaying the calls reproduces ``cached`` exactly at every moment (the emulator builds vLLM's
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events from them). Evictions are
reported when they are applied, at the sync before the next operation, as everything else
here sees them. Without a listener the cost is one attribute test where ``cached`` changes.

Approximations (each documented where it is made):

* A block a request computes although the same hash is cached (the block after a capped hit,
  or a chunk another request computed first) is the request's private copy: vLLM keeps such
  duplicates hashed, here they are freed without a hash.
* A request's private blocks (those duplicates and its partial tail block) are freed before
  its hashed blocks, whatever their position.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol, Sequence


class PrefixState:
    """One request's place in an instance's prefix cache (kept on the request, reset on release)."""

    __slots__ = ("ext", "share", "hold", "held", "reg", "ei", "eo", "priv")

    def __init__(self, ext: Sequence[tuple[int, int]], share: int = 1 << 62) -> None:
        self.ext = ext
        """Extents ``(hash, blocks)`` of the request's whole sequence (prompt, then response)."""
        self.share = share
        """Leading blocks that some other request of the workload may share; the rest are
        cached only when the request leaves (nobody else can hit them before: see
        :meth:`PrefixCache.register`)."""
        self.hold: list[list[int]] = []
        """``[hash, length]`` per extent the request holds a prefix of, in sequence order."""
        self.held = 0
        """Blocks it holds through the cache (sum of the hold lengths)."""
        self.reg = 0
        """Blocks of its sequence accounted so far (held through the cache or private)."""
        self.ei = 0
        """Extent index of block ``reg``."""
        self.eo = 0
        """Offset of block ``reg`` in that extent."""
        self.priv = False
        """True once the request computed a private copy in extent ``ei`` (the rest is private)."""


class CacheListener(Protocol):
    """Told every change of :attr:`PrefixCache.cached` (see the module docstring)."""

    def stored(self, h: int, lo: int, hi: int) -> None:
        """Blocks ``lo .. hi-1`` of extent ``h`` became cached (``cached[h]``: ``lo`` -> ``hi``)."""

    def removed(self, h: int, lo: int, hi: int) -> None:
        """Blocks ``lo .. hi-1`` of extent ``h`` are no longer cached (``cached[h]``: ``hi`` -> ``lo``)."""

    def cleared(self) -> None:
        """Every block's hash was dropped (:meth:`PrefixCache.reset`)."""


class PrefixCache:
    """vLLM V1's block pool for prefix caching, one per simulated instance.

    Block counts are blocks, token counts tokens. The owning instance keeps the number of
    free blocks (``free``); every method that reads or changes the queue takes it, to pop the
    blocks allocated since the last call (see the module docstring).

    Args:
        num_blocks: KV blocks of the instance (all free at first, without hashes).
        listener: told every change of :attr:`cached` (:class:`CacheListener`), or None.
    """

    def __init__(self, num_blocks: int, listener: CacheListener | None = None) -> None:
        self.listener = listener
        """:class:`CacheListener` of every change of :attr:`cached`, or None (may be set later)."""
        self.cached: dict[int, int] = {}
        """Extent hash -> leading blocks cached (in use or free)."""
        self.holders: dict[int, dict[int, int]] = {}
        """Extent hash -> {held prefix length: requests holding it}."""
        self._runs_of: dict[int, list[list]] = {}
        # Runs [h, lo, hi, alive] oldest first; a run a hit consumes is marked dead (alive = 0)
        # and dropped when it reaches the head, so no operation searches the queue.
        self._queue: deque[list] = deque()
        self.qsize = num_blocks
        """Blocks in the free queue as of the last sync."""
        self.cached_free = 0
        """Hashed blocks in the free queue (evictable hits)."""
        self.evicted = 0
        """Hashed blocks evicted so far (blocks)."""

    # ------------------------------------------------------------------ free queue
    def _push(self, h: int | None, lo: int, hi: int) -> None:
        """Append blocks ``lo .. hi-1`` of ``h`` (``None``: hash-less blocks) to the queue tail."""
        n = hi - lo
        if h is None:
            if self.cached_free:
                self._add_run([None, lo, hi])
            # else the whole queue is hash-less: its order does not matter, only its size
            self.qsize += n
            return
        if self.cached_free == 0:
            # Materialise the hash-less blocks in front: they were freed earlier.
            self._queue.clear()
            if self.qsize:
                self._add_run([None, 0, self.qsize])
        run = [h, lo, hi]
        self._runs_of.setdefault(h, []).append(run)
        self.cached_free += n
        self.qsize += n
        self._add_run(run)

    def _add_run(self, run: list) -> None:
        run.append(1)
        self._queue.append(run)

    def _drop_run(self, run: list) -> None:
        """Drop the head run (emptied by evictions)."""
        self._queue.popleft()
        h = run[0]
        if h is not None:
            self._unlink(h, run)

    def _unlink(self, h: int, run: list) -> None:
        """Remove ``run`` (by identity: lists compare by value) from the runs of ``h``."""
        runs = self._runs_of[h]
        if runs[0] is run:  # evictions take the oldest
            del runs[0]
        else:
            del runs[next(i for i, r in enumerate(runs) if r is run)]
        if not runs:
            del self._runs_of[h]

    def _sync(self, free: int) -> None:
        """Pop the blocks allocated since the last call from the queue head (evicting hashes)."""
        n = self.qsize - free
        if n <= 0:
            if n < 0:  # freed outside release(): hash-less blocks at the tail
                self._push(None, 0, -n)
            return
        self.qsize = free
        if self.cached_free == 0:
            return
        self._evict(n)

    def _evict(self, n: int) -> None:
        """Pop ``n`` blocks from the queue head (``cached_free > 0``)."""
        q = self._queue
        while n > 0:
            run = q[0]
            if not run[3]:
                q.popleft()
                continue
            h, lo, hi = run[0], run[1], run[2]
            t = hi - lo if hi - lo < n else n
            n -= t
            hi -= t
            run[2] = hi
            if h is not None:
                self.cached_free -= t
                self.evicted += t
                if self._runs_of[h][0] is run:
                    # The oldest run of h holds its top blocks: the cached prefix ends at hi.
                    if self.listener is not None:
                        self.listener.removed(h, hi, self.cached[h])
                    if hi:
                        self.cached[h] = hi
                    else:
                        del self.cached[h]
                elif hi < self.cached[h]:
                    self._cut(h, hi)
            if hi == lo:
                self._drop_run(run)
            if self.cached_free == 0:
                q.clear()  # what is left is hash-less
                return

    def _cut(self, h: int, length: int) -> None:
        """Extent ``h`` is now cached only up to ``length`` blocks (its block ``length`` was evicted)."""
        if self.listener is not None:
            self.listener.removed(h, length, self.cached[h])
        if length:
            self.cached[h] = length
        else:
            del self.cached[h]
        for run in list(self._runs_of.get(h, ())):
            if run[1] >= length:
                # Free blocks above a hole are unreachable: vLLM would keep their hashes until
                # reallocated, but a lookup stops at the hole. (The module docstring's argument
                # says eviction never makes a hole; this keeps the state consistent if it did.)
                self.cached_free -= run[2] - run[1]
                run[0] = None
                self._unlink(h, run)

    # ------------------------------------------------------------------ requests
    def match(self, ext: Sequence[tuple[int, int]]) -> int:
        """Longest cached prefix of ``ext`` (blocks), as of the last operation (no sync)."""
        total = 0
        get = self.cached.get
        for h, n in ext:
            c = get(h, 0)
            if c >= n:
                total += n
                continue
            return total + c
        return total

    def lookup(self, ext: Sequence[tuple[int, int]], cap: int, free: int) -> tuple[int, int]:
        """``(hit blocks, of which free)`` for a request admitted now, at most ``cap`` hit blocks.

        The free ones leave the free pool when the request is admitted (:meth:`acquire`).
        """
        if self.qsize != free:
            self._sync(free)
        total = 0
        free_hit = 0
        get = self.cached.get
        holders = self.holders
        for h, n in ext:
            if total >= cap:
                break
            c = get(h, 0)
            m = c if c < n else n
            if total + m > cap:
                m = cap - total
            if m <= 0:
                break
            hm = holders.get(h)
            top = max(hm) if hm else 0
            if m > top:
                free_hit += m - top
            total += m
            if m < n:
                break
        return total, free_hit

    def acquire(self, st: PrefixState, hit: int) -> None:
        """Admit a request with ``hit`` blocks reused (as returned by :meth:`lookup` just before)."""
        holders = self.holders
        left = hit
        ei = eo = 0
        for h, n in st.ext:
            if left <= 0:
                break
            m = n if n < left else left
            hm = holders.get(h)
            if hm is None:
                hm = holders[h] = {}
                top = 0
            else:
                top = max(hm)
            if m > top:
                self._take_free(h, top, m)
            hm[m] = hm.get(m, 0) + 1
            st.hold.append([h, m])
            left -= m
            if m < n:
                eo = m
                break
            ei += 1
        st.ei, st.eo = ei, eo
        st.held = hit
        st.reg = hit
        st.priv = False

    def admit(self, st: PrefixState, hit: int, upto: int, free: int) -> None:
        """:meth:`acquire` then :meth:`register` up to ``upto`` blocks (an admission's first chunk)."""
        if hit:
            self.acquire(st, hit)
        register = self.register
        register(st, upto, free)

    def _take_free(self, h: int, lo: int, hi: int) -> None:
        """Blocks ``lo .. hi-1`` of ``h`` (free) are reused: trim them off the bottom of its runs.

        ``_runs_of[h]`` is in push order, which is descending offset (a release frees the blocks
        just below the ones freed before), so the lowest run is the last.
        """
        runs = self._runs_of[h]
        taken = 0
        while runs:
            run = runs[-1]
            if run[1] >= hi:
                break
            if run[2] <= hi:
                taken += run[2] - run[1]
                run[3] = 0  # dead: dropped when it reaches the queue head
                runs.pop()
            else:
                taken += hi - run[1]
                run[1] = hi
                break
        if not runs:
            del self._runs_of[h]
        self.cached_free -= taken
        self.qsize -= taken

    def register(self, st: PrefixState, upto: int, free: int, final: bool = False) -> None:
        """The request's first ``upto`` blocks are full and allocated: cache the new ones.

        A block already cached by someone else is the request's private copy (not cached
        twice); so is every later block of that extent. Blocks past ``st.share`` (no other
        request of the workload has them) are cached only with ``final`` (when the request
        leaves): until then no lookup or match can reach them, so the result is the same and
        a long unique prompt costs one registration instead of one per chunk.
        """
        if upto > st.share and not final:
            upto = st.share
        left = upto - st.reg
        if left <= 0:
            return
        if self.qsize != free:
            self._sync(free)
        ext = st.ext
        eo = st.eo
        if eo and not st.priv:
            # The common case, a prefill chunk within the extent it is computing: its hold grows.
            h, n = ext[st.ei]
            if eo + left < n and self.cached.get(h, 0) == eo:
                hl = st.hold[-1]
                hm = self.holders[h]
                c = hm[eo]
                if c == 1:
                    del hm[eo]
                else:
                    hm[eo] = c - 1
                eo += left
                hl[1] = eo
                hm[eo] = hm.get(eo, 0) + 1
                self.cached[h] = eo
                if self.listener is not None:
                    self.listener.stored(h, eo - left, eo)
                st.held += left
                st.eo = eo
                st.reg = upto
                return
        cached = self.cached
        holders = self.holders
        hold = st.hold
        ei, eo, priv = st.ei, st.eo, st.priv
        nx = len(ext)
        while left > 0 and ei < nx:
            h, n = ext[ei]
            k = n - eo
            if k > left:
                k = left
            if not priv:
                if cached.get(h, 0) == eo:
                    if eo:
                        # Its own hold of this extent grows (the last one it holds).
                        hl = hold[-1]
                        hm = holders[h]
                        old = hl[1]
                        c = hm[old]
                        if c == 1:
                            del hm[old]
                        else:
                            hm[old] = c - 1
                        hl[1] = old + k
                        hm[old + k] = hm.get(old + k, 0) + 1
                    else:
                        hold.append([h, k])
                        hm = holders.get(h)
                        if hm is None:
                            holders[h] = {k: 1}
                        else:
                            hm[k] = hm.get(k, 0) + 1
                    cached[h] = eo + k
                    if self.listener is not None:
                        self.listener.stored(h, eo, eo + k)
                    st.held += k
                else:
                    priv = True
            eo += k
            left -= k
            if eo >= n:
                ei += 1
                eo = 0
                priv = False
        st.ei, st.eo, st.priv = ei, eo, priv
        st.reg = upto  # blocks past the sequence's extents (none in practice) count as private

    def release(self, st: PrefixState | None, blocks: int, free: int) -> int:
        """A request holding ``blocks`` blocks leaves (finish, preemption, abort).

        Returns the blocks that go back to the free pool (those no other request holds).
        ``st`` is None for a request without prefix identity (all its blocks are hash-less).
        """
        if self.qsize != free:
            self._sync(free)
        if st is None:
            if blocks:
                if self.cached_free:
                    self._push(None, 0, blocks)
                else:
                    self.qsize += blocks
            return blocks
        anon = blocks - st.held
        freed = anon
        if anon > 0:
            self._push(None, 0, anon)
        holders = self.holders
        for h, m in reversed(st.hold):
            hm = holders[h]
            cnt = hm[m] - 1
            if cnt:
                hm[m] = cnt
                continue
            del hm[m]
            top = max(hm) if hm else 0
            if not hm:
                del holders[h]
            if m > top:
                self._push(h, top, m)
                freed += m - top
        st.hold = []
        st.held = 0
        st.reg = 0
        st.ei = st.eo = 0
        st.priv = False
        return freed

    def reset(self, free: int) -> bool:
        """Drop every block's hash (vLLM's ``reset_prefix_cache``), if no request holds a block
        through the cache; returns whether it did. ``free``: the instance's free blocks.

        vLLM refuses while any block is in use (``BlockPool.reset_prefix_cache``); the caller
        checks its hash-less blocks too (an instance with nothing running).
        """
        if self.holders:
            return False
        # Blocks allocated since the last sync simply stay allocated: the queue is all hash-less.
        if self.listener is not None:
            self.listener.cleared()
        self.cached.clear()
        self._runs_of.clear()
        self._queue.clear()
        self.cached_free = 0
        self.qsize = free
        return True

    # ------------------------------------------------------------------ checks
    def check(self, free: int) -> None:
        """Assert the invariants (tests): runs partition each extent's free blocks, counts agree."""
        self._sync(free)
        total_cached_free = 0
        for h, c in self.cached.items():
            hm = self.holders.get(h)
            top = max(hm) if hm else 0
            assert top <= c, (h, top, c)
            runs = sorted(self._runs_of.get(h, ()), key=lambda r: r[1])
            lo = top
            for run in runs:
                assert run[1] == lo and run[2] > run[1], (h, lo, run)
                lo = run[2]
                total_cached_free += run[2] - run[1]
            assert lo == c, (h, lo, c)
        assert total_cached_free == self.cached_free, (total_cached_free, self.cached_free)
        for h in self._runs_of:
            assert h in self.cached
        for h in self.holders:
            assert h in self.cached and self.holders[h]
        if self.cached_free:
            assert sum(r[2] - r[1] for r in self._queue if r[3]) == self.qsize
