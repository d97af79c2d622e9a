"""The OpenAI-compatible HTTP front of routerd (aiohttp) and the relay to the instances.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` true or
false), ``GET /v1/models``, ``GET /metrics``, ``/healthz``, ``/readyz``. Errors use the
OpenAI shape ``{"error": {"message", "type", "param", "code"}}``: 400 malformed JSON or a
missing field, 404 unknown model or route, 413 body over ``max_body_bytes``, 429 router
queue full, 502/504 upstream failure or timeout, 503 no ready endpoint or draining
(with ``x-phasewise-reject-reason``), never 500.

The request body is forwarded unchanged, but for one thing: a streamed request whose client did
not ask for the final ``usage`` event (``stream_options.include_usage``) asks vLLM for it
(:func:`with_usage`), and that event is taken out of what the client receives
(:class:`_UsageStrip`), so the client gets the stream vLLM sends without it. A streamed answer
is relayed chunk by chunk as it arrives; while it runs, each SSE event counts as one generated
token (complete ``\\n\\n``-terminated events, counted with bytes operations even when an event
is split across network chunks): fewer than vLLM sent when it put several tokens in one event,
as it does whenever its API server falls behind. At the end the usage event's
``completion_tokens`` gives the exact count (events, less ``[DONE]`` and a chat stream's role
chunk, only from a server that sends no usage). A non-streamed answer gives
``usage.completion_tokens``.

A stream is complete only with vLLM's terminal ``data: [DONE]`` event: one that breaks off (the
engine killed, a reset, a stall) or ends without it is counted in
``phasewise_streams_broken_total{endpoint,reason}`` and as a 502, never as a completion, marks the
endpoint for passive health, and ends with an SSE error event ``data: {"error": {...}}`` and no
``[DONE]`` (the ``openai`` client raises ``openai.APIError`` for it), or with the connection cut
when the break fell inside an event.

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

from routerd.daemon.models import merge_cards, parse_model_cards
from routerd.daemon.prefix import PrefixInput
from routerd.daemon.router import RejectedError, shown_name
from routerd.daemon.upstream import Exchange, UpstreamError, UpstreamPool, UpstreamTimeout
from routerd.epp.names import CACHED_TOKENS_HEADER, ENDPOINT_HEADER
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


#: How a stream that ended without vLLM's terminal event is described (log, the client's error event).
NO_DONE = "ended the stream without its last event (data: [DONE])"


def broken_stream_event(name: str, why: str = "broke off the stream") -> bytes:
    """The SSE event that tells a client its stream from instance ``name`` broke: an OpenAI error
    object as a data event, as vLLM sends an error mid-stream (``data: {"error": {...}}``;
    ``vllm/entrypoints/openai/completion/serving.py``), code ``upstream_stream_broken``."""
    return b"data: " + error_body(f"instance {name} {why}", "upstream_error", code="upstream_stream_broken") + b"\n\n"


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


def prompt_of(kind: str, payload: dict) -> tuple[int, str | None, PrefixInput]:
    """(estimated prompt tokens, prompt text for the predictor or None, what the prompt's prefix
    is computed from) of a request body.

    The prefix input (:class:`routerd.daemon.prefix.PrefixInput`, read by
    :meth:`routerd.daemon.prefix.PrefixIdentity.blocks_for`) holds a chat request's messages and
    template options (and their :func:`routerd.tokens.chat_prompt_text` rendering), a
    completions prompt string, or its token ids; of a batch (a list of several prompts) the first
    prompt, which the policies score and index for the whole batch (batched prompts share a
    template more often than not; the others are cached where the batch goes too); and the
    request's ``model`` and ``cache_salt``, which vLLM salts block hashes with.

    Raises:
        BadRequest: ``prompt`` / ``messages`` missing or of the wrong type.
    """
    model = payload.get("model") if isinstance(payload.get("model"), str) else None
    salt = payload.get("cache_salt")
    salt = salt if isinstance(salt, str) and salt else None
    if kind == "chat":
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty array of message objects", "messages")
        try:
            text = chat_prompt_text(messages)
        except ValueError as e:
            raise BadRequest(str(e), "messages") from None
        return count_text_tokens(text), text, PrefixInput(messages=messages, request=payload, chat_text=text,
                                                          model=model, cache_salt=salt)
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return count_text_tokens(prompt), prompt, PrefixInput(prompt, model=model, cache_salt=salt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return (sum(count_text_tokens(p) for p in prompt), "\n".join(prompt),
                    PrefixInput(prompt[0], model=model, cache_salt=salt))
        if all(type(p) is int for p in prompt):
            return len(prompt), None, PrefixInput(prompt, model=model, cache_salt=salt)
        if all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in prompt):
            return sum(len(p) for p in prompt), None, PrefixInput(prompt[0], model=model, cache_salt=salt)
    raise BadRequest("'prompt' must be a string, an array of strings, or an array of token ids", "prompt")


def parse_request(kind: str, body: bytes) -> tuple[dict, bool, int, str | None, PrefixInput]:
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


#: The response headers routerd (and the picker) add to every routed answer (``routerd.epp.names``):
#: the endpoint that served it, and routerd's estimate of the prompt tokens that endpoint had cached
#: (absent while prefix scoring is off). An upstream's own headers of these names are dropped.
_ROUTING_HEADERS = frozenset((ENDPOINT_HEADER, CACHED_TOKENS_HEADER))


def routing_headers(r: Any, ep: Any) -> list[tuple[str, str]]:
    """``x-phasewise-endpoint`` (``ep``'s name) and, when ``r`` had a prefix (prefix scoring on),
    ``x-phasewise-cached-tokens``: the prompt tokens routerd believed ``ep`` cached at dispatch
    (``Inflight.cached_tokens``: from the engine's KV events in precise mode, in whole engine
    blocks below the last prompt token as vLLM counts ``usage.prompt_tokens_details.cached_tokens``;
    from the policy's approximate index otherwise)."""
    out = [(ENDPOINT_HEADER, ep.name)]
    if r is not None and r.features is not None and r.features.prefix is not None:
        out.append((CACHED_TOKENS_HEADER, str(int(r.cached_tokens))))
    return out


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


def ends_with_done(tail: bytes) -> bool:
    """Whether an SSE stream whose last bytes are ``tail`` ended with vLLM's terminal event: its last
    non-blank line is ``data: [DONE]`` (or ``data:[DONE]``). vLLM ends every stream so, after the
    usage event when asked and after an error event (``vllm/entrypoints/openai/completion/serving.py``,
    ``completion_stream_generator``; ``chat_completion/serving.py`` likewise)."""
    t = tail.rstrip(b"\r\n\t ")
    line = t[max(t.rfind(b"\n"), t.rfind(b"\r")) + 1:]
    return line == b"data: [DONE]" or line == b"data:[DONE]"


def stream_tokens(tail: bytes, events: int, chat: bool) -> int:
    """Output tokens of an SSE stream relayed to its end: the final usage event's
    ``completion_tokens`` if ``tail`` (the stream's last bytes) has one, else ``events`` (SSE
    events counted) less ``[DONE]`` and, for ``chat``, the role-only first chunk vLLM sends."""
    tokens = final_usage_tokens(tail)
    if tokens is None:
        tokens = max(0, events - (1 if _DONE in tail else 0) - (1 if chat else 0))
    return tokens


# -- usage for every stream ---------------------------------------------------------------
#
# vLLM sends one SSE event for several tokens whenever its API server falls behind the engine
# (``RequestOutputCollector`` merges the outputs waiting: a 64-token stream came as 31-63 events,
# shared/docs/real-vllm.md), so counting events undercounts. routerd therefore asks vLLM for the
# final usage event of every stream (``stream_options.include_usage``) and, when the client did
# not ask for it, takes that event out of what the client receives (:class:`_UsageStrip`).

_ASK_USAGE = b'"stream_options":{"include_usage":true},'
#: pydantic's lax reading of a string as a bool (vLLM's ``StreamOptions`` fields are ``bool | None``),
#: lower-cased; any other string is refused (vLLM answers 400).
_LAX_TRUE = frozenset(("1", "on", "t", "true", "y", "yes"))
_LAX_FALSE = frozenset(("0", "off", "f", "false", "n", "no"))
_INVALID = object()


def _lax_bool(v: Any) -> Any:
    """True / False / None as pydantic (lax mode) reads ``v`` into a ``bool | None`` field, or
    ``_INVALID`` for a value it refuses (measured with pydantic 2: 0/1 and 0.0/1.0 are booleans,
    strings case-insensitively as in ``_LAX_TRUE``/``_LAX_FALSE``, ``" true"`` and 2 are refused)."""
    if v is None or v is True or v is False:
        return v
    if type(v) in (int, float) and v in (0, 1):
        return bool(v)
    if isinstance(v, str):
        low = v.lower()
        if low in _LAX_TRUE:
            return True
        if low in _LAX_FALSE:
            return False
    return _INVALID


def with_usage(body: bytes, payload: dict) -> bytes | None:
    """The body to send upstream so that vLLM ends the stream with its usage event, for a streamed
    request (``body``, parsed as ``payload``) whose client did not ask for it; None when the body
    goes as it is: the client asked (``stream_options.include_usage`` true), or its
    ``stream_options`` is one vLLM refuses anyway (not an object, a field not a boolean).

    vLLM sends the usage event when ``bool(stream_options.include_usage)``, and the running usage in
    every chunk only when ``continuous_usage_stats`` is set too (``should_include_usage`` in
    ``vllm/entrypoints/serve/utils/api_utils.py``). Without ``stream_options`` the option goes in
    after the object's opening brace, the client's bytes otherwise untouched (one copy of the
    body, no re-serialization of a large prompt; the object has a ``model`` member, so a member
    follows the inserted one). With ``stream_options`` present (null, or without ``include_usage``
    true), or a body not in UTF-8 (``json.loads`` also reads UTF-16 and UTF-32), the payload is
    serialized again with ``include_usage`` true (and ``continuous_usage_stats``, if set, false: the
    client gets no usage from vLLM, so none may appear in its chunks)."""
    if "stream_options" not in payload:
        i = 3 if body.startswith(b"\xef\xbb\xbf") else 0
        n = len(body)
        while i < n and body[i] in b" \t\r\n":
            i += 1
        if i + 1 < n and body[i] == 0x7B and body[i + 1] != 0:  # '{', then not UTF-16/32's NUL
            return body[:i + 1] + _ASK_USAGE + body[i + 1:]
        options: dict = {"include_usage": True}
    else:
        so = payload["stream_options"]
        if so is None:
            options = {"include_usage": True}
        elif isinstance(so, dict):
            asked = _lax_bool(so.get("include_usage"))
            continuous = _lax_bool(so.get("continuous_usage_stats"))
            if asked is True or asked is _INVALID or continuous is _INVALID:
                return None
            options = {**so, "include_usage": True}
            if continuous:
                options["continuous_usage_stats"] = False
        else:
            return None
    return json.dumps({**payload, "stream_options": options}).encode()


def choices_of(kind: str, payload: dict) -> int:
    """How many choices a request's stream carries: ``n`` per prompt, times the prompts of a
    completions batch (a list of strings or of token-id lists)."""
    n = payload.get("n")
    n = n if type(n) is int and n > 1 else 1
    prompt = payload.get("prompt") if kind == "completions" else None
    if isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
        n *= len(prompt)
    return n


#: A vLLM chunk that ends a choice (``"finish_reason":null`` on the others; compact JSON, as
#: pydantic's ``model_dump_json`` writes it).
_FINISHED = b'"finish_reason":"'
_NOT_FINISHED = b'"finish_reason":null'
_USAGE_KEY = b'"usage"'
_FINGERPRINT_KEY = b'"system_fingerprint"'
_FINGERPRINT = re.compile(rb'"system_fingerprint"\s*:\s*("(?:[^"\\]|\\.)*")')
# A blank line: two line endings, each CRLF, LF or CR (the SSE specification); a CR is an ending
# of its own only when no LF follows it.
_BLANK_LINE = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?!\n)|\n)")
_UNKNOWN = object()


def _event_data(ev: bytes) -> bytes | None:
    """The data of an SSE event that is one ``data:`` line (vLLM's every event), else None."""
    s = ev.strip()
    if not s.startswith(b"data:") or b"\n" in s or b"\r" in s:
        return None
    return s[5:].strip()


class _UsageStrip:
    """Takes vLLM's usage-only final event (``"choices":[]`` with ``usage``, just before
    ``data: [DONE]``) out of a stream whose client did not ask for it, so that the client gets the
    stream vLLM sends without ``include_usage`` (``vllm/entrypoints/openai/completion/serving.py``,
    ``chat_completion/serving.py``, vLLM 0.32).

    One more difference is put right: vLLM stamps ``system_fingerprint`` on each choice's last
    chunk (the one with ``finish_reason`` set) when no usage event follows, and on the usage event
    instead when one does. So each such chunk gets the fingerprint of the usage event, as the last
    member of its object (its place in vLLM's chunk models). A stream of one choice holds its last
    chunk until the usage event, which vLLM writes right after it; a stream of several choices
    (``n`` > 1, a completions batch), whose choices end at different times, gets the fingerprint
    the endpoint's previous usage event had (``fingerprints``) at once, and holds from its first
    finished choice to the usage event only while the endpoint's fingerprint is unknown.

    :meth:`feed` takes the upstream bytes that :class:`_StreamRelay` does not pass straight on
    and returns those to write: whole events only, an event split across reads being held until
    its end, so an event is written, changed or dropped whole.
    """

    __slots__ = ("buf", "held", "watch", "busy", "stamp", "fingerprints", "key", "same_end")

    def __init__(self, fingerprints: dict[str, Any], key: str, choices: int) -> None:
        self.same_end = b"\0"
        """The end of an event known to be neither the usage event nor a finished choice (:meth:`learn`);
        a NUL byte ends no whole event."""
        self.buf = b""
        """Bytes of an event not ended yet."""
        self.held: list[bytes] | None = None
        """Events held from a choice's last chunk to the usage event (None: not holding)."""
        self.watch = True
        """Look for choices' last chunks (until the usage event or ``[DONE]``)."""
        self.busy = False
        """Bytes are held: every read goes through :meth:`feed`."""
        self.fingerprints = fingerprints
        self.key = key
        fp = fingerprints.get(key, _UNKNOWN) if choices > 1 else _UNKNOWN
        self.stamp: bytes | None = None if fp is _UNKNOWN else fp
        """The fingerprint (JSON string) to stamp at once, or None to hold (or, known to be
        absent, b"": nothing to stamp)."""
        if fp is not _UNKNOWN and not fp:
            self.watch = False

    def feed(self, piece: bytes) -> bytes:
        buf = self.buf + piece if self.buf else piece
        out = []
        pos = 0
        if 13 in buf:
            n = len(buf)
            for m in _BLANK_LINE.finditer(buf):
                end = m.end()
                if end == n and buf[-1] == 13:
                    break  # a CR that may be the first half of a CRLF still to come
                ev = self._event(buf[pos:end])
                pos = end
                if ev:
                    out.append(ev)
        else:  # LF only (vLLM's): a blank line is "\n\n"
            find = buf.find
            while (end := find(b"\n\n", pos)) >= 0:
                ev = self._event(buf[pos:end + 2])
                pos = end + 2
                if ev:
                    out.append(ev)
        self.buf = buf[pos:] if pos else buf
        self.busy = bool(self.buf) or self.held is not None
        return out[0] if len(out) == 1 else b"".join(out)

    def learn(self, piece: bytes) -> None:
        """Remember how ``piece``, one whole event found to be neither the usage event nor a
        finished choice, ends from its last ``"finish_reason":null``: an event that ends so is
        neither (a usage event has no choices; that ``finish_reason`` is its last), and
        :meth:`_StreamRelay.sink` passes it on after one comparison of its end instead of two
        searches of it. vLLM's chunks of one stream end alike (``"finish_reason":null`` and the
        same members after it), unless they carry ``token_ids`` or logprobs after it."""
        i = piece.rfind(_NOT_FINISHED)
        if i >= 0:
            self.same_end = piece[i:]

    def _event(self, ev: bytes) -> bytes:
        """What to write for the whole event ``ev`` now (b"": nothing)."""
        data = _event_data(ev)
        if data is not None and _USAGE_KEY in data:
            try:
                obj = json.loads(data)
            except (ValueError, UnicodeDecodeError, RecursionError):
                obj = None
            if isinstance(obj, dict) and obj.get("choices") == [] and isinstance(obj.get("usage"), dict):
                m = _FINGERPRINT.search(data) if isinstance(obj.get("system_fingerprint"), str) else None
                fp_json = m.group(1) if m else b""  # vLLM's own bytes of it
                fps = self.fingerprints
                if len(fps) >= 4096 and self.key not in fps:
                    fps.clear()  # endpoints come and go (pods): keep it bounded
                fps[self.key] = fp_json
                self.watch = False
                held, self.held = self.held, None
                if not held:
                    return b""
                return b"".join(self._stamped(e, fp_json) for e in held)
        if self.held is not None:
            if data == b"[DONE]":
                # No usage event came (an error event ended the stream, or the server ignores
                # stream_options): the held events go as they came.
                held, self.held = self.held, None
                self.watch = False
                return b"".join(held) + ev
            self.held.append(ev)
            return b""
        if self.watch and data is not None and _FINISHED in data:
            if self.stamp is None:
                self.held = [ev]
                return b""
            return self._stamped(ev, self.stamp)
        if data == b"[DONE]":
            self.watch = False
        return ev

    @staticmethod
    def _stamped(ev: bytes, fp_json: bytes) -> bytes:
        """``ev`` with ``"system_fingerprint":fp_json`` as the last member of its object, when it
        is a choice's last chunk without one."""
        data = _event_data(ev)
        if not fp_json or data is None or _FINISHED not in data or _FINGERPRINT_KEY in data:
            return ev
        i = ev.rfind(b"}")
        return ev[:i] + b',"system_fingerprint":' + fp_json + ev[i:] if i > 0 else ev

    def flush(self) -> bytes:
        """Everything held, as it came (the stream ended or broke)."""
        out = b"".join(self.held or ()) + self.buf
        self.held = None
        self.buf = b""
        self.busy = False
        return out


def settle_tokens(ep: Any, r: Any, tokens: int) -> None:
    """Bring ``r``'s generated tokens in ``ep``'s bookkeeping up to ``tokens``, its exact count at
    the stream's end: during the stream each event counted as one token, fewer than vLLM sent when
    it coalesced tokens. (More only by the events without a token, the chat role chunk, the usage
    event and ``[DONE]``, at most a few: left as they are, since the request is released next and
    :meth:`RequestBook.remove` takes back exactly what was added.)"""
    behind = tokens - r.generated
    if behind > 0:
        ep.on_tokens(r, behind)


class _DeliveredThenClosed(asyncio.CancelledError):
    """The handler was cancelled after the whole stream reached the client (already counted)."""


class _StreamRelay:
    """The per-chunk path of a streamed answer: count SSE events, write to the client, flow control.

    Runs inside the upstream connection's ``data_received``: no coroutine switch per chunk.
    Events are counted at blank lines (:meth:`sink`, :meth:`_count_cr`), carrying the line ending that ends one
    chunk into the next, so an event split across network chunks counts once. Each event counts as
    one token while the stream runs (:meth:`RequestBook.on_tokens`): a lower bound when vLLM
    coalesces tokens, brought to the exact count at the end (:func:`settle_tokens`).

    ``strip`` (a :class:`_UsageStrip`): the client did not ask for the usage event routerd asked
    vLLM for. A read that is whole events with no ``"usage"`` in it, nor a finished choice while
    the strip watches for one, goes to the client as it is (vLLM's usual read: one event); the
    others go through the strip.
    """

    __slots__ = ("ctr", "chunked", "ex", "ep", "r", "events", "prev_nl", "at_boundary", "t_first", "t2",
                 "client_gone", "paused", "_poll", "cr", "pending_cr", "last", "on_tokens", "strip")

    #: Client write buffer above which the upstream is paused (bytes; 262144 in ``sink``), and
    #: below which it resumes.
    HIGH_WATER = 256 * 1024
    LOW_WATER = 64 * 1024

    def __init__(self, ctr, chunked: bool, ex: Exchange, ep, r, strip: "_UsageStrip | None" = None) -> None:
        self.ctr = ctr
        self.strip = strip
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
            n = 0  # (a stream with CRs always goes through the strip, if any)
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
        strip = self.strip
        if strip is not None and not (n == 1 and piece.endswith(strip.same_end) and not strip.busy):
            # Not one whole event ending as the stream's plain chunks do (_UsageStrip.learn): looked at.
            if (strip.busy or self.cr or not self.at_boundary or _USAGE_KEY in piece
                    or (strip.watch and _FINISHED in piece)):
                piece = strip.feed(piece)
                if last:
                    piece += strip.flush()
                elif not piece:
                    return  # all held (an event not ended yet, or a finished choice awaiting the usage event)
                chunk = None
            elif n == 1:
                strip.learn(piece)
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

    def flush(self) -> bytes:
        """What the strip still holds, to write as it is (the body ended or broke); b"" without one."""
        return self.strip.flush() if self.strip is not None else b""

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
        self.fingerprints: dict[str, bytes] = {}
        """Endpoint name -> the ``system_fingerprint`` (JSON string; b"": none) of its last usage
        event (:class:`_UsageStrip`)."""

    # -- lifecycle ---------------------------------------------------------------
    def build_app(self) -> web.Application:
        """The aiohttp application (routes only; the daemon runs it)."""
        self.max_body_bytes = self.d.settings.max_body_bytes
        app = web.Application(client_max_size=self.max_body_bytes)
        busy = self._marking_busy
        app.router.add_post("/v1/completions", busy(self.completions))
        app.router.add_post("/v1/chat/completions", busy(self.chat_completions))
        app.router.add_get("/v1/models", busy(self.models))
        app.router.add_post("/reset_prefix_cache", busy(self.reset_prefix_cache))
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

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """``POST /reset_prefix_cache``: vLLM's route (served by engines started with
        ``VLLM_SERVER_DEV_MODE=1``), sent on to every present endpoint at once. Each endpoint that
        answers 200 has its blocks forgotten by every index at once (its engine index and the
        policies' approximate ones): vLLM sends its ``AllBlocksCleared`` event only at its next
        engine step, so without this the next request would be scored against the lost blocks.
        Answers 200 when every endpoint did, else 502; the body lists each endpoint's status (0:
        unreachable)."""
        d = self.d
        pool = self.pool
        assert pool is not None
        eps = [ep for ep in d.router.endpoints if not ep.removed]

        async def one(ep) -> int:
            try:
                ex = await pool.request(ep.target, "/reset_prefix_cache", [], b"")
            except (UpstreamError, UpstreamTimeout):
                return 0
            try:
                await ex.read()
            except (UpstreamError, UpstreamTimeout):
                return 0
            finally:
                ex.release()
            if ex.status == 200:
                if ep.engine_index is not None:
                    ep.engine_index.cleared()  # its on_loss forgets the approximate entries too
                else:
                    d.router.forget_cached(ep.name, "cleared")
            return ex.status

        codes = await asyncio.gather(*(one(ep) for ep in eps))
        ok = bool(eps) and all(c == 200 for c in codes)
        return web.json_response({"success": ok, "endpoints": {ep.name: c for ep, c in zip(eps, codes)}},
                                 status=200 if ok else 502)

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: the served models (:meth:`Daemon.model_names`: ``models`` if configured,
        else what the endpoints serve), each with the card an endpoint serving it listed, vLLM's
        fields kept (``root``, ``parent``, ``max_model_len``, ``permission``...), merged by
        :func:`routerd.daemon.models.merge_cards` over the endpoints' last ``/v1/models`` reads
        (ready endpoints first). Models no read listed (configured ones, one ``models`` name, whose
        lists routerd does not read) take the cards the ready endpoints answer now (2 s at most);
        routerd's own minimal card for any left without one."""
        d = self.d
        names = d.model_names()
        router = d.router
        now = router.clock()
        eps = sorted((ep for ep in router.endpoints if not ep.removed),
                     key=lambda ep: (not router.is_ready(ep, now), ep.index))
        listed = []
        for ep in eps:
            got = d.model_lister.cards.get(ep.name)
            # Only a list the router still trusts, read from the endpoint's current URL.
            if got is not None and got[0] == ep.url and ep.discovered_models is not None:
                listed.append(got[1])
        if not names or any(not any(m in cards for cards in listed) for m in names):
            # Nothing known yet (no configuration, no list read), or models no read listed: ask now.
            fetched = await self._cards_from_instances([ep for ep in eps if router.is_ready(ep, now)])
            if not names:
                names = list(dict.fromkeys(m for cards in fetched for m in cards))
            listed += fetched
        return web.json_response({"object": "list",
                                  "data": merge_cards(names, listed, int(d.started_at_unix))})

    async def _cards_from_instances(self, eps) -> list[dict[str, dict]]:
        """The model cards (by id) each of ``eps`` lists at its ``/v1/models`` now, read at once,
        2 s at most each; endpoints that fail are left out."""
        pool = self.pool
        if pool is None:
            return []

        async def one(ep) -> dict[str, dict] | None:
            try:
                async with asyncio.timeout(2.0):
                    ex = await pool.request(ep.target, "/v1/models", [("Accept", "application/json")], b"",
                                            method="GET")
                    try:
                        body = await ex.read()
                    finally:
                        ex.release()
                return {c["id"]: c for c in parse_model_cards(body)} if ex.status == 200 else None
            except (UpstreamError, TimeoutError, ValueError, UnicodeDecodeError):
                return None

        return [c for c in await asyncio.gather(*(one(ep) for ep in eps)) if c]

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
        return web.json_response({"status": "ready" if ready else "not ready", "reason": why, "ejected": ejected,
                                  "unhealthy": self.d.unhealthy_endpoints(now)}, status=200 if ready else 503)

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
        strip = 0
        if stream:
            asked = with_usage(body, payload)
            if asked is not None:
                body, strip = asked, choices_of(kind, payload)
        try:
            return await self._forward(request, kind, body, stream, r, ep, t0, strip)
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

    def _validate(self, kind: str, body: bytes) -> tuple[dict, bool, int, str | None, PrefixInput]:
        return parse_request(kind, body)

    @staticmethod
    def _upstream_headers(request: web.Request) -> list[tuple[str, str]]:
        drop = _HOP_BY_HOP | connection_named(request.headers.getall("Connection", ()))
        h = [(k, v) for k, v in request.headers.items() if k.lower() not in drop]
        h.append(("Accept-Encoding", "identity"))
        return h

    async def _forward(self, request: web.Request, kind: str, body: bytes, stream: bool, r, ep,
                       t0: float, strip: int = 0) -> web.StreamResponse:
        """Send ``body`` to ``ep`` (another endpoint on a failure before the first byte) and relay
        the answer. ``strip``: routerd asked for the usage event the client did not (:func:`with_usage`),
        to be taken out of a stream of that many choices."""
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
                return await self._relay_stream(request, ex, r, ep, t0, strip)
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
    def _response_headers(ex: Exchange, r: Any = None, ep: Any = None) -> CIMultiDict:
        drop = _RESPONSE_DROP | connection_named(v for k, v in ex.headers if k.lower() == "connection")
        h = CIMultiDict()
        for k, v in ex.headers:
            if k.lower() not in drop and k.lower() not in _ROUTING_HEADERS:
                h.add(k, v)
        if ep is not None:
            h.extend(routing_headers(r, ep))
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
        return web.Response(body=data, status=status, headers=self._response_headers(ex, r, ep))

    async def _relay_stream(self, request: web.Request, ex: Exchange, r, ep, t0: float,
                            strip: int = 0) -> web.StreamResponse:
        d = self.d
        resp = web.StreamResponse(status=ex.status, headers=self._response_headers(ex, r, ep))
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
        relay = _StreamRelay(ctr, resp.chunked, ex, ep, r,
                             _UsageStrip(self.fingerprints, ep.name, strip) if strip else None)
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
            self._stream_broken(ep, e.reason, f"broke off a stream: {e}")
            held = relay.flush()
            if held:
                try:
                    await resp.write(held)
                except (ConnectionError, aiohttp.ClientConnectionResetError):
                    return resp
            await self._end_broken_stream(request, resp, relay.at_boundary, ep.name)
            return resp
        finally:
            relay.close()
        if relay.client_gone:
            d.metrics.client_disconnects.inc()
            d.metrics.count_response(499)
            return resp
        held = relay.flush()
        if held:  # bytes the strip held after the body's last read (nothing for vLLM's streams)
            relay.last += held
        if not ends_with_done(relay.tail()):
            # The body ended cleanly but without vLLM's last event: something between cut it short
            # (a proxy closing early), or the server is not vLLM. Not a whole answer.
            self._stream_broken(ep, "no_done", NO_DONE)
            if relay.last:
                try:
                    await resp.write(relay.last)
                except (ConnectionError, aiohttp.ClientConnectionResetError):
                    return resp
            await self._end_broken_stream(request, resp, relay.at_boundary, ep.name, NO_DONE)
            return resp
        self._finish_stream(request, r, t0, relay)
        try:
            await resp.write_eof(relay.last)
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            pass
        return resp

    def _finish_stream(self, request: web.Request, r, t0: float, relay: "_StreamRelay") -> None:
        """Record a stream relayed to its ``[DONE]``: tokens from the final usage event (routerd asks
        vLLM for it, :func:`with_usage`), else the SSE events less ``[DONE]`` and, for chat, the
        role-only first chunk vLLM sends; the endpoint's bookkeeping is brought up to them."""
        tokens = stream_tokens(relay.tail(), relay.events, request.path.endswith("/chat/completions"))
        settle_tokens(relay.ep, r, tokens)
        self.d.observe_finished(r, t0, relay.t_first, tokens)
        self.d.metrics.count_response(200)

    def _stream_broken(self, ep, reason: str, what: str) -> None:
        """Count a stream of ``ep`` that broke (``reason``: a ``phasewise_streams_broken_total`` reason,
        or an :class:`UpstreamError` reason) as a 502, an upstream error (kind ``timeout`` or
        ``stream``) and a failure for passive health; ``what`` is logged."""
        timeout = reason == "timeout"
        (ep.m.err_timeout if timeout else ep.m.err_stream).inc()
        self.d.router.note_failure(ep, "timeout" if timeout else "stream")
        broken = ep.m.streams_broken
        (broken.get(reason) or broken["closed"]).inc()
        log.warning("instance %s %s", ep.name, what)
        self.d.metrics.count_response(502)

    async def _end_broken_stream(self, request: web.Request, resp: web.StreamResponse, at_boundary: bool,
                                 name: str, why: str = "broke off the stream") -> None:
        """Tell the client its stream broke: an SSE error event (vLLM's way for an error mid-stream)
        and the end of the body without ``[DONE]``, at an event boundary; else drop the connection (a
        half-sent event cannot be completed). The ``openai`` client raises ``openai.APIError`` for
        the event, ``openai.APIConnectionError`` for the dropped connection."""
        if at_boundary:
            try:
                await resp.write(broken_stream_event(name, why))
                await resp.write_eof()
                return
            except (ConnectionError, aiohttp.ClientConnectionResetError):
                return
        tr = request.transport
        if tr is not None:
            tr.abort()
