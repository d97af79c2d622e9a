"""Load through routerd against calling the backends directly, in the same run.

Setup (issue #5 target): two emulators in fixed-timing mode (20 ms to the first token,
5 ms per token, 64-token replies), 128 concurrent streaming ``/v1/completions``
requests. Phases alternate: *direct* (the client spreads requests round robin over the
two emulators itself) and *routed* (every request goes through ``phasewise serve`` with
``round_robin``, or ``--policy``). Each phase sends ``--requests`` requests with at most
``--concurrency`` in flight; ``--rounds`` pairs of phases are run and the median of
each figure is reported.

Figures per phase: throughput (completed requests/s over the phase's wall time), p50
and p99 TTFT (first SSE event) and E2E (``data: [DONE]``), errors, and for routed
phases routerd's CPU time per request (user + system, from ``/proc/PID/stat``).
Targets: routed/direct throughput >= 0.95, p50 TTFT and E2E added <= 3 ms, routerd
CPU <= 1.5 ms per request.

The client is this process (aiohttp, no JSON parsing of chunks); the emulators and
routerd are subprocesses; all share the machine's cores, as the issue asks.

Usage: python benchmarks/routerd_load.py [--requests 1024] [--concurrency 128]
       [--rounds 3] [--policy round_robin] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (s), from /proc/PID/stat fields 14 and 15."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


async def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} not ready after {timeout} s")
            await asyncio.sleep(0.1)


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


async def one(session: aiohttp.ClientSession, url: str, body: bytes, out: list) -> None:
    t0 = time.perf_counter()
    ttft = None
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
            if r.status != 200:
                await r.read()
                out.append(None)
                return
            done = False
            async for chunk in r.content.iter_any():
                if ttft is None:
                    ttft = time.perf_counter() - t0
                if b"[DONE]" in chunk:
                    done = True
            out.append((ttft, time.perf_counter() - t0) if done else None)
    except aiohttp.ClientError:
        out.append(None)


async def phase(urls: list[str], n: int, concurrency: int, tokens: int, model: str) -> dict:
    body = (b'{"model": "%s", "prompt": "Say something about routers, please.", "max_tokens": %d, '
            b'"stream": true}' % (model.encode(), tokens))
    out: list = []
    sem = asyncio.Semaphore(concurrency)
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
        async def task(i: int) -> None:
            async with sem:
                await one(s, urls[i % len(urls)], body, out)

        t0 = time.perf_counter()
        await asyncio.gather(*(task(i) for i in range(n)))
        wall = time.perf_counter() - t0
    ok = [x for x in out if x is not None]
    ttfts = sorted(x[0] for x in ok)
    e2es = sorted(x[1] for x in ok)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    return {"throughput": len(ok) / wall, "errors": n - len(ok), "wall": wall,
            "ttft_p50": pct(ttfts, 0.5), "ttft_p99": pct(ttfts, 0.99),
            "e2e_p50": pct(e2es, 0.5), "e2e_p99": pct(e2es, 0.99)}


async def main_async(a: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="routerd-load-"))
    py = sys.executable
    procs: list[subprocess.Popen] = []
    model = "llama-2-7b"
    try:
        backends = []
        for i in range(2):
            port = free_port()
            procs.append(start([py, "-m", "routerd", "emulate", "--port", str(port), "--model", model,
                                "--fixed-timing", "0.02,0.005"], tmp / f"emulator{i}.log"))
            backends.append(f"http://127.0.0.1:{port}")
        rport = free_port()
        cmd = [py, "-m", "routerd", "serve", "--host", "127.0.0.1", "--port", str(rport), "--grpc-port", "0",
               "--policy", a.policy, "--model", model]
        for i, b in enumerate(backends):
            cmd += ["--endpoint", f"emu{i}={b}"]
        router = start(cmd, tmp / "routerd.log")
        procs.append(router)
        for b in backends:
            await wait_http(b + "/v1/models")
        await wait_http(f"http://127.0.0.1:{rport}/readyz")
        direct_urls = [b + "/v1/completions" for b in backends]
        routed_urls = [f"http://127.0.0.1:{rport}/v1/completions"]
        # Warm-up: connection pools, first-call imports.
        await phase(direct_urls, 2 * a.concurrency, a.concurrency, a.tokens, model)
        await phase(routed_urls, 2 * a.concurrency, a.concurrency, a.tokens, model)
        rows: dict[str, list[dict]] = {"direct": [], "routed": []}
        for _ in range(a.rounds):
            rows["direct"].append(await phase(direct_urls, a.requests, a.concurrency, a.tokens, model))
            c0 = cpu_seconds(router.pid)
            r = await phase(routed_urls, a.requests, a.concurrency, a.tokens, model)
            r["cpu_ms_per_request"] = 1e3 * (cpu_seconds(router.pid) - c0) / a.requests
            rows["routed"].append(r)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[kind])

    print(f"# {a.requests} streaming requests per phase, concurrency {a.concurrency}, {a.tokens} tokens, "
          f"2 fixed-timing emulators (20 ms TTFT, 5 ms/token), policy {a.policy}, {a.rounds} rounds, medians")
    print(f"{'':8} {'req/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'E2E p50':>9} {'E2E p99':>9} {'errors':>7}")
    for kind in ("direct", "routed"):
        print(f"{kind:8} {med(kind, 'throughput'):8.1f} {1e3 * med(kind, 'ttft_p50'):7.2f}ms "
              f"{1e3 * med(kind, 'ttft_p99'):7.2f}ms {1e3 * med(kind, 'e2e_p50'):7.2f}ms "
              f"{1e3 * med(kind, 'e2e_p99'):7.2f}ms {sum(r['errors'] for r in rows[kind]):7d}")
    print(f"throughput routed/direct: {med('routed', 'throughput') / med('direct', 'throughput'):.3f} (target >= 0.95)")
    print(f"added p50 TTFT: {1e3 * (med('routed', 'ttft_p50') - med('direct', 'ttft_p50')):+.2f} ms (target <= 3)")
    print(f"added p50 E2E:  {1e3 * (med('routed', 'e2e_p50') - med('direct', 'e2e_p50')):+.2f} ms (target <= 3)")
    print(f"routerd CPU per request: {med('routed', 'cpu_ms_per_request'):.3f} ms (target <= 1.5)")
    print(f"(logs in {tmp})")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--policy", default="round_robin")
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
