"""routerd's Prometheus metrics (``phasewise_*``), in a registry of their own per daemon.

Per-endpoint series are resolved once per endpoint (:class:`EndpointMetrics`) so the
request path does not look labels up, and removed when the endpoint leaves
(production-stack#888: removed endpoints must not keep exporting series).

Latency buckets cover 1 ms to 10 min: TTFT and TPOT of a healthy instance sit in the
10-500 ms range; E2E of long generations reaches minutes.
"""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24,
                    20.48, 40.96, 81.92, 163.84, 327.68, 655.36)
_TPOT_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2,
                 0.3, 0.5, 1.0, 2.5)
_DECISION_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 1e-2)

#: Label values of ``phasewise_fallbacks_total{reason}``.
FALLBACK_REASONS = ("policy_error", "policy_fallback", "stale_state", "hold_idle", "invalid_choice")
#: Label values of ``phasewise_streams_broken_total{reason}``: the upstream connection closed or
#: reset mid-stream, its HTTP framing broke, it stalled past ``upstream.read_timeout_s``, or its
#: body ended cleanly without vLLM's terminal ``data: [DONE]`` event.
STREAM_BROKEN_REASONS = ("closed", "malformed", "timeout", "no_done")

#: Prefix lengths in KV blocks (16 tokens each by default): 0 (no match) up to 16,384 blocks;
#: ``prefix.max_prompt_tokens``' default, 131,072 tokens, is 8,192 blocks of 16.
_PREFIX_BLOCK_BUCKETS = (0, 1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class EngineIndexCollector:
    """Counters of every endpoint's KV-event index, read at each scrape from ``source()``:
    ``{endpoint: (EngineBlockIndex, EndpointStats or None)}`` (the daemon's subscriptions).

    * ``phasewise_prefix_kv_event_batches_total{endpoint,outcome}``: batches ``applied``,
      ``missed`` (sequence gaps), ``duplicate``, ``malformed`` (not decodable, or holding an event
      type the decoder does not know: ``unknown_type``, counted in both; the whole batch is refused
      and the index goes stale, so nothing is applied in part);
    * ``phasewise_prefix_engine_dropped_blocks_total{endpoint,cause}``: stored blocks not indexed,
      by cause (``routerd.prefix.engine_index.DROP_CAUSES``: ``block_size`` is an event of another
      size than the engine's learnt one);
    * ``phasewise_prefix_engine_stale_total{endpoint,reason}``: times the index went stale, by reason.
    """

    def __init__(self, source: Callable[[], dict[str, tuple[Any, Any]]]) -> None:
        self._source = source

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        batches = CounterMetricFamily("phasewise_prefix_kv_event_batches",
                                      "KV-event batches per endpoint, by outcome (see EngineIndexCollector).",
                                      labels=["endpoint", "outcome"])
        dropped = CounterMetricFamily("phasewise_prefix_engine_dropped_blocks",
                                      "Stored blocks an endpoint's KV-event index did not index, by cause.",
                                      labels=["endpoint", "cause"])
        stale = CounterMetricFamily("phasewise_prefix_engine_stale",
                                    "Times an endpoint's KV-event index went stale, by reason.",
                                    labels=["endpoint", "reason"])
        for name, (idx, stats) in sorted(self._source().items()):
            for outcome, v in (("applied", idx.batches_applied), ("missed", idx.batches_missed),
                               ("duplicate", idx.batches_duplicate), ("malformed", idx.batches_malformed),
                               ("unknown_type", getattr(stats, "unknown_events", 0) if stats is not None else 0)):
                batches.add_metric([name, outcome], float(v))
            for cause, v in idx.dropped_blocks.items():
                dropped.add_metric([name, cause], float(v))
            for reason, v in idx.stale_transitions.items():
                stale.add_metric([name, reason], float(v))
        yield batches
        yield dropped
        yield stale

    def describe(self):
        return []


class EndpointMetrics:
    """The label children of one endpoint (resolved once)."""

    __slots__ = ("decisions", "in_flight", "err_connect", "err_status", "err_stream", "err_timeout", "ready",
                 "state_stale", "ejections", "ejected", "prefix_index_blocks", "streams_broken")

    def __init__(self, m: "Metrics", name: str, in_flight: Callable[[], float],
                 ejected: Callable[[], float] | None = None,
                 prefix_index_blocks: Callable[[], float] | None = None) -> None:
        self.decisions = m.decisions.labels(name)
        self.in_flight = m.in_flight.labels(name)
        self.in_flight.set_function(in_flight)
        self.err_connect = m.upstream_errors.labels(name, "connect")
        self.err_status = m.upstream_errors.labels(name, "status")
        self.err_stream = m.upstream_errors.labels(name, "stream")
        self.err_timeout = m.upstream_errors.labels(name, "timeout")
        self.streams_broken = {r: m.streams_broken.labels(name, r) for r in STREAM_BROKEN_REASONS}
        self.ready = m.endpoint_ready.labels(name)
        self.state_stale = m.endpoint_state_stale.labels(name)
        self.ejections = m.ejections.labels(name)
        self.ejected = m.endpoint_ejected.labels(name)
        if ejected is not None:
            self.ejected.set_function(ejected)
        self.prefix_index_blocks = m.prefix_index_blocks.labels(name)
        if prefix_index_blocks is not None:
            self.prefix_index_blocks.set_function(prefix_index_blocks)


class Metrics:
    """Every routerd metric, registered in ``self.registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter("phasewise_requests", "HTTP requests answered on the inference routes, and on paths "
                                "routerd does not serve (404, 405), by status code.",
                                ["code"], registry=r)
        self.rejections = Counter("phasewise_rejections",
                                  "Requests refused before dispatch, by reason (queue_full, no_endpoint, draining, "
                                  "bad_request, not_found, too_large, body_timeout).", ["reason"], registry=r)
        self.e2e = Histogram("phasewise_request_e2e_seconds",
                             "End-to-end latency from arrival at routerd to the last byte (s).",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("phasewise_request_ttft_seconds",
                              "Time to first token: arrival at routerd to the first streamed event (s).",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("phasewise_request_tpot_seconds",
                              "Time per output token after the first: (E2E - TTFT) / (tokens - 1) (s).",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.queue_depth = Gauge("phasewise_router_queue_depth", "Requests held in the router queue.", registry=r)
        self.router_wait = Histogram("phasewise_router_wait_seconds",
                                     "Time a request spent in the router queue before dispatch (s).",
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.decision_time = Histogram("phasewise_decision_seconds",
                                       "Time the policy took for one decision (s).",
                                       buckets=_DECISION_BUCKETS, registry=r)
        self.decisions = Counter("phasewise_decisions", "Dispatch decisions per endpoint.", ["endpoint"],
                                 registry=r)
        self.holds = Counter("phasewise_holds", "Policy decisions that held the queue head.", registry=r)
        self.fallbacks = Counter("phasewise_fallbacks",
                                 "Round-robin fail-open decisions, by reason: policy_error (it raised), "
                                 "policy_fallback (it fell back itself, e.g. dqn on another instance count), "
                                 "stale_state (every candidate's sidecar state is stale), hold_idle (it held "
                                 "an idle cluster too long), invalid_choice.", ["reason"], registry=r)
        self.in_flight = Gauge("phasewise_in_flight_requests",
                               "Requests dispatched to the endpoint and not finished.", ["endpoint"], registry=r)
        self.predicted_vs_actual = Counter("phasewise_predicted_bucket",
                                           "Finished requests by predicted and actual decode bucket.",
                                           ["predicted", "actual"], registry=r)
        self.upstream_errors = Counter("phasewise_upstream_errors",
                                       "Upstream failures by endpoint and kind (connect, status = 5xx answer, "
                                       "stream = broken after the first byte, timeout).",
                                       ["endpoint", "kind"], registry=r)
        self.streams_broken = Counter(
            "phasewise_streams_broken",
            "Streamed (SSE) answers that ended without vLLM's terminal 'data: [DONE]' event, by endpoint and "
            "reason: closed (the upstream connection closed or reset mid-stream: an engine killed, a proxy in "
            "between gone), malformed (broken HTTP framing), timeout (no byte for upstream.read_timeout_s), "
            "no_done (the body ended cleanly without [DONE]). The client is told (an SSE error event, no "
            "[DONE]); each is a 502 in phasewise_requests_total, never a completion.",
            ["endpoint", "reason"], registry=r)
        self.retries = Counter("phasewise_upstream_retries",
                               "Requests re-sent to another endpoint after a failure before the first byte.",
                               registry=r)
        self.client_disconnects = Counter("phasewise_client_disconnects",
                                          "Requests whose client went away before the answer ended.", registry=r)
        self.prompt_tokens = Counter("phasewise_prompt_tokens", "Prompt tokens of dispatched requests (estimate).",
                                     registry=r)
        self.generation_tokens = Counter("phasewise_generation_tokens", "Output tokens of finished requests.",
                                         registry=r)
        self.endpoint_ready = Gauge("phasewise_endpoint_ready",
                                    "1 while the endpoint takes new requests: its source says it is ready and its "
                                    "sidecar's latest snapshot (younger than state.max_age_s) does not report it "
                                    "unhealthy.", ["endpoint"], registry=r)
        self.endpoint_state_stale = Gauge("phasewise_endpoint_state_stale",
                                          "1 while the endpoint's sidecar state is stale or missing.",
                                          ["endpoint"], registry=r)
        self.grpc_unreported = Counter("phasewise_grpc_unreported",
                                       "gRPC-routed requests released by timeout without a ReportCompletion.",
                                       registry=r)
        self.reloads = Counter("phasewise_config_reloads", "Configuration reloads, by result.", ["result"],
                               registry=r)
        self.client_connections = Gauge("phasewise_client_connections", "Open client connections to the HTTP front.",
                                        registry=r)
        self.client_connections_closed = Counter(
            "phasewise_client_connections_closed",
            "Client connections closed by routerd's limits, by reason (header_timeout, idle_timeout, too_many).",
            ["reason"], registry=r)
        self.ejections = Counter("phasewise_endpoint_ejections",
                                 "Ejections of an endpoint by passive health checking (consecutive failures).",
                                 ["endpoint"], registry=r)
        self.endpoint_ejected = Gauge("phasewise_endpoint_ejected",
                                      "1 while the endpoint is ejected (no new requests), else 0.", ["endpoint"],
                                      registry=r)
        self.ejections_capped = Counter("phasewise_endpoint_ejections_capped",
                                        "Ejections not made because upstream.outlier.max_ejected_percent was reached.",
                                        registry=r)
        self.endpointslice_skipped = Counter(
            "phasewise_endpointslice_entries_skipped",
            "EndpointSlice entries skipped because their address is not an IP address (each counted once).",
            registry=r)
        self.profile_fallbacks = Counter(
            "phasewise_profile_fallbacks",
            "Endpoints whose own hardware profile (endpoints[].profile, kubernetes.profiles) could not be "
            "loaded, so routerd's profile serves them instead (each endpoint and profile counted once).",
            registry=r)
        self.prefix_match_blocks = Histogram(
            "phasewise_prefix_match_blocks",
            "Leading KV blocks of the request's prompt believed cached on the chosen endpoint, per policy "
            "decision on a prompt of at least one block, by where the belief comes from (source: approximate = "
            "the policy's own dispatch history, precise = the engine's KV events).", ["source"],
            buckets=_PREFIX_BLOCK_BUCKETS, registry=r)
        self.prefix_update_time = Histogram(
            "phasewise_prefix_index_update_seconds",
            "Time to store decisions' prompts in the policies' approximate prefix indexes and evict to their "
            "bounds, run on the event loop's next turn after the decisions (s).",
            buckets=_DECISION_BUCKETS, registry=r)
        self.prefix_prompt_blocks = Histogram(
            "phasewise_prefix_prompt_blocks",
            "KV blocks hashed per request prompt (at most prefix.max_prompt_tokens / block_size).",
            buckets=_PREFIX_BLOCK_BUCKETS, registry=r)
        self.prefix_index_blocks = Gauge(
            "phasewise_prefix_index_blocks",
            "KV blocks the policies' approximate prefix indexes hold for the endpoint (summed over the "
            "per-model policies; each bounded by prefix.index_capacity_blocks).", ["endpoint"], registry=r)
        self.prefix_fallbacks = Counter(
            "phasewise_prefix_fallbacks",
            "Precise mode: a policy's prefix queries for the endpoint (one per candidate per decision) answered "
            "by its approximate index instead, because the endpoint's KV-event index is stale, by reason "
            "(see routerd/routerd/prefix/engine_index.py STALE_REASONS).", ["endpoint", "reason"],
            registry=r)
        self._prefix_fallback_children: dict[tuple[str, str], Counter] = {}
        self.prefix_engine_blocks = Gauge(
            "phasewise_prefix_engine_index_blocks",
            "KV blocks the endpoint's engine reports cached in its KV events (precise mode's index, bounded "
            "by prefix.kv_events.max_blocks).", ["endpoint"], registry=r)
        self.prefix_engine_stale = Gauge(
            "phasewise_prefix_engine_index_stale",
            "1 while the endpoint's KV-event index is stale (a gap, a restart, garbage, silence): its prefix "
            "matches come from the approximate index; 0 while it answers.", ["endpoint"], registry=r)
        self.prefix_engine_block_size = Gauge(
            "phasewise_prefix_engine_block_size",
            "Tokens per KV block of the endpoint's engine as its KV events report it (vLLM: 16 on most GPU "
            "backends, 128 on the CPU build); its blocks are keyed in it. 0 before its first stored event.",
            ["endpoint"], registry=r)
        self.prefix_block_size_mismatch = Gauge(
            "phasewise_prefix_block_size_mismatch",
            "1 while the endpoint's engine reports another KV block size than prefix.block_size expects "
            "(both named): routerd keys its blocks in the engine's size.", ["endpoint", "configured", "reported"],
            registry=r)
        self.prefix_problems = Counter(
            "phasewise_prefix_identity_problems",
            "Requests precise mode could not key on the engine's token ids, by reason (no_tokenizer: "
            "prefix.tokenizer could not be loaded; chat_template: no usable chat template; chat_render: the template failed; chat_unsupported: a non-text message part; "
            "tokenizer: encoding failed); they are matched against the approximate index.", ["reason"], registry=r)
        self.prefix_engine_losses = Counter(
            "phasewise_prefix_engine_cache_lost",
            "Times an endpoint's engine lost what routerd believed it cached (restart, cache reset, lost "
            "events, disconnect), by cause; every prefix index forgets the endpoint's blocks then.",
            ["endpoint", "cause"], registry=r)
        self._mismatch: dict[str, tuple[str, str]] = {}
        self._losses: set[tuple[str, str]] = set()
        self.fallback_children = {reason: self.fallbacks.labels(reason) for reason in FALLBACK_REASONS}
        self._bucket_children: dict[tuple[str, str], Counter] = {}
        self._code_children: dict[int, Counter] = {}
        self._reject_children: dict[str, Counter] = {}

    def endpoint(self, name: str, in_flight: Callable[[], float],
                 ejected: Callable[[], float] | None = None,
                 prefix_index_blocks: Callable[[], float] | None = None) -> EndpointMetrics:
        """Create the series of endpoint ``name``; ``in_flight()``, ``ejected()`` and
        ``prefix_index_blocks()`` are read at each scrape."""
        return EndpointMetrics(self, name, in_flight, ejected, prefix_index_blocks)

    def count_prefix_fallback(self, endpoint: str, reason: str) -> None:
        """Count one prefix match on ``endpoint`` answered by the approximate index for ``reason``."""
        key = (endpoint, reason)
        c = self._prefix_fallback_children.get(key)
        if c is None:
            c = self._prefix_fallback_children[key] = self.prefix_fallbacks.labels(endpoint, reason)
        c.inc()

    def engine_index(self, name: str, index: Any) -> None:
        """Export endpoint ``name``'s KV-event index (read at each scrape); ``index`` None removes it."""
        if index is None:
            for metric in (self.prefix_engine_blocks, self.prefix_engine_stale, self.prefix_engine_block_size):
                try:
                    metric.remove(name)
                except KeyError:
                    pass
            self.block_size_mismatch(name, None, None)
            return
        self.prefix_engine_blocks.labels(name).set_function(lambda: float(index.size))
        self.prefix_engine_stale.labels(name).set_function(lambda: float(index.check() is not None))
        self.prefix_engine_block_size.labels(name).set_function(lambda: float(index.reported_block_size or 0))

    def block_size_mismatch(self, name: str, configured: int | None, reported: int | None) -> None:
        """Set endpoint ``name``'s ``phasewise_prefix_block_size_mismatch`` to the pair (one series;
        ``reported`` None clears it)."""
        old = self._mismatch.pop(name, None)
        if old is not None:
            self.prefix_block_size_mismatch.remove(name, *old)
        if reported is not None and configured is not None and configured != reported:
            labels = (str(configured), str(reported))
            self._mismatch[name] = labels
            self.prefix_block_size_mismatch.labels(name, *labels).set(1)

    def count_engine_loss(self, name: str, cause: str) -> None:
        """Count one loss of endpoint ``name``'s cached blocks (``phasewise_prefix_engine_cache_lost``)."""
        self._losses.add((name, cause))
        self.prefix_engine_losses.labels(name, cause).inc()

    def remove_endpoint(self, name: str) -> None:
        """Delete every series labelled with endpoint ``name``."""
        self.engine_index(name, None)
        for metric in (self.decisions, self.in_flight, self.endpoint_ready, self.endpoint_state_stale,
                       self.ejections, self.endpoint_ejected, self.prefix_index_blocks):
            try:
                metric.remove(name)
            except KeyError:
                pass
        for key in [k for k in self._losses if k[0] == name]:
            self._losses.discard(key)
            self.prefix_engine_losses.remove(*key)
        for key in [k for k in self._prefix_fallback_children if k[0] == name]:
            del self._prefix_fallback_children[key]
            try:
                self.prefix_fallbacks.remove(*key)
            except KeyError:
                pass
        for kind in ("connect", "status", "stream", "timeout"):
            try:
                self.upstream_errors.remove(name, kind)
            except KeyError:
                pass
        for reason in STREAM_BROKEN_REASONS:
            try:
                self.streams_broken.remove(name, reason)
            except KeyError:
                pass

    def count_response(self, code: int) -> None:
        """Count one answered HTTP request with status ``code``."""
        c = self._code_children.get(code)
        if c is None:
            c = self._code_children[code] = self.requests.labels(str(code))
        c.inc()

    def count_rejection(self, reason: str) -> None:
        """Count one request refused before dispatch for ``reason``."""
        c = self._reject_children.get(reason)
        if c is None:
            c = self._reject_children[reason] = self.rejections.labels(reason)
        c.inc()

    def count_bucket(self, predicted: int | None, actual: int) -> None:
        """Count one finished request by predicted (None = no prediction) and actual bucket."""
        key = ("none" if predicted is None else str(predicted), str(actual))
        c = self._bucket_children.get(key)
        if c is None:
            c = self._bucket_children[key] = self.predicted_vs_actual.labels(*key)
        c.inc()
