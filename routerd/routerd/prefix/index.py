"""The router-side approximate prefix index: what a router knows from its own dispatches.

llm-d's ``approx-prefix-cache-producer``
(``llm-d/llm-d-router:pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/indexer.go``),
SGLang's approximate radix tree (``sgl-project/sglang:sgl-model-gateway/src/policies/tree.rs``) and
Dynamo's approximate mode (``use_kv_events=false``, ``router_ttl_secs``) all keep, per instance, the
prompts the router sent there, with no feedback from the engine: a prompt is believed cached on an
instance once the router dispatched it there, until the index forgets it.

Here each instance holds ``extent hash -> leading blocks believed cached`` (extents as in
:mod:`routerd.prefix.chain`) in LRU order, bounded by a capacity in blocks. Matching walks the
request's extents (O(extents), not O(blocks)); inserting touches each extent once.

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


class _InstanceIndex:
    """One instance's entries: extent hash -> leading blocks, least recently touched first."""

    __slots__ = ("blocks", "touched", "size", "capacity")

    def __init__(self, capacity: int | None, timed: bool = True) -> None:
        self.blocks: OrderedDict[int, int] = OrderedDict()
        self.touched: dict[int, float] | None = {} if timed else None
        """Last insert time per entry (s), for TTL expiry only; None without a TTL (a third less
        memory per entry and a dict store less per extent inserted)."""
        self.size = 0
        self.capacity = capacity

    def evict_to_capacity(self) -> int:
        """Trim LRU entries until ``size <= capacity``; returns blocks evicted."""
        return self.evict_to(self.capacity)

    def evict_to(self, cap: int | None) -> int:
        """Trim LRU entries until ``size <= cap`` (blocks; None: nothing); returns blocks evicted."""
        if cap is None or self.size <= cap:
            return 0
        evicted = 0
        blocks = self.blocks
        while self.size > cap:
            h, c = next(iter(blocks.items()))
            excess = self.size - cap
            if c <= excess:
                blocks.popitem(last=False)
                if self.touched is not None:
                    del self.touched[h]
                self.size -= c
                evicted += c
            else:
                # Keep the leading blocks: assigning an existing key keeps its LRU position.
                blocks[h] = c - excess
                self.size -= excess
                evicted += excess
        return evicted

    def expire(self, deadline: float) -> None:
        """Drop entries last touched at or before ``deadline`` (s)."""
        blocks, touched = self.blocks, self.touched
        if touched is None:
            return
        while blocks:
            h = next(iter(blocks))
            if touched[h] > deadline:
                break
            self.size -= blocks.pop(h)
            del touched[h]


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
        self.last_insert: tuple[int, int, int] | None = None
        """``(instance, matched blocks, inserted blocks)`` of the latest :meth:`insert` that had
        blocks to insert: how many of the request's leading blocks the index believed cached
        there just before (what routerd's ``phasewise_prefix_match_blocks`` observes). An
        observer may reset it to None before a decision to tell whether the decision inserted."""

    # --- state ----------------------------------------------------------------------------

    def _get(self, instance: int) -> _InstanceIndex:
        idx = self._inst.get(instance)
        if idx is None:
            idx = self._inst[instance] = _InstanceIndex(self._bounded(self.default_capacity), self.ttl_s is not None)
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
        if blocks is not None and blocks <= 0:
            raise ValueError(f"PrefixIndex: capacity limit must be > 0 or None, got {blocks!r}")
        self.hard_limit = blocks
        for idx in self._inst.values():
            idx.capacity = self._bounded(idx.capacity)
            idx.evict_to(blocks)

    def forget(self, instance: int) -> int:
        """Drop every entry of ``instance`` and its capacity (it starts empty, as a new instance);
        returns the blocks dropped (0 for an unknown instance)."""
        idx = self._inst.pop(instance, None)
        return 0 if idx is None else idx.size

    def renumber(self, mapping: dict[int, int]) -> None:
        """Renumber instances after an endpoint table changed: instance ``old`` becomes
        ``mapping[old]``; instances not in ``mapping`` are forgotten.

        Raises:
            ValueError: two old instances mapped to one new instance.
        """
        if len(set(mapping.values())) != len(mapping):
            raise ValueError(f"PrefixIndex.renumber: two instances mapped to one: {mapping}")
        self._inst = {mapping[i]: idx for i, idx in self._inst.items() if i in mapping}

    def instances(self) -> list[int]:
        """Instances that have entries or a capacity."""
        return list(self._inst)

    def has_instance(self, instance: int) -> bool:
        """Whether ``instance`` has been given a capacity or an insert yet."""
        return instance in self._inst

    def set_capacity(self, instance: int, blocks: int | None) -> None:
        """Set ``instance``'s capacity (blocks, > 0; None: unbounded); evicts now if on-insert.

        Raises:
            ValueError: ``blocks`` <= 0.
        """
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
        idx = self._inst.get(instance)
        return 0 if idx is None else idx.size

    def entries(self, instance: int) -> list[tuple[int, int]]:
        """``(extent hash, leading blocks)`` of ``instance``, least recently inserted first."""
        idx = self._inst.get(instance)
        return [] if idx is None else list(idx.blocks.items())

    # --- time -----------------------------------------------------------------------------

    def advance(self, now: float) -> float:
        """Bring the index to time ``now`` (s): run due periodic sweeps and TTL expiry.

        Returns the clock the index now stands at (``max`` of all times seen).

        Call before :meth:`match` at each decision; :meth:`insert` calls it itself. A sweep
        due at ``k * interval`` evicts what was there then: nothing is inserted between the
        sweep time and the first call after it, so one sweep at ``now`` is the same.
        """
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
        idx = self._inst.get(instance)
        if idx is None or not idx.blocks:
            return 0
        ext = prefix.extents
        if len(ext) <= 8:
            m = matched_blocks(ext, idx.blocks)
        else:
            get = idx.blocks.get
            k = _wholly_cached(ext, get)
            m = _leading_blocks(ext, k)
            if k < len(ext):
                m += get(ext[k][0], 0)  # the cached blocks of the first extent not wholly cached
        cap = self.max_blocks
        return m if cap is None or m <= cap else cap

    def insert(self, instance: int, prefix: PrefixBlocks | None, now: float) -> None:
        """Record that ``prefix`` was dispatched to ``instance`` at ``now`` (s).

        Its first ``max_blocks_per_request`` blocks become believed cached and most recently
        used (head extents the most recent); evicts to capacity unless sweeps are periodic.
        """
        now = self.advance(now)
        if prefix is None or prefix.num_blocks == 0:
            return
        idx = self._get(instance)
        cap = self.max_blocks
        items: tuple[tuple[int, int], ...] | list[tuple[int, int]] = prefix.extents
        if cap is not None and prefix.num_blocks > cap:
            items, remaining = [], cap
            for h, n in prefix.extents:
                if remaining <= 0:
                    break
                m = n if n < remaining else remaining
                items.append((h, m))
                remaining -= m
        blocks, touched = idx.blocks, idx.touched
        get = blocks.get
        if len(items) <= 8:
            self._insert_few(instance, idx, items, now)
            return
        # The first ``k`` extents are wholly here, the rest not (and, past extent k, absent:
        # _wholly_cached's invariant), so they are stored in bulk, the same as one extent at a time
        # tail first would store them: absent ones appended deepest first, extent k grown or
        # appended, the cached head moved to the end head last (the most recently used).
        n_items = len(items)
        k = _wholly_cached(items, get)
        head = _leading_blocks(items, k)
        inserted = head
        matched = head
        if k < n_items:
            hk, mk = items[k]
            old = get(hk, 0)
            matched += old
            rest = items[:k:-1]  # extents k+1 .. end, deepest first
            before = len(blocks)
            blocks.update(rest)
            added = sum(map(itemgetter(1), rest))
            inserted += mk + added
            if old:
                blocks[hk] = mk  # old < mk: the whole extent now
                blocks.move_to_end(hk)
            else:
                blocks[hk] = mk
            idx.size += added + mk - old
            if len(blocks) - before != len(rest) + (0 if old else 1):
                # A key already here among the absent ones (a 64-bit hash collision): recount.
                idx.size = sum(blocks.values())
        if k:
            try:
                deque(map(blocks.move_to_end, map(itemgetter(0), items[k - 1::-1])), maxlen=0)
            except KeyError:
                # Not all of the head here after all (prompts whose equal hashes differ in blocks,
                # against the invariant): store it one extent at a time, head last, as a miss would.
                for h, m in items[k - 1::-1]:
                    old = get(h)
                    if old is None:
                        blocks[h] = m
                        idx.size += m
                    else:
                        if m > old:
                            blocks[h] = m
                            idx.size += m - old
                        blocks.move_to_end(h)
        if touched is not None:
            touched.update(zip(map(itemgetter(0), items), repeat(now)))
        self.last_insert = (instance, matched, inserted)
        self._evict_after_insert(idx)

    def _insert_few(self, instance: int, idx: _InstanceIndex, items: "Sequence[tuple[int, int]]",
                    now: float) -> None:
        matched, inserted = _insert_one_at_a_time(idx, items, now)
        self.last_insert = (instance, matched, inserted)
        self._evict_after_insert(idx)

    def _evict_after_insert(self, idx: _InstanceIndex) -> None:
        if self.eviction_interval_s is None:
            idx.evict_to_capacity()
        elif self.hard_limit is not None:
            idx.evict_to(self.hard_limit)


def _insert_one_at_a_time(idx: _InstanceIndex, items: "Sequence[tuple[int, int]]", now: float) -> tuple[int, int]:
    """Store ``items`` in ``idx`` tail first (head last, the most recently used); returns
    ``(matched, inserted)`` blocks. Faster than the bulk path below 9 extents."""
    blocks, touched = idx.blocks, idx.touched
    get = blocks.get
    # Walking tail first, ``matched`` restarts at each extent not wholly cached; after the head
    # it is the leading run of blocks that was cached (matched_blocks' answer).
    matched = inserted = 0
    for h, m in reversed(items):
        inserted += m
        old = get(h)
        if old is None:
            blocks[h] = m
            idx.size += m
            matched = 0
        else:
            if m > old:
                blocks[h] = m
                idx.size += m - old
                matched = old
            else:
                matched += m
            blocks.move_to_end(h)
        if touched is not None:
            touched[h] = now
    return matched, inserted


def _wholly_cached(ext: "Sequence[tuple[int, int]]", get) -> int:
    """How many leading extents of ``ext`` are wholly cached (``get(hash, 0) >= blocks``), by a
    galloping search: O(log k) lookups for ``k`` (about 16 for a 512-extent prompt cached whole,
    1 for a miss at its head) instead of a walk of ``k``.

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
    h, c = ext[0]
    if get(h, 0) < c:
        return 0
    lo, hi, step = 0, n, 1  # ext[lo] wholly cached; ext[hi] not (hi = n: none known)
    while True:
        probe = lo + step
        if probe >= n:
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


def _leading_blocks(ext: "Sequence[tuple[int, int]]", k: int) -> int:
    """Blocks in the first ``k`` extents of ``ext``."""
    global _cum_of
    if k == 0:
        return 0
    if len(ext) <= 8:
        return sum(map(itemgetter(1), ext[:k]))
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
