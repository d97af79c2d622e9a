"""The profiler's view of an OpenAI-compatible endpoint: discovery, timed streams, vLLM metrics.

Token arrival times are taken as each server-sent event is read (``time.perf_counter``,
seconds); chunks are not JSON-decoded on the hot path so the client keeps up with
large batches, only the final ``usage`` chunk is.
"""

from __future__ import annotations

import asyncio
import json
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


@dataclass
class StreamRecord:
    """One streamed completion: when it was sent and when each token arrived (``perf_counter`` s)."""

    sent_s: float
    token_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    """From the final ``usage`` chunk."""
    completion_tokens: int | None = None


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
            connector=aiohttp.TCPConnector(limit=0),
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
        return info

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

    def _payload(self, model: str, prompt: str, max_tokens: int, stream: bool) -> dict:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                # vLLM extensions: run to max_tokens whatever the text (outputs of known length).
                "ignore_eos": True, "min_tokens": max_tokens, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def stream(self, model: str, prompt: str, max_tokens: int,
                     on_token: Callable[[float], None] | None = None,
                     hold: asyncio.Event | None = None, hold_after: int = 1) -> StreamRecord:
        """Stream one completion, time-stamping every token chunk (``on_token(t)`` is called for each).

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
                rest = b""
                # One timestamp per network read; events are split on the SSE separator with
                # bytes operations only (per-line iteration costs more than the tokens' spacing
                # allows at 128 concurrent streams).
                async for data in r.content.iter_any():
                    t = time.perf_counter()
                    events = (rest + data).split(b"\n\n")
                    rest = events.pop()
                    for ev in events:
                        if not ev.startswith(b"data: {"):
                            continue
                        if b'"choices":[]' in ev or b'"choices": []' in ev:
                            usage_line = ev
                            continue
                        times.append(t)
                        if on_token is not None:
                            on_token(t)
                    if hold is not None and len(times) >= hold_after:
                        await hold.wait()
                        hold = None
        except aiohttp.ClientError as e:
            raise self._fail(f"POST /v1/completions failed ({_reason(e)})") from None
        except asyncio.TimeoutError:
            raise self._fail(f"a streamed completion of {max_tokens} tokens timed out") from None
        if usage_line:
            usage = json.loads(usage_line[len(b"data: "):]).get("usage") or {}
            rec.prompt_tokens = usage.get("prompt_tokens")
            rec.completion_tokens = usage.get("completion_tokens")
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


def _reason(e: BaseException) -> str:
    if isinstance(e, aiohttp.ClientConnectorError):
        if isinstance(e.os_error, ConnectionRefusedError):
            return "connection refused"
        return (e.os_error.strerror or str(e.os_error)) if e.os_error is not None else str(e)
    return str(e) or type(e).__name__
