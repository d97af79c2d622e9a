"""KV-cache events: ZMQ frames, the msgpack schema of every field, parent chaining, LoRA and salt keys.

What vLLM 0.32 publishes (``vllm/distributed/kv_events.py``, ``vllm/v1/core/block_pool.py``,
``vllm/v1/core/kv_cache_utils.py``): multipart ``[topic, seq (8 bytes big-endian), payload]``,
``seq`` counting from 0 per process; the payload a msgpack array ``[ts, events,
data_parallel_rank]`` whose events are maps tagged ``type``. ``BlockStored`` holds the new full
blocks' hashes (64-bit ints), the parent block's hash, their token ids (``block_size`` per
block), ``block_size``, ``lora_id``, ``medium`` "GPU", ``lora_name``, ``extra_keys`` (per block:
None, or the adapter's name in every block and the ``cache_salt`` in block 0, in that order),
``group_idx`` 0 and ``kv_cache_spec_kind`` "full_attention". ``BlockRemoved`` when the cache evicts,
``AllBlocksCleared`` after ``POST /reset_prefix_cache`` (vLLM sends it at the engine's next step).

Tests decode with :func:`routerd.prefix.kv_wire.decode_batch` (routerd's reader) and check the raw
msgpack too. The shared engines are only ever sent prompts of the test's own; eviction, reset
and the first sequence number run on ``small_backend``, a private engine of each kind.
"""

from __future__ import annotations

import uuid

from conformance.backends import SMALL_BLOCKS, SMALL_BS, SMALL_LEN, KVSub, stored_for, unique_ids

from routerd.prefix.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored
from routerd.prefix.text import request_extra_keys, stored_block_keys, token_prefix_blocks

_STORED_KEYS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"}


def _blocks_of(sub: KVSub, ids: list[int], bs: int, n: int) -> list[BlockStored]:
    """Wait for the events storing the ``n`` full blocks of ``ids``; returns them in order."""
    def done(evs):
        return sum(len(e.block_hashes) for e in stored_for(evs, ids, bs)) >= n
    return stored_for(sub.until(done), ids, bs)


def _raw_events(sub: KVSub, type_: str) -> list[dict]:
    return [e for r in sub.received for e in r.raw[1] if e["type"] == type_]


def test_block_stored_schema_frames_and_raw_fields(backend, kv_sub):
    bs = backend.block_size
    ids = unique_ids(2 * bs + 5)
    backend.complete(ids)
    (ev,) = _blocks_of(kv_sub, ids, bs, 2)
    assert ev.token_ids == ids[:2 * bs] and len(ev.token_ids) == len(ev.block_hashes) * bs
    assert ev.parent_block_hash is None and ev.block_size == bs
    assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in ev.block_hashes)
    assert (ev.lora_id, ev.medium, ev.lora_name, ev.extra_keys) == (None, "GPU", None, [None, None])
    assert (ev.group_idx, ev.kv_cache_spec_kind) == (0, "full_attention")
    # Frames and the raw msgpack: [ts, events, rank], every event a tagged map with vLLM's field names.
    seqs = [r.seq for r in kv_sub.received]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    for r in kv_sub.received:
        assert r.topic == b"" and isinstance(r.raw, list) and len(r.raw) == 3
        ts, events, rank = r.raw
        assert isinstance(ts, float) and rank == 0 and isinstance(events, list)
    (raw,) = [e for e in _raw_events(kv_sub, "BlockStored") if e["token_ids"][:bs] == ids[:bs]]
    assert set(raw) == _STORED_KEYS
    assert isinstance(raw["block_hashes"], list) and all(isinstance(h, int) for h in raw["block_hashes"])
    assert raw["parent_block_hash"] is None and raw["block_size"] == bs and raw["medium"] == "GPU"
    assert raw["lora_id"] is None and raw["lora_name"] is None and raw["extra_keys"] == [None, None]
    assert raw["group_idx"] == 0 and raw["kv_cache_spec_kind"] == "full_attention"
    # routerd keys the blocks from their token ids: the same keys as the prompt's own.
    assert stored_block_keys(None, ev.token_ids, bs) == [k for k, _ in token_prefix_blocks(ids, bs).extents]


def test_a_shared_prefix_chains_to_its_parent(backend, kv_sub):
    bs = backend.block_size
    head = unique_ids(bs)
    a = head + unique_ids(bs + 3)
    backend.complete(a)
    first = _blocks_of(kv_sub, a, bs, 2)
    hashes = [h for e in first for h in e.block_hashes]
    b = head + unique_ids(bs + 7)
    out = backend.complete(b)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == bs
    (ev,) = _blocks_of(kv_sub, b[bs:], bs, 1)
    # Only b's new block is stored, chained to the block both prompts share.
    assert ev.token_ids == b[bs:2 * bs] and ev.parent_block_hash == hashes[0]
    assert ev.block_hashes[0] not in hashes


def test_lora_and_cache_salt_extra_keys(backend, kv_sub):
    bs = backend.block_size
    salt = f"s{uuid.uuid4().hex}"
    cases = [("a1", None), ("a2", None), (None, salt), ("a1", salt)]
    for lora, s in cases:
        ids = unique_ids(2 * bs + 1)
        extra = {"cache_salt": s} if s else {}
        if lora:
            extra["model"] = lora
        backend.complete(ids, **extra)
        evs = _blocks_of(kv_sub, ids, bs, 2)
        assert len(evs) == 1, evs
        ev = evs[0]
        want_extra = [list(x) if x is not None else None for x in request_extra_keys(lora, s, 2)]
        assert ev.extra_keys == want_extra, (lora, s, ev.extra_keys)
        assert ev.lora_name == lora and ev.lora_id == ({"a1": 1, "a2": 2}[lora] if lora else None)
        # routerd's keys for the request equal those it chains from the event.
        assert stored_block_keys(None, ev.token_ids, bs, ev.extra_keys) == \
            [k for k, _ in token_prefix_blocks(ids, bs, extra_keys=request_extra_keys(lora, s, 2)).extents]
    raw = [e for e in _raw_events(kv_sub, "BlockStored") if e["lora_name"] == "a1"]
    assert [e["extra_keys"] for e in raw] == [[["a1"], ["a1"]], [["a1", salt], ["a1"]]]


# ---------------------------------------------------------------- a private engine of each kind

def test_private_engine_batches_start_at_zero_with_its_block_size(small_backend):
    sub = KVSub(small_backend.kv_events)
    try:
        sub.wait_connected()
        # The subscription reaches the publisher a moment after the handshake: a batch published
        # before that is lost. Each request here stores its blocks in one batch (one prefill
        # step, a fresh cache: nothing to evict), so the first batch received belongs to request
        # i and must be batch i: the engine numbers its batches from 0.
        for i in range(20):
            ids = unique_ids(3 * SMALL_BS + 2)
            small_backend.complete(ids)
            evs = sub.until(lambda evs: sum(len(e.block_hashes) for e in stored_for(evs, ids, SMALL_BS)) >= 3,
                            1.0, must=False)
            if evs is not None:
                break
        assert evs is not None, "no KV event batch after 20 requests"
        first = sub.received[0]
        assert stored_for(first.batch.events, ids, SMALL_BS) and first.seq == i
        evs = stored_for(evs, ids, SMALL_BS)
        assert [e.block_size for e in evs] == [SMALL_BS] * len(evs)
        assert [t for e in evs for t in e.token_ids] == ids[:3 * SMALL_BS]
    finally:
        sub.close()
    text = small_backend.metrics_text()
    info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert f'block_size="{SMALL_BS}"' in info and f'num_gpu_blocks="{SMALL_BLOCKS}"' in info


def test_a_full_cache_evicts_with_block_removed(small_backend):
    sub = KVSub(small_backend.kv_events)
    try:
        sub.sync(small_backend)
        # Four prompts of 7 full blocks (8 with their last token and output) into a 16-block
        # cache: later ones evict earlier ones.
        full = SMALL_LEN // SMALL_BS - 1
        prompts = [unique_ids(full * SMALL_BS + 1) for _ in range(4)]
        for ids in prompts:
            small_backend.complete(ids)
        events = sub.until(lambda evs: any(isinstance(e, BlockRemoved) for e in evs)
                           and sum(len(e.block_hashes) for e in stored_for(evs, prompts[-1], SMALL_BS)) >= full)
        removed = [e for e in events if isinstance(e, BlockRemoved)]
        assert all(e.medium == "GPU" for e in removed)
        gone = {h for e in removed for h in e.block_hashes}
        # (Blocks of requests before the subscription may be among them: not checked against ours.)
        raw = _raw_events(sub, "BlockRemoved")[0]
        assert set(raw) >= {"type", "block_hashes", "medium"} and all(isinstance(h, int) for h in raw["block_hashes"])
        # The first prompt's first block went first (least recently used): a repeat misses it.
        first_hashes = [h for e in stored_for(events, prompts[0], SMALL_BS) for h in e.block_hashes]
        assert first_hashes[0] in gone
        again = small_backend.complete(prompts[0])
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        sub.close()


def test_reset_prefix_cache_sends_all_blocks_cleared(small_backend):
    sub = KVSub(small_backend.kv_events)
    try:
        sub.sync(small_backend)
        ids = unique_ids(2 * SMALL_BS + 3)
        small_backend.complete(ids)
        _blocks_of(sub, ids, SMALL_BS, 2)
        assert small_backend.request("POST", "/reset_prefix_cache")[0] == 200
        # vLLM sends AllBlocksCleared at its next step: the repeat makes one, and finds nothing cached.
        out = small_backend.complete(ids)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        evs = sub.until(lambda evs: any(isinstance(e, AllBlocksCleared) for e in evs)
                        and len(stored_for(evs, ids, SMALL_BS)) >= 2)
        cleared = next(i for i, e in enumerate(evs) if isinstance(e, AllBlocksCleared))
        restored = [i for i, e in enumerate(evs)
                    if isinstance(e, BlockStored) and e.token_ids[:SMALL_BS] == ids[:SMALL_BS]]
        assert restored[0] < cleared < restored[-1]  # stored, cleared, stored again
        assert _raw_events(sub, "AllBlocksCleared")[0] == {"type": "AllBlocksCleared"}
    finally:
        sub.close()
