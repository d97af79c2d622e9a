"""One engine's prefix cache as its vLLM KV events report it: the state behind precise prefix routing.

vLLM publishes, per scheduler step, a batch of ``BlockStored`` (full blocks became cached, with
their token ids and their first block's parent), ``BlockRemoved`` (blocks evicted) and
``AllBlocksCleared`` (the cache was reset) events (``vllm/distributed/kv_events.py``, wire format
in :mod:`routerd.prefix.kv_wire`; facts in ``shared/docs/prefix-routing.md`` §1). vLLM's block
hashes are seeded per process, so a router cannot recompute them from a request; instead this
index maps each engine block hash to *our* key for the same block, chained from the event's token
ids and the parent's key with :func:`routerd.prefix.text.stored_block_keys`, the keys
:func:`routerd.prefix.text.token_prefix_blocks` gives the same blocks inside a request. A request's
cached prefix on this engine is then its leading run of keys present here (:meth:`cached_blocks`),
exactly vLLM's longest-cached-prefix lookup (whole blocks from the start, stopping at the first
miss). llm-d's precise index does the same engine-key to request-key mapping
(``llm-d/llm-d-kv-cache:pkg/kvevents/pool.go``, ``processEventBatch``); it keeps no sequence
bookkeeping, which is what this module adds.

Multiplicity: vLLM does not de-duplicate cached blocks (``vllm/v1/core/block_pool.py``: two
requests computing the same block in one step cache two physical blocks with one hash, each
with its own ``BlockStored`` and, at eviction, its own ``BlockRemoved``), and different engine
hashes may share one of our keys; so both are counted, and a key is present while any engine
block holds it.

What is tracked: blocks of the device cache (``medium`` None or ``"GPU"``, configurable) of KV
cache group 0 (or no group). Blocks of other media (CPU offload tiers) and other groups (hybrid
models' sliding-window groups, which vLLM evicts on a different rule) are ignored and counted.
Blocks of a LoRA adapter or with extra hash keys (multimodal inputs, ``cache_salt``: vLLM's
``extra_keys``) get keys mixed with those (:func:`routerd.prefix.text.extra_salt`), so neither they
nor their descendants ever match the keys of a request without the same adapter and salt (vLLM
would not give such a request a hit on them either); a request's own extra keys come from
:func:`routerd.prefix.text.request_extra_keys`. An event from a vLLM that sends ``lora_name`` but
no ``extra_keys`` (before v0.2x) gets the adapter's name as every block's extra key.

**Block size.** The index keys blocks in the engine's own block size, learnt from its events
(``BlockStored.block_size``): vLLM's default is 16 on most GPU backends and 128 on its CPU build
(``vllm:cache_config_info``), and a router cannot assume it. ``block_size`` given at construction
is what the configuration expects (None: nothing); the first stored event after an empty state
(a fresh start, a clear, a loss) sets it, and ``on_block_size(expected, reported)`` is called
when that differs from what was expected, so the caller can say so (a warning and a metric,
never a silent drop). Until a batch is seen, :attr:`block_size` is the expected one (None when
unknown). An engine cannot change its block size without a restart, so a stored event with
another size while blocks are held is dropped and counted (``dropped_blocks["block_size"]``).
A request's blocks must be keyed in :attr:`block_size` tokens per block
(``routerd.daemon.prefix.EngineKeyed.at``).

**Staleness** (:attr:`stale`, :attr:`stale_reason`): :meth:`cached_blocks` answers None, and the
caller falls back to its approximate index, whenever the index may claim blocks the engine no
longer has or miss many it has. vLLM's publisher numbers its batches 0, 1, 2, ... per process
(``ZmqEventPublisher``: ``itertools.count()``, 8-byte big-endian frame), and its cache is empty
when a process starts, so the index is *exact* once it has seen every batch since an empty
cache. The reasons, with what happens to the entries:

============== ====================================================== ===========
reason         cause                                                  entries
============== ====================================================== ===========
``no_events``  no batch yet (the initial state; not a transition)     (empty)
``late_join``  the first batch seen has seq > 0: the engine was       cleared
               running before we subscribed
``gap``        seq jumped past the next expected one: batches lost    cleared
               (ZMQ drops at a high-water mark; removals may be lost,
               so entries could be phantoms)
``restart``    seq went back to a value > 0: a new publisher whose    cleared
               first batches we missed
``malformed``  a message we could not decode (its events are lost)    cleared
``unkeyed``    more than ``max_unkeyed_fraction`` of the last         kept
               ``settle_events`` stored events could not be keyed
               (parent unknown, block size not ours, bad token ids):
               the engine is extending blocks we do not know
``silent``     no batch for ``stale_after_s`` although requests with  kept
               uncached blocks were dispatched (:meth:`note_dispatch`):
               the publisher stopped, or events are off
============== ====================================================== ===========

Losing entries only ever makes the index miss blocks (the safe direction: the caller falls back
meanwhile), never claim ones the engine dropped. Recovery, counted by cause in
:attr:`recoveries`:

* ``fresh_start``: a batch with seq 0, first or after a restart (a new engine process, its cache
  empty): cleared and exact from there;
* ``cleared``: an ``AllBlocksCleared`` event (vLLM's ``reset_prefix_cache``; the cache is empty
  right after it): cleared and exact;
* ``settled``: after a ``late_join``, ``gap``, ``restart``, ``malformed`` or ``unkeyed`` loss,
  ``settle_events`` consecutive stored events all keyed. A ``BlockStored`` whose parent we do
  not know is the engine extending a cached block we lost (a request hit it); a clean run of
  them says current traffic hits only blocks we know, so the index answers as an exact one
  would for it. While traffic keeps hitting lost blocks (a hot system prompt cached before we
  joined, which the engine never re-stores) the index stays stale, which is right: it does not
  know them, and the approximate index does;
* ``resumed``: after ``silent``, the next batch in sequence (nothing was lost).

Duplicated batches (same seq and ``ts`` as the last one) are ignored. A seq lower than expected is a
publisher restart (on one ZMQ PUB/SUB connection messages arrive in order; only vLLM's separate
replay socket resends old batches, and it is not used here).

**Memory bound**: at most ``max_blocks`` distinct engine block hashes. At the bound, storing a new
one first forgets the oldest-stored one (counted in ``dropped_blocks["bound"]``): recent blocks are
the likeliest still cached (vLLM evicts least recently used). A forgotten block is only a miss, but
its children then have an unknown parent, so a bound below the engine's real block count (vLLM
logs ``num_gpu_blocks``) shows as ``unkeyed`` staleness. Memory is about 300 bytes per block plus
the engine's hash object (36 bytes for vLLM's default int hashes, 65 for 32-byte digests),
measured with ``tracemalloc`` over 200,000 blocks: about 90 MB at the default bound, whatever the
events.

Time is the ``clock`` given (s, monotonic by default), read only for the ``silent`` rule. Pure
Python and numpy: no ZMQ, no I/O; :mod:`routerd.daemon.kv_events` feeds it.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any, Callable, Iterable

from routerd.prefix.chain import PrefixBlocks
from routerd.prefix.text import stored_block_keys

if TYPE_CHECKING:
    from routerd.prefix.kv_wire import BlockRemoved, BlockStored, EventBatch

__all__ = ["DROP_CAUSES", "ENGINE_LOSSES", "EngineBlockIndex", "RECOVERY_CAUSES", "STALE_REASONS"]

#: Why the index may answer None, in the order of the table in the module docstring.
STALE_REASONS: tuple[str, ...] = ("no_events", "late_join", "gap", "restart", "malformed", "unkeyed", "silent",
                                  "engine_down", "disconnected")
#: How it becomes exact (or good enough) again.
RECOVERY_CAUSES: tuple[str, ...] = ("fresh_start", "cleared", "settled", "resumed")
#: Causes after which the *engine* holds nothing it held before (not only this index): a new
#: process (``fresh_start``, ``restart``), a reset cache (``cleared``), a dead or unreachable one
#: (``engine_down``, ``disconnected``: what it held is gone if it comes back). ``on_loss`` is called
#: with them (and ``cleared``/``fresh_start``), so other indexes forget the engine's blocks too;
#: ``gap``, ``malformed`` and ``late_join`` lose only this index's knowledge.
ENGINE_LOSSES: frozenset[str] = frozenset(("fresh_start", "cleared", "restart", "engine_down", "disconnected"))
#: Why stored blocks were not (or no longer) indexed.
DROP_CAUSES: tuple[str, ...] = ("unknown_parent", "block_size", "token_count", "token_range", "medium", "group",
                                "bound")

_SETTLEABLE = frozenset(("late_join", "gap", "restart", "malformed", "unkeyed", "engine_down", "disconnected"))
_MISSING = -1  # our keys are unsigned 64-bit: never negative


_answers: tuple = ((), ())
"""The latest prompt (its extents) an engine index bisected and where the runs ended, the latest
first, at most :data:`_HINTS`: the hints for the next engine asked about the same prompt (one
tuple, rebound whole, so threads sharing it never pair one prompt with another's answers)."""
#: Answers kept as hints: a decision's engines mostly end at one of a few places (nothing of the
#: prompt, its system prompt, its conversation's history), so three cover them.
_HINTS = 3


class EngineBlockIndex:
    """The blocks one engine instance holds, keyed as requests key theirs, from its KV events.

    Args:
        block_size: the engine's KV block size (tokens) the configuration expects, or None: it is
            learnt from the engine's first stored event either way (see the module docstring).
        max_blocks: most distinct engine block hashes held (see the module docstring); set it
            at least to the engine's ``num_gpu_blocks``.
        stale_after_s: seconds without a batch, after a dispatch that should have stored
            blocks, before the index goes ``silent`` (None: never). A live vLLM publishes within
            one scheduler step of caching a block; a long prefill under load takes seconds.
        settle_events: stored events in the window that both the ``unkeyed`` rule and the
            ``settled`` recovery look at.
        max_unkeyed_fraction: the ``unkeyed`` rule's threshold, in [0, 1] (1: never).
        media: ``medium`` values tracked (compared case-insensitively; None: vLLM versions that
            send none, which is the device cache).
        clock: monotonic seconds.
        on_block_size: called as ``on_block_size(expected, reported)`` when the engine's events
            report a block size other than the one expected (``expected`` None: none was).
        on_loss: called with the cause (one of :data:`ENGINE_LOSSES`) whenever the engine itself
            lost its cached blocks (a restart, a reset, a disconnect), before new ones are indexed.

    Raises:
        ValueError: ``block_size`` (unless None), ``max_blocks`` or ``settle_events`` < 1,
            ``stale_after_s`` <= 0, or ``max_unkeyed_fraction`` outside [0, 1].
    """

    def __init__(
        self,
        block_size: int | None = 16,
        *,
        max_blocks: int = 262_144,
        stale_after_s: float | None = 30.0,
        settle_events: int = 64,
        max_unkeyed_fraction: float = 0.125,
        media: Iterable[str | None] = (None, "GPU"),
        clock: Callable[[], float] = time.monotonic,
        on_block_size: Callable[[int | None, int], None] | None = None,
        on_loss: Callable[[str], None] | None = None,
    ) -> None:
        for name, v in (("block_size", block_size), ("max_blocks", max_blocks), ("settle_events", settle_events)):
            if name == "block_size" and v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"EngineBlockIndex: {name} must be an integer >= 1, got {v!r}")
        if stale_after_s is not None and not stale_after_s > 0:
            raise ValueError(f"EngineBlockIndex: stale_after_s must be > 0 or None, got {stale_after_s!r}")
        if not 0.0 <= max_unkeyed_fraction <= 1.0:
            raise ValueError(f"EngineBlockIndex: max_unkeyed_fraction must lie in [0, 1], got {max_unkeyed_fraction!r}")
        self.block_size: int | None = block_size
        """Tokens per block the index keys in: the engine's (learnt), or the expected one before."""
        self.expected_block_size = block_size
        """What the configuration expected (None: nothing)."""
        self.reported_block_size: int | None = None
        """The block size the engine's events last set (None before its first stored event)."""
        self._on_block_size = on_block_size
        self._on_loss = on_loss
        self._bs_fixed = False  # a stored event set block_size since the last clear
        self.max_blocks = max_blocks
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._media = frozenset(m.upper() if isinstance(m, str) else m for m in media)
        self._unkeyed_limit = int(max_unkeyed_fraction * settle_events)

        # engine block hash -> our key, oldest stored first; copies beyond the first per hash.
        self._by_hash: OrderedDict[Any, int] = OrderedDict()
        self._copies: dict[Any, int] = {}
        # our key -> engine blocks holding it (> 0; absent at 0).
        self._keys: dict[int, int] = {}
        # Per held key its parent key (None: a chain start); per key with held children (held
        # or not) how many; held keys whose parent is not held. With no orphans, presence along
        # any chain is a prefix, which lets cached_blocks bisect.
        self._parent: dict[int, int | None] = {}
        self._children: dict[int, int] = {}
        self._orphans = 0

        self._expected: int | None = None  # next seq expected; None before the first batch
        self._last_ts: float | None = None
        self._loss: str | None = "no_events"
        self._silent = False
        self._awaiting_since: float | None = None  # first dispatch not yet followed by a batch
        self._window: deque[bool] = deque(maxlen=settle_events)  # per stored event: unkeyed?
        self._unkeyed_in_window = 0

        self.stale_transitions: dict[str, int] = dict.fromkeys(STALE_REASONS, 0)
        """Times the index went from answering to stale, by reason (``no_events`` stays 0)."""
        self.recoveries: dict[str, int] = dict.fromkeys(RECOVERY_CAUSES, 0)
        """Times it went from stale to answering, by cause."""
        self.dropped_blocks: dict[str, int] = dict.fromkeys(DROP_CAUSES, 0)
        """Stored blocks not indexed, or forgotten at the bound (``bound``), by cause (blocks)."""
        self.batches_applied = 0
        """Batches whose events were applied (duplicates and malformed messages excluded)."""
        self.batches_missed = 0
        """Batches skipped by sequence gaps (the sum of the gaps' sizes)."""
        self.batches_duplicate = 0
        """Batches ignored as repeats of the previous one."""
        self.batches_malformed = 0
        """Messages that could not be decoded (:meth:`record_malformed`)."""
        self.restarts = 0
        """Sequence numbers going back: publisher restarts."""
        self.removed_unknown = 0
        """``BlockRemoved`` hashes not held (stored before we joined, dropped, or never keyed)."""
        self.hash_conflicts = 0
        """Engine hashes stored again with other content than we keyed them with (replaced)."""
        self.stale_answers = 0
        """:meth:`cached_blocks` calls answered None."""

    # --- what the policies ask ----------------------------------------------------------------

    @property
    def stale(self) -> bool:
        """Whether :meth:`cached_blocks` answers None now (the silence rule is checked by :meth:`check`)."""
        return self._loss is not None or self._silent

    @property
    def stale_reason(self) -> str | None:
        """The current stale reason (one of :data:`STALE_REASONS`), or None while answering."""
        return self._loss if self._loss is not None else ("silent" if self._silent else None)

    def check(self) -> str | None:
        """Apply the ``silent`` rule at the clock's now; returns :attr:`stale_reason`."""
        since = self._awaiting_since
        if (since is not None and not self._silent and self.stale_after_s is not None
                and self._clock() - since >= self.stale_after_s):
            if not self.stale:
                self.stale_transitions["silent"] += 1
            self._silent = True
        return self.stale_reason

    def cached_blocks(self, prefix: PrefixBlocks | None) -> int | None:
        """Leading blocks of ``prefix`` this engine holds (blocks), or None while stale.

        ``prefix``: a request's token-block extents, ``(key, 1)`` each
        (:func:`routerd.prefix.text.token_prefix_blocks` with routerd's ``block_size`` and root
        0); an extent ``(key, n)`` counts ``n`` blocks when its key is present. The run ends at
        the first absent key, as vLLM's lookup does. Cost: O(log n) lookups while no held block
        lacks its parent (:attr:`orphans` is 0; vLLM frees a sequence's tail before its head, so
        this is the usual state), else a walk over the matched blocks. None prefix: 0.
        """
        if self._awaiting_since is not None:
            self.check()
        if self._loss is not None or self._silent:
            self.stale_answers += 1
            return None
        if prefix is None:
            return 0
        keys = self._keys
        ext = prefix.extents
        n = len(ext)
        if n == 0 or ext[0][0] not in keys:
            return 0
        if self._orphans == 0 and prefix.num_blocks == n:
            # Every held key's parent is held, so along a request's chain presence is a prefix:
            # bisect for its end (O(log n) lookups instead of O(n): 9 for an 8K-token prompt).
            if ext[-1][0] in keys:
                return n
            lo, hi = 1, n - 1  # ext[lo - 1] present, ext[hi] absent
            # A decision asks every candidate's engine about one prompt, and engines that hold a
            # conversation or a system prompt end at the same block: try the answers other
            # engines gave first (two lookups when right; a wrong one still narrows the bisection).
            global _answers
            seen, hints = _answers
            if seen is ext:
                for k in hints:
                    if lo <= k <= hi:
                        if ext[k - 1][0] in keys:
                            if ext[k][0] not in keys:
                                return k  # already remembered
                            lo = k + 1
                        else:
                            hi = k - 1
            else:
                hints = ()
                # The first engine asked about a prompt: back from its end, doubling (a
                # conversation's next turn ends a few blocks past its cached history), then
                # bisect what is left.
                step = 1
                while True:
                    j = n - 1 - step
                    if j < lo:
                        break
                    if ext[j][0] in keys:
                        lo = j + 1
                        break
                    hi = j
                    step += step
            while lo < hi:
                mid = (lo + hi) // 2
                if ext[mid][0] in keys:
                    lo = mid + 1
                else:
                    hi = mid
            _answers = (ext, (lo,) + hints[:_HINTS - 1])
            return lo
        total = 0
        for k, m in ext:
            if k not in keys:
                break
            total += m
        return total

    def note_dispatch(self, uncached_blocks: int) -> None:
        """A request was dispatched to this engine with ``uncached_blocks`` full prompt blocks it
        does not hold (blocks): the engine should publish ``BlockStored`` events soon, so the
        ``silent`` clock starts if it is not already running. 0 or less: nothing expected."""
        if uncached_blocks > 0 and self._awaiting_since is None:
            self._awaiting_since = self._clock()

    @property
    def awaiting_for(self) -> float | None:
        """Seconds (this index's clock) since a dispatched request first made the engine due to
        publish ``BlockStored`` events and none came (:meth:`note_dispatch`); None while nothing
        is awaited. What tells an engine that publishes nowhere from one that has had nothing to
        store."""
        since = self._awaiting_since
        return None if since is None else self._clock() - since

    # --- state, for metrics and tests ---------------------------------------------------------

    @property
    def size(self) -> int:
        """Distinct engine block hashes held (what ``max_blocks`` bounds)."""
        return len(self._by_hash)

    @property
    def num_keys(self) -> int:
        """Distinct keys held (<= :attr:`size`)."""
        return len(self._keys)

    @property
    def orphans(self) -> int:
        """Held keys whose parent key is not held (a head evicted before its tail, or forgotten at
        the bound); while > 0, :meth:`cached_blocks` walks instead of bisecting."""
        return self._orphans

    def key_count(self, key: int) -> int:
        """Engine blocks holding ``key`` (0 when absent)."""
        return self._keys.get(key, 0)

    # --- feeding it ---------------------------------------------------------------------------

    def apply(self, batch: "EventBatch", seq: int) -> None:
        """Apply one decoded batch with its ZMQ sequence number (see the module docstring).

        Never raises for well-typed events (what :func:`routerd.prefix.kv_wire.decode_batch`
        returns): events that cannot be keyed are dropped and counted.
        """
        self._awaiting_since = None
        exp = self._expected
        if exp is None:
            if seq == 0:
                self._fresh("fresh_start")
            else:
                self._lose("late_join", clear=True)
        elif seq == exp or (seq == exp - 1 and batch.ts == self._last_ts):
            if self._silent:  # nothing was lost meanwhile: the publisher was only quiet
                self._silent = False
                if self._loss is None:
                    self.recoveries["resumed"] += 1
            if seq != exp:
                self.batches_duplicate += 1
                return
        elif seq > exp:
            self.batches_missed += seq - exp
            self._lose("gap", clear=True)
        else:
            self.restarts += 1
            if seq == 0:
                self._fresh("fresh_start")
            else:
                self._lose("restart", clear=True)
        self._silent = False
        self._expected = seq + 1
        self._last_ts = batch.ts
        for ev in batch.events:
            kind = type(ev).__name__  # vLLM's msgspec tag is the class name as well
            if kind == "BlockStored":
                self._stored(ev)  # type: ignore[arg-type]
            elif kind == "BlockRemoved":
                self._removed(ev)  # type: ignore[arg-type]
            elif kind == "AllBlocksCleared":
                self._fresh("cleared")
        self.batches_applied += 1

    def record_malformed(self, seq: int | None = None) -> None:
        """A message from this engine's publisher could not be decoded; ``seq`` is its sequence
        number when the frames could be parsed (so the next batch is not taken for a gap)."""
        self._awaiting_since = None
        self.batches_malformed += 1
        if seq is not None:
            if self._expected is not None and seq > self._expected:
                self.batches_missed += seq - self._expected
            self._expected = seq + 1
            self._last_ts = None
        self._lose("malformed", clear=True)
        self._silent = False

    def engine_down(self, reason: str = "engine_down") -> None:
        """The engine refused a connection (``engine_down``: the router saw it down) or its
        publisher's connection closed (``disconnected``): whatever it cached may be gone with it
        (a restart starts empty) and batches may be lost, so the index is cleared and stale until
        the publisher numbers from 0 again, clears, or settles. Without this, a dead engine's
        blocks keep winning prefix scores until the ``silent`` rule notices."""
        self._awaiting_since = None
        self._silent = False
        self._lose(reason, clear=True)

    def cleared(self) -> None:
        """The engine's prefix cache was reset by a route routerd sent on (vLLM's
        ``POST /reset_prefix_cache``): forget everything now, as its ``AllBlocksCleared`` event will
        say at the engine's next step. The index stays as exact as it was (nothing is lost that the
        event would not clear too); its ``on_loss`` is called with ``cleared``."""
        self._fresh("cleared")

    # --- internals ----------------------------------------------------------------------------

    def _clear(self) -> None:
        self._bs_fixed = False  # a new engine process (or an empty cache) may have another size
        self._by_hash.clear()
        self._copies.clear()
        self._keys.clear()
        self._parent.clear()
        self._children.clear()
        self._orphans = 0

    def _reset_window(self) -> None:
        self._window.clear()
        self._unkeyed_in_window = 0

    def _lose(self, reason: str, *, clear: bool) -> None:
        if clear:
            self._clear()
            if reason in ENGINE_LOSSES and self._on_loss is not None:
                self._on_loss(reason)
        if not self.stale:
            self.stale_transitions[reason] += 1
        self._loss = reason
        self._reset_window()

    def _fresh(self, cause: str) -> None:
        was = self.stale
        self._clear()
        if self._on_loss is not None:
            self._on_loss(cause)  # a new engine process, or its cache reset: nothing it held is left
        self._loss = None
        self._silent = False
        self._reset_window()
        if was:
            self.recoveries[cause] += 1

    def _record(self, unkeyed: bool) -> None:
        w = self._window
        if len(w) == w.maxlen and w[0]:
            self._unkeyed_in_window -= 1
        w.append(unkeyed)
        if unkeyed:
            self._unkeyed_in_window += 1
        if self._loss is None:
            if self._unkeyed_in_window > self._unkeyed_limit:
                self._lose("unkeyed", clear=False)
        elif self._loss in _SETTLEABLE and self._unkeyed_in_window == 0 and len(w) == w.maxlen:
            self._loss = None
            if not self._silent:
                self.recoveries["settled"] += 1

    def _tracked(self, medium: str | None, group: int | None) -> bool:
        return (medium.upper() if isinstance(medium, str) else medium) in self._media and group in (None, 0)

    def _stored(self, ev: "BlockStored") -> None:
        hashes = ev.block_hashes
        n = len(hashes)
        if n == 0:
            return
        group = getattr(ev, "group_idx", None)
        if not self._tracked(ev.medium, group):
            self.dropped_blocks["medium" if group in (None, 0) else "group"] += n
            return
        bs = self.block_size
        if ev.block_size != bs:
            if self._bs_fixed:
                self._drop("block_size", n)
                return
            bs = self._learn_block_size(ev.block_size)
        self._bs_fixed = True
        if len(ev.token_ids) != n * bs:
            self._drop("token_count", n)
            return
        parent = ev.parent_block_hash
        if parent is None:
            pkey: int | None = None
        else:
            pkey = self._by_hash.get(parent, _MISSING)
            if pkey == _MISSING:
                self._drop("unknown_parent", n)
                return
        try:
            keys = self._keys_of(pkey, ev)
        except ValueError:  # a token id outside 0 .. 2^32 - 1
            self._drop("token_range", n)
            return
        for h, k in zip(hashes, keys):
            self._add(h, k, pkey)
            pkey = k
        self._record(False)

    def _learn_block_size(self, reported: int) -> int:
        """The engine's first stored event since an empty state says its block size: key in it."""
        if self._by_hash:  # entries keyed in another size cannot be compared with new requests
            self._clear()
        self.block_size = reported
        if reported != self.reported_block_size:
            self.reported_block_size = reported
            if reported != self.expected_block_size and self._on_block_size is not None:
                self._on_block_size(self.expected_block_size, reported)
        return reported

    def _drop(self, cause: str, n: int) -> None:
        self.dropped_blocks[cause] += n
        self._record(True)

    def _keys_of(self, pkey: int | None, ev: "BlockStored") -> list[int]:
        extra = getattr(ev, "extra_keys", None)
        if extra is None and (ev.lora_name is not None or ev.lora_id is not None):
            # A vLLM that sends the adapter but no extra_keys: its name salts every block.
            lora = ev.lora_name if ev.lora_name is not None else ev.lora_id
            extra = [(lora,)] * len(ev.block_hashes)
        return stored_block_keys(pkey, ev.token_ids, self.block_size, extra)

    def _add(self, h: Any, k: int, parent: int | None) -> None:
        by_hash = self._by_hash
        old = by_hash.get(h, _MISSING)
        if old == _MISSING:
            if len(by_hash) >= self.max_blocks:
                oh, ok = by_hash.popitem(last=False)
                self._unhold(ok, 1 + self._copies.pop(oh, 0))
                self.dropped_blocks["bound"] += 1
            by_hash[h] = k
        elif old == k:
            self._copies[h] = self._copies.get(h, 0) + 1
            by_hash.move_to_end(h)
        else:
            self.hash_conflicts += 1
            self._unhold(old, 1 + self._copies.pop(h, 0))
            by_hash[h] = k
            by_hash.move_to_end(h)
        keys = self._keys
        c = keys.get(k, 0)
        keys[k] = c + 1
        if c == 0:  # k appears: its parent link, and the orphan count both ways
            self._parent[k] = parent
            if parent is not None:
                if parent not in keys:
                    self._orphans += 1
                self._children[parent] = self._children.get(parent, 0) + 1
            self._orphans -= self._children.get(k, 0)

    def _unhold(self, k: int, copies: int) -> None:
        keys = self._keys
        c = keys[k] - copies
        if c > 0:
            keys[k] = c
            return
        del keys[k]  # k disappears: its held children become orphans
        parent = self._parent.pop(k)
        if parent is not None:
            if parent not in keys:
                self._orphans -= 1
            n = self._children[parent] - 1
            if n:
                self._children[parent] = n
            else:
                del self._children[parent]
        self._orphans += self._children.get(k, 0)

    def _removed(self, ev: "BlockRemoved") -> None:
        if not self._tracked(ev.medium, getattr(ev, "group_idx", None)):
            return
        by_hash, copies = self._by_hash, self._copies
        for h in ev.block_hashes:
            k = by_hash.get(h, _MISSING)
            if k == _MISSING:
                self.removed_unknown += 1
                continue
            c = copies.get(h)
            if c:
                if c == 1:
                    del copies[h]
                else:
                    copies[h] = c - 1
            else:
                del by_hash[h]
            self._unhold(k, 1)
