"""routerd's configuration: pydantic models read from a YAML file, environment variables and flags.

Precedence, lowest first: defaults, the YAML file (``phasewise serve --config FILE``),
environment variables ``PHASEWISE_<FIELD>`` with ``__`` between nested fields
(``PHASEWISE_HTTP__PORT=8080``, ``PHASEWISE_POLICY__NAME=late_binding``; lists and
objects as JSON, ``PHASEWISE_MODELS='["llama-2-7b"]'``), then command-line flags.
Environment parsing is pydantic-settings' ``EnvSettingsSource``.

Every error is a :class:`routerd.errors.ConfigError` whose one-line message names
where the bad value came from (file, environment variable or flag) and its field path,
indexed like ``endpoints[2].url``.

An example file::

    http: {host: 0.0.0.0, port: 8000}
    grpc: {port: 50051}
    models: [llama-2-7b]
    endpoints:
      - {name: vllm-0, url: "http://10.0.0.7:8000", state_address: "10.0.0.7:50061"}
      - {name: vllm-1, url: "http://10.0.0.8:8000", state_address: "10.0.0.8:50061"}
    policy: {name: late_binding, params: {reserve_fraction: 0.1}}
    profile: llama2-7b-v100
    prefix: {mode: approximate, chunk_blocks: 4, index_capacity_blocks: 262144}
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Mapping
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from routerd.errors import ConfigError

ENV_PREFIX = "PHASEWISE_"
ENV_NESTED_DELIMITER = "__"

#: Default request body limit (bytes): a 1 MiB prompt plus room for JSON escaping and
#: the other fields. Bigger bodies get 413 (GIE#854: define a limit instead of failing).
DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024


#: Largest config file read (bytes): 8x what a ConfigMap can hold; parsing more would take
#: seconds of CPU (measured: 10.8 s for 1 MiB of endpoints on a loaded 2-core machine).
MAX_CONFIG_BYTES = 8 * 1024 * 1024


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)


class ListenConfig(_Model):
    """One listening socket."""

    host: str = "0.0.0.0"
    """Address to bind (``0.0.0.0`` = every IPv4 interface)."""
    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port; 0 picks a free one (logged at start-up)."""


class HttpConfig(ListenConfig):
    """The OpenAI-compatible HTTP front and the limits on its client connections
    (``routerd.daemon.frontend``)."""

    header_timeout_s: float = Field(default=15.0, gt=0, le=3600)
    """A client must send a complete request (line and headers) within this long of connecting (s);
    one that sends nothing, or its headers byte by byte, is closed (nginx's ``client_header_timeout``
    is 60 s; LLM clients send theirs at once)."""
    body_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    """A request body must arrive within this long of its headers (s), else 408 (nginx's
    ``client_body_timeout``, 60 s)."""
    keepalive_timeout_s: float = Field(default=75.0, gt=0, le=3600)
    """An idle keep-alive connection is closed this long after its last response (s) (nginx's
    ``keepalive_timeout``, 75 s); a next request begun meanwhile must then be complete within
    ``header_timeout_s`` of its first byte."""
    max_connections: int = Field(default=10_000, ge=1)
    """Most open client connections; one more gets 503 and is closed. Lowered at start to half
    the process's open-file limit (logged), so clients can never take every descriptor."""


class GrpcConfig(ListenConfig):
    """The gRPC listener (``phasewise.v1.RouterService`` and ``grpc.health.v1``)."""

    port: int = Field(default=50051, ge=0, le=65535)
    enabled: bool = True
    """Serve the gRPC API at all."""
    report_timeout_s: float = Field(default=600.0, gt=0)
    """A gRPC-routed request never reported with ``ReportCompletion`` is released from the
    in-flight bookkeeping after this long (s)."""


def _check_host_port(value: str, what: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{what} must be host:port, got {value!r}")
    return value


def normalize_url(value: str) -> str:
    """An endpoint base URL checked and without a trailing slash: ``http(s)://host[:port]``.

    routerd sends ``/v1/completions`` and the other OpenAI paths itself, so the URL names
    the server only.

    Raises:
        ValueError: another scheme, no host, white space, credentials, a path (``/v1``
            included), a query or fragment, or a port outside 1-65535.
    """
    v = value.strip()
    if any(c.isspace() for c in v):
        raise ValueError(f"must not contain white space, got {value!r}")
    parts = urlsplit(v)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http:// or https:// URL with a host, got {value!r}")
    if parts.username is not None or parts.password is not None:
        raise ValueError("must not carry credentials (user:password@); the URL is logged and exported in "
                         "metrics")
    if parts.path not in ("", "/"):
        hint = " (routerd adds /v1/... itself)" if parts.path.rstrip("/").endswith("/v1") else ""
        raise ValueError(f"must not have a path{hint}: give the server only, like http://10.0.0.7:8000, "
                         f"got {value!r}")
    if parts.query or parts.fragment or "?" in v or "#" in v:
        raise ValueError(f"must not have a query or fragment, got {value!r}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"has an invalid port: {value!r}") from None
    if port == 0:
        raise ValueError(f"port 0 cannot be dialled (1-65535, or none for the scheme's default): {value!r}")
    host = parts.hostname
    if not host.startswith("[") and ":" not in host:
        try:
            host.encode("idna")  # empty or over-long labels ("a..b"): no resolver takes them
        except UnicodeError:
            raise ValueError(f"has an invalid host name {parts.hostname!r}") from None
        if not host.isascii():
            raise ValueError(f"host {parts.hostname!r} is not ASCII: give its IDNA form "
                             f"({host.encode('idna').decode()!r})")
    return parts.scheme + v[len(parts.scheme):].rstrip("/")


class EndpointConfig(_Model):
    """A statically configured serving instance."""

    name: str = Field(min_length=1)
    """Unique instance name (used in metrics labels and decisions)."""
    url: str
    """OpenAI-compatible base URL, e.g. ``http://10.0.0.7:8000``."""
    state_address: str | None = None
    """``host:port`` of the instance's state sidecar, or None (routerd's own bookkeeping only)."""
    models: list[str] = Field(default_factory=list)
    """Models it serves; replaces what its ``/v1/models`` lists. Empty: learned from its
    ``/v1/models`` (vLLM lists its served names and loaded LoRA adapters), refreshed every
    ``model_refresh_s``, after a 404 from it, and on a reload that changes models; while
    several models are possible (``models`` names two or more, or the lists and sidecar
    reports together name two or more) and that list is unknown or unreadable (401/403), the
    endpoint serves nothing (fail closed)."""

    profile: str | None = None
    """Hardware profile of this instance (a name or a profile YAML), for a pool of mixed GPUs
    serving one model: its KV blocks, batch limits and latency model, which the policies read per
    instance (``PolicyContext.profiles``; ``predicted_latency`` forecasts with it). None: the
    top-level ``profile``. It must serve that profile's model with the same block size."""
    kv_events: str | None = None
    """ZMQ address of the instance's vLLM KV-event publisher (``--kv-events-config``), e.g.
    ``tcp://10.0.0.7:5557``; read in ``prefix.mode: precise``. None: the URL's host and
    ``prefix.kv_events.port`` (vLLM publishes on ``tcp://*:5557`` by default); ``""``: this
    instance publishes none (precise matching falls back to the approximate index for it)."""

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return normalize_url(v)

    @field_validator("state_address")
    @classmethod
    def _state(cls, v: str | None) -> str | None:
        return None if v is None or v == "" else _check_host_port(v, "state_address")

    @field_validator("kv_events")
    @classmethod
    def _kv_events(cls, v: str | None) -> str | None:
        return v if v is None or v == "" else check_zmq_address(v)


def check_zmq_address(value: str) -> str:
    """A ZMQ address to connect to: ``tcp://host:port`` (IPv6 in brackets) or ``ipc://path``.

    Raises:
        ValueError: another transport, no host or path, a wildcard host (``*``: vLLM binds it,
            a subscriber must name the instance), white space, or a port outside 1-65535.
    """
    v = value.strip()
    if v != value or any(c.isspace() for c in v):
        raise ValueError(f"must not contain white space, got {value!r}")
    scheme, sep, rest = v.partition("://")
    if scheme == "ipc" and sep and rest:
        return v
    if scheme != "tcp" or not sep:
        raise ValueError(f"must be tcp://host:port or ipc://path, got {value!r}")
    host, colon, port = rest.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"must be tcp://host:port with a port in 1-65535, got {value!r}")
    if host == "*" or "/" in host or (":" in host and not (host.startswith("[") and host.endswith("]"))):
        raise ValueError(f"needs the instance's host (IPv6 in brackets), not {host!r}: {value!r}")
    return v


class KubernetesConfig(_Model):
    """Endpoint discovery from the EndpointSlices of a Service (watched by ``daemon.endpointslices``)."""

    enabled: bool = False
    namespace: str | None = None
    """Namespace of the Service; None = the pod's own namespace."""
    service: str | None = None
    """Service whose EndpointSlices list the vLLM pods (required when enabled)."""
    http_port_name: str = "http"
    """Name of the Service port that serves the OpenAI API."""
    state_port_name: str = "state"
    """Name of the Service port of the state sidecar (gRPC); absent = no sidecar."""
    kv_events_port_name: str = "kv-events"
    """Name of the Service port of vLLM's KV-event publisher (ZMQ); absent = the pod's address
    with ``prefix.kv_events.port``. Read in ``prefix.mode: precise``."""
    selector: str | None = None
    """Label selector of the EndpointSlices to watch instead of ``service``'s own
    (``kubernetes.io/service-name=<service>``), e.g. the slices of one Service per engine group:
    ``phasewise.io/pool=chat,phasewise.io/engine-group``. A Service's labels are copied to its
    EndpointSlices, so a selector on Service labels selects their slices."""
    profile_label: str | None = None
    """EndpointSlice label whose value picks each endpoint's hardware profile from ``profiles``
    (the operator's ``phasewise.io/engine-group``: one Service per group, mixed-GPU pools)."""
    profiles: dict[str, str] = Field(default_factory=dict)
    """Hardware profile (a name or YAML path) by the value of ``profile_label`` on the endpoint's
    EndpointSlice; an endpoint whose slice has no such label or value uses ``profile``. Each must
    be of ``profile``'s model and block size (``routerd.profiles.check_pool``)."""

    @model_validator(mode="after")
    def _service(self) -> "KubernetesConfig":
        if self.enabled and not (self.service or self.selector):
            raise ValueError("service (or selector) is required when kubernetes discovery is enabled")
        if self.profiles and not self.profile_label:
            raise ValueError("profiles needs profile_label: the EndpointSlice label whose value names the entry")
        return self


class PolicyConfig(_Model):
    """Routing policy by registry name, with its typed parameters (``phasewise policies``)."""

    name: str = "round_robin"
    """A servable policy of the registry (``phasewise policies``); the oracle policies, which read
    true output lengths a live router cannot know, are refused."""
    params: dict[str, Any] = Field(default_factory=dict)
    """The policy's typed parameters (checked here against its ``Params`` model)."""

    @model_validator(mode="after")
    def _known_and_servable(self) -> "PolicyConfig":
        from pydantic import ValidationError as _VE

        from routerd.policies.registry import POLICIES

        cls = POLICIES.get(self.name)
        if cls is None or cls.oracle:
            why = "unknown policy" if cls is None else "reads true output lengths, so it runs only in the simulator:"
            raise _PathError(("name",), f"{why} {self.name!r}; servable: {', '.join(servable_policies())}")
        try:
            cls.Params.model_validate(self.params)
        except _VE as e:
            err = e.errors()[0]
            msg = err["msg"][len("Value error, "):] if err["msg"].startswith("Value error, ") else err["msg"]
            fields = ", ".join(cls.Params.model_fields) or "none"
            raise _PathError(("params", *err["loc"]), f"{msg} (policy {self.name} takes: {fields})") from None
        return self


def servable_policies() -> list[str]:
    """Registry names routerd can serve: every policy except the oracle ones."""
    from routerd.policies.registry import POLICIES

    return [name for name, cls in POLICIES.items() if not cls.oracle]


class KvEventsConfig(_Model):
    """The instances' vLLM KV-cache events (``prefix.mode: precise``): vLLM's ZMQ publisher
    (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq"}'``), msgpack
    ``EventBatch``es of ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
    (``vllm/distributed/kv_events.py``; ``shared/docs/prefix-routing.md`` §1)."""

    port: int = Field(default=5557, ge=1, le=65535)
    """Port of an instance's publisher when its endpoint names none (vLLM's default endpoint is
    ``tcp://*:5557``)."""
    topic: str = ""
    """ZMQ topic subscribed to (vLLM's default ``""``: every message)."""
    stale_after_s: float = Field(default=10.0, gt=0, le=3600)
    """A publisher that has sent nothing for this long (s) while requests were dispatched to its
    instance is taken as stopped: that instance's precise index is stale and its matches fall back
    to the approximate index (counted in ``phasewise_prefix_fallbacks_total``)."""
    max_blocks: int = Field(default=262_144, ge=1)
    """Most blocks the precise index keeps per instance (blocks); a publisher that floods is cut
    here. 262,144 blocks of 16 tokens = 4M tokens, above one GPU's KV cache (an 80 GB H100 holds
    about 30K blocks of an 8B model)."""


class PrefixConfig(_Model):
    """Prefix-cache-aware routing: the request's prompt as hash-chained KV blocks
    (``routerd.prefix.text``), which the cache-aware policies (``llmd``, ``sglang_cache_aware``,
    ``dynamo_kv``, ``lmetric``, ``phasewise``) match against what they believe each endpoint caches.
    Hashed once per request at parse, and only while the policy keeps a prefix index (no cost for
    ``round_robin`` and the other load-only policies)."""

    mode: Literal["off", "approximate", "precise"] = "approximate"
    """``off``: no prefix, the cache-aware policies route on load only. ``approximate``: the
    prompt text is hashed in chunks and each policy remembers what it sent where (llm-d's
    approx-prefix-cache-producer, SGLang's tree): no engine feedback. ``precise``: tokens, matched
    against the engines' KV events (``kv_events``), with ``tokenizer``; without a usable tokenizer it
    matches as ``approximate`` (said once in the log). An unquoted YAML ``off`` (YAML 1.1 reads it
    as false) is taken as ``off``."""
    block_size: int | None = Field(default=None, ge=1, le=4096)
    """The engines' KV block size (tokens) as you expect it: vLLM's ``--block-size``. None: nothing
    expected. Each engine's own size is learnt from its KV events either way (vLLM's default is 16
    on most GPU backends, 128 on its CPU build) and its blocks are keyed in it; an engine that
    reports another size than this one is said in a warning and in
    ``phasewise_prefix_block_size_mismatch{endpoint,configured,reported}``, never dropped. The
    policies count a match in the hardware profile's blocks (``profile``), whatever the engines'."""
    chunk_blocks: int = Field(default=4, ge=1, le=256)
    """Blocks per hashed chunk of text (approximate identity): a chunk is ``chunk_blocks *
    block_size * 4`` bytes (routerd's 4 bytes per token) and a shared prefix is found to its last
    whole chunk (a prompt shorter than one chunk has no prefix). A decision costs about one
    index entry per chunk not yet cached on the chosen endpoint (its insert, and the eviction
    of as many; a cached history is moved whole and matching is logarithmic):
    4 (256 bytes, 64 tokens) is half to a third of 1's cost on 4K-8K-token prompts
    (``benchmarks/prefix_decision_cost.py``); 1 is llm-d's granularity (64 characters), at 4x
    the entries."""
    max_prompt_tokens: int = Field(default=131_072, ge=1)
    """Only the prompt's first this many tokens (``block_size``-aligned, at 4 bytes per token) are
    hashed, matched and indexed, so a 1 MB prompt costs what this many tokens cost (llm-d's
    maxPrefixTokensToMatch, 131,072)."""
    index_capacity_blocks: int = Field(default=262_144, ge=1)
    """Bound on each policy's approximate index per endpoint (blocks), over any capacity the
    policy sets itself (llm-d's LRU of kv_total_blocks, phasewise's 31,250, SGLang's tree between
    sweeps, Dynamo's TTL-only index); least recently used entries go first. Memory: about 220
    bytes per entry of ``chunk_blocks`` blocks (with or without ``dynamo_kv``'s TTL; measured RSS,
    ``benchmarks/prefix_decision_cost.py``), so 262,144 blocks at ``chunk_blocks`` 4 is about
    14 MB per endpoint (per model with several models)."""
    tokenizer: str = ""
    """Precise mode's tokenizer: ``""`` (none: text chunks as in approximate mode), ``bytes``
    (the emulator's deterministic tokenizer, 4 UTF-8 bytes per token), the served model's Hugging
    Face folder (its ``tokenizer.json``, and its chat template for chat requests: the folder vLLM
    serves, or a copy of its tokenizer files) or the path of a ``tokenizer.json`` alone (chat
    requests then match approximately) (``pip install 'phasewise[tokenizer]'``)."""
    kv_events: KvEventsConfig = Field(default_factory=KvEventsConfig)
    """Where precise mode reads each instance's KV events from."""

    @field_validator("mode", mode="before")
    @classmethod
    def _mode(cls, v: Any) -> Any:
        # `mode: off` unquoted is YAML 1.1's boolean false (PyYAML, Helm and kubectl read it so).
        return "off" if v is False else v

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer(cls, v: str) -> str:
        if v != v.strip():
            raise ValueError(f"must not start or end with white space, got {v!r}")
        return v


class RouterConfig(_Model):
    """The router queue and the decision loop."""

    queue_limit: int = Field(default=1024, ge=1)
    """Most requests held in the router queue (requests); one more gets 429."""
    action_interval_s: float = Field(default=0.02, gt=0)
    """While requests are held, the policy decides again every this often (s), as in the simulator."""
    hold_idle_limit_s: float = Field(default=1.0, gt=0)
    """A policy that holds while every candidate instance is idle for this long is
    overridden by round robin (s): holding an idle cluster would never end."""
    no_endpoint_grace_s: float = Field(default=0.0, ge=0)
    """How long a request may wait in the queue for a ready endpoint (s). 0 = answer 503
    at once when none is ready (llm-d's choice); > 0 rides out a short rollout gap."""
    decisions_kept: int = Field(default=1000, ge=1)
    """Decision records kept for ``ListDecisions`` (newest)."""
    tie_break_seed: int | None = None
    """Seed of the random order in which policies see their candidates (so ties go to a random
    instance, not the lowest index). None: a fresh seed per process, so that routerd replicas
    break ties differently (it is logged at start); set one to replay decisions exactly."""
    near_tie: float = Field(default=0.05, ge=0.0, le=1.0)
    """Relative width of a near-tie for ``join_shortest_queue``, ``least_outstanding_tokens``,
    ``late_binding``, ``phasewise``, ``predicted_latency`` and ``learned_linear``: an instance whose load score is within this fraction of
    the best one's counts as tied, and one of those is chosen at random (seeded by the policy's
    seed). Several replicas deciding on the same sidecar report then spread over near-equal
    instances instead of all taking the strictly lightest; 0 keeps each policy's own rule (the
    simulator's setting). Other policies follow their sources' rules."""


class StateConfig(_Model):
    """Instance state from the sidecars."""

    max_age_s: float = Field(default=2.0, gt=0)
    """A sidecar snapshot older than this (s, since it was received) is stale: the instance is
    then seen through routerd's own bookkeeping only. Must exceed the sidecar's scrape
    interval (llm-d-router#2408). Default: llm-d's 2 s metrics staleness threshold."""
    min_interval_s: float = Field(default=0.0, ge=0)
    """Shortest interval between two updates asked of each sidecar (s); 0 = every scrape."""


class OutlierConfig(_Model):
    """Passive health checking: eject an endpoint that keeps failing (Envoy's outlier detection,
    ``envoy.config.cluster.v3.OutlierDetection``: consecutive errors, an ejection time that grows
    with each ejection, a cap on the share ejected)."""

    enabled: bool = True
    """Eject failing endpoints at all."""
    consecutive_errors: int = Field(default=5, ge=1)
    """Consecutive failed requests that eject an endpoint: connect failures, timeouts, answers
    with a 5xx status and streams broken off (Envoy's ``consecutive_5xx`` default, 5)."""
    base_ejection_s: float = Field(default=30.0, gt=0)
    """First ejection time (s); the k-th ejection in a row lasts k times this (Envoy's
    ``base_ejection_time``, 30 s)."""
    max_ejection_s: float = Field(default=300.0, gt=0)
    """Longest ejection (s) (Envoy's ``max_ejection_time``, 300 s)."""
    max_ejected_percent: float = Field(default=50.0, ge=0, le=100)
    """Most endpoints ejected at once, in percent of the known ones; one may always be ejected
    (as Envoy does). An endpoint past the cap keeps serving and is counted as not ejected."""

    @model_validator(mode="after")
    def _order(self) -> "OutlierConfig":
        if self.max_ejection_s < self.base_ejection_s:
            raise _PathError(("max_ejection_s",), f"must be >= base_ejection_s ({self.base_ejection_s})")
        return self


class UpstreamConfig(_Model):
    """The connections to the instances."""

    connect_timeout_s: float = Field(default=5.0, gt=0)
    """TCP connect timeout (s)."""
    response_timeout_s: float = Field(default=600.0, gt=0)
    """Time from sending the request to the response headers (s). A non-streaming vLLM
    response sends its headers only when the whole generation is done."""
    read_timeout_s: float = Field(default=600.0, gt=0)
    """Longest gap between two reads from the instance, response headers included (s)."""
    max_retries: int = Field(default=2, ge=0)
    """Retries on other instances when one fails before sending its first byte."""
    connection_limit: int = Field(default=4096, ge=1)
    """Connection pool size over all instances."""
    failure_cooldown_s: float = Field(default=1.0, ge=0)
    """After a failed connect, the instance gets no new requests for this long (s), doubling
    on each further failure up to 30 s (while another instance is available)."""
    outlier: OutlierConfig = Field(default_factory=OutlierConfig)
    """Ejection of endpoints that keep failing (passive health)."""


class ReloadConfig(_Model):
    """Hot reload of the configuration file (also on SIGHUP)."""

    watch: bool = True
    """Poll the file's modification time and reload when it changes."""
    poll_interval_s: float = Field(default=1.0, gt=0)
    """How often the file is checked for a change (s)."""
    settle_s: float = Field(default=0.5, ge=0, le=60)
    """A change is read only once the file's size, modification time and inode have stayed
    the same for this long (s), and is applied only if they did not change while it was
    read: a file still being written is never applied half-way. SIGHUP reads at once."""


class EppConfig(_Model):
    """``phasewise epp``: the Gateway API Inference Extension endpoint picker (:mod:`routerd.epp`),
    an Envoy ext_proc server over the same router as ``phasewise serve``. Default ports are the
    ecosystem's (``gateway-api-inference-extension`` and llm-d: ext_proc 9002, health 9003,
    metrics 9090)."""

    host: str = "0.0.0.0"
    """Address the ext_proc, health and metrics listeners bind."""
    port: int = Field(default=9002, ge=0, le=65535)
    """ext_proc gRPC port (``envoy.service.ext_proc.v3.ExternalProcessor``; in efficient mode also
    ``envoy.service.accesslog.v3.AccessLogService``); 0 picks a free one (logged)."""
    health_port: int = Field(default=9003, ge=0, le=65535)
    """gRPC health port (``grpc.health.v1``: ``liveness``, ``readiness``, the ext_proc service and
    ""); 0 serves health on the ext_proc port instead of a listener of its own."""
    metrics_port: int | None = Field(default=9090, ge=0, le=65535)
    """HTTP port of ``/metrics`` (Prometheus), ``/healthz`` and ``/readyz``; 0 picks a free one,
    null serves none."""
    mode: Literal["full-duplex", "efficient"] = "full-duplex"
    """``full-duplex``: Envoy sends both bodies in ``FULL_DUPLEX_STREAMED`` (what gateways
    configure; every response chunk is echoed by the picker, which counts its tokens).
    ``efficient``: only the request goes through the picker; the response never does, and each
    request's completion (status, token count, times, the endpoint that served it) comes from the
    Envoy configuration Phasewise ships (``phasewise epp --print-envoy-config --mode efficient``):
    a Lua filter counts the SSE events and the gRPC access log brings them to the picker."""
    max_body_bytes: int = Field(default=DEFAULT_MAX_BODY_BYTES, ge=1024)
    """Largest request body the picker buffers (bytes); a larger one is answered 413."""
    max_fallbacks: int = Field(default=2, ge=0, le=16)
    """Fallback endpoints listed after the primary in ``x-gateway-destination-endpoint`` (the
    least loaded other candidates, fewest in flight first); 0 lists the primary only."""
    completion_timeout_s: float = Field(default=600.0, gt=0)
    """Efficient mode: how long after Envoy ends a request's ext_proc stream (right after the
    request phase: measured with Envoy 1.40) the picker waits for its access-log entry before
    releasing the booking without one (s; counted in
    ``phasewise_epp_streams_total{outcome="unreported"}``). Longer than any request may run:
    an entry is lost only when Envoy's access-log stream to the picker breaks."""


class Settings(_Model):
    """Everything ``phasewise serve`` is configured with."""

    http: HttpConfig = Field(default_factory=HttpConfig)
    """The OpenAI-compatible HTTP front, ``/metrics``, ``/healthz`` and ``/readyz``."""
    grpc: GrpcConfig = Field(default_factory=GrpcConfig)
    models: list[str] = Field(default_factory=list)
    """Served model names, checked before dispatch (404 for any other). Empty: the union of what
    the endpoints serve (``endpoints[].models``, their ``/v1/models``, their sidecars' reports),
    or any model at all while none is known. One name and no lists: every endpoint serves it
    (no ``/v1/models`` is read)."""
    endpoints: list[EndpointConfig] = Field(default_factory=list)
    """Static instances (in addition to Kubernetes discovery, if enabled)."""
    kubernetes: KubernetesConfig = Field(default_factory=KubernetesConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    prefix: PrefixConfig = Field(default_factory=PrefixConfig)
    """Prefix-cache-aware routing: how a request's prompt becomes KV blocks, and the bounds on
    what the policies remember."""
    profile: str = "llama2-7b-v100"
    """Hardware profile (name or YAML path): KV blocks, max_num_seqs and decode speed the
    policies reason with."""
    predictor: str = "default"
    """Decode-length predictor (``routerd.predictor.load_predictor``), loaded at start and on
    each reload:

    - ``default``: the shipped n-gram model (``routerd/data/predictor/default``; numpy only,
      runs on the event loop);
    - ``none``: no prediction (a request's bucket is None and its expected output is
      bucket 0's midpoint, ``routerd.model.bucket_mid_tokens(0)`` = 125 tokens);
    - a baseline name (``majority``, ``task-prior``, ``length-only``, ``length+task``): fitted
      at start on the shared prompt data (``PHASEWISE_DATA_DIR`` or the usual search), which
      must then be present; the last two need ``pip install 'phasewise[predictor-train]'``;
    - a folder saved by ``phasewise predictor train``: ``--kind ngram`` folders need numpy
      only, transformer folders ``pip install 'phasewise[predictor]'`` (run off the loop)."""
    router: RouterConfig = Field(default_factory=RouterConfig)
    state: StateConfig = Field(default_factory=StateConfig)
    upstream: UpstreamConfig = Field(default_factory=UpstreamConfig)
    model_refresh_s: float = Field(default=30.0, gt=0)
    """How often each endpoint's ``/v1/models`` is read again (s); also at start and after the
    endpoint answers 404 (an adapter unloaded, a model swapped)."""
    max_body_bytes: int = Field(default=DEFAULT_MAX_BODY_BYTES, ge=1024)
    """Largest request body accepted (bytes); larger gets 413."""
    drain_timeout_s: float = Field(default=30.0, ge=0)
    """On SIGTERM, how long queued and in-flight requests may take to finish (s)."""
    reload: ReloadConfig = Field(default_factory=ReloadConfig)
    epp: EppConfig = Field(default_factory=EppConfig)
    """``phasewise epp`` (the endpoint picker); ``phasewise serve`` ignores it."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    event_loop: Literal["auto", "asyncio", "uvloop"] = "auto"
    """``auto`` uses uvloop when it is installed."""

    @model_validator(mode="after")
    def _unique_names(self) -> "Settings":
        seen: dict[str, int] = {}
        for i, ep in enumerate(self.endpoints):
            if ep.name in seen:
                raise _PathError(("endpoints", i, "name"), f"duplicate endpoint name {ep.name!r} "
                                 f"(also endpoints[{seen[ep.name]}])")
            seen[ep.name] = i
        for i, m in enumerate(self.models):
            if not m:
                raise _PathError(("models", i), "model name must not be empty")
        return self


class _PathError(ValueError):
    """A cross-field error that knows the path of the field at fault."""

    def __init__(self, loc: tuple, msg: str) -> None:
        super().__init__(msg)
        self.loc = loc


def format_loc(loc: tuple) -> str:
    """``('endpoints', 2, 'url')`` -> ``endpoints[2].url``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _deep_merge(base: dict, over: Mapping) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _has_path(data: Any, loc: tuple) -> bool:
    for part in loc:
        if isinstance(data, Mapping) and part in data:
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data):
            data = data[part]
        else:
            return False
    return True


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML config file.

    Raises:
        ConfigError: unreadable file, invalid YAML (with line and column), an empty file
            (or one of comments only), or a top level that is not a mapping.
    """
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"config {p}: {size} bytes; the limit is {MAX_CONFIG_BYTES} (a Kubernetes ConfigMap "
                              "holds at most 1 MiB)")
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config {p}: cannot read: {e.strerror if isinstance(e, OSError) else e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config {p}: invalid YAML{where}: {problem}") from None
    if data is None:
        # An empty file is what a truncate-then-write or a failed copy leaves behind: taking it
        # as "all defaults" would drop every endpoint. `{}` says "all defaults" on purpose.
        what = "is empty" if not text.strip() else "holds no settings (only comments or null)"
        raise ConfigError(f"config {p}: the file {what}; refused (a half-written file?). "
                          "Write `{}` to mean all defaults")
    if not isinstance(data, dict):
        raise ConfigError(f"config {p}: the top level must be a mapping of settings, got {type(data).__name__}")
    return data


def read_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Settings given as ``PHASEWISE_*`` environment variables (nested with ``__``).

    Raises:
        ConfigError: a variable for a list or object field that is not valid JSON.
    """
    from pydantic_settings import EnvSettingsSource
    from pydantic_settings.exceptions import SettingsError

    src = EnvSettingsSource(Settings, env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_NESTED_DELIMITER,
                            case_sensitive=False)
    if environ is not None:
        src.env_vars = {k.lower(): v for k, v in environ.items()}
    try:
        return src()
    except SettingsError as e:
        raise ConfigError(f"environment: {e}") from None


def load_settings(
    path: str | Path | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    override_flags: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Settings from the YAML file ``path`` (optional), the environment and ``overrides``.

    Args:
        path: YAML config file, or None for defaults + environment + overrides.
        overrides: nested values from command-line flags (highest precedence).
        override_flags: top-level override key -> the flag that set it, for messages.
        environ: environment to read (default ``os.environ``).

    Raises:
        ConfigError: naming the file, variable or flag and the field path of each error (all
            of them, one per line, when there are several).
    """
    file_data = read_yaml(path) if path is not None else {}
    env_data = read_env(os.environ if environ is None else environ)
    data = _merge_layer(_merge_layer(file_data, env_data), overrides or {})
    try:
        settings = Settings.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = tuple(err["loc"])
            ctx_err = (err.get("ctx") or {}).get("error")
            if isinstance(ctx_err, _PathError):
                loc, msg = loc + ctx_err.loc if loc else ctx_err.loc, str(ctx_err)
            else:
                msg = err["msg"]
                if msg.startswith("Value error, "):
                    msg = msg[len("Value error, "):]
            line = f"{_source_of(loc, path, env_data, overrides, override_flags)}: {format_loc(loc)}: {msg}"
            if line not in lines:
                lines.append(line)
        # Cross-field checks run only once every field is valid (pydantic's after-validators):
        # report duplicate endpoint names now too, so one run names every mistake.
        eps = data.get("endpoints")
        if isinstance(eps, list):
            seen: dict[str, int] = {}
            for i, ep in enumerate(eps):
                name = ep.get("name") if isinstance(ep, Mapping) else None
                if isinstance(name, str) and name in seen:
                    loc = ("endpoints", i, "name")
                    line = (f"{_source_of(loc, path, env_data, overrides, override_flags)}: {format_loc(loc)}: "
                            f"duplicate endpoint name {name!r} (also endpoints[{seen[name]}])")
                    if line not in lines:
                        lines.append(line)
                elif isinstance(name, str):
                    seen[name] = i
        for loc, msg in profile_checks(data.get("profile", Settings.model_fields["profile"].default),
                                       data.get("prefix"), _endpoint_profiles(data.get("endpoints")),
                                       _slice_profiles(data.get("kubernetes"))):
            line = f"{_source_of(loc, path, env_data, overrides, override_flags)}: {format_loc(loc)}: {msg}"
            if line not in lines:
                lines.append(line)
        if len(lines) == 1:
            raise ConfigError(lines[0]) from None
        # Every mistake at once: fixing a file should not take one run per error.
        raise ConfigError(f"{len(lines)} configuration errors:\n  " + "\n  ".join(lines)) from None
    # The checks that need the profile, named by where they were set (the daemon checks them again).
    found = [f"{_source_of(loc, path, env_data, overrides, override_flags)}: {format_loc(loc)}: {msg}"
             for loc, msg in profile_checks(settings.profile, settings.prefix.model_dump(),
                                            [e.profile for e in settings.endpoints],
                                            settings.kubernetes.profiles)]
    if found:
        raise ConfigError(found[0] if len(found) == 1 else
                          f"{len(found)} configuration errors:\n  " + "\n  ".join(found))
    return settings


def _endpoint_profiles(endpoints: Any) -> list[Any]:
    """Each raw ``endpoints[i].profile`` (None where absent or the entry is malformed)."""
    if not isinstance(endpoints, list):
        return []
    return [e.get("profile") if isinstance(e, Mapping) else None for e in endpoints]


def _slice_profiles(kubernetes: Any) -> Mapping[Any, Any]:
    """The raw ``kubernetes.profiles`` mapping (empty where absent or malformed)."""
    profiles = kubernetes.get("profiles") if isinstance(kubernetes, Mapping) else None
    return profiles if isinstance(profiles, Mapping) else {}


def profile_checks(profile: Any, prefix: Any, endpoint_profiles: Any = (),
                   slice_profiles: Mapping[Any, Any] | None = None) -> list[tuple[tuple, str]]:
    """``(field path, message)`` of each check that needs the hardware profile: ``profile`` must
    load (a known name or a readable profile YAML); each
    ``endpoints[i].profile`` and ``kubernetes.profiles`` value must load and be of its model and
    block size (``routerd.profiles.check_pool``). Values of
    the wrong type are left to the field validation, which names them; so is a profile path that
    does not exist here (a file the pod mounts, checked where it runs: the daemon loads it at start
    and names it if it cannot).
    """
    from routerd.profiles import PoolError, ProfileError, check_pool, get_profile

    def load(spec: Any, loc: tuple) -> tuple[Any, list[tuple[tuple, str]]]:
        if not isinstance(spec, str):
            return None, []
        if ("/" in spec or spec.endswith((".yaml", ".yml"))) and not Path(spec).exists():
            return None, []
        try:
            return get_profile(spec), []
        except ProfileError as e:
            return None, [(loc, str(e))]

    prof, out = load(profile, ("profile",))
    if prof is None:
        return out
    own_profiles = [(("endpoints", i, "profile"), spec) for i, spec in enumerate(endpoint_profiles or ())]
    own_profiles += [(("kubernetes", "profiles", key), spec) for key, spec in (slice_profiles or {}).items()]
    for loc, spec in own_profiles:
        own, errs = load(spec, loc)
        out.extend(errs)
        if own is not None:
            try:
                check_pool([prof, own])  # one model, one block size (routerd.profiles.profile_model)
            except PoolError as e:
                out.append((loc, str(e)))
    return out


def _merge_layer(base: Mapping[str, Any], layer: Mapping[str, Any]) -> dict[str, Any]:
    """``layer`` deep-merged over ``base``, except that a layer naming another policy starts
    that policy's parameters afresh: the file's ``late_binding`` parameters must not be
    handed to a ``round_robin`` chosen by flag or environment."""
    merged = _deep_merge(base, layer)
    lp, bp = layer.get("policy"), base.get("policy")
    if isinstance(lp, Mapping) and isinstance(bp, Mapping) and "name" in lp and lp["name"] != bp.get("name"):
        merged["policy"] = dict(lp)
    return merged


def _source_of(loc: tuple, path, env_data, overrides, override_flags) -> str:
    if overrides and loc and _has_path(overrides, loc[:1]):
        flag = (override_flags or {}).get(str(loc[0]))
        return f"flag {flag}" if flag else "command line"
    for n in range(len(loc), 0, -1):
        if _has_path(env_data, loc[:n]) and all(isinstance(p, str) for p in loc[:n]):
            return "environment variable " + ENV_PREFIX + ENV_NESTED_DELIMITER.join(str(p).upper() for p in loc[:n])
    return f"config {path}" if path is not None else "configuration"

