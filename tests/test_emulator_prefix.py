"""The emulator's prefix caching and vLLM KV-cache events, with real processes on loopback.

Expected numbers by hand: the byte tokenizer makes a prompt of ``4 * n`` ASCII bytes exactly
``n`` tokens; vLLM caches full 16-token blocks and a request reuses at most
``(n - 1) // 16`` of them (its last prompt token is always computed), so a repeated 64-token
prompt hits 48 tokens, not 64. A ZMQ SUB in the test decodes the events with
:mod:`routerd.prefix.kv_wire` and rebuilds the block keys from their token ids, as routerd does.
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
import zmq
from conftest import toy_profile
from prometheus_client.parser import text_string_to_metric_families

from routerd.emulator.kv_events import BlockTracker, KVEventsConfig, ZmqEventPublisher, parse_kv_events_config
from routerd.emulator.process import EmulatorProcess
from routerd.errors import ConfigError
from routerd.prefix.kv_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    parse_frames,
)
from routerd.prefix.text import byte_token_array, stored_block_keys, token_prefix_blocks
from routerd.tokens import chat_prompt_text

BS = 16
# 8 KV blocks (128 tokens): a 127-token prompt evicts a finished 64-token prompt's blocks.
# Prefill 1 ms per token on a 10 ms overhead: TTFT = 0.01 + 0.001 * computed tokens.
SMALL = dict(name="small-kv", overhead_s=0.01, prefill_per_token_s=0.001, prefill_attn_s=0.0,
             decode_per_seq_s=0.001, decode_per_ctx_token_s=0.0, kv_capacity_tokens=128, block_size=BS,
             max_num_seqs=4, max_num_batched_tokens=256, max_model_len=128)
TOPIC = "kv@emu-test@toy"


def _profile(folder: Path) -> str:
    prof = toy_profile(**SMALL)
    path = folder / "small-kv.yaml"
    path.write_text(yaml.safe_dump(prof.model_dump(mode="json")))
    return str(path)


def _text(tokens: int, salt: str = "a") -> str:
    """ASCII text of exactly ``tokens`` byte-tokenizer tokens (4 bytes each)."""
    unit = (salt * 4)[:4]
    return "".join(unit if i % 7 else f"{i % 10}{salt[0]}{salt[0]}{salt[0]}" for i in range(tokens))


def _keys(text: str) -> list[int]:
    return [h for h, _ in token_prefix_blocks(byte_token_array(text), BS).extents]


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    cfg = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*", "topic": TOPIC})
    with EmulatorProcess("--port", "0", "--profile", _profile(tmp_path_factory.mktemp("p")), "--model", "toy",
                         "--kv-events-config", cfg) as e:
        yield e


@pytest.fixture(scope="module")
def emu_off(tmp_path_factory):
    with EmulatorProcess("--port", "0", "--profile", _profile(tmp_path_factory.mktemp("p")), "--model", "toy",
                         "--no-enable-prefix-caching") as e:
        yield e


def _post(url: str, body: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read()


def _complete(e, prompt, max_tokens: int = 1) -> dict:
    status, body = _post(e.url + "/v1/completions", {"model": "toy", "prompt": prompt, "max_tokens": max_tokens})
    assert status == 200, body
    return json.loads(body)


def _chat(e, messages, max_tokens: int = 1) -> dict:
    status, body = _post(e.url + "/v1/chat/completions",
                         {"model": "toy", "messages": messages, "max_tokens": max_tokens})
    assert status == 200, body
    return json.loads(body)


def _scrape(e) -> dict[str, float]:
    """``/metrics`` samples by name (the emulator has one engine and one model)."""
    with urllib.request.urlopen(e.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "vllm:cache_config_info":
                out["enable_prefix_caching=" + s.labels["enable_prefix_caching"]] = s.value
            elif not s.labels.keys() - {"model_name", "engine"}:
                out[s.name] = s.value
    return out


class Sub:
    """A SUB socket on the emulator's events, subscribed to ``TOPIC``, past ZMQ's slow-joiner gap."""

    def __init__(self, e) -> None:
        assert e.kv_events_endpoint.startswith("tcp://127.0.0.1:"), e.kv_events_endpoint
        self.e = e
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(e.kv_events_endpoint)
        self.last_seq = None
        self.engine_to_key: dict[int | bytes, int] = {}
        # Messages published before the subscription reached the PUB socket are lost: reset the
        # (idle) cache until its AllBlocksCleared arrives, then every later batch arrives.
        deadline = time.monotonic() + 30
        while True:
            assert _post(e.url + "/reset_prefix_cache")[0] == 200
            if self.sock.poll(300):
                batch = self._recv()
                assert isinstance(batch.events[-1], AllBlocksCleared)
                break
            assert time.monotonic() < deadline, "no KV event batch within 30 s of subscribing"

    def _recv(self):
        topic, seq, payload = parse_frames(self.sock.recv_multipart())
        assert topic == TOPIC.encode()
        if self.last_seq is not None:
            assert seq == self.last_seq + 1  # nothing lost, nothing reordered
        self.last_seq = seq
        batch = decode_batch(payload)
        assert batch.data_parallel_rank == 0 and abs(batch.ts - time.time()) < 60
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                # routerd's way: our keys from the token ids, chained from the parent's key.
                assert ev.block_size == BS and ev.medium == "GPU" and ev.lora_id is None
                assert len(ev.token_ids) == BS * len(ev.block_hashes)
                parent = None if ev.parent_block_hash is None else self.engine_to_key[ev.parent_block_hash]
                for h, k in zip(ev.block_hashes, stored_block_keys(parent, ev.token_ids, BS)):
                    self.engine_to_key[h] = k
            elif isinstance(ev, BlockRemoved):
                assert ev.medium == "GPU"
            elif isinstance(ev, AllBlocksCleared):
                self.engine_to_key.clear()
        return batch

    def events(self, quiet_s: float = 0.3) -> list:
        """Every event received until none arrives for ``quiet_s`` seconds."""
        out = []
        while self.sock.poll(int(quiet_s * 1000)):
            out.extend(self._recv().events)
        return out

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture
def sub(emu):
    s = Sub(emu)
    yield s
    s.close()


def _stored_keys(sub: Sub, events) -> list[int]:
    return [sub.engine_to_key[h] for ev in events if isinstance(ev, BlockStored) for h in ev.block_hashes]


# ---------------------------------------------------------------- hits, by hand

def test_a_repeated_prompt_hits_its_full_blocks_but_the_last_token(emu, sub):
    prompt = _text(64)
    assert len(byte_token_array(prompt)) == 64
    prof = toy_profile(**SMALL)
    m0 = _scrape(emu)
    first = _complete(emu, prompt)
    m1 = _scrape(emu)
    second = _complete(emu, prompt)
    m2 = _scrape(emu)
    assert first["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"] == 64
    assert m1["vllm:prefix_cache_queries_total"] - m0["vllm:prefix_cache_queries_total"] == 64
    assert m1["vllm:prefix_cache_hits_total"] - m0["vllm:prefix_cache_hits_total"] == 0
    assert m2["vllm:prefix_cache_queries_total"] - m1["vllm:prefix_cache_queries_total"] == 64
    # 4 full blocks cached, at most (64 - 1) // 16 = 3 reused: 48 tokens.
    assert m2["vllm:prefix_cache_hits_total"] - m1["vllm:prefix_cache_hits_total"] == 48
    assert m2["enable_prefix_caching=True"] == 1
    # The hit skips prefill: TTFT 0.01 + 0.001 * 64, then 0.01 + 0.001 * 16 (the profile's formula).
    ttft = [m1["vllm:time_to_first_token_seconds_sum"] - m0["vllm:time_to_first_token_seconds_sum"],
            m2["vllm:time_to_first_token_seconds_sum"] - m1["vllm:time_to_first_token_seconds_sum"]]
    assert ttft == pytest.approx([prof.overhead_s + prof.prefill_per_token_s * 64,
                                  prof.overhead_s + prof.prefill_per_token_s * 16], rel=1e-6)
    # Events: the first request stored its 4 blocks; their keys, rebuilt from the token ids,
    # are the prompt's own (routerd's precise identity). The repeat stores nothing new.
    evs = sub.events()
    assert _stored_keys(sub, evs) == _keys(prompt)
    assert [type(e) for e in evs] == [BlockStored]  # one step, one event of 4 consecutive blocks
    assert evs[0].parent_block_hash is None and evs[0].token_ids == byte_token_array(prompt).tolist()


def test_chat_turns_share_the_rendered_history(emu, sub):
    sys_msg = {"role": "system", "content": "You are terse. " * 20}
    turn1 = [sys_msg, {"role": "user", "content": "What is a KV cache?"}]
    reply = _chat(emu, turn1, max_tokens=5)["choices"][0]["message"]["content"]
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And a block?"}]
    m1 = _scrape(emu)
    _chat(emu, turn2)
    m2 = _scrape(emu)
    t1, t2 = chat_prompt_text(turn1).encode(), chat_prompt_text(turn2).encode()
    assert t2.startswith(t1)
    n2 = math.ceil(len(t2) / 4)
    # Turn 1's full blocks (64 bytes each) are turn 2's first blocks; at most (n2 - 1) // 16 reused.
    expect = BS * min(len(t1) // 64, (n2 - 1) // BS)
    assert expect >= 48
    assert m2["vllm:prefix_cache_hits_total"] - m1["vllm:prefix_cache_hits_total"] == expect
    assert m2["vllm:prefix_cache_queries_total"] - m1["vllm:prefix_cache_queries_total"] == n2
    keys = _stored_keys(sub, sub.events())
    k2 = _keys(chat_prompt_text(turn2))
    assert keys == _keys(chat_prompt_text(turn1)) + k2[len(t1) // 64:]  # turn 2 stores only its new blocks


def test_token_id_prompts_are_used_as_given(emu, sub):
    ids = list(range(1000, 1040))  # 40 tokens: 2 full blocks
    _complete(emu, ids)
    m1 = _scrape(emu)
    _complete(emu, ids)
    m2 = _scrape(emu)
    assert m2["vllm:prefix_cache_hits_total"] - m1["vllm:prefix_cache_hits_total"] == 32
    evs = sub.events()
    assert _stored_keys(sub, evs) == [h for h, _ in token_prefix_blocks(ids, BS).extents]
    assert evs[0].token_ids == ids[:32]
    status, body = _post(emu.url + "/v1/completions", {"model": "toy", "prompt": [1, -2], "max_tokens": 1})
    # vLLM's answer to a negative id: pydantic's ge=0 check on body.prompt.<i>.
    err = json.loads(body)["error"]
    assert status == 400 and (err["type"], err["param"]) == ("Bad Request", "body.prompt.1")
    status, body = _post(emu.url + "/v1/completions", {"model": "toy", "prompt": [1, 1 << 32], "max_tokens": 1})
    assert status == 400 and json.loads(body)["error"]["message"] == f"Token id {1 << 32} is out of vocabulary"


# ---------------------------------------------------------------- eviction and reset

def test_eviction_publishes_block_removed_and_the_prompt_misses(emu, sub):
    a, b = _text(64, "x"), _text(127, "y")
    _complete(emu, a)
    stored_a = _stored_keys(sub, sub.events())
    assert stored_a == _keys(a)
    hashes_a = {h for h, k in sub.engine_to_key.items() if k in stored_a}
    # b needs all 8 blocks (127 prompt tokens): the 4 never used go first, then a's 4 cached ones.
    _complete(emu, b)
    evs = sub.events()
    removed = [h for ev in evs if isinstance(ev, BlockRemoved) for h in ev.block_hashes]
    assert set(removed) == hashes_a and len(removed) == 4
    # vLLM order: the allocation's evictions, then the new blocks; a's tail is evicted first.
    assert isinstance(evs[0], BlockRemoved) and isinstance(evs[-1], BlockStored)
    assert [sub.engine_to_key[h] for h in removed] == stored_a[::-1]
    assert _stored_keys(sub, evs) == _keys(b)
    m1 = _scrape(emu)
    _complete(emu, a)
    m2 = _scrape(emu)
    assert m2["vllm:prefix_cache_hits_total"] - m1["vllm:prefix_cache_hits_total"] == 0


def test_reset_prefix_cache_clears_and_publishes_all_blocks_cleared(emu, sub):
    prompt = _text(48, "r")
    _complete(emu, prompt)
    assert _stored_keys(sub, sub.events()) == _keys(prompt)
    status, body = _post(emu.url + "/reset_prefix_cache")
    assert (status, body) == (200, b"")
    evs = sub.events()
    assert evs == [AllBlocksCleared()]
    m1 = _scrape(emu)
    _complete(emu, prompt)
    m2 = _scrape(emu)
    assert m2["vllm:prefix_cache_hits_total"] - m1["vllm:prefix_cache_hits_total"] == 0
    assert m2["vllm:prefix_cache_queries_total"] - m1["vllm:prefix_cache_queries_total"] == 48
    evs = sub.events()
    assert _stored_keys(sub, evs) == _keys(prompt) and evs[0].parent_block_hash is None
    assert _post(emu.url + "/reset_prefix_cache?reset_running_requests=true")[0] == 400
    assert _post(emu.url + "/reset_prefix_cache?reset_external=maybe")[0] == 400
    m = _scrape(emu)
    assert m["phasewise_emulator_kv_event_errors_total"] == 0
    assert m["phasewise_emulator_kv_event_batches_total"] >= 4


def test_no_enable_prefix_caching_never_hits(emu_off):
    prompt = _text(64, "z")
    m1 = _scrape(emu_off)
    for _ in range(3):
        _complete(emu_off, prompt)
    m2 = _scrape(emu_off)
    # vLLM does not look a request up when caching is off: no queries, no hits.
    assert m2["vllm:prefix_cache_hits_total"] == m1["vllm:prefix_cache_hits_total"] == 0
    assert m2["vllm:prefix_cache_queries_total"] == 0
    assert m2["enable_prefix_caching=False"] == 1
    assert "phasewise_emulator_kv_event_batches_total" not in m2


@pytest.mark.parametrize("layout", ["array", "map-batch"])
def test_other_wire_layouts_decode_the_same(tmp_path, layout):
    cfg = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*", "topic": TOPIC})
    with EmulatorProcess("--port", "0", "--profile", _profile(tmp_path), "--model", "toy", "--kv-events-config", cfg,
                         "--kv-events-layout", layout) as e:
        s = Sub(e)
        try:
            prompt = _text(40, "q")
            _complete(e, prompt)
            assert _stored_keys(s, s.events()) == _keys(prompt)
        finally:
            s.close()


# ---------------------------------------------------------------- bad configuration

def _run_emulator(*flags: str) -> subprocess.CompletedProcess:
    src = str(Path(__file__).resolve().parents[1] / "routerd")
    return subprocess.run([sys.executable, "-m", "routerd.emulator", "--port", "0", "--host", "127.0.0.1", *flags],
                          capture_output=True, text=True, timeout=60, env={"PYTHONPATH": src, "PATH": "/usr/bin"})


@pytest.mark.parametrize("cfg, needle", [
    ("{not json", "--kv-events-config: "),
    ('{"enable_kv_cache_events": true, "bogus": 1}', "--kv-events-config: bogus: Extra inputs are not permitted"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "--kv-events-config: publisher: "),
    ('{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5558"}', "replay_endpoint is not supported"),
    ('{"enable_kv_cache_events": true, "endpoint": "bogus://x"}', "--kv-events-config: endpoint 'bogus://x'"),
])
def test_bad_kv_events_config_exits_2_with_one_line(cfg, needle):
    r = _run_emulator("--kv-events-config", cfg)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr


def test_kv_events_with_fixed_timing_is_refused():
    r = _run_emulator("--fixed-timing", "0.01,0.01", "--kv-events-config", '{"enable_kv_cache_events": true}')
    assert r.returncode == 2 and "not --fixed-timing" in r.stderr


def test_config_keys_and_defaults_are_vllms():
    c = parse_kv_events_config("{}")
    assert (c.enable_kv_cache_events, c.publisher, c.endpoint, c.topic, c.hwm, c.buffer_steps,
            c.max_queue_size, c.replay_endpoint) == (False, None, "tcp://*:5557", "", 100_000, 10_000, 100_000, None)
    assert not c.active
    assert parse_kv_events_config('{"enable_kv_cache_events": true}').active
    assert not parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}').active
    with pytest.raises(ConfigError, match="--kv-events-config"):
        parse_kv_events_config("[]")


# ---------------------------------------------------------------- units

def test_tracker_chains_blocks_into_one_event_and_hashes_differ_per_process_seed():
    toks = byte_token_array(_text(48))
    keys = _keys(_text(48))
    runs = []
    for seed in (b"one", b"two"):
        t = BlockTracker(BS, seed=seed)
        t.track(keys, toks)
        for k in keys:
            t.stored(k, 0, 1)
        evs = t.take()
        assert len(evs) == 1 and evs[0].token_ids == toks.tolist() and evs[0].parent_block_hash is None
        assert stored_block_keys(None, evs[0].token_ids, BS) == keys
        runs.append(evs[0].block_hashes)
        t.removed(keys[2], 0, 1)
        assert t.take() == [BlockRemoved([evs[0].block_hashes[2]], "GPU", 0)]
        t.untrack(keys)
        assert t.sizes == (0, 2) and t.anomalies == 0
        t.removed(keys[2], 0, 1)  # not cached any more: counted, not raised
        assert t.anomalies == 1
    assert runs[0] != runs[1] and all(0 <= h < 1 << 64 for h in runs[0])


def test_a_failing_publisher_counts_logs_once_and_never_raises(caplog):
    pub = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="inproc://emu-test-fail"))
    pub.close()  # every send now fails
    with caplog.at_level(logging.WARNING, logger="routerd.emulator.kv_events"):
        for _ in range(3):
            pub.publish([AllBlocksCleared()])
    assert (pub.errors, pub.batches, pub.seq) == (3, 0, 3)
    assert len([r for r in caplog.records if "KV event publishing failed" in r.message]) == 1


def test_a_subscriber_that_never_reads_does_not_block_the_publisher():
    pub = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="inproc://emu-test-hwm", hwm=2))
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 2)
    sub.connect("inproc://emu-test-hwm")
    try:
        for _ in range(1000):  # far past both high-water marks: PUB drops, never waits
            pub.publish([AllBlocksCleared()])
        assert (pub.batches, pub.errors) == (1000, 0)
    finally:
        sub.close(0)
        pub.close()


def test_tracker_hashes_a_block_whose_parent_it_has_not_stored_yet():
    toks = byte_token_array(_text(48))
    keys = _keys(_text(48))
    ordered = BlockTracker(BS, seed=b"s")
    ordered.track(keys, toks)
    for k in keys:
        ordered.stored(k, 0, 1)
    want = ordered.take()[0].block_hashes
    out_of_order = BlockTracker(BS, seed=b"s")
    out_of_order.track(keys, toks)
    out_of_order.stored(keys[1], 0, 1)  # parent computed from the request's own blocks
    ev = out_of_order.take()[0]
    assert (ev.parent_block_hash, ev.block_hashes) == (want[0], [want[1]]) and out_of_order.anomalies == 0


class _Recorder:
    def __init__(self) -> None:
        self.batches: list[list] = []

    def publish(self, events) -> None:
        self.batches.append(list(events))


def test_engine_events_replay_to_the_simulators_cache_and_memory_stays_bounded():
    """In process: many requests over shared prefixes through a 12-block cache; a consumer that
    keys blocks by token ids (as routerd) ends with exactly the simulator's cached blocks, and the
    tracker holds nothing for finished requests."""
    import asyncio
    import random

    from routerd.emulator.engine import SimEngine

    prof = toy_profile(**{**SMALL, "kv_capacity_tokens": 192, "overhead_s": 0.001, "prefill_per_token_s": 1e-5})
    rng = random.Random(7)
    heads = [_text(32, "h"), _text(48, "i"), _text(16, "j")]

    async def run():
        rec = _Recorder()
        eng = SimEngine(prof, None, rec)  # type: ignore[arg-type]
        streams = []
        for i in range(80):
            text = rng.choice(heads) + _text(rng.randint(1, 60), f"t{i % 9}")
            ids = byte_token_array(text)
            streams.append(eng.submit(len(ids), rng.randint(1, 4), ids))
            if i % 5 == 4:
                await asyncio.gather(*(s.wait_done() for s in streams))
                streams = []
                if i % 20 == 19:
                    assert eng.reset_prefix_cache()
        await asyncio.gather(*(s.wait_done() for s in streams))
        eng.stats()
        eng.close()
        return eng, rec

    eng, rec = asyncio.run(run())
    engine_to_key: dict = {}
    cached: set[int] = set()
    kinds = set()
    for batch in rec.batches:
        assert batch
        for ev in batch:
            kinds.add(type(ev))
            if isinstance(ev, BlockStored):
                parent = None if ev.parent_block_hash is None else engine_to_key[ev.parent_block_hash]
                for h, k in zip(ev.block_hashes, stored_block_keys(parent, ev.token_ids, BS)):
                    engine_to_key[h] = k
                    cached.add(k)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    cached.remove(engine_to_key.pop(h))
            else:
                cached.clear()
                engine_to_key.clear()
    pc = eng.inst.pc
    assert kinds == {BlockStored, BlockRemoved, AllBlocksCleared}
    assert cached == set(pc.cached) and all(n == 1 for n in pc.cached.values())
    assert eng._tracker.sizes == (0, len(pc.cached)) and len(pc.cached) <= prof.num_blocks
    assert eng._tracker.anomalies == 0
    st = eng.stats()
    assert 0 < st.prefix_hits < st.prefix_queries
