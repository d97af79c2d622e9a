"""A hung or always-500 backend beside healthy ones: its share after ejection, and healthy p99 (issue 15).

Starts ``--instances`` (2) emulators (``phasewise emulate``, the llama2-7b-v100 profile's
real-time instance model) with a sidecar each, and one bad backend in this process: ``hung``
(accepts the request, never answers) or ``500`` (answers HTTP 500 at once). For each policy
in ``--policies`` and each kind in ``--kinds`` it runs one routerd (``phasewise serve``)
three times on the same requests:

- **baseline**: the healthy instances only;
- **bad**: the healthy instances and the bad backend (routerd's default outlier detection:
  5 consecutive errors eject it, 30 s at first; ``upstream.response_timeout_s`` is
  ``--timeout-s`` so a hung backend costs a bounded wait).

``--clients`` closed-loop streaming clients send ``--requests`` completions each. It prints
per (policy, kind):

- requests the bad backend received after its first ejection, over all requests routerd
  dispatched after that moment (target <= 5 %); the first ejection's time is read from
  routerd's ``phasewise_endpoint_ejections_total`` polled every 50 ms;
- p99 and mean E2E of the requests answered 200, in the bad run over the baseline run
  (target: p99 within 10 %), and how many requests failed (the ones the bad backend took
  before its ejection).

Usage: python benchmarks/routerd_bad_backend.py [--policies round_robin,join_shortest_queue]
       [--kinds hung,500] [--clients 8] [--requests 25] [--tokens 32] [--timeout-s 2] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
from emulated_pool import (MODEL, PROFILE, endpoint_flags, free_port, start_instances, stop,  # noqa: E402
                           stream_once, wait_http)


class BadBackend:
    """``hung``: reads the request and never answers; ``500``: answers 500 at once. Counts hits (monotonic s)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.hits: list[float] = []
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.hits.append(time.monotonic())
        if self.kind == "hung":
            await asyncio.sleep(3600)
        return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_get("/v1/models", self._models)
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


def _metric(text: str, name: str, endpoint: str) -> float:
    m = re.search(rf'^{name}\{{endpoint="{re.escape(endpoint)}"\}} ([0-9.e+]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _total(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf'^{name}\{{[^}}]*\}} ([0-9.e+]+)$', text, re.M))


async def _scrape(session: aiohttp.ClientSession, port: int) -> str:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
        return await r.text()


async def _client(session, url, work, ok: list[float], failed: list[int]) -> None:
    for chars, tokens in work:
        status, took = await stream_once(session, url, chars, tokens)
        if status == 200:
            ok.append(took)
        else:
            failed.append(status)


async def _run(port: int, work, bad: BadBackend | None) -> dict:
    """Drive one routerd; with ``bad``, watch its ejection counter and the decisions after it."""
    ok: list[float] = []
    failed: list[int] = []
    seen: dict = {"t": None, "decisions": None}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        done = asyncio.Event()

        async def watch() -> None:
            while not done.is_set():
                text = await _scrape(s, port)
                if _metric(text, "phasewise_endpoint_ejections_total", "bad") >= 1:
                    seen["t"] = time.monotonic()
                    seen["decisions"] = _total(text, "phasewise_decisions_total")
                    return
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch()) if bad is not None else None
        await asyncio.gather(*(_client(s, f"http://127.0.0.1:{port}", w, ok, failed) for w in work))
        done.set()
        if watcher is not None:
            await watcher if watcher.done() else watcher.cancel()
        final = await _scrape(s, port)
    out = {"ok": sorted(ok), "failed": failed}
    if bad is not None:
        t = seen["t"]
        after = _total(final, "phasewise_decisions_total") - (seen["decisions"] or 0.0)
        out["bad_after"] = sum(1 for h in bad.hits if t is not None and h > t)
        out["dispatched_after"] = after if t is not None else 0.0
        out["ejected"] = t is not None
    return out


def _p(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", default="round_robin,join_shortest_queue")
    ap.add_argument("--kinds", default="hung,500")
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=25, help="requests per client")
    ap.add_argument("--tokens", type=int, default=32, help="mean max_tokens")
    ap.add_argument("--timeout-s", type=float, default=2.0, help="routerd's upstream.response_timeout_s")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    rng = random.Random(a.seed)
    work = [[(rng.randint(200, 2000), max(8, int(rng.expovariate(1 / a.tokens)))) for _ in range(a.requests)]
            for _ in range(a.clients)]
    procs: list = []
    loop = asyncio.new_event_loop()
    try:
        inst = start_instances(a.instances, procs)
        print(f"{a.instances} emulators ({PROFILE}) with sidecars + 1 bad backend; {a.clients} closed-loop "
              f"clients x {a.requests} requests (same requests every run, seed {a.seed}); "
              f"response_timeout_s {a.timeout_s}")
        print(f"{'policy':<22} {'bad':>5} {'bad after ejection':>19} {'p99 ok s':>9} {'base p99':>9} {'ratio':>6} "
              f"{'mean ok':>8} {'base mean':>9} {'failed':>6}")
        for policy in a.policies.split(","):
            for kind in a.kinds.split(","):
                results = {}
                for label in ("baseline", "bad"):
                    bad = BadBackend(kind) if label == "bad" else None
                    if bad is not None:
                        loop.run_until_complete(bad.start())
                    eps = endpoint_flags(inst)
                    if bad is not None:
                        eps += ["--endpoint", f"bad=http://127.0.0.1:{bad.port}"]
                    port = free_port()
                    env = {**os.environ, "PHASEWISE_UPSTREAM__RESPONSE_TIMEOUT_S": str(a.timeout_s)}
                    p = subprocess.Popen([sys.executable, "-m", "routerd", "serve", "--host", "127.0.0.1",
                                          "--port", str(port), "--no-grpc", "--policy", policy, "--profile",
                                          PROFILE, "--model", MODEL, "--log-level", "error", *eps],
                                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True)
                    try:
                        wait_http(f"http://127.0.0.1:{port}/readyz")
                        time.sleep(1.0)  # sidecar state arrives
                        results[label] = loop.run_until_complete(_run(port, work, bad))
                    finally:
                        stop([p])
                        if bad is not None:
                            loop.run_until_complete(bad.runner.cleanup())
                b, x = results["baseline"], results["bad"]
                share = (f"{x['bad_after']}/{int(x['dispatched_after'])} "
                         f"({x['bad_after'] / x['dispatched_after']:.1%})" if x["ejected"] and x["dispatched_after"]
                         else "never ejected")
                p99b, p99x = _p(b["ok"], 0.99), _p(x["ok"], 0.99)
                print(f"{policy:<22} {kind:>5} {share:>19} {p99x:>9.3f} {p99b:>9.3f} {p99x / p99b:>6.2f} "
                      f"{statistics.fmean(x['ok']):>8.3f} {statistics.fmean(b['ok']):>9.3f} "
                      f"{len(x['failed']):>6}", flush=True)
    finally:
        stop(procs)
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
