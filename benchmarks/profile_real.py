"""``phasewise profile`` against a real vLLM engine: does it finish, and how much do its fits spread?

Runs ``phasewise profile --endpoint URL --output FILE [--quick]`` (the command, as a child
process) ``--runs`` times against one real vLLM 0.32 engine (CPU build, the tiny model of
``tools/real_vllm``), and prints per run: whether it completed and wrote a profile that loads,
its wall time, the fitted terms and the fit residuals; then completions out of runs and each
term's median and spread (min-max relative to the median, and the coefficient of variation).

After each run it also measures the decode time per output token independently, the way
``tests/realvllm/test_profiler_real.py`` does (streamed batches of B = 1 and 8 requests with
200-token prompts through the official ``openai`` client, tokens counted by vLLM's ``usage``:
the growth of the batch's median end-to-end time from 32 to 288 output tokens over the 256
tokens added, medians of three runs), and prints the run's fitted
``decode_time(B, B * (200 + 160))`` over it.

By default it starts its own engine (``tools/real_vllm/engine.py``: 64 MiB of KV cache, block
size 128, ``max_model_len`` 2048) and stops it at the end; ``--endpoint URL`` uses a running
one instead. Take the real-engine lock while it runs (one real-engine job at a time on a
2-core machine): ``flock /tmp/pw-realvllm.lock python benchmarks/profile_real.py``.

Usage: python benchmarks/profile_real.py [--runs 10] [--plan quick|full|both] [--endpoint URL] [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TERMS = ("overhead_s", "prefill_per_token_s", "prefill_attn_s", "decode_per_seq_s", "decode_per_ctx_token_s",
         "decode_token_time_s")
TPOT_BATCHES = (1, 8)
TPOT_PROMPT, TPOT_SHORT, TPOT_LONG = 200, 32, 288


async def _e2e(url: str, model: str, batch: int, prompt: int, output: int) -> float:
    """Median over ``batch`` concurrent streamed requests of send -> last token read (s)."""
    from openai import AsyncOpenAI

    rng = random.Random()

    async def one(client) -> float:
        ids = [rng.randrange(2, 2000) for _ in range(prompt)]
        t0 = time.perf_counter()
        stream = await client.completions.create(
            model=model, prompt=ids, max_tokens=output, temperature=0.0, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True})
        last, n = t0, 0
        async for chunk in stream:
            if chunk.choices:
                last, n = time.perf_counter(), chunk.usage.completion_tokens
        if n != output:
            raise RuntimeError(f"asked for {output} tokens, usage says {n}")
        return last - t0

    async with AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        return statistics.median(await asyncio.gather(*(one(client) for _ in range(batch))))


def measure_tpot(url: str, model: str, batch: int, runs: int = 3) -> float:
    """Decode time per output token (s) of ``batch`` concurrent requests: the growth of their
    median end-to-end time from :data:`TPOT_SHORT` to :data:`TPOT_LONG` outputs over the tokens
    added (prefill and first token cancel), medians over ``runs`` alternating runs."""
    shorts, longs = [], []
    for _ in range(runs):
        shorts.append(asyncio.run(_e2e(url, model, batch, TPOT_PROMPT, TPOT_SHORT)))
        longs.append(asyncio.run(_e2e(url, model, batch, TPOT_PROMPT, TPOT_LONG)))
    return (statistics.median(longs) - statistics.median(shorts)) / (TPOT_LONG - TPOT_SHORT)


def profile_once(url: str, quick: bool, out: Path) -> tuple[bool, float, str]:
    """Run the command once: ``(completed, wall s, its output)``; the output is also written
    beside ``out`` (``.log``)."""
    cmd = [sys.executable, "-m", "routerd.profiler", "--endpoint", url, "--output", str(out)]
    if quick:
        cmd.append("--quick")
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    text = r.stdout + r.stderr
    out.with_suffix(".log").write_text(text)
    return r.returncode == 0 and out.is_file(), wall, text


def spread(values: list[float]) -> str:
    med = statistics.median(values)
    if not values or med == 0:
        return f"median {med:.4g}"
    cv = statistics.pstdev(values) / statistics.mean(values) if len(values) > 1 else 0.0
    return (f"median {med:.4g}  range {min(values):.4g}..{max(values):.4g} "
            f"({(min(values) / med - 1):+.0%}..{(max(values) / med - 1):+.0%})  cv {cv:.0%}")


def run_plan(url: str, model: str, runs: int, quick: bool, tpot: bool, keep: str | None) -> None:
    from routerd.profiles import load_profile_file

    name = "quick" if quick else "full"
    print(f"\n== phasewise profile --endpoint {url}{' --quick' if quick else ''}: {runs} runs")
    print(f"{'run':>3} {'ok':>3} {'wall_s':>7} " + " ".join(f"{t[:14]:>14}" for t in TERMS)
          + ("  " + " ".join(f"B={b} fit/meas" for b in TPOT_BATCHES) if tpot else ""))
    done, walls = 0, []
    values: dict[str, list[float]] = {t: [] for t in TERMS}
    ratios: dict[int, list[float]] = {b: [] for b in TPOT_BATCHES}
    with tempfile.TemporaryDirectory() as d:
        folder = Path(keep) if keep else Path(d)
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(runs):
            out = folder / f"{name}-{i}.yaml"
            ok, wall, text = profile_once(url, quick, out)
            walls.append(wall)
            if not ok:
                print(f"{i:>3} {'no':>3} {wall:>7.1f}  " + "\n        ".join(text.strip().splitlines()[-12:]))
                continue
            prof = load_profile_file(out)
            done += 1
            row = [getattr(prof, t) for t in TERMS]
            for t, v in zip(TERMS, row):
                values[t].append(v)
            extra = ""
            if tpot:
                parts = []
                for b in TPOT_BATCHES:
                    meas = measure_tpot(url, model, b)
                    fit = prof.decode_time(b, b * (TPOT_PROMPT + (TPOT_SHORT + TPOT_LONG) // 2))
                    ratios[b].append(fit / meas)
                    parts.append(f"{fit * 1e3:.2f}/{meas * 1e3:.2f}ms")
                extra = "  " + " ".join(f"{p:>14}" for p in parts)
            notes = [ln for ln in out.read_text().splitlines() if ln.startswith("# Note:")]
            print(f"{i:>3} {'yes':>3} {wall:>7.1f} " + " ".join(f"{v:>14.4g}" for v in row) + extra
                  + (f"  ({len(notes)} notes)" if notes else ""))
    print(f"{name}: completed {done} of {runs} runs; wall time per run {spread(walls)} s")
    for t in TERMS:
        if values[t]:
            print(f"  {t:<24} {spread(values[t])}")
    for b in TPOT_BATCHES:
        if ratios[b]:
            print(f"  fitted/measured decode time per token at B={b}: {spread(ratios[b])}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--plan", choices=("quick", "full", "both"), default="both")
    ap.add_argument("--endpoint", default=None, help="a running engine (default: start one)")
    ap.add_argument("--no-tpot", action="store_true", help="skip the independent decode measurement")
    ap.add_argument("--keep", default=None, help="folder to keep every run's profile and output in")
    args = ap.parse_args()
    engine = None
    url = args.endpoint
    if url is None:
        sys.path.insert(0, str(ROOT / "tools"))
        from real_vllm.engine import one_benchmark_engine

        engine = one_benchmark_engine("profile-real")
        if isinstance(engine, str):
            print(f"error: {engine}", file=sys.stderr)
            return 2
        url = engine.url
    try:
        import json
        import urllib.request

        with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=30) as r:
            model = json.loads(r.read())["data"][0]["id"]
        plans = {"quick": [True], "full": [False], "both": [True, False]}[args.plan]
        for quick in plans:
            run_plan(url, model, args.runs, quick, not args.no_tpot, args.keep)
    finally:
        if engine is not None:
            engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
