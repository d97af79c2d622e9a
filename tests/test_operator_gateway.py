"""spec.gateway (issue 16): the InferencePool, the picker Deployment and Service, standalone Envoy, budgets,
engine pod placement, and the gateway status conditions: pure builders and status functions."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "operator"))
sys.path.insert(0, str(REPO / "tests"))

from phasewise_operator import builders as B  # noqa: E402
from phasewise_operator import status as S  # noqa: E402
from phasewise_operator.settings import DEFAULT_ENVOY_IMAGE, OperatorSettings  # noqa: E402
from phasewise_operator.spec import SpecError, check_pool, parse_pool_spec  # noqa: E402

POOL = B.PoolRef(name="chat", namespace="llm", uid="0b5e3c1a-0000-4000-8000-000000000001", generation=3)
OPS = OperatorSettings(routerd_image="example/routerd:1", vllm_image="example/vllm:2")

BASE = {
    "model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "servedModelName": "llama-3.1-8b"},
    "engine": {"replicas": 2, "port": 8001, "resources": {"limits": {"nvidia.com/gpu": 1}}},
    "hardwareProfile": {"name": "llama3.1-8b-h100"},
}
GATEWAY = {"inferencePool": {"enabled": True}, "picker": {"enabled": True}}
GROUPS = {
    "engineGroups": [{"name": "chat", "model": {"name": "m-chat"}}, {"name": "code", "model": {"name": "m-code"}}],
    "emulated": True,
}


def _children(spec: dict) -> dict[tuple[str, str], dict]:
    ps = parse_pool_spec(spec)
    check_pool(ps)
    return {(o["kind"], o["metadata"]["name"]): o for o in B.pool_children(POOL, ps, OPS)}


def _container(dep: dict, name: str) -> dict:
    return next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == name)


class FakeEnvoyBuilder:
    """Stands in for routerd.epp.envoy_config.build_envoy_config (being written elsewhere): records its calls."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, **kw):
        self.calls.append(kw)
        return {"static_resources": {"listeners": [{"name": "http", "port": kw["listen_port"]}],
                                     "clusters": [{"name": "epp", "address": kw["picker_address"]}]},
                "mode": kw["mode"]}


@pytest.fixture
def envoy_builder(monkeypatch):
    fake = FakeEnvoyBuilder()
    monkeypatch.setattr(B, "_envoy_config_builder", lambda: fake)
    return fake


# ---------------------------------------------------------------- unchanged without the section

@pytest.mark.parametrize("spec", [BASE, GROUPS], ids=["single", "groups"])
def test_a_disabled_gateway_renders_exactly_what_no_gateway_does(spec):
    """What the API server stores for `gateway: {}` (its defaults) changes no child: no pod rolls."""
    absent = _children(spec)
    stored = {**spec, "gateway": {"inferencePool": {"enabled": False, "appProtocol": "http",
                                                    "failureMode": "FailClose"},
                                  "picker": {"enabled": False, "replicas": 1, "mode": "full-duplex",
                                             "envoy": {"enabled": False, "port": 8081}}}}
    assert _children(stored) == absent
    assert not any(k[0] in ("InferencePool", "PodDisruptionBudget") for k in absent)
    assert "epp" not in yaml.safe_load(absent[("ConfigMap", "chat-routerd")]["data"]["routerd.yaml"])


# ---------------------------------------------------------------- InferencePool

def test_inference_pool_selects_every_engine_pod_and_names_the_picker():
    kids = _children({**GROUPS, "gateway": GATEWAY})
    ip = kids[("InferencePool", "chat")]
    assert ip["apiVersion"] == "inference.networking.k8s.io/v1"
    assert ip["metadata"]["namespace"] == "llm"
    assert ip["metadata"]["ownerReferences"] == [B.owner_reference(POOL)]
    assert ip["metadata"]["ownerReferences"][0]["controller"] is True
    assert ip["metadata"]["labels"][B.LABEL_POOL] == "chat"
    assert ip["spec"] == {
        "selector": {"matchLabels": {"phasewise.io/pool": "chat", "app.kubernetes.io/component": "engine"}},
        "targetPorts": [{"number": 8000}],
        "appProtocol": "http",
        "endpointPickerRef": {"group": "", "kind": "Service", "name": "chat-epp", "port": {"number": 9002},
                              "failureMode": "FailClose"},
    }
    # Every group's pods carry the selector's labels (and the engine Service selects the same set).
    sel = ip["spec"]["selector"]["matchLabels"]
    for group in ("chat", "code"):
        pod_labels = kids[("Deployment", f"chat-engine-{group}")]["spec"]["template"]["metadata"]["labels"]
        assert sel.items() <= pod_labels.items(), group
    assert kids[("Service", "chat-engine")]["spec"]["selector"] == sel
    # The picker ref names a Service that exists, on its ext_proc port.
    svc = kids[("Service", "chat-epp")]
    assert {"name": "grpc-ext-proc", "port": 9002} .items() <= svc["spec"]["ports"][0].items()
    # The InferencePool goes last: its CRD may be missing, and everything before it must still be applied.
    assert list(kids)[-1] == ("InferencePool", "chat")


def test_inference_pool_port_protocol_and_failure_mode():
    ip = _children({**BASE, "gateway": {**GATEWAY, "inferencePool": {"enabled": True}}})[("InferencePool", "chat")]
    assert ip["spec"]["targetPorts"] == [{"number": 8001}]  # spec.engine.port
    spec = {**BASE, "gateway": {"picker": {"enabled": True}, "inferencePool": {
        "enabled": True, "targetPortNumber": 8100, "appProtocol": "kubernetes.io/h2c", "failureMode": "FailOpen"}}}
    ip = _children(spec)[("InferencePool", "chat")]
    assert ip["spec"]["targetPorts"] == [{"number": 8100}]
    assert ip["spec"]["appProtocol"] == "kubernetes.io/h2c"
    assert ip["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"


def test_inference_pool_spec_validates_against_the_gie_crd_schema():
    """The object against GIE's own v1 schema, where build.sh has copied it (tests/k8s applies it for real)."""
    jsonschema = pytest.importorskip("jsonschema")
    sys.path.insert(0, str(REPO / "tests"))
    from k8s.harness import inferencepool_crd

    path = inferencepool_crd()
    if not path.is_file():
        pytest.skip(f"{path} not there (tools/k8s/build.sh --crds)")
    crd = yaml.safe_load(path.read_text())
    schema = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]
    ip = _children({**GROUPS, "gateway": GATEWAY})[("InferencePool", "chat")]
    errors = [e.message for e in jsonschema.Draft4Validator(schema["properties"]["spec"]).iter_errors(ip["spec"])]
    assert errors == []
    assert set(ip["spec"]) <= set(schema["properties"]["spec"]["properties"])


# ---------------------------------------------------------------- picker

def test_picker_deployment_runs_phasewise_epp_with_grpc_health_probes():
    kids = _children({**BASE, "gateway": GATEWAY})
    dep = kids[("Deployment", "chat-epp")]
    assert dep["metadata"]["ownerReferences"] == [B.owner_reference(POOL)]
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["selector"]["matchLabels"] == {"phasewise.io/pool": "chat", "app.kubernetes.io/component": "epp"}
    pod = dep["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["epp"]
    epp = _container(dep, "epp")
    assert epp["image"] == "example/routerd:1"
    assert epp["command"] == ["phasewise", "epp"] and epp["args"] == ["--config", "/etc/phasewise/routerd.yaml"]
    assert {p["name"]: p["containerPort"] for p in epp["ports"]} == {"ext-proc": 9002, "grpc-health": 9003,
                                                                      "metrics": 9090}
    assert epp["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert epp["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    # The same ConfigMap and EndpointSlice rights as routerd: one router configuration for both fronts.
    assert pod["serviceAccountName"] == "chat-routerd"
    config = next(v for v in pod["volumes"] if v["name"] == "config")
    assert config["configMap"]["name"] == "chat-routerd"
    assert {"name": "config", "mountPath": "/etc/phasewise", "readOnly": True} in epp["volumeMounts"]
    assert epp["securityContext"]["readOnlyRootFilesystem"] is True
    svc = kids[("Service", "chat-epp")]
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert [(p["name"], p["port"], p["targetPort"], p["appProtocol"]) for p in svc["spec"]["ports"]] == [
        ("grpc-ext-proc", 9002, "ext-proc", "kubernetes.io/h2c"),
        ("grpc-health", 9003, "grpc-health", "kubernetes.io/h2c"),
        ("metrics", 9090, "metrics", "http")]
    # routerd keeps running beside it (a pool may serve both fronts); the section adds, it replaces nothing.
    assert ("Deployment", "chat-routerd") in kids


def test_routerd_yaml_gets_the_epp_section_and_routerd_accepts_it(tmp_path):
    from routerd.daemon.config import Settings, load_settings

    kids = _children({**BASE, "gateway": {"picker": {"enabled": True, "mode": "efficient",
                                                     "envoy": {"enabled": True}}}})
    text = kids[("ConfigMap", "chat-routerd")]["data"]["routerd.yaml"]
    rendered = yaml.safe_load(text)
    assert rendered["epp"] == {"host": "0.0.0.0", "port": 9002, "health_port": 9003, "metrics_port": 9090,
                               "mode": "efficient"}
    if "epp" not in Settings.model_fields:
        pytest.skip("routerd's Settings has no epp section yet (phasewise epp is being written)")
    f = tmp_path / "routerd.yaml"
    f.write_text(text)
    s = load_settings(f)
    assert s.epp.port == 9002 and s.epp.mode == "efficient"


def test_picker_mode_change_rolls_the_picker_not_routerd(envoy_builder):
    a = _children({**BASE, "gateway": {"picker": {"enabled": True, "envoy": {"enabled": True}}}})
    b = _children({**BASE, "gateway": {"picker": {"enabled": True, "mode": "efficient", "envoy": {"enabled": True}}}})
    hash_of = lambda kids, name: kids[("Deployment", name)]["spec"]["template"]["metadata"]["annotations"]  # noqa: E731
    assert hash_of(a, "chat-epp") != hash_of(b, "chat-epp")
    assert hash_of(a, "chat-routerd") == hash_of(b, "chat-routerd")


def test_standalone_envoy_sidecar_configmap_and_client_port(envoy_builder):
    spec = {**BASE, "gateway": {"picker": {"enabled": True, "envoy": {"enabled": True, "port": 8088}}}}
    kids = _children(spec)
    assert envoy_builder.calls and envoy_builder.calls[0] == {"listen_port": 8088, "picker_address": "127.0.0.1:9002",
                                                             "mode": "full-duplex"}
    cm = kids[("ConfigMap", "chat-epp-envoy")]
    assert yaml.safe_load(cm["data"]["envoy.yaml"]) == envoy_builder(listen_port=8088,
                                                                     picker_address="127.0.0.1:9002",
                                                                     mode="full-duplex")
    dep = kids[("Deployment", "chat-epp")]
    envoy = _container(dep, "envoy")
    assert envoy["image"] == DEFAULT_ENVOY_IMAGE == "envoyproxy/envoy:v1.40.0"
    assert envoy["command"] == ["envoy"]
    assert envoy["args"][:2] == ["--config-path", "/etc/envoy/envoy.yaml"]
    assert envoy["ports"] == [{"name": "http", "containerPort": 8088, "protocol": "TCP"}]
    assert envoy["securityContext"]["readOnlyRootFilesystem"] is True
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert vols["envoy-config"]["configMap"]["name"] == "chat-epp-envoy"
    assert B.ANNOTATION_CONFIG_HASH in dep["spec"]["template"]["metadata"]["annotations"]
    svc = kids[("Service", "chat-epp")]
    assert {"name": "http", "port": 8088, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"} in \
        svc["spec"]["ports"]
    custom = copy.deepcopy(spec)
    custom["gateway"]["picker"]["envoy"]["image"] = "mirror.example/envoy:v1.40.0"
    assert _container(_children(custom)[("Deployment", "chat-epp")], "envoy")["image"] == "mirror.example/envoy:v1.40.0"


def test_standalone_without_routerds_envoy_builder_names_the_field(monkeypatch):
    def missing():
        raise ImportError("No module named 'routerd.epp.envoy_config'")

    monkeypatch.setattr(B, "_envoy_config_builder", missing)
    with pytest.raises(SpecError) as e:
        _children({**BASE, "gateway": {"picker": {"enabled": True, "envoy": {"enabled": True}}}})
    assert e.value.field == "spec.gateway.picker.envoy.enabled"
    assert "routerd.epp.envoy_config" in str(e.value)


@pytest.mark.parametrize("gateway,field,words", [
    ({"inferencePool": {"enabled": True}}, "spec.gateway.picker.enabled", "needs gateway.picker.enabled"),
    ({"picker": {"envoy": {"enabled": True}}}, "spec.gateway.picker.envoy.enabled", "needs picker.enabled"),
    ({"picker": {"enabled": True, "mode": "efficient"}}, "spec.gateway.picker.mode", "own Envoy"),
    ({"picker": {"enabled": True, "envoy": {"enabled": True, "port": 9003}}}, "spec.gateway.picker.envoy.port",
     "9002, 9003, 9090"),
    # Envoy's own admin listener (127.0.0.1:9901 in the same pod): the client listener could not bind.
    ({"picker": {"enabled": True, "envoy": {"enabled": True, "port": 9901}}}, "spec.gateway.picker.envoy.port",
     "admin port 9901"),
    ({"picker": {"enabled": True}, "inferencePool": {"targetPortNumber": 50051}},
     "spec.gateway.inferencePool.targetPortNumber", "sidecar"),
    ({"inferencePool": {"failureMode": "FailSometimes"}}, "spec.gateway.inferencePool.failureMode", "FailOpen"),
    ({"inferencePool": {"appProtocol": "grpc"}}, "spec.gateway.inferencePool.appProtocol", "kubernetes.io/h2c"),
    ({"picker": {"replicas": -1}}, "spec.gateway.picker.replicas", "greater than or equal"),
])
def test_bad_gateway_specs_name_the_field(gateway, field, words):
    with pytest.raises(SpecError) as e:
        parse_pool_spec({**BASE, "gateway": gateway})
    assert e.value.field == field
    assert words in str(e.value)


# ---------------------------------------------------------------- budgets and placement

@pytest.mark.parametrize("section,field", [
    ({"engine": {"podDisruptionBudget": {"minAvailable": "150%"}}}, "spec.engine.podDisruptionBudget"),
    ({"routerd": {"podDisruptionBudget": {"minAvailable": 1}}}, "spec.routerd.podDisruptionBudget"),
    ({"routerd": {"podDisruptionBudget": {"minAvailable": 1, "maxUnavailable": 1}}}, "spec.routerd.podDisruptionBudget"),
    ({"gateway": {"picker": {"enabled": True, "podDisruptionBudget": {"minAvailable": "50%"}}}},
     "spec.gateway.picker.podDisruptionBudget"),
])
def test_min_available_budgets_say_only_max_unavailable_is_supported(section, field):
    with pytest.raises(SpecError) as e:
        parse_pool_spec({**BASE, **section})
    assert e.value.field == field
    assert "only maxUnavailable is supported" in str(e.value) and "minAvailable" in str(e.value)
    assert "Field required" not in str(e.value)


def test_disruption_budgets_per_engine_deployment_routerd_and_picker():
    spec = {**GROUPS, "engine": {"podDisruptionBudget": {"maxUnavailable": "25%"}},
            "routerd": {"podDisruptionBudget": {"maxUnavailable": 1}},
            "gateway": {"picker": {"enabled": True, "podDisruptionBudget": {"maxUnavailable": "0"}}}}
    kids = _children(spec)
    pdbs = {k[1]: v for k, v in kids.items() if k[0] == "PodDisruptionBudget"}
    assert sorted(pdbs) == ["chat-engine-chat", "chat-engine-code", "chat-epp", "chat-routerd"]
    for name, pdb in pdbs.items():
        dep = kids[("Deployment", name)]
        assert pdb["apiVersion"] == "policy/v1"
        assert pdb["spec"]["selector"] == dep["spec"]["selector"], name
        assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
        assert pdb["metadata"]["ownerReferences"] == [B.owner_reference(POOL)]
    assert pdbs["chat-engine-code"]["spec"]["maxUnavailable"] == "25%"
    assert pdbs["chat-routerd"]["spec"]["maxUnavailable"] == 1
    assert pdbs["chat-epp"]["spec"]["maxUnavailable"] == 0  # a count: "0" without % is not a percentage


def test_optional_children_to_delete_are_those_not_wanted():
    every = parse_pool_spec({**BASE, "routerd": {"podDisruptionBudget": {"maxUnavailable": 1}},
                             "gateway": {"inferencePool": {"enabled": True},
                                         "picker": {"enabled": True, "podDisruptionBudget": {"maxUnavailable": 1}}}})
    unwanted = {(k, n) for _, k, n in B.optional_children(POOL, every)}
    assert unwanted == {("ConfigMap", "chat-epp-envoy")}
    plain = {(k, n) for _, k, n in B.optional_children(POOL, parse_pool_spec(BASE))}
    assert plain == {("Deployment", "chat-epp"), ("Service", "chat-epp"), ("ConfigMap", "chat-epp-envoy"),
                     ("InferencePool", "chat"), ("PodDisruptionBudget", "chat-routerd"),
                     ("PodDisruptionBudget", "chat-epp")}
    # Engine budgets: only this pool's, only those no longer wanted.
    mine = {"metadata": {"name": "chat-engine-code", "labels": {B.LABEL_COMPONENT: "engine"},
                         "ownerReferences": [B.owner_reference(POOL)]}}
    theirs = copy.deepcopy(mine)
    theirs["metadata"]["name"] = "chat-engine-x"
    theirs["metadata"]["ownerReferences"][0]["uid"] = "someone-else"
    spec = parse_pool_spec({**GROUPS, "engine": {"podDisruptionBudget": {"maxUnavailable": 1}}})
    assert B.stale_engine_budgets(POOL, spec, [mine, theirs]) == []
    assert B.stale_engine_budgets(POOL, parse_pool_spec(GROUPS), [mine, theirs]) == ["chat-engine-code"]


def test_engine_affinity_and_topology_spread_with_group_overrides():
    anti = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                            "labelSelector": {"matchLabels": {"phasewise.io/pool": "chat"}}}}]}}
    spread = [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}]
    spec = {**GROUPS, "engine": {"affinity": anti, "topologySpreadConstraints": spread},
            "engineGroups": [GROUPS["engineGroups"][0],
                             {**GROUPS["engineGroups"][1], "affinity": {"nodeAffinity": {"x": 1}},
                              "topologySpreadConstraints": [{**spread[0], "maxSkew": 2, "minDomains": 2,
                                                             "labelSelector": {"matchLabels": {"k": "v"}}}]}]}
    kids = _children(spec)
    chat = kids[("Deployment", "chat-engine-chat")]["spec"]["template"]["spec"]
    code = kids[("Deployment", "chat-engine-code")]["spec"]["template"]["spec"]
    assert chat["affinity"] == anti
    assert chat["topologySpreadConstraints"] == [{**spread[0], "labelSelector": {"matchLabels": {
        "phasewise.io/pool": "chat", "app.kubernetes.io/component": "engine", "phasewise.io/engine-group": "chat"}}}]
    assert code["affinity"] == {"nodeAffinity": {"x": 1}}
    # Fields beyond the three required pass through; a given labelSelector is kept.
    assert code["topologySpreadConstraints"] == [{**spread[0], "maxSkew": 2, "minDomains": 2,
                                                  "labelSelector": {"matchLabels": {"k": "v"}}}]
    with pytest.raises(SpecError) as e:
        parse_pool_spec({**BASE, "engine": {"topologySpreadConstraints": [{**spread[0], "maxSkew": 0}]}})
    assert e.value.field == "spec.engine.topologySpreadConstraints[0].maxSkew"


def test_refused_children_blame_the_gateway_and_placement_fields():
    kids = _children({**BASE, "engine": {"affinity": {"nodeAffinity": {}}},
                      "gateway": {"inferencePool": {"enabled": True}, "picker": {"enabled": True}}})
    assert B.blame(kids[("Deployment", "chat-engine")], "spec.template.spec.affinity.nodeAffinity: Invalid") == \
        "spec.engine.affinity"
    assert B.blame(kids[("Deployment", "chat-epp")],
                   'spec.template.spec.containers[0].resources.limits[cpu]: Invalid value') == \
        "spec.gateway.picker.resources"
    assert B.blame(kids[("Deployment", "chat-epp")], "spec.replicas: Invalid value: -1") == \
        "spec.gateway.picker.replicas"


# ---------------------------------------------------------------- status

NOW = "2026-12-02T10:00:00Z"


def _dep(replicas=1, ready=1, generation=1):
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": generation, "replicas": replicas, "updatedReplicas": replicas,
                       "availableReplicas": ready, "readyReplicas": ready}}


def _slices(ready: list[bool]):
    return [{"metadata": {"labels": {"kubernetes.io/service-name": "chat-engine"}},
             "ports": [{"name": "http", "port": 8000}, {"name": "state", "port": 50051}],
             "endpoints": [{"addresses": [f"10.0.0.{i}"], "conditions": {"ready": r},
                            "targetRef": {"kind": "Pod", "name": f"p{i}"}} for i, r in enumerate(ready)]}]


def _cond(conds, ctype):
    return next(c for c in conds if c["type"] == ctype)


def test_picker_readiness_counts_and_a_gateway_only_pool_needs_no_routerd():
    common = dict(engine=_dep(2, 2), slices=_slices([True, True]), problem=None, generation=3, now=NOW)
    st = S.pool_status(routerd=_dep(1, 1), picker_wanted=True, picker=_dep(1, 0), **common)
    assert (_cond(st["conditions"], "Ready")["status"], _cond(st["conditions"], "Ready")["reason"]) == \
        ("False", "PickerNotReady")
    assert "picker: 0/1 pods available" in _cond(st["conditions"], "Progressing")["message"]
    st = S.pool_status(routerd=_dep(0, 0), picker_wanted=True, picker=_dep(1, 1), **common)
    ready = _cond(st["conditions"], "Ready")
    assert ready["status"] == "True" and "1/1 picker" in ready["message"]
    st = S.pool_status(routerd=_dep(1, 1), picker_wanted=True, picker=None, **common)
    assert _cond(st["conditions"], "Ready")["reason"] == "NotCreated"
    # Without a picker, a routerd scaled to 0 still makes the pool unready, as before.
    st = S.pool_status(routerd=_dep(0, 0), **common)
    assert _cond(st["conditions"], "Ready")["reason"] == "RouterdNotReady"
    failed = _dep(1, 0)
    failed["status"]["conditions"] = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                                       "message": "ReplicaSet chat-epp-1 has timed out progressing."}]
    st = S.pool_status(routerd=_dep(1, 1), picker_wanted=True, picker=failed, **common)
    deg = _cond(st["conditions"], "Degraded")
    assert (deg["reason"], deg["message"]) == ("PickerFailed", "picker Deployment: ReplicaSet chat-epp-1 has timed "
                                                               "out progressing.")


def _gw(**kw):
    args = dict(crd_served=True, inference_pool={"metadata": {"name": "chat"}}, name="chat",
                selector="phasewise.io/pool=chat,app.kubernetes.io/component=engine", target_port=8000,
                ready_endpoints=2, endpoints=2, now=NOW, generation=3)
    args.update(kw)
    return {c["type"]: c for c in S.gateway_conditions(**args)}


def _parent(name, accepted=("True", "Accepted", ""), resolved=("True", "ResolvedRefs", "")):
    return {"parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": "gw", "name": name},
            "conditions": [{"type": t, "status": s, "reason": r, "message": m, "lastTransitionTime": NOW}
                           for t, (s, r, m) in (("Accepted", accepted), ("ResolvedRefs", resolved))]}


def test_gateway_conditions_without_the_crd_name_the_cause():
    c = _gw(crd_served=False, inference_pool=None)
    assert c["InferencePoolReady"]["status"] == "False"
    assert c["InferencePoolReady"]["reason"] == "CRDNotInstalled"
    assert "inferencepools.inference.networking.k8s.io" in c["InferencePoolReady"]["message"]
    assert "the rest of the pool is reconciled" in c["InferencePoolReady"]["message"]
    assert c["GatewayAccepted"]["reason"] == "CRDNotInstalled"


def test_gateway_conditions_no_ready_pod_names_the_selector():
    c = _gw(ready_endpoints=0, endpoints=3)
    ready = c["InferencePoolReady"]
    assert (ready["status"], ready["reason"]) == ("False", "NoReadyEndpoints")
    assert "phasewise.io/pool=chat,app.kubernetes.io/component=engine matches no ready pod" in ready["message"]
    assert "0/3 endpoints on port 8000" in ready["message"]
    assert _gw()["InferencePoolReady"]["status"] == "True"


def test_gateway_accepted_reflects_the_parents():
    assert _gw()["GatewayAccepted"]["reason"] == "NoParents"
    ok = _gw(inference_pool={"status": {"parents": [_parent("inference-gateway")]}})["GatewayAccepted"]
    assert (ok["status"], ok["reason"]) == ("True", "Accepted")
    assert "Gateway gw/inference-gateway" in ok["message"]
    bad = _gw(inference_pool={"status": {"parents": [
        _parent("a"), _parent("b", resolved=("False", "InvalidExtensionRef", "Service chat-epp not found"))]}})
    acc = bad["GatewayAccepted"]
    assert (acc["status"], acc["reason"]) == ("False", "InvalidExtensionRef")
    assert acc["message"] == "Gateway gw/b: ResolvedRefs is False (InvalidExtensionRef): Service chat-epp not found"
    rejected = _gw(inference_pool={"status": {"parents": [_parent("a", accepted=("False", "NotSupportedByGateway",
                                                                                "no ext_proc"))]}})
    assert rejected["GatewayAccepted"]["reason"] == "NotSupportedByGateway"
    # lastTransitionTime stays while the status does not change.
    later = S.gateway_conditions(crd_served=True, inference_pool={"status": {"parents": [_parent("x")]}}, name="chat",
                                 selector="s", target_port=1, ready_endpoints=1, endpoints=1,
                                 now="2026-12-02T11:00:00Z", generation=4,
                                 previous=[{**ok, "lastTransitionTime": "2026-12-01T00:00:00Z"}])
    assert _cond(later, "GatewayAccepted")["lastTransitionTime"] == "2026-12-01T00:00:00Z"


_OK = _parent("ok")
_NO_PARENTS = ("False", "NoParents")
_ACCEPTED = ("True", "Accepted")


@pytest.mark.parametrize("status,want,words", [
    # a gateway that writes a broken status: bad entries are skipped, never an exception
    (None, _NO_PARENTS, "no gateway lists"),
    ("broken", _NO_PARENTS, "no gateway lists"),
    ({"parents": None}, _NO_PARENTS, "no gateway lists"),
    ({"parents": [None]}, _NO_PARENTS, "no gateway lists"),
    ({"parents": "Gateway gw/x"}, _NO_PARENTS, "no gateway lists"),
    ({"parents": {"parentRef": {"name": "x"}}}, _NO_PARENTS, "no gateway lists"),
    ({"parents": [None, "x", 3, []]}, _NO_PARENTS, "no gateway lists"),
    ({"parents": [None, _OK]}, _ACCEPTED, "by Gateway gw/ok"),
    ({"parents": [{**_OK, "conditions": [None, *_OK["conditions"]]}]}, _ACCEPTED, "by Gateway gw/ok"),
    ({"parents": [{**_OK, "conditions": [None]}]}, ("False", "PendingAccepted"), "Gateway gw/ok: no Accepted"),
    ({"parents": [{**_OK, "conditions": "Accepted"}]}, ("False", "PendingAccepted"), "no Accepted condition"),
    ({"parents": [{**_OK, "conditions": None}]}, ("False", "PendingAccepted"), "no Accepted condition"),
    ({"parents": [{**_OK, "parentRef": None}]}, _ACCEPTED, "by Gateway ?"),
    ({"parents": [{**_OK, "parentRef": "gw"}]}, _ACCEPTED, "by Gateway ?"),
    ({"parents": [{"conditions": [None, {"type": "Accepted", "status": "True"}, 7]}]},
     ("False", "PendingResolvedRefs"), "Gateway ?: no ResolvedRefs condition"),
])
def test_gateway_accepted_tolerates_a_malformed_inference_pool_status(status, want, words):
    acc = _gw(inference_pool={"metadata": {"name": "chat"}, "status": status})["GatewayAccepted"]
    assert (acc["status"], acc["reason"]) == want
    assert words in acc["message"], acc["message"]


def test_standalone_configmap_holds_routerds_own_envoy_bootstrap():
    """With routerd's real builder (routerd.epp.envoy_config): Envoy listens on the pool's port and sends
    ext_proc to the picker on loopback."""
    envoy_config = pytest.importorskip("routerd.epp.envoy_config")
    spec = {**BASE, "gateway": {"picker": {"enabled": True, "mode": "efficient", "envoy": {"enabled": True,
                                                                                          "port": 8088}}}}
    cm = _children(spec)[("ConfigMap", "chat-epp-envoy")]
    boot = yaml.safe_load(cm["data"]["envoy.yaml"])
    assert boot == envoy_config.build_envoy_config(listen_port=8088, picker_address="127.0.0.1:9002", mode="efficient")
    text = cm["data"]["envoy.yaml"]
    assert "8088" in text and "9002" in text


def test_picker_pods_are_restricted(envoy_builder):
    from test_operator_builders import check_restricted

    dep = _children({**BASE, "gateway": {"picker": {"enabled": True, "envoy": {"enabled": True}}}})[
        ("Deployment", "chat-epp")]
    check_restricted(dep["spec"]["template"]["spec"], "picker")
