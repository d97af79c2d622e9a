"""``phasewise sidecar`` as a real process: serving, clean exit on signals, one-line errors; the CPU benchmark runs."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys
from pathlib import Path

import grpc
import pytest
from test_sidecar import MetricsServer, eventually_state, health, run
from conftest import load_benchmark
from test_sidecar_metrics import vllm_page

from routerd.api.v1 import instance_state_pb2_grpc
from routerd.api.v1.instance_state_pb2 import WatchStateRequest
from routerd.cli import main as phasewise_main
from routerd.errors import ConfigError
from routerd.sidecar.config import OPTIONS, resolve_config

ROUTERD_DIR = Path(__file__).resolve().parents[1] / "routerd"
_PORT_LINE = re.compile(r"on port (\d+)")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHASEWISE_SIDECAR_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROUTERD_DIR), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


async def _start_sidecar(*args: str, env: dict[str, str]) -> tuple[asyncio.subprocess.Process, int, list[str]]:
    """Start ``python -m routerd sidecar ARGS``; returns the process, its gRPC port and its stderr lines so far."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "routerd", "sidecar", *args, env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    lines: list[str] = []
    while True:
        line = (await asyncio.wait_for(proc.stderr.readline(), 15)).decode()
        if not line:
            raise AssertionError(f"sidecar exited before serving: {''.join(lines)}")
        lines.append(line)
        if m := _PORT_LINE.search(line):
            return proc, int(m.group(1)), lines


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sidecar_process_serves_then_exits_0_on_a_signal(sig):
    async def main():
        metrics = await MetricsServer(vllm_page(running=6, waiting=1, kv=0.75)).start()
        # Metrics URL and instance from the environment, the rest from flags.
        env = _env(PHASEWISE_SIDECAR_METRICS_URL=metrics.url, PHASEWISE_SIDECAR_INSTANCE="vllm-e2e")
        proc, port, lines = await _start_sidecar("--listen", "127.0.0.1:0", "--interval", "0.05",
                                                 "--endpoint", "http://127.0.0.1:8000/", env=env)
        try:
            state = await eventually_state(port, lambda s: s.healthy, timeout_s=10)
            assert (state.instance, state.endpoint) == ("vllm-e2e", "http://127.0.0.1:8000")
            assert (state.num_requests_running, state.num_requests_waiting, state.kv_cache_usage) == (6, 1, 0.75)
            assert await health(port) == 1  # SERVING
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                call = instance_state_pb2_grpc.InstanceStateServiceStub(ch).WatchState(WatchStateRequest())
                seen = [await call.read() for _ in range(6)]
                assert [s.sequence for s in seen] == sorted({s.sequence for s in seen})
                hits = metrics.hits
                proc.send_signal(sig)  # with a stream open: the sidecar ends it and exits
                rc = await asyncio.wait_for(proc.wait(), 10)
                while await call.read() is not grpc.aio.EOF:
                    pass
                assert await call.code() == grpc.StatusCode.OK
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await metrics.stop()
        err = "".join(lines) + (await proc.stderr.read()).decode()
        assert rc == 0, err
        assert "Traceback" not in err and "instance vllm-e2e: stopped" in err
        # One log line per health change, not one per scrape (there were many scrapes).
        assert hits >= 5 and err.count("instance vllm-e2e: healthy") == 1, err

    run(main(), timeout_s=40)


@pytest.mark.parametrize("argv, message", [
    ([], "--metrics-url (or PHASEWISE_SIDECAR_METRICS_URL) is required"),
    (["--metrics-url", "http://127.0.0.1:8000/metrics"], "--listen (or PHASEWISE_SIDECAR_LISTEN) is required"),
    (["--metrics-url", "ftp://h/metrics", "--listen", ":1"], "--metrics-url='ftp://h/metrics': expected an http"),
    (["--metrics-url", "http://h/metrics", "--listen", "50051"], "--listen='50051': expected HOST:PORT"),
    (["--metrics-url", "http://h/metrics", "--listen", "h:70000"], "--listen='h:70000': expected HOST:PORT"),
    (["--metrics-url", "http://h/metrics", "--listen", "h:1", "--interval", "0"],
     "--interval='0': Input should be greater than 0"),
    (["--metrics-url", "http://h/metrics", "--listen", "h:1", "--timeout", "soon"],
     "--timeout='soon': Input should be a valid number"),
    (["--metrics-url", "http://h/metrics", "--listen", "h:1", "--instance", ""],
     "--instance='': String should have at least 1 character"),
    (["--metrics-url", "http://h/metrics", "--listen", "h:1", "--endpoint", "10.0.0.7:8000"],
     "--endpoint='10.0.0.7:8000': expected an http"),
    (["--metrics-url", "http://h/metrics", "--listen", "h:1", "--log-level", "loud"], "--log-level='loud'"),
])
def test_bad_flags_exit_2_with_one_line_naming_the_flag(argv, message, capsys, monkeypatch):
    for o in OPTIONS:
        monkeypatch.delenv(o.env, raising=False)
    assert phasewise_main(["sidecar", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("phasewise: error: ") and message in err, err


def test_environment_values_are_validated_and_named(monkeypatch):
    import argparse

    args = argparse.Namespace(**{o.field: None for o in OPTIONS})
    env = {"PHASEWISE_SIDECAR_METRICS_URL": "http://h/metrics", "PHASEWISE_SIDECAR_LISTEN": "0.0.0.0:50051",
           "PHASEWISE_SIDECAR_INTERVAL": "nan"}
    with pytest.raises(ConfigError, match=r"PHASEWISE_SIDECAR_INTERVAL='nan': Input should be a finite number"):
        resolve_config(args, env)
    env["PHASEWISE_SIDECAR_INTERVAL"] = "0.25"
    args.interval_s = "0.5"  # the flag wins over the variable
    cfg = resolve_config(args, env)
    assert (cfg.interval_s, cfg.listen, cfg.instance) == (0.5, "0.0.0.0:50051", socket.gethostname())


def test_a_taken_port_is_a_one_line_error_from_the_real_process():
    import subprocess

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "routerd", "sidecar", "--metrics-url", "http://127.0.0.1:9/metrics",
             "--listen", f"127.0.0.1:{port}"], env=_env(), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr == f"phasewise: error: --listen 127.0.0.1:{port}: cannot bind: Address already in use\n"


def test_a_restarted_sidecar_numbers_its_snapshots_above_the_previous_process():
    import subprocess

    code = "from routerd.sidecar import scraper; print(next(scraper._SEQUENCE))"
    first, second = (int(subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True,
                                        check=True, timeout=30).stdout) for _ in range(2))
    assert second > first > 0


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_cpu_benchmark_measures_a_scraping_sidecar():
    """``benchmarks/sidecar_cpu.py`` (where the CPU figure now lives, issue 19) measures a real sidecar
    process: its scrapes hit the page, its CPU is read from /proc, and the figures are consistent
    with each other. No speed bound: a busy machine must not fail a test."""
    bench = load_benchmark("sidecar_cpu")
    fig = asyncio.run(asyncio.wait_for(bench.measure(vllm_page(running=4, waiting=1, kv=0.5), 1.0, 0.1), 40))
    assert fig["scrapes_per_s"] > 0  # the sidecar scraped during the window
    assert fig["cpu_percent"] > 0
    # CPU per scrape times scrapes per second is CPU per second: the three figures agree.
    assert fig["cpu_ms_per_scrape"] * fig["scrapes_per_s"] / 10 == pytest.approx(fig["cpu_percent"], rel=0.02)
