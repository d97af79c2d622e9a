"""Typed views of the ``LLMRouterPool`` and ``LLMRouterJob`` specs, and the checks the schema cannot make.

The models mirror the CRD schemas of :mod:`phasewise_operator.gen_crds` field for field
(camelCase on the wire, snake_case here; a test walks both). The API server has already
applied the schema and its defaults; these models repeat the defaults so a spec read
from a test or from an older stored object means the same thing.

:func:`check_pool` makes the checks that need routerd itself (a policy's parameter
model, a merged inline profile's limits) and raises :class:`SpecError` naming the field,
e.g. ``spec.routing.params.reserve_fraction: Input should be less than 1``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from phasewise_operator.gen_crds import (DEFAULT_ENVOY_PORT, DEFAULT_FAILURE_MODE, DEFAULT_KV_EVENTS_PORT,
                                         DEFAULT_KV_EVENTS_TOPIC, DEFAULT_PICKER_MODE, DEFAULT_POLICY,
                                         DEFAULT_PREDICTOR, DEFAULT_PROFILE, ENVOY_FORBIDDEN_PORTS,
                                         ENVOY_PORT_RULE_MESSAGE, FAILURE_MODES, MIXED_POOL_POLICY,
                                         GATEWAY_APP_PROTOCOLS, GROUP_NAME_MAX, GROUP_NAME_PATTERN,
                                         GROUP_NAME_RESERVED, PICKER_MODES, PREFIX_MODES, RESERVED_GROUP_WORDS)

Quantity = int | str

KV_EVENTS_FLAG = "--kv-events-config"
"""vLLM's (and the emulator's) flag for the KV-event publisher, set by the operator in precise mode
(``KVEventsConfig``, ``vllm/config/kv_events.py``)."""
PROMPT_TOKENS_DETAILS_FLAG = "--enable-prompt-tokens-details"
"""vLLM's flag that adds ``usage.prompt_tokens_details.cached_tokens`` (the prompt tokens its prefix
cache served) to every response (``FrontendArgs.enable_prompt_tokens_details``,
``vllm/entrypoints/launchers/cli_args.py``; off by default). The operator gives it to every vLLM
container: it is the ground truth routerd's cached-token estimate is compared against."""
OPERATOR_FLAGS = ("--model", "--served-model-name", "--port")
"""vLLM flags the operator sets from spec fields on every vLLM container; ``check_pool`` refuses
them in ``args`` (a second copy would win, argparse keeps the last, and routerd would look for
another model name, the probes and Services for another port)."""
_VLLM_KV_EVENTS_ENDPOINT = f"tcp://*:{DEFAULT_KV_EVENTS_PORT}"
"""``KVEventsConfig.endpoint``'s default (``vllm/config/kv_events.py``)."""


def flag_uses(args: list[str] | tuple[str, ...], flag: str) -> list[tuple[int, str]]:
    """Where ``args`` give vLLM flag ``flag`` (``--name``), in every spelling vLLM's parser reads as it.

    vLLM's ``FlexibleArgumentParser.parse_args`` (``vllm/utils/argparse_utils.py``) reads
    underscores as dashes in an option's name (up to its first ``.``), ``--name=value``, dotted
    keys of a JSON option (``--name.key value``, merged into one JSON value placed after every
    other argument, so they replace a whole ``--name JSON``), and ``--no-name`` for a boolean
    (``argparse.BooleanOptionalAction``). Abbreviations, which argparse also takes, and
    options read from a ``--config`` file are not seen here.

    Returns:
        ``(index, form)`` for each occurrence, form ``bare`` (``--name``, its value the next
        argument when it takes one), ``inline`` (``--name=value``), ``dotted``
        (``--name.key ...``) or ``negated`` (``--no-name``).
    """
    name = flag.removeprefix("--")
    out: list[tuple[int, str]] = []
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        key, eq, _ = arg[2:].partition("=")
        head, dot, _ = key.partition(".")
        head = head.replace("_", "-")
        if head == name:
            out.append((i, "dotted" if dot else "inline" if eq else "bare"))
        elif head == f"no-{name}" and not dot:
            out.append((i, "negated"))
    return out


def kv_events_fields(port: int, topic: str) -> dict[str, Any]:
    """The ``KVEventsConfig`` fields (``vllm/config/kv_events.py``) of an engine publishing what
    routerd subscribes to: events on, the ZMQ publisher bound on every address (``tcp://*:PORT``:
    vLLM binds an endpoint with ``*`` and connects to any other, ``vllm/distributed/kv_events.py``)
    at ``port``, topic ``topic``."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": topic}


def _check_own_kv_events_config(g: "EngineGroup", port: int, topic: str) -> None:
    """A group's own ``--kv-events-config`` in precise mode: the operator leaves its copy out, so
    the user's must publish what routerd reads (:func:`kv_events_fields`; other fields such as
    ``hwm`` or ``replay_endpoint`` are the user's).

    Raises:
        SpecError: naming the group's ``args``: the flag given more than once or with dotted keys,
            without a value, not a JSON object, or disagreeing in events on, publisher, endpoint
            or topic.
    """
    uses = flag_uses(g.args, KV_EVENTS_FLAG)
    if not uses:
        return
    where = g.field("args")
    want = json.dumps(kv_events_fields(port, topic), separators=(",", ":"))
    if len(uses) > 1 or uses[0][1] not in ("bare", "inline"):
        raise SpecError(where, f"give {KV_EVENTS_FLAG} once, as one JSON object (or leave it out: with "
                        f"routing.prefix.mode precise the operator sets {want})")
    i, form = uses[0]
    raw = g.args[i].partition("=")[2] if form == "inline" else (g.args[i + 1] if i + 1 < len(g.args) else None)
    try:
        cfg = json.loads(raw) if raw is not None else None
    except json.JSONDecodeError:
        cfg = None
    if not isinstance(cfg, dict):
        raise SpecError(where, f"{KV_EVENTS_FLAG} needs a JSON object, got {raw!r} (or leave it out: with "
                        f"routing.prefix.mode precise the operator sets {want})")
    bad = []
    if cfg.get("enable_kv_cache_events") is not True:
        bad.append("enable_kv_cache_events must be true")
    if "publisher" in cfg and cfg["publisher"] != "zmq":
        bad.append(f"publisher must be zmq, not {cfg['publisher']!r}")
    endpoint = cfg.get("endpoint", _VLLM_KV_EVENTS_ENDPOINT)
    if endpoint != f"tcp://*:{port}":
        bad.append(f"endpoint {endpoint!r} must be 'tcp://*:{port}', where routerd subscribes "
                   "(spec.routing.prefix.kvEvents.port)")
    if cfg.get("topic", "") != topic:
        bad.append(f"topic {cfg.get('topic', '')!r} must be {topic!r}, routerd's (spec.routing.prefix.kvEvents.topic)")
    if bad:
        raise SpecError(where, f"{KV_EVENTS_FLAG} disagrees with routerd's KV-event subscription "
                        f"(routing.prefix.mode precise): {'; '.join(bad)}; "
                        f"or leave it out and the operator sets {want}")


class SpecError(ValueError):
    """A spec the operator cannot act on; ``field`` is its path, e.g. ``spec.routing.policy``.

    Retrying cannot help: only a change of the spec can.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class _Spec(BaseModel):
    # extra="ignore": the API server prunes unknown fields anyway, and an operator older
    # than its CRD must keep working on fields it does not know yet.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore",
                              allow_inf_nan=False)

    def wire(self) -> dict[str, Any]:
        """The camelCase dict, without unset optional fields (as the API server stores it)."""
        return self.model_dump(by_alias=True, exclude_none=True)


class ModelSpec(_Spec):
    name: str = Field(min_length=1)
    """Model vLLM loads (Hugging Face id or path)."""
    served_model_name: str | None = None
    """Name clients send as ``model``; None = ``name``."""

    @property
    def served(self) -> str:
        """The name clients use."""
        return self.served_model_name or self.name


class EnvVar(_Spec):
    name: str
    value: str | None = None
    value_from: dict[str, Any] | None = None


class Toleration(_Spec):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class Resources(_Spec):
    limits: dict[str, Quantity] = Field(default_factory=dict)
    requests: dict[str, Quantity] = Field(default_factory=dict)

    def requests_gpu(self) -> bool:
        """Whether limits or requests name ``nvidia.com/gpu``."""
        return "nvidia.com/gpu" in self.limits or "nvidia.com/gpu" in self.requests

    def k8s(self) -> dict[str, Any]:
        """The Kubernetes ResourceRequirements (empty parts left out)."""
        return {k: dict(v) for k, v in (("limits", self.limits), ("requests", self.requests)) if v}


class TopologySpread(_Spec):
    """One Kubernetes TopologySpreadConstraint; fields beyond the three required ones pass through unchanged."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow", allow_inf_nan=False)

    max_skew: int = Field(ge=1)
    """Most the pod count may differ between two domains."""
    topology_key: str = Field(min_length=1)
    """Node label of a domain, e.g. ``topology.kubernetes.io/zone``."""
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"]
    """What the scheduler does when the constraint cannot be met."""


class DisruptionBudget(_Spec):
    """A PodDisruptionBudget (``policy/v1``) for one set of the pool's pods."""

    max_unavailable: Quantity
    """Pods evicted at once by voluntary disruptions: a count or a percentage such as ``25%``."""

    @model_validator(mode="before")
    @classmethod
    def _only_max_unavailable(cls, data: Any) -> Any:
        # policy/v1 also has minAvailable; the operator's budgets take maxUnavailable only (it stays right
        # when replicas change). Without this, minAvailable alone read as "maxUnavailable: Field required".
        if isinstance(data, dict) and ("minAvailable" in data or "min_available" in data):
            raise ValueError("only maxUnavailable is supported (a count >= 0 or a percentage such as 25%), "
                             "not minAvailable: give the pods that may be evicted at once as maxUnavailable")
        return data

    @field_validator("max_unavailable")
    @classmethod
    def _count_or_percent(cls, v: Quantity) -> Quantity:
        if isinstance(v, int):
            if v < 0:
                raise ValueError("must be a count >= 0 or a percentage such as 25%")
            return v
        if not re.fullmatch(r"[0-9]+%?", v):
            raise ValueError("must be a count >= 0 or a percentage such as 25%")
        return int(v) if v.isdigit() else v


class EngineSpec(_Spec):
    image: str | None = None
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    args: list[str] = Field(default_factory=list)
    env: list[EnvVar] = Field(default_factory=list)
    resources: Resources = Field(default_factory=Resources)
    replicas: int = Field(default=1, ge=0)
    port: int = Field(default=8000, ge=1, le=65535)
    model_cache_claim: str | None = None
    shared_memory: Quantity = "1Gi"
    startup_seconds: int = Field(default=1800, ge=10)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    affinity: dict[str, Any] | None = None
    """Kubernetes Affinity of the engine pods, passed through; None = none."""
    topology_spread_constraints: list[TopologySpread] = Field(default_factory=list)
    """Kubernetes TopologySpreadConstraints of the engine pods; one without ``labelSelector`` gets the
    Deployment's own pod selector."""
    pod_disruption_budget: DisruptionBudget | None = None
    """A PodDisruptionBudget per engine Deployment; None = none."""


class SidecarSpec(_Spec):
    port: int = Field(default=50051, ge=1, le=65535)
    interval_seconds: float = Field(default=0.25, gt=0)
    resources: Resources = Field(default_factory=Resources)


class InlineProfile(_Spec):
    """routerd's :class:`~routerd.profiles.HardwareProfile` terms in camelCase; unset ones come from ``based_on``."""

    based_on: str = DEFAULT_PROFILE
    description: str | None = None
    grad1: float = Field(gt=0)
    grad2: float = Field(gt=0)
    overhead_s: float = Field(ge=0)
    kv_capacity_tokens: int = Field(gt=0)
    prefill_per_token_s: float | None = Field(default=None, ge=0)
    prefill_attn_s: float | None = Field(default=None, ge=0)
    decode_per_seq_s: float | None = Field(default=None, ge=0)
    decode_per_ctx_token_s: float | None = Field(default=None, ge=0)
    block_size: int | None = Field(default=None, gt=0)
    max_num_seqs: int | None = Field(default=None, gt=0)
    max_num_batched_tokens: int | None = Field(default=None, gt=0)
    chunked_prefill: bool | None = None
    max_model_len: int | None = Field(default=None, gt=0)
    decode_token_time_s: float | None = Field(default=None, gt=0)
    heavy_prefill_s: float | None = Field(default=None, gt=0)
    heavy_decode_s: float | None = Field(default=None, gt=0)

    def terms(self) -> dict[str, Any]:
        """The given HardwareProfile terms by routerd's snake_case names (``based_on`` left out)."""
        return self.model_dump(exclude_none=True, exclude={"based_on"})


class HardwareProfileRef(_Spec):
    name: str | None = None
    inline: InlineProfile | None = None

    @model_validator(mode="after")
    def _one(self) -> "HardwareProfileRef":
        if (self.name is None) == (self.inline is None):
            raise ValueError("set exactly one of hardwareProfile.name (a shipped profile) or hardwareProfile.inline")
        return self


class CheckpointRef(_Spec):
    config_map: str = Field(min_length=1)


class KvEventsSpec(_Spec):
    """``spec.routing.prefix.kvEvents``: the engines' vLLM KV-cache events (mode precise).

    Unset fields: vLLM's defaults for ``port`` and ``topic`` (the operator configures the
    engines and routerd alike, :data:`~phasewise_operator.gen_crds.DEFAULT_KV_EVENTS_PORT`),
    routerd's for the rest.
    """

    port: int | None = Field(default=None, ge=1, le=65535)
    """Port each engine publishes on (``tcp://*:<port>``, container and Service port ``kv-events``)."""
    topic: str | None = None
    """ZMQ topic of the events (vLLM's ``topic``)."""
    stale_after_seconds: float | None = Field(default=None, gt=0)
    """Seconds without events after which routerd counts an instance's index stale (routerd's ``stale_after_s``)."""
    max_blocks: int | None = Field(default=None, ge=1)
    """Most blocks routerd keeps per instance from its events (routerd's ``max_blocks``)."""


class PrefixSpec(_Spec):
    """``spec.routing.prefix``: routerd's prefix-cache-aware routing (routerd's ``prefix`` settings).

    Every unset field is routerd's default (``routerd/routerd/daemon/config.py``), the mode
    included; the operator renders only what is set, except that mode ``precise`` also
    fixes the events' port and topic, which the engines must share with routerd.
    """

    mode: Literal[PREFIX_MODES] | None = None  # type: ignore[valid-type]
    """``off``, ``approximate`` (routerd hashes the prompt text) or ``precise`` (routerd follows the
    engines' KV events); None = routerd's default."""
    block_size: int | None = Field(default=None, ge=1)
    """Tokens per KV block of routerd's prefix keys (routerd's ``block_size``); None = routerd learns each
    engine's own. Never passed to vLLM: the engines keep their backend's default (16 on most GPU
    backends, 128 on the CPU build) unless ``args`` give ``--block-size``."""
    chunk_blocks: int | None = Field(default=None, ge=1)
    """Blocks per hashed text chunk of the approximate index (routerd's ``chunk_blocks``)."""
    max_prompt_tokens: int | None = Field(default=None, ge=1)
    """Only the first this many prompt tokens are hashed (routerd's ``max_prompt_tokens``)."""
    index_capacity_blocks: int | None = Field(default=None, ge=1)
    """Bound of the approximate index per endpoint, blocks (routerd's ``index_capacity_blocks``)."""
    tokenizer: str | None = None
    """Tokenizer of precise mode: ``bytes`` (the emulator's) or a tokenizer.json path in the routerd
    pod (routerd's ``tokenizer``); None = routerd's default, or ``bytes`` in an emulated pool."""
    kv_events: KvEventsSpec | None = None
    """The engines' KV events (mode ``precise``)."""

    @property
    def precise(self) -> bool:
        """Whether the engines must publish KV events (mode ``precise``; routerd's default mode never is)."""
        return self.mode == "precise"


class RoutingSpec(_Spec):
    policy: str | None = None
    """The policy by registry name; None: the pool's measured default (:meth:`PoolSpec.routing_policy`)."""
    params: dict[str, Any] = Field(default_factory=dict)
    action_interval_seconds: float = Field(default=0.02, ge=0.0001)
    queue_limit: int = Field(default=1024, ge=1)
    checkpoint: CheckpointRef | None = None
    prefix: PrefixSpec | None = None
    """Prefix-cache-aware routing; None = routerd's defaults throughout."""

    @property
    def precise_prefix(self) -> bool:
        """Whether the pool routes on the engines' KV events (``prefix.mode: precise``)."""
        return self.prefix is not None and self.prefix.precise

    @property
    def kv_events_port(self) -> int:
        """The port the engines publish KV events on: ``prefix.kvEvents.port`` or vLLM's default."""
        ke = self.prefix.kv_events if self.prefix is not None else None
        return ke.port if ke is not None and ke.port is not None else DEFAULT_KV_EVENTS_PORT

    @property
    def kv_events_topic(self) -> str:
        """The topic of the engines' KV events: ``prefix.kvEvents.topic`` or vLLM's default ("")."""
        ke = self.prefix.kv_events if self.prefix is not None else None
        return ke.topic if ke is not None and ke.topic is not None else DEFAULT_KV_EVENTS_TOPIC


class PredictorVolume(_Spec):
    claim_name: str = Field(min_length=1)
    path: str = ""


class PredictorSpec(_Spec):
    name: str | None = None
    """``default`` (routerd's shipped n-gram model), ``none`` (no prediction) or a baseline
    (``gen_crds.predictor_names``); exclusive with ``persistent_volume_claim``."""
    persistent_volume_claim: PredictorVolume | None = None

    @model_validator(mode="after")
    def _one(self) -> "PredictorSpec":
        if (self.name is None) == (self.persistent_volume_claim is None):
            raise ValueError("set exactly one of predictor.name or predictor.persistentVolumeClaim")
        return self


class ServiceSpec(_Spec):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = Field(default=80, ge=1, le=65535)
    node_port: int | None = Field(default=None, ge=30000, le=32767)
    annotations: dict[str, str] = Field(default_factory=dict)


class RouterdSpec(_Spec):
    replicas: int = Field(default=1, ge=0)
    image: str | None = None
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    resources: Resources = Field(default_factory=Resources)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    pod_disruption_budget: DisruptionBudget | None = None
    """A PodDisruptionBudget for the routerd pods; None = none."""
    service: ServiceSpec = Field(default_factory=ServiceSpec)


class SecretRef(_Spec):
    name: str


class InferencePoolSpec(_Spec):
    """``spec.gateway.inferencePool``: the InferencePool the operator creates (GIE ``api/v1/inferencepool_types.go``)."""

    enabled: bool = False
    """Create the InferencePool ``<pool>`` (needs ``picker.enabled``)."""
    target_port_number: int | None = Field(default=None, ge=1, le=65535)
    """``spec.targetPorts[0].number``: the engines' OpenAI port; None = ``spec.engine.port``."""
    app_protocol: Literal[GATEWAY_APP_PROTOCOLS] = "http"  # type: ignore[valid-type]
    """``spec.appProtocol``: ``http`` (HTTP/1.1) or ``kubernetes.io/h2c``."""
    failure_mode: Literal[FAILURE_MODES] = DEFAULT_FAILURE_MODE  # type: ignore[valid-type]
    """``spec.endpointPickerRef.failureMode``: ``FailClose`` (GIE's default) or ``FailOpen``."""


class EnvoySpec(_Spec):
    """``spec.gateway.picker.envoy``: standalone mode, an Envoy sidecar beside each picker."""

    enabled: bool = False
    """Run the Envoy sidecar (and its ConfigMap, and the picker Service's ``http`` port)."""
    image: str | None = None
    """Envoy image; None = the operator's ``envoy_image`` setting."""
    port: int = Field(default=DEFAULT_ENVOY_PORT, ge=1, le=65535)
    """Envoy's client listener: container and Service port ``http``."""
    resources: Resources = Field(default_factory=Resources)
    """Resources of the Envoy container; empty = the operator's defaults."""


class PickerSpec(_Spec):
    """``spec.gateway.picker``: ``phasewise epp`` as the Deployment and Service ``<pool>-epp``."""

    enabled: bool = False
    """Run the picker."""
    replicas: int = Field(default=1, ge=0)
    """Picker replicas."""
    mode: Literal[PICKER_MODES] = DEFAULT_PICKER_MODE  # type: ignore[valid-type]
    """routerd's ``epp.mode``: ``full-duplex`` (gateways) or ``efficient`` (Phasewise's Envoy only)."""
    resources: Resources = Field(default_factory=Resources)
    """Resources of the picker container; empty = routerd's defaults."""
    pod_disruption_budget: DisruptionBudget | None = None
    """A PodDisruptionBudget for the picker pods; None = none."""
    envoy: EnvoySpec = Field(default_factory=EnvoySpec)
    """Standalone mode's Envoy sidecar."""


class GatewaySpec(_Spec):
    """``spec.gateway``: the pool behind an InferencePool-conformant gateway and/or Phasewise's own Envoy."""

    inference_pool: InferencePoolSpec = Field(default_factory=InferencePoolSpec)
    """The InferencePool the operator creates."""
    picker: PickerSpec = Field(default_factory=PickerSpec)
    """The Endpoint Picker Deployment."""


class EngineGroupSpec(_Spec):
    """One entry of ``spec.engineGroups``: a model with its own Deployment; every unset
    override is the pool's ``spec.engine`` value (a set one replaces it, lists and maps
    are not merged)."""

    name: str = Field(min_length=1, max_length=GROUP_NAME_MAX, pattern=GROUP_NAME_PATTERN)
    """Group name: a DNS-1123 label without the words ``engine`` or ``routerd``, so that
    ``<pool>-engine-<name>`` can be no other child's name (see ``gen_crds.GROUP_NAME_RESERVED``)."""
    model: ModelSpec
    """The model this group's instances serve."""
    replicas: int | None = Field(default=None, ge=0)
    """Instances of this group; None = ``spec.engine.replicas``."""
    args: list[str] | None = None
    """Extra vLLM arguments; None = ``spec.engine.args``."""
    env: list[EnvVar] | None = None
    """Environment of the engine container; None = ``spec.engine.env``."""
    resources: Resources | None = None
    """Resources of the engine container; None = ``spec.engine.resources``."""
    node_selector: dict[str, str] | None = None
    """Node labels; None = ``spec.engine.nodeSelector``."""
    tolerations: list[Toleration] | None = None
    """Tolerations; None = ``spec.engine.tolerations``."""
    affinity: dict[str, Any] | None = None
    """Affinity; None = ``spec.engine.affinity``."""
    topology_spread_constraints: list[TopologySpread] | None = None
    """Topology spread constraints; None = ``spec.engine.topologySpreadConstraints``."""
    hardware_profile: HardwareProfileRef | None = None
    """This group's hardware profile (its GPU type: a mixed-GPU pool gives each group its own),
    by name or inline, of the pool profile's model and block size; None = ``spec.hardwareProfile``.
    routerd learns each endpoint's profile from its group (one Service per group), and an
    emulated group runs at its own profile's speed."""

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, v: str) -> str:
        if re.search(GROUP_NAME_RESERVED, v):
            words = f"{', '.join(RESERVED_GROUP_WORDS[:-1])} or {RESERVED_GROUP_WORDS[-1]}"
            raise ValueError(f"group name {v!r} must not contain the word {words} (its Deployment and "
                             f"Service <pool>-engine-{v} could be another pool's child)")
        return v


@dataclass(frozen=True)
class EngineGroup:
    """A group with the pool's engine values filled in: what one engine Deployment serves.

    The single-model form (``spec.model``) is one group with ``name`` "" whose fields
    are ``spec.engine``'s.
    """

    name: str
    """"" for the single-model form, else ``spec.engineGroups[i].name``."""
    index: int | None
    """Position in ``spec.engineGroups``; None for the single-model form."""
    model: ModelSpec
    replicas: int
    args: list[str]
    env: list[EnvVar]
    resources: Resources
    node_selector: dict[str, str]
    tolerations: list[Toleration]
    affinity: dict[str, Any] | None = None
    topology_spread_constraints: tuple[TopologySpread, ...] = ()
    hardware_profile: HardwareProfileRef | None = None
    """The group's own profile; None = the pool's ``spec.hardwareProfile``."""

    def field(self, name: str) -> str:
        """The spec path a user sets ``name`` (camelCase) at for this group, e.g.
        ``spec.engineGroups[1].replicas``, or ``spec.engine.replicas`` where the group inherits it."""
        if self.index is None:
            return "spec.model" if name == "model" else f"spec.engine.{name}"
        return f"spec.engineGroups[{self.index}].{name}"


class PoolSpec(_Spec):
    """``LLMRouterPool.spec``."""

    model: ModelSpec | None = None
    """The one model of a single-model pool; exclusive with ``engine_groups``."""
    engine_groups: list[EngineGroupSpec] | None = None
    """Several models, one Deployment each; exclusive with ``model``."""
    engine: EngineSpec = Field(default_factory=EngineSpec)
    sidecar: SidecarSpec = Field(default_factory=SidecarSpec)
    hardware_profile: HardwareProfileRef = Field(default_factory=lambda: HardwareProfileRef(name=DEFAULT_PROFILE))
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    predictor: PredictorSpec | None = Field(default_factory=lambda: PredictorSpec(name=DEFAULT_PREDICTOR))
    """Unset: routerd's shipped predictor (the CRD's default); None (an explicit null the API
    server did not prune) means the same, see ``builders.routerd_settings``."""
    routerd: RouterdSpec = Field(default_factory=RouterdSpec)
    emulated: bool = False
    image_pull_secrets: list[SecretRef] = Field(default_factory=list)
    gateway: GatewaySpec | None = None
    """InferencePool and picker; None = neither (the pool renders as before the field existed)."""

    @property
    def inference_pool(self) -> bool:
        """Whether the operator creates an InferencePool for the pool."""
        return self.gateway is not None and self.gateway.inference_pool.enabled

    @property
    def picker(self) -> bool:
        """Whether the pool runs ``phasewise epp``."""
        return self.gateway is not None and self.gateway.picker.enabled

    @property
    def envoy(self) -> bool:
        """Whether the picker runs with Phasewise's own Envoy sidecar (standalone mode)."""
        return self.picker and self.gateway.picker.envoy.enabled  # type: ignore[union-attr]

    @property
    def target_port(self) -> int:
        """The engines' port the InferencePool lists: ``inferencePool.targetPortNumber`` or ``engine.port``."""
        n = self.gateway.inference_pool.target_port_number if self.gateway is not None else None
        return self.engine.port if n is None else n

    @property
    def multi_model(self) -> bool:
        """Whether the pool uses ``engineGroups`` (else the single-model ``model``)."""
        return self.engine_groups is not None

    def groups(self) -> list[EngineGroup]:
        """Every engine group in spec order, overrides resolved against ``spec.engine``.

        Raises:
            SpecError: neither ``model`` nor ``engineGroups`` is set (``parse_pool_spec``
                refuses such a spec first).
        """
        e = self.engine
        if self.engine_groups is None:
            if self.model is None:
                raise SpecError("spec.model", "set spec.model (one model) or spec.engineGroups (several)")
            return [EngineGroup("", None, self.model, e.replicas, list(e.args), list(e.env), e.resources,
                                dict(e.node_selector), list(e.tolerations), e.affinity,
                                tuple(e.topology_spread_constraints))]

        def pick(value, default):
            return default if value is None else value

        return [EngineGroup(g.name, i, g.model, pick(g.replicas, e.replicas), list(pick(g.args, e.args)),
                            list(pick(g.env, e.env)), pick(g.resources, e.resources),
                            dict(pick(g.node_selector, e.node_selector)), list(pick(g.tolerations, e.tolerations)),
                            pick(g.affinity, e.affinity),
                            tuple(pick(g.topology_spread_constraints, e.topology_spread_constraints)),
                            g.hardware_profile)
                for i, g in enumerate(self.engine_groups)]

    @property
    def mixed_profiles(self) -> bool:
        """Whether an engine group sets its own ``hardwareProfile`` (then each group gets its own
        Service, and routerd each endpoint's profile from it)."""
        return any(g.hardware_profile is not None for g in self.engine_groups or ())

    def mixed_hardware(self) -> bool:
        """Whether some served model runs on hardware profiles that differ in their terms, counting
        the pool's own ``hardwareProfile`` (what the profile-blind policies read for every
        instance) beside its groups' (a group may name the pool's profile, or copy its terms
        inline, and still not be mixed).

        Raises:
            SpecError: a group's profile cannot be resolved (:func:`resolve_profile`).
        """
        if not self.mixed_profiles:
            return False
        from routerd.profiles import terms_key  # the model line an inline profile gains is no term

        pool = terms_key(resolve_profile(self, pool_name="check"))
        terms_by_model: dict[str, set[str]] = {}
        for g in self.groups():
            own = terms_key(resolve_profile(self, pool_name="check", group=g))
            terms_by_model.setdefault(g.model.served, {pool}).add(own)
        return any(len(t) > 1 for t in terms_by_model.values())

    def routing_policy(self) -> str:
        """The policy routerd runs: ``routing.policy``, or when unset the measured default for the
        pool's shape, :data:`~phasewise_operator.gen_crds.MIXED_POOL_POLICY` (``predicted_latency``,
        which prices each instance with its own profile) on a mixed-GPU pool
        (:meth:`mixed_hardware`), :data:`~phasewise_operator.gen_crds.DEFAULT_POLICY`
        (``late_binding``) otherwise (docs/rl.md, issue 18).

        Raises:
            SpecError: a group's profile cannot be resolved.
        """
        if self.routing.policy is not None:
            return self.routing.policy
        return MIXED_POOL_POLICY if self.mixed_hardware() else DEFAULT_POLICY

    def served_models(self) -> list[str]:
        """The names clients may send as ``model``: each group's served name, in spec order, once each."""
        return list(dict.fromkeys(g.model.served for g in self.groups()))

    def total_replicas(self) -> int:
        """Engine instances of all groups together."""
        return sum(g.replicas for g in self.groups())


class ProfileTask(_Spec):
    instance: str | None = None
    args: list[str] = Field(default_factory=list)


class TrainTask(_Spec):
    variant: str = "workload-guided"
    workload: str = "public-mix"
    episodes: int = Field(default=30, ge=1)
    requests_per_episode: int = Field(default=1000, ge=1)
    rate: float | None = Field(default=None, ge=0)
    prediction: str = "true"
    seed: int = Field(default=0, ge=0)
    args: list[str] = Field(default_factory=list)


class PoolRef(_Spec):
    name: str = Field(min_length=1)


class JobSpec(_Spec):
    """``LLMRouterJob.spec``."""

    pool_ref: PoolRef
    task: Literal["profile", "train"]
    apply: bool = True
    image: str | None = None
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    resources: Resources = Field(default_factory=Resources)
    backoff_limit: int = Field(default=0, ge=0)
    active_deadline_seconds: int = Field(default=7200, ge=1)
    profile: ProfileTask | None = None
    train: TrainTask | None = None

    @property
    def profile_task(self) -> ProfileTask:
        """The profile parameters (defaults when none were given)."""
        return self.profile or ProfileTask()

    @property
    def train_task(self) -> TrainTask:
        """The train parameters (defaults when none were given)."""
        return self.train or TrainTask()


# ---------------------------------------------------------------- parsing with field paths

def _wire_path(prefix: str, model: type[BaseModel], loc: tuple) -> str:
    """A pydantic error location as the camelCase path a user wrote, e.g. ``spec.engine.replicas``."""
    parts = [prefix]
    current: Any = model
    for item in loc:
        if isinstance(item, int):
            parts[-1] += f"[{item}]"
            continue
        name = str(item)
        fields = getattr(current, "model_fields", None)
        if fields and name in fields:
            info = fields[name]
            parts.append(info.alias or name)
            current = _inner_model(info.annotation)
        else:
            parts.append(name)
            current = None
    return ".".join(parts)


def _inner_model(annotation: Any) -> Any:
    """The pydantic model inside an annotation (``X``, ``X | None``, ``list[X]``), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def parse_pool_spec(spec: dict[str, Any] | None) -> PoolSpec:
    """``PoolSpec`` from the stored camelCase spec.

    Raises:
        SpecError: naming the first invalid field (``spec.…``), including what the
            schema's CEL rules check: exactly one of ``model`` and a non-empty
            ``engineGroups``, group names unique within the pool, and the rules of
            ``spec.gateway`` (an InferencePool needs the picker, Envoy's port is not one of
            the picker's).
    """
    ps = _parse(PoolSpec, spec)
    if ps.engine_groups is None:
        if ps.model is None:
            raise SpecError("spec.model", "set spec.model (one model) or spec.engineGroups (several)")
        _check_gateway(ps)
        return ps
    if ps.model is not None:
        raise SpecError("spec.engineGroups", "set spec.model or spec.engineGroups, not both")
    if not ps.engine_groups:
        raise SpecError("spec.engineGroups", "needs at least one group (or set spec.model instead)")
    seen: set[str] = set()
    for i, g in enumerate(ps.engine_groups):
        if g.name in seen:
            raise SpecError(f"spec.engineGroups[{i}].name", f"duplicate group name {g.name!r}")
        seen.add(g.name)
    _check_gateway(ps)
    return ps


def _check_gateway(ps: PoolSpec) -> None:
    """The CEL rules of ``spec.gateway`` (gen_crds.gateway_schema), for specs stored before them."""
    gw = ps.gateway
    if gw is None:
        return
    picker = gw.picker
    if gw.inference_pool.enabled and not picker.enabled:
        raise SpecError("spec.gateway.picker.enabled", "gateway.inferencePool.enabled needs gateway.picker.enabled "
                        "(the InferencePool's endpointPickerRef is the picker's Service)")
    if picker.envoy.enabled and not picker.enabled:
        raise SpecError("spec.gateway.picker.envoy.enabled",
                        "picker.envoy.enabled needs picker.enabled (Envoy sends every request to the picker)")
    if picker.mode == "efficient" and not picker.envoy.enabled:
        raise SpecError("spec.gateway.picker.mode", "picker.mode efficient needs Phasewise's own Envoy "
                        "(picker.envoy.enabled); gateways run full-duplex")
    if picker.envoy.port in ENVOY_FORBIDDEN_PORTS:
        raise SpecError("spec.gateway.picker.envoy.port", ENVOY_PORT_RULE_MESSAGE)
    if gw.inference_pool.target_port_number is not None and gw.inference_pool.target_port_number == ps.sidecar.port:
        raise SpecError("spec.gateway.inferencePool.targetPortNumber", "gateway.inferencePool.targetPortNumber is "
                        "the state sidecar's gRPC port (sidecar.port), not an OpenAI endpoint")


def parse_job_spec(spec: dict[str, Any] | None) -> JobSpec:
    """``JobSpec`` from the stored camelCase spec.

    Raises:
        SpecError: naming the first invalid field (``spec.…``).
    """
    return _parse(JobSpec, spec)


def _parse(model: type[_Spec], spec: dict[str, Any] | None) -> Any:
    if not isinstance(spec, dict):
        raise SpecError("spec", "missing or not an object")
    try:
        return model.model_validate(spec)
    except ValidationError as e:
        err = e.errors()[0]
        msg = err["msg"].removeprefix("Value error, ")
        raise SpecError(_wire_path("spec", model, tuple(err["loc"])), msg) from None


# ---------------------------------------------------------------- checks that need routerd

def _check_group_profiles(spec: PoolSpec) -> None:
    """Every group's own profile resolves and is of the pool profile's model and block size.

    Raises:
        SpecError: naming the group's ``hardwareProfile`` (or the pool's, when that one is bad).
    """
    if not spec.mixed_profiles:
        return
    from routerd.profiles import PoolError, check_pool as check_profiles

    profile = resolve_profile(spec, pool_name="check")
    for g in spec.groups():
        if g.hardware_profile is None:
            continue
        own = resolve_profile(spec, pool_name="check", group=g)
        try:
            check_profiles([profile, own])  # one model, one block size: routerd refuses others
        except PoolError as e:
            raise SpecError(g.field("hardwareProfile"), f"{e} (the pool's spec.hardwareProfile is "
                            f"{profile.name!r}; every group serves its model with its block size)") from None


def check_pool(spec: PoolSpec) -> None:
    """What the schema cannot check: routerd's own models accept the policy, its params and the profile.

    Raises:
        SpecError: naming the field, e.g. an unknown policy or profile that slipped past
            an older CRD, a policy parameter its model rejects, a merged inline profile
            that breaks routerd's limits, an emulated pool that requests GPUs, vLLM args
            that give a flag the operator sets from a spec field (:data:`OPERATOR_FLAGS`),
            or in prefix mode precise a group's own ``--kv-events-config`` that does not
            publish where routerd subscribes.
    """
    from routerd.policies.registry import POLICIES

    from phasewise_operator.gen_crds import policy_names, predictor_names

    routing = spec.routing
    live = policy_names()
    if routing.policy is None:
        _check_group_profiles(spec)  # they decide the default: a bad one is the error to report
    policy = spec.routing_policy()
    chosen = "" if routing.policy is not None else (
        ", the default for a mixed-GPU pool," if policy == MIXED_POOL_POLICY else ", the default,")
    if policy not in live:
        why = "an oracle policy runs only in the simulator" if policy in POLICIES else "unknown policy"
        raise SpecError("spec.routing.policy", f"{why} {policy!r}; valid: {', '.join(live)}")
    if "checkpoint" in routing.params:
        if policy != "learned_linear":
            raise SpecError("spec.routing.params.checkpoint", "give the DQN checkpoint as routing.checkpoint.configMap")
        from routerd.policies.learned_linear import SHIPPED

        if routing.params["checkpoint"] not in SHIPPED:
            # routerd's pod holds only the package's own checkpoints (no volume for a folder).
            raise SpecError("spec.routing.params.checkpoint",
                            f"learned_linear takes a shipped checkpoint here: {', '.join(SHIPPED)}; "
                            f"got {routing.params['checkpoint']!r}")

    if policy == "dqn" and routing.checkpoint is None:
        raise SpecError("spec.routing.checkpoint", "policy dqn needs a checkpoint ConfigMap")
    params_model = POLICIES[policy].Params
    params = dict(routing.params)
    if policy == "dqn":
        params["checkpoint"] = "/"  # the operator's own mount; only the other fields are checked here
    try:
        params_model.model_validate(params)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or "params"
        known = ", ".join(f for f in params_model.model_fields if f != "checkpoint") or "none"
        raise SpecError(f"spec.routing.params.{field}",
                        f"{err['msg']} (policy {policy}{chosen} takes: {known})") from None
    # prefix.blockSize is what the engines are expected to report, not the profile's: routerd keys
    # each engine's blocks in the size its KV events report, and says so when it differs.
    resolve_profile(spec, pool_name="check")
    if spec.predictor is not None and spec.predictor.name is not None and \
            spec.predictor.name not in predictor_names():
        raise SpecError("spec.predictor.name", f"unknown predictor {spec.predictor.name!r}; "
                        f"valid: {', '.join(predictor_names())}")
    if spec.emulated and spec.engine.resources.requests_gpu():
        raise SpecError("spec.engine.resources", "an emulated pool must not request nvidia.com/gpu")
    if spec.emulated and spec.engine.args:
        raise SpecError("spec.engine.args", "engine.args are vLLM arguments; an emulated pool must not set them")
    if routing.policy is not None:
        _check_group_profiles(spec)  # checked first above when they chose the policy
    for i, g in enumerate(spec.engine_groups or []):
        where = f"spec.engineGroups[{i}]"
        if spec.emulated and g.resources is not None and g.resources.requests_gpu():
            raise SpecError(f"{where}.resources", "an emulated pool must not request nvidia.com/gpu")
        if spec.emulated and g.args:
            raise SpecError(f"{where}.args", "args are vLLM arguments; an emulated pool must not set them")
    if spec.engine.port == spec.sidecar.port:
        raise SpecError("spec.sidecar.port", "engine.port and sidecar.port must differ")
    for g in spec.groups():
        model = g.field("model")
        source = {"--model": f"{model}.name", "--served-model-name": f"{model}.servedModelName",
                  "--port": "spec.engine.port"}
        for flag in OPERATOR_FLAGS:
            if flag_uses(g.args, flag):
                raise SpecError(g.field("args"), f"{flag} is set by the operator from {source[flag]}; "
                                "leave it out of the args")
    if spec.routing.precise_prefix:
        port = spec.routing.kv_events_port
        if port in (spec.engine.port, spec.sidecar.port):
            raise SpecError("spec.routing.prefix.kvEvents.port",
                            f"port {port} is taken by engine.port or sidecar.port; the KV events need their own")
        # The operator sets the engines' --kv-events-config in precise mode unless a group gives
        # its own: then that one must publish where routerd listens.
        for g in spec.groups():
            _check_own_kv_events_config(g, port, spec.routing.kv_events_topic)


def resolve_profile(spec: PoolSpec, *, pool_name: str, group: EngineGroup | None = None):
    """The pool's :class:`routerd.profiles.HardwareProfile` (or ``group``'s own, when it sets one): a
    shipped one, or ``basedOn`` with the inline terms over it.

    Raises:
        SpecError: an unknown profile name, or a merged inline profile routerd rejects
            (the message names the inline field, e.g. ``spec.hardwareProfile.inline.kvCapacityTokens``,
            or ``spec.engineGroups[1].hardwareProfile.name`` for a group's).
    """
    from routerd.profiles import HardwareProfile, ProfileError, get_profile, profile_model, profile_names

    ref = spec.hardware_profile
    at = "spec.hardwareProfile"
    if group is not None and group.hardware_profile is not None:
        ref, at = group.hardware_profile, group.field("hardwareProfile")
        pool_name = f"{pool_name}-{group.name}"
    base_name = ref.name if ref.name is not None else ref.inline.based_on  # type: ignore[union-attr]
    field = f"{at}.name" if ref.name is not None else f"{at}.inline.basedOn"
    if base_name not in profile_names():
        raise SpecError(field, f"unknown profile {base_name!r}; valid: {', '.join(profile_names())}")
    try:
        base = get_profile(base_name)
    except ProfileError as e:  # a broken shipped file: nothing the user can fix, but say so
        raise SpecError(field, str(e)) from None
    if ref.inline is None:
        return base
    inline = ref.inline
    data = base.model_dump()
    data.update(inline.terms())
    data["name"] = f"{pool_name}-inline"
    if spec.mixed_profiles:
        # Its name no longer says the model, and check_pool compares models. Only in a mixed pool:
        # elsewhere the file stays as it was (a changed profile.yaml restarts emulated pools).
        data["model"] = profile_model(base)
    data["description"] = inline.description or f"inline profile of pool {pool_name}, based on {base_name}"
    data["sources"] = {}
    try:
        return HardwareProfile.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        msg = err["msg"].removeprefix("Value error, ")
        loc = [str(x) for x in err["loc"]]
        # A cross-field limit has no location: name the first term its message mentions.
        terms = loc[:1] or _terms_in(msg)[:1]
        where = f"{at}.inline" + ("." + to_camel(terms[0]) if terms else "")
        raise SpecError(where, _camelize(msg)) from None


def _terms_in(text: str) -> list[str]:
    from routerd.profiles import HardwareProfile

    found = [(m.start(), f) for f in HardwareProfile.model_fields
             for m in re.finditer(rf"\b{re.escape(f)}\b", text)]
    return [f for _, f in sorted(found)]


def _camelize(text: str) -> str:
    """routerd's snake_case profile terms in a message, as the camelCase names of the spec."""
    from routerd.profiles import HardwareProfile

    for f in sorted(HardwareProfile.model_fields, key=len, reverse=True):
        text = re.sub(rf"\b{re.escape(f)}\b", to_camel(f), text)
    return text


def profile_label(spec: PoolSpec) -> str:
    """What ``status.activeProfile`` shows: the shipped name, or ``inline(<basedOn>)``."""
    ref = spec.hardware_profile
    return ref.name if ref.name is not None else f"inline({ref.inline.based_on})"  # type: ignore[union-attr]
