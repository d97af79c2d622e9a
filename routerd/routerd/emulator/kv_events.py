"""The emulator's KV-cache events: vLLM's ``--kv-events-config`` and ZMQ publisher, fed by the simulator.

What vLLM does with ``--kv-events-config '{"enable_kv_cache_events": true}'`` (read in
``vllm-project/vllm``: ``vllm/config/kv_events.py``, ``vllm/distributed/kv_events.py``,
``vllm/v1/core/block_pool.py`` and ``kv_cache_utils.py``; the wire format is
:mod:`routerd.prefix.kv_wire`), and what the emulator does the same way:

* A PUB socket on ``endpoint`` (default ``tcp://*:5557``; bound when it has ``*``, ``::``,
  ``ipc://`` or ``inproc://``, connected otherwise), high-water mark ``hwm``; each engine step
  that changed the cache publishes one ``EventBatch`` as ``[topic, seq, payload]``, ``seq``
  counting from 0 in each process (a restarted engine starts again at 0).
* ``BlockStored`` when full blocks become cached, with their token ids, the parent block's
  hash, ``block_size``, ``lora_id`` (the adapter's 1-based position in ``--lora-modules``, None
  for the base model), ``medium`` "GPU", ``lora_name`` and, as vLLM 0.32, ``extra_keys`` per block
  (None, or the adapter's name in every block and the request's ``cache_salt`` in block 0, in
  the order ``[lora_name, cache_salt]``: ``vllm/v1/core/kv_cache_utils.py``,
  ``generate_block_hash_extra_keys``), ``group_idx`` 0, ``kv_cache_spec_kind``
  "full_attention"; consecutive blocks of one sequence stored in one step form one event
  (checked against a real vLLM 0.32: ``[["a1", "s2"], ["a1"]]`` for adapter ``a1`` with salt
  ``s2``). ``BlockRemoved`` per evicted block. ``AllBlocksCleared`` when
  ``POST /reset_prefix_cache`` succeeds.
* Block hashes are what vLLM's default ``sha256`` would give in spirit: a chain
  ``d_i = sha256(d_{i-1} || token ids of block i as uint32 LE || repr(extra keys of block i))``
  from a seed drawn at random per process (from ``PYTHONHASHSEED`` when set, as vLLM's
  ``init_none_hash``), sent as the low 64 bits as an int (vLLM's default
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``). Not vLLM's exact bytes (it hashes a pickled tuple)
  and never equal across processes: a consumer must key blocks by the token ids and extra keys
  (:func:`routerd.prefix.text.stored_block_keys`), not by these hashes.

Which blocks are cached and when they are evicted is the simulator's prefix cache
(:mod:`routerd.prefix.cache`, vLLM V1's block pool), through its listener. Only prompt blocks
have identity: blocks holding generated tokens are never cached (see
:mod:`routerd.emulator.engine`). Evictions are reported when the cache applies them, at its next
operation (an admission, a prefill chunk, a release), so a ``BlockRemoved`` may come a step or a
decode segment after the allocation that caused it; a hit is never reported for a block the
simulator no longer holds.

Publishing never blocks the engine: PUB sends do not wait (a slow subscriber loses messages past
the high-water mark, as with vLLM), and a send that fails is counted and logged once.
The replay socket (``replay_endpoint``) is not emulated.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import time
from typing import Literal

import numpy as np
import zmq
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from routerd.errors import ConfigError
from routerd.prefix.kv_wire import (
    DEFAULT_ENDPOINT,
    DEFAULT_HWM,
    DEFAULT_TOPIC,
    LAYOUTS,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    encode_batch,
    frames,
)

log = logging.getLogger(__name__)

_U64 = (1 << 64) - 1
#: struct unpackers of blocks of common sizes (faster than numpy for 16 ints)
_UNPACK = {n: struct.Struct(f"<{n}I").unpack for n in (8, 16, 32, 64, 128, 256)}


class KVEventsConfig(BaseModel):
    """vLLM's ``KVEventsConfig`` (``vllm/config/kv_events.py``): the same keys and defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable_kv_cache_events: bool = False
    """Publish KV-cache events (block stored / removed / all cleared)."""
    publisher: Literal["null", "zmq"] | None = None
    """``"zmq"`` or ``"null"`` (publish nothing); unset: ``"zmq"`` when events are enabled."""
    endpoint: str = DEFAULT_ENDPOINT
    """ZMQ PUB endpoint: bound when it holds ``*``, ``::``, ``ipc://`` or ``inproc://``, else connected."""
    replay_endpoint: str | None = None
    """vLLM's ROUTER socket for replaying missed batches; not emulated (must stay unset)."""
    buffer_steps: int = Field(default=10_000, ge=0)
    """Batches vLLM keeps for replay (accepted; unused without a replay socket)."""
    hwm: int = Field(default=DEFAULT_HWM, ge=0)
    """ZMQ send high-water mark (messages per subscriber queued before PUB drops)."""
    max_queue_size: int = Field(default=100_000, ge=1)
    """vLLM's publisher-thread queue bound (accepted; the emulator sends from the engine, no queue)."""
    topic: str = DEFAULT_TOPIC
    """Topic frame of every message (subscribers filter by prefix)."""

    @model_validator(mode="after")
    def _no_replay(self) -> "KVEventsConfig":
        if self.replay_endpoint is not None:
            raise ValueError("replay_endpoint is not supported by the emulator (it has no replay socket)")
        return self

    @property
    def active(self) -> bool:
        """True when events are published: enabled, and the publisher ``"zmq"`` or unset (vLLM's
        ``EventPublisherFactory.create`` gives the null publisher otherwise)."""
        return self.enable_kv_cache_events and self.publisher in (None, "zmq")


def parse_kv_events_config(text: str, where: str = "--kv-events-config") -> KVEventsConfig:
    """``--kv-events-config`` JSON (vLLM's keys) as :class:`KVEventsConfig`.

    Raises:
        ConfigError: not JSON, not an object, an unknown key or a bad value (names ``where``).
    """
    try:
        return KVEventsConfig.model_validate_json(text)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "value"
        raise ConfigError(f"{where}: {loc}: {err['msg']}") from None


class _Meta:
    """What one request's blocks carry besides token ids: per-block extra keys and its LoRA adapter."""

    __slots__ = ("extra_keys", "lora_name", "lora_id")

    def __init__(self, extra_keys: list | None, lora: tuple[str, int] | None) -> None:
        self.extra_keys = extra_keys
        self.lora_name, self.lora_id = lora if lora is not None else (None, None)

    def block_extra(self, j: int):
        """Block ``j``'s extra keys (a tuple or list), or None."""
        ek = self.extra_keys
        return ek[j] if ek is not None and j < len(ek) else None


_PLAIN = _Meta(None, None)


class BlockTracker:
    """The prefix cache's listener: turns its stored/removed/cleared calls into vLLM events.

    The engine tells it each request's prompt blocks (:meth:`track`, keys from
    :func:`routerd.prefix.text.token_prefix_blocks`, one block per extent, with the request's
    per-block extra keys and LoRA adapter) and forgets them when
    the request has left the cache (:meth:`untrack`). Memory: one entry per block of a live
    request (reference counted) plus one per cached block (at most the cache's blocks), each
    dropped when its request leaves or its block is evicted.

    Args:
        block_size: tokens per block.
        seed: chain seed (bytes); default: ``PYTHONHASHSEED`` if set, else 32 random bytes.
    """

    def __init__(self, block_size: int, seed: bytes | None = None) -> None:
        self.bs = block_size
        if seed is None:
            env = os.environ.get("PYTHONHASHSEED")
            seed = env.encode() if env else os.urandom(32)
        self._none_hash = hashlib.sha256(b"phasewise-emulator" + seed).digest()
        # key -> [parent key or None, a request's token ids (little-endian uint32), block index,
        # live requests, the request's _Meta]
        self._pending: dict[int, list] = {}
        # key -> (sha256 digest, the int hash sent), for blocks the cache holds
        self._cached: dict[int, tuple[bytes, int]] = {}
        self.events: list[Event] = []
        """Events since the last :meth:`take`, in order."""
        self.anomalies = 0
        """Listener calls for blocks it was not told about (a bug elsewhere; counted, never raised)."""

    # -- requests
    def track(self, keys: list[int], tokens: np.ndarray, extra_keys: list | None = None,
              lora: tuple[str, int] | None = None) -> None:
        """A request with prompt block keys ``keys`` (block ``j`` = ``tokens[j*bs:(j+1)*bs]``) arrived.

        ``extra_keys``: per block the extra keys vLLM hashes in and publishes
        (:func:`routerd.prefix.text.request_extra_keys`; None: none); ``lora``: ``(name, id)`` of
        its adapter, None for the base model. Both must be what ``keys`` were computed with.
        """
        pending = self._pending
        get = pending.get
        tokens = np.ascontiguousarray(tokens, dtype="<u4")
        meta = _PLAIN if extra_keys is None and lora is None else _Meta(extra_keys, lora)
        parent = None
        for j, k in enumerate(keys):
            e = get(k)
            if e is None:
                pending[k] = [parent, tokens, j, 1, meta]
            else:
                e[3] += 1
            parent = k

    def untrack(self, keys: list[int]) -> None:
        """The request of :meth:`track` left the cache (finished, aborted, released)."""
        pending = self._pending
        get = pending.get
        for k in keys:
            e = get(k)
            if e is None:
                continue
            if e[3] <= 1:
                del pending[k]
            else:
                e[3] -= 1

    @property
    def sizes(self) -> tuple[int, int]:
        """``(blocks of live requests, cached blocks)`` held in memory."""
        return len(self._pending), len(self._cached)

    # -- engine hashes
    def _digest(self, key: int) -> bytes | None:
        """The chain digest of the block keyed ``key`` (cached, or computed from pending blocks)."""
        chain = []
        k: int | None = key
        while k is not None:
            c = self._cached.get(k)
            if c is not None:
                d = c[0]
                break
            e = self._pending.get(k)
            if e is None:
                return None
            chain.append(e)
            k = e[0]
        else:
            d = self._none_hash
        for e in reversed(chain):
            d = hashlib.sha256(d + self._hash_input(e)).digest()
        return d

    def _block_bytes(self, e: list) -> bytes:
        j, bs = e[2], self.bs
        return e[1][j * bs:(j + 1) * bs].tobytes()

    def _hash_input(self, e: list) -> bytes:
        """A block's token bytes, then its extra keys (so an adapter's or salted block hashes apart)."""
        raw = self._block_bytes(e)
        extra = e[4].block_extra(e[2])
        return raw if extra is None else raw + repr(tuple(extra)).encode("utf-8", "backslashreplace")

    # -- CacheListener
    def stored(self, h: int, lo: int, hi: int) -> None:
        """Block ``h`` became cached (``lo, hi == 0, 1``: one block per extent)."""
        e = self._pending.get(h)
        if e is None or lo != 0 or hi != 1:
            self.anomalies += 1
            return
        parent_key = e[0]
        if parent_key is None:
            pd, parent_ext = self._none_hash, None
        else:
            c = self._cached.get(parent_key)  # the parent is cached: it was reused or stored before
            if c is not None:
                pd, parent_ext = c
            else:
                pd = self._digest(parent_key)
                if pd is None:
                    self.anomalies += 1
                    return
                parent_ext = int.from_bytes(pd[-8:], "big")
        meta: _Meta = e[4]
        extra = meta.block_extra(e[2])
        d = hashlib.sha256(pd + self._hash_input(e)).digest()
        ext = int.from_bytes(d[-8:], "big")
        self._cached[h] = (d, ext)
        raw = self._block_bytes(e)
        toks = list(_UNPACK[self.bs](raw)) if self.bs in _UNPACK else np.frombuffer(raw, "<u4").tolist()
        ev_extra = None if extra is None else list(extra)
        evs = self.events
        if evs:
            last = evs[-1]
            if (type(last) is BlockStored and parent_ext is not None and last.block_hashes
                    and last.block_hashes[-1] == parent_ext and last.lora_name == meta.lora_name):
                last.block_hashes.append(ext)
                last.token_ids.extend(toks)
                last.extra_keys.append(ev_extra)  # type: ignore[union-attr]
                return
        evs.append(BlockStored([ext], parent_ext, toks, self.bs, meta.lora_id, MEDIUM_GPU, meta.lora_name,
                               [ev_extra], 0, "full_attention"))

    def removed(self, h: int, lo: int, hi: int) -> None:
        """Block ``h`` was evicted."""
        c = self._cached.pop(h, None)
        if c is None or lo != 0 or hi != 1:
            self.anomalies += 1
            return
        self.events.append(BlockRemoved([c[1]], MEDIUM_GPU, 0))

    def cleared(self) -> None:
        """Every hash was dropped (reset)."""
        self._cached.clear()
        self.events.append(AllBlocksCleared())

    def take(self) -> list[Event]:
        """The events since the last call (and forget them)."""
        evs = self.events
        self.events = []
        return evs


class ZmqEventPublisher:
    """vLLM's ZMQ PUB publisher without its thread: sends from the caller, never blocking.

    Raises:
        ConfigError: from the constructor, when the endpoint cannot be bound or connected.
    """

    def __init__(self, config: KVEventsConfig, layout: str = "map", data_parallel_rank: int = 0) -> None:
        if layout not in LAYOUTS:
            raise ConfigError(f"--kv-events-layout: one of {', '.join(LAYOUTS)}, got {layout!r}")
        self.layout = layout
        self.rank = data_parallel_rank
        self.topic = config.topic.encode()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, config.hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        ep = config.endpoint
        try:
            if "*" in ep or "::" in ep or ep.startswith(("ipc://", "inproc://")):
                self._sock.bind(ep)
            else:
                self._sock.connect(ep)
        except zmq.ZMQError as e:
            self._sock.close(0)
            raise ConfigError(f"--kv-events-config: endpoint {ep!r}: {e}") from None
        last = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint = last.decode() if last else ep
        """The endpoint as bound (a wildcard port resolved), e.g. ``tcp://0.0.0.0:5557``."""
        self.seq = 0
        """Sequence number of the next batch."""
        self.batches = 0
        """Batches handed to the socket."""
        self.events = 0
        """Events in those batches."""
        self.errors = 0
        """Batches lost to a send error (logged once)."""

    def publish(self, events: list[Event]) -> None:
        """Send one batch of ``events`` stamped now (seconds since the epoch); never raises."""
        try:
            payload = encode_batch(EventBatch(time.time(), events, self.rank), self.layout)  # type: ignore[arg-type]
            self._sock.send_multipart(frames(self.topic, self.seq, payload), flags=zmq.NOBLOCK, copy=False)
        except Exception as e:  # zmq.ZMQError, or a bug in encoding: the engine must go on
            self.errors += 1
            if self.errors == 1:
                log.warning("KV event publishing failed (%s: %s); counting further failures silently",
                            type(e).__name__, e)
        else:
            self.batches += 1
            self.events += len(events)
        self.seq += 1

    def close(self) -> None:
        """Close the socket (pending messages are dropped)."""
        self._sock.close(0)
