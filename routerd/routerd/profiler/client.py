"""The profiler's view of an OpenAI-compatible endpoint: discovery, timed streams, vLLM metrics.

Token arrival times are taken at each network read (``time.perf_counter``, seconds).
One server-sent event may carry several tokens: vLLM's output processor merges the
outputs of several engine steps when its API server falls behind (a 64-token stream of
vLLM 0.32 came as 31-63 events under load; ``vllm/v1/engine/output_processor.py``,
``RequestOutputCollector``), so tokens are counted, never events. Each streamed request
asks for vLLM's ``"return_token_ids": true`` (every chunk then carries its delta
``token_ids``, the first also ``prompt_token_ids``) and ``stream_options``
``{"include_usage": true, "continuous_usage_stats": true}`` (every chunk carries the
cumulative ``usage``), as ``vllm/entrypoints/openai/completion/serving.py``
(``completion_stream_generator``) sends them. A chunk's tokens are the length of its
``token_ids``, else the growth of its ``usage.completion_tokens``, else (a server that
sends neither) one per event, checked against the final ``usage`` chunk: when they
disagree the stream is marked inexact (:attr:`StreamRecord.exact`) and its counts are
spread over its reads in proportion to time. Chunks are not JSON-decoded
on the hot path (only byte searches) so the client keeps up with large batches; the final
``usage`` chunk is.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from typing import Callable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from routerd.errors import ConfigError


@dataclass
class EndpointInfo:
    """What discovery learnt about the endpoint."""

    base_url: str
    model: str
    max_model_len: int | None = None
    """From vLLM's ``/v1/models`` card (``max_model_len``), when present."""
    kv_capacity_tokens: int | None = None
    """``num_gpu_blocks * block_size`` from ``vllm:cache_config_info`` on ``/metrics``, when present."""
    block_size: int | None = None
    has_metrics: bool = False
    """Whether ``/metrics`` serves vLLM's metrics (preemptions are then checked per batch)."""
    scheduler: dict[str, int | bool] = field(default_factory=dict)
    """``max_num_seqs``, ``max_num_batched_tokens``, ``chunked_prefill`` from vLLM's development
    endpoint ``GET /server_info?config_format=json`` (``scheduler_config``; served only with
    ``VLLM_SERVER_DEV_MODE=1``, ``vllm/entrypoints/serve/dev/server_info/api_router.py``); empty
    when not served."""


@dataclass
class StreamRecord:
    """One streamed completion: when it was sent and when its tokens arrived (``perf_counter`` s).

    ``token_s[i]`` is the time of the network read that brought token ``i`` (0-based): the
    tokens of one read share its time, and only the read's last token has a time that is not
    late by construction (its earlier tokens were made one or more engine steps before).
    ``read_counts[j]`` is the cumulative token count after read ``j`` at ``read_s[j]``: the
    points timing fits use (:func:`routerd.profiler.measure.read_points`).
    """

    sent_s: float
    token_s: list[float] = field(default_factory=list)
    read_s: list[float] = field(default_factory=list)
    """Times of the reads that brought tokens (s)."""
    read_counts: list[int] = field(default_factory=list)
    """Cumulative tokens after each of those reads."""
    prompt_tokens: int | None = None
    """From the final ``usage`` chunk (else the first chunk's ``prompt_token_ids``)."""
    completion_tokens: int | None = None
    """From the final ``usage`` chunk."""
    counted_by: str = "events"
    """How tokens were counted: ``"token_ids"``, ``"usage"`` (continuous usage) or ``"events"``."""
    exact: bool = True
    """False when events were counted as one token each and the final ``usage`` disagreed."""


class ProfilerClient:
    """An aiohttp session against ``base_url`` (the part before ``/v1``).

    Raises :class:`ConfigError` (one line, naming ``--endpoint``) when the endpoint
    refuses connections, answers with an error, or does not speak the OpenAI API.
    """

    def __init__(self, base_url: str, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[: -len("/v1")]
        self._session = aiohttp.ClientSession(
            # A new connection per request: a request sent on a kept-alive connection the server
            # is closing (vLLM closes idle ones after VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s,
            # vllm/envs.py) fails with "Server disconnected"; it ended one profile of a real
            # engine in 20 with a 2 s client-side idle limit, and one more on a loaded machine,
            # where the client's own clock runs late. A loopback connect costs far less than the
            # millisecond steps timed here, and it happens before the request is sent.
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
            timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=10))

    async def close(self) -> None:
        """Close the session."""
        await self._session.close()

    async def __aenter__(self) -> "ProfilerClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _fail(self, what: str) -> ConfigError:
        return ConfigError(f"--endpoint {self.base_url}: {what}")

    async def _get_json(self, path: str) -> object:
        try:
            async with self._session.get(self.base_url + path) as r:
                text = await r.text()
                if r.status != 200:
                    raise self._fail(f"GET {path} answered HTTP {r.status}; is this an OpenAI-compatible server?")
        except aiohttp.ClientError as e:
            raise self._fail(f"cannot reach it ({_reason(e)})") from None
        except asyncio.TimeoutError:
            raise self._fail(f"GET {path} timed out") from None
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise self._fail(f"GET {path} did not return JSON; is this an OpenAI-compatible server?") from None

    async def discover(self, model: str | None) -> EndpointInfo:
        """Read ``/v1/models`` (and ``/metrics`` when served) and check ``model`` is served.

        Raises:
            ConfigError: unreachable, not OpenAI-compatible, or ``model`` not served.
        """
        body = await self._get_json("/v1/models")
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
            raise self._fail("GET /v1/models is not an OpenAI model list")
        ids = [m["id"] for m in data]
        if not ids:
            raise self._fail("serves no model")
        if model is None:
            model = ids[0]
        elif model not in ids:
            raise ConfigError(f"--model {model!r}: not served by {self.base_url}; it serves {', '.join(ids)}")
        card = data[ids.index(model)]
        info = EndpointInfo(self.base_url, model)
        if isinstance(card.get("max_model_len"), int):
            info.max_model_len = card["max_model_len"]
        await self._read_cache_config(info)
        info.scheduler = await self._read_scheduler_config()
        return info

    async def _read_scheduler_config(self) -> dict[str, int | bool]:
        """vLLM's scheduler limits from ``/server_info?config_format=json`` (dev mode), or {}."""
        try:
            async with self._session.get(self.base_url + "/server_info", params={"config_format": "json"}) as r:
                if r.status != 200:
                    return {}
                body = json.loads(await r.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return {}
        sc = body.get("vllm_config") if isinstance(body, dict) else None
        sc = sc.get("scheduler_config") if isinstance(sc, dict) else None
        if not isinstance(sc, dict):
            return {}
        out: dict[str, int | bool] = {}
        for key in ("max_num_seqs", "max_num_batched_tokens"):
            v = sc.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                out[key] = v
        if isinstance(sc.get("enable_chunked_prefill"), bool):
            out["chunked_prefill"] = sc["enable_chunked_prefill"]
        return out

    async def _read_cache_config(self, info: EndpointInfo) -> None:
        text = await self.metrics_text()
        if text is None:
            return
        for fam in text_string_to_metric_families(text):
            if fam.name == "vllm:cache_config_info":
                for s in fam.samples:
                    try:
                        blocks, bs = int(s.labels["num_gpu_blocks"]), int(s.labels["block_size"])
                    except (KeyError, ValueError):
                        continue
                    info.kv_capacity_tokens, info.block_size = blocks * bs, bs
            elif fam.name.startswith("vllm:"):
                info.has_metrics = True

    async def metrics_text(self) -> str | None:
        """``/metrics`` text, or None when the endpoint serves none."""
        try:
            async with self._session.get(self.base_url + "/metrics") as r:
                if r.status != 200:
                    return None
                return await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

    async def preemptions(self) -> float | None:
        """``vllm:num_preemptions_total`` summed over engines, or None when not served."""
        text = await self.metrics_text()
        if text is None:
            return None
        # vLLM's exposition is long (histograms); parse only the family needed, so the
        # scrape does not stall this client's reading of timed streams.
        text = "\n".join(line for line in text.splitlines() if "vllm:num_preemptions" in line)
        total = None
        for fam in text_string_to_metric_families(text + "\n"):
            if fam.name == "vllm:num_preemptions":
                total = sum(s.value for s in fam.samples if s.name.endswith("_total"))
        return total

    async def inter_token_latency(self) -> tuple[float, float] | None:
        """``(sum s, count)`` of vLLM's ``vllm:inter_token_latency_seconds`` histogram summed over
        engines, or None when not served. vLLM observes it per output token after the first, as
        the time between the engine core's timestamps of that request's consecutive outputs
        (``vllm/v1/metrics/stats.py``, ``IterationStats.update_from_output``): engine-side step
        times, which no delay of this client or of the HTTP layer changes."""
        return await self.histogram("vllm:inter_token_latency_seconds")

    async def histogram(self, name: str) -> tuple[float, float] | None:
        """``(sum, count)`` of the Prometheus histogram ``name`` on ``/metrics``, summed over its
        label sets, or None when not served. Only those lines are parsed (vLLM's exposition is
        long)."""
        text = await self.metrics_text()
        if text is None:
            return None
        total = count = None
        s_key, c_key = name + "_sum", name + "_count"
        for line in text.splitlines():
            if line.startswith(s_key) and line[len(s_key)] in "{ ":
                total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
            elif line.startswith(c_key) and line[len(c_key)] in "{ ":
                count = (count or 0.0) + float(line.rsplit(" ", 1)[1])
        return None if total is None or count is None else (total, count)

    def _payload(self, model: str, prompt: str, max_tokens: int, stream: bool) -> dict:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                # vLLM extensions: run to max_tokens whatever the text (outputs of known length).
                "ignore_eos": True, "min_tokens": max_tokens, "stream": stream}
        if stream:
            # vLLM extensions: per-chunk token ids and cumulative usage, so tokens are counted
            # even when one event carries several (servers that do not know them ignore them).
            body["return_token_ids"] = True
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        return body

    async def stream(self, model: str, prompt: str, max_tokens: int,
                     on_tokens: Callable[[float, int], None] | None = None,
                     hold: asyncio.Event | None = None, hold_after: int = 1) -> StreamRecord:
        """Stream one completion, time-stamping every network read that brings tokens
        (``on_tokens(t, n)`` is called after each, ``n`` the cumulative token count).

        With ``hold``, reading stops after ``hold_after`` tokens until the event is set
        (the rest waits in socket buffers): only those tokens' times are meaningful, and
        a batch of many streams costs this client little while the few fully timed
        ones are read.

        Raises:
            ConfigError: the endpoint answers with an error or the connection fails.
        """
        rec = StreamRecord(time.perf_counter())
        usage_line = b""
        try:
            async with self._session.post(self.base_url + "/v1/completions",
                                          json=self._payload(model, prompt, max_tokens, True)) as r:
                if r.status != 200:
                    raise self._fail(f"POST /v1/completions answered HTTP {r.status}: {(await r.text())[:200]}")
                times = rec.token_s
                counter = _TokenCounter()
                rest = b""
                # One timestamp per network read; events are split on the SSE separator with
                # bytes operations only (per-line iteration costs more than the tokens' spacing
                # allows at 128 concurrent streams).
                async for data in r.content.iter_any():
                    t = time.perf_counter()
                    events = (rest + data).split(b"\n\n")
                    rest = events.pop()
                    before = len(times)
                    for ev in events:
                        if not ev.startswith(b"data: {"):
                            continue
                        if b'"choices":[]' in ev or b'"choices": []' in ev:
                            usage_line = ev
                            continue
                        k = counter.count(ev)
                        if k:
                            times.extend([t] * k)
                    if len(times) > before:
                        rec.read_s.append(t)
                        rec.read_counts.append(len(times))
                        if on_tokens is not None:
                            on_tokens(t, len(times))
                    if hold is not None and len(times) >= hold_after:
                        await hold.wait()
                        hold = None
        except aiohttp.ClientError as e:
            raise self._fail(f"POST /v1/completions failed ({_reason(e)})") from None
        except asyncio.TimeoutError:
            raise self._fail(f"a streamed completion of {max_tokens} tokens timed out") from None
        rec.counted_by = counter.source
        rec.prompt_tokens = counter.prompt_tokens
        if usage_line:
            try:
                usage = json.loads(usage_line[len(b"data: "):]).get("usage") or {}
            except (json.JSONDecodeError, AttributeError):
                raise self._fail("a streamed completion's usage chunk is not JSON") from None
            if isinstance(usage.get("prompt_tokens"), int):
                rec.prompt_tokens = usage["prompt_tokens"]
            if isinstance(usage.get("completion_tokens"), int):
                rec.completion_tokens = usage["completion_tokens"]
        if rec.completion_tokens is not None and rec.completion_tokens != len(times) and times:
            if counter.source != "events":
                raise self._fail(f"a streamed completion sent {len(times)} tokens by its chunks' "
                                 f"{counter.source} but its usage says {rec.completion_tokens}")
            spread_counts(rec, rec.completion_tokens)
        return rec

    async def complete(self, model: str, prompt: str, max_tokens: int) -> tuple[float, float, int | None]:
        """One non-streamed completion: ``(sent_s, done_s, prompt_tokens)``.

        Raises:
            ConfigError: the endpoint answers with an error or the connection fails.
        """
        sent = time.perf_counter()
        try:
            async with self._session.post(self.base_url + "/v1/completions",
                                          json=self._payload(model, prompt, max_tokens, False)) as r:
                text = await r.text()
                done = time.perf_counter()
                if r.status != 200:
                    raise self._fail(f"POST /v1/completions answered HTTP {r.status}: {text[:200]}")
        except aiohttp.ClientError as e:
            raise self._fail(f"POST /v1/completions failed ({_reason(e)})") from None
        except asyncio.TimeoutError:
            raise self._fail(f"a completion of {max_tokens} tokens timed out") from None
        try:
            usage = json.loads(text).get("usage") or {}
        except (json.JSONDecodeError, AttributeError):
            raise self._fail("POST /v1/completions did not return an OpenAI completion") from None
        return sent, done, usage.get("prompt_tokens")


class _TokenCounter:
    """Tokens of one stream's chunks, from their bytes (see the module docstring).

    ``"token_ids":[...]`` cannot occur unescaped inside a JSON string, and the prompt's ids are
    under ``"prompt_token_ids"`` (no quote right before ``token_ids``), so a byte search finds
    the delta ids; vLLM writes compact JSON (``model_dump_json``), the search allows spaces.
    """

    __slots__ = ("source", "_usage_seen", "prompt_tokens")

    def __init__(self) -> None:
        self.source = "events"
        self._usage_seen = 0
        self.prompt_tokens: int | None = None

    def count(self, ev: bytes) -> int:
        """Tokens carried by one ``data: {...}`` event with non-empty ``choices``."""
        if self.prompt_tokens is None:
            i = ev.find(b'"prompt_token_ids":')
            if i >= 0:
                self.prompt_tokens = _count_list(ev, i + len(b'"prompt_token_ids":'))
        i = ev.rfind(b'"token_ids":')
        if i >= 0:
            n = _count_list(ev, i + len(b'"token_ids":'))
            if n is not None:
                self.source = "token_ids"
                self._usage_step(ev)
                return n
        got = self._usage_step(ev)
        if got is not None:
            self.source = "usage"
            return got
        return 1

    def _usage_step(self, ev: bytes) -> int | None:
        """Growth of the continuous ``usage.completion_tokens`` since the last chunk, or None."""
        i = ev.rfind(b'"completion_tokens":')
        if i < 0:
            return None
        m = _INT.match(ev, i + len(b'"completion_tokens":'))
        if m is None:
            return None
        total = int(m.group(1))
        step, self._usage_seen = total - self._usage_seen, total
        return step


_INT = re.compile(rb"\s*(\d+)")
_LIST = re.compile(rb"\s*\[([^\]]*)\]")


def _count_list(ev: bytes, j: int) -> int | None:
    """Elements of the JSON list of integers that opens at ``ev[j]`` (after spaces), or None
    when a value other than a list (``null``) is there."""
    m = _LIST.match(ev, j)
    if m is None:
        return None
    body = m.group(1).strip()
    return 0 if not body else body.count(b",") + 1


def spread_counts(rec: StreamRecord, total: int) -> None:
    """Re-count an inexact stream: ``total`` tokens (the usage) over its reads, the first read
    carrying one and the rest in proportion to the time since the previous read (a steady decode
    makes tokens at a steady rate). Sets ``rec.exact = False``; per-read resolution is lost."""
    ts = rec.read_s
    rec.exact = False
    if len(ts) < 2 or ts[-1] <= ts[0]:
        rec.read_counts = [total] * len(ts)
        rec.token_s = [ts[-1] if ts else rec.sent_s] * total
        return
    span = ts[-1] - ts[0]
    counts = [1 + int(round((total - 1) * (t - ts[0]) / span)) for t in ts]
    rec.read_counts = counts
    token_s: list[float] = []
    prev = 0
    for t, c in zip(ts, counts):
        token_s.extend([t] * (c - prev))
        prev = c
    rec.token_s = token_s


def _reason(e: BaseException) -> str:
    if isinstance(e, aiohttp.ClientConnectorError):
        if isinstance(e.os_error, ConnectionRefusedError):
            return "connection refused"
        return (e.os_error.strerror or str(e.os_error)) if e.os_error is not None else str(e)
    return str(e) or type(e).__name__
