"""Prefix identity of live requests: KV blocks from prompt text or token ids, at routerd's speed.

Offline, a prompt's blocks come from content units (:mod:`routerd.prefix.chain`). Online routerd
has the request's text, and in precise mode its token ids; this module turns either into the
same :class:`~routerd.prefix.chain.PrefixBlocks` the policies read, one extent ``(key, 1)`` per
full block, so one policy implementation serves the simulator and routerd.

Keys are a polynomial hash chain over per-block unit hashes (arithmetic mod 2^64)::

    u_j   = mix(the block's bytes)                      (64-bit, see _unit_hashes)
    key_j = P * key_{j-1} + u_j        key_{-1} = root

so ``key_j`` identifies the whole prefix up to block ``j``, like vLLM's ``hash_i = H(hash_{i-1},
block i)`` (``vllm/v1/core/kv_cache_utils.py``; ``shared/docs/prefix-routing.md`` §1), and the
whole chain is computed with numpy at once (``key_j = P^j * (root * P + sum_{i<=j} u_i * P^-i)``,
P odd hence invertible mod 2^64) instead of one Python call per block: about 50 us for a
32 KB prompt (8K tokens) where a per-block ``xxhash`` loop took 200 us
(``benchmarks/prefix_decision_cost.py``). A router needs identity, not secrecy: these keys are
never compared with vLLM's own hashes (which are seeded per process); precise mode recomputes
keys from the token ids in vLLM's ``BlockStored`` events with :func:`stored_block_key`.

Two identities:

* **approximate** (:func:`text_prefix_blocks`): the prompt's UTF-8 bytes in chunks of
  ``block_size * BYTES_PER_TOKEN`` bytes (the ~4 bytes/token estimate of
  :mod:`routerd.tokens`), llm-d's approximate prefix producer hashing characters in the same way.
* **tokens** (:func:`token_prefix_blocks`): ``block_size`` token ids per block, what vLLM
  caches; :func:`byte_token_ids` is the emulator's deterministic tokenizer (4 bytes per
  token), so the emulator's blocks and routerd's precise keys agree byte for byte.

**Extra keys.** vLLM mixes more than token ids into a block's hash: the LoRA adapter (every
block), the request's ``cache_salt`` (the first block only), multimodal inputs and prompt
embeddings (``vllm/v1/core/kv_cache_utils.py``, ``generate_block_hash_extra_keys``), and
publishes them per block in ``BlockStored.extra_keys`` untagged (``to_event_extra_keys``: the
adapter's name, the salt itself, in that order). Two requests with equal text but another
adapter or salt share no block there, so here neither: a block's unit hash gets
``extra_salt(extra keys)`` added (:func:`extra_salt`, 0 without extra keys), which changes its
key and, through the chain, every key after it. Requests compute their blocks' extra keys with
:func:`request_extra_keys`; the engine index takes them from the events.
"""

from __future__ import annotations

from array import array
from itertools import repeat
from typing import Any, Sequence

import numpy as np
import xxhash

from routerd.prefix.chain import PrefixBlocks
from routerd.tokens import BYTES_PER_TOKEN

_U64 = np.uint64
#: Chain multiplier (odd, so invertible mod 2^64): the 64-bit golden-ratio constant.
P = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
P_INV = pow(P, -1, 1 << 64)
#: Per-word offsets that make a word's position within its block matter.
_WORD_SALT = 0xD6E8FEB86659FD93
#: Powers cached per length (grown on demand).
_pow_cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """``(P^0..P^(n-1), P^-0..P^-(n-1))`` mod 2^64 as uint64 arrays (cached, grown by doubling)."""
    have = max((k for k in _pow_cache if k >= n), default=0)
    if have:
        fw, bw = _pow_cache[have]
        return fw[:n], bw[:n]
    size = 1
    while size < n:
        size *= 2
    fw = np.empty(size, dtype=_U64)
    bw = np.empty(size, dtype=_U64)
    a = b = 1
    for i in range(size):
        fw[i] = a
        bw[i] = b
        a = (a * P) & _MASK
        b = (b * P_INV) & _MASK
    _pow_cache.clear()
    _pow_cache[size] = (fw, bw)
    return fw[:n], bw[:n]


def _fmix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (a bijection with full avalanche)."""
    x = x ^ (x >> _U64(30))
    x = x * _U64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> _U64(27))
    x = x * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def _unit_hashes(words: np.ndarray) -> np.ndarray:
    """Per block (row of ``words``, uint64 ``(blocks, words per block)``) a 64-bit unit hash.

    Each word is multiplied by an odd constant of its position and folded (``v ^= v >> 29``),
    the row summed and the sum finalised with splitmix64's mixer: blocks differing in one
    word never collide (odd multipliers are invertible), and equal words at different
    positions count differently. Two numpy passes over the words, not a hash call per block.
    """
    k = words.shape[1]
    mult = _mults(k)
    v = words * mult
    v ^= v >> _U64(29)
    return _fmix(v.sum(axis=1, dtype=_U64))


_mult_cache: dict[int, np.ndarray] = {}


def _mults(k: int) -> np.ndarray:
    m = _mult_cache.get(k)
    if m is None:
        m = _mult_cache[k] = (np.arange(1, k + 1, dtype=_U64) * _U64(_WORD_SALT)) | _U64(1)
    return m


#: What a block's extra keys may be: None (none), or a sequence of the values vLLM publishes
#: (strings, bytes, numbers, nested sequences such as a multimodal ``(identifier, offset)``).
ExtraKeys = Sequence[Any] | None


def _canonical(x: Any) -> Any:
    # msgpack gives lists where vLLM had tuples: compare the values, not the container type.
    if isinstance(x, (list, tuple)):
        return tuple(_canonical(v) for v in x)
    return x


def extra_salt(extra: ExtraKeys) -> int:
    """The 64-bit value added to a block's unit hash for its extra keys (0: none).

    ``extra`` is a block's entry of vLLM's ``BlockStored.extra_keys`` (a list, or None), or what
    :func:`request_extra_keys` gives a request's block. Lists and tuples compare by value
    (``["a1", "s"]`` and ``("a1", "s")`` give the same salt); an empty sequence is no extra key.
    """
    if not extra:
        return 0
    return xxhash.xxh64_intdigest(repr(_canonical(extra)).encode("utf-8", "backslashreplace")) | 1


def request_extra_keys(lora_name: str | None, cache_salt: str | None, num_blocks: int) -> list[tuple] | None:
    """Per block, the extra keys vLLM publishes for a text-only request's blocks (None: all plain).

    ``vllm/v1/core/kv_cache_utils.py`` ``generate_block_hash_extra_keys``: the LoRA adapter's name
    in every block, then the ``cache_salt`` in block 0 only (``start_token_idx == 0``), untagged
    in events by ``to_event_extra_keys``. Checked against a real vLLM 0.32's events: ``[["a1",
    "s1"], ["a1"], ...]`` for adapter ``a1`` with salt ``s1``, ``[["s1"], None, ...]`` for the
    base model with it.
    """
    if not lora_name and not cache_salt:
        return None
    lora = (lora_name,) if lora_name else ()
    out: list[tuple | None] = [lora or None] * num_blocks
    if num_blocks and cache_salt:
        out[0] = lora + (cache_salt,)
    return out  # type: ignore[return-value]


def _salts(extra_keys: Sequence[ExtraKeys] | None, n: int) -> np.ndarray | None:
    """Per block (n of them) :func:`extra_salt` as uint64, or None when no block has extra keys."""
    if not extra_keys:
        return None
    vals = [extra_salt(extra_keys[j]) if j < len(extra_keys) else 0 for j in range(n)]
    if not any(vals):
        return None
    return np.array(vals, dtype=_U64)


def _chain(units: np.ndarray, root: int, salts: np.ndarray | None = None) -> list[int]:
    """``key_j = P * key_{j-1} + u_j (+ salt_j)`` (mod 2^64) for all j at once; ``key_{-1} = root``."""
    n = len(units)
    if n == 0:
        return []
    if salts is not None:
        units = units + salts[:n]
    fw, bw = _powers(n)
    acc = np.cumsum(units * bw, dtype=_U64)  # uint64 arrays wrap silently: arithmetic mod 2^64
    acc += _U64((root * P) & _MASK)
    acc *= fw
    return acc.tolist()


def _blocks(keys: list[int], per: int = 1) -> PrefixBlocks:
    ext = tuple(zip(keys, repeat(per)))
    return PrefixBlocks(ext, per * len(ext), keys[-1] if keys else 0, per)


def _check(block_size: int, max_blocks: int | None) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if max_blocks is not None and max_blocks < 0:
        raise ValueError(f"max_blocks must be >= 0 or None, got {max_blocks}")


def text_prefix_blocks(text: str | bytes, block_size: int, max_blocks: int | None = None,
                       root: int = 0, chunk_blocks: int = 1) -> PrefixBlocks:
    """The approximate identity of a prompt: its full chunks of ``block_size * 4`` UTF-8 bytes.

    Args:
        text: the prompt (a chat request's rendered messages, :func:`routerd.tokens.chat_prompt_text`);
            a ``str`` is encoded with ``errors="replace"`` (never raises), bytes are used as is.
        block_size: KV block size (tokens); a chunk is ``block_size * BYTES_PER_TOKEN`` bytes.
        max_blocks: only the first this many chunks (None: all); bounds the cost of huge prompts.
        root: key before the first block (e.g. a model's, so two models never share).
        chunk_blocks: blocks per chunk (>= 1): one extent ``(key, chunk_blocks)`` per
            ``chunk_blocks * block_size * 4`` bytes, matched a chunk at a time (coarser, cheaper
            to insert and match; a shared prefix is found to the last whole chunk).

    Returns:
        One extent ``(key, chunk_blocks)`` per full chunk; the partial tail has none.

    Raises:
        ValueError: ``block_size < 1``, ``chunk_blocks < 1`` or ``max_blocks < 0``.
    """
    _check(block_size, max_blocks)
    if chunk_blocks < 1:
        raise ValueError(f"chunk_blocks must be >= 1, got {chunk_blocks}")
    data = text.encode("utf-8", "replace") if isinstance(text, str) else bytes(text)
    chunk = block_size * BYTES_PER_TOKEN * chunk_blocks
    n = len(data) // chunk
    if max_blocks is not None and n > max_blocks // chunk_blocks:
        n = max_blocks // chunk_blocks
    if n == 0:
        return PrefixBlocks((), 0, root)
    # chunk is a multiple of 4; pad each row to whole 8-byte words (block_size odd).
    raw = np.frombuffer(data, dtype=np.uint8, count=n * chunk).reshape(n, chunk)
    if chunk % 8:
        raw = np.concatenate([raw, np.zeros((n, 8 - chunk % 8), dtype=np.uint8)], axis=1)
    words = np.ascontiguousarray(raw).view("<u8").astype(_U64, copy=False)
    return _blocks(_chain(_unit_hashes(words), root), chunk_blocks)


def _token_words(tokens: np.ndarray, block_size: int) -> np.ndarray:
    """``(blocks, words)`` uint64 rows: each block's uint32 token ids, two per word."""
    n = len(tokens) // block_size
    t = tokens[: n * block_size].astype("<u4", copy=False).reshape(n, block_size)
    if block_size % 2:
        t = np.concatenate([t, np.zeros((n, 1), dtype="<u4")], axis=1)
    return np.ascontiguousarray(t).view("<u8").astype(_U64, copy=False)


def _token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """uint32 array of ``token_ids`` (a list converts through ``array('I')``, 2x faster than numpy's)."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1:
            raise ValueError("token ids must be a flat sequence of integers")
        if token_ids.dtype == np.uint32:
            return token_ids
        if token_ids.size and (int(token_ids.min()) < 0 or int(token_ids.max()) >= 1 << 32):
            raise ValueError("token ids must lie in 0 .. 2**32 - 1")
        return token_ids.astype(np.uint32)
    try:
        return np.frombuffer(array("I", token_ids), dtype=np.uint32)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be integers in 0 .. 2**32 - 1 ({e})") from None


def token_prefix_blocks(token_ids: Sequence[int] | np.ndarray, block_size: int, max_blocks: int | None = None,
                        root: int = 0, extra_keys: Sequence[ExtraKeys] | None = None) -> PrefixBlocks:
    """The precise identity of a prompt: one extent per full block of ``block_size`` token ids.

    Keys equal those :func:`stored_block_keys` chains from a vLLM ``BlockStored`` event's token
    ids and extra keys. ``extra_keys``: per block its extra keys (:func:`request_extra_keys`;
    None or a shorter list: none for the blocks not covered).

    Raises:
        ValueError: ``block_size < 1``, ``max_blocks < 0``, or a token id outside 0 .. 2^32 - 1.
    """
    _check(block_size, max_blocks)
    arr = _token_array(token_ids)
    n = len(arr) // block_size
    if max_blocks is not None and n > max_blocks:
        n = max_blocks
    if n == 0:
        return PrefixBlocks((), 0, root)
    units = _unit_hashes(_token_words(arr[: n * block_size], block_size))
    return _blocks(_chain(units, root, _salts(extra_keys, n)))


def block_unit_ids(token_ids: Sequence[int] | np.ndarray, block_size: int) -> list[int]:
    """The 64-bit unit hash ``u_j`` of each full block of ``token_ids`` (the recurrence's input):
    equal blocks have equal unit hashes wherever they stand (for tools that describe prompts as
    content units, e.g. ``benchmarks/prefix_online.py`` handing the simulator the emulator's blocks).

    Raises:
        ValueError: ``block_size < 1`` or a token id outside 0 .. 2^32 - 1.
    """
    _check(block_size, None)
    arr = _token_array(token_ids)
    if len(arr) < block_size:
        return []
    return _unit_hashes(_token_words(arr, block_size)).tolist()


def stored_block_keys(parent_key: int | None, token_ids: Sequence[int] | np.ndarray, block_size: int,
                      extra_keys: Sequence[ExtraKeys] | None = None) -> list[int]:
    """Keys of the full blocks of ``token_ids`` stored after the block keyed ``parent_key``.

    A ``BlockStored`` event carries its blocks' token ids (``block_size`` each), their extra keys
    and its first block's parent; chaining from the parent's key gives the keys
    :func:`token_prefix_blocks` gives the same blocks inside a prompt with the same extra keys.
    ``parent_key`` None: the chain's start (root 0).

    Raises:
        ValueError: a token id outside 0 .. 2^32 - 1, or ``block_size < 1``.
    """
    _check(block_size, None)
    arr = _token_array(token_ids)
    if len(arr) < block_size:
        return []
    units = _unit_hashes(_token_words(arr, block_size))
    return _chain(units, 0 if parent_key is None else parent_key, _salts(extra_keys, len(units)))


def stored_block_key(parent_key: int | None, token_ids: Sequence[int]) -> int:
    """Key of one full block (``len(token_ids)`` tokens) after the block keyed ``parent_key``.

    Raises:
        ValueError: empty ``token_ids`` or a token id outside 0 .. 2^32 - 1.
    """
    if len(token_ids) == 0:
        raise ValueError("a block has at least one token")
    return stored_block_keys(parent_key, token_ids, len(token_ids))[0]


def byte_token_ids(text: str | bytes) -> list[int]:
    """The emulator's deterministic tokenizer: UTF-8 bytes in 4-byte chunks, id = the chunk as a
    little-endian integer (< 2^32; the last chunk may be shorter).

    ``len(byte_token_ids(t)) == routerd.tokens.count_text_tokens(t)`` (an empty text is one token, 0),
    so the emulator's KV accounting and routerd's token estimate agree. Never raises for a ``str``
    (``errors="replace"``).
    """
    return byte_token_array(text).tolist()


def byte_token_array(text: str | bytes) -> np.ndarray:
    """:func:`byte_token_ids` as a uint32 array (what :func:`token_prefix_blocks` takes fastest)."""
    data = text.encode("utf-8", "replace") if isinstance(text, str) else bytes(text)
    if not data:
        return np.zeros(1, dtype=np.uint32)
    pad = (-len(data)) % BYTES_PER_TOKEN
    return np.frombuffer(data + b"\0" * pad, dtype="<u4").astype(np.uint32)
