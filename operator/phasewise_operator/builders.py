"""Desired Kubernetes objects of a pool, as plain dicts: pure functions, no API calls.

For a pool ``P`` in namespace ``N`` the operator owns (every object has ``P`` as its
controller owner reference, so deleting the pool deletes them):

===========================  ========================================================
``P-engine`` Deployment      vLLM (or ``phasewise emulate`` when emulated) and the
                             ``phasewise sidecar`` beside it, ``spec.engine.replicas``
                             (a single-model pool, ``spec.model``)
``P-engine-G`` Deployment    the same for engine group ``G`` of ``spec.engineGroups``
                             (one each), pods labelled ``phasewise.io/engine-group: G``
``P-engine`` Service         headless, selecting the pods of every engine Deployment;
                             ports named ``http`` and ``state`` (and ``kv-events`` with
                             prefix mode precise), which routerd's EndpointSlice
                             watcher looks for
``P-routerd`` ConfigMap      ``routerd.yaml`` (routerd's :class:`~routerd.daemon.config.Settings`),
                             ``profile.yaml`` for an inline profile, and the DQN
                             checkpoint (``checkpoint-model.safetensors``,
                             ``checkpoint-metadata.json``)
``P-routerd`` Deployment     ``phasewise serve --config /etc/phasewise/routerd.yaml``
``P-routerd`` Service        the OpenAI API clients call (type and port from the spec)
``P-routerd`` ServiceAccount with a Role and RoleBinding to get/list/watch EndpointSlices
===========================  ========================================================

With ``spec.gateway`` (absent: none of these, and every object above renders exactly as
before the field existed):

===========================  ========================================================
``P-epp`` Deployment         ``phasewise epp --config /etc/phasewise/routerd.yaml``
                             (``gateway.picker``), reading ``P-routerd``'s ConfigMap with
                             its ``epp`` section, under ``P-routerd``'s ServiceAccount;
                             with ``picker.envoy`` an Envoy sidecar in each pod
``P-epp`` Service            ext_proc 9002, gRPC health 9003, metrics 9090 (and Envoy's
                             ``http`` port in standalone mode)
``P-epp-envoy`` ConfigMap    Envoy's bootstrap (standalone mode)
``P`` InferencePool          ``inference.networking.k8s.io/v1`` (``gateway.inferencePool``):
                             the engine pods, the engine port, ``P-epp`` as its picker
PodDisruptionBudgets         ``P-engine[-G]``, ``P-routerd``, ``P-epp`` where the spec
                             asks for one (``podDisruptionBudget``)
===========================  ========================================================

routerd reloads ``routerd.yaml`` when the file changes (policy, its parameters and
checkpoint, profile, predictor, models, router and state settings), and the kubelet swaps all keys of one
ConfigMap volume at once, so those changes reach routerd without a restart. Only the
settings routerd reads at start (:data:`RESTART_KEYS`) are hashed into the routerd pod
template's ``phasewise.io/restart-hash`` annotation, which rolls the pods when they change.

Every pod meets the restricted Pod Security Standard: non-root, read-only root file
system (emptyDirs for ``/tmp`` and caches), no capabilities, RuntimeDefault seccomp, no
privilege escalation.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import yaml

from phasewise_operator.gen_crds import (API_VERSION, DEFAULT_PREDICTOR, EPP_GRPC_PORT, EPP_HEALTH_PORT,
                                         EPP_METRICS_PORT, KV_EVENTS_PORT_NAME)
from phasewise_operator.settings import OperatorSettings
from phasewise_operator.spec import (KV_EVENTS_FLAG, PROMPT_TOKENS_DETAILS_FLAG, DisruptionBudget, EngineGroup,
                                     PoolSpec, Resources, SpecError, flag_uses, kv_events_fields, resolve_profile)

# ---------------------------------------------------------------- names and labels

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_POOL = "phasewise.io/pool"
LABEL_JOB = "phasewise.io/job"
LABEL_ENGINE_GROUP = "phasewise.io/engine-group"
"""The engine group of a Deployment and its pods (pools with ``spec.engineGroups`` only)."""
LABEL_MODEL = "phasewise.io/model"
"""The served model of a group's Deployment and pods, as a label value (:func:`model_label`)."""
ANNOTATION_MODEL = "phasewise.io/model"
"""The exact served model name (a label value cannot hold every model name, e.g. ``org/model``)."""
MANAGED_BY = "phasewise-operator"

ANNOTATION_RESTART_HASH = "phasewise.io/restart-hash"
ANNOTATION_PROFILE_HASH = "phasewise.io/profile-hash"
ANNOTATION_CONFIG_HASH = "phasewise.io/config-hash"

CONFIG_DIR = "/etc/phasewise"
CONFIG_FILE = f"{CONFIG_DIR}/routerd.yaml"
PROFILE_FILE = f"{CONFIG_DIR}/profile.yaml"
CHECKPOINT_DIR = f"{CONFIG_DIR}/checkpoint"
PREDICTOR_DIR = "/var/lib/phasewise/predictor"

KEY_CONFIG = "routerd.yaml"
KEY_PROFILE = "profile.yaml"
KEY_CKPT_MODEL = "checkpoint-model.safetensors"
KEY_CKPT_META = "checkpoint-metadata.json"

ROUTERD_HTTP_PORT = 8000
ROUTERD_GRPC_PORT = 50051
UID = 65532
"""User and group every container runs as (the images' ``phasewise`` user; any non-root id works)."""

RESTART_KEYS = ("http", "grpc", "event_loop", "kubernetes", "reload", "log_level")
"""Top-level routerd settings it reads only at start (``Daemon.reload`` warns about http, grpc and
event_loop; the EndpointSlice watcher, the reload watcher and logging are set up once).
Their hash rolls the routerd pods; every other setting is reloaded in place."""

ROUTERD_DRAIN_S = 30.0

_SIDECAR_DEFAULT_RESOURCES = {"requests": {"cpu": "50m", "memory": "96Mi"}, "limits": {"memory": "256Mi"}}
_ROUTERD_DEFAULT_RESOURCES = {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
_ENVOY_DEFAULT_RESOURCES = {"requests": {"cpu": "250m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}
_EMULATOR_DEFAULT_RESOURCES = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}


@dataclass(frozen=True)
class PoolRef:
    """The identity of a pool object: what owner references and names need."""

    name: str
    namespace: str
    uid: str
    generation: int = 1


def engine_name(pool: str) -> str:
    """Deployment and headless Service of the serving instances."""
    return f"{pool}-engine"


def engine_group_name(pool: str, group: str) -> str:
    """Deployment (and, for a multi-model pool, headless Service) of engine group ``group``
    (``spec.engineGroups[].name``); "" = the single-model ``P-engine``.

    Unique among every pool's children: group names exclude the words ``engine``, ``routerd``
    and ``epp`` (``gen_crds.RESERVED_GROUP_WORDS``), so no pool's ``<q>-engine``, ``<q>-routerd``
    or ``<q>-epp`` can take this name.
    """
    return f"{engine_name(pool)}-{group}" if group else engine_name(pool)


def model_label(served: str) -> str:
    """``served`` as a label value (at most 63 of ``[A-Za-z0-9._-]``, alphanumeric at both ends).

    Other characters (``/`` of ``org/model``) become ``_``; a longer name keeps its first
    46 characters and a hash of the whole, so two long names stay apart. The exact name
    is in the :data:`ANNOTATION_MODEL` annotation.
    """
    value = re.sub(r"[^A-Za-z0-9._-]", "_", served)
    if len(value) > 63:
        value = value[:46].rstrip("._-") + "-" + short_hash(served)
    return value.strip("._-") or short_hash(served)


def routerd_name(pool: str) -> str:
    """routerd's Deployment, Service, ConfigMap, ServiceAccount, Role and RoleBinding."""
    return f"{pool}-routerd"


def picker_name(pool: str) -> str:
    """The picker's Deployment and Service (``phasewise epp``); GIE's own charts call theirs ``<pool>-epp``."""
    return f"{pool}-epp"


def envoy_configmap_name(pool: str) -> str:
    """The ConfigMap of the standalone Envoy's bootstrap."""
    return f"{picker_name(pool)}-envoy"


def inference_pool_name(pool: str) -> str:
    """The InferencePool: the LLMRouterPool's own name, so an HTTPRoute's backendRef names the pool users know."""
    return pool


def labels(pool: str, component: str) -> dict[str, str]:
    """Labels of every child object (and of its pods)."""
    return {
        LABEL_NAME: "phasewise",
        LABEL_INSTANCE: pool,
        LABEL_COMPONENT: component,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_PART_OF: "phasewise",
        LABEL_POOL: pool,
    }


def selector(pool: str, component: str) -> dict[str, str]:
    """The pod selector of a component (a subset of :func:`labels`, immutable once created)."""
    return {LABEL_POOL: pool, LABEL_COMPONENT: component}


def engine_selector(pool: str, group: str = "") -> dict[str, str]:
    """The pod selector of one engine Deployment: :func:`selector` plus the group, so no two groups'
    Deployments select each other's pods (the single-model form keeps its selector: it is immutable)."""
    sel = selector(pool, "engine")
    if group:
        sel[LABEL_ENGINE_GROUP] = group
    return sel


def selector_string(pool: str, component: str) -> str:
    """:func:`selector` as a label-selector string (the scale subresource's ``status.selector``)."""
    return ",".join(f"{k}={v}" for k, v in selector(pool, component).items())


def owner_reference(pool: PoolRef, kind: str = "LLMRouterPool") -> dict[str, Any]:
    """A controller owner reference: garbage collection deletes the child with the owner."""
    return {"apiVersion": API_VERSION, "kind": kind, "name": pool.name, "uid": pool.uid,
            "controller": True, "blockOwnerDeletion": True}


def _meta(pool: PoolRef, name: str, component: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "namespace": pool.namespace, "labels": labels(pool.name, component),
            "ownerReferences": [owner_reference(pool)], **extra}


def short_hash(data: Any) -> str:
    """First 16 hex digits of the SHA-256 of ``data`` (canonical JSON, or the bytes/str itself)."""
    if isinstance(data, str):
        raw = data.encode()
    elif isinstance(data, bytes):
        raw = data
    else:
        raw = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


# ---------------------------------------------------------------- security

def pod_security_context() -> dict[str, Any]:
    """Pod-level part of the restricted Pod Security Standard."""
    return {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
            "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context() -> dict[str, Any]:
    """Container-level part of the restricted Pod Security Standard, with a read-only root file system."""
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def _resources(res: Resources, default: Mapping[str, Any]) -> dict[str, Any]:
    given = res.k8s()
    return given if given else json.loads(json.dumps(default))


# ---------------------------------------------------------------- routerd settings

@dataclass(frozen=True)
class Checkpoint:
    """A DQN checkpoint's two files, as read from its ConfigMap."""

    config_map: str
    model_b64: str
    """``model.safetensors``, base64 (ConfigMap ``binaryData``)."""
    metadata_json: str

    @property
    def digest(self) -> str:
        """Content hash (shows in routerd.yaml, so the file changes when only the checkpoint does)."""
        return short_hash(self.model_b64 + "\n" + self.metadata_json)


def routerd_settings(pool: PoolRef, spec: PoolSpec, *, checkpoint: Checkpoint | None = None) -> dict[str, Any]:
    """routerd's settings for the pool: what :class:`routerd.daemon.config.Settings` validates.

    Endpoints come from the EndpointSlices of the engine Service (ports ``http`` and
    ``state``) for a single-model pool, or from those of the per-group Services of a multi-model
    one (:func:`group_services`), each endpoint with its group's profile where the group sets one
    (``kubernetes.selector``, ``profile_label``, ``profiles``); ``models`` lists each
    group's served name once, in spec order; the profile is a shipped name or :data:`PROFILE_FILE`; policy ``dqn``
    loads its checkpoint from :data:`CHECKPOINT_DIR`; the predictor is ``predictor.name``
    (``none`` turns it off), the volume's folder under :data:`PREDICTOR_DIR`, or, when
    ``spec.predictor`` is unset or null, :data:`~phasewise_operator.gen_crds.DEFAULT_PREDICTOR`
    (the model shipped in the routerd image); ``prefix`` is :func:`prefix_settings`, left out
    when the pool sets none, and with prefix mode precise ``kubernetes.kv_events_port_name``
    names the engine Service's ``kv-events`` port.

    Raises:
        SpecError: an unknown profile or an invalid inline profile (from :func:`resolve_profile`).
    """
    resolve_profile(spec, pool_name=pool.name)  # raises SpecError naming the field
    params = dict(spec.routing.params)
    policy = spec.routing_policy()
    if policy == "dqn":
        params["checkpoint"] = CHECKPOINT_DIR
    if spec.predictor is None:
        predictor = DEFAULT_PREDICTOR
    elif spec.predictor.name is not None:
        predictor = spec.predictor.name
    else:
        sub = spec.predictor.persistent_volume_claim.path.strip("/")  # type: ignore[union-attr]
        predictor = f"{PREDICTOR_DIR}/{sub}" if sub else PREDICTOR_DIR
    # The sidecar must refresh a snapshot well within state.max_age_s, or every instance
    # looks stale and routerd routes on its own bookkeeping only.
    max_age = max(2.0, 4 * spec.sidecar.interval_seconds)
    kubernetes = {"enabled": True, "namespace": pool.namespace, "service": engine_name(pool.name),
                  "http_port_name": "http", "state_port_name": "state"}
    if spec.routing.precise_prefix:
        kubernetes["kv_events_port_name"] = KV_EVENTS_PORT_NAME
    if spec.multi_model:
        # Each group's own Service (group_services): its slices carry the group label, and a
        # group with its own profile gives it to its endpoints; the others keep the pool's.
        kubernetes["selector"] = f"{LABEL_POOL}={pool.name},{LABEL_COMPONENT}={GROUP_SERVICE_COMPONENT}"
        kubernetes["profile_label"] = LABEL_ENGINE_GROUP
        kubernetes["profiles"] = {g.name: group_profile_file(g) for g in own_profile_groups(spec)}
    out = {
        "http": {"host": "0.0.0.0", "port": ROUTERD_HTTP_PORT},
        "grpc": {"host": "0.0.0.0", "port": ROUTERD_GRPC_PORT},
        # The union of the groups' names: routerd learns which endpoint serves which from
        # each endpoint's own /v1/models, so every group stays behind the one engine Service.
        "models": spec.served_models(),
        "kubernetes": kubernetes,
        "policy": {"name": policy, "params": params},
        "profile": spec.hardware_profile.name if spec.hardware_profile.name is not None else PROFILE_FILE,
        "predictor": predictor,
        "router": {"queue_limit": spec.routing.queue_limit,
                   "action_interval_s": spec.routing.action_interval_seconds},
        "state": {"max_age_s": max_age},
        "drain_timeout_s": ROUTERD_DRAIN_S,
        "reload": {"watch": True, "poll_interval_s": 1.0},
        "log_level": spec.routerd.log_level,
    }
    prefix = prefix_settings(spec)
    if prefix:
        out["prefix"] = prefix
    if spec.picker:
        out["epp"] = epp_settings(spec)
    return out


def epp_settings(spec: PoolSpec) -> dict[str, Any]:
    """routerd's ``epp`` settings for ``phasewise epp`` (``spec.gateway.picker``): the ecosystem's ports, the mode.

    ``phasewise serve`` ignores the section, so it is only rendered for a pool with a picker
    (a pool without one keeps its routerd.yaml byte for byte).
    """
    return {"host": "0.0.0.0", "port": EPP_GRPC_PORT, "health_port": EPP_HEALTH_PORT,
            "metrics_port": EPP_METRICS_PORT, "mode": spec.gateway.picker.mode}  # type: ignore[union-attr]


def prefix_settings(spec: PoolSpec) -> dict[str, Any]:
    """routerd's ``prefix`` settings from ``spec.routing.prefix``: the fields set, by routerd's names.

    Every unset field is left out, so routerd's own default applies (the mode's included:
    one place for it, routerd's settings model; an unset ``block_size`` lets routerd learn
    each engine's own, which the operator never pins on vLLM either). Mode ``precise`` adds what the engines and
    routerd must agree on, ``kv_events.port`` and ``topic`` (vLLM's defaults unless set),
    and in an emulated pool ``tokenizer: bytes`` unless set, the emulator's tokenizer
    (without it routerd could not tokenize like the engines and would stay approximate).
    {} when the pool sets nothing.
    """
    p = spec.routing.prefix
    if p is None:
        return {}
    out: dict[str, Any] = {}
    for field, key in (("mode", "mode"), ("block_size", "block_size"), ("chunk_blocks", "chunk_blocks"),
                       ("max_prompt_tokens", "max_prompt_tokens"),
                       ("index_capacity_blocks", "index_capacity_blocks"), ("tokenizer", "tokenizer")):
        value = getattr(p, field)
        if value is not None:
            out[key] = value
    ke = p.kv_events
    events: dict[str, Any] = {}
    if ke is not None:
        for field, key in (("port", "port"), ("topic", "topic"), ("stale_after_seconds", "stale_after_s"),
                           ("max_blocks", "max_blocks")):
            value = getattr(ke, field)
            if value is not None:
                events[key] = value
    if p.precise:
        events["port"] = spec.routing.kv_events_port
        events["topic"] = spec.routing.kv_events_topic
        if spec.emulated and p.tokenizer is None:
            out["tokenizer"] = "bytes"
    if events:
        out["kv_events"] = {k: events[k] for k in ("port", "topic", "stale_after_s", "max_blocks") if k in events}
    return out


def kv_events_config(spec: PoolSpec) -> str | None:
    """The engines' ``--kv-events-config`` JSON with prefix mode precise, else None.

    vLLM's ``KVEventsConfig`` fields (``vllm/config/kv_events.py``, :func:`~phasewise_operator.spec.kv_events_fields`):
    events on, the ZMQ publisher bound on every address at the port routerd subscribes to
    (``prefix.kv_events.port`` of :func:`prefix_settings`), the same topic; the rest
    (buffer_steps, hwm, replay endpoint) stay vLLM's.
    """
    if not spec.routing.precise_prefix:
        return None
    return json.dumps(kv_events_fields(spec.routing.kv_events_port, spec.routing.kv_events_topic),
                      separators=(",", ":"))


def _kv_events_parts(spec: PoolSpec, user_args: Sequence[str] = ()) -> tuple[list[str], list[dict[str, Any]]]:
    """(args, container ports) an engine container adds with prefix mode precise; empty otherwise.

    The args are left out where ``user_args`` give ``--kv-events-config`` themselves (``check_pool``
    has checked that theirs publishes on the same port and topic); the port is named either way.
    """
    cfg = kv_events_config(spec)
    if cfg is None:
        return [], []
    args = [] if flag_uses(list(user_args), KV_EVENTS_FLAG) else [KV_EVENTS_FLAG, cfg]
    return args, [{"name": KV_EVENTS_PORT_NAME, "containerPort": spec.routing.kv_events_port, "protocol": "TCP"}]


def vllm_args(spec: PoolSpec, group: EngineGroup | None = None) -> list[str]:
    """The vLLM container's arguments after ``vllm serve``.

    ``MODEL --served-model-name NAME --host 0.0.0.0 --port PORT``, the group's ``args``, then
    the operator's own flags: ``--enable-prompt-tokens-details`` always, and with prefix mode
    precise ``--kv-events-config`` (:func:`kv_events_config`). Never ``--block-size``: each
    engine keeps its attention backend's default (16 on most GPU backends, 128 on vLLM's CPU
    build) unless the args give one, and routerd learns each engine's block size.

    A flag of the operator's own that the args already give, in any spelling vLLM reads as it
    (:func:`~phasewise_operator.spec.flag_uses`: underscores, ``=value``, dotted keys, the
    ``--no-`` form), is left out: the user's wins (``--no-enable-prompt-tokens-details`` turns
    the cached-token counts off; a ``--kv-events-config`` in precise mode must agree with
    routerd, which ``check_pool`` enforces). The operator's flags come after the args, so a
    spelling not recognized here (an abbreviation) still loses to them, as argparse keeps the
    last. ``--model``, ``--served-model-name`` and ``--port`` come from spec fields and
    ``check_pool`` refuses them in args.
    """
    e = spec.engine
    g = _group(spec, group)
    own: list[str] = []
    if not flag_uses(g.args, PROMPT_TOKENS_DETAILS_FLAG):
        own.append(PROMPT_TOKENS_DETAILS_FLAG)
    own += _kv_events_parts(spec, g.args)[0]
    return [g.model.name, "--served-model-name", g.model.served, "--host", "0.0.0.0", "--port", str(e.port),
            *g.args, *own]


def render_settings(settings: Mapping[str, Any], checkpoint: Checkpoint | None = None) -> str:
    """``routerd.yaml``: the settings as YAML, headed by a comment naming the checkpoint content.

    The comment makes the file differ whenever the checkpoint does, so routerd's reload
    (on a file change) also picks up a new checkpoint under the same path.
    """
    head = "# Rendered by the phasewise operator from the LLMRouterPool; edits are overwritten.\n"
    if checkpoint is not None:
        head += f"# checkpoint: ConfigMap {checkpoint.config_map}, content {checkpoint.digest}\n"
    return head + yaml.safe_dump(dict(settings), sort_keys=False)


def restart_hash(settings: Mapping[str, Any]) -> str:
    """Hash of the settings routerd reads only at start (:data:`RESTART_KEYS`)."""
    return short_hash({k: settings.get(k) for k in RESTART_KEYS})


def profile_yaml(pool: PoolRef, spec: PoolSpec, group: EngineGroup | None = None) -> str:
    """The pool's resolved hardware profile (``group``'s own, when it sets one) as a routerd profile
    file (snake_case, ``load_profile_file``)."""
    prof = resolve_profile(spec, pool_name=pool.name, group=group)
    return yaml.safe_dump(prof.model_dump(), sort_keys=False)


#: Component label of the per-group engine Services of a mixed-profile pool (not ``engine``: the
#: ServiceMonitor scrapes ``engine`` Services, and would scrape every instance twice).
GROUP_SERVICE_COMPONENT = "engine-group"


def group_profile_key(group: str) -> str:
    """ConfigMap key (and file name under :data:`CONFIG_DIR`) of engine group ``group``'s own profile."""
    return f"profile-{group}.yaml"


def own_profile_groups(spec: PoolSpec) -> list[EngineGroup]:
    """The engine groups that set their own ``hardwareProfile``, in spec order."""
    return [g for g in spec.groups() if g.hardware_profile is not None]


def group_profile_file(g: EngineGroup) -> str:
    """Where routerd and ``g``'s emulators read ``g``'s profile: its own file, else :data:`PROFILE_FILE`."""
    return f"{CONFIG_DIR}/{group_profile_key(g.name)}" if g.hardware_profile is not None else PROFILE_FILE


# ---------------------------------------------------------------- ConfigMap

def routerd_configmap(pool: PoolRef, spec: PoolSpec, *, checkpoint: Checkpoint | None = None) -> dict[str, Any]:
    """``P-routerd``: routerd.yaml, profile.yaml (always: the emulators read it too) and the checkpoint."""
    settings = routerd_settings(pool, spec, checkpoint=checkpoint)
    data = {KEY_CONFIG: render_settings(settings, checkpoint), KEY_PROFILE: profile_yaml(pool, spec)}
    for g in own_profile_groups(spec):
        data[group_profile_key(g.name)] = profile_yaml(pool, spec, g)
    cm: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap",
                          "metadata": _meta(pool, routerd_name(pool.name), "routerd"), "data": data}
    if checkpoint is not None:
        data[KEY_CKPT_META] = checkpoint.metadata_json
        cm["binaryData"] = {KEY_CKPT_MODEL: checkpoint.model_b64}
    return cm


def _config_volume(with_checkpoint: bool, only_profile: bool = False, profile_keys: Sequence[str] = ()) -> dict[str, Any]:
    items = [{"key": KEY_PROFILE, "path": KEY_PROFILE}, *({"key": k, "path": k} for k in profile_keys)]
    if not only_profile:
        items.insert(0, {"key": KEY_CONFIG, "path": KEY_CONFIG})
        if with_checkpoint:
            items += [{"key": KEY_CKPT_MODEL, "path": "checkpoint/model.safetensors"},
                      {"key": KEY_CKPT_META, "path": "checkpoint/metadata.json"}]
    return {"name": "config", "configMap": {"name": "", "items": items, "optional": not only_profile}}


# ---------------------------------------------------------------- engine

def _env(pairs: Mapping[str, str]) -> list[dict[str, Any]]:
    return [{"name": k, "value": v} for k, v in pairs.items()]


def _merge_env(fixed: Mapping[str, str], user) -> list[dict[str, Any]]:
    """The operator's variables, then ``engine.env``; a user variable replaces a fixed one of the same name
    (server-side apply refuses a container with two variables of one name)."""
    user_env = [v.model_dump(by_alias=True, exclude_none=True) for v in user]
    user_names = {v["name"] for v in user_env}
    return [v for v in _env(fixed) if v["name"] not in user_names] + user_env


_POD_ENV = [
    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
]


def _group(spec: PoolSpec, group: EngineGroup | None) -> EngineGroup:
    """``group``, or the one group of a single-model pool (the first of a multi-model one)."""
    return group if group is not None else spec.groups()[0]


def vllm_container(spec: PoolSpec, settings: OperatorSettings, group: EngineGroup | None = None) -> dict[str, Any]:
    """The vLLM container: ``vllm serve`` with :func:`vllm_args`.

    With prefix mode precise, also the container port ``kv-events`` the events are published on.

    ``group`` (default: the pool's only one) supplies the model, args, env and resources.
    vLLM writes caches under HOME, HF_HOME, the Triton and TorchInductor cache dirs and
    needs a user name (``getpass.getuser``), which an arbitrary non-root UID lacks in
    /etc/passwd: every such path points into the ``cache`` volume and ``USER`` is set.
    """
    e = spec.engine
    g = _group(spec, group)
    hf_home = "/models" if e.model_cache_claim else "/cache/huggingface"
    fixed_env = {
        "HOME": "/cache", "USER": "phasewise", "HF_HOME": hf_home, "XDG_CACHE_HOME": "/cache/xdg",
        "XDG_CONFIG_HOME": "/cache/config", "VLLM_CACHE_ROOT": "/cache/vllm", "VLLM_CONFIG_ROOT": "/cache/config/vllm",
        "TRITON_CACHE_DIR": "/cache/triton", "TORCHINDUCTOR_CACHE_DIR": "/cache/torchinductor",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
    }
    env = _merge_env(fixed_env, g.env)
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": "/cache"},
              {"name": "dshm", "mountPath": "/dev/shm"}]
    if e.model_cache_claim:
        mounts.append({"name": "models", "mountPath": "/models"})
    probe = {"httpGet": {"path": "/health", "port": "http"}, "timeoutSeconds": 5}
    _, kv_ports = _kv_events_parts(spec)
    return {
        "name": "vllm",
        "image": e.image or settings.vllm_image,
        "imagePullPolicy": e.image_pull_policy or settings.image_pull_policy,
        "command": ["vllm", "serve"],
        "args": vllm_args(spec, g),
        "ports": [{"name": "http", "containerPort": e.port, "protocol": "TCP"}, *kv_ports],
        "env": env,
        "resources": g.resources.k8s(),
        "startupProbe": {**probe, "periodSeconds": 10, "failureThreshold": max(1, math.ceil(e.startup_seconds / 10))},
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 6},
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
    }


def emulator_container(spec: PoolSpec, settings: OperatorSettings,
                       group: EngineGroup | None = None) -> dict[str, Any]:
    """``phasewise emulate``: the OpenAI API (serving the group's model name) and vLLM-named /metrics,
    timed by the group's own profile or else the pool's; with prefix mode precise, its KV events as vLLM's (the same
    ``--kv-events-config`` and ``kv-events`` port as :func:`vllm_container`)."""
    e = spec.engine
    g = _group(spec, group)
    probe = {"httpGet": {"path": "/health", "port": "http"}, "timeoutSeconds": 5}
    kv_args, kv_ports = _kv_events_parts(spec)
    return {
        "name": "emulator",
        "image": spec.routerd.image or settings.routerd_image,
        "imagePullPolicy": spec.routerd.image_pull_policy or settings.image_pull_policy,
        "command": ["phasewise", "emulate"],
        "args": ["--host", "0.0.0.0", "--port", str(e.port), "--profile", group_profile_file(g),
                 "--model", g.model.served, *kv_args],
        "ports": [{"name": "http", "containerPort": e.port, "protocol": "TCP"}, *kv_ports],
        "env": _merge_env({"HOME": "/tmp"}, g.env),
        "resources": _resources(g.resources, _EMULATOR_DEFAULT_RESOURCES),
        "readinessProbe": {**probe, "periodSeconds": 2, "failureThreshold": 3},
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 6},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                         {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}],
        "securityContext": container_security_context(),
    }


def sidecar_container(spec: PoolSpec, settings: OperatorSettings) -> dict[str, Any]:
    """``phasewise sidecar``: scrapes the engine's /metrics on loopback, serves its state over gRPC (port ``state``)."""
    e, s = spec.engine, spec.sidecar
    return {
        "name": "sidecar",
        "image": spec.routerd.image or settings.routerd_image,
        "imagePullPolicy": spec.routerd.image_pull_policy or settings.image_pull_policy,
        "command": ["phasewise", "sidecar"],
        "args": ["--metrics-url", f"http://127.0.0.1:{e.port}/metrics", "--listen", f"0.0.0.0:{s.port}",
                 "--instance", "$(POD_NAME)", "--interval", f"{s.interval_seconds:g}"],
        "ports": [{"name": "state", "containerPort": s.port, "protocol": "TCP"}],
        "env": [*_POD_ENV, {"name": "HOME", "value": "/tmp"}],
        "resources": _resources(s.resources, _SIDECAR_DEFAULT_RESOURCES),
        # gRPC health (grpc.health.v1) of the sidecar itself, not of the engine: a sidecar
        # that cannot scrape stays up and reports the instance unhealthy to routerd.
        "readinessProbe": {"grpc": {"port": s.port}, "periodSeconds": 5, "timeoutSeconds": 3},
        "livenessProbe": {"grpc": {"port": s.port}, "periodSeconds": 10, "timeoutSeconds": 3, "failureThreshold": 6},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": container_security_context(),
    }


def engine_deployment(pool: PoolRef, spec: PoolSpec, settings: OperatorSettings,
                      group: EngineGroup | None = None) -> dict[str, Any]:
    """One engine Deployment: one serving instance per replica, each with its sidecar.

    ``group`` None or the single-model form's: ``P-engine``, exactly as before engine
    groups existed (same name, labels and selector, so an upgrade rolls no pod). A group
    of ``spec.engineGroups``: ``P-engine-G``, its Deployment and pods labelled with
    :data:`LABEL_ENGINE_GROUP` and :data:`LABEL_MODEL`, selected by :func:`engine_selector`.
    """
    e = spec.engine
    g = _group(spec, group)
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}]
    annotations: dict[str, str] = {}
    if spec.emulated:
        main = emulator_container(spec, settings, g)
        own = [group_profile_key(g.name)] if g.hardware_profile is not None else []
        vol = _config_volume(False, only_profile=True, profile_keys=own)
        vol["configMap"]["name"] = routerd_name(pool.name)
        volumes.append(vol)
        # The emulated hardware is the group's profile: a new profile restarts the emulators.
        annotations[ANNOTATION_PROFILE_HASH] = short_hash(profile_yaml(pool, spec, g))
    else:
        main = vllm_container(spec, settings, g)
        volumes += [{"name": "cache", "emptyDir": {}},
                    {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": e.shared_memory}}]
        if e.model_cache_claim:
            volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": e.model_cache_claim}})
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
        "containers": [main, sidecar_container(spec, settings)],
        "volumes": volumes,
        "terminationGracePeriodSeconds": 30 if spec.emulated else 60,
    }
    if g.node_selector:
        pod_spec["nodeSelector"] = dict(g.node_selector)
    if g.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in g.tolerations]
    if g.affinity:
        pod_spec["affinity"] = json.loads(json.dumps(g.affinity))
    if g.topology_spread_constraints:
        pod_spec["topologySpreadConstraints"] = topology_spread(g.topology_spread_constraints,
                                                                engine_selector(pool.name, g.name))
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s.name} for s in spec.image_pull_secrets]
    pod_labels = labels(pool.name, "engine")
    meta = _meta(pool, engine_group_name(pool.name, g.name), "engine")
    if g.name:
        group_labels = {LABEL_ENGINE_GROUP: g.name, LABEL_MODEL: model_label(g.model.served)}
        pod_labels.update(group_labels)
        meta["labels"].update(group_labels)
        meta["annotations"] = {ANNOTATION_MODEL: g.model.served}
        annotations[ANNOTATION_MODEL] = g.model.served
    template_meta: dict[str, Any] = {"labels": pod_labels}
    if annotations:
        template_meta["annotations"] = annotations
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": g.replicas,
            "selector": {"matchLabels": engine_selector(pool.name, g.name)},
            # A GPU node rarely has room for a surge pod: replace one instance at a time.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0 if not spec.emulated else 1,
                                                                   "maxUnavailable": 1}},
            "template": {"metadata": template_meta, "spec": pod_spec},
        },
    }


def topology_spread(constraints, own_selector: Mapping[str, str]) -> list[dict[str, Any]]:
    """The pod spec's ``topologySpreadConstraints``; one without ``labelSelector`` gets the Deployment's own
    pod selector (without any, Kubernetes counts no pods and the constraint spreads nothing)."""
    out = []
    for c in constraints:
        item = c.model_dump(by_alias=True, exclude_none=True)
        item.setdefault("labelSelector", {"matchLabels": dict(own_selector)})
        out.append(item)
    return out


def engine_deployments(pool: PoolRef, spec: PoolSpec, settings: OperatorSettings) -> list[dict[str, Any]]:
    """Every engine Deployment of the pool, one per group in spec order (one for ``spec.model``)."""
    return [engine_deployment(pool, spec, settings, g) for g in spec.groups()]


def stale_engine_deployments(pool: PoolRef, spec: PoolSpec, observed: list[Mapping[str, Any]]) -> list[str]:
    """Names of the observed engine Deployments the pool owns but no longer wants (a removed group, or
    ``P-engine`` after a switch to engineGroups), to delete after the wanted ones are applied.

    Only Deployments whose controller owner reference is this pool's uid count: a
    Deployment someone else made with the pool's labels is left alone.
    """
    wanted = {engine_group_name(pool.name, g.name) for g in spec.groups()}
    out = []
    for dep in observed:
        meta = dep.get("metadata") or {}
        owned = any(r.get("controller") and r.get("uid") == pool.uid for r in meta.get("ownerReferences") or [])
        component = (meta.get("labels") or {}).get(LABEL_COMPONENT)
        if owned and component == "engine" and meta.get("name") not in wanted:
            out.append(meta["name"])
    return sorted(out)


def engine_service(pool: PoolRef, spec: PoolSpec) -> dict[str, Any]:
    """``P-engine``: headless; its EndpointSlices list every instance of every group with ports ``http`` and
    ``state`` (the selector leaves the group out), and ``kv-events`` with prefix mode precise."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(pool, engine_name(pool.name), "engine"),
        "spec": {
            "clusterIP": "None",
            "selector": selector(pool.name, "engine"),
            "publishNotReadyAddresses": False,
            "ports": _engine_ports(spec),
        },
    }


def group_services(pool: PoolRef, spec: PoolSpec) -> list[dict[str, Any]]:
    """A multi-model pool's (``spec.engineGroups``) ``P-engine-G`` per group: headless, selecting
    that group's pods, labelled with :data:`LABEL_ENGINE_GROUP` and component
    :data:`GROUP_SERVICE_COMPONENT`. The API server copies a Service's labels to its EndpointSlices,
    so routerd watches these slices by label and learns each endpoint's group, and so its profile
    when the group sets one (:func:`routerd_settings`). Rendered whether or not a group sets a
    profile, so that giving a group one (or taking it away) changes only routerd's settings: the
    Services routerd's running pods watch stay. Empty for a single-model pool.

    Raises:
        SpecError: a Service name longer than 63 characters (a DNS-1035 label), naming the group.
    """
    if not spec.multi_model:
        return []
    out = []
    for g in spec.groups():
        name = engine_group_name(pool.name, g.name)
        if len(name) > 63:
            raise SpecError(g.field("name"), f"the group's Service {name} would be {len(name)} characters, "
                            "more than the 63 of a Service name: shorten the pool or group name")
        meta = _meta(pool, name, GROUP_SERVICE_COMPONENT)
        meta["labels"][LABEL_ENGINE_GROUP] = g.name
        out.append({"apiVersion": "v1", "kind": "Service", "metadata": meta,
                    "spec": {"clusterIP": "None", "selector": engine_selector(pool.name, g.name),
                             "publishNotReadyAddresses": False, "ports": _engine_ports(spec)}})
    return out


def stale_group_services(pool: PoolRef, spec: PoolSpec | None, observed: list[Mapping[str, Any]]) -> list[str]:
    """Names of the observed per-group engine Services the pool owns but no longer wants (a group
    removed, or no group with its own profile any more)."""
    wanted = {o["metadata"]["name"] for o in group_services(pool, spec)} if spec is not None else set()
    out = []
    for svc in observed:
        meta = svc.get("metadata") or {}
        owned = any(r.get("controller") and r.get("uid") == pool.uid for r in meta.get("ownerReferences") or [])
        if owned and (meta.get("labels") or {}).get(LABEL_COMPONENT) == GROUP_SERVICE_COMPONENT \
                and meta.get("name") not in wanted:
            out.append(meta["name"])
    return sorted(out)


def _engine_ports(spec: PoolSpec) -> list[dict[str, Any]]:
    ports = [
        {"name": "http", "port": spec.engine.port, "targetPort": "http", "protocol": "TCP",
         "appProtocol": "http"},
        {"name": "state", "port": spec.sidecar.port, "targetPort": "state", "protocol": "TCP",
         "appProtocol": "kubernetes.io/h2c"},
    ]
    if spec.routing.precise_prefix:
        ports.append({"name": KV_EVENTS_PORT_NAME, "port": spec.routing.kv_events_port,
                      "targetPort": KV_EVENTS_PORT_NAME, "protocol": "TCP"})
    return ports


# ---------------------------------------------------------------- routerd

def routerd_rbac(pool: PoolRef) -> list[dict[str, Any]]:
    """ServiceAccount, Role and RoleBinding: routerd may get, list and watch EndpointSlices, nothing else."""
    name = routerd_name(pool.name)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(pool, name, "routerd"),
         "automountServiceAccountToken": False},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(pool, name, "routerd"),
         "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": _meta(pool, name, "routerd"),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": pool.namespace}]},
    ]


def _router_volumes(pool: PoolRef, spec: PoolSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) of the router's process (routerd or the picker): routerd's ConfigMap, a
    writable /tmp and, when the pool names one, the predictor's PersistentVolumeClaim."""
    vol = _config_volume(True, profile_keys=[group_profile_key(g.name) for g in own_profile_groups(spec)])
    vol["configMap"]["name"] = routerd_name(pool.name)
    volumes: list[dict[str, Any]] = [vol, {"name": "tmp", "emptyDir": {}}]
    mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}, {"name": "tmp", "mountPath": "/tmp"}]
    if spec.predictor is not None and spec.predictor.persistent_volume_claim is not None:
        volumes.append({"name": "predictor", "persistentVolumeClaim": {
            "claimName": spec.predictor.persistent_volume_claim.claim_name, "readOnly": True}})
        mounts.append({"name": "predictor", "mountPath": PREDICTOR_DIR, "readOnly": True})
    return volumes, mounts


def routerd_deployment(pool: PoolRef, spec: PoolSpec, settings: OperatorSettings, *,
                       checkpoint: Checkpoint | None = None) -> dict[str, Any]:
    """``P-routerd``: ``phasewise serve`` reading the ConfigMap, with the EndpointSlice RBAC's token."""
    r = spec.routerd
    rs = routerd_settings(pool, spec, checkpoint=checkpoint)
    volumes, mounts = _router_volumes(pool, spec)
    container = {
        "name": "routerd",
        "image": r.image or settings.routerd_image,
        "imagePullPolicy": r.image_pull_policy or settings.image_pull_policy,
        "command": ["phasewise", "serve"],
        "args": ["--config", CONFIG_FILE],
        "ports": [{"name": "http", "containerPort": ROUTERD_HTTP_PORT, "protocol": "TCP"},
                  {"name": "grpc", "containerPort": ROUTERD_GRPC_PORT, "protocol": "TCP"}],
        "env": [*_POD_ENV, {"name": "HOME", "value": "/tmp"}],
        "resources": _resources(r.resources, _ROUTERD_DEFAULT_RESOURCES),
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 2, "timeoutSeconds": 2,
                           "failureThreshold": 2},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 10, "timeoutSeconds": 3,
                          "failureThreshold": 6},
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
    }
    return _router_deployment(pool, spec, routerd_name(pool.name), "routerd", r.replicas, [container], volumes,
                              {ANNOTATION_RESTART_HASH: restart_hash(rs)})


def _router_deployment(pool: PoolRef, spec: PoolSpec, name: str, component: str, replicas: int,
                       containers: list[dict[str, Any]], volumes: list[dict[str, Any]],
                       annotations: dict[str, str]) -> dict[str, Any]:
    """A Deployment of the router's process (routerd, or the endpoint picker): routerd's
    ServiceAccount, the restricted pod security context, surge-only rolling updates, and time
    to drain (routerd drains queued and in-flight requests for drain_timeout_s after SIGTERM)."""
    pod_spec: dict[str, Any] = {
        "serviceAccountName": routerd_name(pool.name),
        "automountServiceAccountToken": True,
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
        "containers": containers,
        "volumes": volumes,
        "terminationGracePeriodSeconds": int(ROUTERD_DRAIN_S) + 15,
    }
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s.name} for s in spec.image_pull_secrets]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(pool, name, component),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector(pool.name, component)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": labels(pool.name, component), "annotations": annotations},
                         "spec": pod_spec},
        },
    }


def routerd_service(pool: PoolRef, spec: PoolSpec) -> dict[str, Any]:
    """``P-routerd``: the OpenAI API (port ``spec.routerd.service.port``) and routerd's gRPC API (50051)."""
    svc = spec.routerd.service
    http_port: dict[str, Any] = {"name": "http", "port": svc.port, "targetPort": "http", "protocol": "TCP",
                                 "appProtocol": "http"}
    if svc.node_port is not None:
        http_port["nodePort"] = svc.node_port
    meta = _meta(pool, routerd_name(pool.name), "routerd")
    if svc.annotations:
        meta["annotations"] = dict(svc.annotations)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": svc.type,
            "selector": selector(pool.name, "routerd"),
            "ports": [http_port,
                      {"name": "grpc", "port": ROUTERD_GRPC_PORT, "targetPort": "grpc", "protocol": "TCP",
                       "appProtocol": "kubernetes.io/h2c"}],
        },
    }


# ---------------------------------------------------------------- gateway: picker, Envoy, InferencePool

INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
"""The InferencePool's group/version (GIE ``api/v1/inferencepool_types.go``, v1.0.0 and later)."""
INFERENCE_POOL_PLURAL = "inferencepools"
ENVOY_CONFIG_DIR = "/etc/envoy"
KEY_ENVOY = "envoy.yaml"
PICKER_ADDRESS = f"127.0.0.1:{EPP_GRPC_PORT}"
"""Where the standalone Envoy finds the picker: the same pod, on loopback."""


def _envoy_config_builder():
    """routerd's Envoy bootstrap builder, ``routerd.epp.envoy_config.build_envoy_config`` (tests replace this).

    Imported late: the operator image carries routerd, but an older routerd has no picker,
    and only standalone pools need the function.
    """
    from routerd.epp.envoy_config import build_envoy_config

    return build_envoy_config


def envoy_config(spec: PoolSpec) -> dict[str, Any]:
    """The standalone Envoy's bootstrap: a listener on ``picker.envoy.port`` whose ext_proc is the picker
    beside it (:data:`PICKER_ADDRESS`), in the picker's mode; built by routerd, which ships the configuration.

    Raises:
        SpecError: this operator's routerd has no Envoy builder (naming ``spec.gateway.picker.envoy.enabled``).
    """
    p = spec.gateway.picker  # type: ignore[union-attr]
    try:
        build = _envoy_config_builder()
    except ImportError as e:
        raise SpecError("spec.gateway.picker.envoy.enabled", f"this operator's routerd has no Envoy configuration "
                        f"builder (routerd.epp.envoy_config: {e}); upgrade the operator image") from None
    try:
        return build(listen_port=p.envoy.port, picker_address=PICKER_ADDRESS, mode=p.mode)
    except ValueError as e:  # the builder's own checks (its docstring's Raises)
        raise SpecError("spec.gateway.picker.envoy", f"routerd's Envoy configuration builder refused it: {e}") from None


def envoy_configmap(pool: PoolRef, spec: PoolSpec) -> dict[str, Any]:
    """``P-epp-envoy``: ``envoy.yaml``, the standalone Envoy's bootstrap (:func:`envoy_config`)."""
    text = yaml.safe_dump(envoy_config(spec), sort_keys=False)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(pool, envoy_configmap_name(pool.name), "epp"),
            "data": {KEY_ENVOY: text}}


def envoy_container(spec: PoolSpec, settings: OperatorSettings) -> dict[str, Any]:
    """Envoy beside the picker: clients' OpenAI requests on port ``http``, each sent to the engine the picker
    names. ``--disable-hot-restart``: hot restart needs shared memory a restricted pod does not have."""
    e = spec.gateway.picker.envoy  # type: ignore[union-attr]
    return {
        "name": "envoy",
        "image": e.image or settings.envoy_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["envoy"],
        "args": ["--config-path", f"{ENVOY_CONFIG_DIR}/{KEY_ENVOY}", "--disable-hot-restart", "--log-level", "warn"],
        "ports": [{"name": "http", "containerPort": e.port, "protocol": "TCP"}],
        "resources": _resources(e.resources, _ENVOY_DEFAULT_RESOURCES),
        # Envoy's admin interface stays on loopback (not reachable by the kubelet): the listener itself
        # is what clients need.
        "readinessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 2, "timeoutSeconds": 2,
                           "failureThreshold": 2},
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10, "timeoutSeconds": 3,
                          "failureThreshold": 6},
        "volumeMounts": [{"name": "envoy-config", "mountPath": ENVOY_CONFIG_DIR, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": container_security_context(),
    }


def picker_deployment(pool: PoolRef, spec: PoolSpec, settings: OperatorSettings, *,
                      checkpoint: Checkpoint | None = None) -> dict[str, Any]:
    """``P-epp``: ``phasewise epp`` reading routerd's ConfigMap (the same router core, policy and profile),
    with gRPC health probes, and in standalone mode Envoy beside it.

    Its own Deployment, not routerd's: a gateway reaches the picker through
    ``endpointPickerRef`` (a Service of its own, as GIE's and llm-d's charts deploy it),
    scales and rolls apart from routerd's proxy, and a pool can run either or both.
    """
    p = spec.gateway.picker  # type: ignore[union-attr]
    rs = routerd_settings(pool, spec, checkpoint=checkpoint)
    volumes, mounts = _router_volumes(pool, spec)
    epp = {
        "name": "epp",
        "image": spec.routerd.image or settings.routerd_image,
        "imagePullPolicy": spec.routerd.image_pull_policy or settings.image_pull_policy,
        "command": ["phasewise", "epp"],
        "args": ["--config", CONFIG_FILE],
        "ports": [{"name": "ext-proc", "containerPort": EPP_GRPC_PORT, "protocol": "TCP"},
                  {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": EPP_METRICS_PORT, "protocol": "TCP"}],
        "env": [*_POD_ENV, {"name": "HOME", "value": "/tmp"}],
        "resources": _resources(p.resources, _ROUTERD_DEFAULT_RESOURCES),
        # readiness: the picker's state is synced (gateway-epp.md section 1); a gateway sends no
        # request to a picker that is not.
        "readinessProbe": {"grpc": {"port": EPP_HEALTH_PORT, "service": "readiness"}, "periodSeconds": 2,
                           "timeoutSeconds": 2, "failureThreshold": 2},
        "livenessProbe": {"grpc": {"port": EPP_HEALTH_PORT, "service": "liveness"}, "periodSeconds": 10,
                          "timeoutSeconds": 3, "failureThreshold": 6},
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
    }
    containers = [epp]
    # The picker reads epp's ports at start, like routerd its own: both roll it.
    annotations = {ANNOTATION_RESTART_HASH: short_hash({k: rs.get(k) for k in (*RESTART_KEYS, "epp")})}
    if spec.envoy:
        containers.append(envoy_container(spec, settings))
        volumes.append({"name": "envoy-config", "configMap": {"name": envoy_configmap_name(pool.name)}})
        # A static bootstrap is read once: a new one must roll the pods.
        annotations[ANNOTATION_CONFIG_HASH] = short_hash(envoy_config(spec))
    return _router_deployment(pool, spec, picker_name(pool.name), "epp", p.replicas, containers, volumes,
                              annotations)


def picker_service(pool: PoolRef, spec: PoolSpec) -> dict[str, Any]:
    """``P-epp``: the picker's ext_proc (9002, h2c), gRPC health (9003) and metrics (9090); in standalone
    mode also Envoy's ``http`` port, which clients call."""
    ports: list[dict[str, Any]] = [
        {"name": "grpc-ext-proc", "port": EPP_GRPC_PORT, "targetPort": "ext-proc", "protocol": "TCP",
         "appProtocol": "kubernetes.io/h2c"},
        {"name": "grpc-health", "port": EPP_HEALTH_PORT, "targetPort": "grpc-health", "protocol": "TCP",
         "appProtocol": "kubernetes.io/h2c"},
        {"name": "metrics", "port": EPP_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP",
         "appProtocol": "http"},
    ]
    if spec.envoy:
        ports.append({"name": "http", "port": spec.gateway.picker.envoy.port,  # type: ignore[union-attr]
                      "targetPort": "http", "protocol": "TCP", "appProtocol": "http"})
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(pool, picker_name(pool.name), "epp"),
            "spec": {"type": "ClusterIP", "selector": selector(pool.name, "epp"), "ports": ports}}


def inference_pool(pool: PoolRef, spec: PoolSpec) -> dict[str, Any]:
    """``P``, an InferencePool (GIE ``api/v1/inferencepool_types.go``, v1.6.0): ``spec.selector.matchLabels``
    selects every engine pod of every group (the engine Service's selector), ``spec.targetPorts`` the
    engines' OpenAI port, ``spec.endpointPickerRef`` the picker Service's ext_proc port."""
    ip = spec.gateway.inference_pool  # type: ignore[union-attr]
    return {
        "apiVersion": INFERENCE_POOL_API,
        "kind": "InferencePool",
        "metadata": _meta(pool, inference_pool_name(pool.name), "gateway"),
        "spec": {
            "selector": {"matchLabels": selector(pool.name, "engine")},
            "targetPorts": [{"number": spec.target_port}],
            "appProtocol": ip.app_protocol,
            "endpointPickerRef": {"group": "", "kind": "Service", "name": picker_name(pool.name),
                                  "port": {"number": EPP_GRPC_PORT}, "failureMode": ip.failure_mode},
        },
    }


def _pdb(pool: PoolRef, name: str, component: str, sel: Mapping[str, str], budget: DisruptionBudget) -> dict[str, Any]:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(pool, name, component),
            "spec": {"maxUnavailable": budget.max_unavailable, "selector": {"matchLabels": dict(sel)},
                     # A pod that is not ready (an engine still loading its model, one crash-looping)
                     # serves nothing: a drain may evict it whatever the budget says.
                     "unhealthyPodEvictionPolicy": "AlwaysAllow"}}


def disruption_budgets(pool: PoolRef, spec: PoolSpec) -> list[dict[str, Any]]:
    """PodDisruptionBudgets the spec asks for: one per engine Deployment (``engine.podDisruptionBudget``),
    routerd's and the picker's; named like the Deployment they protect."""
    out = []
    if spec.engine.pod_disruption_budget is not None:
        for g in spec.groups():
            out.append(_pdb(pool, engine_group_name(pool.name, g.name), "engine", engine_selector(pool.name, g.name),
                            spec.engine.pod_disruption_budget))
    if spec.routerd.pod_disruption_budget is not None:
        out.append(_pdb(pool, routerd_name(pool.name), "routerd", selector(pool.name, "routerd"),
                        spec.routerd.pod_disruption_budget))
    if spec.picker and spec.gateway.picker.pod_disruption_budget is not None:  # type: ignore[union-attr]
        out.append(_pdb(pool, picker_name(pool.name), "epp", selector(pool.name, "epp"),
                        spec.gateway.picker.pod_disruption_budget))  # type: ignore[union-attr]
    return out


def optional_children(pool: PoolRef, spec: PoolSpec | None) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of the single-named optional children the spec does not want now (a picker
    switched off, a budget removed): the reconcile deletes those that exist and are this pool's."""
    wanted: set[tuple[str, str, str]] = set()
    if spec is not None:
        wanted = {(o["apiVersion"], o["kind"], o["metadata"]["name"]) for o in _optional(pool, spec)}
    candidates = [("apps/v1", "Deployment", picker_name(pool.name)), ("v1", "Service", picker_name(pool.name)),
                  ("v1", "ConfigMap", envoy_configmap_name(pool.name)),
                  (INFERENCE_POOL_API, "InferencePool", inference_pool_name(pool.name)),
                  ("policy/v1", "PodDisruptionBudget", routerd_name(pool.name)),
                  ("policy/v1", "PodDisruptionBudget", picker_name(pool.name))]
    return [c for c in candidates if c not in wanted]


def stale_engine_budgets(pool: PoolRef, spec: PoolSpec, observed: list[Mapping[str, Any]]) -> list[str]:
    """Names of the observed engine PodDisruptionBudgets the pool owns but no longer wants (budget removed,
    or its group gone)."""
    wanted = {o["metadata"]["name"] for o in disruption_budgets(pool, spec)}
    out = []
    for pdb in observed:
        meta = pdb.get("metadata") or {}
        owned = any(r.get("controller") and r.get("uid") == pool.uid for r in meta.get("ownerReferences") or [])
        if owned and (meta.get("labels") or {}).get(LABEL_COMPONENT) == "engine" and meta.get("name") not in wanted:
            out.append(meta["name"])
    return sorted(out)


def _optional(pool: PoolRef, spec: PoolSpec, checkpoint: Checkpoint | None = None,
              settings: OperatorSettings | None = None) -> list[dict[str, Any]]:
    """The children that exist only when the spec asks: picker, its Envoy, the InferencePool (last: its CRD
    may be missing, which must not stop the rest), and the budgets."""
    settings = settings or OperatorSettings()
    out: list[dict[str, Any]] = []
    if spec.picker:
        if spec.envoy:
            out.append(envoy_configmap(pool, spec))
        out += [picker_service(pool, spec), picker_deployment(pool, spec, settings, checkpoint=checkpoint)]
    out += disruption_budgets(pool, spec)
    if spec.inference_pool:
        out.append(inference_pool(pool, spec))
    return out


def router_url(pool: PoolRef, spec: PoolSpec) -> str:
    """In-cluster base URL of the pool's OpenAI API."""
    port = spec.routerd.service.port
    suffix = "" if port == 80 else f":{port}"
    return f"http://{routerd_name(pool.name)}.{pool.namespace}.svc{suffix}"


def pool_children(pool: PoolRef, spec: PoolSpec, settings: OperatorSettings, *,
                  checkpoint: Checkpoint | None = None) -> list[dict[str, Any]]:
    """Every object the pool owns, in apply order (RBAC and config before the pods that use them; the
    InferencePool last, since its CRD may not be installed).

    Raises:
        SpecError: the profile cannot be resolved (naming the field), or standalone mode without
            routerd's Envoy builder.
    """
    return [
        *routerd_rbac(pool),
        routerd_configmap(pool, spec, checkpoint=checkpoint),
        engine_service(pool, spec),
        *group_services(pool, spec),
        *engine_deployments(pool, spec, settings),
        routerd_service(pool, spec),
        routerd_deployment(pool, spec, settings, checkpoint=checkpoint),
        *_optional(pool, spec, checkpoint, settings),
    ]


# ---------------------------------------------------------------- errors back to the pool's fields

_MAIN = r'containers(\[0\]|\[name="(vllm|emulator)"\])'
_BLAME: list[tuple[str, str, str, str]] = [
    # (kind, component, pattern in the API server's message, the pool field it comes from)
    ("Deployment", "engine", _MAIN + r"\.resources", "spec.engine.resources"),
    ("Deployment", "engine", _MAIN + r"\.env", "spec.engine.env"),
    ("Deployment", "engine", r'containers(\[0\]|\[name="vllm"\])\.image', "spec.engine.image"),
    ("Deployment", "engine", r'containers(\[0\]|\[name="emulator"\])\.image', "spec.routerd.image"),
    ("Deployment", "engine", r'containers(\[0\]|\[name="vllm"\])\.args', "spec.engine.args"),
    ("Deployment", "engine", r'containers(\[1\]|\[name="sidecar"\])\.resources', "spec.sidecar.resources"),
    ("Deployment", "engine", r'containers(\[1\]|\[name="sidecar"\])\.image', "spec.routerd.image"),
    ("Deployment", "engine", r"tolerations", "spec.engine.tolerations"),
    ("Deployment", "engine", r"affinity", "spec.engine.affinity"),
    ("Deployment", "engine", r"topologySpreadConstraints", "spec.engine.topologySpreadConstraints"),
    ("Deployment", "epp", r'containers(\[0\]|\[name="epp"\])\.resources', "spec.gateway.picker.resources"),
    ("Deployment", "epp", r'containers(\[0\]|\[name="epp"\])\.image', "spec.routerd.image"),
    ("Deployment", "epp", r'containers(\[1\]|\[name="envoy"\])\.resources', "spec.gateway.picker.envoy.resources"),
    ("Deployment", "epp", r'containers(\[1\]|\[name="envoy"\])\.image', "spec.gateway.picker.envoy.image"),
    ("Deployment", "epp", r"\.replicas", "spec.gateway.picker.replicas"),
    ("PodDisruptionBudget", "engine", r"maxUnavailable", "spec.engine.podDisruptionBudget.maxUnavailable"),
    ("PodDisruptionBudget", "routerd", r"maxUnavailable", "spec.routerd.podDisruptionBudget.maxUnavailable"),
    ("PodDisruptionBudget", "epp", r"maxUnavailable", "spec.gateway.picker.podDisruptionBudget.maxUnavailable"),
    ("InferencePool", "gateway", r"targetPorts", "spec.gateway.inferencePool.targetPortNumber"),
    ("Deployment", "engine", r"nodeSelector", "spec.engine.nodeSelector"),
    ("Deployment", "engine", r"emptyDir\.sizeLimit|\.sizeLimit", "spec.engine.sharedMemory"),
    ("Deployment", "engine", r"persistentVolumeClaim|claimName", "spec.engine.modelCacheClaim"),
    ("Deployment", "routerd", r'containers(\[0\]|\[name="routerd"\])\.resources', "spec.routerd.resources"),
    ("Deployment", "routerd", r'containers(\[0\]|\[name="routerd"\])\.image', "spec.routerd.image"),
    ("Deployment", "routerd", r"persistentVolumeClaim|claimName", "spec.predictor.persistentVolumeClaim"),
    ("Deployment", "", r"imagePullSecrets", "spec.imagePullSecrets"),
    ("Deployment", "", r"\.replicas", "spec.engine.replicas"),
    ("Service", "routerd", r"metadata\.annotations", "spec.routerd.service.annotations"),
    ("Service", "routerd", r"nodePort", "spec.routerd.service.nodePort"),
    ("Service", "routerd", r"spec\.type|loadBalancer", "spec.routerd.service.type"),
    ("Service", "routerd", r"ports", "spec.routerd.service.port"),
    ("Service", "engine", r"ports", "spec.engine.port"),
]


_GROUP_FIELDS = {"spec.engine.resources": "resources", "spec.engine.env": "env", "spec.engine.args": "args",
                 "spec.engine.tolerations": "tolerations", "spec.engine.nodeSelector": "nodeSelector",
                 "spec.engine.replicas": "replicas", "spec.engine.affinity": "affinity",
                 "spec.engine.topologySpreadConstraints": "topologySpreadConstraints"}


def blame(obj: Mapping[str, Any], message: str, spec: PoolSpec | None = None) -> str | None:
    """The pool field a refused child's API error comes from, e.g. ``spec.engine.resources`` for
    ``spec.template.spec.containers[0].resources.limits[cpu]: Invalid value`` on ``P-engine``; None if unknown.

    The API server names the child's own field; a user wrote the pool's, so the pool's
    Degraded message starts with that one (as InvalidSpec messages do). With ``spec``, a
    group Deployment's error names the group's own override where the group sets one,
    e.g. ``spec.engineGroups[1].resources``.
    """
    obj_labels = (obj.get("metadata") or {}).get("labels") or {}
    component = obj_labels.get(LABEL_COMPONENT, "")
    for kind, comp, pattern, field in _BLAME:
        if obj.get("kind") == kind and comp in ("", component) and re.search(pattern, message):
            if field == "spec.engine.replicas" and component == "routerd":
                field = "spec.routerd.replicas"
            group = obj_labels.get(LABEL_ENGINE_GROUP)
            own = _GROUP_FIELDS.get(field)
            if group and spec is not None and own:
                for i, g in enumerate(spec.engine_groups or []):
                    if g.name == group and g.model_dump(by_alias=True).get(own) is not None:
                        return f"spec.engineGroups[{i}].{own}"
            return field
    return None
