"""routerd.prefix.kv_wire: vLLM's KV-event bytes, from hand-built msgpack and from msgspec's own encoding."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from routerd.prefix.kv_wire import (
    DEFAULT_ENDPOINT,
    DEFAULT_TOPIC,
    LAYOUTS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventError,
    decode_batch,
    encode_batch,
    frames,
    parse_frames,
)


def _s(text: str) -> bytes:
    """A msgpack fixstr (< 32 bytes): 0xa0 | length, then the bytes."""
    b = text.encode()
    assert len(b) < 32
    return bytes([0xA0 | len(b)]) + b


def test_defaults_are_vllms():
    # vllm/config/kv_events.py: endpoint "tcp://*:5557", topic "".
    assert DEFAULT_ENDPOINT == "tcp://*:5557"
    assert DEFAULT_TOPIC == ""


def test_hand_built_array_layout_batch_decodes():
    """vLLM <= 0.23: [ts, [events], rank], each event [tag, fields...] (msgpack spec by hand)."""
    toks = bytes(range(16))  # positive fixints 0..15
    payload = (
        b"\x93" + b"\xcb" + struct.pack(">d", 1.5)  # fixarray(3), float64 ts
        + b"\x93"  # three events
        + b"\x98" + _s("BlockStored") + b"\x91\x05" + b"\xc0"  # hashes [5], parent nil
        + b"\xdc\x00\x10" + toks + b"\x10" + b"\xc0" + _s("GPU") + b"\xc0"  # tokens, 16, lora nil, GPU, nil
        + b"\x93" + _s("BlockRemoved") + b"\x91\x05" + _s("GPU")
        + b"\x91" + _s("AllBlocksCleared")
        + b"\x00"  # data_parallel_rank 0
    )
    assert decode_batch(payload) == EventBatch(1.5, [
        BlockStored([5], None, list(range(16)), 16, None, "GPU", None),
        BlockRemoved([5], "GPU"),
        AllBlocksCleared(),
    ], 0)


def test_hand_built_map_layout_batch_decodes_uint64_and_bytes_hashes():
    """vLLM >= 0.24 (PR #42892): events are maps tagged under "type"; hashes uint64 or bin."""
    big = 0xDAB89BAA7B5857C0
    digest = bytes(range(32))
    payload = (
        b"\x93" + b"\xcb" + struct.pack(">d", 2.0) + b"\x92"
        + b"\x87" + _s("type") + _s("BlockStored")
        + _s("block_hashes") + b"\x92" + b"\xcf" + big.to_bytes(8, "big") + b"\xc4\x20" + digest
        + _s("parent_block_hash") + b"\x07"
        + _s("token_ids") + b"\xdc\x00\x20" + b"\xcd\x01\x00" * 32  # uint16 256, 32 times
        + _s("block_size") + b"\x10"
        + _s("lora_id") + b"\xc0"
        + _s("medium") + _s("GPU")
        + b"\x83" + _s("type") + _s("BlockRemoved") + _s("block_hashes") + b"\x91\x07" + _s("medium") + b"\xc0"
        + b"\x01"
    )
    b = decode_batch(payload)
    assert b.ts == 2.0 and b.data_parallel_rank == 1
    assert b.events == [BlockStored([big, digest], 7, [256] * 32, 16, None, "GPU", None), BlockRemoved([7], None)]


# msgspec 0.23.0's encoding of vLLM's structs (field lists as in vllm/distributed/kv_events.py at
# 0181ea3173e5, with array_like on events and batch ("array"), on the batch only ("map") or on
# neither ("map-batch")), of _full() and of EventBatch(12.0, []): an independent encoder.
MSGSPEC = {
    "array": (
        "93cb41d954fc40100000959cab426c6f636b53746f72656492cfdab89baa7b5857c007c0dc0020000102030405060708"
        "090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f10c0a3475055c092c0c000ae66756c6c5f617474656e74696f"
        "6ec09cab426c6f636b53746f72656491c420010101010101010101010101010101010101010101010101010101010101"
        "010107dc0010ce00011170ceffffffffce00011170ceffffffffce00011170ceffffffffce00011170ceffffffffce00"
        "011170ceffffffffce00011170ceffffffffce00011170ceffffffffce00011170ceffffffff10c0a3475055c0c0c0c0"
        "c094ac426c6f636b52656d6f7665649207fba34750550094ac426c6f636b52656d6f7665649103c0c091b0416c6c426c"
        "6f636b73436c656172656400",
        "93cb402800000000000090c0"),
    "map": (
        "93cb41d954fc40100000958ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cfdab89baa"
        "7b5857c007b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc0020000102030405060708090a"
        "0b0c0d0e0f101112131415161718191a1b1c1d1e1faa626c6f636b5f73697a6510a76c6f72615f6964c0a66d65646975"
        "6da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797392c0c0a967726f75705f69647800b26b765f636163"
        "68655f737065635f6b696e64ae66756c6c5f617474656e74696f6e88a474797065ab426c6f636b53746f726564ac626c"
        "6f636b5f68617368657391c4200101010101010101010101010101010101010101010101010101010101010101b17061"
        "72656e745f626c6f636b5f6861736807a9746f6b656e5f696473dc0010ce00011170ceffffffffce00011170ceffffff"
        "ffce00011170ceffffffffce00011170ceffffffffce00011170ceffffffffce00011170ceffffffffce00011170ceff"
        "ffffffce00011170ceffffffffaa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da3475055a96c6f"
        "72615f6e616d65c084a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739207fba66d656469"
        "756da3475055a967726f75705f6964780083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865"
        "739103a66d656469756dc081a474797065b0416c6c426c6f636b73436c656172656400",
        "93cb402800000000000090c0"),
    "map-batch": (
        "83a27473cb41d954fc40100000a66576656e7473958ba474797065ab426c6f636b53746f726564ac626c6f636b5f6861"
        "7368657392cfdab89baa7b5857c007b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc002000"
        "0102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1faa626c6f636b5f73697a6510a76c6f7261"
        "5f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797392c0c0a967726f75705f69"
        "647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e88a474797065ab426c6f63"
        "6b53746f726564ac626c6f636b5f68617368657391c42001010101010101010101010101010101010101010101010101"
        "01010101010101b1706172656e745f626c6f636b5f6861736807a9746f6b656e5f696473dc0010ce00011170ceffffff"
        "ffce00011170ceffffffffce00011170ceffffffffce00011170ceffffffffce00011170ceffffffffce00011170ceff"
        "ffffffce00011170ceffffffffce00011170ceffffffffaa626c6f636b5f73697a6510a76c6f72615f6964c0a66d6564"
        "69756da3475055a96c6f72615f6e616d65c084a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368"
        "65739207fba66d656469756da3475055a967726f75705f6964780083a474797065ac426c6f636b52656d6f766564ac62"
        "6c6f636b5f6861736865739103a66d656469756dc081a474797065b0416c6c426c6f636b73436c6561726564b2646174"
        "615f706172616c6c656c5f72616e6b00",
        "82a27473cb4028000000000000a66576656e747390"),
}


def _full() -> EventBatch:
    return EventBatch(1700000000.25, [
        BlockStored([15760518052499183552, 7], None, list(range(32)), 16, None, "GPU", None,
                    [None, None], 0, "full_attention"),
        BlockStored([b"\x01" * 32], 7, [70000, 2**32 - 1] * 8, 16, None, "GPU", None),
        BlockRemoved([7, -5], "GPU", 0),
        BlockRemoved([3], None),
        AllBlocksCleared(),
    ], 0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_encoding_is_msgspecs_bytes_and_decodes_back(layout):
    full, empty = (bytes.fromhex(h) for h in MSGSPEC[layout])
    assert encode_batch(_full(), layout) == full
    assert encode_batch(EventBatch(12.0, []), layout) == empty
    assert decode_batch(full) == _full()
    assert decode_batch(empty) == EventBatch(12.0, [])


def test_default_layout_is_the_released_map_form():
    assert encode_batch(_full()) == bytes.fromhex(MSGSPEC["map"][0])


_hash = st.one_of(st.integers(-(1 << 63), (1 << 64) - 1), st.binary(min_size=1, max_size=32))
_opt_int = st.one_of(st.none(), st.integers(0, 1 << 31))
_opt_str = st.one_of(st.none(), st.text(max_size=8))
_stored = st.builds(
    BlockStored, st.lists(_hash, max_size=4), st.one_of(st.none(), _hash),
    st.lists(st.integers(0, (1 << 32) - 1), max_size=40), st.integers(1, 64), _opt_int, _opt_str, _opt_str,
    st.one_of(st.none(), st.lists(st.one_of(st.none(), st.lists(st.integers(0, 9), max_size=2)), max_size=3)),
    _opt_int, _opt_str, _opt_int)
_removed = st.builds(BlockRemoved, st.lists(_hash, max_size=4), _opt_str, _opt_int)
_batch = st.builds(EventBatch, st.floats(allow_nan=False),
                   st.lists(st.one_of(_stored, _removed, st.just(AllBlocksCleared())), max_size=5), _opt_int)


@settings(max_examples=150, deadline=None)
@given(_batch, st.sampled_from(LAYOUTS))
def test_round_trip(batch, layout):
    assert decode_batch(encode_batch(batch, layout)) == batch


def test_extra_fields_of_a_newer_vllm_are_ignored():
    stored = ["BlockStored", [1], None, [4] * 16, 16, None, "GPU", None, None, 0, "full_attention", None,
              "locality-x", {"future": 1}]
    removed = ["BlockRemoved", [1], "GPU", 0, [2], "more"]
    b = decode_batch(msgpack.packb([3.0, [stored, removed, ["AllBlocksCleared", 9]], 0, "extra"]))
    assert b.events == [BlockStored([1], None, [4] * 16, 16, None, "GPU", None, None, 0, "full_attention"),
                        BlockRemoved([1], "GPU", 0), AllBlocksCleared()]
    m = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [4] * 16,
         "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "locality": "rack-1",
         "cache_salt": "t"}
    b = decode_batch(msgpack.packb({"ts": 3.0, "events": [m], "data_parallel_rank": 0, "new": [1]}))
    assert b.events == [BlockStored([1], None, [4] * 16, 16, None, "GPU", None)]


def test_older_vllm_shorter_forms_decode():
    # vLLM v0.9 (commit b4e69e0af33f): BlockStored ends at lora_id, BlockRemoved has only hashes,
    # the batch has no data_parallel_rank.
    b = decode_batch(msgpack.packb([1.0, [["BlockStored", [1, 2], None, [0] * 32, 16, None],
                                          ["BlockRemoved", [2]], ["AllBlocksCleared"]]]))
    assert b == EventBatch(1.0, [BlockStored([1, 2], None, [0] * 32, 16), BlockRemoved([2]), AllBlocksCleared()])
    assert b.data_parallel_rank is None


def _ev(*fields):
    return msgpack.packb([1.0, [list(fields)], 0])


_GOOD_STORED = ["BlockStored", [1], None, [1] * 16, 16, None, "GPU", None]


@pytest.mark.parametrize("payload, needle", [
    (b"\xc1", "not one msgpack object"),  # 0xc1 is never used in msgpack
    (bytes.fromhex(MSGSPEC["array"][0])[:-40], "not one msgpack object"),  # truncated
    (bytes.fromhex(MSGSPEC["array"][1]) + b"\x00", "not one msgpack object"),  # trailing bytes
    (b"", "not one msgpack object"),
    (msgpack.packb(5), "batch must be an array or a map, got int"),
    (msgpack.packb([1.0]), "got 1 element"),
    (msgpack.packb({"ts": 1.0}), "batch map lacks events"),
    (msgpack.packb(["now", []]), "batch ts must be a number, got str"),
    (msgpack.packb([True, []]), "batch ts must be a number, got bool"),
    (msgpack.packb([1.0, {"a": 1}]), "batch events must be an array, got dict"),
    (msgpack.packb([1.0, [], "zero"]), "data_parallel_rank must be int or nil, got str"),
    (_ev(), "event 0: empty event array"),
    (_ev("BlockMoved", [1]), "event 0: unknown event type 'BlockMoved' (field 'type')"),
    (_ev(7, [1]), "event tag must be a string, got int"),
    (msgpack.packb([1.0, [5]]), "event 0: an event must be an array or a map, got int"),
    (_ev("BlockStored", [1], None, [1] * 16), "BlockStored needs at least 4 field(s), got 3"),
    (_ev("BlockRemoved"), "BlockRemoved needs at least 1 field(s), got 0"),
    (_ev("BlockStored", 5, None, [1] * 16, 16), "block_hashes must be an array, got int"),
    (_ev("BlockStored", ["abc"], None, [1] * 16, 16), "block_hashes[0]: block hash must be int or bytes, got str"),
    (_ev("BlockStored", [b""], None, [1] * 16, 16), "empty block hash"),
    (_ev("BlockStored", [1], 2.5, [1] * 16, 16), "parent_block_hash: block hash must be int or bytes, got float"),
    (_ev("BlockStored", [1], None, "tokens", 16), "token_ids must be an array, got str"),
    (_ev("BlockStored", [1], None, [1, -3], 16), "token_ids[1]: token id must be a non-negative int, got -3"),
    (_ev("BlockStored", [1], None, [1, "a"], 16), "token_ids[1]: token id must be a non-negative int"),
    (_ev("BlockStored", [1], None, [1] * 16, 0), "block_size must be >= 1, got 0"),
    (_ev("BlockStored", [1], None, [1] * 16, "16"), "block_size must be int, got str"),
    (_ev("BlockStored", [1], None, [1] * 16, 16, "lora"), "lora_id must be int or nil, got str"),
    (_ev("BlockStored", [1], None, [1] * 16, 16, None, 1), "medium must be a string or nil, got int"),
    (_ev("BlockStored", [1], None, [1] * 16, 16, None, "GPU", None, 5), "extra_keys must be an array or nil"),
    (_ev("BlockRemoved", [1], 3), "event 0 (BlockRemoved): medium must be a string or nil, got int"),
    (msgpack.packb([1.0, [{"block_hashes": [1]}]]), "event map has no 'type' tag"),
    (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1]}]]),
     "BlockStored lacks field(s) parent_block_hash, block_size"),
    (msgpack.packb([1.0, [{"type": "Nope"}]]), "unknown event type 'Nope' (field 'type')"),
])
def test_malformed_payloads_raise_a_named_error(payload, needle):
    with pytest.raises(KVEventError) as e:
        decode_batch(payload)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_the_good_event_used_above_decodes():
    # The malformed cases differ from this one in the named field only.
    assert decode_batch(_ev(*_GOOD_STORED)).events == [BlockStored([1], None, [1] * 16, 16, None, "GPU", None)]


def test_frames_are_topic_big_endian_seq_payload():
    assert frames(b"kv@pod", 258, b"p") == [b"kv@pod", b"\x00\x00\x00\x00\x00\x00\x01\x02", b"p"]
    assert parse_frames(frames(b"", (1 << 64) - 1, b"x")) == (b"", (1 << 64) - 1, b"x")
    with pytest.raises(ValueError):
        frames(b"", -1, b"")
    with pytest.raises(ValueError):
        frames(b"", 1 << 64, b"")


@pytest.mark.parametrize("parts, needle", [
    ([b"t", b"\x00" * 8], "expected 3 frames"),
    ([b"t", b"\x00" * 8, b"p", b"q"], "got 4"),
    ([b"t", b"\x00" * 7, b"p"], "must be 8 bytes"),
    ([], "got 0"),
])
def test_malformed_frames_raise(parts, needle):
    with pytest.raises(KVEventError, match=needle):
        parse_frames(parts)


def test_encode_rejects_unknown_layout_and_non_events():
    with pytest.raises(ValueError, match="unknown KV event layout"):
        encode_batch(EventBatch(1.0, []), "json")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not a KV event"):
        encode_batch(EventBatch(1.0, ["BlockStored"]))  # type: ignore[list-item]
