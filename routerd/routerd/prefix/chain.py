"""A prompt's KV blocks as hash-chain extents.

vLLM V1 caches full blocks only and keys block ``i`` by a hash chain
``hash_i = H(hash_{i-1}, tokens of block i)`` (``vllm/v1/core/kv_cache_utils.py``; facts in
``shared/docs/prefix-routing.md`` §1), so a block is shared exactly when everything before its
last token is equal. Workloads here describe a prompt by *content units* ``(unit id, tokens)``
(a Mooncake ``hash_id`` of 512 tokens, a system prompt, a question, an answer): equal unit id
sequences mean equal text. Block ``j`` (tokens ``16j .. 16j+15``) is then identified by the
unit that holds its last token plus the block's offset inside that unit's run of blocks, and
the unit is identified by the chain hash of all unit ids up to it. One unit's blocks form one
*extent* ``(chain hash, number of blocks)``, and a whole prompt of ``N`` blocks is a handful
of extents instead of ``N`` hashes: that is what keeps the simulator's cost proportional to
events, not blocks (a 100K-token prompt of 512-token units is about 200 extents, not 6,250
block hashes).

A unit whose tokens hold no block's last token gets no extent (its text still enters the
chain hash of the next unit). A partial last unit covers a prefix of the blocks the same unit
id covers in a longer prompt: Mooncake's last ``hash_id`` may cover less than 512 tokens, and
its full blocks are still the first blocks of that id (``prefix-routing.md`` §4).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import xxhash

_PACK = struct.Struct("<Qq").pack
_MASK = (1 << 64) - 1


def chain_hash(parent: int, unit_id: int) -> int:
    """The chain hash (unsigned 64-bit) of ``unit_id`` after a chain ending in ``parent``.

    xxHash64 of the pair (llm-d's approximate index hashes with xxhash64 too,
    ``prefix-routing.md`` §2); deterministic across processes and Python versions, so every
    simulation is reproducible.
    """
    return xxhash.xxh64_intdigest(_PACK(parent & _MASK, unit_id))


@dataclass(frozen=True, slots=True)
class PrefixBlocks:
    """A token sequence's full KV blocks as extents.

    ``extents[k] = (hash, n)``: the next ``n`` blocks are blocks ``0 .. n-1`` of the extent
    keyed ``hash``. Two sequences share their first ``b`` blocks exactly when their extents
    agree up to there (a shorter extent with the same hash is a prefix of a longer one).
    """

    extents: tuple[tuple[int, int], ...]
    num_blocks: int
    """Full blocks in all (the sum of the extents' ``n``)."""
    tail: int = 0
    """Chain hash after the last unit (continues the chain, e.g. into the response)."""
    unit: int = field(default=0, compare=False)
    """Blocks in every extent when they all have the same count (routerd's prompts: one extent
    per ``chunk_blocks`` chunk or per block), else 0. With it the blocks in the first ``k``
    extents are ``k * unit``, found in O(1) by the index's matches instead of a running sum
    over the extents (:func:`routerd.prefix.index._leading_blocks`)."""

    def common_blocks(self, other: "PrefixBlocks") -> int:
        """Leading blocks the two sequences share (blocks)."""
        total = 0
        for (h1, n1), (h2, n2) in zip(self.extents, other.extents):
            if h1 != h2:
                break
            m = n1 if n1 < n2 else n2
            total += m
            if n1 != n2:
                break
        return total


def unit_extents(
    units: Iterable[tuple[int, int]], block_size: int, root: int = 0
) -> tuple[tuple[tuple[int, int], ...], int, int]:
    """Extents of a sequence of content units.

    Args:
        units: ``(unit id, tokens)`` pairs in order; tokens >= 0.
        block_size: KV block size (tokens).
        root: chain hash to start from (0; a model or salt key when several must not share).

    Returns:
        ``(extents, full_blocks, last_chain_hash)``: the extents over the sequence's full
        blocks, their block count, and the chain hash after the last unit (to continue the
        chain with more units).
    """
    out: list[tuple[int, int]] = []
    h = root
    start = 0  # first token of the current unit
    done = 0  # blocks assigned to extents so far
    for uid, n in units:
        h = chain_hash(h, uid)
        start += n
        end_blocks = start // block_size  # blocks whose last token lies before `start`
        k = end_blocks - done
        if k > 0:
            out.append((h, k))
            done = end_blocks
    return tuple(out), done, h


def prefix_blocks(units: Sequence[tuple[int, int]] | None, block_size: int, root: int = 0) -> PrefixBlocks | None:
    """:class:`PrefixBlocks` of a prompt given as content units, or None without units."""
    if units is None:
        return None
    ext, n, tail = unit_extents(units, block_size, root)
    return PrefixBlocks(ext, n, tail)


def sequence_extents(prefix: PrefixBlocks, prompt_tokens: int, response_id: int, output_tokens: int,
                     block_size: int) -> tuple[tuple[int, int], ...]:
    """Extents of a whole sequence: the prompt's, then the response's as one more unit.

    The block that straddles the prompt's end belongs to the response's extent (its last
    token is a response token), so a later prompt that resends this response as a unit
    (a multi-turn session's history) shares those blocks.
    """
    start = prompt_tokens // block_size
    end = (prompt_tokens + output_tokens) // block_size
    if end <= start:
        return prefix.extents
    return prefix.extents + ((chain_hash(prefix.tail, response_id), end - start),)


def matched_blocks(extents: Sequence[tuple[int, int]], cached: "dict[int, int]") -> int:
    """Longest leading run of blocks found in ``cached`` (extent hash -> cached leading blocks)."""
    total = 0
    get = cached.get
    for h, n in extents:
        c = get(h, 0)
        if c >= n:
            total += n
            continue
        total += c
        break
    return total


def shared_extents(
    sequences: Sequence[Sequence[tuple[int, int]] | None], block_size: int, root: int = 0
) -> list[tuple[tuple[tuple[int, int], ...], int] | None]:
    """Extents of many sequences at once, each run of units that every sequence passing
    through it traverses whole merged into one extent (a radix tree's edges).

    Per-unit extents (:func:`unit_extents`) cost the simulator a few operations per unit;
    a 15K-token Mooncake prompt is 30 units, most of them unique to it. Two sequences share
    block ``j`` exactly as they do with per-unit extents: a run ends wherever the set of
    sequences through the next unit differs (a branch, a sequence ending, a partial last
    unit), so a shared run is always shared whole, and a block's key is still the chain hash
    of the run plus its offset. Known from the whole workload (offline), never from the
    future of one request: it is an encoding, not information a policy could use.

    Args:
        sequences: per request its units ``(unit id, tokens)`` (prompt then response), or None.

    Returns:
        Per request ``(extents, shared blocks)``, or None where the sequence is None; the first
        ``shared blocks`` blocks lie on units some other sequence also has (beyond them the
        sequence is alone: pass counts only fall along a path).
    """
    # Trie of unit ids; pass counts per node.
    child: dict[tuple[int, int], int] = {}
    count: list[int] = [0]
    paths: list[list[int] | None] = []
    for seq in sequences:
        if seq is None:
            paths.append(None)
            continue
        node = 0
        path = []
        for uid, _ in seq:
            key = (node, uid)
            nxt = child.get(key)
            if nxt is None:
                nxt = child[key] = len(count)
                count.append(0)
            count[nxt] += 1
            node = nxt
            path.append(node)
        paths.append(path)
    out: list[tuple[tuple[int, int], ...] | None] = []
    for seq, path in zip(sequences, paths):
        if seq is None:
            out.append(None)
            continue
        ext: list[tuple[int, int]] = []
        h = root
        pos = 0
        done = 0
        shared = 0
        last = len(seq) - 1
        for i, (uid, n) in enumerate(seq):
            h = chain_hash(h, uid)
            pos += n
            if i < last and count[path[i + 1]] == count[path[i]]:
                continue  # every sequence through this unit goes on to the next: same run
            end_blocks = pos // block_size
            if end_blocks > done:
                ext.append((h, end_blocks - done))
                done = end_blocks
            if count[path[i]] > 1:
                shared = done
        out.append((tuple(ext), shared))
    return out


def truncate(extents: Sequence[tuple[int, int]], blocks: int, tail: int = 0) -> PrefixBlocks:
    """The first ``blocks`` blocks of ``extents`` as :class:`PrefixBlocks`."""
    out = []
    left = blocks
    for h, n in extents:
        if left <= 0:
            break
        m = n if n < left else left
        out.append((h, m))
        left -= m
    return PrefixBlocks(tuple(out), blocks - max(left, 0), tail)
