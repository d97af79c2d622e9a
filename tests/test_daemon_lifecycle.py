"""routerd's operations: hot reload without dropping requests, and graceful drain on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import aiohttp

from conftest import policy_params
from daemon_fakes import FakeBackend, in_flight_samples, openai_client, sample
from stack_processes import await_until, http_get
from routerd.daemon.app import Daemon
from routerd.daemon.config import load_settings

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 30.0  # for every condition polled: far above what a loaded 2-core machine needs


def _config(backends, policy, **extra) -> str:
    cfg = {"http": {"host": "127.0.0.1", "port": 0}, "grpc": {"host": "127.0.0.1", "port": 0}, "models": ["m"],
           "endpoints": [{"name": b.name, "url": b.url} for b in backends], "policy": policy,
           "log_level": "info", **extra}
    return json.dumps(cfg)  # JSON is YAML


async def _shutdown(client, daemon, *backends) -> None:
    await client.close()
    await daemon.stop()
    for b in backends:
        await b.stop()


def test_reload_swaps_policy_checkpoint_and_endpoints_with_requests_in_flight(tmp_path):
    async def main():
        b0 = await FakeBackend("b0", token_s=0.03, default_tokens=8).start()
        b1 = await FakeBackend("b1").start()
        path = tmp_path / "routerd.yaml"
        path.write_text(_config([b0], {"name": "round_robin"}, reload={"watch": False}))
        d = Daemon(load_settings(path, environ={}), config_path=path)
        await d.start()
        client = openai_client(d)
        try:
            stream = await client.completions.create(model="m", prompt="p", max_tokens=8, stream=True)
            first = await stream.__anext__()
            queued = asyncio.create_task(client.completions.create(model="m", prompt="q", max_tokens=1))
            # New endpoints and a dqn checkpoint while a stream is running.
            dqn = {"name": "dqn", "params": {**policy_params("dqn", 2), "allow_hold": False}}
            path.write_text(_config([b0, b1], dqn, reload={"watch": False}))
            assert await d.reload()
            assert d.router.policy_name == "dqn" and [e.name for e in d.router.endpoints] == ["b0", "b1"]
            assert str(d.router.policy.checkpoint.path) == policy_params("dqn", 2)["checkpoint"]
            rest = [ch.choices[0].text async for ch in stream]
            assert [first.choices[0].text] + rest == [f"t{i} " for i in range(8)]
            assert (await queued).choices[0].text == "t0 "
            r = await client.completions.create(model="m", prompt="p", max_tokens=1)
            assert r.choices[0].text == "t0 " and d.router.decisions[-1][6] == "dqn"
            # A broken config is refused and the running one kept.
            path.write_text(_config([b0], {"name": "dqn", "params": {"checkpoint": str(tmp_path)}}))
            assert not await d.reload()
            assert d.router.policy_name == "dqn" and len(d.router.endpoints) == 2
            assert sample(d, "phasewise_config_reloads_total", result="error") == 1
            assert sample(d, "phasewise_config_reloads_total", result="ok") == 1
            # The gauges drop as each handler ends, which may be just after its client has the
            # last byte.
            await await_until(lambda: in_flight_samples(d), lambda v: all(x == 0 for x in v.values()), WAIT_S,
                              "phasewise_in_flight_requests and the queue depth back at 0")
        finally:
            await _shutdown(client, d, b0, b1)
    asyncio.run(main())


def test_an_unusable_dqn_checkpoint_at_startup_routes_round_robin_and_says_so(tmp_path, caplog, monkeypatch):
    """Issue #3 "Bad input": routerd starts on round robin and logs the file and the problem;
    a reload to a good checkpoint then switches to dqn."""
    async def main():
        b0 = await FakeBackend("b0").start()
        b1 = await FakeBackend("b1").start()
        bad = tmp_path / "ck"
        bad.mkdir()
        (bad / "metadata.json").write_text("{not json")
        path = tmp_path / "routerd.yaml"
        path.write_text(_config([b0, b1], {"name": "dqn", "params": {"checkpoint": str(bad)}},
                                reload={"watch": False}))
        with caplog.at_level("WARNING", logger="routerd"):
            d = Daemon(load_settings(path, environ={}), config_path=path)
        assert d.router.policy_name == "round_robin"
        warned = [r.getMessage() for r in caplog.records if "round robin instead" in r.getMessage()]
        assert len(warned) == 1 and str(bad) in warned[0] and "policy: dqn" in warned[0]
        with caplog.at_level("INFO", logger="routerd"):
            await d.start()
        assert any("policy round_robin (configured dqn: its checkpoint is unusable)" in r.getMessage()
                   for r in caplog.records)
        client = openai_client(d)
        try:
            for _ in range(4):
                r = await client.completions.create(model="m", prompt="p", max_tokens=1)
                assert r.choices[0].text == "t0 "
            assert [x[6] for x in list(d.router.decisions)[-4:]] == ["round_robin"] * 4
            assert b0.started == b1.started == 2  # alternated
            good = {"name": "dqn", "params": {**policy_params("dqn", 2), "allow_hold": False}}
            path.write_text(_config([b0, b1], good, reload={"watch": False}))
            assert await d.reload()
            assert d.router.policy_name == "dqn"
            # Any failure while building a reload is refused and counted; routerd keeps serving.
            import routerd.daemon.app as app_module

            def broken(*a, **k):
                raise RuntimeError("disk on fire")

            monkeypatch.setattr(app_module, "_Built", broken)
            assert not await d.reload()
            assert d.router.policy_name == "dqn"
            assert sample(d, "phasewise_config_reloads_total", result="error") == 1
            r = await client.completions.create(model="m", prompt="p", max_tokens=1)
            assert r.choices[0].text == "t0 "
        finally:
            await _shutdown(client, d, b0, b1)
    asyncio.run(main())


def test_a_changed_config_file_is_picked_up_without_a_signal(tmp_path):
    async def main():
        b0 = await FakeBackend("b0").start()
        path = tmp_path / "routerd.yaml"
        path.write_text(_config([b0], {"name": "round_robin"}, reload={"watch": True, "poll_interval_s": 0.05}))
        d = Daemon(load_settings(path, environ={}), config_path=path)
        await d.start()
        try:
            await asyncio.sleep(0.1)
            os.utime(path, (time.time() + 5, time.time() + 5))  # an mtime the watcher cannot miss
            path.write_text(_config([b0], {"name": "late_binding"}, reload={"watch": True, "poll_interval_s": 0.05}))
            os.utime(path, (time.time() + 10, time.time() + 10))
            await await_until(lambda: d.router.policy_name, lambda name: name == "late_binding", WAIT_S,
                              "the file watcher reloading policy late_binding")
        finally:
            await d.stop()
            await b0.stop()
    asyncio.run(main())


async def _read_port(proc) -> int:
    seen = []
    while True:
        line = await asyncio.wait_for(proc.stderr.readline(), 20)
        if not line:
            raise AssertionError("routerd exited before listening:\n" + "".join(seen[-20:]))
        text = line.decode()
        seen.append(text)
        if "routerd listening on http://" in text:
            return int(text.split("routerd listening on http://", 1)[1].split(":")[1].split(";")[0].split(",")[0])


def test_sigterm_drains_in_flight_requests_refuses_new_ones_and_exits_zero(tmp_path):
    async def main():
        # The backend (in this process) holds the stream after its first token until the gate is
        # set: it is in flight, whatever the machine's speed, through SIGTERM, the polls and the
        # refused POST below (issue 19).
        b0 = FakeBackend("b0", default_tokens=12)
        b0.between_tokens_gate = asyncio.Event()
        await b0.start()
        path = tmp_path / "routerd.yaml"
        path.write_text(_config([b0], {"name": "round_robin"}, drain_timeout_s=20))
        env = {**os.environ, "PYTHONPATH": str(ROOT / "routerd")}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "routerd", "serve", "--config", str(path), cwd=str(tmp_path), env=env,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        try:
            port = await _read_port(proc)
            base = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession() as s:
                # SIGHUP reloads the file (here: another policy).
                path.write_text(_config([b0], {"name": "join_shortest_queue"}, drain_timeout_s=20))
                proc.send_signal(signal.SIGHUP)
                await await_until(lambda: http_get(base + "/metrics")[1], lambda text: b'phasewise_config_reloads_total'
                                  b'{result="ok"} 1.0' in text, WAIT_S, "SIGHUP reloading the file "
                                  "(phasewise_config_reloads_total ok 1)")
                body = json.dumps({"model": "m", "prompt": "p", "stream": True, "max_tokens": 12}).encode()
                async with s.post(base + "/v1/completions", data=body) as r:
                    assert r.status == 200
                    events = [await r.content.readline()]
                    proc.send_signal(signal.SIGTERM)
                    # Draining: not ready, and new requests are refused with 503.
                    await await_until(lambda: http_get(base + "/readyz")[0], lambda status: status == 503, WAIT_S,
                                      "routerd draining after SIGTERM (/readyz 503)")
                    async with s.post(base + "/v1/completions", data=body) as r2:
                        assert r2.status == 503 and r2.headers["x-phasewise-reject-reason"] == "draining"
                    assert b0.active == 1 and b0.tokens_sent == 1  # still mid-stream while draining
                    b0.between_tokens_gate.set()
                    async for line in r.content:
                        events.append(line)
                data = [e for e in events if e.startswith(b"data: ")]
                assert len(data) == 13 and data[-1] == b"data: [DONE]\n"
            assert await asyncio.wait_for(proc.wait(), WAIT_S) == 0
            # The backend's handler counts its finish after its last write: it may be behind routerd's exit.
            assert await await_until(lambda: (b0.finished, b0.cancelled), lambda v: v != (0, 0), WAIT_S,
                                     "the backend's stream finished or cancelled") == (1, 0)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await b0.stop()
    asyncio.run(main())


def test_dqn_for_another_cluster_size_is_named_at_startup(tmp_path, caplog):
    class _Addr:  # endpoints are only named here; nothing connects before start()
        def __init__(self, name, port):
            self.name, self.url = name, f"http://127.0.0.1:{port}"

    path = tmp_path / "routerd.yaml"
    path.write_text(_config([_Addr("a", 1), _Addr("b", 2)], {"name": "dqn"}))  # the shipped 4-instance one
    with caplog.at_level("WARNING", logger="routerd"):
        d = Daemon(load_settings(path, environ={}), config_path=path)
    assert d.router.policy_name == "dqn"
    said = [r.getMessage() for r in caplog.records]
    assert any("trained for 4 instances and 2 endpoints are configured" in m for m in said)
