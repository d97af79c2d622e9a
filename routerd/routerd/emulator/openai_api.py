"""The emulator's HTTP API: vLLM's OpenAI-compatible server, reproduced with aiohttp.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` true or
false), ``GET /v1/models``, ``GET /health``, ``GET /version``, ``GET /metrics``,
``POST /reset_prefix_cache`` (vLLM's, a development endpoint there: always served here;
200 with an empty body whether or not the reset happened, as vLLM, which refuses while
requests hold blocks and logs it).

Response shapes follow vLLM's ``vllm/entrypoints/openai/protocol.py``: completion
ids ``cmpl-<hex>`` and ``chatcmpl-<hex>``; streamed chunks are server-sent events
``data: {json}\\n\\n`` ending with ``data: [DONE]\\n\\n``; the chunk carrying the
last token has ``finish_reason`` ``"length"`` (outputs always run to ``max_tokens``,
as with vLLM's ``ignore_eos``); with ``stream_options.include_usage`` a final chunk
has empty ``choices`` and the ``usage``. Errors are vLLM's ``ErrorResponse``:
``{"error": {"message", "type", "param", "code"}}`` with status 400 (bad request,
prompt too long), 404 (unknown model or route), 405 or 413; never 500 for bad input.

Prompt tokens are counted with :mod:`routerd.tokens` (the estimate routerd uses), and a
prompt's token ids are the byte tokenizer's (:func:`routerd.prefix.text.byte_token_array`,
4 UTF-8 bytes per token, ``len`` = that count) of its text: a completions prompt's string, a
chat request's :func:`routerd.tokens.chat_prompt_text`; a completions prompt given as token
ids uses them as they are. Equal prompts thus have equal tokens, and prefix caching hits.
Generated text is filler, one short word per token.
"""

from __future__ import annotations

import json
import logging
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiohttp import HttpVersion11, web

from routerd.emulator.engine import Engine, TokenStream
from routerd.emulator.metrics import CONTENT_TYPE, EmulatorMetrics
from routerd.prefix.text import byte_token_array
from routerd.tokens import chat_prompt_text, count_text_tokens

log = logging.getLogger(__name__)

#: Largest request body accepted (bytes). vLLM's server has no limit; prompts far
#: beyond any context length must still get the context-length 400, not a 413.
MAX_BODY_BYTES = 64 * 1024 * 1024

_FILLER = ("the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be",
           "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have",
           "an", "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there")

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError",
                413: "RequestEntityTooLargeError", 500: "InternalServerError"}


@dataclass(frozen=True)
class ApiSettings:
    """What the HTTP layer needs to know about the served model."""

    model: str
    """Served model name (``model`` in requests and responses)."""
    max_model_len: int
    """Longest prompt + output (tokens)."""
    default_max_tokens: int
    """Output length when a request gives no ``max_tokens`` (clipped to the context left)."""
    seed: int = 0
    """Seeds the filler text."""


class ApiError(Exception):
    """A request that gets an OpenAI-style error body instead of a completion."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def response(self) -> web.Response:
        """The JSON error response (vLLM ``ErrorResponse``)."""
        return error_response(self.status, self.message, self.param)


def error_response(status: int, message: str, param: str | None = None) -> web.Response:
    """``{"error": {"message", "type", "param", "code"}}`` with HTTP status ``status``."""
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "BadRequestError"),
                      "param": param, "code": status}}
    return web.json_response(body, status=status)


@dataclass(slots=True)
class _Parsed:
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool


_MAX_TOKEN_ID = (1 << 32) - 1


def _token_ids(x: list) -> bool:
    """True if ``x`` is a non-empty list of token ids (ints, not bools)."""
    return bool(x) and all(isinstance(y, int) and not isinstance(y, bool) for y in x)


def _check_ids(ids: list[int]) -> list[int]:
    if min(ids) < 0 or max(ids) > _MAX_TOKEN_ID:
        raise ApiError(400, f"prompt token ids must lie in 0 .. {_MAX_TOKEN_ID}", "prompt")
    return ids


class _Frames:
    """Pre-encoded server-sent-event frames of one streamed response (built by string joins, not json.dumps)."""

    __slots__ = ("_head", "_mid", "_last", "_words", "_first_head", "_obj", "_rid", "_created", "_model")

    def __init__(self, chat: bool, rid: str, created: int, model_json: str, words: list[str]) -> None:
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._obj, self._rid, self._created, self._model = obj, rid, created, model_json
        head = f'data: {{"id":"{rid}","object":"{obj}","created":{created},"model":{model_json},"choices":[{{"index":0,'
        if chat:
            self._head = head + '"delta":{"content":'
            # vLLM sends the role in a chunk of its own, with the first output.
            self._first_head = (head + '"delta":{"role":"assistant","content":""},"logprobs":null,'
                                '"finish_reason":null}]}\n\n' + self._head)
            self._mid = '},"logprobs":null,"finish_reason":null}]}\n\n'
            self._last = '},"logprobs":null,"finish_reason":"length"}]}\n\n'
        else:
            self._head = self._first_head = head + '"text":'
            self._mid = ',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
            self._last = ',"logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n'
        self._words = words

    def tokens(self, start: int, end: int, total: int) -> str:
        """Frames of tokens ``start .. end-1`` (0-based) of a ``total``-token output."""
        words = self._words
        nw = len(words)
        parts = []
        for k in range(start, end):
            head = self._first_head if k == 0 else self._head
            parts.append(head + words[k % nw] + (self._last if k == total - 1 else self._mid))
        return "".join(parts)

    def usage(self, prompt: int, completion: int) -> str:
        """The final ``include_usage`` chunk (empty ``choices``)."""
        return (f'data: {{"id":"{self._rid}","object":"{self._obj}","created":{self._created},'
                f'"model":{self._model},"choices":[],"usage":{json.dumps(_usage(prompt, completion))}}}\n\n')


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}


ENGINE_KEY: web.AppKey[Engine] = web.AppKey("engine", Engine)  # type: ignore[type-abstract]
METRICS_KEY: web.AppKey[EmulatorMetrics] = web.AppKey("metrics", EmulatorMetrics)
SETTINGS_KEY: web.AppKey[ApiSettings] = web.AppKey("settings", ApiSettings)


class OpenAIHandlers:
    """Request handlers bound to one engine, its metrics and the served model's settings."""

    def __init__(self, engine: Engine, metrics: EmulatorMetrics, settings: ApiSettings) -> None:
        self.engine = engine
        self.metrics = metrics
        self.settings = settings
        self._model_json = json.dumps(settings.model)
        words = list(_FILLER)
        random.Random(settings.seed).shuffle(words)
        self._words_plain = [" " + w for w in words]
        self._words_json = [json.dumps(w) for w in self._words_plain]
        self._created = int(time.time())

    # -- parsing ------------------------------------------------------------
    async def _body(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except UnicodeDecodeError:
            raise ApiError(400, "request body is not UTF-8 text") from None
        except json.JSONDecodeError as e:
            raise ApiError(400, f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") \
                from None
        except (ValueError, RecursionError) as e:  # an integer over 4300 digits; nesting too deep
            raise ApiError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        return body

    def _common(self, body: dict[str, Any], prompt_tokens: int, chat: bool) -> _Parsed:
        s = self.settings
        model = body.get("model")
        if model is not None and model != s.model:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")
        stream = body.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise ApiError(400, "stream must be a boolean", "stream")
        opts = body.get("stream_options")
        include_usage = False
        if opts is not None:
            if not isinstance(opts, dict):
                raise ApiError(400, "stream_options must be an object", "stream_options")
            if not stream:
                raise ApiError(400, "Stream options can only be defined when `stream=True`.", "stream_options")
            include_usage = opts.get("include_usage", False)
            if not isinstance(include_usage, bool):
                raise ApiError(400, "stream_options.include_usage must be a boolean", "stream_options")
        n = body.get("n", 1)
        if n is not None and (isinstance(n, bool) or n != 1):
            raise ApiError(400, f"n must be 1 (the emulator generates one choice per request), got {n!r}", "n")
        key = "max_tokens"
        max_tokens = body.get("max_tokens")
        if chat and body.get("max_completion_tokens") is not None:
            key, max_tokens = "max_completion_tokens", body["max_completion_tokens"]
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)):
            raise ApiError(400, f"{key} must be an integer, got {max_tokens!r}", key)
        if max_tokens is not None and max_tokens < 1:
            raise ApiError(400, f"{key} must be at least 1, got {max_tokens}.", key)
        limit = s.max_model_len
        if prompt_tokens >= limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, your request "
                                f"has {prompt_tokens} input tokens. Please reduce the length of the input.",
                           "messages" if chat else "prompt")
        if max_tokens is None:
            max_tokens = min(s.default_max_tokens, limit - prompt_tokens)
        elif prompt_tokens + max_tokens > limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
                                f"{'messages' if chat else 'prompt'}, {max_tokens} in the completion). Please "
                                "reduce the length of the input or completion.", key)
        return _Parsed(prompt_tokens, max_tokens, stream, include_usage)

    @staticmethod
    def _completion_prompt(body: dict[str, Any]) -> str | list[int]:
        """The prompt as text or token ids (ids checked to lie in 0 .. 2^32 - 1)."""
        if "prompt" not in body or body["prompt"] is None:
            raise ApiError(400, "prompt is required", "prompt")
        p = body["prompt"]
        if isinstance(p, str):
            return p
        if isinstance(p, list) and p:
            if _token_ids(p):
                return _check_ids(p)
            if len(p) == 1:
                x = p[0]
                if isinstance(x, str):
                    return x
                if isinstance(x, list) and _token_ids(x):
                    return _check_ids(x)
            if all(isinstance(x, (str, list)) for x in p):
                raise ApiError(400, f"prompt holds {len(p)} prompts; the emulator serves one prompt per request",
                               "prompt")
        raise ApiError(400, "prompt must be a string, a list of token ids, or a one-element list of either",
                       "prompt")

    @staticmethod
    def _chat_prompt(body: dict[str, Any]) -> str:
        """The rendered messages (the emulator's chat template, :func:`routerd.tokens.chat_prompt_text`)."""
        msgs = body.get("messages")
        if msgs is None:
            raise ApiError(400, "messages is required", "messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "messages must be a non-empty list of messages", "messages")
        try:
            return chat_prompt_text(msgs)
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None

    def _tokens(self, prompt: str | list[int]) -> tuple[int, np.ndarray | None]:
        """``(prompt tokens, token ids or None)``; the ids only when the engine caches prefixes."""
        if isinstance(prompt, str):
            if self.engine.prefix_caching:
                ids = byte_token_array(prompt)
                return len(ids), ids
            return count_text_tokens(prompt), None
        return len(prompt), np.array(prompt, dtype=np.uint32) if self.engine.prefix_caching else None

    # -- handlers -----------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions``."""
        try:
            body = await self._body(request)
            n, ids = self._tokens(self._completion_prompt(body))
            p = self._common(body, n, chat=False)
        except ApiError as e:
            return e.response()
        return await self._generate(request, p, chat=False, tokens=ids)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions``."""
        try:
            body = await self._body(request)
            n, ids = self._tokens(self._chat_prompt(body))
            p = self._common(body, n, chat=True)
        except ApiError as e:
            return e.response()
        return await self._generate(request, p, chat=True, tokens=ids)

    async def _generate(self, request: web.Request, p: _Parsed, chat: bool,
                        tokens: np.ndarray | None = None) -> web.StreamResponse:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        s = self.engine.submit(p.prompt_tokens, p.max_tokens, tokens)
        try:
            if p.stream:
                return await self._stream(request, s, p, chat, rid, created)
            await s.wait_done()
            return web.json_response(self._full_body(s, chat, rid, created))
        finally:
            # Client gone (the handler was cancelled or a write failed): free the request.
            if not s.done:
                self.engine.abort(s)

    async def _stream(self, request: web.Request, s: TokenStream, p: _Parsed, chat: bool, rid: str,
                      created: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        chunked = request.version >= HttpVersion11
        if chunked:
            resp.enable_chunked_encoding()
        await resp.prepare(request)  # a StreamResponse sends its headers here
        frames = _Frames(chat, rid, created, self._model_json, self._words_json)
        total = p.max_tokens
        sent = 0
        transport = request.transport
        if chunked and transport is not None:
            # Tokens go straight from the engine's timer to the socket as HTTP chunks;
            # the handler only wakes at the end for the usage chunk and [DONE].
            def sink(n: int) -> None:
                nonlocal sent
                data = frames.tokens(sent, n, total).encode()
                sent = n
                if transport.is_closing():
                    s.sink = None  # the client is gone; the handler is being cancelled
                    return
                transport.write(b"%x\r\n%s\r\n" % (len(data), data))

            s.sink = sink
            try:
                await s.wait_done()
                if sent < total:
                    return resp
                tail = frames.usage(p.prompt_tokens, total) if p.include_usage else ""
                await resp.write((tail + "data: [DONE]\n\n").encode())
                await resp.write_eof()
            except ConnectionError:
                pass  # the client went away at the very end
            finally:
                s.sink = None
            return resp
        try:
            while sent < total:
                n = await s.wait(sent)
                if s.aborted:
                    break
                if n > sent:
                    data = frames.tokens(sent, n, total)
                    sent = n
                    if sent >= total:
                        if p.include_usage:
                            data += frames.usage(p.prompt_tokens, total)
                        data += "data: [DONE]\n\n"
                    await resp.write(data.encode())
            await resp.write_eof()
        except ConnectionError:
            pass  # the client went away mid-stream; the caller aborts the request
        return resp

    def _full_body(self, s: TokenStream, chat: bool, rid: str, created: int) -> dict[str, Any]:
        words = self._words_plain
        nw = len(words)
        text = "".join(words[k % nw] for k in range(s.generated))
        usage = _usage(s.prompt_tokens, s.generated)
        if chat:
            return {"id": rid, "object": "chat.completion", "created": created, "model": self.settings.model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "logprobs": None, "finish_reason": "length", "stop_reason": None}],
                    "usage": usage}
        return {"id": rid, "object": "text_completion", "created": created, "model": self.settings.model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                             "stop_reason": None}],
                "usage": usage}

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: the served model, with vLLM's ``max_model_len`` field."""
        m = self.settings.model
        return web.json_response({"object": "list", "data": [
            {"id": m, "object": "model", "created": self._created, "owned_by": "vllm", "root": m,
             "parent": None, "max_model_len": self.settings.max_model_len}]})

    async def health(self, request: web.Request) -> web.Response:
        """``GET /health``: 200 with an empty body once serving (as vLLM)."""
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        """``GET /version``."""
        from routerd import __version__

        return web.json_response({"version": f"phasewise-emulator {__version__}"})

    async def metrics_page(self, request: web.Request) -> web.Response:
        """``GET /metrics``: Prometheus text exposition, vLLM V1 names."""
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """``POST /reset_prefix_cache[?reset_running_requests=false&reset_external=false]``.

        vLLM (``vllm/entrypoints/serve/cache/api_router.py``) answers 200 with an empty body
        without checking that the reset happened; the engine refuses while any block is in use
        and logs a warning. ``reset_external`` is accepted (no connector cache here);
        ``reset_running_requests=true`` (preempt everything first) is not emulated: 400.
        """
        q = request.query
        flags = {}
        for name in ("reset_running_requests", "reset_external"):
            raw = q.get(name, "false").strip().lower()
            if raw not in _BOOLS:
                raise ApiError(400, f"{name} must be a boolean, got {q.get(name)!r}", name)
            flags[name] = _BOOLS[raw]
        if flags["reset_running_requests"]:
            raise ApiError(400, "reset_running_requests=true is not supported by the emulator",
                           "reset_running_requests")
        log.info("Resetting prefix cache...")
        if not self.engine.reset_prefix_cache():
            log.warning("Failed to reset prefix cache because some blocks are not freed yet")
        return web.Response(status=200)


_BOOLS = {"true": True, "1": True, "yes": True, "on": True, "t": True, "y": True,
          "false": False, "0": False, "no": False, "off": False, "f": False, "n": False}


@web.middleware
async def _json_errors(request: web.Request, handler):
    """Unknown routes, wrong methods and oversized bodies get the JSON error body too."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(e.status, e.reason if e.status != 404 else f"no route {request.method} "
                              f"{request.path}", None)
    except ApiError as e:
        return e.response()
    except Exception:
        # A bug, not bad input: log it once, answer in the API's error shape.
        log.exception("unexpected error handling %s %s", request.method, request.path)
        return error_response(500, "internal error in the emulator")


def build_app(engine: Engine, metrics: EmulatorMetrics, settings: ApiSettings) -> web.Application:
    """The aiohttp application serving ``engine`` (the engine's timer is cancelled on cleanup)."""
    h = OpenAIHandlers(engine, metrics, settings)
    app = web.Application(middlewares=[_json_errors], client_max_size=MAX_BODY_BYTES)
    app[ENGINE_KEY] = engine
    app[METRICS_KEY] = metrics
    app[SETTINGS_KEY] = settings
    app.router.add_post("/v1/completions", h.completions)
    app.router.add_post("/v1/chat/completions", h.chat_completions)
    app.router.add_get("/v1/models", h.models)
    app.router.add_get("/health", h.health)
    app.router.add_get("/version", h.version)
    app.router.add_get("/metrics", h.metrics_page)
    app.router.add_post("/reset_prefix_cache", h.reset_prefix_cache)

    async def _close(_app: web.Application) -> None:
        engine.close()

    app.on_cleanup.append(_close)
    return app
