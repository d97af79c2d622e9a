"""Prefix-cache-aware routing online: routerd in front of emulators, beside the simulator, one run.

A shared-prefix workload (``routerd.workloads.shared_prefix``, the offline issue's generator
in the shape of llm-d's capacity benchmark, scaled to this machine) is written out as text:
every content unit ``(id, tokens)`` becomes ``4 * tokens`` bytes of seeded ASCII, so equal
unit sequences are equal text, and the emulator's byte tokenizer (``routerd.prefix.text``)
sees exactly ``tokens`` tokens per unit. Each request is then served twice:

- **simulated**: ``ClusterSimulator`` with the same profile and instance count, the same
  requests (prefix identity: one content unit per 16-token block of the prompt's bytes, so
  the simulated cache keys blocks exactly as the emulator's does), the same policy (routerd's
  ``router.near_tie``; no length predictor on either side: the lengths are all equal);
- **online**: ``phasewise emulate`` x N (prefix caching and vLLM KV events on), a sidecar
  each, ``phasewise serve`` with the policy and the prefix mode, and an open-loop client
  that sends each request at its arrival time as a streamed completion and times it.

Modes: ``off`` (the policy gets no prefix: load only), ``approximate`` (routerd's index of
its own dispatches), ``precise`` (the engines' KV events, keyed from the byte tokenizer's
ids). In the simulator ``approximate``/``precise`` set the policy's ``prefix_source``; ``off``
strips the prefix from what the policy sees (the simulated engines still cache, as vLLM does).
round_robin ignores prefixes and runs once.

Printed per policy and mode: hit rate (prompt tokens served from the cache / prompt tokens,
the emulators' ``vllm:prefix_cache_*`` counters online, the simulator's counts offline),
mean and p90 TTFT, mean E2E (s), online beside simulated. The load is ``--load`` times round
robin's simulated saturated throughput on the same requests (``routerd.sim.capacity``).

Usage: python benchmarks/prefix_online.py [--instances 4] [--requests 240] [--load 0.8]
       [--policies round_robin,llmd,phasewise] [--modes off,approximate,precise] [--seed 0]
       [--sim-only] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "routerd"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from routerd.model import Request  # noqa: E402
from routerd.policies.base import PolicyContext, RoutingPolicy  # noqa: E402
from routerd.policies.registry import build_policy  # noqa: E402
from routerd.prefix.text import block_unit_ids, byte_token_array  # noqa: E402
from routerd.profiles import get_profile  # noqa: E402
from routerd.sim.capacity import round_robin_capacity  # noqa: E402
from routerd.sim.cluster import ClusterSimulator  # noqa: E402
from routerd.sim.prepare import prepare_requests  # noqa: E402
from routerd.sim.report import summarize  # noqa: E402
from routerd.workloads.shared_prefix import SharedPrefixParams, shared_prefix  # noqa: E402
from routerd.workloads.traces import rescale_to_rate  # noqa: E402

PROFILE = "llama2-7b-v100"
#: routerd's default ``router.near_tie``, given to the simulated policy too.
NEAR_TIE = 0.05
MODEL = "llama-2-7b"
BLOCK = 16
#: The workload, scaled to a 2-core machine: 12 groups x 4 users, 1,024-token system prompts,
#: 64-token questions, 16-token answers, the benchmark's repeat mode.
PARAMS = SharedPrefixParams(groups=12, users_per_group=4, system_prompt_tokens=1024, question_tokens=64,
                            output_tokens=16, multi_turn=False)


# -- the workload as text ------------------------------------------------------------------------

def unit_text(uid: int, tokens: int, seed: int) -> str:
    """``4 * tokens`` bytes of lower-case ASCII words, a function of (uid, seed) only."""
    rng = np.random.default_rng([seed, uid])
    raw = rng.integers(97, 123, size=4 * tokens, dtype=np.uint8)
    raw[rng.random(4 * tokens) < 0.18] = 32
    return raw.tobytes().decode("ascii")


def block_units(text: str) -> tuple[tuple[int, int], ...]:
    """The prompt's prefix identity as the simulator takes it: one unit per full block of the
    byte tokenizer's ids (id: the block's unit hash, which equal blocks share) and one unit for
    the partial tail (an id of its own text), so the simulated cache shares a block exactly when
    the emulator's token-block chain does."""
    ids = byte_token_array(text)
    n = len(ids) // BLOCK
    units = [(u >> 1, BLOCK) for u in block_unit_ids(ids, BLOCK)]  # unit ids are int64 (chain.py)
    rest = len(ids) - n * BLOCK
    if rest:
        units.append((block_unit_ids(ids[n * BLOCK:], rest)[0] >> 1, rest))
    return tuple(units)


def build_workload(n: int, seed: int) -> tuple[list[str], list[Request]]:
    """(prompt texts, simulator requests at 1 req/s) of the benchmark's ``n`` requests."""
    base = shared_prefix(PARAMS, n, 1.0, seed)
    texts, reqs = [], []
    for r in base:
        text = "".join(unit_text(uid, t, seed) for uid, t in r.prefix)
        texts.append(text)
        reqs.append(Request(id=r.id, arrival_s=r.arrival_s, prompt_tokens=len(byte_token_array(text)),
                            output_tokens=r.output_tokens, prefix=block_units(text)))
    return texts, reqs


# -- the simulator -------------------------------------------------------------------------------

class _Blind(RoutingPolicy):
    """``inner`` deciding without prefix identity (mode ``off``): the request it sees has none."""

    name = "blind"

    def __init__(self, inner: RoutingPolicy) -> None:
        super().__init__(inner.ctx, inner.params)
        self.inner = inner
        self.order_sensitive = inner.order_sensitive

    def pick(self, request, view):
        return self.inner.pick(dataclasses.replace(request, prefix=None), view)

    def on_complete(self, instance, request_id, now):
        self.inner.on_complete(instance, request_id, now)


def policy_params(name: str, mode: str) -> dict[str, Any]:
    from routerd.policies.registry import POLICIES  # the registry's classes

    cls = POLICIES[name]
    if mode in ("approximate", "precise") and "prefix_source" in cls.Params.model_fields:
        return {"prefix_source": mode}
    return {}


def simulate(name: str, mode: str, reqs: list[Request], m: int, seed: int) -> dict[str, float]:
    profile = get_profile(PROFILE)
    # routerd's near-tie width (router.near_tie): the same policy on both sides.
    ctx = PolicyContext(profile, m, seed=seed, near_tie=NEAR_TIE)
    policy = build_policy(name, policy_params(name, mode), ctx)
    if mode == "off":
        policy = _Blind(policy)
    prep = prepare_requests(reqs, profile, prediction="none", seed=seed)
    run = ClusterSimulator(profile, m, policy).run(prep.requests)
    s = summarize(run)
    return {"hit_rate": s.prefix_hit_rate or 0.0, "ttft_mean": s.ttft_mean, "ttft_p90": s.ttft_p90,
            "e2e_mean": s.e2e_mean}


def capacity(reqs: list[Request], m: int) -> float:
    """Round robin's saturated throughput (req/s) on ``reqs`` over ``m`` simulated instances."""
    return round_robin_capacity(reqs, get_profile(PROFILE), m)


def workload_at_load(a) -> tuple[list[str], list[Request], float, float]:
    """(texts, requests at ``a.load`` x capacity, capacity, rate), the workload line printed."""
    texts, reqs = build_workload(a.requests, a.seed)
    cap = capacity(reqs, a.instances)
    rate = a.load * cap
    reqs = rescale_to_rate(reqs, rate)
    print(f"workload: {a.requests} requests, {PARAMS.groups} x {PARAMS.users_per_group} users, system "
          f"{PARAMS.system_prompt_tokens} + question {PARAMS.question_tokens} tokens, {PARAMS.output_tokens}-token "
          f"answers; {a.instances} x {PROFILE}; capacity {cap:.2f} req/s (round robin, simulated), load "
          f"{a.load:g}x = {rate:.2f} req/s; seed {a.seed}", flush=True)
    return texts, reqs, cap, rate


def main_sim(a) -> None:
    _, reqs, _, _ = workload_at_load(a)
    for name in a.policies:
        for mode in (["-"] if name == "round_robin" else a.modes):
            s = simulate(name, "off" if mode == "-" else mode, reqs, a.instances, a.seed)
            print(f"{name:12s} {mode:11s} sim hit {100 * s['hit_rate']:5.1f}%  TTFT mean {s['ttft_mean']:.3f} "
                  f"p90 {s['ttft_p90']:.3f}  E2E mean {s['e2e_mean']:.3f}")


# -- online --------------------------------------------------------------------------------------

def start_pool(m: int, procs: list) -> list[dict[str, str]]:
    """``m`` emulators (prefix caching on, KV events on a loopback port each) with a sidecar each."""
    from emulated_pool import free_port, start, wait_http

    out = []
    for i in range(m):
        hp, sp, zp = free_port(), free_port(), free_port()
        kv = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": f"tcp://*:{zp}", "topic": ""})
        procs.append(start(["emulate", "--host", "127.0.0.1", "--port", str(hp), "--profile", PROFILE,
                            "--model", MODEL, "--seed", str(i), "--kv-events-config", kv]))
        url = f"http://127.0.0.1:{hp}"
        wait_http(url + "/health")
        procs.append(start(["sidecar", "--metrics-url", url + "/metrics", "--listen", f"127.0.0.1:{sp}",
                            "--instance", f"vllm-{i}", "--endpoint", url]))
        out.append({"name": f"vllm-{i}", "url": url, "state_address": f"127.0.0.1:{sp}",
                    "kv_events": f"tcp://127.0.0.1:{zp}"})
    return out


def _counter(url: str, name: str) -> float:
    import urllib.request

    total = 0.0
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
    return total


def cache_counters(pool: list[dict[str, str]]) -> tuple[float, float]:
    """(hits, queries) in tokens summed over the emulators (vLLM's counters)."""
    return (sum(_counter(e["url"], "vllm:prefix_cache_hits_total") for e in pool),
            sum(_counter(e["url"], "vllm:prefix_cache_queries_total") for e in pool))


def reset_caches(pool: list[dict[str, str]]) -> None:
    import urllib.request

    for e in pool:
        urllib.request.urlopen(urllib.request.Request(e["url"] + "/reset_prefix_cache", method="POST"),
                               timeout=10).read()


async def replay(url: str, texts: list[str], reqs: list[Request]) -> list[tuple[float, float]]:
    """Each request at its arrival time (open loop) as a streamed completion: (TTFT, E2E) in s."""
    import aiohttp

    out: list[tuple[float, float] | None] = [None] * len(reqs)

    async def one(session, i: int, t0: float) -> None:
        r = reqs[i]
        delay = t0 + r.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        sent = time.perf_counter()
        first = None
        body = {"model": MODEL, "prompt": texts[i], "max_tokens": r.output_tokens, "stream": True}
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"request {i}: HTTP {resp.status}: {(await resp.text())[:200]}")
            async for chunk in resp.content.iter_any():
                if first is None and b"data:" in chunk:
                    first = time.perf_counter()
        end = time.perf_counter()
        out[i] = (first - sent, end - sent)

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        t0 = time.perf_counter() + 0.2
        await asyncio.gather(*(one(session, i, t0) for i in range(len(reqs))))
    return out  # type: ignore[return-value]


def online(name: str, mode: str, pool: list[dict[str, str]], texts: list[str], reqs: list[Request],
           seed: int, logdir: str) -> dict[str, float]:
    import yaml

    from emulated_pool import free_port, start, stop, wait_http

    port = free_port()
    params = policy_params(name, mode)
    cfg = {"http": {"host": "127.0.0.1", "port": port}, "grpc": {"enabled": False}, "models": [MODEL],
           "endpoints": pool, "policy": {"name": name, "params": params}, "profile": PROFILE,
           "predictor": "none",
           "router": {"tie_break_seed": seed, "near_tie": NEAR_TIE}, "reload": {"watch": False},
           "prefix": {"mode": mode, "tokenizer": "bytes" if mode == "precise" else ""}}
    path = os.path.join(logdir, f"routerd-{name}-{mode}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    procs = [start(["serve", "--config", path, "--log-level", "warning"])]
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz")
        # Empty caches, reset once routerd subscribes: its indexes see the AllBlocksCleared and
        # are exact from there (ZMQ drops what is published before a subscription is joined).
        time.sleep(1.0)
        reset_caches(pool)
        h0, q0 = cache_counters(pool)
        res = asyncio.run(replay(f"http://127.0.0.1:{port}", texts, reqs))
        rm = _scrape(f"http://127.0.0.1:{port}")
    finally:
        stop(procs)
    h1, q1 = cache_counters(pool)
    ttft = [x[0] for x in res]
    e2e = [x[1] for x in res]
    return {"hit_rate": (h1 - h0) / max(1.0, q1 - q0), "ttft_mean": statistics.fmean(ttft),
            "ttft_p90": float(np.percentile(ttft, 90)), "e2e_mean": statistics.fmean(e2e),
            "decisions_precise": rm.get(('phasewise_prefix_match_blocks_count', 'precise'), 0.0),
            "decisions_approximate": rm.get(('phasewise_prefix_match_blocks_count', 'approximate'), 0.0),
            "fallbacks": rm.get(('phasewise_prefix_fallbacks_total', None), 0.0)}


def _scrape(url: str) -> dict[tuple[str, str | None], float]:
    """routerd's prefix metrics: match counts by source, fallbacks summed."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, str | None], float] = {}
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == "phasewise_prefix_match_blocks_count":
                out[(smp.name, smp.labels.get("source"))] = smp.value
            elif smp.name == "phasewise_prefix_fallbacks_total":
                out[(smp.name, None)] = out.get((smp.name, None), 0.0) + smp.value
    return out


def main_online(a) -> None:
    from emulated_pool import stop

    texts, reqs, cap, rate = workload_at_load(a)
    rows = []
    procs: list = []
    with tempfile.TemporaryDirectory(prefix="prefix-online-") as logdir:
        try:
            pool = start_pool(a.instances, procs)
            for name in a.policies:
                for mode in (["off"] if name == "round_robin" else a.modes):
                    sim = simulate(name, mode, reqs, a.instances, a.seed)
                    on = online(name, mode, pool, texts, reqs, a.seed, logdir)
                    rows.append({"policy": name, "mode": mode, "sim": sim, "online": on})
                    shown = "-" if name == "round_robin" else mode
                    print(f"{name:12s} {shown:11s} hit {100 * on['hit_rate']:5.1f}% (sim {100 * sim['hit_rate']:5.1f}%)"
                          f"  TTFT mean {on['ttft_mean']:.3f} (sim {sim['ttft_mean']:.3f})"
                          f"  p90 {on['ttft_p90']:.3f} (sim {sim['ttft_p90']:.3f})"
                          f"  E2E mean {on['e2e_mean']:.3f} (sim {sim['e2e_mean']:.3f})"
                          f"  [decisions matched: {on['decisions_precise']:.0f} precise, "
                          f"{on['decisions_approximate']:.0f} approximate; {on['fallbacks']:.0f} fallbacks]", flush=True)
        finally:
            stop(procs)
    for mode in a.modes:
        sel = [r for r in rows if r["mode"] == mode or r["policy"] == "round_robin"]
        on_rank = [f"{r['policy']}" for r in sorted(sel, key=lambda r: r["online"]["ttft_mean"])]
        sim_rank = [f"{r['policy']}" for r in sorted(sel, key=lambda r: r["sim"]["ttft_mean"])]
        print(f"mode {mode}: ranking by mean TTFT online {on_rank}, simulated {sim_rank}: "
              f"{'equal' if on_rank == sim_rank else 'DIFFERENT'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "capacity_rps": cap, "rate_rps": rate, "args": vars(a)}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--load", type=float, default=0.8, help="offered load as a multiple of round robin's capacity")
    ap.add_argument("--policies", default="round_robin,llmd,phasewise")
    ap.add_argument("--modes", default="off,approximate,precise")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sim-only", action="store_true", help="only the simulator's figures")
    ap.add_argument("--json", default="", help="write every figure to this file")
    a = ap.parse_args()
    a.policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in a.modes if m not in ("off", "approximate", "precise")]
    if bad:
        ap.error(f"--modes: unknown mode(s) {bad}; use off, approximate, precise")
    if a.sim_only:
        main_sim(a)
        return
    main_online(a)


if __name__ == "__main__":
    main()
