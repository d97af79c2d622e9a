"""The endpoint picker: Envoy ext_proc (Endpoint Picker protocol v1.0) over routerd's core.

Protocol (``kubernetes-sigs/gateway-api-inference-extension:docs/proposals/004-endpoint-picker-protocol/README.md``,
and the reference picker ``llm-d/llm-d-router:pkg/epp/handlers/server.go``, ``request.go``,
``response.go``): one bidirectional ``envoy.service.ext_proc.v3.ExternalProcessor/Process``
stream per HTTP request. Per stream, in ``FULL_DUPLEX_STREAMED`` for the request body:

1. ``request_headers`` (kept), ``request_body`` chunks buffered to ``end_of_stream`` (or to
   ``request_trailers``); over ``epp.max_body_bytes`` -> ImmediateResponse 413 at once.
2. The decision, by the same calls as routerd's HTTP front (:mod:`routerd.daemon.proxy`):
   :func:`~routerd.daemon.proxy.parse_request` (400), :meth:`Daemon.settle_model` (404 / 503),
   :meth:`Daemon.predict`, :meth:`Daemon.prefix_blocks`, :meth:`Router.dispatch` (which may
   hold the request: the stream is simply not answered until dispatch; 429 queue full, 503 no
   endpoint or draining). A subset hint (``metadata_context.filter_metadata["envoy.lb.subset_hint"]
   ["x-gateway-destination-endpoint-subset"]``, a list of ``ip:port``) excludes every other
   endpoint; set but empty, or naming nothing eligible -> 503.
3. A HeadersResponse: ``x-gateway-destination-endpoint: ip:port[,ip:port...]`` (primary, then up
   to ``epp.max_fallbacks`` other candidates, fewest in flight first), ``content-length`` of the
   buffered body, ``x-phasewise-request-id`` (efficient mode's key), ``clear_route_cache``; the
   same value as dynamic metadata ``envoy.lb / x-gateway-destination-endpoint``. Then the body back
   in BodyResponses whose ``body_mutation.streamed_response`` carries it (an empty CommonResponse
   makes Envoy answer 500: GIE PR #3028), after the headers (PR #3033); ``transfer-encoding`` is
   never set (stream truncation: PR #2996). Trailers are answered.
4. Response phase, ``full-duplex`` mode: headers (their ``metadata_context["envoy.lb"]
   ["x-gateway-destination-endpoint-served"]``, when the gateway reports it, names the endpoint
   that served: a fallback moves the booking there, :meth:`Router.move`), then every body chunk
   echoed; its SSE events are counted by routerd's own relay counter (:class:`_StreamRelay`), so
   bookkeeping, token counts and latency metrics are the proxy's. As routerd's proxy does, a
   streamed request whose client did not ask for the usage event is sent on with
   ``stream_options.include_usage`` (:func:`~routerd.daemon.proxy.with_usage`; the
   ``content-length`` set in step 3 is the new body's), and the usage event is taken out of the
   echoed chunks (:class:`~routerd.daemon.proxy._UsageStrip`; a chunk may then be echoed empty, or
   an event held to the next chunk), so the count at the end is vLLM's ``completion_tokens`` even
   when vLLM put several tokens in one event. The response's end of stream completes the request
   (:meth:`Daemon.observe_finished`, :meth:`Router.finish`).

**Efficient mode** (``epp.mode: efficient``, only with the Envoy configuration Phasewise ships,
:func:`routerd.epp.envoy_config.build_envoy_config`): Envoy sends the picker the request only
(response header, body and trailer modes SKIP / NONE / SKIP), so no response chunk makes a Python
hop. How the picker knows a request ended: Envoy's Lua filter (C++/LuaJIT, in the Envoy worker)
counts the response's SSE events and keeps its last bytes and the first chunk's time, and puts
them in the stream's dynamic metadata (namespace ``phasewise``) at end of stream, and at ``[DONE]``
(a client closing there resets the stream before its end); Envoy's gRPC
access logger (``envoy.access_loggers.http_grpc``, flushed every ``buffer_flush_interval``)
sends one entry per finished HTTP stream to this process's
``envoy.service.accesslog.v3.AccessLogService`` (on the ext_proc port). The entry carries the
``x-phasewise-request-id`` the picker set, the response code and flags, the upstream address that
served (a fallback moves the booking), the times, and that metadata: the tokens follow from it by
the proxy's rule (:func:`~routerd.daemon.proxy.stream_tokens`), and the booking is released. The
request body goes unchanged in this mode (the Lua filter cannot cheaply rewrite a streamed
response, so no usage event may be added for it to take out): a client that asked for the usage
event gets its tokens counted exactly from it (kept in the tail); otherwise tokens are SSE events,
fewer than vLLM generated whenever it put several tokens in one event (a 64-token stream came as
31-63 events under load, ``shared/docs/real-vllm.md``): ``phasewise_generation_tokens_total``,
TPOT and the predictor's bucket counts undercount such streams.
Requests in flight are booked ``blind`` (as routerd books a non-streaming request: decoding
while the engine counts it running), because their first token is not seen. If no entry comes
(an access-log stream broken), the booking is released ``epp.completion_timeout_s`` after Envoy
ended the request's ext_proc stream (``phasewise_epp_streams_total{outcome="unreported"}``): Envoy
ends that stream as soon as the request phase is answered (Envoy 1.40, measured), so its end says
nothing about the response and only the access-log entry completes a request.

A streamed answer is complete only with vLLM's terminal ``data: [DONE]`` (the proxy's rule,
:func:`~routerd.daemon.proxy.ends_with_done`): one the upstream cut (efficient mode: the access
log's response flags) or ended without it is counted in ``phasewise_streams_broken_total`` and as a
502 (outcome ``broken``), never as a completion, and marks the endpoint for passive health; in
full-duplex mode an answer that ended without ``[DONE]`` gets the proxy's SSE error event appended.
(In full-duplex mode Envoy ends the ext_proc stream of a request whose upstream died mid-answer as
it ends one whose client went away: both count as cancelled, 499.) A request on another path than
the inference routes (a probe: ``GET /health``, ``/v1/models``) is routed like any other but counted
only as outcome ``passthrough``: not in ``phasewise_requests_total`` nor the latency and token metrics.

Every stream ends in exactly one release of its booking: a ``finally`` on the stream handler for
streams that end early (Envoy reset, client gone, picker error), :meth:`Router.finish` being
idempotent for the rest. Errors answer OpenAI-style JSON bodies (``{"error": {"message",
"type", "param", "code"}}``) with ``x-phasewise-reject-reason``, as routerd's proxy does.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from typing import TYPE_CHECKING, Any, AsyncIterator

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import Counter, Histogram

from routerd.daemon.proxy import (_COMPLETION_TOKENS, _DONE, REASON_HEADER, BadRequest, _StreamRelay, _UsageStrip,
                                  NO_DONE, broken_stream_event, choices_of, ends_with_done, error_body,
                                  parse_request, routing_headers, settle_tokens, stream_tokens, with_usage)
from routerd.daemon.grpc_api import ReadinessHealth, cancel_task
from routerd.daemon.router import RejectedError, shown_name
from routerd.epp.names import (DEST_HEADER, LB_NAMESPACE, LUA_NAMESPACE, REQUEST_ID_HEADER, SERVED_KEY,
                               SUBSET_KEY, SUBSET_NAMESPACE)

if TYPE_CHECKING:
    from routerd.daemon.app import Daemon
    from routerd.daemon.state import EndpointState, Inflight

log = logging.getLogger("routerd.epp")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)
#: Largest body piece sent back in one BodyResponse (bytes): well under gRPC's 4 MiB message limit.
BODY_PIECE = 256 * 1024
#: Bytes of a non-streamed answer kept for its ``usage.completion_tokens`` (the proxy reads it whole).
_KEEP_BODY = 4 * 1024 * 1024
_ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_DECISION_BUCKETS = (1e-5, 2e-5, 3e-5, 4e-5, 5e-5, 6e-5, 7e-5, 8e-5, 9e-5, 1e-4, 1.25e-4, 1.5e-4, 2e-4, 3e-4, 5e-4,
                     1e-3, 2.5e-3, 1e-2, 0.1)
_DELAY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 5.0, 30.0)


class _NullTransport:
    """What :class:`_StreamRelay` writes to when Envoy, not routerd, relays the stream: the
    relay then only counts events and keeps the tail (the echo goes back over ext_proc)."""

    __slots__ = ()

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        pass

    def writelines(self, data) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


_NULL = _NullTransport()


class _Collect:
    """What :class:`_StreamRelay` writes to in full-duplex mode when it takes the usage event out
    (:class:`routerd.daemon.proxy._UsageStrip`): what it writes is the chunk echoed to Envoy."""

    __slots__ = ("out",)

    def __init__(self) -> None:
        self.out: list[bytes] = []

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def writelines(self, data) -> None:
        self.out.extend(data)

    def get_write_buffer_size(self) -> int:
        return 0

    def take(self) -> bytes:
        out = self.out
        if not out:
            return b""
        self.out = []
        return out[0] if len(out) == 1 else b"".join(out)

# Constant answers, built once: gRPC serializes a message when it is written and never changes
# it, so one object serves every stream.
_REQUEST_TRAILERS_DONE = ep_pb2.ProcessingResponse(request_trailers=ep_pb2.TrailersResponse())
_RESPONSE_HEADERS_DONE = ep_pb2.ProcessingResponse(response_headers=ep_pb2.HeadersResponse())


def _routing_headers_response(b: "_Booking") -> ep_pb2.ProcessingResponse:
    """The response-headers answer of a routed request: ``x-phasewise-endpoint`` and
    ``x-phasewise-cached-tokens`` (:func:`routerd.daemon.proxy.routing_headers`) set on the
    response, as routerd's proxy sets them (full-duplex mode; in efficient mode Envoy's Lua adds
    them)."""
    out = ep_pb2.ProcessingResponse()
    set_headers = out.response_headers.response.header_mutation.set_headers
    for k, v in routing_headers(b.r, b.ep):
        h = set_headers.add()
        h.header.key = k
        h.header.raw_value = v.encode()
        h.append_action = _OVERWRITE
    return out
_RESPONSE_TRAILERS_DONE = ep_pb2.ProcessingResponse(response_trailers=ep_pb2.TrailersResponse())


def _body_response(phase: str, chunk: bytes, end_of_stream: bool) -> ep_pb2.ProcessingResponse:
    """A BodyResponse of ``phase`` (``request_body`` / ``response_body``) whose
    ``body_mutation.streamed_response`` carries ``chunk``. Built by setting fields in place:
    about 4x cheaper than nesting constructors (upb copies each nested message it is given)."""
    m = ep_pb2.ProcessingResponse()
    sr = getattr(m, phase).response.body_mutation.streamed_response
    sr.SetInParent()  # present even when empty: an empty CommonResponse makes Envoy answer 500
    if chunk:
        sr.body = chunk
    if end_of_stream:
        sr.end_of_stream = True
    return m


class EppMetrics:
    """The picker's own series (``phasewise_epp_*``), in the daemon's registry beside routerd's."""

    def __init__(self, registry) -> None:
        self.streams = Counter("phasewise_epp_streams", "ext_proc streams by outcome: completed (response "
                               "ended), broken (a streamed answer the upstream cut or ended without 'data: "
                               "[DONE]', also in phasewise_streams_broken_total), refused (ImmediateResponse), "
                               "cancelled (ended before the response did), unreported (efficient mode: released "
                               "without an access-log entry), passthrough (not an inference request, e.g. a "
                               "probe of GET /health or /v1/models: routed, not counted as a request).",
                               ["outcome"], registry=registry)
        self.decision = Histogram("phasewise_epp_decision_seconds",
                                  "Picker CPU time per request (its thread's, time.thread_time) from the end of "
                                  "the request body to the answer being ready: parse, model check, prefix "
                                  "hashing, dispatch with the policy, building the answer; not its waits (the "
                                  "predictor's batch, computed apart; a router-queue wait ends its count at "
                                  "dispatch) nor gRPC transport (s).",
                                  buckets=_DECISION_BUCKETS, registry=registry)
        self.completion_delay = Histogram("phasewise_epp_completion_delay_seconds",
                                          "Efficient mode: time from Envoy's last byte to the client to the "
                                          "picker releasing the booking on its access-log entry (s).",
                                          buckets=_DELAY_BUCKETS, registry=registry)
        self.moved = Counter("phasewise_epp_served_moves", "Requests Envoy served on a fallback endpoint; "
                             "their booking moved there.", registry=registry)
        self.access_log_unknown = Counter("phasewise_epp_access_log_unknown",
                                          "Access-log entries naming no request the picker has booked.",
                                          registry=registry)
        self.outcome = {o: self.streams.labels(o) for o in ("completed", "broken", "refused", "cancelled",
                                                            "unreported", "passthrough")}


def endpoint_address(ep: "EndpointState") -> str:
    """``ip:port`` of an endpoint as Envoy's ORIGINAL_DST cluster reads it (``[v6]:port``)."""
    _, host, port, _ = ep.target
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _header_map(hm) -> dict[str, str]:
    """Lower-case name -> value of an ext_proc ``HeaderMap`` (Envoy sends ``raw_value``)."""
    out = {}
    for h in hm.headers:
        out[h.key.lower()] = h.raw_value.decode("latin-1") if h.raw_value else h.value
    return out


#: No subset hint in the metadata (a hint that is present but null or malformed is refused).
_NO_HINT = object()
_MALFORMED = object()


def _struct_value(v: struct_pb2.Value) -> Any:
    kind = v.WhichOneof("kind")
    if kind == "struct_value":
        return _MALFORMED
    if kind == "list_value":
        return [_struct_value(x) for x in v.list_value.values]
    if kind == "string_value":
        return v.string_value
    if kind == "number_value":
        return v.number_value
    if kind == "bool_value":
        return v.bool_value
    return None


def _metadata_field(md, namespace: str, key: str, absent: Any = None) -> Any:
    """``filter_metadata[namespace][key]`` of an Envoy ``Metadata`` as Python, or ``absent``."""
    ns = md.filter_metadata.get(namespace) if md.filter_metadata else None
    if ns is None or key not in ns.fields:
        return absent
    return _struct_value(ns.fields[key])


def _immediate(status: int, message: str, type_: str, reason: str, code: str | None = None,
               param: str | None = None, retry_after: bool = False) -> ep_pb2.ProcessingResponse:
    headers = [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
                                          append_action=_OVERWRITE)
               for k, v in (("content-type", "application/json"), (REASON_HEADER, reason))]
    if retry_after:
        headers.append(base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="retry-after", raw_value=b"1"),
                                                  append_action=_OVERWRITE))
    return ep_pb2.ProcessingResponse(immediate_response=ep_pb2.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), headers=ep_pb2.HeaderMutation(set_headers=headers),
        body=error_body(message, type_, param, code or reason), details=f"phasewise_{reason}"))


class _Refused(Exception):
    """A request answered with an ImmediateResponse (``response``) before dispatch."""

    def __init__(self, response: ep_pb2.ProcessingResponse) -> None:
        super().__init__()
        self.response = response


class _Booking:
    """One dispatched request of a stream, until its response ends (or the stream does)."""

    __slots__ = ("r", "ep", "t0", "path", "stream", "status", "relay", "body", "t_first", "served_checked", "rid",
                 "stream_ended", "inference", "strip", "echo")

    def __init__(self, r: "Inflight", ep: "EndpointState", t0: float, path: str, stream: bool, rid: str,
                 strip: int = 0) -> None:
        self.r = r
        self.strip = strip
        """Full-duplex mode: the picker asked for the usage event the client did not, to be taken
        out of a stream of that many choices (0: not)."""
        self.echo: _Collect | None = None
        self.ep = ep
        self.t0 = t0
        self.path = path
        self.stream = stream
        self.rid = rid
        self.status = 0
        self.relay: _StreamRelay | None = None
        self.body = bytearray()
        self.t_first: float | None = None
        self.served_checked = False
        self.stream_ended = False
        self.inference = path in _ROUTES
        """An inference request; else (a probe: ``GET /health``, ``/v1/models``) it is routed and
        released without being counted as a request or a completion."""


class ExtProcServicer(ep_grpc.ExternalProcessorServicer):
    """``ExternalProcessor/Process`` over one daemon's router (see the module docstring)."""

    def __init__(self, daemon: "Daemon", metrics: EppMetrics, efficient: bool) -> None:
        self.d = daemon
        self.m = metrics
        self.efficient = efficient
        self._said_als_mismatch = False
        self._ids = itertools.count(1)
        self._prefix = f"{os.getpid():x}-{int(time.time()):x}-"
        self.pending: dict[str, _Booking] = {}
        """Efficient mode: request id -> booking awaiting its access-log entry."""
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._said_mismatch = False
        self.fingerprints: dict[str, bytes] = {}
        """Endpoint name -> its last usage event's ``system_fingerprint`` (full-duplex mode's strip)."""

    # -- the stream --------------------------------------------------------------
    async def Process(self, request_iterator: AsyncIterator[ep_pb2.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[ep_pb2.ProcessingResponse]:
        t0 = time.monotonic()
        headers: dict[str, str] | None = None
        body = bytearray()
        subset: Any = _NO_HINT
        booking: _Booking | None = None
        done = False  # the response ended (completed) or the request was refused
        try:
            async for msg in request_iterator:
                which = msg.WhichOneof("request")
                if msg.HasField("metadata_context") and subset is _NO_HINT and booking is None:
                    subset = _metadata_field(msg.metadata_context, SUBSET_NAMESPACE, SUBSET_KEY, _NO_HINT)
                if booking is None:
                    if which == "request_headers":
                        headers = _header_map(msg.request_headers.headers)
                        if not msg.request_headers.end_of_stream:
                            continue
                        ended_by = "headers"
                    elif which == "request_body":
                        if done:
                            continue
                        body += msg.request_body.body
                        if len(body) > self.d.settings.epp.max_body_bytes:
                            done = True
                            yield self._refuse(self._refusal(
                                413, f"request body exceeds the limit of {self.d.settings.epp.max_body_bytes} bytes",
                                "invalid_request_error", "too_large", code="request_too_large"))
                            return
                        if not msg.request_body.end_of_stream:
                            continue
                        ended_by = "body"
                    elif which == "request_trailers":
                        ended_by = "trailers"
                    else:
                        log.warning("ext_proc: %s before the request was decided; ignored", which)
                        continue
                    try:
                        booking, out = await self._decide(headers or {}, bytes(body), subset, t0)
                    except _Refused as e:
                        done = True
                        yield self._refuse(e.response)
                        return
                    except Exception:  # a picker bug: say so in the OpenAI shape (nothing stays booked)
                        log.exception("internal error deciding on %s", (headers or {}).get(":path", "?")[:200])
                        done = True
                        yield self._refuse(_immediate(500, "internal error in the endpoint picker", "server_error",
                                                      "internal_error"))
                        return
                    for o in out:
                        yield o
                    if ended_by == "trailers":
                        yield _REQUEST_TRAILERS_DONE
                    body = bytearray()
                    continue
                # -- after the decision ---------------------------------------------
                if which == "request_trailers":
                    yield _REQUEST_TRAILERS_DONE
                elif which == "response_headers":
                    self._served(booking, msg)
                    h = _header_map(msg.response_headers.headers)
                    try:
                        booking.status = int(h.get(":status", "0"))
                    except ValueError:
                        booking.status = 0
                    if booking.stream and booking.status == 200 and h.get("content-type", "").startswith(
                            "text/event-stream"):
                        if booking.strip:
                            booking.echo = _Collect()
                            booking.relay = _StreamRelay(booking.echo, False, None, booking.ep, booking.r,
                                                         _UsageStrip(self.fingerprints, booking.ep.name, booking.strip))
                        else:
                            booking.relay = _StreamRelay(_NULL, False, None, booking.ep, booking.r)
                    # A request ends before its last answer goes back: whoever sees that answer
                    # (Envoy, a test) then sees the booking released.
                    if msg.response_headers.end_of_stream:
                        done = True
                        self._complete(booking)
                    yield _routing_headers_response(booking)
                elif which == "response_body":
                    self._served(booking, msg)
                    rb = msg.response_body
                    chunk = rb.body
                    relay = booking.relay
                    if chunk:
                        if relay is not None:
                            relay.sink(chunk)
                        elif len(booking.body) < _KEEP_BODY:
                            booking.body += chunk
                    echo = booking.echo
                    if echo is not None:
                        # What the relay passed on: the usage event taken out, events held whole.
                        chunk = echo.take()
                        if rb.end_of_stream:
                            chunk += relay.flush()
                    if rb.end_of_stream:
                        done = True
                        if self._complete(booking) and booking.relay is not None and booking.relay.at_boundary:
                            # Ended without [DONE]: the client is told as routerd's proxy tells it.
                            chunk = chunk + broken_stream_event(booking.ep.name, NO_DONE)
                    yield _body_response("response_body", chunk, rb.end_of_stream)
                elif which == "response_trailers":
                    if not done:
                        done = True
                        self._complete(booking)
                    yield _RESPONSE_TRAILERS_DONE
                elif which == "request_body":
                    # Body after its end (should not happen): echo it so nothing is lost.
                    yield _body_response("request_body", msg.request_body.body, msg.request_body.end_of_stream)
        finally:
            if booking is not None and not done:
                if self.efficient:
                    self._await_access_log(booking)
                else:
                    self._cancelled(booking)

    # -- the decision ------------------------------------------------------------
    async def _decide(self, headers: dict[str, str], body: bytes, subset: Any,
                      t0: float) -> tuple[_Booking, list[ep_pb2.ProcessingResponse]]:
        """Dispatch the request; returns its booking and the responses to send (headers, then body).

        Raises:
            _Refused: answered with an ImmediateResponse (400, 404, 413, 429, 503).
        """
        d = self.d
        router = d.router
        # The decision's cost is the CPU time of this thread in its own steps (time.thread_time):
        # neither waits (the predictor's batch, the router queue) nor other processes preempting it.
        cpu = 0.0
        t = time.thread_time()
        if router.draining:
            raise _Refused(self._refusal(503, "the endpoint picker is shutting down", "service_unavailable_error",
                                         "draining", retry_after=True))
        path = headers.get(":path", "").partition("?")[0]
        kind = _ROUTES.get(path)
        model: str | None = None
        stream = False
        prompt_tokens = 0
        prompt_text = None
        prefix_input = None
        mt = None
        strip = 0
        if kind is not None:
            try:
                payload, stream, prompt_tokens, prompt_text, prefix_input = parse_request(kind, body)
            except BadRequest as e:
                raise _Refused(self._refusal(e.status, str(e), e.type_, "not_found" if e.status == 404
                                             else "bad_request", code=e.code, param=e.param)) from None
            model = payload["model"]
            mt = payload.get("max_tokens", payload.get("max_completion_tokens"))
            if stream and not self.efficient:
                # Full-duplex mode sends the body back and sees the response: it asks vLLM for the
                # usage event the client did not ask for, and takes it out of the echoed stream.
                asked = with_usage(body, payload)
                if asked is not None:
                    body, strip = asked, choices_of(kind, payload)
            if router.model_verdict(model) != "ok":
                verdict = await d.settle_model(model)
                if verdict == "unknown":
                    raise _Refused(self._refusal(404, f"the model {shown_name(model)} does not exist; see GET "
                                                 "/v1/models", "invalid_request_error", "not_found",
                                                 code="model_not_found", param="model"))
                if verdict == "pending":
                    raise _Refused(self._refusal(503, f"no endpoint is known to serve the model {shown_name(model)} "
                                                 "yet: model lists are still being read", "service_unavailable",
                                                 "no_endpoint", retry_after=True))
        exclude: frozenset[str] = frozenset()
        if subset is not _NO_HINT:
            # A list of ip:port or a comma-separated string; anything else (a number, a boolean,
            # a struct, null) names no endpoint: refused like an empty hint.
            if isinstance(subset, str):
                wanted = {subset}
            elif isinstance(subset, list):
                wanted = {x for x in subset if isinstance(x, str)}
            else:
                wanted = set()
            wanted = {w.strip() for s in wanted for w in s.split(",") if w.strip()}
            exclude = frozenset(ep.name for ep in router.endpoints if endpoint_address(ep) not in wanted)
            if not wanted or not router.has_candidate(exclude, model):
                shown = ", ".join(sorted(wanted))[:200] or "nothing"
                raise _Refused(self._refusal(503, f"no ready endpoint in the gateway's subset hint ({shown})",
                                             "service_unavailable", "no_endpoint", retry_after=True))
        task = headers.get("x-phasewise-task")
        cpu += time.thread_time() - t
        bucket = await d.predict(prompt_text, prompt_tokens, task, mt if type(mt) is int else None)
        t = time.thread_time()
        chat = kind == "chat"
        prefix = None
        if prefix_input is not None:
            prefix = (await d.prefix_blocks_in_thread(prefix_input, chat) if d.prefix_in_thread(prefix_input, chat)
                      else d.prefix_blocks(prefix_input, chat))
        r = router.new_request(prompt_tokens, bucket, task, model=model, prefix=prefix)
        # Efficient mode never sees a first token: booked as routerd books a non-streaming request.
        r.blind = self.efficient or not stream
        try:
            ep = await router.dispatch(r, exclude, retry=False)
        except RejectedError as e:
            raise _Refused(self._refusal(e.status, str(e), e.error_type, e.reason, retry_after=True)) from None
        try:
            return self._answer(r, ep, t0, path, stream, model, exclude, headers, body, cpu, t, strip)
        except BaseException:
            router.finish(r)  # booked but never answered: released here, once
            raise

    def _answer(self, r: "Inflight", ep: "EndpointState", t0: float, path: str, stream: bool, model: str | None,
                exclude: frozenset[str], headers: dict[str, str], body: bytes, cpu: float,
                t: float, strip: int = 0) -> tuple[_Booking, list[ep_pb2.ProcessingResponse]]:
        """The booking of dispatched ``r`` and the request-phase answer (destination, then the body:
        the client's, or with the usage option when ``strip``)."""
        d = self.d
        router = d.router
        d.metrics.prompt_tokens.inc(r.prompt_tokens)
        rid = self._prefix + str(next(self._ids))
        booking = _Booking(r, ep, t0, path, stream, rid, strip)
        dest = [endpoint_address(ep)]
        n_fb = d.settings.epp.max_fallbacks
        if n_fb:
            others = router.candidates(model, exclude | {ep.name})
            others.sort(key=lambda e: len(e.requests))
            dest += [endpoint_address(e) for e in others[:n_fb]]
        value = ",".join(dest)
        # Fields set in place (nesting constructors copies each sub-message: 26 us against 8 us).
        first = ep_pb2.ProcessingResponse()
        common = first.request_headers.response
        common.clear_route_cache = True
        set_headers = common.header_mutation.set_headers
        pairs = [(DEST_HEADER, value), (REQUEST_ID_HEADER, rid)]
        if self.efficient:
            # No response reaches the picker: the shipped Envoy's Lua filter moves these request
            # headers onto the response (routerd.epp.envoy_config.LUA_PRIMARY).
            pairs += routing_headers(r, ep)
        for k, v in pairs:
            h = set_headers.add()
            h.header.key = k
            h.header.raw_value = v.encode()
            h.append_action = _OVERWRITE
        if body or "content-length" in headers:
            h = set_headers.add()
            h.header.key = "content-length"
            h.header.raw_value = str(len(body)).encode()
            h.append_action = _OVERWRITE
        first.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[DEST_HEADER].string_value = value
        out = [first]
        if body:
            for i in range(0, len(body), BODY_PIECE):
                out.append(_body_response("request_body", body[i:i + BODY_PIECE], i + BODY_PIECE >= len(body)))
        if r.waiter is None:
            cpu += time.thread_time() - t  # dispatched at once (Router.dispatch made no waiter): nothing else ran
        self.m.decision.observe(cpu)
        if self.efficient:
            self.pending[rid] = booking
        return booking, out

    def _refusal(self, status: int, message: str, type_: str, reason: str, code: str | None = None,
                 param: str | None = None, retry_after: bool = False) -> ep_pb2.ProcessingResponse:
        self.d.metrics.count_rejection(reason)
        return _immediate(status, message, type_, reason, code, param, retry_after)

    def _refuse(self, response: ep_pb2.ProcessingResponse) -> ep_pb2.ProcessingResponse:
        self.d.metrics.count_response(response.immediate_response.status.code)
        self.m.outcome["refused"].inc()
        return response

    # -- the response ------------------------------------------------------------
    def _served(self, b: _Booking, msg: ep_pb2.ProcessingRequest) -> None:
        """Move ``b``'s booking when the gateway reports it was served elsewhere (a fallback)."""
        if b.served_checked or not msg.HasField("metadata_context"):
            return
        served = _metadata_field(msg.metadata_context, LB_NAMESPACE, SERVED_KEY)
        if served is None:
            return
        b.served_checked = True
        if isinstance(served, list):
            served = served[0] if served else None
        if isinstance(served, str):
            self._move_to(b, served.strip())

    def _move_to(self, b: _Booking, address: str) -> None:
        if not address or address == endpoint_address(b.ep):
            return
        for ep in self.d.router.endpoints:
            if endpoint_address(ep) == address and not ep.removed:
                if self.d.router.move(b.r, ep):
                    b.ep = ep
                    relay = b.relay
                    if relay is not None:
                        relay.ep = ep
                        relay.on_tokens = ep.on_tokens  # bound at its start: the old endpoint's
                        if relay.strip is not None:
                            relay.strip.key = ep.name
                    self.m.moved.inc()
                return
        log.warning("the gateway reports %s served a request; no endpoint has that address", address[:200])

    def _complete(self, b: _Booking) -> bool:
        """The response ended (full-duplex mode): record it like the proxy does and release. Returns
        True when it was a streamed answer that ended without ``data: [DONE]`` (counted broken)."""
        d = self.d
        if not b.inference:
            self.pending.pop(b.rid, None)
            self._passthrough(b)
            return False
        if self.pending.pop(b.rid, None) is not None and not self._said_mismatch:
            # Efficient mode, yet Envoy sends the response: its configuration is full-duplex.
            self._said_mismatch = True
            log.warning("epp.mode is efficient but Envoy sends responses to the picker: its ext_proc "
                        "processing_mode is not the efficient one (phasewise epp --print-envoy-config --mode "
                        "efficient); completing requests from the responses")
        ep, r = b.ep, b.r
        if b.status == 200 and b.relay is not None and not ends_with_done(b.relay.tail()):
            # The proxy's rule (routerd.daemon.proxy): a stream without vLLM's last event is cut.
            self._broken(b, "no_done", NO_DONE)
            return True
        if b.status >= 500:
            ep.m.err_status.inc()
            d.router.note_failure(ep, "status")
        elif b.status:
            d.router.note_success(ep)
        if b.status == 200:
            relay = b.relay
            if relay is not None:
                tokens = stream_tokens(relay.tail(), relay.events, b.path.endswith("/chat/completions"))
                settle_tokens(ep, r, tokens)
                d.observe_finished(r, b.t0, relay.t_first, tokens)
            else:
                m = _COMPLETION_TOKENS.search(b.body)
                tokens = int(m.group(1)) if m else 0
                ep.on_first_token(r)
                ep.on_tokens(r, tokens)
                d.observe_finished(r, b.t0, None, tokens)
        d.metrics.count_response(b.status)
        d.router.finish(r)
        self.m.outcome["completed"].inc()
        return False

    def _broken(self, b: _Booking, reason: str, what: str) -> None:
        """``b``'s streamed answer broke (``reason``: a ``phasewise_streams_broken_total`` reason):
        counted as routerd's proxy counts it (a 502, an upstream error of kind stream or timeout,
        passive health), never as a completion; released."""
        ep, d = b.ep, self.d
        timeout = reason == "timeout"
        (ep.m.err_timeout if timeout else ep.m.err_stream).inc()
        d.router.note_failure(ep, "timeout" if timeout else "stream")
        ep.m.streams_broken[reason].inc()
        log.warning("instance %s %s", ep.name, what)
        d.metrics.count_response(502)
        d.router.finish(b.r)
        self.m.outcome["broken"].inc()

    def _passthrough(self, b: _Booking) -> None:
        """Release a request that is not inference (a probe) without counting it as one."""
        if self.d.router.finish(b.r):
            self.m.outcome["passthrough"].inc()

    def _cancelled(self, b: _Booking) -> None:
        if not b.inference:
            self._passthrough(b)
            return
        relay = b.relay
        if relay is not None and _DONE in relay.tail() and not b.r.done:
            # The client read ``[DONE]`` and closed before the upstream ended its body (the openai
            # client does), so Envoy reset the stream: the answer was delivered in full (the proxy's
            # rule, ``_DeliveredThenClosed``).
            self._complete(b)
            return
        if self.d.router.finish(b.r):
            self.d.metrics.client_disconnects.inc()
            self.d.metrics.count_response(499)
            self.m.outcome["cancelled"].inc()

    # -- efficient mode: the access log ------------------------------------------
    def _await_access_log(self, b: _Booking) -> None:
        """Envoy ended ``b``'s ext_proc stream: its access-log entry completes it; without one it is
        released after ``epp.completion_timeout_s``."""
        b.stream_ended = True
        log.debug("ext_proc stream of %s ended; access-log entry %s", b.rid,
                  "awaited" if b.rid in self.pending else "already in")
        if b.rid not in self.pending:
            return
        loop = asyncio.get_running_loop()
        self._timers[b.rid] = loop.call_later(self.d.settings.epp.completion_timeout_s, self._unreported, b.rid)

    def _unreported(self, rid: str) -> None:
        self._timers.pop(rid, None)
        b = self.pending.pop(rid, None)
        if b is not None and self.d.router.finish(b.r):
            self.m.outcome["unreported"].inc()

    def on_access_log(self, entry) -> None:
        """Complete the booking an HTTP access-log entry (``envoy.data.accesslog.v3.HTTPAccessLogEntry``) names."""
        rid = entry.request.request_headers.get(REQUEST_ID_HEADER)
        if not self.efficient and not self._said_als_mismatch:
            # Only the efficient Envoy configuration sends access-log entries; with it, Envoy ends
            # each ext_proc stream after the request phase, and a full-duplex picker sees every
            # request end there (counted 499, released early).
            self._said_als_mismatch = True
            log.warning("epp.mode is full-duplex but Envoy sends access-log entries, as the efficient "
                        "configuration does (phasewise epp --print-envoy-config --mode efficient): requests "
                        "end after their request phase here and count as cancelled; run the picker with "
                        "epp.mode efficient, or Envoy with the full-duplex configuration")
        b = self.pending.pop(rid, None) if rid else None
        if b is None:
            if rid:
                self.m.access_log_unknown.inc()
            return
        t = self._timers.pop(rid, None)
        if t is not None:
            t.cancel()
        log.debug("access-log entry of %s (ext_proc stream %s)", rid, "ended" if b.stream_ended else "open")
        if not b.inference:
            self._passthrough(b)
            return
        d = self.d
        cp = entry.common_properties
        served = cp.upstream_remote_address.socket_address
        if served.address:
            host = served.address
            self._move_to(b, f"[{host}]:{served.port_value}" if ":" in host else f"{host}:{served.port_value}")
        ep, r = b.ep, b.r
        status = entry.response.response_code.value
        flags = cp.response_flags
        start = cp.start_time.ToNanoseconds() / 1e9 if cp.HasField("start_time") else None
        tokens, e2e, ttft, tail, sse = self._lua_figures(cp, b, start)
        # A client that closed after reading [DONE] (the openai client does) got the whole answer.
        client_gone = flags.downstream_connection_termination and _DONE not in tail
        broken = None if client_gone else _upstream_broke(entry, flags)
        if broken is not None and status and status < 300:
            # The upstream failed after its headers (died, reset, timed out mid-stream): the
            # client got a cut answer. Counted as routerd's proxy counts it: 502, an upstream
            # error of kind stream (or timeout), passive health.
            self._broken(b, "timeout" if broken == "timeout" else "closed",
                         f"broke off a stream ({entry.response.response_code_details or 'response flags'})")
            return
        if status == 200 and sse and not client_gone and not ends_with_done(tail):
            # Ended cleanly for Envoy, yet without vLLM's last event (the proxy's rule).
            self._broken(b, "no_done", NO_DONE)
            return
        if flags.upstream_connection_failure or flags.no_healthy_upstream:
            ep.m.err_connect.inc()
            d.router.note_connect_failure(ep)
        elif status >= 500 and served.address:
            ep.m.err_status.inc()
            d.router.note_failure(ep, "status")
        elif status:
            d.router.note_success(ep)
        if cp.HasField("time_to_last_downstream_tx_byte") and start is not None:
            end = start + cp.time_to_last_downstream_tx_byte.ToNanoseconds() / 1e9
            self.m.completion_delay.observe(max(0.0, time.time() - end))
        if status == 200 and not client_gone:
            ep.on_first_token(r)
            ep.on_tokens(r, tokens)
            m = d.metrics
            if e2e is not None:
                m.e2e.observe(e2e)
                if ttft is not None:
                    m.ttft.observe(ttft)
                    if tokens > 1:
                        m.tpot.observe((e2e - ttft) / (tokens - 1))
            m.generation_tokens.inc(tokens)
            m.count_bucket(r.predicted_bucket, _bucket(tokens, d.router.bucket_edges))
            d.metrics.count_response(200)
        elif flags.downstream_connection_termination or not status:
            d.metrics.client_disconnects.inc()
            d.metrics.count_response(499)
        else:
            d.metrics.count_response(status)
        d.router.finish(r)
        self.m.outcome["completed"].inc()

    def _lua_figures(self, cp, b: _Booking,
                     start: float | None) -> tuple[int, float | None, float | None, bytes, bool]:
        """(output tokens, E2E s, TTFT s, the response's last bytes, whether it was an SSE stream)
        from the Lua filter's metadata and the entry's times."""
        ns = cp.metadata.filter_metadata.get(LUA_NAMESPACE) if cp.HasField("metadata") else None
        f = ns.fields if ns is not None else {}
        tail = f["tail"].string_value.encode() if "tail" in f else b""
        sse = "sse" in f and f["sse"].bool_value
        if sse:
            tokens = stream_tokens(tail, int(f["events"].number_value) if "events" in f else 0,
                                   b.path.endswith("/chat/completions"))
        else:
            m = None
            for m in _COMPLETION_TOKENS.finditer(tail):
                pass
            tokens = int(m.group(1)) if m else 0
        e2e = cp.time_to_last_downstream_tx_byte.ToNanoseconds() / 1e9 if cp.HasField(
            "time_to_last_downstream_tx_byte") else None
        ttft = None
        if start is not None and "first_us" in f:
            try:
                ttft = max(0.0, int(f["first_us"].string_value) / 1e6 - start)
            except ValueError:
                ttft = None
        return tokens, e2e, ttft, tail, sse

    def release_all(self) -> None:
        """Release every booking awaiting an access-log entry (shutdown)."""
        for t in self._timers.values():
            t.cancel()
        self._timers.clear()
        for b in self.pending.values():
            self.d.router.finish(b.r)
        self.pending.clear()


#: Envoy response flags that say the upstream failed (UT, UR, UC, UF, UPE, URX, UMSDR, SI).
_UPSTREAM_FAILURE_FLAGS = ("upstream_remote_reset", "upstream_connection_termination", "upstream_connection_failure",
                           "upstream_protocol_error", "upstream_retry_limit_exceeded", "upstream_overflow")
_UPSTREAM_TIMEOUT_FLAGS = ("upstream_request_timeout", "upstream_max_stream_duration_reached", "stream_idle_timeout")


def _upstream_broke(entry, flags) -> str | None:
    """``"stream"`` or ``"timeout"`` when an access-log entry says the upstream failed (Envoy's
    response flags, or ``response_code_details`` ``upstream_reset_after_response_started...``),
    else None."""
    if any(getattr(flags, f) for f in _UPSTREAM_TIMEOUT_FLAGS):
        return "timeout"
    if any(getattr(flags, f) for f in _UPSTREAM_FAILURE_FLAGS):
        return "stream"
    details = entry.response.response_code_details
    if details.startswith("upstream_reset") or details.startswith("upstream_per_try_timeout"):
        return "stream"
    return None


def _bucket(tokens: int, edges) -> int:
    from routerd.model import bucket_of

    return bucket_of(tokens, edges)


class AccessLogServicer(als_pb2_grpc.AccessLogServiceServicer):
    """``envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs``: Envoy's per-request entries
    complete the bookings of efficient mode (:meth:`ExtProcServicer.on_access_log`)."""

    def __init__(self, ext_proc: ExtProcServicer) -> None:
        self.ext_proc = ext_proc

    async def StreamAccessLogs(self, request_iterator, context) -> als_pb2.StreamAccessLogsResponse:
        async for msg in request_iterator:
            if msg.HasField("http_logs"):
                for entry in msg.http_logs.log_entry:
                    try:
                        self.ext_proc.on_access_log(entry)
                    except Exception:  # noqa: BLE001 - one bad entry must not drop the others
                        log.exception("access-log entry not applied")
        return als_pb2.StreamAccessLogsResponse()


class EppServer:
    """The picker's listeners over a started daemon: ext_proc (+ access log), health, metrics."""

    def __init__(self, daemon: "Daemon") -> None:
        self.d = daemon
        cfg = daemon.settings.epp
        self.mode = cfg.mode
        self.metrics = EppMetrics(daemon.metrics.registry)
        self.ext_proc = ExtProcServicer(daemon, self.metrics, cfg.mode == "efficient")
        # liveness is SERVING from the start and stays so; the rest follow readiness.
        self.readiness = ReadinessHealth([n for n in HEALTH_SERVICES if n != "liveness"])
        self.health = self.readiness.servicer
        self.server: grpc.aio.Server | None = None
        self.health_server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.health_port: int | None = None
        self.metrics_port: int | None = None
        self._runner: Any = None
        self._sweeper: asyncio.Task | None = None

    async def start(self) -> None:
        """Bind every listener of ``epp`` (ports 0: free ones, see the ``*_port`` attributes).

        Raises:
            routerd.errors.ConfigError: an address cannot be bound.
        """
        from routerd.errors import ConfigError

        cfg = self.d.settings.epp
        host = cfg.host
        opts = [("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 16 * 1024 * 1024)]
        self.server = grpc.aio.server(options=opts)
        ep_grpc.add_ExternalProcessorServicer_to_server(self.ext_proc, self.server)
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(AccessLogServicer(self.ext_proc), self.server)
        if cfg.health_port == 0:
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self._bind(self.server, host, cfg.port, "epp.port", ConfigError)
        if cfg.health_port != 0:
            self.health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = self._bind(self.health_server, host, cfg.health_port, "epp.health_port", ConfigError)
        else:
            self.health_port = self.port
        # liveness is SERVING while the process answers; the rest follow routerd's readiness.
        await self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
        if cfg.metrics_port is not None:
            await self._start_metrics(host, cfg.metrics_port)
        self.d.ready_listeners.append(self.set_serving)
        self.set_serving(self.d.readiness()[0])
        self._sweeper = asyncio.create_task(self._sweep())
        log.info("endpoint picker (%s mode) listening: ext_proc %s:%d, health %s:%d, metrics %s", self.mode, host,
                 self.port, host, self.health_port,
                 f"http://{host}:{self.metrics_port}/metrics" if self.metrics_port is not None else "off")

    @staticmethod
    def _bind(server, host: str, port: int, field: str, error) -> int:
        addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            bound = server.add_insecure_port(addr)
        except RuntimeError as e:
            raise error(f"{field}: cannot listen on {addr}: {e}") from None
        return bound

    async def _start_metrics(self, host: str, port: int) -> None:
        from aiohttp import web

        from routerd.errors import ConfigError

        proxy = self.d.proxy  # routerd's own handlers: the same /metrics, /healthz and /readyz
        app = web.Application()
        app.router.add_get("/metrics", proxy.metrics)
        app.router.add_get("/healthz", proxy.healthz)
        app.router.add_get("/readyz", proxy.readyz)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        try:
            await site.start()
        except OSError as e:
            raise ConfigError(f"epp.metrics_port: cannot listen on {host}:{port}: {e.strerror or e}") from None
        self.metrics_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def set_serving(self, serving: bool) -> None:
        """Set ``readiness``, the ext_proc service and "" to SERVING or NOT_SERVING."""
        self.readiness.set_serving(serving)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            # Readiness also changes with time (a connect-failure cooldown running out).
            self.set_serving(self.d.readiness()[0])

    async def stop(self, grace_s: float = 0.5) -> None:
        """Stop every listener (open streams get ``grace_s``) and release the bookings left."""
        await cancel_task(self._sweeper)
        self._sweeper = None
        if self.set_serving in self.d.ready_listeners:
            self.d.ready_listeners.remove(self.set_serving)
        await self.health.enter_graceful_shutdown()
        for srv in (self.server, self.health_server):
            if srv is not None:
                await srv.stop(grace_s)
        self.server = self.health_server = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self.ext_proc.release_all()
