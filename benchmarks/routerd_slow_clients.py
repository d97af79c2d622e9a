"""1,000 idle or slow client connections against routerd's front-end limits, beside normal traffic (issue 15).

Starts ``--instances`` (2) emulators (``phasewise emulate``, llama2-7b-v100 profile) with a
sidecar each and one routerd (``phasewise serve``) with ``http.header_timeout_s``,
``http.body_timeout_s`` (``--timeout-s``, 2 s) and ``http.keepalive_timeout_s``
(``--keepalive-s``, 3 s). ``--clients`` closed-loop streaming clients send ``--requests``
completions each, twice on the same requests:

- **baseline**: nothing else connected;
- **slow**: a separate process (this script with ``--worker``, so that its writes do not
  share the measuring clients' event loop) first opens ``--bad`` (1,000) connections: a third
  silent (connect, send nothing), a third sending the request line and headers one byte every
  0.5 s, a third sending full headers then the body one byte every 0.5 s; each records the
  seconds until routerd closed it.

It prints the p99 and mean E2E of the normal requests in both runs (target: p99 kept), and
for each kind of bad connection how many were closed, the median and largest time to close
(from the connect for the header timeout, from the end of the headers for the body timeout),
and how many closed within its timeout plus a slack for the event loop (``--slack-s``, 0.1 s).

Usage: python benchmarks/routerd_slow_clients.py [--bad 1000] [--clients 4] [--requests 20]
       [--tokens 32] [--timeout-s 2] [--keepalive-s 3] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from emulated_pool import (MODEL, PROFILE, endpoint_flags, free_port, start_instances, stop,  # noqa: E402
                           stream_once, wait_http)

KINDS = ("silent", "slow_header", "slow_body")


async def _bad_connection(port: int, kind: str, ready: asyncio.Event, hold_s: float) -> float | None:
    """Seconds until routerd closed the connection, from where its bound starts: the connect (the
    header timeout), or for ``slow_body`` the end of its headers (the body timeout); None if it was
    still open at ``hold_s``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    start = [t0]
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 10000\r\n\r\n")

    async def trickle() -> None:
        if kind == "silent":
            return
        await ready.wait()
        data = head if kind == "slow_header" else b"{" * 10000
        if kind == "slow_body":
            writer.write(head)
            start[0] = time.monotonic()
        for i in range(len(data)):
            writer.write(data[i:i + 1])
            await asyncio.sleep(0.5)

    sender = asyncio.create_task(trickle())
    try:
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), timeout=max(0.01, hold_s - (time.monotonic() - t0)))
            if not chunk:
                return time.monotonic() - start[0]
    except (asyncio.TimeoutError, TimeoutError):
        return None
    except (ConnectionError, OSError):
        return time.monotonic() - start[0]
    finally:
        sender.cancel()
        writer.close()


async def _worker(port: int, n: int, hold_s: float) -> dict:
    ready = asyncio.Event()
    kinds = [KINDS[i % 3] for i in range(n)]
    tasks = []
    for k in kinds:  # opened one by one: a burst of 1,000 SYNs would overflow the listen backlog
        tasks.append(asyncio.create_task(_bad_connection(port, k, ready, hold_s)))
        await asyncio.sleep(0)
    ready.set()
    print("opened", flush=True)
    got = await asyncio.gather(*tasks, return_exceptions=True)
    out: dict = {k: [] for k in KINDS}
    for k, g in zip(kinds, got):
        out[k].append(None if isinstance(g, BaseException) else g)
    return out


async def _client(session, url, work, e2e: list[float]) -> None:
    for chars, tokens in work:
        status, took = await stream_once(session, url, chars, tokens)
        if status != 200:
            raise RuntimeError(f"HTTP {status}")
        e2e.append(took)


async def _drive(port: int, work) -> list[float]:
    e2e: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await asyncio.gather(*(_client(s, f"http://127.0.0.1:{port}", w, e2e) for w in work))
    return sorted(e2e)


def _p(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bad", type=int, default=1000)
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=20, help="requests per client")
    ap.add_argument("--tokens", type=int, default=32, help="mean max_tokens")
    ap.add_argument("--timeout-s", type=float, default=2.0, help="http.header_timeout_s and http.body_timeout_s")
    ap.add_argument("--keepalive-s", type=float, default=3.0, help="http.keepalive_timeout_s")
    ap.add_argument("--slack-s", type=float, default=0.1,
                    help="allowed lateness of a close (routerd sweeps at each connection's bound, at most "
                         "MIN_SWEEP_GAP_S = 0.02 s late, plus the event loop's own lateness)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # internal: port to attack
    ap.add_argument("--hold-s", type=float, default=30.0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker is not None:
        print(json.dumps(asyncio.run(_worker(a.worker, a.bad, a.hold_s))), flush=True)
        return 0
    rng = random.Random(a.seed)
    work = [[(rng.randint(200, 2000), max(8, int(rng.expovariate(1 / a.tokens)))) for _ in range(a.requests)]
            for _ in range(a.clients)]
    procs = []
    try:
        eps = endpoint_flags(start_instances(a.instances, procs))
        port = free_port()
        env = {**os.environ, "PHASEWISE_HTTP__HEADER_TIMEOUT_S": str(a.timeout_s),
               "PHASEWISE_HTTP__BODY_TIMEOUT_S": str(a.timeout_s),
               "PHASEWISE_HTTP__KEEPALIVE_TIMEOUT_S": str(a.keepalive_s)}
        procs.append(subprocess.Popen([sys.executable, "-m", "routerd", "serve", "--host", "127.0.0.1", "--port",
                                       str(port), "--no-grpc", "--policy", "round_robin", "--profile", PROFILE,
                                       "--model", MODEL, "--log-level", "error", *eps],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True))
        wait_http(f"http://127.0.0.1:{port}/readyz")
        time.sleep(1.0)
        base = asyncio.run(_drive(port, work))
        worker = subprocess.Popen([sys.executable, __file__, "--worker", str(port), "--bad", str(a.bad)],
                                  stdout=subprocess.PIPE, text=True)
        assert worker.stdout is not None
        if worker.stdout.readline().strip() != "opened":
            raise RuntimeError("the worker did not open its connections")
        slow = asyncio.run(_drive(port, work))
        closes = json.loads(worker.communicate(timeout=120)[0])
        print(f"{a.instances} emulators ({PROFILE}) with sidecars, 1 routerd; header/body timeout {a.timeout_s} s, "
              f"keep-alive {a.keepalive_s} s; {a.clients} clients x {a.requests} requests")
        print(f"normal requests   p99 E2E {_p(slow, 0.99):.3f} s beside {a.bad} bad connections, "
              f"{_p(base, 0.99):.3f} s without (ratio {_p(slow, 0.99) / _p(base, 0.99):.2f}); "
              f"mean {statistics.fmean(slow):.3f} s vs {statistics.fmean(base):.3f} s")
        for kind in KINDS:
            ts = closes[kind]
            done = sorted(t for t in ts if t is not None)
            within = sum(1 for t in done if t <= a.timeout_s + a.slack_s)
            print(f"{kind:<12} {len(ts):>5} opened, {len(done):>5} closed by routerd "
                  f"(median {statistics.median(done) if done else float('nan'):.2f} s, "
                  f"max {max(done) if done else float('nan'):.2f} s), {within} within {a.timeout_s + a.slack_s:.1f} s")
    finally:
        stop(procs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
