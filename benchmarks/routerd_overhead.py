"""routerd's overhead beside direct calls, in one run: throughput, p50 TTFT/E2E and CPU per request.

The issue-#5 setting: 128 concurrent streaming completions, 64-token replies at 5 ms per
token after a 20 ms first token, two backends. The backends and the load generator
are lean raw-asyncio programs (this file, ``backend`` and ``load`` modes) so that on a
2-core machine they leave the CPU to what is measured. Each run first loads the two
backends directly (clients split evenly), then through ``python -m routerd.daemon``
(round robin), and reports:

- throughput (completed requests/s) and routerd's share of the direct figure;
- p50 and p99 TTFT (request sent -> first ``data:`` byte) and E2E (-> last byte);
- routerd's CPU time per request (user + system from ``/proc/PID/stat`` over the load
  phase, divided by the requests completed in it).

Usage: python benchmarks/routerd_overhead.py [--seconds 15] [--concurrency 128] [--tokens 64]
       [--policy round_robin] [--event-loop auto|asyncio|uvloop] [--router routerd|floor|floor-c]
       [--predictors default[,none,...]] [--baseline PATH --rounds N]
       [--prefix-modes approximate,off --rounds N]

``--predictors`` runs routerd once per predictor spec after the one direct run (so each
is measured against the same baseline); ``default`` (routerd's default since issue #17)
is the shipped n-gram model, ``none`` the setting of the figures measured before it.

``--baseline PATH`` measures a second checkout's routerd (``PATH/routerd`` on its
``PYTHONPATH``, e.g. a ``git worktree`` of the commit to compare against) in the same
run: ``--rounds`` rounds of direct, this checkout and the baseline, the two routerds in
ABBA order so that neither always runs first, and prints each figure's median and the
ratio this/baseline, then per figure the median of the per-round ratios with a 95% bootstrap
interval (seeded). On a 2-core machine one run's added TTFT spreads 2-4x between runs of the
same code (session 23: 9-38 ms), so a single pair says little.

``--prefix-modes A,B`` measures this checkout's routerd with ``--prefix-mode A`` against
``--prefix-mode B`` the same way (issue #14: CPU per request and throughput with prefix scoring
against without; give a prefix-aware ``--policy`` such as ``phasewise`` or ``llmd``, and
``--prompt-chars`` for longer prompts). ``precise`` runs with ``--prefix-tokenizer bytes``: every
prompt is tokenized and keyed per block; the fake backends publish no KV events, so the matches
fall back to the approximate index and the cost of consuming events is not included.
Targets: >= 95% of direct throughput, <= 3 ms added to p50 TTFT and E2E, <= 1.5 ms CPU/request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

EVENT = (b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
         b'"text":"tok ","logprobs":null,"finish_reason":null}]}\n\n')


class _Backend(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection of the fake instance: SSE, one event per token."""

    ttft_s = 0.02
    token_s = 0.005

    def connection_made(self, tr):
        self.tr = tr
        self.buf = b""
        self.busy = False
        self.loop = asyncio.get_running_loop()

    def data_received(self, data):
        self.buf += data
        self._next()

    def _next(self):
        if self.busy:
            return
        i = self.buf.find(b"\r\n\r\n")
        if i < 0:
            return
        length = 0
        for line in self.buf[:i].split(b"\r\n")[1:]:
            k, _, v = line.partition(b":")
            if k.strip().lower() == b"content-length":
                length = int(v)
        if len(self.buf) < i + 4 + length:
            return
        body = json.loads(self.buf[i + 4:i + 4 + length])
        self.buf = self.buf[i + 4 + length:]
        self.busy = True
        self.left = int(body.get("max_tokens") or 64)
        self.tr.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        self.loop.call_later(self.ttft_s, self._token)

    def _token(self):
        if self.tr.is_closing():
            return
        self.left -= 1
        ev = EVENT + (b"data: [DONE]\n\n" if self.left == 0 else b"")
        self.tr.write(b"%x\r\n%s\r\n" % (len(ev), ev))
        if self.left:
            self.loop.call_later(self.token_s, self._token)
        else:
            self.tr.write(b"0\r\n\r\n")
            self.busy = False
            self._next()


class _Client(asyncio.Protocol):
    def __init__(self):
        self.waiter = None
        self.buf = bytearray()
        self.t_first = None

    def connection_made(self, tr):
        self.tr = tr

    def data_received(self, data):
        self.buf += data
        if self.t_first is None and b"data:" in self.buf:
            self.t_first = time.perf_counter()
        if self.buf.endswith(b"0\r\n\r\n") and self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def connection_lost(self, exc):
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection lost"))


async def _worker(port, body, start, deadline, out):
    loop = asyncio.get_running_loop()
    tr, pr = await loop.create_connection(_Client, "127.0.0.1", port)
    req = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    while time.perf_counter() < deadline:
        pr.buf, pr.t_first, pr.waiter = bytearray(), None, loop.create_future()
        t0 = time.perf_counter()
        tr.write(req)
        await pr.waiter
        if b" 200 " not in pr.buf[:16]:
            raise RuntimeError(f"bad answer: {bytes(pr.buf[:200])!r}")
        out.append((t0, pr.t_first - t0, time.perf_counter() - t0))
    tr.close()


#: The prompt's length in characters (``--prompt-chars``): the predictor's cost grows with it.
PROMPT_CHARS = int(os.environ.get("PHASEWISE_BENCH_PROMPT_CHARS", "240"))


def _prompt(chars: int) -> str:
    words = ("please explain how the router picks an instance for each request and why "
             "prefill and decode interfere when they share a batch ").split()
    out, k = [], 0
    while sum(len(w) + 1 for w in out) < chars:
        out.append(words[k % len(words)])
        k += 1
    return " ".join(out)[:chars]


async def _load(ports, conc, seconds, warmup, tokens):
    body = json.dumps({"model": "m", "prompt": _prompt(PROMPT_CHARS), "max_tokens": tokens,
                       "stream": True}).encode()
    out: list[tuple[float, float, float]] = []
    start = time.perf_counter()
    t_measure = start + warmup
    deadline = t_measure + seconds
    await asyncio.gather(*[_worker(ports[i % len(ports)], body, start, deadline, out) for i in range(conc)])
    return [x for x in out if x[0] >= t_measure and x[0] + x[2] <= deadline], len(out)


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _cpu_s(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    tck = os.sysconf("SC_CLK_TCK")
    return int(parts[11]) / tck, int(parts[12]) / tck


def _new_loop():
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


def run_backend(port: int) -> None:
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    loop.run_until_complete(loop.create_server(_Backend, "127.0.0.1", port, backlog=1024))
    loop.run_forever()


def run_load(ports: list[int], conc: int, seconds: float, warmup: float, tokens: int, pid: int | None) -> dict:
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    c0 = _cpu_s(pid) if pid else (0.0, 0.0)
    res, total = loop.run_until_complete(_load(ports, conc, seconds, warmup, tokens))
    out = {"requests": len(res), "rps": len(res) / seconds,
           "ttft_p50_ms": 1e3 * _pct([x[1] for x in res], 0.5), "ttft_p99_ms": 1e3 * _pct([x[1] for x in res], 0.99),
           "e2e_p50_ms": 1e3 * _pct([x[2] for x in res], 0.5), "e2e_p99_ms": 1e3 * _pct([x[2] for x in res], 0.99)}
    if pid:
        # CPU over the whole run (warm-up included) per request completed in the whole run.
        u, s = _cpu_s(pid)
        out["user_ms_per_request"] = 1e3 * (u - c0[0]) / max(1, total)
        out["sys_ms_per_request"] = 1e3 * (s - c0[1]) / max(1, total)
        out["cpu_ms_per_request"] = out["user_ms_per_request"] + out["sys_ms_per_request"]
    return out


def _free_ports(n):
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _wait_port(port, timeout=20.0):
    import socket

    end = time.time() + timeout
    while time.time() < end:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def _build_floor_c(src: Path, outdir: str) -> str:
    """Compile relay_floor_c.c into ``outdir``; returns the binary's path."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise SystemExit("--router floor-c needs gcc on PATH to compile benchmarks/relay_floor_c.c")
    exe = os.path.join(outdir, "relay_floor_c")
    subprocess.run([gcc, "-O2", "-o", exe, str(src)], check=True)
    return exe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument("--event-loop", default="auto", choices=["auto", "asyncio", "uvloop"])
    ap.add_argument("--router", default="routerd", choices=["routerd", "floor", "floor-c"],
                    help="what to put between client and backends: routerd, relay_floor.py (the least a "
                         "Python relay can spend; see that file), or relay_floor_c.c (the same relay in C, "
                         "compiled with gcc: the native floor)")
    ap.add_argument("--prompt-chars", type=int, default=240,
                    help="prompt length in characters (the predictor reads up to 4,000)")
    ap.add_argument("--predictors", default="default",
                    help="comma-separated routerd --predictor specs, one routerd run each (routerd only)")
    ap.add_argument("--baseline", default="",
                    help="another checkout's root (e.g. a git worktree): its routerd is measured in the same run, "
                         "alternating with this one's, and the ratios printed")
    ap.add_argument("--prefix-modes", default="",
                    help="two routerd --prefix-mode values, e.g. approximate,off: both measured in the same run "
                         "(alternating, --rounds rounds) with --policy, and the ratios first/second printed")
    ap.add_argument("--rounds", type=int, default=4,
                    help="rounds with --baseline or --prefix-modes (each: direct, then both routerds)")
    ap.add_argument("--mode", default="main", choices=["main", "backend", "load"], help=argparse.SUPPRESS)
    ap.add_argument("--ports", default="", help=argparse.SUPPRESS)
    ap.add_argument("--pid", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.mode == "backend":
        run_backend(int(a.ports))
        return
    if a.mode == "load":
        print(json.dumps(run_load([int(p) for p in a.ports.split(",")], a.concurrency, a.seconds, a.warmup,
                                  a.tokens, a.pid or None)))
        return
    if a.prompt_chars < 1:
        ap.error("--prompt-chars must be >= 1")
    os.environ["PHASEWISE_BENCH_PROMPT_CHARS"] = str(a.prompt_chars)  # read by the load processes
    if a.prefix_modes:
        modes = [m.strip() for m in a.prefix_modes.split(",")]
        if len(modes) != 2 or not set(modes) <= {"off", "approximate", "precise"} or modes[0] == modes[1]:
            ap.error(f"--prefix-modes: two different values of off, approximate, precise; got {a.prefix_modes!r}")
        if a.baseline or a.router != "routerd":
            ap.error("--prefix-modes compares two routerd settings of this checkout: not with --baseline or --router")
        if a.rounds < 1:
            ap.error("--rounds must be >= 1")
        # precise: the emulator's byte tokenizer, so each request is tokenized and keyed per block
        # as in a deployment (these backends publish no KV events, so matches fall back to the
        # approximate index, counted; what the events cost to consume is not in this figure).
        compare(a, {f"prefix={m}": (ROOT, ["--prefix-mode", m] + (["--prefix-tokenizer", "bytes"] if m == "precise"
                                                                   else [])) for m in modes})
        return
    if a.baseline:
        if a.router != "routerd":
            ap.error("--baseline compares two routerds: it needs --router routerd")
        if not (Path(a.baseline) / "routerd" / "routerd" / "daemon").is_dir():
            ap.error(f"--baseline {a.baseline}: no routerd/routerd/daemon there (give a checkout's root)")
        if a.rounds < 1:
            ap.error("--rounds must be >= 1")
        compare(a, {"this": (ROOT, []), "baseline": (Path(a.baseline).resolve(), [])})
        return
    py = sys.executable
    me = str(Path(__file__).resolve())
    b1, b2, rp = _free_ports(3)
    tmp = tempfile.TemporaryDirectory(prefix="relay_floor_c-")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "routerd") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen([py, me, "--mode", "backend", "--ports", str(p)]) for p in (b1, b2)]
    try:
        for p in (b1, b2):
            _wait_port(p)
        load = [py, me, "--mode", "load", "--concurrency", str(a.concurrency), "--seconds", str(a.seconds),
                "--warmup", str(a.warmup), "--tokens", str(a.tokens)]
        direct = json.loads(subprocess.check_output(load + ["--ports", f"{b1},{b2}"]))
        runs: list[tuple[str, dict]] = []
        specs = [x.strip() for x in a.predictors.split(",") if x.strip()] if a.router == "routerd" else [""]
        for spec in specs:
            if a.router == "floor":
                cmd = [py, str(Path(me).with_name("relay_floor.py")), str(rp), str(b1), str(b2)]
            elif a.router == "floor-c":
                cmd = [_build_floor_c(Path(me).with_name("relay_floor_c.c"), tmp.name), str(rp), str(b1), str(b2)]
            else:
                cmd = [py, "-m", "routerd.daemon", "--host", "127.0.0.1", "--port", str(rp), "--no-grpc",
                       "--model", "m", "--policy", a.policy, "--log-level", "warning", "--predictor", spec,
                       "--endpoint", f"a=http://127.0.0.1:{b1}", "--endpoint", f"b=http://127.0.0.1:{b2}"]
            router = subprocess.Popen(
                cmd, env={**env, "PHASEWISE_EVENT_LOOP": a.event_loop, "PHASEWISE_RELOAD__WATCH": "false"})
            procs.append(router)
            _wait_port(rp)
            via = json.loads(subprocess.check_output(load + ["--ports", str(rp), "--pid", str(router.pid)]))
            router.terminate()
            router.wait()
            name = a.router if not spec else f"{a.router}[{spec}]"
            runs.append((name, via))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
        tmp.cleanup()
    print(f"setting: {a.concurrency} concurrent streams, {a.tokens} tokens at 5 ms after 20 ms, 2 backends, "
          f"{a.seconds:g} s (+{a.warmup:g} s warm-up), policy {a.policy}, event loop {a.event_loop}")
    width = max(8, *(len(n) for n, _ in runs))
    print(f"{'':{width}s} {'req/s':>8s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'E2E p50':>9s} {'E2E p99':>9s}  (ms)")
    for name, r in [("direct", direct), *runs]:
        print(f"{name:{width}s} {r['rps']:8.1f} {r['ttft_p50_ms']:9.2f} {r['ttft_p99_ms']:9.2f} {r['e2e_p50_ms']:9.2f} "
              f"{r['e2e_p99_ms']:9.2f}")
    for name, via in runs:
        print(f"{name}: throughput kept {100 * via['rps'] / direct['rps']:.1f}%  "
              f"added p50 TTFT {via['ttft_p50_ms'] - direct['ttft_p50_ms']:+.2f} ms  "
              f"added p50 E2E {via['e2e_p50_ms'] - direct['e2e_p50_ms']:+.2f} ms  "
              f"CPU {via['cpu_ms_per_request']:.2f} ms/request (user {via['user_ms_per_request']:.2f}, "
              f"system {via['sys_ms_per_request']:.2f})")


def _routerd_cmd(py: str, a, rp: int, b1: int, b2: int, spec: str) -> list[str]:
    return [py, "-m", "routerd.daemon", "--host", "127.0.0.1", "--port", str(rp), "--no-grpc",
            "--model", "m", "--policy", a.policy, "--log-level", "warning", "--predictor", spec,
            "--endpoint", f"a=http://127.0.0.1:{b1}", "--endpoint", f"b=http://127.0.0.1:{b2}"]


def compare(a, variants: dict[str, tuple[Path, list[str]]]) -> None:
    """Two routerds, alternated over ``a.rounds`` rounds: ``variants`` maps each one's name to
    (the checkout whose ``routerd`` is on its ``PYTHONPATH``, extra routerd arguments); the first
    is compared to the second.

    Each round loads the backends directly, then through both routerds (order ABBA over
    rounds), so each routerd figure has a direct figure of the same round beside it.
    Prints per-round rows and, per routerd, the median of throughput kept (% of direct),
    added p50 TTFT and E2E (ms over direct) and CPU per request (ms), the ratios
    first/second of those medians, and the per-round ratios' median with its interval.
    """
    py = sys.executable
    me = str(Path(__file__).resolve())
    spec = [x.strip() for x in a.predictors.split(",") if x.strip()][0]
    names = list(variants)
    b1, b2, rp = _free_ports(3)
    load = [py, me, "--mode", "load", "--concurrency", str(a.concurrency), "--seconds", str(a.seconds),
            "--warmup", str(a.warmup), "--tokens", str(a.tokens)]
    rows: dict[str, list[dict]] = {n: [] for n in names}
    backends = [subprocess.Popen([py, me, "--mode", "backend", "--ports", str(p)]) for p in (b1, b2)]
    try:
        for p in (b1, b2):
            _wait_port(p)
        for k in range(a.rounds):
            direct = json.loads(subprocess.check_output(load + ["--ports", f"{b1},{b2}"]))
            order = names if k % 2 == 0 else names[::-1]
            for name in order:
                root, extra = variants[name]
                env = {**os.environ, "PHASEWISE_EVENT_LOOP": a.event_loop, "PHASEWISE_RELOAD__WATCH": "false",
                       "PYTHONPATH": str(root / "routerd") + os.pathsep + os.environ.get("PYTHONPATH", "")}
                router = subprocess.Popen(_routerd_cmd(py, a, rp, b1, b2, spec) + extra, env=env, cwd=str(root))
                try:
                    _wait_port(rp)
                    via = json.loads(subprocess.check_output(load + ["--ports", str(rp), "--pid", str(router.pid)]))
                finally:
                    router.terminate()
                    router.wait()
                row = {"kept_pct": 100 * via["rps"] / direct["rps"],
                       "added_ttft_ms": via["ttft_p50_ms"] - direct["ttft_p50_ms"],
                       "added_e2e_ms": via["e2e_p50_ms"] - direct["e2e_p50_ms"],
                       "cpu_ms": via["cpu_ms_per_request"]}
                rows[name].append(row)
                print(f"round {k + 1} {name:8s} kept {row['kept_pct']:5.1f}%  added p50 TTFT "
                      f"{row['added_ttft_ms']:+6.2f} ms  added p50 E2E {row['added_e2e_ms']:+6.2f} ms  "
                      f"CPU {row['cpu_ms']:.2f} ms/request", flush=True)
    finally:
        for p in backends:
            p.terminate()
        for p in backends:
            p.wait()
    print(f"setting: {a.concurrency} concurrent streams, {a.tokens} tokens at 5 ms after 20 ms, 2 backends, "
          f"{a.seconds:g} s (+{a.warmup:g} s warm-up) x {a.rounds} rounds, policy {a.policy}, prompt "
          f"{a.prompt_chars} characters; " + "; ".join(f"{n}: {r} {' '.join(x)}".rstrip() for n, (r, x) in variants.items()))
    med = {n: {f: statistics.median(r[f] for r in rs) for f in rs[0]} for n, rs in rows.items()}
    for f, label in (("kept_pct", "throughput kept (%)"), ("added_ttft_ms", "added p50 TTFT (ms)"),
                     ("added_e2e_ms", "added p50 E2E (ms)"), ("cpu_ms", "CPU per request (ms)")):
        t, b = med[names[0]][f], med[names[1]][f]
        ratio = f"{t / b:.3f}" if b else "n/a"
        print(f"median {label:22s} {names[0]} {t:8.2f}  {names[1]} {b:8.2f}  ratio {ratio}")
    # Paired by round: the two routerds of a round share its minutes of this machine's speed, so
    # the per-round ratio removes the drift between rounds that the medians above keep.
    for f, label in (("kept_pct", "throughput kept"), ("added_ttft_ms", "added p50 TTFT"),
                     ("added_e2e_ms", "added p50 E2E"), ("cpu_ms", "CPU per request")):
        ratios = [t[f] / b[f] for t, b in zip(rows[names[0]], rows[names[1]]) if b[f] > 0]
        if not ratios:
            continue
        lo, hi = _bootstrap_median_interval(ratios)
        print(f"paired {label:22s} median of per-round ratios {statistics.median(ratios):.3f} "
              f"(95% bootstrap interval {lo:.3f}-{hi:.3f}, {len(ratios)} rounds)")


def _bootstrap_median_interval(xs: list[float], n: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """2.5th and 97.5th percentiles of the median of ``xs`` resampled with replacement ``n``
    times (a seeded generator: the same figures for the same rounds)."""
    import random

    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


if __name__ == "__main__":
    main()
