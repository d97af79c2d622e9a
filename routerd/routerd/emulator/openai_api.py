"""The emulator's HTTP API: vLLM's OpenAI-compatible server, reproduced with aiohttp.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` true or
false), ``GET /v1/models``, ``GET /health``, ``GET /version``, ``GET /metrics``,
``POST /reset_prefix_cache`` (vLLM's, a development endpoint there: always served here;
200 with an empty body whether or not the reset happened, as vLLM, which refuses while
requests hold blocks and logs it).

What is vLLM 0.32's, checked against a real server (``tests/conformance`` runs the same tests
against both):

* Response shapes (``vllm/entrypoints/openai/completion/protocol.py``,
  ``chat_completion/protocol.py``): ids ``cmpl-<hex>`` and ``chatcmpl-<hex>``; streamed chunks
  are server-sent events ``data: {json}\\n\\n`` ending with ``data: [DONE]\\n\\n``; one event
  carries every token produced since the previous one (several under load, see
  :mod:`routerd.emulator.engine`); the event carrying the last token has ``finish_reason``
  ``"length"`` (outputs always run to ``max_tokens``, as with vLLM's ``ignore_eos``); chat
  starts with a chunk of its own holding ``delta.role``; with ``stream_options.include_usage`` a
  final chunk has empty ``choices`` and the ``usage``.
* ``return_token_ids`` (vLLM's extension): ``token_ids`` per choice (per chunk when streaming)
  and ``prompt_token_ids`` (in the first completions chunk's choice; top level in chat).
  ``stream_options.continuous_usage_stats`` (with ``include_usage``): every chunk carries the
  running ``usage``.
* ``--enable-prompt-tokens-details``: ``usage.prompt_tokens_details.cached_tokens`` is the
  request's prompt tokens found in the prefix cache (chat adds ``created_cache_tokens``: the
  full prompt blocks it cached anew); without the flag the details are null (left out of a
  streamed usage chunk), as vLLM.
* ``model`` may name the served model or a LoRA adapter of ``--lora-modules`` (the response
  echoes it); ``/v1/models`` lists the adapters with ``root`` (their path) and ``parent``.
* ``cache_salt``: a non-empty string mixed into the request's first block, so salted requests
  share cache only with the same salt.
* ``max_tokens`` larger than the context left is cut to it (``get_max_tokens`` in
  ``vllm/entrypoints/serve/utils/api_utils.py``), not refused; a prompt longer than
  ``max_model_len`` is refused (400, ``param`` ``input_tokens``).
* Errors are vLLM's ``ErrorResponse`` ``{"error": {"message", "type", "param", "code"}}``:
  its own checks as ``BadRequestError`` / ``NotFoundError`` with vLLM's message and
  ``(parameter=..., value=...)`` suffix; a body that is not JSON or a field of the wrong type
  as FastAPI's validation error (``type`` ``"Bad Request"``, ``param`` ``"body.<field>"``, the
  message listing the error in pydantic's words,
  ``vllm/entrypoints/serve/exception_handling/handlers/validation.py``); an unknown route 404
  and a wrong method 405 with Starlette's ``{"detail": "Not Found"}`` /
  ``{"detail": "Method Not Allowed"}``. Never 500 for bad input.

Tokens: without ``--tokenizer`` a prompt's token ids are the byte tokenizer's
(:func:`routerd.prefix.text.byte_token_array`, 4 UTF-8 bytes per token) of its text: a
completions prompt's string, a chat request's :func:`routerd.tokens.chat_prompt_text`; a
completions prompt given as token ids uses them as they are. With ``--tokenizer DIR`` (a Hugging
Face model folder) text is tokenized by its ``tokenizer.json`` and chat messages rendered by its
chat template first (:mod:`routerd.prefix.tokenize`, :mod:`routerd.prefix.chat`), as vLLM does.
Generated text is filler, one short word per token, whose token ids are those words' first byte
token (never a real model's).

Not emulated (answered 400 where a request asks for it): ``n`` > 1, several prompts in one
completions request, logprobs, stop strings and EOS (every output runs to ``max_tokens``).
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
from routerd.prefix.text import byte_token_array, byte_token_ids
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
#: FastAPI's validation errors carry the HTTP reason phrase as their type (vLLM's handler).
VALIDATION_ERROR_TYPE = "Bad Request"
#: vLLM's limit on ``cache_salt`` (``vllm/entrypoints/generate/base/protocol.py``).
MAX_CACHE_SALT_CHARS = 128
_CACHE_SALT_FORBIDDEN = ("@", "/", "\\", "\0")


@dataclass(frozen=True)
class LoraModule:
    """One ``--lora-modules`` entry: a LoRA adapter served under ``name`` (vLLM's ``LoRAModulePath``)."""

    name: str
    """The adapter's model name in requests."""
    path: str
    """Where vLLM would load it from (``root`` in ``/v1/models``; nothing is read here)."""
    base_model_name: str | None = None
    """``parent`` in ``/v1/models``; None: the served model."""


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
    root: str | None = None
    """``root`` of the served model in ``/v1/models`` (vLLM: the ``--model`` path); None: ``model``."""
    lora_modules: tuple[LoraModule, ...] = ()
    """LoRA adapters served besides the model; adapter ``i`` (0-based) has LoRA id ``i + 1``."""
    prompt_tokens_details: bool = False
    """vLLM's ``--enable-prompt-tokens-details``: ``usage.prompt_tokens_details`` in responses."""
    tokenizer: Any = None
    """A :class:`routerd.prefix.tokenize.Tokenizer` (``--tokenizer``); None: the byte tokenizer."""


class ApiError(Exception):
    """A request that gets an OpenAI-style error body instead of a completion."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 detail: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.detail = detail
        """Answer Starlette's ``{"detail": message}`` instead of vLLM's ``ErrorResponse``."""

    def response(self) -> web.Response:
        """The JSON error response (vLLM ``ErrorResponse``, or Starlette's ``{"detail"}``)."""
        if self.detail:
            return web.json_response({"detail": self.message}, status=self.status)
        return error_response(self.status, self.message, self.param, self.type)


def error_response(status: int, message: str, param: str | None = None, type_: str | None = None) -> web.Response:
    """``{"error": {"message", "type", "param", "code"}}`` with HTTP status ``status``."""
    body = {"error": {"message": message, "type": type_ or _ERROR_TYPES.get(status, "BadRequestError"),
                      "param": param, "code": status}}
    return web.json_response(body, status=status)


def vllm_error(message: str, param: str | None = None, value: Any = None, status: int = 400) -> ApiError:
    """vLLM's own ``VLLMValidationError``: the message ends ``(parameter=P, value=V)`` (``vllm/exceptions.py``)."""
    extras = []
    if param is not None:
        extras.append(f"parameter={param}")
    if value is not None:
        extras.append(f"value={value}")
    text = f"{message} ({', '.join(extras)})" if extras else message
    return ApiError(status, text, param)


def _summary(v: Any) -> Any:
    """vLLM's stand-in for an offending value (``_summarize_error_input``): containers described."""
    if isinstance(v, str):
        return v if len(v) <= 200 else v[:200] + "...[truncated]"
    if isinstance(v, (list, tuple, dict)):
        return f"<{type(v).__name__} of {len(v)} items>"
    return str(v)


def invalid(loc: str, kind: str, msg: str, value: Any, ctx: dict | None = None) -> ApiError:
    """FastAPI's ``RequestValidationError`` as vLLM answers it: 400 ``Bad Request``, ``param`` = ``loc``."""
    err: dict[str, Any] = {"type": kind, "loc": loc, "msg": msg, "input": _summary(value)}
    if ctx is not None:
        err["ctx"] = ctx
    return ApiError(400, f"1 validation error:\n  {err}", loc, VALIDATION_ERROR_TYPE)


# -- pydantic's lax coercions of the fields the emulator reads -------------------------------
_BOOLS = {"true": True, "1": True, "yes": True, "on": True, "t": True, "y": True,
          "false": False, "0": False, "no": False, "off": False, "f": False, "n": False}


def _int(body: dict[str, Any], name: str, loc: str | None = None) -> int | None:
    v = body.get(name)
    loc = loc or f"body.{name}"
    if v is None:
        return None
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        if v.is_integer():
            return int(v)
        raise invalid(loc, "int_from_float", "Input should be a valid integer, got a number with a fractional part",
                      v)
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            raise invalid(loc, "int_parsing", "Input should be a valid integer, unable to parse string as an "
                          "integer", v) from None
    raise invalid(loc, "int_type", "Input should be a valid integer", v)


def _bool(body: dict[str, Any], name: str, loc: str | None = None) -> bool | None:
    v = body.get(name)
    loc = loc or f"body.{name}"
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _BOOLS:
        return _BOOLS[v.strip().lower()]
    if isinstance(v, (str, int, float)):
        raise invalid(loc, "bool_parsing", "Input should be a valid boolean, unable to interpret input", v)
    raise invalid(loc, "bool_type", "Input should be a valid boolean", v)


def _str(body: dict[str, Any], name: str) -> str | None:
    v = body.get(name)
    if v is None or isinstance(v, str):
        return v
    raise invalid(f"body.{name}", "string_type", "Input should be a valid string", v)


@dataclass(slots=True)
class _Parsed:
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    """``stream_options.continuous_usage_stats`` (with ``include_usage``): usage in every chunk."""
    model: str
    """The name the response echoes (the served model's or an adapter's)."""
    lora: tuple[str, int] | None
    cache_salt: str | None
    return_token_ids: bool
    ids: np.ndarray | None
    """The prompt's token ids, when the engine caches prefixes or the client asked for them."""


_MAX_TOKEN_ID = (1 << 32) - 1


def _token_ids(x: list) -> bool:
    """True if ``x`` is a non-empty list of token ids (ints, not bools)."""
    return bool(x) and all(isinstance(y, int) and not isinstance(y, bool) for y in x)


def _check_ids(ids: list[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t < 0:
            raise invalid(f"body.prompt.{i}", "greater_than_equal", "Input should be greater than or equal to 0",
                          t, {"ge": 0})
        if t > _MAX_TOKEN_ID:
            raise ApiError(400, f"Token id {t} is out of vocabulary")
    return ids


def _ids_json(ids: Any) -> str:
    return "[" + ",".join(map(str, ids)) + "]"


class _Frames:
    """The server-sent events of one streamed response, built by string joins (not json.dumps)."""

    __slots__ = ("_chat", "_head", "_words", "_word_ids", "_prompt_ids", "_return_ids", "_details", "_first",
                 "_continuous")

    def __init__(self, chat: bool, rid: str, created: int, model_json: str, words: list[str], word_ids: list[str],
                 prompt_ids: str | None, details: bool, continuous_prompt: int | None = None) -> None:
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._chat = chat
        self._head = f'data: {{"id":"{rid}","object":"{obj}","created":{created},"model":{model_json},"choices":'
        self._words = words
        self._word_ids = word_ids
        self._return_ids = prompt_ids is not None
        self._prompt_ids = prompt_ids or "null"
        self._details = details
        self._first = True
        self._continuous = continuous_prompt
        """Prompt tokens when every chunk carries the running usage (``continuous_usage_stats``)."""

    def _running_usage(self, completion: int) -> str:
        p = self._continuous
        if p is None:
            return ""
        tail = ',"completion_tokens_details":null' if self._chat else ""
        return f',"usage":{{"prompt_tokens":{p},"total_tokens":{p + completion},"completion_tokens":{completion}{tail}}}'

    def tokens(self, start: int, end: int, total: int) -> str:
        """One event with tokens ``start .. end-1`` (0-based) of a ``total``-token output (chat's role
        chunk before it when ``start == 0``)."""
        words, nw = self._words, len(self._words)
        # Filler words are ASCII letters and a space: the joined text needs no JSON escaping.
        text = '"' + "".join(words[k % nw] for k in range(start, end)) + '"'
        ids = _ids_json(self._word_ids[k % len(self._word_ids)] for k in range(start, end)) if self._return_ids \
            else "null"
        last = end >= total
        finish = '"length"' if last else "null"
        out = ""
        if self._chat:
            if self._first:
                # vLLM sends the role in a chunk of its own, with the first output.
                out = (self._head + '[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
                       f'"finish_reason":null}}]{self._running_usage(0)},"prompt_token_ids":{self._prompt_ids},'
                       '"prompt_text":null}\n\n')
            out += (self._head + f'[{{"index":0,"delta":{{"content":{text}}},"logprobs":null,"finish_reason":{finish},'
                    + ('"stop_reason":null,' if last else "") + f'"token_ids":{ids}}}]{self._running_usage(end)}}}\n\n')
        else:
            prompt = self._prompt_ids if self._first else "null"
            out = (self._head + f'[{{"index":0,"text":{text},"logprobs":null,"finish_reason":{finish},'
                   f'"stop_reason":null,"prompt_token_ids":{prompt},"token_ids":{ids}}}]'
                   f'{self._running_usage(end)}}}\n\n')
        self._first = False
        return out

    def usage(self, prompt: int, completion: int, cached: int, created_cache: int) -> str:
        """The final ``include_usage`` chunk (empty ``choices``)."""
        u = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}
        if self._details:
            # A streamed usage chunk leaves None fields out (exclude_none in vLLM's serving code).
            u["prompt_tokens_details"] = ({"cached_tokens": cached, "created_cache_tokens": created_cache}
                                          if self._chat else {"cached_tokens": cached})
        return self._head + f'[],"usage":{json.dumps(u, separators=(",", ":"))}}}\n\n'


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
        self._loras = {m.name: (m, i + 1) for i, m in enumerate(settings.lora_modules)}
        words = list(_FILLER)
        random.Random(settings.seed).shuffle(words)
        self._words_plain = [" " + w for w in words]
        self._word_ids = [byte_token_ids(w)[0] for w in self._words_plain]
        self._word_ids_str = [str(i) for i in self._word_ids]
        self._created = int(time.time())

    # -- parsing ------------------------------------------------------------
    async def _body(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        if not raw.strip():
            raise invalid("body", "missing", "Field required", None)
        try:
            body = json.loads(raw)
        except UnicodeDecodeError:
            # vLLM's server reports a body that is not UTF-8 as a JSON error at its first byte.
            raise invalid("body.0", "json_invalid", "JSON decode error", {}, {"error": "Expecting value"}) from None
        except json.JSONDecodeError as e:
            raise invalid(f"body.{e.pos}", "json_invalid", "JSON decode error", {}, {"error": e.msg}) from None
        except (ValueError, RecursionError):  # an integer over 4300 digits; nesting too deep
            # FastAPI's answer to a body its JSON parser raised on other than a decode error.
            raise ApiError(400, "There was an error parsing the body", detail=True) from None
        if not isinstance(body, dict):
            raise invalid("body", "model_attributes_type",
                          "Input should be a valid dictionary or object to extract fields from", body)
        return body

    def _fields(self, body: dict[str, Any], chat: bool) -> tuple[Any, ...]:
        """The typed fields, checked as pydantic checks vLLM's request model (400 ``Bad Request``)."""
        model = _str(body, "model")
        stream = bool(_bool(body, "stream"))
        opts = body.get("stream_options")
        include_usage = continuous = False
        if opts is not None:
            if not isinstance(opts, dict):
                raise invalid("body.stream_options", "model_attributes_type",
                              "Input should be a valid dictionary or object to extract fields from", opts)
            include_usage = bool(_bool(opts, "include_usage", "body.stream_options.include_usage"))
            # vLLM sends the running usage only when both are set (include_continuous_usage).
            continuous = include_usage and bool(_bool(opts, "continuous_usage_stats",
                                                      "body.stream_options.continuous_usage_stats"))
        n = _int(body, "n")
        key = "max_tokens"
        max_tokens = _int(body, "max_tokens")
        if chat:
            mct = _int(body, "max_completion_tokens")
            if mct is not None:
                key, max_tokens = "max_completion_tokens", mct
        return_ids = bool(_bool(body, "return_token_ids"))
        return model, stream, opts, include_usage, continuous, n, key, max_tokens, return_ids

    def _request(self, body: dict[str, Any], chat: bool) -> _Parsed:
        s = self.settings
        model, stream, opts, include_usage, continuous, n, key, max_tokens, return_ids = self._fields(body, chat)
        if chat:
            msgs = body.get("messages")
            if msgs is None:
                raise invalid("body.messages", "missing", "Field required", body)
            if not isinstance(msgs, list):
                raise invalid("body.messages", "list_type", "Input should be a valid list", msgs)
        lora = None
        if model and model != s.model:  # absent or "": the served model, as vLLM
            hit = self._loras.get(model)
            if hit is None:
                raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: {s.model}.", "model")
            lora = (model, hit[1])
        if opts is not None and not stream:
            raise vllm_error("Stream options can only be defined when `stream=True`.", "stream_options")
        salt = body.get("cache_salt")
        if salt is not None:
            if not isinstance(salt, str) or not salt:
                raise vllm_error("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
            if len(salt) > MAX_CACHE_SALT_CHARS or any(c in salt for c in _CACHE_SALT_FORBIDDEN):
                raise vllm_error("Parameter 'cache_salt' must be at most 128 characters and must not contain '@', "
                                 "'/', '\\\\', or NUL.", "cache_salt")
        if n is not None and n != 1:
            raise ApiError(400, f"n must be 1 (the emulator generates one choice per request), got {n}", "n")
        want_ids = return_ids or self.engine.prefix_caching
        if chat:
            count, ids = self._chat_tokens(body, want_ids)
        else:
            count, ids = self._completion_tokens(self._completion_prompt(body), want_ids)
        limit = s.max_model_len
        if count > limit:
            # vLLM's wording (vllm/renderers/params.py, _token_len_check): "at least" when the
            # count is one past the limit (its tokenizer stops there).
            qualifier = "at least " if count == limit + 1 else ""
            raise vllm_error(f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                             f"{qualifier}{count} input tokens, which exceeds this limit even without any output "
                             "tokens. Please reduce the length of the input prompt.", "input_tokens", count)
        # vLLM's get_max_tokens: the request's (or the default) cut to the context left.
        wanted = s.default_max_tokens if max_tokens is None else max_tokens
        max_tokens = min(wanted, limit - count)
        if max_tokens < 1:
            raise vllm_error(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
        return _Parsed(count, max_tokens, stream, include_usage, continuous, model or s.model, lora, salt, return_ids,
                       ids)

    @staticmethod
    def _completion_prompt(body: dict[str, Any]) -> str | list[int]:
        """The prompt as text or token ids (ids checked to lie in 0 .. 2^32 - 1)."""
        p = body.get("prompt")
        if p is None or p == "":
            raise vllm_error("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        if isinstance(p, str):
            return p
        if isinstance(p, list):
            if not p:
                raise ApiError(400, "You must pass at least one prompt")
            if _token_ids(p):
                return _check_ids(p)
            if len(p) == 1:
                x = p[0]
                if isinstance(x, str) and x:
                    return x
                if isinstance(x, list) and _token_ids(x):
                    return _check_ids(x)
            if len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
                raise ApiError(400, f"prompt holds {len(p)} prompts; the emulator serves one prompt per request",
                               "prompt")
        raise invalid("body.prompt", "list_type", "Input should be a valid list", p)

    def _completion_tokens(self, prompt: str | list[int], want_ids: bool) -> tuple[int, np.ndarray | None]:
        """``(prompt tokens, token ids or None)``; the ids only when ``want_ids``."""
        if isinstance(prompt, str):
            tok = self.settings.tokenizer
            if tok is not None:
                try:
                    ids = tok.encode(prompt)  # completions add special tokens (e.g. BOS), as vLLM
                except ValueError as e:
                    raise ApiError(400, str(e), "prompt") from None
                return len(ids), ids
            if want_ids:
                ids = byte_token_array(prompt)
                return len(ids), ids
            return count_text_tokens(prompt), None
        return len(prompt), np.array(prompt, dtype=np.uint32) if want_ids else None

    def _chat_tokens(self, body: dict[str, Any], want_ids: bool) -> tuple[int, np.ndarray | None]:
        """The rendered messages' token count and ids (``--tokenizer``'s chat template, else the
        emulator's ``role: content`` lines, :func:`routerd.tokens.chat_prompt_text`)."""
        msgs = body["messages"]
        if not msgs:
            raise ApiError(400, "Cannot apply chat template to an empty conversation. Provide at least one message.")
        tok = self.settings.tokenizer
        template = getattr(tok, "chat_template", None)
        if template is not None:
            from routerd.prefix.chat import ChatTemplateError, ChatUnsupported

            try:
                text = template.render(msgs, body)
            except (ChatTemplateError, ChatUnsupported) as e:
                raise ApiError(400, str(e)) from None
            except (TypeError, ValueError, KeyError, AttributeError) as e:  # malformed messages
                raise invalid("body.messages", "value_error", f"Value error, {e}", msgs) from None
        else:
            try:
                text = chat_prompt_text(msgs)
            except ValueError as e:
                raise invalid("body.messages", "value_error", f"Value error, {e}", msgs) from None
        if tok is not None:
            try:
                ids = tok.encode(text, add_special_tokens=False)  # the template wrote them
            except ValueError as e:
                raise ApiError(400, str(e), "messages") from None
            return len(ids), ids
        if want_ids:
            ids = byte_token_array(text)
            return len(ids), ids
        return count_text_tokens(text), None

    # -- handlers -----------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions``."""
        try:
            p = self._request(await self._body(request), chat=False)
        except ApiError as e:
            return e.response()
        return await self._generate(request, p, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions``."""
        try:
            p = self._request(await self._body(request), chat=True)
        except ApiError as e:
            return e.response()
        return await self._generate(request, p, chat=True)

    async def _generate(self, request: web.Request, p: _Parsed, chat: bool) -> web.StreamResponse:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        cache_ids = p.ids if self.engine.prefix_caching else None
        s = self.engine.submit(p.prompt_tokens, p.max_tokens, cache_ids, p.lora, p.cache_salt)
        try:
            if p.stream:
                return await self._stream(request, s, p, chat, rid, created)
            await s.wait_done()
            return web.json_response(self._full_body(s, p, chat, rid, created))
        finally:
            # Client gone (the handler was cancelled or a write failed): free the request.
            if not s.done:
                self.engine.abort(s)

    def _created_cache_tokens(self, s: TokenStream) -> int:
        """Prompt tokens of the full blocks this request cached anew (vLLM's ``created_cache_tokens``,
        ``PrefillStats.finalize`` in ``vllm/v1/metrics/stats.py``); 0 without a prefix cache."""
        if not self.engine.prefix_caching:
            return 0
        bs = self.engine.block_size
        return max(0, s.prompt_tokens // bs * bs - s.cached_tokens)

    async def _stream(self, request: web.Request, s: TokenStream, p: _Parsed, chat: bool, rid: str,
                      created: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        chunked = request.version >= HttpVersion11
        if chunked:
            resp.enable_chunked_encoding()
        await resp.prepare(request)  # a StreamResponse sends its headers here
        prompt_ids = _ids_json(p.ids.tolist()) if p.return_token_ids and p.ids is not None else None
        frames = _Frames(chat, rid, created, json.dumps(p.model), self._words_plain, self._word_ids_str,
                         prompt_ids, self.settings.prompt_tokens_details,
                         p.prompt_tokens if p.continuous_usage else None)
        total = p.max_tokens
        sent = 0
        transport = request.transport

        def tail() -> str:
            usage = frames.usage(p.prompt_tokens, total, s.cached_tokens, self._created_cache_tokens(s)) \
                if p.include_usage else ""
            return usage + "data: [DONE]\n\n"

        if chunked and transport is not None:
            # Tokens go straight from the engine to the socket as HTTP chunks, everything
            # produced since the last write in one event; the handler only wakes at the end
            # for the usage chunk and [DONE].
            def sink(n: int) -> None:
                nonlocal sent
                if n <= sent:
                    return
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
                await resp.write(tail().encode())
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
                        data += tail()
                    await resp.write(data.encode())
            await resp.write_eof()
        except ConnectionError:
            pass  # the client went away mid-stream; the caller aborts the request
        return resp

    def _full_body(self, s: TokenStream, p: _Parsed, chat: bool, rid: str, created: int) -> dict[str, Any]:
        words = self._words_plain
        nw = len(words)
        text = "".join(words[k % nw] for k in range(s.generated))
        usage: dict[str, Any] = {"prompt_tokens": s.prompt_tokens, "total_tokens": s.prompt_tokens + s.generated,
                                 "completion_tokens": s.generated, "prompt_tokens_details": None}
        if self.settings.prompt_tokens_details:
            usage["prompt_tokens_details"] = {
                "cached_tokens": s.cached_tokens,
                "created_cache_tokens": self._created_cache_tokens(s) if chat else None,
                "multimodal_tokens": None}
        token_ids = prompt_ids = None
        if p.return_token_ids:
            token_ids = [self._word_ids[k % nw] for k in range(s.generated)]
            prompt_ids = p.ids.tolist() if p.ids is not None else None
        if chat:
            return {"id": rid, "object": "chat.completion", "created": created, "model": p.model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "logprobs": None, "finish_reason": "length", "stop_reason": None,
                                 "token_ids": token_ids}],
                    "usage": usage, "prompt_token_ids": prompt_ids}
        return {"id": rid, "object": "text_completion", "created": created, "model": p.model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                             "stop_reason": None, "token_ids": token_ids, "prompt_logprobs": None,
                             "prompt_token_ids": prompt_ids}],
                "usage": usage}

    def _card(self, id_: str, root: str, parent: str | None, max_model_len: int | None) -> dict[str, Any]:
        """One ``/v1/models`` entry (vLLM's ``ModelCard`` with its ``ModelPermission``)."""
        perm = {"id": f"modelperm-{uuid.uuid4().hex[:16]}", "object": "model_permission", "created": self._created,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
                "group": None, "is_blocking": False}
        return {"id": id_, "object": "model", "created": self._created, "owned_by": "vllm", "root": root,
                "parent": parent, "max_model_len": max_model_len, "permission": [perm]}

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: the served model (with ``max_model_len``), then each LoRA adapter
        (``root`` its path, ``parent`` its base model, ``max_model_len`` null), as vLLM."""
        s = self.settings
        data = [self._card(s.model, s.root or s.model, None, s.max_model_len)]
        data += [self._card(m.name, m.path, m.base_model_name or s.model, None) for m in s.lora_modules]
        return web.json_response({"object": "list", "data": data})

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


#: Starlette's bodies for routing errors (vLLM's server does not wrap them in ``ErrorResponse``).
_DETAIL = {404: "Not Found", 405: "Method Not Allowed"}


@web.middleware
async def _json_errors(request: web.Request, handler):
    """Unknown routes and wrong methods get Starlette's ``{"detail"}`` body, oversized bodies and
    request errors the API's error body."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        if e.status in _DETAIL:
            headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
            return web.json_response({"detail": _DETAIL[e.status]}, status=e.status, headers=headers)
        return error_response(e.status, e.reason, None)
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
    # GET only, as vLLM (its routes answer HEAD with 405).
    app.router.add_get("/v1/models", h.models, allow_head=False)
    app.router.add_get("/health", h.health, allow_head=False)
    app.router.add_get("/version", h.version, allow_head=False)
    app.router.add_get("/metrics", h.metrics_page)  # HEAD too: vLLM mounts the Prometheus app there
    app.router.add_post("/reset_prefix_cache", h.reset_prefix_cache)

    async def _close(_app: web.Application) -> None:
        engine.close()

    app.on_cleanup.append(_close)
    return app
