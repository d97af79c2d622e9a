"""Sim-to-real fidelity: one real vLLM engine against the project's simulator with its fitted profile.

1. Profiles a real vLLM 0.32 engine (CPU build, the tiny model of ``tools/real_vllm``) with
   ``phasewise profile --endpoint URL`` (or takes ``--profile FILE``).
2. Takes a slice of ``--n`` (300) requests of the Azure 2023 conversation trace
   (``shared/data/traces/azure2023_conv.csv``, from request ``--offset``), keeping its arrival
   pattern. Lengths: the trace's prompts reach 14,050 tokens and the tiny engine serves 2,048,
   so every prompt and output is multiplied by ``--scale`` (0.5, rounded, at least 8 and 1
   tokens), prompts are then clipped to 1,536 tokens and outputs to ``2,047 - prompt`` (vLLM
   refuses ``prompt + max_tokens > max_model_len``); the same lengths go to the engine and to
   the simulator.
3. Capacity, the project's way (``routerd/routerd/sim/capacity.py``): the slice offered at
   1,000 req/s (all queued at once), finished requests / makespan. Measured on the real engine
   (the median of ``--repeats`` floods); the simulator's own figure for the profile is printed
   beside it.
4. At each ``--loads`` (0.8x, 1.5x of the measured capacity) the slice, rescaled to that mean
   rate (``rescale_to_rate``: the trace's gaps, stretched), is replayed against the engine
   ``--repeats`` times and simulated once with the profile (``routerd.bench.run_policy``: one
   instance, round robin, as ``phasewise bench`` runs it; the simulator is deterministic).

Requests are streamed completions: each prompt is text made for the tiny tokenizer to count
exactly as the trace's prompt (its ``tokenizer.json``, found through ``/v1/models``' ``root``),
starting with a random nonce so no prefix-cache block is shared (the Azure trace has no prefix
identity), ``max_tokens`` = the output, ``ignore_eos`` and ``min_tokens`` so it runs to length;
every request's ``usage`` is checked against the lengths asked for. Measured per request
(vLLM's definitions, as ``routerd/routerd/sim/report.py``): arrival = the scheduled send time,
TTFT = first token read - arrival, E2E = last token seen - arrival, TPOT = (E2E - TTFT) /
(output - 1). The load generator shares the engine's 2 cores, so it is kept light: a stream is
read token by token only until its first token; after that one task collects every open
stream's data each 20 ms (a stream's end is seen up to 20 ms late, against E2Es of seconds).
With every event of every stream read (an earlier
version), one run measured a mean TPOT of 21 ms at 0.8x and sent requests up to 0.9 s late;
this reader's runs measured 11-17 ms.

Prints per replay its figures and how long this process was kept from running (the longest
lateness of a 20 ms sleep: the machine's other load), the engine's own means from vLLM's
histograms (TTFT from arrival at its API server, inter-token latency, queue time), and measured
(median over replays, with the range) against simulated mean E2E, p90 TTFT and mean TPOT at each
load, with simulated / measured. Target: mean E2E and p90 TTFT within 15% at 0.8x. Run it
alone, under the real-engine lock: ``flock /tmp/pw-realvllm.lock python benchmarks/sim_to_real.py``.

Usage: python benchmarks/sim_to_real.py [--endpoint URL] [--profile FILE] [--quick] [--n 300]
       [--offset 0] [--scale 0.5] [--loads 0.8,1.5] [--repeats 3] [--seed 0] [--nice N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MAX_PROMPT = 1536
MIN_PROMPT = 8
WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact city river water light music story table garden window "
         "paper money road island engine market letter mountain").split()


# ---------------------------------------------------------------------------------------------
# Workload


def trace_slice(n: int, offset: int, scale: float, max_model_len: int):
    """``n`` requests of the Azure conversation trace from ``offset``, lengths scaled and clipped
    (module docstring), arrivals relative to the slice's first; returns ``(requests, note)``."""
    from routerd.workloads.registry import load_workload

    w = load_workload("azure-conv", limit=offset + n)
    reqs = w.requests[offset:offset + n]
    t0 = reqs[0].arrival_s
    out, clipped = [], 0
    for i, r in enumerate(reqs):
        p = min(MAX_PROMPT, max(MIN_PROMPT, round(r.prompt_tokens * scale)))
        o = max(1, round(r.output_tokens * scale))
        if p + o > max_model_len - 1:
            o, clipped = max_model_len - 1 - p, clipped + 1
        if p != max(MIN_PROMPT, round(r.prompt_tokens * scale)):
            clipped += 1
        out.append(r.model_copy(update={"id": i, "arrival_s": r.arrival_s - t0, "prompt_tokens": p,
                                        "output_tokens": o}))
    note = (f"azure-conv requests {offset}-{offset + n - 1}, lengths x{scale:g} (prompts {MIN_PROMPT}.."
            f"{MAX_PROMPT}, prompt + output <= {max_model_len - 1}; {clipped} clipped)")
    return out, note


class Prompts:
    """Text prompts of exact token counts for the engine's tokenizer (``tokenizer.json``), each
    starting with a random nonce (unique first block)."""

    def __init__(self, tokenizer_json: Path, seed: int) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(tokenizer_json))
        self.rng = random.Random(seed)

    def count(self, text: str) -> int:
        """The engine's count of a completions prompt (the tokenizer's, BOS included)."""
        return len(self.tok.encode(text).ids)

    def make(self, tokens: int) -> str:
        """A prompt of exactly ``tokens`` tokens.

        Raises:
            RuntimeError: no text of that count was found (never seen with the tiny tokenizer)."""
        words = [f"{self.rng.getrandbits(48):012x}"] + [self.rng.choice(WORDS) for _ in range(tokens)]
        ids = self.tok.encode(" ".join(words)).ids
        k = tokens
        for _ in range(40):
            text = self.tok.decode(ids[:k], skip_special_tokens=True)
            got = self.count(text)
            if got == tokens:
                return text
            k = max(1, min(len(ids), k + tokens - got))
        raise RuntimeError(f"no prompt of exactly {tokens} tokens found")


# ---------------------------------------------------------------------------------------------
# The real engine


@dataclass
class Measured:
    """Per-request figures of one replay (s), and what the engine's own metrics said."""

    e2e: np.ndarray
    ttft: np.ndarray
    tpot: np.ndarray
    makespan: float
    max_send_lag_s: float
    max_stall_s: float
    """Longest lateness of the sweeper's 20 ms sleeps (s): this process waiting for a core."""
    client_cpu_s: float
    """CPU time this process used during the replay (s): the load generator's own cost."""
    server: dict[str, float]
    """Means over the replay of vLLM's own histograms (s): ``ttft`` (arrival at the API server to
    first token), ``e2e``, ``tpot`` (``request_time_per_output_token``), ``queue`` (waiting to be
    scheduled), ``itl`` (inter-token latency, engine timestamps)."""

    @property
    def throughput(self) -> float:
        return len(self.e2e) / self.makespan


#: How often a stream whose first token has come is looked at again (s): its end is seen up
#: to this late (E2E and TPOT read high by half of it on average: 10 ms against E2Es of seconds).
POLL_S = 0.02

_SERVER_HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "e2e": "vllm:e2e_request_latency_seconds",
                      "tpot": "vllm:request_time_per_output_token_seconds", "queue": "vllm:request_queue_time_seconds",
                      "itl": "vllm:inter_token_latency_seconds"}


async def _histograms(session, url: str) -> dict[str, tuple[float, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    async with session.get(url + "/metrics") as r:
        text = await r.text()
    out = {}
    for fam in text_string_to_metric_families(text):
        for key, name in _SERVER_HISTOGRAMS.items():
            if fam.name == name:
                total = sum(x.value for x in fam.samples if x.name.endswith("_sum"))
                count = sum(x.value for x in fam.samples if x.name.endswith("_count"))
                out[key] = (total, count)
    return out


async def replay(url: str, model: str, requests, prompts: list[str]) -> Measured:
    """Send every request at its ``arrival_s`` (from now) as a streamed completion; return the
    figures. Each request's ``usage`` must match its lengths.

    The client must not be what is measured: on 2 cores its CPU is taken from the engine. A
    stream is read token by token only until its first token (TTFT needs it promptly); after
    that one sweeper task takes what has come for every open stream each :data:`POLL_S`, and
    the stream's end is the sweep that finds its last token.

    Raises:
        RuntimeError: a request failed or got other lengths than asked for."""
    import resource

    import aiohttp

    open_streams: dict[int, tuple] = {}
    done_at: dict[int, float] = {}
    bodies: dict[int, bytearray] = {}
    finished: dict[int, asyncio.Event] = {}

    def cpu() -> float:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    stalls: list[float] = []

    async def sweeper(stop: asyncio.Event) -> None:
        while not stop.is_set():
            t_ask = time.perf_counter()
            await asyncio.sleep(POLL_S)
            t = time.perf_counter()
            stalls.append(t - t_ask - POLL_S)  # how late this process woke: its own starvation
            for rid, (content, _) in list(open_streams.items()):
                data = content.read_nowait()
                if data:
                    bodies[rid] += data
                if rid not in done_at and b'"finish_reason":"length"' in bodies[rid][-4096:]:
                    done_at[rid] = t
                if content.at_eof():
                    del open_streams[rid]
                    finished[rid].set()

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=900)) as session:
        before = await _histograms(session, url)
        t0 = time.perf_counter() + 0.2
        cpu0 = cpu()
        lags: list[float] = []
        stop = asyncio.Event()
        sweep = asyncio.create_task(sweeper(stop))

        async def one(r, text: str):
            await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.perf_counter()))
            lags.append(time.perf_counter() - (t0 + r.arrival_s))
            body = {"model": model, "prompt": text, "max_tokens": r.output_tokens, "min_tokens": r.output_tokens,
                    "ignore_eos": True, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with session.post(url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"request {r.id}: HTTP {resp.status}: {(await resp.text())[:200]}")
                buf = bytearray()
                first = None
                while first is None:
                    data = await resp.content.readany()
                    if not data:
                        break
                    buf += data
                    if b'"choices":[{' in buf:
                        first = time.perf_counter()
                bodies[r.id] = buf
                finished[r.id] = asyncio.Event()
                if b'"finish_reason":"length"' in buf:
                    done_at[r.id] = first
                open_streams[r.id] = (resp.content, r)
                await finished[r.id].wait()
            usage = None
            for ev in bytes(bodies.pop(r.id)).split(b"\n\n"):
                if ev.startswith(b"data: {") and b'"choices":[]' in ev:
                    usage = json.loads(ev[6:])["usage"]
            if usage is None or usage["prompt_tokens"] != r.prompt_tokens or \
                    usage["completion_tokens"] != r.output_tokens:
                raise RuntimeError(f"request {r.id}: asked {r.prompt_tokens} + {r.output_tokens} tokens, usage "
                                   f"says {usage}")
            return t0 + r.arrival_s, first, done_at[r.id]

        try:
            res = await asyncio.gather(*(one(r, p) for r, p in zip(requests, prompts)))
        finally:
            stop.set()
            await sweep
        client_cpu = cpu() - cpu0
        after = await _histograms(session, url)
    server = {k: (after[k][0] - before[k][0]) / max(1.0, after[k][1] - before[k][1]) for k in after if k in before}
    arr = np.array([a for a, _, _ in res])
    first = np.array([f for _, f, _ in res])
    fin = np.array([e for _, _, e in res])
    out = np.array([r.output_tokens for r in requests])
    multi = out > 1
    tpot = (fin[multi] - first[multi]) / (out[multi] - 1)
    return Measured(fin - arr, first - arr, tpot, float(fin.max() - arr.min()), max(lags), max(stalls, default=0.0),
                    client_cpu, server)


def engine_facts(url: str) -> tuple[str, Path | None, int]:
    """``(model id, its folder from /v1/models' root or None, max_model_len)``."""
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        card = json.loads(r.read())["data"][0]
    root = Path(card["root"]) if isinstance(card.get("root"), str) else None
    return card["id"], root, int(card.get("max_model_len") or 2048)


def run_profiler(url: str, quick: bool, out: Path) -> None:
    cmd = [sys.executable, "-m", "routerd.profiler", "--endpoint", url, "--output", str(out)]
    if quick:
        cmd.append("--quick")
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"phasewise profile failed: {r.stderr.strip() or r.stdout.strip()}")
    print(f"profiled in {time.perf_counter() - t0:.0f} s: " + " ".join(r.stdout.strip().splitlines()[:2]))


# ---------------------------------------------------------------------------------------------
# The simulator


def simulate(requests, profile):
    """One instance, round robin, true predictions: ``phasewise bench``'s run (``run_policy``)."""
    from routerd.bench import policy_context, run_policy
    from routerd.policies.registry import build_policy_from_spec
    from routerd.sim.report import arrays, summarize

    policy = build_policy_from_spec("round_robin", policy_context(profile, 1))
    run, prep = run_policy(profile, 1, policy, requests)
    if prep.rejected or prep.clipped:
        raise SystemExit(f"the simulator rejected {len(prep.rejected)} and clipped {prep.clipped} requests")
    return summarize(run), arrays(run)


# ---------------------------------------------------------------------------------------------


def _fmt(values: list[float], scale: float = 1e3) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med * scale:9.1f}"
    return f"{med * scale:9.1f} ({min(values) * scale:.0f}-{max(values) * scale:.0f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoint", default=None, help="a running engine (default: start one)")
    ap.add_argument("--profile", default=None, help="a profile YAML (default: profile the engine now)")
    ap.add_argument("--quick", action="store_true", help="profile with --quick")
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--scale", type=float, default=0.5)
    ap.add_argument("--loads", default="0.8,1.5")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="prompt texts")
    ap.add_argument("--nice", type=int, default=0,
                    help="scheduling niceness for the engine this script starts and for itself (negative: ahead "
                         "of other work on a shared machine; needs the right to raise priority)")
    args = ap.parse_args()
    loads = [float(x) for x in args.loads.split(",")]

    from routerd.profiles import load_profile_file
    from routerd.sim.capacity import FLOOD_RATE, round_robin_capacity
    from routerd.workloads.traces import rescale_to_rate

    engine = None
    url = args.endpoint
    if url is None:
        sys.path.insert(0, str(ROOT / "tools"))
        from real_vllm.engine import one_benchmark_engine

        engine = one_benchmark_engine("sim-to-real")
        if isinstance(engine, str):
            print(f"error: {engine}", file=sys.stderr)
            return 2
        url = engine.url
    if args.nice:
        import os

        # The engine's API server, EngineCore and worker share one process group.
        if engine is not None and engine.proc is not None:
            os.setpriority(os.PRIO_PGRP, engine.proc.pid, args.nice)
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)
        print(f"niceness {args.nice} for {'the engine and ' if engine is not None else ''}this client")
    url = url.rstrip("/")
    wall0 = time.perf_counter()
    try:
        model, root, max_model_len = engine_facts(url)
        if root is None or not (root / "tokenizer.json").is_file():
            raise SystemExit(f"--endpoint {url}: /v1/models gives no model folder with a tokenizer.json (root "
                             f"{root}); the prompts need the engine's tokenizer")
        with tempfile.TemporaryDirectory() as d:
            if args.profile is None:
                path = Path(d) / "fit.yaml"
                run_profiler(url, args.quick, path)
            else:
                path = Path(args.profile)
            prof = load_profile_file(path)
        print(f"profile: overhead_s {prof.overhead_s:.4g}, prefill_per_token_s {prof.prefill_per_token_s:.4g}, "
              f"prefill_attn_s {prof.prefill_attn_s:.4g}, decode_per_seq_s {prof.decode_per_seq_s:.4g}, "
              f"decode_per_ctx_token_s {prof.decode_per_ctx_token_s:.4g}; max_num_seqs {prof.max_num_seqs}, "
              f"max_num_batched_tokens {prof.max_num_batched_tokens}, chunked_prefill {prof.chunked_prefill}, "
              f"KV {prof.kv_capacity_tokens} tokens")
        base, note = trace_slice(args.n, args.offset, args.scale, max_model_len)
        pr = np.array([r.prompt_tokens for r in base])
        ou = np.array([r.output_tokens for r in base])
        print(f"workload: {note}; prompt mean {pr.mean():.0f} (p90 {np.percentile(pr, 90):.0f}) tokens, output "
              f"mean {ou.mean():.0f} (p90 {np.percentile(ou, 90):.0f}) tokens")
        maker = Prompts(root / "tokenizer.json", args.seed)

        def texts():  # fresh prompts for every replay: nothing cached from an earlier one
            return [maker.make(r.prompt_tokens) for r in base]

        flood = rescale_to_rate(base, FLOOD_RATE)
        caps, cpus = [], []
        for _ in range(args.repeats):
            m = asyncio.run(replay(url, model, flood, texts()))
            caps.append(m.throughput)
            cpus.append(m.client_cpu_s / m.makespan)
        cap = statistics.median(caps)
        sim_cap = round_robin_capacity(base, prof, 1)
        print(f"capacity (slice offered at {FLOOD_RATE:g} req/s, finished / makespan): measured "
              f"{cap:.2f} req/s ({', '.join(f'{c:.2f}' for c in caps)}), simulated {sim_cap:.2f} req/s "
              f"(x{sim_cap / cap:.2f}); client CPU up to {max(cpus):.0%} of a core")

        rows = []
        for load in loads:
            reqs = rescale_to_rate(base, load * cap)
            meas = [asyncio.run(replay(url, model, reqs, texts())) for _ in range(args.repeats)]
            sim, _ = simulate(reqs, prof)
            busy = max(m.client_cpu_s / m.makespan for m in meas)
            got = {
                "mean E2E": ([float(m.e2e.mean()) for m in meas], sim.e2e_mean),
                "p90 TTFT": ([float(np.percentile(m.ttft, 90)) for m in meas], sim.ttft_p90),
                "mean TPOT": ([float(m.tpot.mean()) for m in meas], sim.tpot_mean),
            }
            print(f"\nload {load:g}x = {load * cap:.2f} req/s over {reqs[-1].arrival_s:.1f} s ({args.repeats} replays; "
                  f"client CPU up to {busy:.0%} of a core)")
            for i, m in enumerate(meas):
                print(f"  replay {i}: mean E2E {m.e2e.mean() * 1e3:.0f} ms, p90 TTFT {np.percentile(m.ttft, 90) * 1e3:.0f} "
                      f"ms, mean TPOT {m.tpot.mean() * 1e3:.1f} ms; this process stalled up to {m.max_stall_s * 1e3:.0f} "
                      f"ms, sent up to {m.max_send_lag_s * 1e3:.0f} ms late")
            print(f"  {'metric':<10} {'measured ms (range)':>26} {'simulated ms':>13} {'sim/meas':>9}")
            for k, (m, s) in got.items():
                ratio = s / statistics.median(m)
                rows.append((load, k, ratio))
                print(f"  {k:<10} {_fmt(m):>26} {s * 1e3:13.1f} {ratio:9.2f}")
            srv = {k: statistics.median(m.server[k] for m in meas) for k in meas[0].server}
            print("  engine's own means (vLLM histograms, ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in srv.items())
                  + f"; simulated mean TTFT {sim.ttft_mean * 1e3:.1f}, mean E2E {sim.e2e_mean * 1e3:.1f}")
        print()
        for load, k, ratio in rows:
            if load == 0.8 and k in ("mean E2E", "p90 TTFT"):
                print(f"target {k} at 0.8x within 15%: {'met' if abs(ratio - 1) <= 0.15 else 'MISSED'} "
                      f"(sim/meas {ratio:.2f})")
        import os

        print(f"wall time {time.perf_counter() - wall0:.0f} s; machine load average at the end "
              f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} (1, 5, 15 min) on {os.cpu_count()} cores")
    finally:
        if engine is not None:
            engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
