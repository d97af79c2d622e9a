"""The OpenAI-compatible HTTP front of routerd (aiohttp) and the relay to the instances.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` true or
false), ``GET /v1/models``, ``GET /metrics``, ``/healthz``, ``/readyz``. Errors use the
OpenAI shape ``{"error": {"message", "type", "param", "code"}}``: 400 malformed JSON or a
missing field, 404 unknown model or route, 413 body over ``max_body_bytes``, 429 router
queue full, 502/504 upstream failure or timeout, 503 no ready endpoint or draining
(with ``x-phasewise-reject-reason``), never 500.

The request body is forwarded unchanged. A streamed answer is relayed chunk by chunk as
it arrives; generated tokens are counted by complete ``\\n\\n``-terminated SSE events
with bytes operations, even when an event is split across network chunks, and the
final ``usage`` event (``stream_options.include_usage``), if any, gives the exact count.
A non-streamed answer gives ``usage.completion_tokens``.

A retry goes to another instance only when the upstream failed before sending its first
byte (connection refused or reset before the response headers). A client that goes away
cancels the handler (aiohttp ``handler_cancellation``), which closes the upstream
connection so vLLM aborts the generation, for streaming and non-streaming requests alike
(production-stack#634). Every path ends in :meth:`Router.finish` (try/finally).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from typing import TYPE_CHECKING, Any, Iterable

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from routerd.daemon.router import RejectedError, shown_name
from routerd.daemon.upstream import Exchange, UpstreamError, UpstreamPool, UpstreamTimeout
from routerd.tokens import chat_prompt_text, count_text_tokens

if TYPE_CHECKING:
    from routerd.daemon.app import Daemon

log = logging.getLogger("routerd.proxy")

#: Request header carrying the task label for the length predictor (optional).
TASK_HEADER = "x-phasewise-task"
#: Response header naming why routerd refused a request (llm-d's drop-reason header).
REASON_HEADER = "x-phasewise-reject-reason"

# RFC 9110 section 7.6.1 and RFC 9112, plus the non-standard Proxy-Connection that old clients send.
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding", "expect",
})
_RESPONSE_DROP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-connection", "te", "transfer-encoding",
    "content-length", "date", "server", "upgrade", "trailer",
})
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_DONE = b"data: [DONE]"
#: Stream bytes kept for the end-of-stream checks: a usage event is ~200 bytes, [DONE] 14.
_TAIL_BYTES = 2048
_TAIL_TRIM = 4 * _TAIL_BYTES
_POST_ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    """An OpenAI-style error object as JSON bytes."""
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


def error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI-style JSON error response."""
    return web.Response(status=status, body=error_body(message, type_, param, code),
                        content_type="application/json", headers=headers)


class BadRequest(Exception):
    """A request that fails validation; answered 400 (or ``status``)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code
        self.type_ = type_


def prompt_tokens_of(kind: str, payload: dict) -> tuple[int, str | None]:
    """(estimated prompt tokens, prompt text for the predictor or None) of a request body.

    Raises:
        BadRequest: ``prompt`` / ``messages`` missing or of the wrong type.
    """
    tokens, text, _ = prompt_of(kind, payload)
    return tokens, text


def prompt_of(kind: str, payload: dict) -> tuple[int, str | None, str | list[int] | None]:
    """(estimated prompt tokens, prompt text for the predictor or None, what the prompt's prefix
    is hashed from) of a request body.

    The prefix input (:meth:`routerd.daemon.prefix.PrefixIdentity.blocks_for`) is the rendered
    messages of a chat request (:func:`routerd.tokens.chat_prompt_text`), a completions prompt
    string, or its token ids; of a batch (a list of several prompts) the first prompt, which the
    policies score and index for the whole batch (batched prompts share a template more often
    than not; the others are cached where the batch goes too).

    Raises:
        BadRequest: ``prompt`` / ``messages`` missing or of the wrong type.
    """
    if kind == "chat":
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty array of message objects", "messages")
        try:
            text = chat_prompt_text(messages)
        except ValueError as e:
            raise BadRequest(str(e), "messages") from None
        return count_text_tokens(text), text, text
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return count_text_tokens(prompt), prompt, prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return sum(count_text_tokens(p) for p in prompt), "\n".join(prompt), prompt[0]
        if all(type(p) is int for p in prompt):
            return len(prompt), None, prompt
        if all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in prompt):
            return sum(len(p) for p in prompt), None, prompt[0]
    raise BadRequest("'prompt' must be a string, an array of strings, or an array of token ids", "prompt")


def parse_request(kind: str, body: bytes) -> tuple[dict, bool, int, str | None, str | list[int] | None]:
    """(payload, stream, estimated prompt tokens, prompt text for the predictor, prefix input) of
    an inference request body (``kind``: ``completions`` or ``chat``); shared by the HTTP front
    and the endpoint picker (:mod:`routerd.epp`).

    Raises:
        BadRequest: an empty body, not JSON, not an object, ``model`` missing or not a string,
            ``stream`` not a boolean, ``prompt`` / ``messages`` missing or of the wrong type.
    """
    if not body:
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # '[[[[...' nested deeper than the parser's stack
        raise BadRequest("request body is not valid JSON: nested too deeply", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", "model")
    stream = payload.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    tokens, text, prefix_input = prompt_of(kind, payload)
    return payload, stream, tokens, text, prefix_input


def connection_named(values: Iterable[str]) -> frozenset[str]:
    """Header names (lower case) listed in ``Connection`` header values: hop-by-hop for this
    connection only, so a proxy must not forward them (RFC 9110 section 7.6.1)."""
    return frozenset(t.strip().lower() for v in values for t in v.split(",") if t.strip())


def final_usage_tokens(tail: bytes) -> int | None:
    """``usage.completion_tokens`` of the last SSE data event before ``[DONE]`` in ``tail``, if any.

    Lines may end with CRLF, LF or CR (the SSE specification)."""
    if 13 in tail:
        tail = tail.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    for ev in reversed(tail.split(b"\n\n")):
        ev = ev.strip()
        if not ev.startswith(b"data:"):
            continue
        payload = ev[5:].strip()
        if payload == b"[DONE]":
            continue
        if b'"usage"' not in payload:
            return None
        try:
            usage = json.loads(payload).get("usage")
        except (ValueError, AttributeError):
            return None
        ct = usage.get("completion_tokens") if isinstance(usage, dict) else None
        return ct if type(ct) is int and ct >= 0 else None
    return None


def stream_tokens(tail: bytes, events: int, chat: bool) -> int:
    """Output tokens of an SSE stream relayed to its end: the final usage event's
    ``completion_tokens`` if ``tail`` (the stream's last bytes) has one, else ``events`` (SSE
    events counted) less ``[DONE]`` and, for ``chat``, the role-only first chunk vLLM sends."""
    tokens = final_usage_tokens(tail)
    if tokens is None:
        tokens = max(0, events - (1 if _DONE in tail else 0) - (1 if chat else 0))
    return tokens


class _DeliveredThenClosed(asyncio.CancelledError):
    """The handler was cancelled after the whole stream reached the client (already counted)."""


class _StreamRelay:
    """The per-chunk path of a streamed answer: count SSE events, write to the client, flow control.

    Runs inside the upstream connection's ``data_received``: no coroutine switch per chunk.
    Events are counted at blank lines (:meth:`sink`, :meth:`_count_cr`), carrying the line ending that ends one
    chunk into the next, so an event split across network chunks counts once.
    """

    __slots__ = ("ctr", "chunked", "ex", "ep", "r", "events", "prev_nl", "at_boundary", "t_first", "t2",
                 "client_gone", "paused", "_poll", "cr", "pending_cr", "last", "on_tokens")

    #: Client write buffer above which the upstream is paused (bytes; 262144 in ``sink``), and
    #: below which it resumes.
    HIGH_WATER = 256 * 1024
    LOW_WATER = 64 * 1024

    def __init__(self, ctr, chunked: bool, ex: Exchange, ep, r) -> None:
        self.ctr = ctr
        self.chunked = chunked
        self.ex = ex
        self.ep = ep
        self.r = r
        self.on_tokens = ep.on_tokens  # bound once: called per token
        self.events = 0
        self.prev_nl = False
        self.at_boundary = True
        self.cr = False  # a CR seen: the stream may end lines with CRLF or CR
        self.pending_cr = False  # the previous piece ended with CR
        self.t_first: float | None = None
        self.t2 = bytearray()  # the stream's last bytes (see sink)
        self.client_gone = False
        self.paused = False
        self._poll: asyncio.TimerHandle | None = None
        self.last = b""
        """The final piece of a chunked client's body, held for ``write_eof`` (see :meth:`sink`)."""

    def sink(self, piece: bytes, chunk: bytes | None = None, last: bool = False) -> None:
        """Relay ``piece`` (``Exchange.relay(framed=True)``). ``chunk``: the same piece framed as
        one chunk, written as it is to a chunked client. ``last``: the upstream body ended with
        it; a chunked client gets it with the end of its body (:attr:`last`)."""
        if self.t_first is None:
            self.t_first = time.monotonic()
            self.ep.on_first_token(self.r)
        # Count the events that end in this piece; inline, since this runs once per token
        # (a method call here and a deque of pieces for the tail cost routerd 5 % more CPU per
        # request than the two-read tail before issue 15: py-spy over routerd_overhead.py).
        if self.cr or 13 in piece:
            self._count_cr(piece)
        else:
            last_nl = piece[-1] == 10
            if self.prev_nl and piece[0] == 10:
                n = piece.count(b"\n\n") + 1
                self.at_boundary = last_nl and (len(piece) == 1 or piece[-2] == 10)
            else:
                # A piece that is one whole event (vLLM's stream, a token a piece) has its first
                # LF at its last-but-one byte: one blank line, at its end. Finding a byte
                # (memchr) costs a third of counting a pair of them.
                n = 1 if last_nl and piece.find(10) == len(piece) - 2 else piece.count(b"\n\n")
                self.at_boundary = n > 0 and last_nl and piece[-2] == 10
            if n:
                self.events += n
                self.on_tokens(self.r, n)
            self.prev_nl = last_nl
        # The stream's last bytes, whatever the read sizes: the final usage event and [DONE]
        # may come in many small reads (issue 15: two reads were kept, and such streams
        # counted [DONE] and the usage event as tokens). One append per read, trimmed to
        # _TAIL_BYTES once it reaches 4x that (amortised: a copy per ~6 KiB relayed).
        t2 = self.t2
        t2 += piece
        if len(t2) > _TAIL_TRIM:
            del t2[:-_TAIL_BYTES]
        ctr = self.ctr
        if ctr.is_closing():
            # The client went away: drop the upstream connection so the instance aborts.
            self.client_gone = True
            self.ex.abort()
            self.ex.conn._fail(UpstreamError("client went away"))
            return
        if self.chunked:
            if chunk is not None:
                ctr.write(chunk)
            elif last:
                # Written by write_eof with the terminating chunk: one write instead of two (a
                # write to a loopback client costs routerd 5-10 us of CPU: py-spy over
                # benchmarks/routerd_overhead.py, where the body's end comes in the same read as
                # its last event nearly always).
                self.last = piece
            elif len(piece) < 16384:
                # One buffer: uvloop writes it with write(), cheaper than writev() of three
                # (0.3 us of CPU per write; the copy is a fraction of that).
                ctr.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            else:
                ctr.writelines((b"%x\r\n" % len(piece), piece, b"\r\n"))
        else:
            ctr.write(piece)
        if ctr.get_write_buffer_size() > 262144 and not self.paused:
            self.paused = True
            self.ex.pause()
            self._poll = asyncio.get_running_loop().call_later(0.01, self._check_drained)

    def _count_cr(self, piece: bytes) -> None:
        """:meth:`sink`'s event count for a stream that ends lines with CRLF or CR.

        An event ends at a blank line; lines end with CRLF, LF or CR (the SSE specification,
        "Interpreting an event stream"). Streams in LF only (vLLM's) never come here; once a CR
        is seen, pieces are rewritten to LF first, a CRLF split across two pieces included.
        """
        self.cr = True
        lf = piece
        if self.pending_cr and piece[0] == 10:
            lf = piece[1:]  # the LF of a CRLF whose CR ended the previous piece
        self.pending_cr = piece[-1] == 13
        lf = lf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if not lf:
            return
        n = lf.count(b"\n\n")
        last_nl = lf[-1] == 10
        if self.prev_nl and lf[0] == 10:
            n += 1
            self.at_boundary = last_nl and (len(lf) == 1 or lf[-2] == 10)
        elif n:
            self.at_boundary = last_nl and lf[-2] == 10
        else:
            self.at_boundary = False
        if n:
            self.events += n
            self.on_tokens(self.r, n)
        self.prev_nl = last_nl

    def _check_drained(self) -> None:
        self._poll = None
        ctr = self.ctr
        if ctr.is_closing():
            self.client_gone = True
            self.ex.abort()
            self.ex.conn._fail(UpstreamError("client went away"))
        elif ctr.get_write_buffer_size() <= self.LOW_WATER:
            self.paused = False
            self.ex.resume()
        else:
            self._poll = asyncio.get_running_loop().call_later(0.01, self._check_drained)

    def tail(self) -> bytes:
        """The last ``_TAIL_BYTES`` bytes relayed: the final usage event and ``[DONE]``, however split."""
        return bytes(self.t2[-_TAIL_BYTES:])

    def close(self) -> None:
        if self._poll is not None:
            self._poll.cancel()
            self._poll = None


class Proxy:
    """Request handlers bound to one :class:`~routerd.daemon.app.Daemon`."""

    def __init__(self, daemon: "Daemon") -> None:
        self.d = daemon
        self.pool: UpstreamPool | None = None
        self.max_body_bytes = daemon.settings.max_body_bytes

    # -- lifecycle ---------------------------------------------------------------
    def build_app(self) -> web.Application:
        """The aiohttp application (routes only; the daemon runs it)."""
        self.max_body_bytes = self.d.settings.max_body_bytes
        app = web.Application(client_max_size=self.max_body_bytes)
        busy = self._marking_busy
        app.router.add_post("/v1/completions", busy(self.completions))
        app.router.add_post("/v1/chat/completions", busy(self.chat_completions))
        app.router.add_get("/v1/models", busy(self.models))
        app.router.add_get("/metrics", busy(self.metrics))
        app.router.add_get("/healthz", busy(self.healthz))
        app.router.add_get("/readyz", busy(self.readyz))
        app.router.add_route("*", "/{tail:.*}", busy(self.not_found))
        return app

    def _marking_busy(self, handler):
        """``handler`` telling the front-end limits (``frontend.py``) that its connection is
        handling a request. A wrapper per route rather than an aiohttp middleware: any
        middleware puts aiohttp's middleware chain on every request, 2-3 % of routerd's CPU
        (py-spy over benchmarks/routerd_overhead.py)."""
        async def marked(request: web.Request) -> web.StreamResponse:
            f = self.d.frontend
            if f is None:
                return await handler(request)
            tr = request.transport
            f.request_started(tr)
            try:
                return await handler(request)
            finally:
                f.request_ended(tr)
        return marked

    async def open_pool(self) -> None:
        """Create the upstream connection pool (keep-alive, TCP_NODELAY)."""
        self.pool = UpstreamPool(**self.pool_settings())

    def pool_settings(self) -> dict[str, Any]:
        """Pool limits and timeouts from the settings."""
        up = self.d.settings.upstream
        return {"limit": up.connection_limit, "connect_timeout_s": up.connect_timeout_s,
                "read_timeout_s": up.read_timeout_s, "response_timeout_s": up.response_timeout_s}

    def reconfigure(self) -> None:
        """Apply new upstream settings to the pool (hot reload)."""
        if self.pool is not None:
            for k, v in self.pool_settings().items():
                setattr(self.pool, k, v)

    async def close(self) -> None:
        """Close the upstream connections."""
        if self.pool is not None:
            await self.pool.close()
            self.pool = None

    # -- small routes ------------------------------------------------------------
    async def not_found(self, request: web.Request) -> web.Response:
        # Counted: a client posting to a mistyped path is an inference request that failed.
        if request.path in _POST_ROUTES or request.path == "/v1/models":
            self.d.metrics.count_response(405)
            return error_response(405, f"method {request.method} not allowed on {request.path}",
                                  "invalid_request_error", code="method_not_allowed")
        self.d.metrics.count_response(404)
        return error_response(404, f"unknown route {request.method} {request.path}", "invalid_request_error",
                              code="not_found")

    async def models(self, request: web.Request) -> web.Response:
        names = self.d.model_names()
        if not names:
            # Nothing configured and no sidecar state yet: ask an instance.
            names = await self._models_from_an_instance()
        created = int(self.d.started_at_unix)
        data = [{"id": m, "object": "model", "created": created, "owned_by": "phasewise"} for m in names]
        return web.json_response({"object": "list", "data": data})

    async def _models_from_an_instance(self) -> list[str]:
        pool = self.pool
        for ep in self.d.router.endpoints:
            if not ep.ready or pool is None:
                continue
            try:
                async with asyncio.timeout(2.0):
                    ex = await pool.request(ep.target, "/v1/models", [("Accept", "application/json")], b"",
                                            method="GET")
                    try:
                        body = await ex.read()
                    finally:
                        ex.release()
                listed = json.loads(body).get("data", []) if ex.status == 200 else []
                names = [m["id"] for m in listed if isinstance(m, dict) and isinstance(m.get("id"), str)]
            except (UpstreamError, TimeoutError, ValueError, AttributeError):
                continue
            if names:
                return names
        return []

    async def metrics(self, request: web.Request) -> web.Response:
        self.d.refresh_gauges()
        return web.Response(body=generate_latest(self.d.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        ready, why = self.d.readiness()
        now = self.d.router.clock()
        ejected = sorted(ep.name for ep in self.d.router.endpoints if ep.ejected_until > now)
        return web.json_response({"status": "ready" if ready else "not ready", "reason": why, "ejected": ejected},
                                 status=200 if ready else 503)

    # -- inference routes --------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._guarded(request, "completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._guarded(request, "chat")

    async def _guarded(self, request: web.Request, kind: str) -> web.StreamResponse:
        try:
            return await self._handle(request, kind)
        except (asyncio.CancelledError, web.HTTPException):
            raise
        except Exception:  # a routerd bug: say so in the OpenAI shape (bookkeeping was released)
            log.exception("internal error on %s", request.path)
            self.d.metrics.count_response(500)
            return error_response(500, "internal error in routerd", "server_error", code="internal_error")

    def _refuse(self, status: int, message: str, type_: str, reason: str, code: str | None = None,
                param: str | None = None, retry_after: bool = False) -> web.Response:
        d = self.d
        d.metrics.count_rejection(reason)
        d.metrics.count_response(status)
        headers = {REASON_HEADER: reason}
        if retry_after:
            headers["Retry-After"] = "1"
        return error_response(status, message, type_, param, code or reason, headers)

    async def _handle(self, request: web.Request, kind: str) -> web.StreamResponse:
        d = self.d
        t0 = time.monotonic()
        if d.router.draining:
            return self._refuse(503, "routerd is shutting down", "service_unavailable_error", "draining",
                                retry_after=True)
        limit = self.max_body_bytes
        cl = request.content_length
        if cl is not None and cl > limit:
            return self._refuse(413, f"request body is {cl} bytes; the limit is {limit}", "invalid_request_error",
                                "too_large", code="request_too_large")
        try:
            if request.content.is_eof():
                # The whole body came with the headers (most requests): nothing to wait for, and
                # the timeout's set-up is 1 % of routerd's CPU per request (py-spy).
                body = await request.read()
            else:
                # asyncio.timeout, not wait_for: wait_for wraps the read in a task of its own, 1 %
                # of routerd's CPU per request (py-spy over benchmarks/routerd_overhead.py).
                async with asyncio.timeout(d.settings.http.body_timeout_s):
                    body = await request.read()
        except TimeoutError:
            resp = self._refuse(408, f"request body not received within {d.settings.http.body_timeout_s:g} s",
                                "invalid_request_error", "body_timeout", code="request_timeout")
            resp.force_close()  # the rest of a half-sent body is not waited for
            if d.frontend is not None:
                d.frontend.close_after_answer(request.transport)
            return resp
        except web.HTTPRequestEntityTooLarge:
            return self._refuse(413, f"request body exceeds the limit of {limit} bytes", "invalid_request_error",
                                "too_large", code="request_too_large")
        except (aiohttp.ClientError, ConnectionError, ValueError) as e:
            return self._refuse(400, f"could not read the request body: {e}", "invalid_request_error",
                                "bad_request", code="invalid_body")
        try:
            payload, stream, prompt_tokens, prompt_text, prefix_input = self._validate(kind, body)
        except BadRequest as e:
            reason = "not_found" if e.status == 404 else "bad_request"
            return self._refuse(e.status, str(e), e.type_, reason, code=e.code, param=e.param)
        if d.router.model_verdict(payload["model"]) != "ok":
            # Only then the coroutine that may wait for model lists (two frames per request saved).
            refused = await self._check_model(payload["model"])
            if refused is not None:
                return refused
        task = request.headers.get(TASK_HEADER)
        mt = payload.get("max_tokens", payload.get("max_completion_tokens"))
        bucket = await d.predict(prompt_text, prompt_tokens, task, mt if type(mt) is int else None)
        router = d.router
        chat = kind == "chat"
        prefix = (await d.prefix_blocks_in_thread(prefix_input, chat) if d.prefix_in_thread(prefix_input, chat)
                  else d.prefix_blocks(prefix_input, chat))
        r = router.new_request(prompt_tokens, bucket, task, model=payload["model"], prefix=prefix)
        r.blind = not stream
        try:
            ep = await router.dispatch(r)
        except RejectedError as e:
            return self._refuse(e.status, str(e), e.error_type, e.reason, retry_after=True)
        except asyncio.CancelledError:
            # The client went away while its request was queued (the router unbooked it).
            d.metrics.client_disconnects.inc()
            d.metrics.count_response(499)
            raise
        d.metrics.prompt_tokens.inc(prompt_tokens)
        try:
            return await self._forward(request, kind, body, stream, r, ep, t0)
        finally:
            router.finish(r)

    async def _check_model(self, model: str) -> web.Response | None:
        """The refusal of a request for ``model`` before dispatch, or None to go on: 404 when no
        endpoint serves it and every list is known; 503 with ``Retry-After`` (reason
        ``no_endpoint``, as when no ready endpoint serves a known model) while some endpoint's
        list is still being read, after waiting up to ``router.no_endpoint_grace_s`` for it."""
        verdict = await self.d.settle_model(model)
        if verdict == "unknown":
            return self._refuse(404, f"the model {shown_name(model)} does not exist; see GET /v1/models",
                                "invalid_request_error", "not_found", code="model_not_found", param="model")
        if verdict == "pending":
            return self._refuse(503, f"no endpoint is known to serve the model {shown_name(model)} yet: model "
                                "lists are still being read", "service_unavailable", "no_endpoint", retry_after=True)
        return None

    def _validate(self, kind: str, body: bytes) -> tuple[dict, bool, int, str | None, str | list[int] | None]:
        return parse_request(kind, body)

    @staticmethod
    def _upstream_headers(request: web.Request) -> list[tuple[str, str]]:
        drop = _HOP_BY_HOP | connection_named(request.headers.getall("Connection", ()))
        h = [(k, v) for k, v in request.headers.items() if k.lower() not in drop]
        h.append(("Accept-Encoding", "identity"))
        return h

    async def _forward(self, request: web.Request, kind: str, body: bytes, stream: bool, r, ep,
                       t0: float) -> web.StreamResponse:
        d = self.d
        router = d.router
        metrics = d.metrics
        pool = self.pool
        assert pool is not None
        path = request.path
        headers = self._upstream_headers(request)
        tried: set[str] = set()
        retries = 0
        moved_on_404 = False
        while True:
            try:
                ex = await pool.request(ep.target, path, headers, body)
                if (ex.status != 404 or moved_on_404 or not router.several_models
                        or not router.has_candidate(tried | {ep.name}, r.model)):
                    break
                # vLLM checks the model before running anything: a 404 here means this endpoint
                # no longer serves it (an adapter unloaded) and the request never ran. Another
                # endpoint serving it takes it, once; this one's list is read again. (With one
                # model possible the lists decide nothing, and a 404 is relayed as it is.)
                moved_on_404 = True
                d.model_lister.poke(ep.name)
                router.note_success(ep)
                try:
                    await ex.read()
                except UpstreamError:
                    pass
                finally:
                    ex.release()
                log.info("instance %s answered 404 for the model %s; retrying on another one", ep.name,
                         shown_name(r.model))
                tried.add(ep.name)
                router.finish(r)
                metrics.retries.inc()
                got = await self._redispatch(r, tried)
                if isinstance(got, web.StreamResponse):
                    return got
                ep = got
                continue
            except asyncio.CancelledError:
                metrics.client_disconnects.inc()
                metrics.count_response(499)
                raise
            except UpstreamTimeout:
                ep.m.err_timeout.inc()
                router.note_failure(ep, "timeout")
                metrics.count_response(504)
                return error_response(504, f"instance {ep.name} did not answer in time", "upstream_error",
                                      code="upstream_timeout")
            except UpstreamError as e:
                if not e.before_first_byte:
                    ep.m.err_stream.inc()
                    router.note_failure(ep, "stream")
                    metrics.count_response(502)
                    return error_response(502, f"instance {ep.name} sent a broken answer: {e}", "upstream_error",
                                          code="upstream_error")
                err = e
            # Failed before the first byte: the instance never answered; try another one.
            ep.m.err_connect.inc()
            router.note_connect_failure(ep)
            log.warning("instance %s (%s): %s", ep.name, ep.url, err)
            tried.add(ep.name)
            router.finish(r)
            if retries >= d.settings.upstream.max_retries or not router.has_candidate(tried, r.model):
                metrics.count_response(502)
                return error_response(502, f"no instance could be reached (last: {ep.name}: {err})",
                                      "upstream_error", code="upstream_unreachable")
            retries += 1
            metrics.retries.inc()
            got = await self._redispatch(r, tried)
            if isinstance(got, web.StreamResponse):
                return got
            ep = got
        try:
            status = ex.status
            if status >= 500:
                ep.m.err_status.inc()
                router.note_failure(ep, "status")
            else:
                router.note_success(ep)
                if status == 404:  # vLLM's answer for a model (or adapter) it no longer serves
                    d.model_lister.poke(ep.name)
            if stream and status == 200 and ex.content_type == "text/event-stream":
                return await self._relay_stream(request, ex, r, ep, t0)
            return await self._relay_body(ex, r, ep, t0)
        except _DeliveredThenClosed:
            raise
        except asyncio.CancelledError:
            metrics.client_disconnects.inc()
            metrics.count_response(499)
            raise
        finally:
            # Not read to the end (client gone, error): closing the connection makes vLLM abort.
            ex.release()

    async def _redispatch(self, r, tried: set[str]):
        """Dispatch ``r`` again to an endpoint not in ``tried``: that endpoint, or the refusal
        (a ``web.Response``) to answer with. A client gone meanwhile is counted (499) and its
        cancellation raised."""
        r.reset_for_retry()
        try:
            return await self.d.router.dispatch(r, frozenset(tried))
        except RejectedError as e:
            return self._refuse(e.status, str(e), e.error_type, e.reason, retry_after=True)
        except asyncio.CancelledError:
            self.d.metrics.client_disconnects.inc()
            self.d.metrics.count_response(499)
            raise

    @staticmethod
    def _response_headers(ex: Exchange) -> CIMultiDict:
        drop = _RESPONSE_DROP | connection_named(v for k, v in ex.headers if k.lower() == "connection")
        h = CIMultiDict()
        for k, v in ex.headers:
            if k.lower() not in drop:
                h.add(k, v)
        return h

    async def _relay_body(self, ex: Exchange, r, ep, t0: float) -> web.StreamResponse:
        d = self.d
        try:
            data = await ex.read()
        except UpstreamTimeout as e:
            ep.m.err_timeout.inc()
            d.router.note_failure(ep, "timeout")
            d.metrics.count_response(504)
            return error_response(504, f"instance {ep.name} stalled in its answer: {e}", "upstream_error",
                                  code="upstream_timeout")
        except UpstreamError as e:
            ep.m.err_stream.inc()
            d.router.note_failure(ep, "stream")
            d.metrics.count_response(502)
            return error_response(502, f"instance {ep.name} broke off its answer: {e}", "upstream_error",
                                  code="upstream_error")
        status = ex.status
        if status == 200:
            m = _COMPLETION_TOKENS.search(data)
            tokens = int(m.group(1)) if m else 0
            ep.on_first_token(r)
            ep.on_tokens(r, tokens)
            d.observe_finished(r, t0, None, tokens)
        d.metrics.count_response(status)
        return web.Response(body=data, status=status, headers=self._response_headers(ex))

    async def _relay_stream(self, request: web.Request, ex: Exchange, r, ep, t0: float) -> web.StreamResponse:
        d = self.d
        resp = web.StreamResponse(status=ex.status, headers=self._response_headers(ex))
        if request.version >= (1, 1):
            resp.enable_chunked_encoding()
        ctr = request.transport
        try:
            await resp.prepare(request)
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            ctr = None
        if ctr is None or ctr.is_closing():
            d.metrics.client_disconnects.inc()
            d.metrics.count_response(499)
            return resp
        relay = _StreamRelay(ctr, resp.chunked, ex, ep, r)
        try:
            await ex.relay(relay.sink, framed=True)
        except asyncio.CancelledError:
            if relay.client_gone or _DONE not in relay.tail():
                raise
            # The client read ``[DONE]`` and closed before the instance ended its body (the
            # openai client does): the answer was delivered in full, so it is a completion.
            self._finish_stream(request, r, t0, relay)
            raise _DeliveredThenClosed from None
        except UpstreamError as e:
            if relay.client_gone:
                d.metrics.client_disconnects.inc()
                d.metrics.count_response(499)
                return resp
            # The instance broke off mid-stream: nothing can be retried after the first byte.
            (ep.m.err_timeout if isinstance(e, UpstreamTimeout) else ep.m.err_stream).inc()
            d.router.note_failure(ep, "timeout" if isinstance(e, UpstreamTimeout) else "stream")
            log.warning("instance %s broke off a stream: %s", ep.name, e)
            d.metrics.count_response(502)
            await self._end_broken_stream(request, resp, relay.at_boundary, ep.name)
            return resp
        finally:
            relay.close()
        if relay.client_gone:
            d.metrics.client_disconnects.inc()
            d.metrics.count_response(499)
            return resp
        self._finish_stream(request, r, t0, relay)
        try:
            await resp.write_eof(relay.last)
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            pass
        return resp

    def _finish_stream(self, request: web.Request, r, t0: float, relay: "_StreamRelay") -> None:
        """Record a stream relayed to its ``[DONE]``: tokens from the final usage event, else
        the SSE events less ``[DONE]`` and, for chat, the role-only first chunk vLLM sends."""
        tokens = stream_tokens(relay.tail(), relay.events, request.path.endswith("/chat/completions"))
        self.d.observe_finished(r, t0, relay.t_first, tokens)
        self.d.metrics.count_response(200)

    async def _end_broken_stream(self, request: web.Request, resp: web.StreamResponse, at_boundary: bool,
                                 name: str) -> None:
        """Tell the client its stream broke: an SSE error event (vLLM's way) at an event boundary,
        else drop the connection (a half-sent event cannot be completed)."""
        if at_boundary:
            event = b"data: " + error_body(f"instance {name} broke off the stream", "upstream_error",
                                           code="upstream_stream_broken") + b"\n\n"
            try:
                await resp.write(event)
                await resp.write_eof()
                return
            except (ConnectionError, aiohttp.ClientConnectionResetError):
                return
        tr = request.transport
        if tr is not None:
            tr.abort()
