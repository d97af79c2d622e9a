"""Several routerd replicas in front of the same instances, each driven by its own clients (issue 15).

Starts ``--instances`` (3) emulators (``phasewise emulate``, the llama2-7b-v100 profile's
real-time instance model: batching, KV blocks) with a sidecar each, then for every policy
and replica count R in ``--replicas`` (1,2,3): R ``phasewise serve`` processes, each with
every instance and its sidecar, and ``--clients`` closed-loop streaming clients split evenly
over the replicas (each client sends ``--requests`` completions one after another). It
prints, per (policy, R):

- the busiest instance's share of the requests over an even split (decisions summed over
  the replicas' ``phasewise_decisions_total``); target <= 1.3;
- mean and p90 E2E (client-observed), and mean E2E over R = 1's in the same run; target
  within 5%;
- ``--sequential``: also one client per replica sending one request at a time (the issue's
  herding case: every instance idle at each decision).

Every run uses the same requests (prompt lengths and max_tokens from ``--seed``).

Usage: python benchmarks/routerd_replicas.py [--policies join_shortest_queue,late_binding,phasewise]
       [--replicas 1,2,3] [--clients 12] [--requests 8] [--tokens 64] [--seed 0] [--sequential]
       [--seq-requests 20]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from emulated_pool import (MODEL, PROFILE, endpoint_flags, free_port, start, start_instances,  # noqa: E402
                           stop, stream_once, wait_http)


def decisions(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for m in re.finditer(r'^phasewise_decisions_total\{endpoint="([^"]+)"\} ([0-9.e+]+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


async def client(session, url: str, work: list[tuple[int, int]], e2e: list[float]) -> None:
    for chars, tokens in work:
        status, took = await stream_once(session, url, chars, tokens)
        if status != 200:
            raise RuntimeError(f"HTTP {status} from {url}")
        e2e.append(took)


async def drive(urls: list[str], clients: int, work: list[list[tuple[int, int]]]) -> list[float]:
    e2e: list[float] = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        await asyncio.gather(*(client(s, urls[i % len(urls)], work[i], e2e) for i in range(clients)))
    return e2e


def one(policy: str, replicas: int, inst: list[tuple[str, str, str]], clients: int,
        work: list[list[tuple[int, int]]], seed: int) -> dict:
    ports = [free_port() for _ in range(replicas)]
    procs = []
    try:
        for port in ports:
            procs.append(start(["serve", "--host", "127.0.0.1", "--port", str(port), "--no-grpc", "--policy", policy,
                                "--profile", PROFILE, "--model", MODEL, "--log-level", "warning",
                                *endpoint_flags(inst)]))
        for port in ports:
            wait_http(f"http://127.0.0.1:{port}/readyz")
        time.sleep(1.0)  # sidecar state arrives
        t0 = time.perf_counter()
        e2e = asyncio.run(drive([f"http://127.0.0.1:{p}" for p in ports], clients, work))
        wall = time.perf_counter() - t0
        by = {}
        for port in ports:
            for k, v in decisions(port).items():
                by[k] = by.get(k, 0.0) + v
    finally:
        stop(procs)
    total = sum(by.values())
    share = max(by.values()) / (total / len(inst)) if total else float("nan")
    e2e.sort()
    return {"share": share, "by": by, "mean": statistics.fmean(e2e), "p90": e2e[int(0.9 * (len(e2e) - 1))],
            "n": len(e2e), "wall": wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", default="join_shortest_queue,late_binding,phasewise")
    ap.add_argument("--replicas", default="1,2,3")
    ap.add_argument("--instances", type=int, default=3)
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--requests", type=int, default=8, help="requests per client")
    ap.add_argument("--tokens", type=int, default=64, help="mean max_tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sequential", action="store_true", help="also one sequential client per replica")
    ap.add_argument("--seq-requests", type=int, default=20,
                    help="requests of each sequential client (an idle cluster: every decision a tie, so "
                         "the split is random and needs a few hundred requests to be near even)")
    a = ap.parse_args(argv)
    rng = random.Random(a.seed)
    work = [[(rng.randint(200, 2000), max(8, int(rng.expovariate(1 / a.tokens)))) for _ in range(a.requests)]
            for _ in range(a.clients)]
    seq_work = [[(rng.randint(200, 2000), max(8, int(rng.expovariate(1 / a.tokens))))
                 for _ in range(a.seq_requests)] for _ in range(3)]
    procs: list = []
    try:
        inst = start_instances(a.instances, procs)
        time.sleep(1.0)
        print(f"{a.instances} emulators ({PROFILE}) with sidecars; {a.clients} closed-loop clients x "
              f"{a.requests} requests (same requests every run, seed {a.seed})")
        print(f"{'policy':<22} {'R':>2} {'busiest/even':>12} {'mean E2E s':>10} {'vs R=1':>7} {'p90 s':>6} "
              f"{'requests':>8}  per instance")
        for policy in a.policies.split(","):
            base = None
            for r in (int(x) for x in a.replicas.split(",")):
                f = one(policy, r, inst, a.clients, work, a.seed)
                base = f["mean"] if base is None else base
                print(f"{policy:<22} {r:>2} {f['share']:>12.2f} {f['mean']:>10.3f} {f['mean'] / base - 1:>+7.1%} "
                      f"{f['p90']:>6.2f} {f['n']:>8}  {dict(sorted((k, int(v)) for k, v in f['by'].items()))}",
                      flush=True)
            if a.sequential:
                for r in (2, 3):
                    f = one(policy, r, inst, r, seq_work[:r], a.seed)
                    print(f"{policy:<22} {r:>2} {f['share']:>12.2f} {f['mean']:>10.3f} {'(seq)':>7} "
                          f"{f['p90']:>6.2f} {f['n']:>8}  {dict(sorted((k, int(v)) for k, v in f['by'].items()))}",
                          flush=True)
    finally:
        stop(procs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
