"""The router-side approximate prefix index: what a router knows from its own dispatches.

llm-d's ``approx-prefix-cache-producer``
(``llm-d/llm-d-router:pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/indexer.go``),
SGLang's approximate radix tree (``sgl-project/sglang:sgl-model-gateway/src/policies/tree.rs``) and
Dynamo's approximate mode (``use_kv_events=false``, ``router_ttl_secs``) all keep, per instance, the
prompts the router sent there, with no feedback from the engine: a prompt is believed cached on an
instance once the router dispatched it there, until the index forgets it.

Here each instance holds ``extent hash -> leading blocks believed cached`` (extents as in
:mod:`routerd.prefix.chain`) in LRU order, bounded by a capacity in blocks. Matching is a
galloping search over the request's extents (O(log extents) lookups, fewer still with the answers
other candidates gave for the same prompt). The LRU is kept over *runs* of extents touched together
(:class:`_Run`, a radix tree's edges), so inserting a prompt costs one step per run on its cached
path plus one per new extent, not one per extent: on 8K-token prompts with a cached history,
11-12 us instead of 29-32 (50-52 with a TTL) per insert, the two measured alternately.

Eviction, modelled on what matters for routing:

* **when**: on every insert (llm-d: its per-pod ``golang-lru`` evicts as it adds), or only at
  periodic sweeps every ``eviction_interval_s`` (SGLang's background thread,
  ``evict_tenant_by_size``), between which the index may grow past its capacity; optionally a TTL
  since the last dispatch (Dynamo's approximate indexer, ``router_ttl_secs`` 120 s).
* **what**: the least recently dispatched extent first, trimmed from its tail so what remains is
  still a prefix. A prompt's extents are touched tail first, head last, so its head stays the
  more recent: a long prompt loses its tail before its shared head, as SGLang's leaf-first
  eviction and vLLM's own free queue do. (llm-d's per-block LRU adds block 0 first, so its oldest
  entry is a prompt's *first* block; that quirk is not modelled: it only ever loses matches.)

Time is the caller's clock (s); a step back is treated as standing still. Pure Python, deterministic, no
simulator imports (routerd uses it with blocks hashed from prompt text).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from itertools import accumulate, repeat
from operator import itemgetter
from typing import TYPE_CHECKING, Literal, Sequence

from routerd.prefix.chain import PrefixBlocks, matched_blocks

if TYPE_CHECKING:
    from routerd.policies.base import InstanceView


class _Run:
    """Entries touched together: a segment of one chain, ``keys`` shallow first (``keys[0]`` the
    extent at chain depth ``top``), last touched at ``time`` (s), holding ``blocks`` in all.

    Within a run the deepest entry is the least recently used (a prompt's extents are touched
    tail first, head last), so the flat LRU order of entries is each run's keys reversed, runs
    in LRU order; eviction takes a run's last key first.
    """

    __slots__ = ("keys", "top", "time", "blocks")

    def __init__(self, keys: list[int], top: int, time: float, blocks: int) -> None:
        self.keys = keys
        self.top = top
        self.time = time
        self.blocks = blocks


class _InstanceIndex:
    """One instance's entries: extent hash -> leading blocks, in runs least recently touched first.

    An LRU over single extents costs a dict move per extent touched, and a prompt touches all of
    its cached extents: 128 moves for an 8K-token prompt at routerd's default ``chunk_blocks``.
    Consecutive extents of a chain that were always touched together form one :class:`_Run`
    (a radix tree's edge, SGLang's ``tree.rs`` node), so a touch costs a move per run on the
    prompt's path, and a run is split only where a touch covers part of it (a new branch or a
    shorter prompt). The order of entries, and so every eviction, is that of the per-extent LRU
    (``tests/test_prefix_index_bounds.py`` checks it against one on random histories).
    """

    __slots__ = ("blocks", "run_of", "lru", "size", "capacity")

    def __init__(self, capacity: int | None) -> None:
        self.blocks: dict[int, int] = {}
        """Extent hash -> leading blocks believed cached (what matching reads)."""
        self.run_of: dict[int, _Run] = {}
        """Extent hash -> the run holding it (every entry is in exactly one run)."""
        self.lru: OrderedDict[_Run, None] = OrderedDict()
        """Non-empty runs, least recently touched first."""
        self.size = 0
        self.capacity = capacity

    def entries(self) -> list[tuple[int, int]]:
        """``(extent hash, leading blocks)``, least recently used first."""
        blocks = self.blocks
        return [(h, blocks[h]) for run in self.lru for h in reversed(run.keys)]

    def touch_times(self) -> dict[int, float]:
        """Extent hash -> time (s) of its last insert."""
        return {h: run.time for run in self.lru for h in run.keys}

    def evict_to_capacity(self) -> int:
        """Trim LRU entries until ``size <= capacity``; returns blocks evicted."""
        return self.evict_to(self.capacity)

    def evict_to(self, cap: int | None) -> int:
        """Trim LRU entries until ``size <= cap`` (blocks; None: nothing); returns blocks evicted."""
        if cap is None or self.size <= cap:
            return 0
        blocks, run_of, lru = self.blocks, self.run_of, self.lru
        popitem = lru.popitem
        start = size = self.size
        while size > cap:
            run = popitem(last=False)[0]
            rk = run.keys
            excess = size - cap
            if run.blocks <= excess:  # the whole run goes (often one entry: a turn's new tail)
                if len(rk) == 1:
                    h = rk[0]
                    del blocks[h], run_of[h]
                else:
                    deque(map(blocks.__delitem__, rk), maxlen=0)
                    deque(map(run_of.__delitem__, rk), maxlen=0)
                size -= run.blocks
                continue
            # Part of it: trimmed from its deep end, the rest back at the LRU end.
            while True:
                h = rk[-1]
                c = blocks[h]
                if c <= excess:
                    rk.pop()
                    del blocks[h], run_of[h]
                    run.blocks -= c
                    size -= c
                    excess -= c
                    if not excess:
                        break
                else:
                    blocks[h] = c - excess  # keep the leading blocks: still a prefix
                    run.blocks -= excess
                    size = cap
                    break
            lru[run] = None
            lru.move_to_end(run, last=False)
        self.size = size
        return start - size

    def _drop(self, run: _Run) -> None:
        """Forget every entry of ``run`` (in the LRU)."""
        rk = run.keys
        self.size -= run.blocks
        deque(map(self.blocks.__delitem__, rk), maxlen=0)
        deque(map(self.run_of.__delitem__, rk), maxlen=0)
        del self.lru[run]

    def expire(self, deadline: float) -> None:
        """Drop entries last touched at or before ``deadline`` (s)."""
        lru = self.lru
        while lru:
            run = next(iter(lru))
            if run.time > deadline:
                break
            self._drop(run)

    def touch_head(self, ext: "Sequence[tuple[int, int]]", k: int, now: float) -> None:
        """Make the entries of ``ext[:k]`` (a prompt's first ``k`` extents, stored) the most
        recently used, head last, as touching them one by one tail first would.

        Walks the runs on the path deepest first: a run covered whole moves; one covered in
        part (its top only: a run is a chain segment) is split, its deep rest left in place.
        """
        run_of, lru = self.run_of, self.lru
        d = k - 1
        while d >= 0:
            h = ext[d][0]
            run = run_of.get(h)
            if run is None:
                # Not stored after all (hashes against the chain invariant, or an extent of no
                # blocks): stored now, at its place in the touch order, as one extent at a time.
                m = ext[d][1]
                self.blocks[h] = m
                self.size += m
                run_of[h] = new = _Run([h], d, now, m)
                lru[new] = None
                d -= 1
                continue
            rk = run.keys
            i = d - run.top
            if not (0 <= i < len(rk) and rk[i] == h):
                i = rk.index(h)  # hashes that break the chain arithmetic (a 64-bit collision)
            if i == len(rk) - 1:
                lru.move_to_end(run)
                run.time = now
            else:
                moved = rk[:i + 1]
                del rk[:i + 1]
                run.top += i + 1
                new = _Run(moved, d - i, now, sum(map(self.blocks.__getitem__, moved)))
                run.blocks -= new.blocks
                run_of.update(zip(moved, repeat(new)))
                lru[new] = None
            d -= i + 1

    def detach(self, h: int) -> None:
        """Take stored ``h`` out of its run (its entry in ``blocks`` stays)."""
        run = self.run_of.pop(h)
        run.blocks -= self.blocks[h]
        rk = run.keys
        if rk and rk[-1] == h:
            rk.pop()
        else:
            rk.remove(h)
        if not rk:
            del self.lru[run]


class PrefixIndex:
    """Per-instance approximate prefix index with LRU eviction under a capacity in blocks.

    Args:
        capacity_blocks: default capacity per instance (blocks); None: unbounded.
            :meth:`set_capacity` overrides it per instance (llm-d sizes each pod's LRU from the
            pod's reported GPU blocks).
        max_blocks_per_request: only a request's first this many blocks are inserted and
            matched (llm-d: ``maxPrefixTokensToMatch / blockSizeTokens``); None: all.
        eviction_interval_s: None: evict on every insert. Otherwise evict only at sweeps at
            ``k * eviction_interval_s`` (s), run by :meth:`advance` (SGLang).
        ttl_s: forget entries this long (s) after their last insert; None: never (Dynamo's
            approximate mode: 120 s).

    A deployment may also bound every instance's entries whatever the policy asks
    (:meth:`limit_capacity`: routerd's ``prefix.index_capacity_blocks``, a memory bound that holds
    at every insert, periodic sweeps or not), drop an instance's entries (:meth:`forget`) and
    renumber instances when its endpoint table changes (:meth:`renumber`).

    Raises:
        ValueError: a non-positive capacity, cap, interval or TTL.
    """

    def __init__(
        self,
        capacity_blocks: int | None = None,
        *,
        max_blocks_per_request: int | None = None,
        eviction_interval_s: float | None = None,
        ttl_s: float | None = None,
    ) -> None:
        for name, v in (
            ("capacity_blocks", capacity_blocks),
            ("max_blocks_per_request", max_blocks_per_request),
            ("eviction_interval_s", eviction_interval_s),
            ("ttl_s", ttl_s),
        ):
            if v is not None and not v > 0:
                raise ValueError(f"PrefixIndex: {name} must be > 0 or None, got {v!r}")
        self.default_capacity = capacity_blocks
        self.max_blocks = max_blocks_per_request
        self.eviction_interval_s = eviction_interval_s
        self.ttl_s = ttl_s
        self._next_sweep = eviction_interval_s if eviction_interval_s is not None else math.inf
        self._now = -math.inf
        self._inst: dict[int, _InstanceIndex] = {}
        self.hard_limit: int | None = None
        """Bound on every instance's blocks over any capacity set (:meth:`limit_capacity`); None: none."""
        self.defer_updates = False
        """Leave each insert's work (storing the prompt, evicting to capacity) to :meth:`flush`,
        which the caller runs after its decision (routerd: on the next event-loop turn, once the
        request is on its way; llm-d updates its index in ``PreRequest``, after scheduling). The
        insert itself only finds :attr:`last_insert` (a match). The next :meth:`match`,
        :meth:`insert`, :meth:`advance` or read of the entries flushes first, so every decision
        sees the index as without deferral."""
        self._pending: list[list] = []
        """Deferred inserts, in order: ``[idx, items, prefix, instance, inserted, now, found]``,
        ``found`` being :meth:`_found`'s ``(k, head, old)``, None until the first of a read of
        :attr:`last_insert` and :meth:`flush` needs it."""
        self._hints: tuple = ((), ())
        """The latest prefix matched (its extents) and the answers found for it (at most 4,
        :func:`_wholly_cached`'s hints): a decision asks every candidate about one prefix."""
        self._last_insert: tuple[int, int, int] | None = None
        self._unseen: list | None = None
        """The pending insert that :attr:`last_insert` reports once its match is found."""

    @property
    def last_insert(self) -> tuple[int, int, int] | None:
        """``(instance, matched blocks, inserted blocks)`` of the latest :meth:`insert` that had
        blocks to insert: how many of the request's leading blocks the index believed cached
        there just before (what routerd's ``phasewise_prefix_match_blocks`` observes). An
        observer may reset it to None before a decision to tell whether the decision inserted.

        With :attr:`defer_updates` that match is searched when this is first read, or at
        :meth:`flush`, whichever comes first: the index cannot change in between (every other
        operation flushes first), so the answer is the one at the insert. A caller that never
        reads it (routerd when an engine's KV events answered) leaves the search to the flush,
        after the decision."""
        e = self._unseen
        if e is not None:
            self._report(e)
        return self._last_insert

    @last_insert.setter
    def last_insert(self, value: tuple[int, int, int] | None) -> None:
        self._unseen = None  # a pending insert is still applied at flush; only its report goes
        self._last_insert = value

    def _found_of(self, e: list) -> tuple[int, int, int]:
        found = e[6]
        if found is None:
            found = e[6] = self._found(e[0], e[1], e[2])
        return found

    def _report(self, e: list) -> None:
        _, head, old = self._found_of(e)
        self._last_insert = (e[3], head + old, e[4])
        self._unseen = None

    # --- state ----------------------------------------------------------------------------

    def _get(self, instance: int) -> _InstanceIndex:
        idx = self._inst.get(instance)
        if idx is None:
            idx = self._inst[instance] = _InstanceIndex(self._bounded(self.default_capacity))
        return idx

    def _bounded(self, blocks: int | None) -> int | None:
        lim = self.hard_limit
        if lim is None:
            return blocks
        return lim if blocks is None or blocks > lim else blocks

    def limit_capacity(self, blocks: int | None) -> None:
        """Bound every instance's entries to ``blocks`` (> 0; None: lift the bound), now and for
        instances to come, whatever capacity the policy sets (:meth:`set_capacity` and the default
        are clamped to it). Unlike a capacity it holds at every insert even with periodic sweeps
        (``eviction_interval_s``), so the index's memory is bounded between sweeps too. A bound
        lifted or raised later does not restore a capacity clamped before.

        Raises:
            ValueError: ``blocks`` <= 0.
        """
        self.flush()
        if blocks is not None and blocks <= 0:
            raise ValueError(f"PrefixIndex: capacity limit must be > 0 or None, got {blocks!r}")
        self.hard_limit = blocks
        for idx in self._inst.values():
            idx.capacity = self._bounded(idx.capacity)
            idx.evict_to(blocks)

    def forget(self, instance: int) -> int:
        """Drop every entry of ``instance`` and its capacity (it starts empty, as a new instance);
        returns the blocks dropped (0 for an unknown instance)."""
        self.flush()
        idx = self._inst.pop(instance, None)
        return 0 if idx is None else idx.size

    def renumber(self, mapping: dict[int, int]) -> None:
        """Renumber instances after an endpoint table changed: instance ``old`` becomes
        ``mapping[old]``; instances not in ``mapping`` are forgotten.

        Raises:
            ValueError: two old instances mapped to one new instance.
        """
        self.flush()
        if len(set(mapping.values())) != len(mapping):
            raise ValueError(f"PrefixIndex.renumber: two instances mapped to one: {mapping}")
        self._inst = {mapping[i]: idx for i, idx in self._inst.items() if i in mapping}

    def instances(self) -> list[int]:
        """Instances that have entries or a capacity."""
        self.flush()
        return list(self._inst)

    def has_instance(self, instance: int) -> bool:
        """Whether ``instance`` has been given a capacity or an insert yet."""
        self.flush()
        return instance in self._inst

    def set_capacity(self, instance: int, blocks: int | None) -> None:
        """Set ``instance``'s capacity (blocks, > 0; None: unbounded); evicts now if on-insert.

        Raises:
            ValueError: ``blocks`` <= 0.
        """
        self.flush()
        if blocks is not None and blocks <= 0:
            raise ValueError(f"PrefixIndex: capacity of instance {instance} must be > 0, got {blocks}")
        idx = self._get(instance)
        idx.capacity = self._bounded(blocks)
        if self.eviction_interval_s is None:
            idx.evict_to_capacity()
        else:
            idx.evict_to(self.hard_limit)

    def size(self, instance: int) -> int:
        """Blocks ``instance``'s entries hold (may exceed capacity between periodic sweeps)."""
        self.flush()
        idx = self._inst.get(instance)
        return 0 if idx is None else idx.size

    def entries(self, instance: int) -> list[tuple[int, int]]:
        """``(extent hash, leading blocks)`` of ``instance``, least recently inserted first."""
        self.flush()
        idx = self._inst.get(instance)
        return [] if idx is None else idx.entries()

    def touch_times(self, instance: int) -> dict[int, float]:
        """Extent hash -> time (s) of its last insert, for ``instance``'s entries."""
        self.flush()
        idx = self._inst.get(instance)
        return {} if idx is None else idx.touch_times()

    # --- time -----------------------------------------------------------------------------

    def advance(self, now: float) -> float:
        """Bring the index to time ``now`` (s): run due periodic sweeps and TTL expiry.

        Returns the clock the index now stands at (``max`` of all times seen).

        Call before :meth:`match` at each decision; :meth:`insert` calls it itself. A sweep
        due at ``k * interval`` evicts what was there then: nothing is inserted between the
        sweep time and the first call after it, so one sweep at ``now`` is the same.
        """
        if self._pending:
            self.flush()
        if now <= self._now:
            return self._now  # nothing due; a clock stepping back (online jitter) stands still
        self._now = now
        if self.ttl_s is not None:
            deadline = now - self.ttl_s
            for idx in self._inst.values():
                idx.expire(deadline)
        if now >= self._next_sweep:
            for idx in self._inst.values():
                idx.evict_to_capacity()
            step = self.eviction_interval_s
            assert step is not None
            self._next_sweep = (math.floor(now / step) + 1) * step
        return self._now

    # --- the two operations -----------------------------------------------------------------

    def match(self, instance: int, prefix: PrefixBlocks | None) -> int:
        """Leading blocks of ``prefix`` believed cached on ``instance`` (blocks), O(log extents).

        Equal to :func:`~routerd.prefix.chain.matched_blocks`' walk, found by a galloping search
        for the first extent not wholly cached: whether a prefix's extent ``j`` is wholly here is
        monotone in ``j`` (see :func:`_wholly_cached`).

        At most ``max_blocks_per_request``; 0 for ``prefix=None`` or an unknown instance.
        """
        if prefix is None:
            return 0
        if self._pending:
            self.flush()
        idx = self._inst.get(instance)
        if idx is None or not idx.blocks:
            return 0
        ext = prefix.extents
        if len(ext) <= 8:
            m = matched_blocks(ext, idx.blocks)
        else:
            get = idx.blocks.get
            seen, hints = self._hints
            if seen is not ext:
                hints = ()
            k = _wholly_cached(ext, get, hints)
            if k not in hints:
                self._hints = (ext, (k, *hints[:3]))
            unit = prefix.unit
            m = unit * k if unit else _leading_blocks(ext, k, prefix.num_blocks)
            if k < len(ext):
                m += get(ext[k][0], 0)  # the cached blocks of the first extent not wholly cached
        cap = self.max_blocks
        return m if cap is None or m <= cap else cap

    def insert(self, instance: int, prefix: PrefixBlocks | None, now: float) -> None:
        """Record that ``prefix`` was dispatched to ``instance`` at ``now`` (s).

        Its first ``max_blocks_per_request`` blocks become believed cached and most recently
        used (head extents the most recent); evicts to capacity unless sweeps are periodic.
        With :attr:`defer_updates`, that waits for :meth:`flush`; :attr:`last_insert` is set
        either way.
        """
        now = self.advance(now)
        if prefix is None or prefix.num_blocks == 0:
            return
        idx = self._get(instance)
        items = self._items(prefix)
        inserted = prefix.num_blocks if items is prefix.extents else self.max_blocks
        if self.defer_updates:
            # The state the insert will meet is this one (anything else flushes first), so what
            # it finds then, or when last_insert is read first, is what it would find now,
            # colliding hashes included.
            e = [idx, items, prefix, instance, inserted, now, None]
            self._pending.append(e)
            self._unseen = e
            self._last_insert = None
            return
        k, head, old = self._found(idx, items, prefix)
        self._last_insert = (instance, head + old, inserted)
        self._unseen = None
        self._insert(idx, items, k, old, now)

    def _items(self, prefix: PrefixBlocks) -> "Sequence[tuple[int, int]]":
        """``prefix``'s extents up to ``max_blocks_per_request`` blocks (the last one cut)."""
        cap = self.max_blocks
        if cap is None or prefix.num_blocks <= cap:
            return prefix.extents
        items, remaining = [], cap
        for h, n in prefix.extents:
            if remaining <= 0:
                break
            m = n if n < remaining else remaining
            items.append((h, m))
            remaining -= m
        return items

    def _found(self, idx: _InstanceIndex, items: "Sequence[tuple[int, int]]",
               prefix: PrefixBlocks) -> tuple[int, int, int]:
        """``(k, head, old)``: how many leading ``items`` are wholly stored, their blocks, and the
        blocks stored of item ``k`` (the match is ``head + old``). Up to 8 items a walk (as
        :meth:`match`), past that the galloping search with this decision's hints."""
        get = idx.blocks.get
        n = len(items)
        if n <= 8:
            k = 0
            while k < n and get(items[k][0], 0) >= items[k][1]:
                k += 1
        else:
            seen, hints = self._hints
            k = _wholly_cached(items, get, hints if seen is prefix.extents else ())
        unit = prefix.unit
        if unit and (items is prefix.extents or k < n):
            head = unit * k  # a cut keeps every extent before its last whole
        else:
            head = _leading_blocks(items, k, prefix.num_blocks if items is prefix.extents else None)
        return k, head, (get(items[k][0], 0) if k < n else 0)

    def _insert(self, idx: _InstanceIndex, items: "Sequence[tuple[int, int]]", k: int, old: int, now: float) -> None:
        """:meth:`insert`'s work at ``now`` (s, the index's clock already there), with what
        :meth:`_found` found in this same state."""
        blocks = idx.blocks
        n = len(items)
        # The first ``k`` extents are wholly here, the rest not (and, past extent k, absent:
        # _wholly_cached's invariant). As touching them one at a time tail first would: extents
        # k.. become one new run (extent k grown, the absent ones added), then the cached head
        # moves to the most recent end run by run, head last.
        if k < n:
            hk, mk = items[k]
            if old:
                idx.detach(hk)
            rest = items[k + 1:]
            new_keys = [h for h, _ in items[k:]]
            before = len(blocks)
            blocks.update(rest)
            blocks[hk] = mk
            added = sum(map(itemgetter(1), rest))
            idx.size += added + mk - old
            run = _Run(new_keys, k, now, mk + added)
            if len(blocks) - before != len(rest) + (0 if old else 1):
                self._repair(idx, run)  # a key already here (a 64-bit hash collision)
            idx.run_of.update(zip(run.keys, repeat(run)))
            idx.lru[run] = None
        if k:
            idx.touch_head(items, k, now)
        self._evict_after_insert(idx)

    def _evict_after_insert(self, idx: _InstanceIndex) -> None:
        if self.eviction_interval_s is None:
            idx.evict_to_capacity()
        elif self.hard_limit is not None:
            idx.evict_to(self.hard_limit)

    @property
    def due(self) -> bool:
        """Whether inserts wait for :meth:`flush` (``defer_updates``)."""
        return bool(self._pending)

    def flush(self) -> None:
        """Apply the inserts (and their evictions) left to it (``defer_updates``), in order; a
        no-op otherwise."""
        pending = self._pending
        if pending:
            self._pending = []
            for e in pending:
                if e is self._unseen:
                    self._report(e)
                k, _, old = self._found_of(e)
                self._insert(e[0], e[1], k, old, e[5])

    @staticmethod
    def _repair(idx: _InstanceIndex, run: _Run) -> None:
        """Keep the books whole when a new run's keys were already stored, or repeat: each key
        leaves its old run and appears once in ``run``; the size is recounted."""
        run.keys = list(dict.fromkeys(run.keys))
        for h in run.keys:
            if h in idx.run_of:
                idx.detach(h)
        blocks = idx.blocks
        for r in (*idx.lru, run):
            r.blocks = sum(map(blocks.__getitem__, r.keys))
        idx.size = sum(blocks.values())


def _wholly_cached(ext: "Sequence[tuple[int, int]]", get, hints: "Sequence[int]" = ()) -> int:
    """How many leading extents of ``ext`` are wholly cached (``get(hash, 0) >= blocks``), by a
    galloping search: O(log k) lookups for ``k`` (about 16 for a 512-extent prompt cached whole,
    1 for a miss at its head) instead of a walk of ``k``. ``hints`` are answers found for the
    same prompt on other instances (a decision asks every candidate): each is tried first, in two
    lookups, and a wrong one still narrows the search.

    Valid because, in a :class:`PrefixIndex`, an extent of a chain is wholly cached only if every
    earlier extent of the chain is: extents are chain hashes (each names the whole prefix up to
    it, hence its blocks), every insert touches a prompt's extents tail first and head last, so
    along a chain the earlier extent is always the more recently used one, and every eviction
    (LRU trimming, TTL expiry, in LRU order) takes the later one first and trims only the least
    recent entry. The only entries shorter than their extent are such a trimmed tail and an
    extent that a request's block cap or a partial last unit cut, and nothing later on their
    chain is stored (so past the first extent not wholly cached, nothing of the prefix is).
    ``tests/test_prefix_index_bounds.py`` checks both matches and inserts against the walk on
    random histories.
    """
    n = len(ext)
    if n == 0:
        return 0
    lo, hi = -1, n  # ext[lo] wholly cached (-1: none known); ext[hi] not (n: none known)
    for k in hints:
        if not lo < k <= hi:
            continue  # ruled out by an earlier hint
        if k > 0:
            h, c = ext[k - 1]
            if get(h, 0) < c:
                hi = k - 1
                continue
            lo = k - 1
        if k == n:
            return n
        h, c = ext[k]
        if get(h, 0) < c:
            return k
        lo = k
    if lo < 0:
        h, c = ext[0]
        if get(h, 0) < c:
            return 0
        lo = 0
    if hi == n and n > 2:
        # A decision's first candidate has no hint; a routed prompt is mostly a cached history
        # plus a short new tail (a conversation's next turn), so try "all" and "all but the
        # last extent" first: 2 lookups there instead of a gallop's 2 log2(n).
        h, c = ext[n - 1]
        if get(h, 0) >= c:
            return n
        h, c = ext[n - 2]
        if get(h, 0) >= c:
            return n - 1
        hi = n - 2
    step = 1
    while True:
        probe = lo + step
        if probe >= hi:
            break
        h, c = ext[probe]
        if get(h, 0) >= c:
            lo = probe
            step += step
        else:
            hi = probe
            break
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        h, c = ext[mid]
        if get(h, 0) >= c:
            lo = mid
        else:
            hi = mid
    return hi


_cum_of: tuple = ((), [])
"""The latest prefix's extents and their running block sums: a decision matches one prefix on
every candidate, so the sums are taken once per decision (one tuple, rebound whole, so that
threads sharing it never pair one prefix's extents with another's sums)."""


def _leading_blocks(ext: "Sequence[tuple[int, int]]", k: int, total: int | None = None) -> int:
    """Blocks in the first ``k`` extents of ``ext`` (``total``: the blocks of all of them, if known)."""
    global _cum_of
    if k == 0:
        return 0
    n = len(ext)
    if n <= 8:
        return sum(map(itemgetter(1), ext[:k]))
    if total is not None and n - k <= 16:  # a long cached head and a short new tail
        return total - sum(map(itemgetter(1), ext[k:]))
    seen, cum = _cum_of
    if seen is not ext:
        cum = list(accumulate(map(itemgetter(1), ext)))
        _cum_of = (ext, cum)
    return cum[k - 1]


# --- optional instance-view methods, with their fallbacks -------------------------------------


def engine_cached_blocks(inst: "InstanceView", prefix: PrefixBlocks | None) -> int | None:
    """Leading blocks of ``prefix`` cached on ``inst`` as its engine's KV events report them.

    Calls the view's optional ``engine_cached_blocks(prefix)`` (precise mode: llm-d precise
    prefix scorer, Dynamo's KV-event indexer), clamped to ``0 .. prefix.num_blocks``; None when
    the view has no such method or its method answers None (routerd: that instance's event index
    is stale, :mod:`routerd.prefix.engine_index`): the caller then uses its approximate index.
    0 for no prefix.
    """
    if prefix is None:
        return 0
    fn = getattr(inst, "engine_cached_blocks", None)
    if fn is None:
        return None
    n = fn(prefix)
    if n is None:
        return None
    n = int(n)
    return 0 if n < 0 else min(n, prefix.num_blocks)


def pending_prefill_tokens(inst: "InstanceView") -> int:
    """Prompt tokens still to prefill on ``inst`` (tokens): waiting plus prefilling.

    The view's optional ``pending_prefill_tokens()`` (net of cache hits and of chunks already
    computed) when it has one; otherwise the sum of ``prompt_tokens`` over residents
    ``in_prefill`` (gross: what a router counts from its own dispatch records).
    """
    fn = getattr(inst, "pending_prefill_tokens", None)
    if fn is not None:
        return int(fn())
    return sum(r.prompt_tokens for r in inst.residents() if r.in_prefill)


def pending_prefill_work(inst: "InstanceView") -> tuple[int, int]:
    """``(tokens, attended)`` still to prefill on ``inst``: tokens, and the sum over requests of
    ``u * (c + u)`` (tokens^2) for ``u`` tokens still to compute after ``c`` done or cached.

    The view's optional ``pending_prefill_work()`` when it has one; else its
    ``pending_prefill_tokens()`` with 0 attended (unknown); else each in-prefill resident's
    whole prompt as ``u`` with nothing done (what a router counts from its own dispatch records).
    """
    fn = getattr(inst, "pending_prefill_work", None)
    if fn is not None:
        t, a = fn()
        return int(t), int(a)
    if getattr(inst, "pending_prefill_tokens", None) is not None:
        return pending_prefill_tokens(inst), 0  # tokens only: the attention part is unknown
    tokens = attended = 0
    for r in inst.residents():
        if r.in_prefill:
            tokens += r.prompt_tokens
            attended += r.prompt_tokens * r.prompt_tokens
    return tokens, attended


PrefixSource = Literal["approximate", "precise"]


def cached_blocks(
    inst: "InstanceView", prefix: PrefixBlocks | None, index: PrefixIndex, source: PrefixSource
) -> int:
    """Leading blocks of ``prefix`` a policy believes cached on ``inst`` (blocks).

    ``precise``: :func:`engine_cached_blocks`, falling back to ``index`` where the view cannot
    answer; ``approximate``: ``index.match``. 0 without a prefix.
    """
    if prefix is None:
        return 0
    if source == "precise":
        n = engine_cached_blocks(inst, prefix)
        if n is not None:
            return n
    return index.match(inst.index, prefix)
