"""The sidecar's CPU cost at its default scrape interval (0.1 s), one watcher attached.

Moved here from a timed test (issue 19: speed figures live in scripts that print them,
never in asserts that a busy machine can fail). It:

1. starts ``phasewise emulate`` once and keeps its ``/metrics`` page (vLLM's metric
   names, 168 lines today), then stops it;
2. serves that page from a counting aiohttp server on 127.0.0.1;
3. starts ``phasewise sidecar --metrics-url ...`` as a child process with one gRPC
   ``WatchState`` watcher attached, lets it warm up, and measures for ``--seconds``
   (default 3) the scrapes per second (hits on the page) and the sidecar's CPU
   (utime + stime from ``/proc/PID/stat``);
4. beside it, in the same run, the baseline: ``parse_vllm_metrics`` on the same page
   in this process (the parse every scrape must do), per call.

Prints scrapes/s (the configured rate is 10/s), CPU as a percentage of one core, CPU
per scrape (ms) and the ratio of CPU per scrape to the in-process parse. Measured in
the session that moved it: about 10 scrapes/s and 2-3% of one core on a loaded 2-core
machine.

Usage: python benchmarks/sidecar_cpu.py [--seconds 3] [--interval-s 0.1]
Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from aiohttp import web

from routerd.api.v1 import instance_state_pb2_grpc
from routerd.api.v1.instance_state_pb2 import WatchStateRequest
from routerd.emulator.process import EmulatorProcess
from routerd.sidecar.metrics import parse_vllm_metrics

_PORT_LINE = re.compile(r"on port (\d+)")


def cpu_s(pid: int) -> float:
    """utime + stime of a process (s), from ``/proc/PID/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def emulator_page() -> str:
    """The emulator's ``/metrics`` text (vLLM's names), read once from a real ``phasewise emulate``."""
    with EmulatorProcess() as emu:
        with urllib.request.urlopen(emu.url + "/metrics", timeout=10) as r:
            return r.read().decode()


class _Page:
    """A fixed ``/metrics`` page on 127.0.0.1 that counts its hits."""

    def __init__(self, text: str) -> None:
        self.text, self.hits, self.port = text, 0, 0
        self._runner: web.AppRunner | None = None

    async def _get(self, request: web.Request) -> web.Response:
        self.hits += 1
        return web.Response(text=self.text, content_type="text/plain")

    async def start(self) -> "_Page":
        app = web.Application()
        app.router.add_get("/metrics", self._get)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


async def _start_sidecar(metrics_url: str, interval_s: float) -> tuple[asyncio.subprocess.Process, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHASEWISE_SIDECAR_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "routerd", "sidecar", "--metrics-url", metrics_url, "--listen", "127.0.0.1:0",
        "--instance", "bench", "--interval", str(interval_s), env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    lines: list[str] = []
    while True:
        line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
        if not line:
            raise RuntimeError(f"sidecar exited before serving: {''.join(lines)}")
        lines.append(line)
        if m := _PORT_LINE.search(line):
            return proc, int(m.group(1))


async def measure(page_text: str, seconds: float, interval_s: float) -> dict[str, float]:
    """Scrapes/s, CPU % of one core and CPU ms per scrape of a sidecar process over ``seconds``."""
    page = await _Page(page_text).start()
    proc, port = await _start_sidecar(f"http://127.0.0.1:{page.port}/metrics", interval_s)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = instance_state_pb2_grpc.InstanceStateServiceStub(ch).WatchState(WatchStateRequest())
            await call.read()
            await asyncio.sleep(0.5)  # past start-up and the first scrapes
            cpu0, t0, hits0 = cpu_s(proc.pid), time.monotonic(), page.hits
            while time.monotonic() - t0 < seconds:
                await asyncio.wait_for(call.read(), 5)
            cpu1, t1, hits1 = cpu_s(proc.pid), time.monotonic(), page.hits
            call.cancel()
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 10)
        await page.stop()
    scrapes = max(hits1 - hits0, 1)
    return {"scrapes_per_s": (hits1 - hits0) / (t1 - t0), "cpu_percent": 100 * (cpu1 - cpu0) / (t1 - t0),
            "cpu_ms_per_scrape": 1000 * (cpu1 - cpu0) / scrapes}


def parse_ms(page_text: str, repeat: int = 200) -> float:
    """CPU ms of one ``parse_vllm_metrics`` call on the page, in this process (the baseline)."""
    parse_vllm_metrics(page_text)
    t0 = time.process_time()
    for _ in range(repeat):
        parse_vllm_metrics(page_text)
    return 1000 * (time.process_time() - t0) / repeat


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="measurement window (s)")
    ap.add_argument("--interval-s", type=float, default=0.1, help="the sidecar's scrape interval (s)")
    args = ap.parse_args(argv)
    if not Path("/proc/self/stat").exists():
        print("sidecar_cpu: needs Linux /proc", file=sys.stderr)
        return 2
    text = emulator_page()
    fig = asyncio.run(measure(text, args.seconds, args.interval_s))
    base = parse_ms(text)
    print(f"page: {len(text.splitlines())} lines from phasewise emulate; interval {args.interval_s} s "
          f"(configured {1 / args.interval_s:.1f} scrapes/s)")
    print(f"sidecar, one watcher: {fig['scrapes_per_s']:.1f} scrapes/s, CPU {fig['cpu_percent']:.1f}% of one core, "
          f"{fig['cpu_ms_per_scrape']:.2f} ms CPU per scrape")
    print(f"baseline, parse_vllm_metrics in-process: {base:.2f} ms per call; "
          f"sidecar per scrape / parse = {fig['cpu_ms_per_scrape'] / base:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
