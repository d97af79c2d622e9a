"""One conformance suite, two backends: real vLLM 0.32 (CPU build) and ``phasewise emulate``.

The backends, helpers and fixtures of ``tests/conformance`` (its ``conftest.py`` registers the
fixtures; tests import the helpers from here). Every test in this folder takes ``backend`` (or
``small_backend``) and runs once per backend:

* ``emulator``: a ``phasewise emulate`` process configured like the real engine where it matters
  (served name ``tiny``, ``--max-model-len 2048``, ``--block-size 128`` as vLLM's CPU build,
  adapters ``a1``/``a2``, ``--enable-prompt-tokens-details``, KV events on ``tcp://*:PORT``);
  started once per session.
* ``vllm``: the first engine of the real-engine tier's session pair (``vllm_pair``,
  ``tests/realvllm_fixtures.py``); marked ``realvllm``: skipped without the vLLM venv, failed when
  ``PHASEWISE_VLLM_REQUIRED`` is set. The pair is shared with other tests: everything here uses
  prompts of its own (random token ids, :func:`unique_ids`) and never resets or restarts it.

``small_backend`` (module scope) is a private engine of each kind with ``--block-size 32`` (the
smallest vLLM's CPU build takes), a 16-block cache (``--num-gpu-blocks-override 16``) and
``--max-model-len 256``: fresh (its KV-event batches start at 0), small enough to evict, free to
reset.

Prompts are token-id lists (both servers take ``prompt: [ids]`` on completions and count them as
given), so exact token counts hold without knowing either backend's tokenizer.
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import msgpack
import pytest
import zmq
import zmq.utils.monitor

# The real-engine tier's port picker: below the ephemeral range vLLM's own ZMQ sockets draw from.
from real_vllm.engine import free_port as _free_port

from routerd.emulator.process import EmulatorProcess
from routerd.prefix.kv_wire import BlockStored, EventBatch, decode_batch, parse_frames

MODEL = "tiny"
ADAPTERS = ("a1", "a2")
MAX_MODEL_LEN = 2048
#: Token ids used in prompts: above the tiny model's special tokens (0-2), below its vocabulary (2048).
ID_LO, ID_HI = 3, 2000
#: The private small engine: block size, blocks, context. vLLM's CPU attention takes multiples of
#: 32 only ("No common block size for 16 (CPU_ATTN: [MultipleOf(32)])" at start), so 32, not 16.
SMALL_BS, SMALL_BLOCKS, SMALL_LEN = 32, 16, 256


@dataclass
class Backend:
    """One server under test."""

    kind: str
    """``"emulator"`` or ``"vllm"``."""
    url: str
    """Base URL (no ``/v1``)."""
    kv_events: str
    """Where a KV-event subscriber connects, ``tcp://127.0.0.1:PORT``."""
    block_size: int
    max_model_len: int
    root: str
    """``root`` of the served model in ``/v1/models`` (vLLM: its ``--model`` path)."""
    adapters: dict[str, str] = field(default_factory=dict)
    """Adapter name -> path (``root`` in ``/v1/models``)."""
    num_blocks: int | None = None
    """KV-cache blocks when fixed by the test (``--num-gpu-blocks-override``)."""

    def request(self, method: str, path: str, body: Any = None, raw: bytes | None = None,
                timeout_s: float = 60.0) -> tuple[int, Any, dict[str, str]]:
        """``(status, parsed JSON or text, headers)``; error statuses are returned, not raised."""
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                status, text, headers = r.status, r.read().decode(), dict(r.headers)
        except urllib.error.HTTPError as e:
            with e:
                status, text, headers = e.code, e.read().decode(), dict(e.headers)
        try:
            return status, json.loads(text), headers
        except ValueError:
            return status, text, headers

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        status, out, _ = self.request("POST", path, body)
        return status, out

    def complete(self, prompt: list[int], max_tokens: int = 2, **extra: Any) -> dict:
        """A non-streaming completion that must succeed; returns the response body."""
        status, out = self.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                    "ignore_eos": True, **extra})
        assert status == 200, out
        return out

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return r.read().decode()


def unique_ids(n: int, rng: random.Random | None = None) -> list[int]:
    """``n`` random token ids no other test (and no earlier run against a shared engine) sends."""
    rng = rng or random.Random(uuid.uuid4().int)
    return [rng.randrange(ID_LO, ID_HI) for _ in range(n)]


def _emulator(*flags: str) -> tuple[EmulatorProcess, int]:
    kv_port = _free_port()
    kv = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{kv_port}"})
    emu = EmulatorProcess("--port", "0", "--profile", "llama2-7b-a100", "--model", "/models/tiny",
                          "--served-model-name", MODEL, "--enable-prompt-tokens-details", "--kv-events-config", kv,
                          *flags)
    emu.start()
    return emu, kv_port


@pytest.fixture(scope="session")
def emulator_backend() -> Iterator[Backend]:
    """The session's ``phasewise emulate``, configured like the tier's vLLM engines."""
    adapters = {a: f"/adapters/{a}" for a in ADAPTERS}
    emu, kv_port = _emulator("--block-size", "128", "--max-model-len", str(MAX_MODEL_LEN), "--lora-modules",
                             *(f"{a}={p}" for a, p in adapters.items()))
    try:
        yield Backend("emulator", emu.url, f"tcp://127.0.0.1:{kv_port}", 128, MAX_MODEL_LEN, "/models/tiny", adapters)
    finally:
        emu.stop()


def _vllm_param(name: str):
    return pytest.param(name, marks=pytest.mark.realvllm, id=name)


BACKENDS = ["emulator", _vllm_param("vllm")]


@pytest.fixture(params=BACKENDS)
def backend(request) -> Backend:
    """Each conformance test runs on the emulator and on real vLLM (the shared session engine)."""
    if request.param == "emulator":
        return request.getfixturevalue("emulator_backend")
    engine = request.getfixturevalue("vllm_pair")[0]
    # vLLM CPU's default block size (engine.block_size None) is 128 (shared/docs/real-vllm.md).
    return Backend("vllm", engine.url, engine.kv_events_address, engine.block_size or 128, engine.max_model_len,
                   str(engine.model.model), {a: str(p) for a, p in engine.model.adapters.items()})


@pytest.fixture(scope="module", params=BACKENDS)
def small_backend(request) -> Iterator[Backend]:
    """A private engine of the test module's own: block size 32, 16 blocks, max_model_len 256."""
    if request.param == "emulator":
        emu, kv_port = _emulator("--block-size", str(SMALL_BS), "--num-gpu-blocks-override", str(SMALL_BLOCKS),
                                 "--max-model-len", str(SMALL_LEN))
        try:
            yield Backend("emulator", emu.url, f"tcp://127.0.0.1:{kv_port}", SMALL_BS, SMALL_LEN, "/models/tiny",
                          num_blocks=SMALL_BLOCKS)
        finally:
            emu.stop()
        return
    make = request.getfixturevalue("vllm_engine_factory")
    engine = make("conformance-small", block_size=SMALL_BS, lora=False, max_model_len=SMALL_LEN,
                  extra_args=["--num-gpu-blocks-override", str(SMALL_BLOCKS)])
    yield Backend("vllm", engine.url, engine.kv_events_address, SMALL_BS, SMALL_LEN, str(engine.model.model),
                  num_blocks=SMALL_BLOCKS)


# ---------------------------------------------------------------- KV events

@dataclass
class Received:
    """One KV-event message: its frames, the raw msgpack object and the decoded batch."""

    topic: bytes
    seq: int
    raw: Any
    batch: EventBatch


class KVSub:
    """A ZMQ SUB socket on a backend's KV-event publisher (which binds ``tcp://*:PORT``)."""

    def __init__(self, address: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sock.connect(address)
        self.received: list[Received] = []

    def wait_connected(self, timeout_s: float = 30.0) -> None:
        """Wait for the ZMTP handshake with the publisher (the subscription is sent right after it).

        Raises:
            AssertionError: no handshake within ``timeout_s``.
        """
        assert self._monitor.poll(int(timeout_s * 1000)), f"no ZMQ handshake with the publisher in {timeout_s} s"
        zmq.utils.monitor.recv_monitor_message(self._monitor)

    def sync(self, backend: Backend, timeout_s: float = 30.0) -> None:
        """Past ZMQ's slow-joiner gap without touching the engine's cache state: send one-block
        prompts of our own until the event storing one arrives, then drop what came so far."""
        deadline = time.monotonic() + timeout_s
        while True:
            ids = unique_ids(backend.block_size + 1)
            backend.complete(ids, 1)
            got = self.until(lambda evs: any(isinstance(e, BlockStored) and e.token_ids == ids[:backend.block_size]
                                             for e in evs), 1.0, must=False)
            if got is not None:
                self.received.clear()
                return
            assert time.monotonic() < deadline, f"no KV event from {backend.kind} within {timeout_s} s of subscribing"

    def recv(self, timeout_s: float) -> Received | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        topic, seq, payload = parse_frames(self.sock.recv_multipart())
        r = Received(topic, seq, msgpack.unpackb(payload, raw=False, strict_map_key=False), decode_batch(payload))
        self.received.append(r)
        return r

    def events(self) -> list:
        return [e for r in self.received for e in r.batch.events]

    def until(self, done: Callable[[list], bool], timeout_s: float = 20.0, must: bool = True) -> list | None:
        """Receive until ``done(every event received so far)``; returns those events.

        Raises:
            AssertionError: not done within ``timeout_s`` (when ``must``; else returns None).
        """
        deadline = time.monotonic() + timeout_s
        while not done(self.events()):
            left = deadline - time.monotonic()
            if left <= 0:
                if must:
                    raise AssertionError(f"KV events: condition not met within {timeout_s} s; got {self.events()}")
                return None
            self.recv(min(left, 0.5))
        return self.events()

    def close(self) -> None:
        self.sock.disable_monitor()
        self._monitor.close(0)
        self.sock.close(0)


@pytest.fixture
def kv_sub(backend) -> Iterator[KVSub]:
    """A subscriber on ``backend``'s KV events, synchronised (every later batch arrives)."""
    sub = KVSub(backend.kv_events)
    try:
        sub.sync(backend)
        yield sub
    finally:
        sub.close()


def stored_for(events: list, ids: list[int], block_size: int) -> list[BlockStored]:
    """The ``BlockStored`` events whose blocks are full blocks of ``ids`` (in order received)."""
    blocks = {tuple(ids[i:i + block_size]) for i in range(0, len(ids) - block_size + 1, block_size)}
    return [e for e in events if isinstance(e, BlockStored)
            and all(tuple(e.token_ids[i:i + block_size]) in blocks for i in range(0, len(e.token_ids), block_size))]
