"""Independent reference for prefix-cache reuse: an infinite cache, requests one after another.

The simulator's fidelity target (issue 13): with one instance, a cache larger than the trace
and requests that do not overlap, its hits must equal the infinite-cache longest-prefix reuse
counted here, per request and in total. This module is deliberately written without
``routerd.prefix.chain`` (no hash chains, no extents): every KV block is an explicit key.

Semantics (vLLM V1 automatic prefix caching, ``shared/docs/prefix-routing.md`` §1):

- A prompt of ``L`` tokens has ``L // B`` full blocks (``B`` = 16); only those are cached.
- Block ``j`` holds tokens ``B j .. B j + B - 1``; its KV depends on every token up to its
  last one, so two prompts share block ``j`` exactly when they agree on tokens
  ``0 .. B j + B - 1``. With prompts given as content units ``(unit id, tokens)`` (equal id
  sequences = equal text; a partial unit is a prefix of that unit's text), that holds when
  the unit-id sequences agree up to and including the unit holding token ``B j + B - 1``.
  The key of block ``j`` is therefore ``(node of that unit-id sequence in a trie, j)``.
- A request hits its longest run of leading blocks already in the cache, capped at
  ``(L - 1) // B`` blocks (the last prompt token is always computed, so a fully cached
  prompt recomputes its last block); then all its full blocks enter the cache.
- With ``responses=True`` the request's answer (unit ``response_id``, ``output_tokens``
  tokens) is appended after it finishes: vLLM holds KV for prompt + output - 1 tokens (the
  last sampled token is never fed back), and its full blocks are cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from routerd.model import Request

BLOCK = 16
# Block indices fit in 24 bits for any prompt below 268M tokens; nodes go in the high bits.
_SHIFT = 24


@dataclass(frozen=True)
class Reuse:
    """Infinite-cache reuse of a request list.

    ``hit_blocks[i]`` / ``blocks[i]``: hit and full blocks of the i-th request in the order
    given (not by id); ``prompt_tokens[i]`` its prompt length.
    """

    hit_blocks: tuple[int, ...]
    blocks: tuple[int, ...]
    prompt_tokens: tuple[int, ...]
    block_size: int

    @property
    def total_hit_blocks(self) -> int:
        return sum(self.hit_blocks)

    @property
    def total_blocks(self) -> int:
        return sum(self.blocks)

    @property
    def block_hit_rate(self) -> float:
        """Hit blocks / full blocks."""
        return self.total_hit_blocks / self.total_blocks

    @property
    def token_hit_rate(self) -> float:
        """Hit tokens / prompt tokens (vLLM's ``prefix_cache_hits / prefix_cache_queries``)."""
        return self.total_hit_blocks * self.block_size / sum(self.prompt_tokens)


class _Trie:
    """Unit-id sequences as integer nodes: node(parent, unit id), root = 0."""

    def __init__(self) -> None:
        self._nodes: dict[tuple[int, int], int] = {}

    def child(self, parent: int, uid: int) -> int:
        key = (parent, uid)
        node = self._nodes.get(key)
        if node is None:
            node = self._nodes[key] = len(self._nodes) + 1
        return node


def _block_keys(units: Sequence[tuple[int, int]], length: int, trie: _Trie, bs: int) -> list[int]:
    """Keys of the ``length // bs`` full blocks of the token sequence ``units`` (first ``length`` tokens)."""
    # The node after each unit, and where each unit ends (exclusive, tokens).
    ends: list[int] = []
    nodes: list[int] = []
    node, pos = 0, 0
    for uid, n in units:
        node = trie.child(node, uid)
        pos += n
        ends.append(pos)
        nodes.append(node)
    keys = []
    u = 0
    for j in range(length // bs):
        last = bs * j + bs - 1
        while ends[u] <= last:
            u += 1
        keys.append((nodes[u] << _SHIFT) | j)
    return keys


def infinite_cache_reuse(
    requests: Sequence[Request], *, block_size: int = BLOCK, responses: bool = False
) -> Reuse:
    """Per-request infinite-cache longest-prefix hits, requests in the order given.

    Pass the requests in arrival order (the loaders return them so). A request without
    ``prefix`` shares nothing: it hits nothing and adds nothing.

    Args:
        requests: requests with ``prefix`` (tokens summing to ``prompt_tokens``).
        block_size: KV block size, tokens.
        responses: also cache each request's answer (needs ``response_id``) after it.
    """
    trie = _Trie()
    cached: set[int] = set()
    hits, blocks, prompts = [], [], []
    for r in requests:
        length = r.prompt_tokens
        prompts.append(length)
        blocks.append(length // block_size)
        if r.prefix is None:
            hits.append(0)
            continue
        assert sum(t for _, t in r.prefix) == length, f"request {r.id}: prefix tokens != prompt_tokens"
        keys = _block_keys(r.prefix, length, trie, block_size)
        cap = (length - 1) // block_size
        h = 0
        while h < cap and keys[h] in cached:
            h += 1
        hits.append(h)
        cached.update(keys)
        if responses and r.response_id is not None:
            seq = tuple(r.prefix) + ((r.response_id, r.output_tokens),)
            cached.update(_block_keys(seq, length + r.output_tokens - 1, trie, block_size))
    return Reuse(tuple(hits), tuple(blocks), tuple(prompts), block_size)


def unit_reuse(requests: Sequence[Request]) -> tuple[int, int]:
    """``(reused units, units)``: infinite-cache longest-prefix reuse counted in whole units.

    A unit is reused when the request's unit-id sequence up to and including it is a prefix
    of an earlier request's sequence (for Mooncake: whole 512-token ids, partial last ids
    counted like full ones). No cap: this is the trace's own statistic
    (``prefix-routing.md`` §4: 64.0% on the Mooncake synthetic trace).
    """
    trie = _Trie()
    seen: set[int] = set()
    reused = total = 0
    for r in requests:
        if r.prefix is None:
            continue
        node, run = 0, True
        for uid, _ in r.prefix:
            node = trie.child(node, uid)
            total += 1
            if run and node in seen:
                reused += 1
            else:
                run = False
            seen.add(node)
    return reused, total
