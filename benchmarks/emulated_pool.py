"""Shared by the routerd benchmarks that run real processes: emulated vLLM instances with
sidecars (``phasewise emulate`` + ``phasewise sidecar``), process start/stop, and one
streamed completion timed on the client side."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.request

PROFILE = "llama2-7b-v100"
MODEL = "llama-2-7b"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float = 60.0) -> None:
    """Wait until ``url`` answers 200. Raises RuntimeError after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s} s")


def start(args: list[str], env: dict | None = None) -> subprocess.Popen:
    """``python -m routerd ARGS`` in its own session, output discarded."""
    return subprocess.Popen([sys.executable, "-m", "routerd", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, env=env)


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each, then SIGKILL any still running after 10 s."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def start_instances(n: int, procs: list[subprocess.Popen]) -> list[tuple[str, str, str]]:
    """``n`` emulators (``PROFILE``, seeds 0..n-1) with a sidecar each, appended to ``procs``.

    Returns (name, http URL, sidecar address) per instance, names ``vllm-0``...
    """
    inst = []
    for i in range(n):
        hp, sp = free_port(), free_port()
        procs.append(start(["emulate", "--host", "127.0.0.1", "--port", str(hp), "--profile", PROFILE,
                            "--seed", str(i)]))
        url = f"http://127.0.0.1:{hp}"
        wait_http(url + "/health")
        procs.append(start(["sidecar", "--metrics-url", url + "/metrics", "--listen", f"127.0.0.1:{sp}",
                            "--instance", f"vllm-{i}", "--endpoint", url]))
        inst.append((f"vllm-{i}", url, f"127.0.0.1:{sp}"))
    return inst


def endpoint_flags(inst: list[tuple[str, str, str]]) -> list[str]:
    """``--endpoint NAME=URL,STATE`` flags of ``phasewise serve`` for ``inst``."""
    return [x for name, url, state in inst for x in ("--endpoint", f"{name}={url},{state}")]


async def stream_once(session, url: str, chars: int, tokens: int) -> tuple[int, float]:
    """One streamed completion of a ``chars``-character prompt and ``max_tokens`` = ``tokens``,
    read to its end: (HTTP status, client-observed E2E in s)."""
    body = {"model": MODEL, "prompt": "x " * (chars // 2), "max_tokens": tokens, "stream": True}
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as r:
        async for _ in r.content.iter_any():
            pass
    return r.status, time.perf_counter() - t0
