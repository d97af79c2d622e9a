"""Emulator CPU per streamed request in fixed-timing mode (the load benchmark's backend).

Starts ``phasewise emulate --fixed-timing 0.02,0.005`` as a child process, drives it
with ``--concurrency`` (128) streaming completions of 64 tokens at a time for
``--rounds`` rounds from a lean aiohttp client, and reports the emulator's CPU time
per request two ways:

* ``process_cpu_seconds_total`` on its ``/metrics`` before and after the load;
* ``resource.getrusage(RUSAGE_CHILDREN)`` after it exits, minus the same for a run
  that starts and stops it with no load (start-up and import cost).

Also prints client-observed TTFT and inter-token gaps (p50) against the configured
values, to show the emulator keeps its timing under this load on this machine (tokens that
came in one event, or one read, have a gap of 0 between them).

Usage: python benchmarks/emulator_cpu.py [--concurrency 128] [--rounds 4] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from routerd.emulator.process import EmulatorProcess


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


async def _cpu_metric(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    for fam in text_string_to_metric_families(text):
        if fam.name == "process_cpu_seconds":
            return fam.samples[0].value
    raise RuntimeError("no process_cpu_seconds_total on /metrics")


async def _one(session: aiohttp.ClientSession, url: str, tokens: int) -> tuple[float, list[float]]:
    body = {"model": "llama-2-7b", "prompt": "Say something about routers.", "max_tokens": tokens, "stream": True}
    t0 = time.perf_counter()
    times: list[float] = []
    async with session.post(url + "/v1/completions", json=body) as r:
        # One timestamp per network read, tokens counted with bytes operations: a lean client,
        # so the emulator rather than this process sets the pace. An event may carry several
        # tokens (the emulator coalesces what it produced since its last write, as vLLM does):
        # its text is one filler word per token, each with a leading space, and its JSON is
        # compact, so a read's tokens are its spaces less the one after each "data:".
        async for data in r.content.iter_any():
            t = time.perf_counter()
            times.extend([t] * (data.count(b" ") - data.count(b"data: ")))
    if len(times) != tokens:
        raise RuntimeError(f"expected {tokens} tokens, got {len(times)}")
    return times[0] - t0, [b - a for a, b in zip(times, times[1:])]


async def _load(url: str, concurrency: int, rounds: int, tokens: int) -> dict:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        await asyncio.gather(*(_one(s, url, 2) for _ in range(concurrency)))  # open the connections
        cpu0 = await _cpu_metric(s, url)
        t0 = time.perf_counter()
        ttfts: list[float] = []
        gaps: list[float] = []
        for _ in range(rounds):
            for ttft, g in await asyncio.gather(*(_one(s, url, tokens) for _ in range(concurrency))):
                ttfts.append(ttft)
                gaps.extend(g)
        wall = time.perf_counter() - t0
        cpu1 = await _cpu_metric(s, url)
    return {"cpu_metric_s": cpu1 - cpu0, "wall_s": wall, "ttft_p50": statistics.median(ttfts),
            "gap_p50": statistics.median(gaps), "gap_mean": statistics.fmean(gaps),
            "warmup_requests": concurrency}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ttft", type=float, default=0.02)
    ap.add_argument("--tpot", type=float, default=0.005)
    args = ap.parse_args()
    flags = ["--port", "0", "--fixed-timing", f"{args.ttft},{args.tpot}"]

    base = _children_cpu()
    with EmulatorProcess(*flags):
        pass
    idle = _children_cpu() - base

    base = _children_cpu()
    with EmulatorProcess(*flags) as emu:
        res = asyncio.run(_load(emu.url, args.concurrency, args.rounds, args.tokens))
    total = _children_cpu() - base
    n = args.concurrency * args.rounds
    warm = res["warmup_requests"]
    print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in res.items()}))
    print(f"{n} streamed requests ({args.tokens} tokens each, {args.concurrency} concurrent, fixed timing "
          f"{args.ttft}/{args.tpot} s) in {res['wall_s']:.2f} s")
    print(f"emulator CPU per request, process_cpu_seconds_total: {res['cpu_metric_s'] / n * 1e3:.3f} ms")
    print(f"emulator CPU per request, getrusage(RUSAGE_CHILDREN) minus start/stop ({idle:.2f} s): "
          f"{(total - idle) / (n + warm) * 1e3:.3f} ms (includes the {warm} warm-up requests)")
    print(f"client-side p50 TTFT {res['ttft_p50'] * 1e3:.1f} ms (configured {args.ttft * 1e3:.1f}), "
          f"p50 inter-token gap {res['gap_p50'] * 1e3:.2f} ms, mean {res['gap_mean'] * 1e3:.2f} ms "
          f"(configured {args.tpot * 1e3:.2f})")


if __name__ == "__main__":
    main()
