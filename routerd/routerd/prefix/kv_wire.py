"""vLLM's KV-cache event wire format: msgpack ``EventBatch`` payloads in ZMQ PUB multipart frames.

What vLLM publishes when started with ``--kv-events-config '{"enable_kv_cache_events": true}'``,
restated from its source (read for this module: ``vllm-project/vllm:vllm/distributed/kv_events.py``
at commits ``b4e69e0af33f`` (v0.9 era) and ``0181ea3173e5`` (main, after PR #42892), and
``vllm/config/kv_events.py`` at ``00634b8acf93``); no vLLM code is copied or imported.

Frames (``ZmqEventPublisher._publisher_thread``): one PUB multipart message per batch,
``[topic (UTF-8, default ""), seq (8 bytes, big-endian, unsigned, 0, 1, 2, ... per publisher
process), payload]``. The PUB socket binds when the endpoint has ``*``, ``::``, ``ipc://`` or
``inproc://`` (default ``tcp://*:5557``, data-parallel rank ``r`` at port + r), else connects.

Payload: msgspec Structs with ``omit_defaults=True, gc=False``; events are a tagged union
(``tag=True``: the tag is the class name). Three layouts exist, all decoded here:

* ``"array"`` (vLLM up to v0.23; every struct ``array_like=True``): the batch is
  ``[ts, events, data_parallel_rank]``, an event ``["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx,
  kv_cache_spec_kind, kv_cache_spec_sliding_window]``, ``["BlockRemoved", block_hashes, medium,
  group_idx]``, ``["AllBlocksCleared"]``. msgspec ignores ``omit_defaults`` for array-like
  structs, so every field is written (nil for None); older vLLM versions have fewer fields
  (v0.9: BlockStored stops at ``lora_id``, BlockRemoved at ``block_hashes``, the batch at
  ``events``), so shorter arrays are accepted too.
* ``"map"`` (vLLM PR #42892, in releases from v0.24; a v0.26.0 capture in
  ``volcano-sh/kthena#1535``): the batch is still the positional ``[ts, events, rank]``, each
  event a map ``{"type": "BlockStored", "block_hashes": ..., ...}`` in declaration order,
  fields equal to their default left out.
* ``"map-batch"``: as ``"map"`` with the batch a map too (``{"ts", "events",
  "data_parallel_rank"}``): vLLM main at ``0181ea3173e5`` declares ``EventBatch`` without
  ``array_like``.

Field types: ``ts`` float (s since the epoch); a block hash is ``int`` (vLLM's default
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``: the low 64 bits of the sha256 digest; older versions
sent Python ``hash()`` values, possibly negative) or ``bytes`` (the digest); ``token_ids`` are
the blocks' token ids (``block_size`` per block); ``medium`` is ``"GPU"`` for the device cache.
``ZmqEventPublisher.publish`` fills ``data_parallel_rank`` (0 without data parallelism).

:func:`encode_batch` writes the bytes msgspec writes for those structs (checked against
msgspec in ``tests/test_kv_wire.py``); :func:`decode_batch` reads all three layouts, ignores
fields and trailing elements a newer vLLM may add, and raises :class:`KVEventError` naming what
is wrong. It does not check that ``len(token_ids) == len(block_hashes) * block_size``: a
consumer that chains keys from the token ids checks that itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Union

import msgpack

#: vLLM's ``KVEventsConfig.endpoint`` default (PUB binds on every interface, port 5557).
DEFAULT_ENDPOINT = "tcp://*:5557"
#: vLLM's ``KVEventsConfig.topic`` default (subscribers subscribe to the prefix "": everything).
DEFAULT_TOPIC = ""
#: vLLM's ``KVEventsConfig.hwm`` default (messages queued per subscriber before PUB drops).
DEFAULT_HWM = 100_000
#: ``BlockStored.medium`` / ``BlockRemoved.medium`` of the device (GPU) cache (``MEDIUM_GPU``).
MEDIUM_GPU = "GPU"

Layout = Literal["array", "map", "map-batch"]
LAYOUTS: tuple[str, ...] = ("array", "map", "map-batch")
BlockHash = Union[int, bytes]

_U64 = 1 << 64
_I64_MIN = -(1 << 63)


class KVEventError(ValueError):
    """A KV-event message that is not what vLLM sends; the message names what is wrong."""


class UnknownEventType(KVEventError):
    """An event whose type tag this decoder does not know (a newer vLLM's, or garbage): the batch
    is not applied in part (its other events may depend on the unknown one). ``tag``: the tag."""

    def __init__(self, message: str, tag: str) -> None:
        super().__init__(message)
        self.tag = tag


@dataclass(slots=True)
class BlockStored:
    """Full blocks became cached: ``block_hashes[i]`` holds ``token_ids[i*block_size:(i+1)*block_size]``.

    ``parent_block_hash`` is the hash of the block before the first one (None: they start a
    sequence). Fields after ``lora_name`` are vLLM's later additions (None when absent).
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    """Per block, the extra hash keys (multimodal ids, LoRA name, cache_salt) or None."""
    group_idx: int | None = None
    """KV cache group (hybrid models); 0 for a single full-attention group."""
    kv_cache_spec_kind: str | None = None
    """e.g. ``"full_attention"``, ``"sliding_window"``."""
    kv_cache_spec_sliding_window: int | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Blocks were evicted (their hashes are no longer hits)."""

    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped (``POST /reset_prefix_cache``, or a restart's first state)."""


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(slots=True)
class EventBatch:
    """One engine step's events, in order. ``ts``: seconds since the epoch."""

    ts: float
    events: list[Event] = field(default_factory=list)
    data_parallel_rank: int | None = None


# Field order (declaration order in vLLM) and how many are required (no default in vLLM).
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
_STORED_REQUIRED = 7  # through lora_name: vLLM declares them without defaults
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_REMOVED_REQUIRED = 2
_BATCH_FIELDS = ("ts", "events", "data_parallel_rank")
_TAGS = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}
_SPEC = {BlockStored: (_STORED_FIELDS, _STORED_REQUIRED), BlockRemoved: (_REMOVED_FIELDS, _REMOVED_REQUIRED),
         AllBlocksCleared: ((), 0)}
#: Fields a consumer cannot do without: older vLLM versions send fewer trailing ones.
_MIN_ARITY = {BlockStored: 4, BlockRemoved: 1, AllBlocksCleared: 0}


# --------------------------------------------------------------------------- encoding
def _event_obj(ev: Event, layout: str) -> Any:
    cls = type(ev)
    try:
        names, required = _SPEC[cls]
    except KeyError:
        raise TypeError(f"not a KV event: {ev!r}") from None
    tag = cls.__name__
    values = [getattr(ev, n) for n in names]
    if layout == "array":
        # msgspec ignores omit_defaults for array_like structs: every field is written.
        return [tag, *values]
    out: dict[str, Any] = {"type": tag}
    for i, (name, v) in enumerate(zip(names, values)):
        if v is None and i >= required:
            continue
        out[name] = v
    return out


def encode_batch(batch: EventBatch, layout: Layout = "map") -> bytes:
    """The payload bytes vLLM's publisher writes for ``batch`` in ``layout`` (see the module docstring).

    Raises:
        ValueError: unknown ``layout``.
        TypeError: an event that is not one of this module's event classes.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown KV event layout {layout!r} (one of {', '.join(LAYOUTS)})")
    events = [_event_obj(ev, layout) for ev in batch.events]
    ts = float(batch.ts)
    obj: Any
    if layout == "map-batch":
        obj = {"ts": ts, "events": events}
        if batch.data_parallel_rank is not None:
            obj["data_parallel_rank"] = batch.data_parallel_rank
    else:
        obj = [ts, events, batch.data_parallel_rank]  # array_like: written even when None
    return msgpack.packb(obj, use_bin_type=True)


def frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """vLLM's PUB multipart message: ``[topic, seq as 8 bytes big-endian, payload]``.

    Raises:
        ValueError: ``seq`` outside 0 .. 2^64 - 1.
    """
    if not 0 <= seq < _U64:
        raise ValueError(f"sequence number must lie in 0 .. 2**64 - 1, got {seq}")
    return [bytes(topic), seq.to_bytes(8, "big"), bytes(payload)]


# --------------------------------------------------------------------------- decoding
def parse_frames(parts: list[bytes]) -> tuple[bytes, int, bytes]:
    """``(topic, seq, payload)`` of one received multipart message.

    Raises:
        KVEventError: not 3 frames, or a sequence frame that is not 8 bytes.
    """
    if len(parts) != 3:
        raise KVEventError(f"expected 3 frames [topic, seq, payload], got {len(parts)}")
    topic, seq, payload = (bytes(p) for p in parts)
    if len(seq) != 8:
        raise KVEventError(f"sequence frame must be 8 bytes (big-endian), got {len(seq)}")
    return topic, int.from_bytes(seq, "big"), payload


def _kind(v: Any) -> str:
    return "nil" if v is None else type(v).__name__


def _hash(v: Any, where: str) -> BlockHash:
    if isinstance(v, bytes):
        if not v:
            raise KVEventError(f"{where}: empty block hash")
        return v
    if isinstance(v, int) and not isinstance(v, bool):
        if not _I64_MIN <= v < _U64:
            raise KVEventError(f"{where}: block hash {v} outside the 64-bit range")
        return v
    raise KVEventError(f"{where}: block hash must be int or bytes, got {_kind(v)}")


def _hashes(v: Any, where: str) -> list[BlockHash]:
    if not isinstance(v, list):
        raise KVEventError(f"{where}: block_hashes must be an array, got {_kind(v)}")
    return [_hash(x, f"{where}.block_hashes[{i}]") for i, x in enumerate(v)]


def _int(v: Any, where: str, name: str, optional: bool = True) -> int | None:
    if v is None and optional:
        return None
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    raise KVEventError(f"{where}: {name} must be {'int or nil' if optional else 'int'}, got {_kind(v)}")


def _str(v: Any, where: str, name: str) -> str | None:
    if v is None or isinstance(v, str):
        return v
    raise KVEventError(f"{where}: {name} must be a string or nil, got {_kind(v)}")


def _stored(f: dict[str, Any], where: str) -> BlockStored:
    hashes = _hashes(f["block_hashes"], where)
    parent = f["parent_block_hash"]
    if parent is not None:
        parent = _hash(parent, f"{where}.parent_block_hash")
    toks = f["token_ids"]
    if not isinstance(toks, list):
        raise KVEventError(f"{where}: token_ids must be an array, got {_kind(toks)}")
    for i, t in enumerate(toks):
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise KVEventError(f"{where}.token_ids[{i}]: token id must be a non-negative int, got {t!r}")
    bs = _int(f["block_size"], where, "block_size", optional=False)
    if bs is None or bs < 1:
        raise KVEventError(f"{where}: block_size must be >= 1, got {bs}")
    extra = f.get("extra_keys")
    if extra is not None and not isinstance(extra, list):
        raise KVEventError(f"{where}: extra_keys must be an array or nil, got {_kind(extra)}")
    return BlockStored(hashes, parent, toks, bs, _int(f.get("lora_id"), where, "lora_id"),
                       _str(f.get("medium"), where, "medium"), _str(f.get("lora_name"), where, "lora_name"),
                       extra, _int(f.get("group_idx"), where, "group_idx"),
                       _str(f.get("kv_cache_spec_kind"), where, "kv_cache_spec_kind"),
                       _int(f.get("kv_cache_spec_sliding_window"), where, "kv_cache_spec_sliding_window"))


def _removed(f: dict[str, Any], where: str) -> BlockRemoved:
    return BlockRemoved(_hashes(f["block_hashes"], where), _str(f.get("medium"), where, "medium"),
                        _int(f.get("group_idx"), where, "group_idx"))


def _event(obj: Any, where: str) -> Event:
    if isinstance(obj, list):
        if not obj:
            raise KVEventError(f"{where}: empty event array (no tag)")
        tag, values = obj[0], obj[1:]
        if not isinstance(tag, str):
            raise KVEventError(f"{where}: event tag must be a string, got {_kind(tag)}")
        cls = _TAGS.get(tag)
        if cls is None:
            raise UnknownEventType(f"{where}: unknown event type {tag!r} (field 'type')", tag)
        names = _SPEC[cls][0]
        if len(values) < _MIN_ARITY[cls]:
            raise KVEventError(f"{where}: {tag} needs at least {_MIN_ARITY[cls]} field(s), got {len(values)}")
        fields = dict(zip(names, values))  # extra trailing values (a newer vLLM) are ignored
    elif isinstance(obj, dict):
        tag = obj.get("type")
        if tag is None:
            raise KVEventError(f"{where}: event map has no 'type' tag")
        if not isinstance(tag, str):
            raise KVEventError(f"{where}: event tag must be a string, got {_kind(tag)}")
        cls = _TAGS.get(tag)
        if cls is None:
            raise UnknownEventType(f"{where}: unknown event type {tag!r} (field 'type')", tag)
        names = _SPEC[cls][0]
        missing = [n for n in names[:_MIN_ARITY[cls]] if n not in obj]
        if missing:
            raise KVEventError(f"{where}: {tag} lacks field(s) {', '.join(missing)}")
        fields = obj
    else:
        raise KVEventError(f"{where}: an event must be an array or a map, got {_kind(obj)}")
    if cls is BlockStored:
        return _stored(fields, f"{where} ({tag})")
    if cls is BlockRemoved:
        return _removed(fields, f"{where} ({tag})")
    return AllBlocksCleared()


def decode_batch(payload: bytes) -> EventBatch:
    """The :class:`EventBatch` in one payload (any of the three layouts).

    Raises:
        KVEventError: not msgpack (or trailing bytes after it), a batch that is neither
            ``[ts, events, ...]`` nor a map with ``ts`` and ``events``, an unknown event tag, too
            few fields, or a field of the wrong type; the message names the event and field.
    """
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises ValueError, ExtraData, FormatError, StackError, ...
        raise KVEventError(f"payload is not one msgpack object ({type(e).__name__}: {e})") from None
    if isinstance(obj, list):
        if len(obj) < 2:
            raise KVEventError(f"batch must be [ts, events, data_parallel_rank], got {len(obj)} element(s)")
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) > 2 else None
    elif isinstance(obj, dict):
        missing = [k for k in _BATCH_FIELDS[:2] if k not in obj]
        if missing:
            raise KVEventError(f"batch map lacks {', '.join(missing)}")
        ts, events, rank = obj["ts"], obj["events"], obj.get("data_parallel_rank")
    else:
        raise KVEventError(f"batch must be an array or a map, got {_kind(obj)}")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise KVEventError(f"batch ts must be a number, got {_kind(ts)}")
    if not isinstance(events, list):
        raise KVEventError(f"batch events must be an array, got {_kind(events)}")
    rank = _int(rank, "batch", "data_parallel_rank")
    return EventBatch(float(ts), [_event(e, f"event {i}") for i, e in enumerate(events)], rank)
