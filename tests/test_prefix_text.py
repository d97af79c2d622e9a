"""routerd.prefix.text: block keys of live prompts, checked against a pure-Python restatement."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings, strategies as st

from routerd.prefix.text import (
    P,
    byte_token_array,
    byte_token_ids,
    stored_block_key,
    stored_block_keys,
    text_prefix_blocks,
    token_prefix_blocks,
)
from routerd.tokens import count_text_tokens

M = (1 << 64) - 1


def _fmix(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M
    return x ^ (x >> 31)


def _unit(words: list[int]) -> int:
    total = 0
    for k, w in enumerate(words, start=1):
        v = (w * (((k * 0xD6E8FEB86659FD93) & M) | 1)) & M
        v ^= v >> 29
        total = (total + v) & M
    return _fmix(total)


def _ref_keys(block_words: list[list[int]], root: int = 0) -> list[int]:
    """The module docstring's recurrence, one block at a time with Python integers."""
    keys, k = [], root
    for words in block_words:
        k = (P * k + _unit(words)) & M
        keys.append(k)
    return keys


def _text_words(data: bytes, chunk: int) -> list[list[int]]:
    return [list(struct.unpack(f"<{chunk // 8}Q", data[i:i + chunk]))
            for i in range(0, len(data) - chunk + 1, chunk)]


def test_text_keys_equal_the_recurrence_computed_by_hand():
    text = "The quick brown fox jumps over the lazy dog. " * 9  # 405 bytes: 6 chunks of 64
    pb = text_prefix_blocks(text, 16)
    assert pb.num_blocks == 405 // 64 == 6
    assert [h for h, _ in pb.extents] == _ref_keys(_text_words(text.encode(), 64))
    assert all(n == 1 for _, n in pb.extents)
    assert pb.tail == pb.extents[-1][0]


def test_root_enters_every_key():
    text = "x" * 256
    a, b = text_prefix_blocks(text, 16, root=0), text_prefix_blocks(text, 16, root=7)
    assert [h for h, _ in b.extents] == _ref_keys(_text_words(text.encode(), 64), root=7)
    assert a.common_blocks(b) == 0


def test_token_keys_equal_the_recurrence_and_the_stored_event_chain():
    toks = [(i * 7919) % 50_000 for i in range(100)]  # 6 full blocks of 16, 4 left over
    pb = token_prefix_blocks(toks, 16)
    words = [[toks[16 * j + 2 * i] | (toks[16 * j + 2 * i + 1] << 32) for i in range(8)] for j in range(6)]
    assert [h for h, _ in pb.extents] == _ref_keys(words)
    # BlockStored carries token ids and the parent: chaining event by event gives the same keys.
    k, keys = None, []
    for j in range(6):
        k = stored_block_key(k, toks[16 * j:16 * j + 16])
        keys.append(k)
    assert keys == [h for h, _ in pb.extents]
    assert stored_block_keys(keys[1], toks[32:96], 16) == keys[2:]
    assert token_prefix_blocks(toks, 16, max_blocks=2).extents == pb.extents[:2]


def test_odd_block_size_pads_words():
    toks = list(range(45))
    pb = token_prefix_blocks(toks, 15)
    words = [[toks[15 * j + 2 * i] | ((toks[15 * j + 2 * i + 1] if 2 * i + 1 < 15 else 0) << 32) for i in range(8)]
             for j in range(3)]
    assert [h for h, _ in pb.extents] == _ref_keys(words)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=600), st.integers(0, 599))
def test_a_change_at_byte_i_keeps_exactly_the_chunks_before_it(text, i):
    data = text.encode("utf-8", "replace")
    if i >= len(data):
        return
    changed = data[:i] + bytes([data[i] ^ 0x55]) + data[i + 1:]
    a, b = text_prefix_blocks(data, 4), text_prefix_blocks(changed, 4)  # 16-byte chunks
    assert a.common_blocks(b) == min(i // 16, a.num_blocks)
    a4, b4 = text_prefix_blocks(data, 4, chunk_blocks=2), text_prefix_blocks(changed, 4, chunk_blocks=2)
    assert a4.common_blocks(b4) == min(i // 32 * 2, a4.num_blocks)


@settings(max_examples=80, deadline=None)
@given(st.text(max_size=300))
def test_byte_tokenizer_counts_as_routerd_estimates(text):
    ids = byte_token_ids(text)
    assert len(ids) == count_text_tokens(text)
    assert ids == byte_token_array(text).tolist()
    assert all(0 <= t < 1 << 32 for t in ids)


def test_byte_tokenizer_by_hand():
    assert byte_token_ids("") == [0]
    assert byte_token_ids("abcdE") == [int.from_bytes(b"abcd", "little"), ord("E")]
    assert byte_token_ids("\ud800") == [ord("?")]  # a lone surrogate is replaced, never raises


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="block_size"):
        text_prefix_blocks("abc", 0)
    with pytest.raises(ValueError, match="chunk_blocks"):
        text_prefix_blocks("abc", 16, chunk_blocks=0)
    with pytest.raises(ValueError, match="token ids"):
        token_prefix_blocks([1, -1], 1)
    with pytest.raises(ValueError, match="token ids"):
        token_prefix_blocks([1 << 32], 1)
    with pytest.raises(ValueError, match="at least one token"):
        stored_block_key(None, [])
    assert text_prefix_blocks("short", 16).num_blocks == 0
    assert text_prefix_blocks("y" * 640, 16, max_blocks=3).num_blocks == 3
