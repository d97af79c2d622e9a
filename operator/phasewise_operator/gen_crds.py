"""The CustomResourceDefinitions of ``phasewise.io/v1alpha1``, generated from routerd's registries.

The enums of policy names, shipped profile names, predictor names and DQN reward
variants come from routerd itself, so the API server rejects a name that routerd would
reject. Write the YAML files (``crds/`` and the Helm chart's copy)::

    PYTHONPATH=routerd:operator python -m phasewise_operator.gen_crds          # write
    PYTHONPATH=routerd:operator python -m phasewise_operator.gen_crds --check  # exit 1 if stale

Cross-field rules are CEL (``x-kubernetes-validations``); each names its field with
``fieldPath`` so ``kubectl apply`` says which field is wrong.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

GROUP = "phasewise.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

#: Pool names are used in child names (``<pool>-routerd``: a Service name, a DNS-1035 label
#: of at most 63 characters), so a pool name has room for the longest suffix.
POOL_NAME_MAX = 55
#: Job names become batch Job names and the ``batch.kubernetes.io/job-name`` label (63).
JOB_NAME_MAX = 52

#: Engine group names are label values (``phasewise.io/engine-group``, at most 63) and end the
#: Deployment name ``<pool>-engine-<group>`` (at most 55 + 8 + 20 = 83 characters, well within
#: the 253 of an object name); 20 also keeps the pods' generated names (cut at 58 characters
#: by the API server before the random suffix) telling their group apart for most pool names.
GROUP_NAME_MAX = 20
GROUP_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
#: Words a group name may not contain as a dash-separated part: with them ``<pool>-engine-<group>``
#: could equal another pool's ``<q>-engine``, ``<q>-routerd``, ``<q>-epp`` or ``<q>-engine-<h>``
#: (e.g. pool ``a``, group ``b-routerd`` and pool ``a-engine-b``'s routerd; group ``epp`` and pool
#: ``a-engine``'s picker), and server-side apply would take it over.
RESERVED_GROUP_WORDS = ("engine", "routerd", "epp")
GROUP_NAME_RESERVED = r"(^|-)(engine|routerd|epp)(-|$)"
#: Most engine groups in one pool (bounds the CEL rules' cost and the status object).
MAX_ENGINE_GROUPS = 16

DEFAULT_POLICY = "late_binding"
"""The default routing policy of a pool whose engines of one model share one hardware profile:
the best mean E2E without a tail penalty in docs/results.md."""
MIXED_POOL_POLICY = "predicted_latency"
"""The default routing policy of a mixed-GPU pool (one model served by engine groups of
different hardware profiles): 5.9-26.1% lower mean E2E than the best profile-blind heuristic in
each of 18 cells (2 mixed pools x 3 workloads x 0.8x/1.5x/2x round robin's capacity, held-out
seeds; ``benchmarks/mixed_pools.py``, docs/rl.md), which reads one profile for all."""
DEFAULT_PROFILE = "llama2-7b-v100"
"""The default hardware profile, as ``phasewise bench``."""
DEFAULT_PREDICTOR = "default"
"""The default length predictor: routerd's shipped n-gram model (numpy only, inside the
routerd image), ``routerd.predictor.assign.DEFAULT_PREDICTOR``."""
NO_PREDICTOR = "none"
"""The predictor name that turns prediction off (routerd's ``predictor: none``)."""

PREFIX_MODES = ("off", "approximate", "precise")
"""routerd's ``prefix.mode`` values. The default mode is routerd's own (its settings model), not
the CRD's: ``spec.routing.prefix`` has no defaults, so an unset field means routerd's value."""
DEFAULT_KV_EVENTS_PORT = 5557
"""vLLM's KV-event publisher port (``KVEventsConfig.endpoint`` ``tcp://*:5557``): the engines'
and routerd's port in precise mode unless ``spec.routing.prefix.kvEvents.port`` says otherwise."""
DEFAULT_KV_EVENTS_TOPIC = ""
"""vLLM's KV-event topic (``KVEventsConfig.topic``)."""
GATEWAY_APP_PROTOCOLS = ("http", "kubernetes.io/h2c")
"""``InferencePool.spec.appProtocol`` values (GIE ``api/v1/inferencepool_types.go``, v1.6.0)."""
FAILURE_MODES = ("FailOpen", "FailClose")
"""``InferencePool.spec.endpointPickerRef.failureMode`` values (GIE ``api/v1/inferencepool_types.go``)."""
DEFAULT_FAILURE_MODE = "FailClose"
"""GIE's default failure mode: a picker that does not answer fails the request instead of routing blind."""
PICKER_MODES = ("full-duplex", "efficient")
"""``phasewise epp`` modes (routerd's ``epp.mode``): ``full-duplex`` is what gateways configure
(both bodies FULL_DUPLEX_STREAMED); ``efficient`` needs Phasewise's own Envoy configuration."""
DEFAULT_PICKER_MODE = "full-duplex"
EPP_GRPC_PORT = 9002
"""ext_proc gRPC port of the picker (the ecosystem's default, gateway-epp.md section 1)."""
EPP_HEALTH_PORT = 9003
"""gRPC health port of the picker (services ``liveness``, ``readiness`` and the ext_proc service)."""
EPP_METRICS_PORT = 9090
"""Prometheus port of the picker."""
EPP_PORTS = (EPP_GRPC_PORT, EPP_HEALTH_PORT, EPP_METRICS_PORT)
DEFAULT_ENVOY_PORT = 8081
"""Port of the standalone Envoy's client listener (container and picker Service port ``http``)."""
ENVOY_ADMIN_PORT = 9901
"""Envoy's admin listener (127.0.0.1, routerd's ``build_envoy_config`` default) in the picker's pod."""
ENVOY_FORBIDDEN_PORTS = (*EPP_PORTS, ENVOY_ADMIN_PORT)
"""Ports ``spec.gateway.picker.envoy.port`` may not take: the picker's and Envoy's own admin port,
all bound in the same pod (a clash crash-loops the picker pod)."""
ENVOY_PORT_RULE_MESSAGE = (f"envoy.port must differ from the picker's ports {', '.join(map(str, EPP_PORTS))} "
                           f"and Envoy's admin port {ENVOY_ADMIN_PORT}")

KV_EVENTS_PORT_NAME = "kv-events"
"""Name of the engines' container and Service port of the KV events (routerd's
``kubernetes.kv_events_port_name``), so EndpointSlices carry it."""

_QUANTITY = {
    # Kubernetes' Quantity pattern without the minus sign: no resource or size here may be negative
    # (a negative integer gets past it; the Deployment then is refused, naming the pool field).
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "pattern": r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$",
    "x-kubernetes-int-or-string": True,
}
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# The KV-events port as CEL sees it at spec level (vLLM's default when unset).
_KV_PORT = ("(has(self.routing.prefix.kvEvents) && has(self.routing.prefix.kvEvents.port) ? "
            f"self.routing.prefix.kvEvents.port : {DEFAULT_KV_EVENTS_PORT})")
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


# ---------------------------------------------------------------- registries from routerd

def policy_names() -> list[str]:
    """Policies a live router can run: every registered one except the oracles.

    Oracle policies read true output lengths, which only the simulator has.
    """
    from routerd.policies.registry import POLICIES

    return [name for name, cls in POLICIES.items() if not cls.oracle]


def profile_names() -> list[str]:
    """Shipped hardware profiles (``routerd/data/profiles/*.yaml``)."""
    from routerd.profiles import profile_names as names

    return names()


def predictor_baselines() -> list[str]:
    """Predictor baselines routerd fits at start (``routerd.predictor.BASELINE_NAMES``)."""
    from routerd.predictor.assign import BASELINE_NAMES

    return list(BASELINE_NAMES)


def predictor_names() -> list[str]:
    """Names ``spec.predictor.name`` accepts: :data:`DEFAULT_PREDICTOR`, :data:`NO_PREDICTOR`
    and the baselines, in that order."""
    return [DEFAULT_PREDICTOR, NO_PREDICTOR, *predictor_baselines()]


def reward_variants() -> list[str]:
    """DQN reward variants of ``phasewise train --variant``."""
    from routerd.rl.reward import REWARD_VARIANTS

    return list(REWARD_VARIANTS)


# ---------------------------------------------------------------- schema helpers

def _s(desc: str, **kw: Any) -> dict[str, Any]:
    return {"type": "string", "description": desc, **kw}


def _i(desc: str, **kw: Any) -> dict[str, Any]:
    return {"type": "integer", "description": desc, **kw}


def _n(desc: str, **kw: Any) -> dict[str, Any]:
    return {"type": "number", "description": desc, **kw}


def _b(desc: str, **kw: Any) -> dict[str, Any]:
    return {"type": "boolean", "description": desc, **kw}


def _o(desc: str, props: dict[str, Any], required: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "description": desc, "properties": props}
    if required:
        out["required"] = required
    out.update(kw)
    return out


def _rule(rule: str, message: str, field_path: str | None = None, reason: str | None = None) -> dict[str, str]:
    out = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    if reason:
        out["reason"] = reason
    return out


def _name_schema(max_len: int, why: str) -> dict[str, Any]:
    """``metadata`` at the root: the one place a CRD may restrict (the name), here to a DNS-1035 label."""
    return {"type": "object", "properties": {"name": {
        "type": "string", "maxLength": max_len, "pattern": "^[a-z]([-a-z0-9]*[a-z0-9])?$",
        "description": f"A DNS-1035 label of at most {max_len} characters ({why})."}}}


def _resources(desc: str) -> dict[str, Any]:
    quantities = {"type": "object", "additionalProperties": dict(_QUANTITY)}
    return _o(desc, {
        "limits": {**quantities, "description": "Most of each resource the container may use."},
        "requests": {**quantities, "description": "Resources reserved for the container."},
    })


def _image(desc: str) -> dict[str, Any]:
    return _s(desc, minLength=1, maxLength=512)


_PULL_POLICY = _s("Image pull policy.", enum=["Always", "IfNotPresent", "Never"])

_ENV = {
    "type": "array",
    "description": "Environment variables of the container (Kubernetes EnvVar, e.g. HF_TOKEN from a Secret).",
    "maxItems": 64,
    # A map keyed by name: the API server refuses two variables of one name (naming the
    # item), which server-side apply of the Deployment would refuse later anyway.
    "x-kubernetes-list-type": "map",
    "x-kubernetes-list-map-keys": ["name"],
    "items": _o("One variable.", {
        "name": _s("Variable name.", minLength=1, maxLength=256),
        "value": _s("Value."),
        "valueFrom": {"type": "object", "description": "Source of the value (Kubernetes EnvVarSource).",
                      "x-kubernetes-preserve-unknown-fields": True},
    }, required=["name"]),
}

_TOLERATIONS = {
    "type": "array",
    "description": "Tolerations of the pods (e.g. for tainted GPU nodes).",
    "maxItems": 32,
    "items": _o("One toleration (Kubernetes Toleration).", {
        "key": _s("Taint key."),
        "operator": _s("Exists or Equal.", enum=["Exists", "Equal"]),
        "value": _s("Taint value."),
        "effect": _s("Taint effect.", enum=["NoSchedule", "PreferNoSchedule", "NoExecute"]),
        "tolerationSeconds": _i("How long a NoExecute taint is tolerated (s).", format="int64"),
    }),
}

_NODE_SELECTOR = {"type": "object", "description": "Node labels the pods must run on.",
                  "additionalProperties": {"type": "string"}}

# Kubernetes' own types, passed through to the pod spec unchanged: the Deployment's validation
# (or the pod's) checks them, and an error there names the pool's field (builders.blame).
_AFFINITY = {"type": "object", "description": "Affinity of the pods (Kubernetes Affinity: nodeAffinity, "
             "podAffinity, podAntiAffinity), e.g. to spread instances over GPU nodes.",
             "x-kubernetes-preserve-unknown-fields": True}

_TOPOLOGY_SPREAD = {
    "type": "array",
    "description": "Topology spread constraints of the pods (Kubernetes TopologySpreadConstraint); a constraint "
                   "without labelSelector selects this Deployment's own pods.",
    "maxItems": 8,
    "items": {"type": "object", "description": "One constraint.", "required": ["maxSkew", "topologyKey",
                                                                              "whenUnsatisfiable"],
              "x-kubernetes-preserve-unknown-fields": True,
              "properties": {
                  "maxSkew": {"type": "integer", "description": "Most the pod count may differ between two "
                              "topology domains.", "minimum": 1},
                  "topologyKey": {"type": "string", "description": "Node label of the domain, e.g. "
                                  "topology.kubernetes.io/zone or kubernetes.io/hostname.", "minLength": 1},
                  "whenUnsatisfiable": {"type": "string", "description": "DoNotSchedule or ScheduleAnyway.",
                                        "enum": ["DoNotSchedule", "ScheduleAnyway"]},
              }},
}


def _condition_list(desc: str) -> dict[str, Any]:
    return {
        "type": "array",
        "description": desc,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
        "items": _o("A condition (metav1.Condition).", {
            "type": _s("Condition type.", maxLength=316),
            "status": _s("True, False or Unknown.", enum=["True", "False", "Unknown"]),
            "reason": _s("CamelCase reason.", maxLength=1024),
            "message": _s("What happened, naming the field when the spec is at fault.", maxLength=32768),
            "lastTransitionTime": _s("When the status last changed.", format="date-time"),
            "observedGeneration": _i("The .metadata.generation the condition was set for.", format="int64",
                                     minimum=0),
        }, required=["type", "status", "lastTransitionTime", "reason", "message"]),
    }


# ---------------------------------------------------------------- LLMRouterPool

def inline_profile_schema(desc: str) -> dict[str, Any]:
    """An inline hardware profile (also a profile job's result): routerd's HardwareProfile in camelCase.

    grad1, grad2, overheadS and kvCapacityTokens are required; every other term comes
    from the shipped profile ``basedOn`` unless given.
    """
    pos = {"exclusiveMinimum": True, "minimum": 0}
    return _o(desc, {
        "basedOn": _s("Shipped profile that supplies every term not given here.", enum=profile_names(),
                      default=DEFAULT_PROFILE),
        "description": _s("What hardware and model this profile describes.", maxLength=1024),
        "grad1": _n("Mixing estimator: prefill time per prompt token (s/token), paper §5.2.", **pos),
        "grad2": _n("Mixing estimator: decode-side gradient, paper §5.2.", **pos),
        "overheadS": _n("Fixed cost of every engine iteration (s).", minimum=0),
        "kvCapacityTokens": _i("KV-cache capacity of one instance (tokens), a multiple of blockSize.",
                               minimum=1, format="int64"),
        "prefillPerTokenS": _n("Cost per prefill token in a batch (s/token).", minimum=0),
        "prefillAttnS": _n("Prefill attention cost per chunk token times attended tokens (s/token^2).",
                           minimum=0),
        "decodePerSeqS": _n("Cost per decoding request in a batch (s/request).", minimum=0),
        "decodePerCtxTokenS": _n("Cost per resident context token of the decoding requests (s/token).",
                                 minimum=0),
        "blockSize": _i("KV-cache block size (tokens).", minimum=1),
        "maxNumSeqs": _i("vLLM max_num_seqs: most requests running at once.", minimum=1),
        "maxNumBatchedTokens": _i("vLLM max_num_batched_tokens: token budget of one iteration.", minimum=1),
        "chunkedPrefill": _b("Whether a prefill may be split across iterations."),
        "maxModelLen": _i("Longest prompt + output of a request (tokens).", minimum=1),
        "decodeTokenTimeS": _n("Average decode iteration time under load (s).", **pos),
        "heavyPrefillS": _n("Prefill time at or above which a prompt is heavy (s), paper §4.2.", **pos),
        "heavyDecodeS": _n("Decode time at or above which a response is heavy (s), paper §4.2.", **pos),
    }, required=["grad1", "grad2", "overheadS", "kvCapacityTokens"])


def prefix_schema() -> dict[str, Any]:
    """``spec.routing.prefix``: routerd's ``prefix`` settings in camelCase, without defaults (unset = routerd's)."""
    return _o("Prefix-cache-aware routing (routerd's prefix settings). Every field left out is routerd's "
              "default, the mode included. Mode precise makes the engines publish vLLM KV events "
              "(--kv-events-config) on the container and Service port named kv-events, which routerd "
              "follows; changing into or out of precise rolls the engine pods.", {
        "mode": _s("off: no prefix scoring; approximate: routerd hashes each prompt's text and remembers "
                   "where it sent it; precise: routerd follows the engines' KV events and matches token "
                   "blocks (falling back to approximate while an instance's events are stale or no "
                   "tokenizer is available). Quote \"off\" in YAML (unquoted it reads as false).",
                   enum=list(PREFIX_MODES)),
        "blockSize": _i("Tokens per KV block of routerd's prefix keys. Unset (recommended): routerd learns each "
                        "engine's own from its KV events and vllm:cache_config_info; vLLM's default depends on the "
                        "attention backend (16 on most GPU backends, 128 on the CPU build). A set size an engine "
                        "disagrees with is a routerd warning and metric, not a dropped engine. The operator never "
                        "passes it to vLLM: give --block-size in the engine args to pin the engines'.",
                        minimum=1),
        "chunkBlocks": _i("Blocks per hashed text chunk of the approximate index.", minimum=1),
        "maxPromptTokens": _i("Only the first this many prompt tokens are hashed.", minimum=1, format="int64"),
        "indexCapacityBlocks": _i("Most blocks the approximate index keeps per endpoint (least recently used "
                                  "evicted first): its memory bound.", minimum=1, format="int64"),
        "tokenizer": _s("Tokenizer of precise mode: bytes (the emulator's byte tokenizer) or the path of a "
                        "Hugging Face tokenizer.json inside the routerd pod. Default in an emulated pool: bytes; "
                        "otherwise routerd's.", maxLength=4096),
        "kvEvents": _o("The engines' KV-cache events (mode precise).", {
            "port": _i(f"Port each engine publishes on (tcp://*:<port>; default {DEFAULT_KV_EVENTS_PORT}, vLLM's).",
                       minimum=1, maximum=65535),
            "topic": _s("ZMQ topic of the events (default \"\", vLLM's).", maxLength=256),
            "staleAfterSeconds": _n("Seconds without events after which routerd counts an instance's index "
                                    "stale and falls back to approximate.", exclusiveMinimum=True, minimum=0),
            "maxBlocks": _i("Most blocks routerd keeps per instance from its events.", minimum=1, format="int64"),
        }),
    })


def _pdb(what: str) -> dict[str, Any]:
    return _o(f"A PodDisruptionBudget for the {what}: voluntary disruptions (node drains, cluster upgrades) "
              "evict at most maxUnavailable of them at a time (only maxUnavailable: minAvailable is not supported). "
              "Unset: no budget.", {
        "maxUnavailable": {**_QUANTITY, "pattern": r"^([0-9]+|[0-9]+%)$",
                           "description": "Pods that may be evicted at once: a number or a percentage "
                           "(e.g. 1 or 25%)."},
    }, required=["maxUnavailable"])


def gateway_schema() -> dict[str, Any]:
    """``spec.gateway``: the pool behind a Gateway API Inference Extension gateway, or behind Phasewise's own Envoy.

    Field names and enums of ``inferencePool`` follow GIE's ``api/v1/inferencepool_types.go``
    (v1.6.0), which the operator's InferencePool carries.
    """
    pool = _o("An InferencePool (inference.networking.k8s.io/v1) named like this LLMRouterPool, selecting every "
              "engine pod, with the picker's Service as its endpointPickerRef: an HTTPRoute's backendRef "
              "names it. Needs the Gateway API Inference Extension CRDs in the cluster and picker.enabled.", {
        "enabled": _b("Create the InferencePool.", default=False),
        "targetPortNumber": _i("Port of the model servers the gateway sends requests to (the InferencePool's "
                               "targetPorts[0].number; default: spec.engine.port).", minimum=1, maximum=65535),
        "appProtocol": _s("Protocol the gateway speaks to the model servers (InferencePool spec.appProtocol).",
                          enum=list(GATEWAY_APP_PROTOCOLS), default="http"),
        "failureMode": _s("What the gateway does when the picker does not answer (endpointPickerRef.failureMode): "
                          "FailClose fails the request, FailOpen routes without it. Note GIE issue 1266: "
                          "FailOpen does not take effect with full-duplex body modes on Envoy 1.35 and later.",
                          enum=list(FAILURE_MODES), default=DEFAULT_FAILURE_MODE),
    }, default={})
    envoy = _o("Standalone mode: an Envoy sidecar beside each picker, routing clients' OpenAI requests to the "
               "engine the picker chose (ORIGINAL_DST on x-gateway-destination-endpoint), without a gateway.", {
        "enabled": _b("Run the Envoy sidecar.", default=False),
        "image": _image("Envoy image (default: the operator's envoyImage setting, envoyproxy/envoy:v1.40.0)."),
        "port": _i("Envoy's client port: container port and picker Service port named http. Must differ from the "
                   f"picker's {', '.join(map(str, EPP_PORTS))} and Envoy's admin port {ENVOY_ADMIN_PORT}.",
                   minimum=1, maximum=65535, default=DEFAULT_ENVOY_PORT),
        "resources": _resources("Resources of the Envoy container."),
    }, default={}, **{"x-kubernetes-validations": [
        _rule(f"!has(self.port) || !(self.port in {list(ENVOY_FORBIDDEN_PORTS)})", ENVOY_PORT_RULE_MESSAGE,
              field_path=".port", reason="FieldValueInvalid"),
    ]})
    picker = _o("phasewise epp, the Endpoint Picker (Envoy ext_proc) with routerd's router core, as its own "
                "Deployment and Service <pool>-epp (ext_proc 9002, gRPC health 9003, metrics 9090), reading "
                "routerd's ConfigMap.", {
        "enabled": _b("Run the picker.", default=False),
        "replicas": _i("Picker replicas.", minimum=0, maximum=100, default=1),
        "mode": _s("full-duplex: both bodies FULL_DUPLEX_STREAMED, what gateways configure; efficient: no response "
                   "chunk goes through the picker (only with Phasewise's own Envoy, envoy.enabled).",
                   enum=list(PICKER_MODES), default=DEFAULT_PICKER_MODE),
        "resources": _resources("Resources of the picker container."),
        "podDisruptionBudget": _pdb("picker pods"),
        "envoy": envoy,
    }, default={}, **{"x-kubernetes-validations": [
        _rule("!has(self.envoy) || !has(self.envoy.enabled) || !self.envoy.enabled || "
              "(has(self.enabled) && self.enabled)",
              "picker.envoy.enabled needs picker.enabled (Envoy sends every request to the picker)",
              field_path=".envoy.enabled", reason="FieldValueInvalid"),
        _rule("!has(self.mode) || self.mode != 'efficient' || (has(self.envoy) && has(self.envoy.enabled) && "
              "self.envoy.enabled)",
              "picker.mode efficient needs Phasewise's own Envoy (picker.envoy.enabled); gateways run full-duplex",
              field_path=".mode", reason="FieldValueInvalid"),
    ]})
    return _o("Expose the pool to Envoy-based gateways (Gateway API Inference Extension) and/or run Phasewise's "
              "picker with its own Envoy. Unset: neither (routerd's proxy only).", {
        "inferencePool": pool,
        "picker": picker,
    }, **{"x-kubernetes-validations": [
        _rule("!has(self.inferencePool) || !has(self.inferencePool.enabled) || !self.inferencePool.enabled || "
              "(has(self.picker) && has(self.picker.enabled) && self.picker.enabled)",
              "gateway.inferencePool.enabled needs gateway.picker.enabled (the InferencePool's endpointPickerRef "
              "is the picker's Service)", field_path=".picker.enabled", reason="FieldValueRequired"),
    ]})


def pool_spec_schema() -> dict[str, Any]:
    """OpenAPI schema of ``LLMRouterPool.spec``."""
    engine = _o("The serving instances: vLLM (or the emulator when emulated) with a state sidecar each. "
                "With engineGroups: the values every group starts from.", {
        "image": _image("vLLM image (default: the operator's vllmImage setting). Ignored when emulated."),
        "imagePullPolicy": _PULL_POLICY,
        "args": {"type": "array", "maxItems": 128, "items": {"type": "string", "maxLength": 4096},
                 "description": "Extra vLLM arguments, after the model, served name and port "
                                "(e.g. --max-model-len, --tensor-parallel-size); --model, --served-model-name and "
                                "--port are refused (they come from spec fields). The operator adds "
                                "--enable-prompt-tokens-details, and with routing.prefix.mode precise "
                                "--kv-events-config, unless these args give them (a precise-mode "
                                "--kv-events-config must then publish on routerd's port and topic). "
                                "Not allowed when emulated."},
        "env": _ENV,
        "resources": _resources("Resources of the vLLM (or emulator) container, e.g. limits nvidia.com/gpu: 1."),
        "replicas": _i("Number of serving instances (the scale subresource); with engineGroups, of each group "
                       "that does not set its own.", minimum=0, maximum=10000, default=1),
        "port": _i("Container port of the OpenAI API (the Service port named http).", minimum=1, maximum=65535,
                   default=8000),
        "modelCacheClaim": _s("PersistentVolumeClaim mounted as the Hugging Face cache (HF_HOME). "
                              "Default: an emptyDir, so each pod downloads the model.",
                              maxLength=253, pattern=_DNS_SUBDOMAIN),
        "sharedMemory": {**_QUANTITY, "description": "Size of /dev/shm (memory-backed emptyDir), used by "
                         "tensor-parallel workers.", "default": "1Gi"},
        "startupSeconds": _i("How long an instance may take to load the model before it is restarted (s).",
                             minimum=10, maximum=86400, default=1800),
        "nodeSelector": _NODE_SELECTOR,
        "tolerations": _TOLERATIONS,
        "affinity": _AFFINITY,
        "topologySpreadConstraints": _TOPOLOGY_SPREAD,
        "podDisruptionBudget": _pdb("engine pods (one budget per engine Deployment)"),
    }, default={})
    sidecar = _o("The instance-state sidecar beside each engine container (phasewise sidecar).", {
        "port": _i("gRPC port of the sidecar (the Service port named state).", minimum=1, maximum=65535,
                   default=50051),
        "intervalSeconds": _n("Seconds between two scrapes of the engine's /metrics.", minimum=0.01,
                              maximum=3600, default=0.25),
        "resources": _resources("Resources of the sidecar container."),
    }, default={})
    profile = _o("Hardware profile of one instance: a shipped profile by name, or an inline profile.", {
        "name": _s("A shipped profile.", enum=profile_names()),
        "inline": inline_profile_schema("An inline profile (a profile job writes its fit here)."),
    }, default={"name": DEFAULT_PROFILE}, **{"x-kubernetes-validations": [
        _rule("has(self.name) != has(self.inline)",
              "set exactly one of hardwareProfile.name (a shipped profile) or hardwareProfile.inline",
              reason="FieldValueInvalid"),
    ]})
    routing = _o("How routerd routes.", {
        "policy": _s(f"Routing policy (phasewise policies lists them; oracles are simulator-only). Unset: "
                     f"{MIXED_POOL_POLICY} on a mixed-GPU pool (a model served by engine groups of different "
                     f"hardware profiles), {DEFAULT_POLICY} otherwise; status.activePolicy says which.",
                     enum=policy_names()),
        "params": {"type": "object", "description": "Policy parameters by name (phasewise policies lists "
                   "them); checked by the operator against the policy's own model.",
                   "maxProperties": 64,
                   "additionalProperties": {"x-kubernetes-preserve-unknown-fields": True}},
        "actionIntervalSeconds": _n("Router tick while requests are held in its queue (s).", minimum=0.0001,
                                    maximum=60, default=0.02),
        "queueLimit": _i("Most requests held in the router queue; more get HTTP 429.", minimum=1,
                         maximum=1000000, default=1024),
        "prefix": prefix_schema(),
        "checkpoint": _o("The DQN checkpoint for policy dqn: a ConfigMap with model.safetensors "
                         "(binaryData) and metadata.json, as a train job writes it. routerd reloads it "
                         "without a restart.", {
                             "configMap": _s("ConfigMap name in the pool's namespace.", minLength=1,
                                             maxLength=253, pattern=_DNS_SUBDOMAIN),
                         }, required=["configMap"]),
    }, default={}, **{"x-kubernetes-validations": [
        _rule("!has(self.policy) || self.policy != 'dqn' || has(self.checkpoint)",
              "policy dqn needs routing.checkpoint (a ConfigMap written by a train LLMRouterJob)",
              field_path=".checkpoint", reason="FieldValueRequired"),
    ]})
    predictor = _o("Response-length predictor routerd uses for the decode bucket (default: name "
                   f"{DEFAULT_PREDICTOR}, the shipped n-gram model).", {
        "name": _s(f"{DEFAULT_PREDICTOR}: the n-gram model shipped in the routerd image (numpy only); "
                   f"{NO_PREDICTOR}: no prediction; or a baseline fitted at routerd start on the shared "
                   "prompt data, which the routerd pod must then have (PHASEWISE_DATA_DIR); length-only and "
                   "length+task also need a routerd image built with EXTRAS=predictor-train.",
                   enum=predictor_names()),
        "persistentVolumeClaim": _o("A folder saved by phasewise predictor train, on a volume: a --kind ngram "
                                    "folder needs numpy only; a transformer folder needs a routerd image built "
                                    "with EXTRAS=predictor.", {
            "claimName": _s("PersistentVolumeClaim name (ReadOnlyMany for several routerd replicas).",
                            minLength=1, maxLength=253, pattern=_DNS_SUBDOMAIN),
            "path": _s("Folder inside the volume.", maxLength=1024, pattern=r"^[^/].*$|^$", default=""),
        }, required=["claimName"]),
    }, default={"name": DEFAULT_PREDICTOR}, **{"x-kubernetes-validations": [
        _rule("has(self.name) != has(self.persistentVolumeClaim)",
              "set exactly one of predictor.name or predictor.persistentVolumeClaim", reason="FieldValueInvalid"),
    ]})
    routerd = _o("The routerd deployment in front of the instances.", {
        "replicas": _i("routerd replicas.", minimum=0, maximum=100, default=1),
        "image": _image("routerd image (default: the operator's routerdImage setting)."),
        "imagePullPolicy": _PULL_POLICY,
        "resources": _resources("Resources of the routerd container."),
        "logLevel": _s("routerd log level.", enum=["debug", "info", "warning", "error"], default="info"),
        "podDisruptionBudget": _pdb("routerd pods"),
        "service": _o("The Service clients call (OpenAI API).", {
            "type": _s("Service type.", enum=["ClusterIP", "NodePort", "LoadBalancer"], default="ClusterIP"),
            "port": _i("Service port of the OpenAI API.", minimum=1, maximum=65535, default=80),
            "nodePort": _i("Node port when type is NodePort or LoadBalancer.", minimum=30000, maximum=32767),
            "annotations": {"type": "object", "description": "Annotations of the Service (e.g. for a cloud "
                            "load balancer).", "additionalProperties": {"type": "string"}},
        }, default={}, **{"x-kubernetes-validations": [
            _rule("!has(self.nodePort) || self.type != 'ClusterIP'", "nodePort needs type NodePort or "
                  "LoadBalancer", field_path=".nodePort", reason="FieldValueForbidden"),
        ]}),
    }, default={})
    gpu_free = ("!has(self.engine) || !has(self.engine.resources) || "
                "((!has(self.engine.resources.limits) || !('nvidia.com/gpu' in self.engine.resources.limits)) && "
                "(!has(self.engine.resources.requests) || !('nvidia.com/gpu' in self.engine.resources.requests)))")
    groups_gpu_free = ("!has(self.engineGroups) || self.engineGroups.all(g, !has(g.resources) || "
                       "((!has(g.resources.limits) || !('nvidia.com/gpu' in g.resources.limits)) && "
                       "(!has(g.resources.requests) || !('nvidia.com/gpu' in g.resources.requests))))")

    def model(desc: str) -> dict[str, Any]:
        return _o(desc, {
            "name": _s("Model to load (Hugging Face id or path; vLLM --model).", minLength=1, maxLength=1024),
            "servedModelName": _s("Name clients send as \"model\" (default: name).", minLength=1, maxLength=1024),
        }, required=["name"])

    engine_props = engine["properties"]
    group = _o("One model with its own engine Deployment <pool>-engine-<name>. Every field left out is the "
               "pool's spec.engine value; one that is set replaces it (lists and maps are not merged).", {
        "name": _s(f"Group name: a DNS-1123 label of at most {GROUP_NAME_MAX} characters, unique in the pool, "
                   "without the words engine, routerd or epp (so <pool>-engine-<name> is no other pool's child). "
                   "Labels the group's pods phasewise.io/engine-group.",
                   minLength=1, maxLength=GROUP_NAME_MAX, pattern=GROUP_NAME_PATTERN,
                   **{"x-kubernetes-validations": [
                       _rule(f"!self.matches('{GROUP_NAME_RESERVED}')",
                             "a group name must not contain the word engine, routerd or epp",
                             reason="FieldValueInvalid"),
                   ]}),
        "model": model("The model this group's instances serve."),
        "replicas": _i("Number of this group's instances (default: spec.engine.replicas).", minimum=0,
                       maximum=10000),
        "args": {**engine_props["args"], "description": "Extra vLLM arguments of this group (default: "
                 "spec.engine.args). Not allowed when emulated."},
        "env": {**_ENV, "description": "Environment variables of this group's engine container (default: "
                "spec.engine.env)."},
        "resources": _resources("Resources of this group's vLLM (or emulator) container (default: "
                                "spec.engine.resources)."),
        "nodeSelector": {**_NODE_SELECTOR, "description": "Node labels this group's pods must run on (default: "
                         "spec.engine.nodeSelector), e.g. another GPU node pool for the same model."},
        "tolerations": {**_TOLERATIONS, "description": "Tolerations of this group's pods (default: "
                        "spec.engine.tolerations)."},
        "affinity": {**_AFFINITY, "description": "Affinity of this group's pods (default: spec.engine.affinity)."},
        "topologySpreadConstraints": {**_TOPOLOGY_SPREAD, "description": "Topology spread constraints of this "
                                      "group's pods (default: spec.engine.topologySpreadConstraints)."},
        "hardwareProfile": {**{k: copy.deepcopy(v) for k, v in profile.items() if k != "default"},
                            "description": "This group's hardware profile (its GPU type), of the pool profile's "
                            "model and block size (default: spec.hardwareProfile). routerd learns each instance's "
                            "profile from its group's Service <pool>-engine-<name> (a mixed-GPU pool), and an "
                            "emulated group runs at its profile's speed."},
    }, required=["name", "model"])
    return _o("Desired state of the pool. Set exactly one of model (one model) and engineGroups (several).", {
        "model": model("The model every instance serves (a single-model pool; exclusive with engineGroups)."),
        "engineGroups": {"type": "array", "minItems": 1, "maxItems": MAX_ENGINE_GROUPS,
                         "description": "Several models in one pool (exclusive with model): each group is one "
                         "engine Deployment behind the one engine Service; routerd serves the union of their "
                         "served names and routes each request to the instances of its model.",
                         "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
                         "items": group},
        "engine": engine,
        "sidecar": sidecar,
        "hardwareProfile": profile,
        "routing": routing,
        "predictor": predictor,
        "routerd": routerd,
        "emulated": _b("Run phasewise emulate (timing from the hardware profile) instead of vLLM, on "
                       "clusters without GPUs.", default=False),
        "imagePullSecrets": {"type": "array", "maxItems": 16, "description": "Secrets for pulling the images.",
                             "items": _o("A Secret reference.", {"name": _s("Secret name.", maxLength=253)},
                                         required=["name"])},
        "gateway": gateway_schema(),
    }, **{"x-kubernetes-validations": [
        _rule("has(self.model) != has(self.engineGroups)",
              "set exactly one of spec.model (one model) or spec.engineGroups (several)",
              reason="FieldValueInvalid"),
        _rule(f"!self.emulated || {gpu_free}",
              "an emulated pool must not request nvidia.com/gpu (spec.engine.resources)",
              field_path=".engine.resources", reason="FieldValueForbidden"),
        _rule(f"!self.emulated || {groups_gpu_free}",
              "an emulated pool must not request nvidia.com/gpu (spec.engineGroups[*].resources)",
              field_path=".engineGroups", reason="FieldValueForbidden"),
        _rule("!self.emulated || !has(self.engine) || !has(self.engine.args) || size(self.engine.args) == 0",
              "engine.args are vLLM arguments; an emulated pool must not set them",
              field_path=".engine.args", reason="FieldValueForbidden"),
        _rule("!self.emulated || !has(self.engineGroups) || "
              "self.engineGroups.all(g, !has(g.args) || size(g.args) == 0)",
              "engineGroups[*].args are vLLM arguments; an emulated pool must not set them",
              field_path=".engineGroups", reason="FieldValueForbidden"),
        _rule("!has(self.engine) || !has(self.sidecar) || !has(self.engine.port) || !has(self.sidecar.port) || "
              "self.engine.port != self.sidecar.port",
              "engine.port and sidecar.port must differ", field_path=".sidecar.port", reason="FieldValueInvalid"),
        _rule("!has(self.gateway) || !has(self.gateway.inferencePool) || "
              "!has(self.gateway.inferencePool.targetPortNumber) || !has(self.sidecar) || !has(self.sidecar.port) || "
              "self.gateway.inferencePool.targetPortNumber != self.sidecar.port",
              "gateway.inferencePool.targetPortNumber is the state sidecar's gRPC port (sidecar.port), not an OpenAI "
              "endpoint", field_path=".gateway.inferencePool.targetPortNumber", reason="FieldValueInvalid"),
        _rule("!has(self.routing) || !has(self.routing.prefix) || !has(self.routing.prefix.mode) || "
              "self.routing.prefix.mode != 'precise' || "
              f"((!has(self.engine) || !has(self.engine.port) || {_KV_PORT} != self.engine.port) && "
              f"(!has(self.sidecar) || !has(self.sidecar.port) || {_KV_PORT} != self.sidecar.port))",
              "with routing.prefix.mode precise, the KV-events port (routing.prefix.kvEvents.port, default "
              f"{DEFAULT_KV_EVENTS_PORT}) must differ from engine.port and sidecar.port",
              field_path=".routing.prefix.kvEvents.port", reason="FieldValueInvalid"),
    ]})


def pool_status_schema() -> dict[str, Any]:
    """OpenAPI schema of ``LLMRouterPool.status`` (written by the operator only)."""
    return _o("Observed state of the pool.", {
        "observedGeneration": _i("The .metadata.generation the status describes.", format="int64"),
        "conditions": _condition_list("Ready, Progressing and Degraded; with spec.gateway.inferencePool also "
                                      "InferencePoolReady and GatewayAccepted."),
        "replicas": _i("Engine pods that exist, of all groups (the scale subresource's status replicas)."),
        "readyInstances": _i("Engine pods that are ready, of all groups (from the engine Deployments)."),
        "selector": _s("Label selector of the engine pods (the scale subresource's selector)."),
        "endpoints": {"type": "array", "maxItems": 512, "description": "Engine endpoints routerd sees (from "
                      "the engine Service's EndpointSlices; at most 512 listed).",
                      "items": _o("One instance.", {
                          "name": _s("Pod name."),
                          "url": _s("OpenAI-compatible base URL."),
                          "stateAddress": _s("host:port of the state sidecar."),
                          "ready": _b("Whether it receives new requests."),
                      })},
        "engineGroups": {"type": "array", "maxItems": MAX_ENGINE_GROUPS, "description": "Per engine group "
                         "(pools with spec.engineGroups only; replicas and readyInstances above are their sums).",
                         "items": _o("One group.", {
                             "name": _s("Group name (spec.engineGroups[].name)."),
                             "model": _s("Served model name of the group."),
                             "deployment": _s("Name of the group's engine Deployment."),
                             "desiredReplicas": _i("Instances the group's Deployment asks for."),
                             "replicas": _i("The group's engine pods that exist."),
                             "readyInstances": _i("The group's engine pods that are ready."),
                         })},
        "routerURL": _s("In-cluster URL of the routerd Service (OpenAI API)."),
        "activePolicy": _s("Routing policy routerd was configured with."),
        "servedModels": _s("The model names clients may send, ',' separated (each group's served name, in "
                           "spec order: what kubectl get's MODEL column shows, engine groups or not)."),
        "activeProfile": _s("Hardware profile routerd was configured with: a shipped name, or "
                            "inline(<basedOn>)."),
        "activeCheckpoint": _s("ConfigMap of the DQN checkpoint mounted for routerd; only policy dqn reads it (empty: none mounted)."),
        "configHash": _s("SHA-256 (first 16 hex digits) of the rendered routerd ConfigMap."),
    })


def _crd(kind: str, plural: str, short_names: list[str], subresources: dict[str, Any],
         printer_columns: list[dict[str, Any]], description: str, metadata: dict[str, Any],
         spec: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    """One namespaced CRD of the group, served and stored at :data:`VERSION`."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}",
                     "labels": {"app.kubernetes.io/name": "phasewise", "app.kubernetes.io/part-of": "phasewise"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": kind, "listKind": f"{kind}List", "plural": plural,
                      "singular": plural[:-1], "shortNames": short_names, "categories": ["phasewise"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": subresources,
                "additionalPrinterColumns": printer_columns,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": description,
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": metadata,
                        "spec": spec,
                        "status": status,
                    },
                    "required": ["spec"],
                }},
            }],
        },
    }


def pool_crd() -> dict[str, Any]:
    """The ``llmrouterpools.phasewise.io`` CRD."""
    return _crd(
        "LLMRouterPool", "llmrouterpools", ["lrp", "llmpool"],
        {"status": {}, "scale": {"specReplicasPath": ".spec.engine.replicas",
                                 "statusReplicasPath": ".status.replicas",
                                 "labelSelectorPath": ".status.selector"}},
        [
            {"name": "Model", "type": "string", "jsonPath": ".status.servedModels"},
            {"name": "Policy", "type": "string", "jsonPath": ".status.activePolicy"},
            {"name": "Profile", "type": "string", "jsonPath": ".status.activeProfile"},
            {"name": "Replicas", "type": "integer", "jsonPath": ".spec.engine.replicas"},
            {"name": "Ready", "type": "integer", "jsonPath": ".status.readyInstances"},
            {"name": "Status", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"Ready\")].status"},
            {"name": "Reason", "type": "string", "priority": 1,
             "jsonPath": ".status.conditions[?(@.type==\"Ready\")].reason"},
            {"name": "Emulated", "type": "boolean", "priority": 1, "jsonPath": ".spec.emulated"},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
        "A pool of vLLM instances (or emulators) with routerd in front of them.",
        _name_schema(POOL_NAME_MAX, "its Services are named <pool>-routerd and <pool>-engine"),
        pool_spec_schema(), pool_status_schema())


def job_spec_schema() -> dict[str, Any]:
    """OpenAPI schema of ``LLMRouterJob.spec`` (immutable once created)."""
    return _o("What the job does. Immutable: create a new job to run again.", {
        "poolRef": _o("The pool this job profiles or trains for (same namespace).", {
            "name": _s("LLMRouterPool name.", minLength=1, maxLength=253, pattern=_DNS_SUBDOMAIN),
        }, required=["name"]),
        "task": _s("profile: fit the pool's hardware profile against one of its instances; "
                   "train: train a DQN router for the pool.", enum=["profile", "train"]),
        "apply": _b("Write the result into the pool (profile: spec.hardwareProfile.inline; "
                    "train: spec.routing.checkpoint).", default=True),
        "image": _image("Image of the work container (default: the operator's routerdImage setting for "
                        "profile, trainerImage for train)."),
        "imagePullPolicy": _PULL_POLICY,
        "resources": _resources("Resources of the work container."),
        "backoffLimit": _i("Retries of the batch Job.", minimum=0, maximum=10, default=0),
        "activeDeadlineSeconds": _i("Time limit of the batch Job (s).", minimum=1, maximum=604800,
                                    default=7200, format="int64"),
        "profile": _o("Parameters of task profile (phasewise profile).", {
            "instance": _s("Engine pod to profile (default: the first ready one).", maxLength=253),
            "args": {"type": "array", "maxItems": 64, "items": {"type": "string", "maxLength": 1024},
                     "description": "Extra arguments of phasewise profile."},
        }),
        "train": _o("Parameters of task train (phasewise train).", {
            "variant": _s("Reward variant.", enum=reward_variants(), default="workload-guided"),
            "workload": _s("Training workload (a generator name, or a trace path in the image).",
                           minLength=1, maxLength=1024, default="public-mix"),
            "episodes": _i("Training episodes.", minimum=1, maximum=100000, default=30),
            "requestsPerEpisode": _i("Requests per episode.", minimum=1, maximum=10000000, default=1000),
            "rate": _n("Episode arrival rate (req/s); 0 keeps a trace's rate.", minimum=0),
            "prediction": _s("Prediction mode of the simulator (true, noisy[:ACC], given, none).",
                             maxLength=64, default="true"),
            "seed": _i("Random seed.", minimum=0, default=0, format="int64"),
            "args": {"type": "array", "maxItems": 64, "items": {"type": "string", "maxLength": 1024},
                     "description": "Extra arguments of phasewise train."},
        }),
    }, required=["poolRef", "task"], **{"x-kubernetes-validations": [
        _rule("self == oldSelf", "spec is immutable; create a new LLMRouterJob", reason="FieldValueForbidden"),
        _rule("self.task == 'profile' || !has(self.profile)", "profile parameters need task profile",
              field_path=".profile", reason="FieldValueForbidden"),
        _rule("self.task == 'train' || !has(self.train)", "train parameters need task train",
              field_path=".train", reason="FieldValueForbidden"),
    ]})


def job_status_schema() -> dict[str, Any]:
    """OpenAPI schema of ``LLMRouterJob.status``."""
    return _o("Observed state of the job.", {
        "observedGeneration": _i("The .metadata.generation the status describes.", format="int64"),
        "phase": _s("Pending (waiting for the pool or an instance), Running, Succeeded or Failed.",
                    enum=["Pending", "Running", "Succeeded", "Failed"]),
        "jobName": _s("Name of the batch Job."),
        "target": _s("What the job ran against (profile: the instance's URL)."),
        "startTime": _s("When the batch Job started.", format="date-time"),
        "completionTime": _s("When the batch Job finished (succeeded or failed).", format="date-time"),
        "message": _s("Why the job is pending or failed, naming the field or object at fault."),
        "conditions": _condition_list("Complete and Failed."),
        "results": _o("What the job produced.", {
            "configMap": _s("ConfigMap the job's reporter wrote its raw output to."),
            "profile": inline_profile_schema("The fitted hardware profile (task profile)."),
            "fit": {"type": "object", "description": "Fit figures the profiler reported (e.g. residuals).",
                    "x-kubernetes-preserve-unknown-fields": True},
            "checkpoint": _o("The trained checkpoint (task train).", {
                "configMap": _s("ConfigMap with model.safetensors and metadata.json, owned by the pool."),
                "evaluation": {"type": "object", "description": "Held-out figures against round robin from "
                               "the checkpoint's metadata.json.", "x-kubernetes-preserve-unknown-fields": True},
            }),
            "appliedToPool": _b("Whether the result was written into the pool's spec."),
        }),
    })


def job_crd() -> dict[str, Any]:
    """The ``llmrouterjobs.phasewise.io`` CRD."""
    return _crd(
        "LLMRouterJob", "llmrouterjobs", ["lrj", "llmjob"], {"status": {}},
        [
            {"name": "Pool", "type": "string", "jsonPath": ".spec.poolRef.name"},
            {"name": "Task", "type": "string", "jsonPath": ".spec.task"},
            {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
            {"name": "Applied", "type": "boolean", "jsonPath": ".status.results.appliedToPool"},
            {"name": "Message", "type": "string", "priority": 1, "jsonPath": ".status.message"},
            {"name": "Completed", "type": "date", "jsonPath": ".status.completionTime"},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
        "A one-off task for a pool: fit its hardware profile, or train its DQN router.",
        _name_schema(JOB_NAME_MAX, "it names a batch Job and <job>-result"),
        job_spec_schema(), job_status_schema())


# ---------------------------------------------------------------- files

CRDS = {"llmrouterpools.yaml": pool_crd, "llmrouterjobs.yaml": job_crd}

_HEADER = ("# Generated by operator/phasewise_operator/gen_crds.py from routerd's registries; do not edit.\n"
           "# Regenerate: PYTHONPATH=routerd:operator python -m phasewise_operator.gen_crds\n")


def render(crd: dict[str, Any]) -> str:
    """One CRD as YAML, with the generated-file header."""
    return _HEADER + yaml.safe_dump(crd, sort_keys=False, width=120, allow_unicode=True)


def render_chart_template(crd: dict[str, Any]) -> str:
    """One CRD as a Helm template: installed and upgraded with the release while crds.install is true.

    ``helm.sh/resource-policy: keep`` leaves the CRD (and so every pool) in place on
    ``helm uninstall``.
    """
    body = yaml.safe_dump(crd, sort_keys=False, width=120, allow_unicode=True)
    body = body.replace("  labels:\n", "  annotations:\n    helm.sh/resource-policy: keep\n  labels:\n", 1)
    return ("{{- /* Generated by operator/phasewise_operator/gen_crds.py from routerd's registries; "
            "do not edit. */}}\n{{- if .Values.crds.install }}\n" + body + "{{- end }}\n")


def targets(root: Path) -> dict[Path, str]:
    """Every generated file under the repository ``root`` with its content."""
    out: dict[Path, str] = {}
    for fname, build in CRDS.items():
        crd = build()
        out[root / "crds" / fname] = render(crd)
        out[root / "charts" / "phasewise" / "templates" / "crds" / fname] = render_chart_template(crd)
    return out


def main(argv: list[str] | None = None) -> int:
    """Write the CRD files, or with ``--check`` report stale ones (exit 1)."""
    parser = argparse.ArgumentParser(prog="gen_crds", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated file is missing or stale")
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[2]), help="repository root")
    args = parser.parse_args(argv)
    stale = []
    for path, text in targets(Path(args.root)).items():
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        if args.check:
            stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    if stale:
        print("stale generated CRDs (run python -m phasewise_operator.gen_crds): " + ", ".join(stale),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
