"""The endpoint picker's decision, in process, without gRPC transport: p50 and p99 per request.

Issue 16's target: picker decision <= 100 us at p99, excluding gRPC transport. ``epp_overhead.py``
reads the same figure from the picker's ``phasewise_epp_decision_seconds`` histogram under load,
but only to its bucket bounds and with Envoy, the backends and the load generator sharing the
CPU. Here a :class:`routerd.daemon.app.Daemon` (no HTTP front, static endpoints, as ``phasewise epp``
builds it) serves :class:`routerd.epp.server.ExtProcServicer` directly: each request is the message
sequence Envoy sends (request headers, then the JSON body with end of stream), driven through the
servicer's own ``Process`` coroutine, and its answers (destination header and metadata, the body
echoed back) are read; the stream then ends, as Envoy ends it in efficient mode, and the request's
access-log entry (a 64-token streamed answer, with the Lua filter's metadata) releases the booking,
``--inflight`` requests later: that many stay booked while each decision is made, as under load
(efficient mode books them ``blind``: routerd never sees their first token).

Two figures per setting, both the thread's CPU clock (``time.thread_time``: the cost, not the
time others ran):

- ``decision``: what the picker itself records in ``phasewise_epp_decision_seconds`` (parse, model
  check, subset hint, prefix identity, the router's decision, building the answers; not the
  predictor's batch wait), captured per request;
- ``request phase``: the servicer's whole request phase, from the first message to the last
  answer (the decision plus protobuf header/body handling), what the picker's process spends per
  request apart from gRPC.

The garbage collector runs as the picker runs it (:mod:`routerd.daemon.collector`: the same
collections between requests, CPython's own only as a backstop). Settings: ``--endpoints`` instances,
``--policies``, ``--predictor`` (``default``: the shipped n-gram model, as ``phasewise epp``
runs by default), ``--prompt-chars`` of prompt text, ``--prefix`` mode.

Usage: python benchmarks/epp_decision.py [--n 3000] [--endpoints 2,8] [--policies round_robin,phasewise]
       [--predictor default] [--prompt-chars 240] [--prefix off] [--inflight 0,128]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
from google.protobuf import struct_pb2

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "routerd"))

from envoy.config.core.v3 import address_pb2, base_pb2  # noqa: E402
from envoy.data.accesslog.v3 import accesslog_pb2  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb  # noqa: E402

from routerd.daemon.app import Daemon  # noqa: E402
from routerd.daemon.collector import BACKSTOP, THRESHOLDS, CollectorPacer  # noqa: E402
from routerd.daemon.config import Settings  # noqa: E402
from routerd.epp.names import DEST_HEADER, LUA_NAMESPACE, REQUEST_ID_HEADER  # noqa: E402
from routerd.epp.server import EppServer  # noqa: E402


def _headers(d: dict[str, str], eos: bool = False) -> pb.HttpHeaders:
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in d.items()]), end_of_stream=eos)


def _messages(body: bytes) -> list[pb.ProcessingRequest]:
    return [pb.ProcessingRequest(request_headers=_headers({
                ":path": "/v1/completions", ":method": "POST", ":authority": "gw", "content-type": "application/json",
                "content-length": str(len(body))})),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))]


class _Feed:
    """An async iterator over the request phase, ended (as Envoy ends the ext_proc stream in
    efficient mode, right after the request phase is answered) once ``finish`` is set."""

    def __init__(self, msgs: list[pb.ProcessingRequest]) -> None:
        self.msgs = list(msgs)
        self.finish = asyncio.Event()

    def __aiter__(self):
        return self

    async def __anext__(self) -> pb.ProcessingRequest:
        if self.msgs:
            return self.msgs.pop(0)
        await self.finish.wait()
        raise StopAsyncIteration


def _access_log(rid: str, served: str, tokens: int) -> accesslog_pb2.HTTPAccessLogEntry:
    """The entry Envoy's gRPC access logger sends for a finished streamed answer of ``tokens``
    SSE events (the shipped Lua filter's metadata: events, sse, tail), as efficient mode reads it."""
    e = accesslog_pb2.HTTPAccessLogEntry()
    e.request.request_headers[REQUEST_ID_HEADER] = rid
    e.request.path = "/v1/completions"
    e.response.response_code.value = 200
    cp = e.common_properties
    cp.start_time.GetCurrentTime()
    cp.time_to_last_downstream_tx_byte.FromMilliseconds(400)
    host, port = served.split(",")[0].rsplit(":", 1)
    cp.upstream_remote_address.CopyFrom(address_pb2.Address(socket_address=address_pb2.SocketAddress(
        address=host, port_value=int(port))))
    md = struct_pb2.Struct()
    md.update({"events": tokens + 1, "sse": True, "tail": "data: [DONE]\n\n"})
    cp.metadata.filter_metadata[LUA_NAMESPACE].CopyFrom(md)
    return e


async def measure(policy: str, m: int, n: int, predictor: str, prompt_chars: int, prefix: str,
                  pacer: CollectorPacer, inflight: int = 0) -> dict[str, float]:
    endpoints = [{"name": f"e{i}", "url": f"http://127.0.0.{i + 1}:8000"} for i in range(m)]
    cfg = {"models": ["m"], "endpoints": endpoints, "grpc": {"enabled": False}, "reload": {"watch": False},
           "predictor": predictor, "log_level": "warning", "policy": {"name": policy},
           "prefix": {"mode": prefix},
           "epp": {"host": "127.0.0.1", "port": 0, "health_port": 0, "metrics_port": None, "mode": "efficient"}}
    d = Daemon(Settings.model_validate(cfg), http_front=False)
    await d.start()
    server = EppServer(d)  # not started: its servicer is driven directly, without gRPC
    servicer = server.ext_proc
    seen: list[float] = []
    observe = servicer.m.decision.observe

    def record(v: float) -> None:
        seen.append(v)
        observe(v)

    servicer.m.decision.observe = record
    rng = random.Random(7)
    words = [f"w{k}" for k in range(5000)]
    bodies = [json.dumps({"model": "m", "max_tokens": 64, "stream": True,
                          "prompt": " ".join(rng.choices(words, k=prompt_chars // 6))[:prompt_chars]}).encode()
              for _ in range(256)]
    phase: list[float] = []
    booked: deque[accesslog_pb2.HTTPAccessLogEntry] = deque()
    try:
        for k in range(n):
            feed = _Feed(_messages(bodies[k % len(bodies)]))
            it = servicer.Process(feed, None).__aiter__()
            c = time.thread_time()
            first = await it.__anext__()  # destination header and metadata
            await it.__anext__()  # the body, echoed
            phase.append(time.thread_time() - c)
            feed.finish.set()
            async for _ in it:  # Envoy ends the stream after the request phase
                pass
            hs = {h.header.key: h.header.raw_value.decode()
                  for h in first.request_headers.response.header_mutation.set_headers}
            booked.append(_access_log(hs[REQUEST_ID_HEADER], hs[DEST_HEADER], 64))
            while len(booked) > inflight:  # the oldest answer ends: its access-log entry releases it
                servicer.on_access_log(booked.popleft())
            pacer.collect_if_due()  # the picker's collector timer, between requests
        while booked:
            servicer.on_access_log(booked.popleft())
        # Every booking released (the response's end completed it): decisions met no leftovers.
        left = sum(len(ep.requests) for ep in d.router.endpoints)
        assert left == 0, f"{left} requests still booked after the run"
    finally:
        await d.stop()
    assert len(seen) == n, (len(seen), n)
    skip = n // 10
    dec = np.asarray(seen[skip:]) * 1e6
    ph = np.asarray(phase[skip:]) * 1e6
    return {"decision_p50": float(np.percentile(dec, 50)), "decision_p99": float(np.percentile(dec, 99)),
            "phase_p50": float(np.percentile(ph, 50)), "phase_p99": float(np.percentile(ph, 99))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=3000, help="requests per setting (the first 10%% are warm-up)")
    ap.add_argument("--endpoints", default="2,8")
    ap.add_argument("--policies", default="round_robin,phasewise")
    ap.add_argument("--predictor", default="default")
    ap.add_argument("--prompt-chars", type=int, default=240)
    ap.add_argument("--prefix", default="off", choices=["off", "approximate"])
    ap.add_argument("--inflight", default="0,128",
                    help="requests kept booked while deciding (efficient mode's blind bookings, released "
                         "oldest first by their access-log entries; 128: the overhead setting's streams)")
    a = ap.parse_args()
    gc.collect()
    gc.freeze()
    gc.set_threshold(BACKSTOP * THRESHOLDS[0], *THRESHOLDS[1:])  # CPython's own, as the picker's backstop
    pacer = CollectorPacer()
    print(f"picker decision in process, no gRPC (thread CPU, us; {a.n} requests, first 10% warm-up; predictor "
          f"{a.predictor}, {a.prompt_chars}-char prompts, prefix {a.prefix})")
    print(f"{'policy':>12} {'endpoints':>9} {'in flight':>9} | {'decision p50':>12} {'p99':>7} | "
          f"{'request phase p50':>17} {'p99':>7}")
    for policy in a.policies.split(","):
        for m in (int(x) for x in a.endpoints.split(",")):
            for inflight in (int(x) for x in a.inflight.split(",")):
                r = asyncio.run(measure(policy, m, a.n, a.predictor, a.prompt_chars, a.prefix, pacer, inflight))
                flag = "" if r["decision_p99"] <= 100 else "  decision p99 > 100 us"
                print(f"{policy:>12} {m:>9} {inflight:>9} | {r['decision_p50']:12.1f} {r['decision_p99']:7.1f} | "
                      f"{r['phase_p50']:17.1f} {r['phase_p99']:7.1f}{flag}")


if __name__ == "__main__":
    main()
