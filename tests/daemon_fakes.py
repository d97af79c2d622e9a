"""Loopback servers for the routerd tests: a small OpenAI-compatible backend and a state sidecar.

:class:`FakeBackend` answers ``/v1/completions`` and ``/v1/chat/completions`` like vLLM:
SSE ``data:`` events one token each, an optional final usage event
(``stream_options.include_usage``), ``data: [DONE]``; a non-streamed answer carries
``usage.completion_tokens``. It records what it received, how many generations finished
and how many were cancelled by the client going away (what routerd must cause when its
own client disconnects). Knobs: first-token delay, per-token delay, dying after k tokens
(the connection is aborted mid-stream), splitting every event across two writes, several tokens
per event (``coalesce``, as vLLM sends them when its API server falls behind), vLLM's
``system_fingerprint`` (``fingerprint``), the usage event split across two writes (``split_usage``).

:class:`FakeSidecar` serves ``phasewise.v1.InstanceStateService`` with states the test sets.
"""

from __future__ import annotations

import asyncio
import json
import time

import grpc
from aiohttp import web

from routerd.api.v1 import instance_state_pb2, instance_state_pb2_grpc


async def serve_app(app: web.Application, port: int = 0, **runner_kw) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on 127.0.0.1:``port`` (0: a free one); returns (runner, the bound port)."""
    runner = web.AppRunner(app, access_log=None, **runner_kw)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


class FakeBackend:
    """An OpenAI-compatible fake instance on 127.0.0.1 (port 0)."""

    def __init__(self, name: str = "b", *, ttft_s: float = 0.0, token_s: float = 0.0, default_tokens: int = 8,
                 die_after: int | None = None, die_mid_event: bool = True, split_events: bool = False, models=("m",),
                 pad: int = 0, eol: bytes = b"\n", coalesce: int = 1, fingerprint: str | None = None,
                 split_usage: int | None = None) -> None:
        self.name = name
        self.coalesce = coalesce
        """Tokens per streamed event (the last event may have fewer): vLLM's ``RequestOutputCollector``
        merges the outputs its API server has not sent yet into one event."""
        self.fingerprint = fingerprint
        """vLLM's ``system_fingerprint``: on each choice's last chunk when the client asked for no usage
        event, else on the usage event only (``vllm/entrypoints/openai/completion/serving.py``); with it
        events are compact JSON, as vLLM's pydantic writes them."""
        self.split_usage = split_usage
        """Write the usage event in two parts, the first this many bytes (a network read ends inside it)."""
        self.resets = 0
        self.ttft_s = ttft_s
        self.token_s = token_s
        self.default_tokens = default_tokens
        self.die_after = die_after
        self.die_mid_event = die_mid_event
        self.split_events = split_events
        self.pad = pad
        """Extra characters in every streamed token's text (to make big streams)."""
        self.eol = eol
        """SSE line ending of streamed events: LF (vLLM's), or CRLF / CR (the SSE specification allows both)."""
        self.tokens_sent = 0
        self.models = list(models)
        """What its ``/v1/models`` lists."""
        self.models_status = 200
        """Status of its ``/v1/models`` answers (401/403: vLLM started with ``--api-key``)."""
        self.models_reads = 0
        """``GET /v1/models`` requests received."""
        self.reject_unknown_models = False
        """Answer a completion for a model not in :attr:`models` with vLLM's 404, as vLLM does."""
        self.misrouted = 0
        """Completions received for a model not in :attr:`models`."""
        self.bodies: list[bytes] = []
        self.headers: list[dict] = []
        self.started = 0
        self.finished = 0
        self.cancelled = 0
        self.active = 0
        self.max_active = 0
        self.gate: asyncio.Event | None = None
        """When set to an Event, generations wait on it before the first token."""
        self.between_tokens_gate: asyncio.Event | None = None
        """When set to an Event, streamed generations wait on it after the first token (before
        each later one): a test holds a stream mid-way, deterministically, until it sets the Event."""
        self.runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> "FakeBackend":
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/reset_prefix_cache", self._reset)
        self.runner, self.port = await serve_app(app, self.port, handler_cancellation=True, shutdown_timeout=0.1)
        return self

    async def _reset(self, request: web.Request) -> web.Response:
        """vLLM's dev-mode route: ``reset_status`` (200 as a dev-mode vLLM; 404 as one without)."""
        self.resets += 1
        return web.Response(status=getattr(self, "reset_status", 200))

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def _models(self, request: web.Request) -> web.Response:
        self.models_reads += 1
        if self.models_status != 200:
            return web.json_response({"object": "error", "message": "Unauthorized", "type": "Unauthorized",
                                      "code": self.models_status}, status=self.models_status)
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    def _event(self, chat: bool, i: int, n: int, k: int = 1, usage_asked: bool = False) -> bytes:
        """The event of tokens ``i`` .. ``i + k - 1`` of ``n``."""
        text = "".join(f"t{j} " + "x" * self.pad for j in range(i, i + k))
        last = i + k >= n
        if chat:
            choice = {"index": 0, "delta": {"content": text}, "finish_reason": "length" if last else None}
            obj = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                   "choices": [choice]}
        else:
            choice = {"index": 0, "text": text, "finish_reason": "length" if last else None}
            obj = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}
        return b"data: " + self._json(obj, last and not usage_asked) + self.eol * 2

    def _json(self, obj: dict, stamp: bool) -> bytes:
        if self.fingerprint is None:
            return json.dumps(obj).encode()
        if stamp:
            obj["system_fingerprint"] = self.fingerprint
        return json.dumps(obj, separators=(",", ":")).encode()

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.read()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        payload = json.loads(body)
        if payload.get("model") not in self.models:
            self.misrouted += 1
            if self.reject_unknown_models:
                # vLLM's answer (serving_engine.py: _check_model): 404 NotFoundError.
                return web.json_response({"object": "error", "message": f"The model `{payload.get('model')}` "
                                          "does not exist.", "type": "NotFoundError", "param": None, "code": 404},
                                         status=404)
        if payload.get("prompt") == "invalid":
            # vLLM's own validation error: relayed to the client as it is.
            return web.json_response({"object": "error", "message": "bad prompt", "type": "BadRequestError",
                                      "param": None, "code": 400}, status=400)
        n = int(payload.get("max_tokens") or self.default_tokens)
        stream = bool(payload.get("stream"))
        usage_opt = bool((payload.get("stream_options") or {}).get("include_usage"))
        self.started += 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if self.gate is not None:
                await self.gate.wait()
            await asyncio.sleep(self.ttft_s)
            if not stream:
                await asyncio.sleep(self.token_s * max(0, n - 1))
                text = "".join(f"t{i} " for i in range(n))
                if chat:
                    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                    obj = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
                           "choices": [choice]}
                else:
                    obj = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                           "choices": [{"index": 0, "text": text, "finish_reason": "length"}]}
                obj["usage"] = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
                self.finished += 1
                return web.json_response(obj, headers={"x-backend": self.name})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-backend": self.name})
            await resp.prepare(request)
            for i in range(0, n, self.coalesce):
                k = min(self.coalesce, n - i)
                if self.die_after is not None and i <= self.die_after < i + k:
                    # The connection drops (a crashed instance), inside an event or between two.
                    if self.die_mid_event:
                        await resp.write(b'data: {"choices": [{"te')
                    request.transport.abort()
                    return resp
                if i:
                    if self.between_tokens_gate is not None:
                        await self.between_tokens_gate.wait()
                    await asyncio.sleep(self.token_s)
                ev = self._event(chat, i, n, k, usage_opt)
                if self.split_events:
                    await resp.write(ev[: len(ev) - 1])
                    await asyncio.sleep(0.002)
                    await resp.write(ev[len(ev) - 1:])
                else:
                    await resp.write(ev)
                self.tokens_sent += k
            if usage_opt:
                usage = {"id": "x", "object": "chat.completion.chunk" if chat else "text_completion", "choices": [],
                         "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}}
                ev = b"data: " + self._json(usage, True) + self.eol * 2
                if self.split_usage is not None:
                    await resp.write(ev[:self.split_usage])
                    await asyncio.sleep(0.002)
                    ev = ev[self.split_usage:]
                await resp.write(ev)
                await asyncio.sleep(0.002)  # usage and [DONE] in separate chunks (GIE#1626)
            await resp.write(b"data: [DONE]" + self.eol * 2)
            await resp.write_eof()
            self.finished += 1
            return resp
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1


class _StateServicer(instance_state_pb2_grpc.InstanceStateServiceServicer):
    def __init__(self, sidecar: "FakeSidecar") -> None:
        self.s = sidecar

    async def GetState(self, request, context):
        return self.s.state

    async def WatchState(self, request, context):
        seq = -1
        while True:
            if self.s.seq != seq:
                seq = self.s.seq
                yield self.s.state
            await asyncio.sleep(0.01)


class FakeSidecar:
    """An ``InstanceStateService`` on 127.0.0.1 that streams whatever :meth:`set` was given."""

    def __init__(self, name: str = "b") -> None:
        self.name = name
        self.state = instance_state_pb2.InstanceState(instance=name, healthy=True, scraped_at_unix_s=time.time())
        self.seq = 0
        self.server: grpc.aio.Server | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set(self, **fields) -> None:
        fields.setdefault("healthy", True)
        self.seq += 1
        self.state = instance_state_pb2.InstanceState(instance=self.name, sequence=self.seq,
                                                      scraped_at_unix_s=time.time(), **fields)

    async def start(self) -> "FakeSidecar":
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        instance_state_pb2_grpc.add_InstanceStateServiceServicer_to_server(_StateServicer(self), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
            self.server = None


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


async def start_daemon(backends=(), **settings):
    """A started :class:`routerd.daemon.app.Daemon` on loopback (ports 0) routing to ``backends``."""
    from routerd.daemon.app import Daemon
    from routerd.daemon.config import Settings

    cfg = {"http": {"host": "127.0.0.1", "port": 0}, "grpc": {"host": "127.0.0.1", "port": 0}, "models": ["m"],
           "endpoints": [{"name": b.name, "url": b.url} for b in backends], "reload": {"watch": False},
           "log_level": "warning"}
    d = Daemon(Settings.model_validate(_merge(cfg, settings)))
    await d.start()
    return d


def sample(daemon, name: str, **labels) -> float:
    """The value of one sample of ``daemon``'s registry (0.0 when absent)."""
    v = daemon.metrics.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def in_flight_samples(daemon) -> dict[str, float]:
    """Every ``phasewise_in_flight_requests`` series by endpoint, plus the queue depth."""
    out = {}
    for metric in daemon.metrics.registry.collect():
        for s in metric.samples:
            if s.name == "phasewise_in_flight_requests":
                out[s.labels["endpoint"]] = s.value
            if s.name == "phasewise_router_queue_depth":
                out["queue"] = s.value
    return out


def openai_client(daemon):
    import openai

    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{daemon.http_port}/v1", api_key="test", max_retries=0)


class SilentServer:
    """A TCP server on 127.0.0.1 that accepts, reads, then closes without answering, or (``partial``)
    after half a status line: an instance that crashed before (or while) answering."""

    def __init__(self, partial: bool = False) -> None:
        self.partial = partial
        self.accepted = 0
        self.server: asyncio.AbstractServer | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        await reader.read(1024)
        if self.partial:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Ty")
            await writer.drain()
        writer.close()

    async def start(self) -> "SilentServer":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None
