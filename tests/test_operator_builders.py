"""The operator's pure builders: concrete pools in, hand-checked Kubernetes objects out."""

from __future__ import annotations

import base64
import copy
import json
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "operator"))

from phasewise_operator import builders as B  # noqa: E402
from phasewise_operator.settings import OperatorSettings  # noqa: E402
from phasewise_operator.spec import SpecError, check_pool, parse_pool_spec  # noqa: E402

POOL = B.PoolRef(name="chat", namespace="llm", uid="0b5e3c1a-0000-4000-8000-000000000001", generation=2)
OPS = OperatorSettings(routerd_image="example/routerd:1", vllm_image="example/vllm:2")

GPU_SPEC = {
    "model": {"name": "meta-llama/Llama-2-7b-hf", "servedModelName": "llama-2-7b"},
    "engine": {"replicas": 3, "args": ["--max-model-len", "4096"],
               "resources": {"limits": {"nvidia.com/gpu": 1}},
               "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
               "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
               "nodeSelector": {"gpu": "a100"}},
    "hardwareProfile": {"name": "llama2-7b-a100"},
    "routing": {"policy": "late_binding", "params": {"reserve_fraction": 0.1}, "queueLimit": 256},
    "routerd": {"replicas": 2, "service": {"type": "NodePort", "port": 8080, "nodePort": 30080}},
}
EMU_SPEC = {
    "model": {"name": "m"},
    "emulated": True,
    "engine": {"replicas": 2},
    "hardwareProfile": {"inline": {"grad1": 3.2e-4, "grad2": 3.3e-5, "overheadS": 0.019, "kvCapacityTokens": 30208}},
}


def _children(spec: dict, **kw) -> dict[tuple[str, str], dict]:
    ps = parse_pool_spec(spec)
    check_pool(ps)
    return {(o["kind"], o["metadata"]["name"]): o for o in B.pool_children(POOL, ps, OPS, **kw)}


def _container(dep: dict, name: str) -> dict:
    return next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def test_children_names_kinds_and_owner_references():
    kids = _children(GPU_SPEC)
    assert sorted(kids) == [
        ("ConfigMap", "chat-routerd"), ("Deployment", "chat-engine"), ("Deployment", "chat-routerd"),
        ("Role", "chat-routerd"), ("RoleBinding", "chat-routerd"), ("Service", "chat-engine"),
        ("Service", "chat-routerd"), ("ServiceAccount", "chat-routerd"),
    ]
    for obj in kids.values():
        meta = obj["metadata"]
        assert meta["namespace"] == "llm"
        assert meta["ownerReferences"] == [{
            "apiVersion": "phasewise.io/v1alpha1", "kind": "LLMRouterPool", "name": "chat",
            "uid": "0b5e3c1a-0000-4000-8000-000000000001", "controller": True, "blockOwnerDeletion": True}]
        assert meta["labels"]["phasewise.io/pool"] == "chat"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "phasewise-operator"


def test_vllm_engine_deployment():
    dep = _children(GPU_SPEC)[("Deployment", "chat-engine")]
    spec = dep["spec"]
    assert spec["replicas"] == 3
    assert spec["selector"] == {"matchLabels": {"phasewise.io/pool": "chat", "app.kubernetes.io/component": "engine"}}
    labels = spec["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in spec["selector"]["matchLabels"].items())
    vllm = _container(dep, "vllm")
    assert vllm["image"] == "example/vllm:2"
    assert vllm["command"] == ["vllm", "serve"]
    # The user's args, then the operator's own: the cached-token counts routerd is compared
    # against, and no --block-size (the engine keeps its backend's default).
    assert vllm["args"] == ["meta-llama/Llama-2-7b-hf", "--served-model-name", "llama-2-7b", "--host", "0.0.0.0",
                            "--port", "8000", "--max-model-len", "4096", "--enable-prompt-tokens-details"]
    assert vllm["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert vllm["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    env = {e["name"]: e for e in vllm["env"]}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert env["HF_HOME"]["value"] == "/cache/huggingface" and env["HOME"]["value"] == "/cache"
    # 1800 s of model loading at one probe per 10 s
    assert vllm["startupProbe"]["failureThreshold"] == 180
    assert vllm["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    pod = spec["template"]["spec"]
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["nodeSelector"] == {"gpu": "a100"}
    assert pod["automountServiceAccountToken"] is False
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["dshm"] == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}
    assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


def test_sidecar_beside_every_engine():
    for spec, engine in ((GPU_SPEC, "vllm"), (EMU_SPEC, "emulator")):
        dep = _children(spec)[("Deployment", "chat-engine")]
        names = [c["name"] for c in dep["spec"]["template"]["spec"]["containers"]]
        assert names == [engine, "sidecar"]
        side = _container(dep, "sidecar")
        assert side["command"] == ["phasewise", "sidecar"]
        assert side["args"] == ["--metrics-url", "http://127.0.0.1:8000/metrics", "--listen", "0.0.0.0:50051",
                                "--instance", "$(POD_NAME)", "--interval", "0.25"]
        assert side["ports"] == [{"name": "state", "containerPort": 50051, "protocol": "TCP"}]
        assert side["readinessProbe"]["grpc"] == {"port": 50051}
        assert side["image"] == "example/routerd:1"


def test_sidecar_args_parse_with_phasewise_sidecar():
    """The sidecar's command line is accepted by phasewise sidecar's own parser and config model."""
    import argparse

    from routerd.sidecar.config import add_arguments, resolve_config

    side = _container(_children(GPU_SPEC)[("Deployment", "chat-engine")], "sidecar")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = [a.replace("$(POD_NAME)", "chat-engine-abc") for a in side["args"]]
    cfg = resolve_config(parser.parse_args(args), environ={})
    assert cfg.metrics_url == "http://127.0.0.1:8000/metrics"
    assert cfg.listen == "0.0.0.0:50051" and cfg.instance == "chat-engine-abc" and cfg.interval_s == 0.25


def test_emulated_engine_runs_phasewise_emulate_with_the_pool_profile():
    kids = _children(EMU_SPEC)
    dep = kids[("Deployment", "chat-engine")]
    emu = _container(dep, "emulator")
    assert emu["command"] == ["phasewise", "emulate"]
    assert emu["args"] == ["--host", "0.0.0.0", "--port", "8000", "--profile", "/etc/phasewise/profile.yaml",
                           "--model", "m"]
    assert "nvidia.com/gpu" not in json.dumps(dep)
    pod = dep["spec"]["template"]["spec"]
    cfg = next(v for v in pod["volumes"] if v["name"] == "config")
    assert cfg["configMap"] == {"name": "chat-routerd", "items": [{"key": "profile.yaml", "path": "profile.yaml"}],
                                "optional": False}
    # The emulator's profile file is the one routerd reasons with.
    cm = kids[("ConfigMap", "chat-routerd")]
    prof = yaml.safe_load(cm["data"]["profile.yaml"])
    assert (prof["grad1"], prof["grad2"], prof["overhead_s"], prof["kv_capacity_tokens"]) == (3.2e-4, 3.3e-5, 0.019, 30208)
    assert prof["decode_per_seq_s"] == 0.00067  # from basedOn llama2-7b-v100
    assert dep["spec"]["template"]["metadata"]["annotations"][B.ANNOTATION_PROFILE_HASH] == \
        B.short_hash(cm["data"]["profile.yaml"])


def test_emulator_args_parse_with_phasewise_emulate(tmp_path):
    """The emulator's command line is accepted by phasewise emulate and the profile file loads."""
    import argparse

    from routerd.emulator.cli import add_parser, settings_from_args
    from routerd.emulator.server import load_profile

    kids = _children(EMU_SPEC)
    emu = _container(kids[("Deployment", "chat-engine")], "emulator")
    prof = tmp_path / "profile.yaml"
    prof.write_text(kids[("ConfigMap", "chat-routerd")]["data"]["profile.yaml"])
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["emulate", *[str(prof) if a == B.PROFILE_FILE else a for a in emu["args"]]])
    s = settings_from_args(args, environ={})
    assert (s.host, s.port, s.model) == ("0.0.0.0", 8000, "m")
    assert load_profile(s.profile).kv_capacity_tokens == 30208


def test_engine_service_has_the_port_names_routerd_watches():
    svc = _children(GPU_SPEC)[("Service", "chat-engine")]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {"phasewise.io/pool": "chat", "app.kubernetes.io/component": "engine"}
    assert [(p["name"], p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == \
        [("http", 8000, "http"), ("state", 50051, "state")]
    # routerd's own EndpointSlice translation finds url and state address through these names
    from routerd.daemon.endpointslices import endpoints_from_slices

    slice_ = {"addressType": "IPv4", "metadata": {"name": "chat-engine-x"},
              "ports": [{"name": p["name"], "port": p["port"]} for p in svc["spec"]["ports"]],
              "endpoints": [{"addresses": ["10.1.2.3"], "targetRef": {"name": "chat-engine-0"},
                             "conditions": {"ready": True}}]}
    (ep,) = endpoints_from_slices([slice_])
    assert (ep.url, ep.state_address) == ("http://10.1.2.3:8000", "10.1.2.3:50051")


def test_routerd_service_and_deployment():
    kids = _children(GPU_SPEC)
    svc = kids[("Service", "chat-routerd")]
    assert svc["spec"]["type"] == "NodePort"
    assert svc["spec"]["ports"][0] == {"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP",
                                       "appProtocol": "http", "nodePort": 30080}
    assert svc["spec"]["ports"][1]["name"] == "grpc" and svc["spec"]["ports"][1]["port"] == 50051
    dep = kids[("Deployment", "chat-routerd")]
    assert dep["spec"]["replicas"] == 2
    r = _container(dep, "routerd")
    assert r["command"] == ["phasewise", "serve"] and r["args"] == ["--config", "/etc/phasewise/routerd.yaml"]
    assert [(p["name"], p["containerPort"]) for p in r["ports"]] == [("http", 8000), ("grpc", 50051)]
    assert r["readinessProbe"]["httpGet"]["path"] == "/readyz" and r["livenessProbe"]["httpGet"]["path"] == "/healthz"
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "chat-routerd" and pod["automountServiceAccountToken"] is True
    assert pod["terminationGracePeriodSeconds"] == 45  # 30 s drain + 15
    cfg = next(v for v in pod["volumes"] if v["name"] == "config")["configMap"]
    assert cfg["name"] == "chat-routerd" and cfg["optional"] is True
    assert [i["path"] for i in cfg["items"]] == ["routerd.yaml", "profile.yaml", "checkpoint/model.safetensors",
                                               "checkpoint/metadata.json"]
    assert B.router_url(POOL, parse_pool_spec(GPU_SPEC)) == "http://chat-routerd.llm.svc:8080"


def test_routerd_rbac_reads_only_endpointslices():
    kids = _children(GPU_SPEC)
    role = kids[("Role", "chat-routerd")]
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    rb = kids[("RoleBinding", "chat-routerd")]
    assert rb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "chat-routerd"}
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": "chat-routerd", "namespace": "llm"}]


# ---------------------------------------------------------------- the routerd ConfigMap

def _settings_from_configmap(cm: dict, tmp_path: Path):
    from routerd.daemon.config import load_settings

    f = tmp_path / "routerd.yaml"
    f.write_text(cm["data"]["routerd.yaml"])
    return load_settings(f, environ={})


def test_configmap_is_what_routerd_accepts(tmp_path):
    cm = _children(GPU_SPEC)[("ConfigMap", "chat-routerd")]
    s = _settings_from_configmap(cm, tmp_path)
    assert (s.http.port, s.grpc.port) == (8000, 50051)
    assert s.models == ["llama-2-7b"]
    assert s.kubernetes.enabled and s.kubernetes.namespace == "llm" and s.kubernetes.service == "chat-engine"
    assert (s.kubernetes.http_port_name, s.kubernetes.state_port_name) == ("http", "state")
    assert s.policy.name == "late_binding" and s.policy.params == {"reserve_fraction": 0.1}
    assert s.profile == "llama2-7b-a100"
    assert s.predictor == "default"  # GPU_SPEC sets no predictor: routerd's shipped model
    assert (s.router.queue_limit, s.router.action_interval_s) == (256, 0.02)
    assert s.state.max_age_s == 2.0 and s.reload.watch is True
    # routerd builds the policy from it (the same call its reload makes)
    from routerd.daemon.router import build_routing_policy
    from routerd.model import PREDICTOR_BUCKET_EDGES
    from routerd.profiles import get_profile

    policy = build_routing_policy(s.policy, get_profile(s.profile), 3, PREDICTOR_BUCKET_EDGES)
    assert policy.name == "late_binding"


def test_inline_profile_is_a_file_routerd_loads(tmp_path):
    cm = _children(EMU_SPEC)[("ConfigMap", "chat-routerd")]
    s = _settings_from_configmap(cm, tmp_path)
    assert s.profile == "/etc/phasewise/profile.yaml"
    from routerd.profiles import load_profile_file

    f = tmp_path / "profile.yaml"
    f.write_text(cm["data"]["profile.yaml"])
    prof = load_profile_file(f)
    assert prof.name == "chat-inline" and prof.grad1 == 3.2e-4 and prof.max_num_seqs == 128


def _checkpoint(n: int = 3) -> B.Checkpoint:
    meta = json.dumps({"format": "phasewise-dqn/1", "num_instances": n, "variant": "workload-guided"})
    return B.Checkpoint(config_map="train-1-checkpoint", model_b64=base64.b64encode(b"weights").decode(),
                        metadata_json=meta)


def test_dqn_checkpoint_rides_in_the_configmap(tmp_path):
    spec = copy.deepcopy(GPU_SPEC)
    spec["routing"] = {"policy": "dqn", "checkpoint": {"configMap": "train-1-checkpoint"}}
    ck = _checkpoint()
    cm = _children(spec, checkpoint=ck)[("ConfigMap", "chat-routerd")]
    assert cm["binaryData"] == {"checkpoint-model.safetensors": ck.model_b64}
    assert cm["data"]["checkpoint-metadata.json"] == ck.metadata_json
    assert f"content {ck.digest}" in cm["data"]["routerd.yaml"]
    s = _settings_from_configmap(cm, tmp_path)
    assert s.policy.name == "dqn" and s.policy.params == {"checkpoint": "/etc/phasewise/checkpoint"}


def test_reloadable_changes_do_not_restart_routerd():
    """Policy, its params, profile, queue limit and checkpoint change the ConfigMap but not routerd's pods."""
    base = _children(GPU_SPEC)
    changes = []
    s = copy.deepcopy(GPU_SPEC); s["routing"]["policy"] = "join_shortest_queue"; s["routing"]["params"] = {}
    changes.append(s)
    s = copy.deepcopy(GPU_SPEC); s["routing"]["params"] = {"reserve_fraction": 0.2}
    changes.append(s)
    s = copy.deepcopy(GPU_SPEC); s["hardwareProfile"] = {"name": "llama2-7b-v100"}
    changes.append(s)
    s = copy.deepcopy(GPU_SPEC); s["routing"]["queueLimit"] = 10
    changes.append(s)
    for s in changes:
        kids = _children(s)
        assert kids[("ConfigMap", "chat-routerd")] != base[("ConfigMap", "chat-routerd")]
        assert kids[("Deployment", "chat-routerd")] == base[("Deployment", "chat-routerd")]
        assert kids[("Deployment", "chat-engine")] == base[("Deployment", "chat-engine")]
    s = copy.deepcopy(GPU_SPEC); s["routing"] = {"policy": "dqn", "checkpoint": {"configMap": "x"}}
    a, b = _children(s, checkpoint=_checkpoint(3)), _children(s, checkpoint=B.Checkpoint("x", "AAAA", "{}"))
    assert a[("ConfigMap", "chat-routerd")] != b[("ConfigMap", "chat-routerd")]
    assert a[("Deployment", "chat-routerd")] == b[("Deployment", "chat-routerd")]


def test_start_only_settings_restart_routerd():
    base = _children(GPU_SPEC)[("Deployment", "chat-routerd")]
    s = copy.deepcopy(GPU_SPEC); s["routerd"]["logLevel"] = "debug"
    new = _children(s)[("Deployment", "chat-routerd")]
    key = B.ANNOTATION_RESTART_HASH
    assert new["spec"]["template"]["metadata"]["annotations"][key] != \
        base["spec"]["template"]["metadata"]["annotations"][key]


def test_emulated_profile_change_rolls_the_emulators_only():
    a = _children(EMU_SPEC)
    s = copy.deepcopy(EMU_SPEC); s["hardwareProfile"]["inline"]["grad1"] = 3.0e-4
    b = _children(s)
    assert a[("Deployment", "chat-engine")] != b[("Deployment", "chat-engine")]
    assert a[("Deployment", "chat-routerd")] == b[("Deployment", "chat-routerd")]


def test_predictor_volume_and_path(tmp_path):
    s = copy.deepcopy(GPU_SPEC)
    s["predictor"] = {"persistentVolumeClaim": {"claimName": "predictors", "path": "minilm/v3"}}
    kids = _children(s)
    dep = kids[("Deployment", "chat-routerd")]
    vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "predictor")
    assert vol["persistentVolumeClaim"] == {"claimName": "predictors", "readOnly": True}
    assert "predictor: /var/lib/phasewise/predictor/minilm/v3\n" in kids[("ConfigMap", "chat-routerd")]["data"]["routerd.yaml"]
    s["predictor"] = {"name": "length-only"}
    assert "predictor: length-only\n" in _children(s)[("ConfigMap", "chat-routerd")]["data"]["routerd.yaml"]


def _routerd_yaml(spec: dict) -> str:
    return _children(spec)[("ConfigMap", "chat-routerd")]["data"]["routerd.yaml"]


def test_the_shipped_predictor_is_on_unless_the_pool_says_none(tmp_path):
    from routerd.daemon.app import load_length_predictor
    from routerd.predictor.ngram_predictor import NgramPredictor

    unset = copy.deepcopy(GPU_SPEC)
    assert "predictor" not in unset
    for spec in (unset, {**GPU_SPEC, "predictor": None}, {**GPU_SPEC, "predictor": {"name": "default"}}):
        text = _routerd_yaml(spec)
        assert "predictor: default\n" in text
        deps = _children(spec)[("Deployment", "chat-routerd")]["spec"]["template"]["spec"]
        assert all(v["name"] != "predictor" for v in deps["volumes"])  # shipped in the image: no volume
        s = _settings_from_configmap({"data": {"routerd.yaml": text}}, tmp_path)
        assert isinstance(load_length_predictor(s.predictor), NgramPredictor)  # what routerd then loads
    off = _routerd_yaml({**GPU_SPEC, "predictor": {"name": "none"}})
    assert "predictor: none\n" in off
    s = _settings_from_configmap({"data": {"routerd.yaml": off}}, tmp_path)
    assert load_length_predictor(s.predictor) is None
    # Turning it off is a reload, not a restart: the routerd pod template does not change.
    on_dep = _children(unset)[("Deployment", "chat-routerd")]
    off_dep = _children({**GPU_SPEC, "predictor": {"name": "none"}})[("Deployment", "chat-routerd")]
    assert on_dep["spec"]["template"]["metadata"]["annotations"][B.ANNOTATION_RESTART_HASH] == \
        off_dep["spec"]["template"]["metadata"]["annotations"][B.ANNOTATION_RESTART_HASH]


def test_sidecar_interval_keeps_state_fresh():
    s = copy.deepcopy(GPU_SPEC); s["sidecar"] = {"intervalSeconds": 1.5}
    text = _children(s)[("ConfigMap", "chat-routerd")]["data"]["routerd.yaml"]
    assert yaml.safe_load(text.split("\n", 1)[1])["state"]["max_age_s"] == 6.0


def test_bad_inline_profile_names_the_field():
    s = copy.deepcopy(EMU_SPEC); s["hardwareProfile"]["inline"]["kvCapacityTokens"] = 1024
    with pytest.raises(SpecError) as e:
        _children(s)
    assert e.value.field == "spec.hardwareProfile.inline.kvCapacityTokens"
    assert "maxModelLen=4096" in e.value.message


# ---------------------------------------------------------------- restricted Pod Security Standard

_ALLOWED_VOLUMES = {"configMap", "emptyDir", "persistentVolumeClaim", "secret", "projected", "downwardAPI", "csi",
                    "ephemeral"}


def check_restricted(pod: dict, where: str) -> None:
    """The restricted Pod Security Standard (v1.37 'restricted' profile), plus a read-only root file system
    whose writable paths are volumes."""
    assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), where
    psc = pod.get("securityContext") or {}
    assert psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
    assert psc.get("runAsUser", 1) != 0
    for v in pod.get("volumes") or []:
        kinds = set(v) - {"name"}
        assert kinds <= _ALLOWED_VOLUMES, f"{where}: volume {v['name']} of kind {kinds}"
    for c in (pod.get("initContainers") or []) + pod["containers"]:
        sc = c.get("securityContext") or {}
        cw = f"{where}/{c['name']}"
        assert sc.get("allowPrivilegeEscalation") is False, cw
        assert sc.get("privileged") is not True, cw
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], cw
        assert set(sc.get("capabilities", {}).get("add") or []) <= {"NET_BIND_SERVICE"}, cw
        assert (sc.get("runAsNonRoot") or psc.get("runAsNonRoot")) is True, cw
        assert sc.get("runAsUser", psc.get("runAsUser")) not in (0, None), cw
        assert sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type") == "RuntimeDefault", cw
        assert sc.get("readOnlyRootFilesystem") is True, cw
        assert "/tmp" in [m["mountPath"] for m in c.get("volumeMounts") or []], f"{cw}: no writable /tmp"
        assert not any(p.get("hostPort") for p in c.get("ports") or []), cw
        names = {m["name"] for m in c.get("volumeMounts") or []}
        assert names <= {v["name"] for v in pod["volumes"]}, cw


@pytest.mark.parametrize("spec", [GPU_SPEC, EMU_SPEC], ids=["vllm", "emulated"])
def test_every_pod_is_restricted(spec):
    for obj in _children(spec).values():
        if obj["kind"] == "Deployment":
            check_restricted(obj["spec"]["template"]["spec"], obj["metadata"]["name"])


def test_vllm_writable_paths_are_volumes():
    vllm = _container(_children(GPU_SPEC)[("Deployment", "chat-engine")], "vllm")
    mounts = {m["mountPath"] for m in vllm["volumeMounts"]}
    for var in ("HOME", "HF_HOME", "XDG_CACHE_HOME", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        value = next(e["value"] for e in vllm["env"] if e["name"] == var)
        assert any(value == m or value.startswith(m + "/") for m in mounts), (var, value)
    assert {"/tmp", "/dev/shm", "/cache"} <= mounts


def test_model_cache_claim():
    s = copy.deepcopy(GPU_SPEC); s["engine"]["modelCacheClaim"] = "hf-cache"
    dep = _children(s)[("Deployment", "chat-engine")]
    vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "models")
    assert vol["persistentVolumeClaim"] == {"claimName": "hf-cache"}
    vllm = _container(dep, "vllm")
    assert next(e["value"] for e in vllm["env"] if e["name"] == "HF_HOME") == "/models"


# ---------------------------------------------------------------- engine groups (several models)

GROUPS_SPEC = {
    "engine": {"replicas": 2, "resources": {"limits": {"nvidia.com/gpu": 1}}, "nodeSelector": {"gpu": "a100"},
               "args": ["--max-model-len", "4096"]},
    "engineGroups": [
        {"name": "llama", "model": {"name": "meta-llama/Llama-2-7b-hf", "servedModelName": "llama-2-7b"}},
        {"name": "llama-h100", "model": {"name": "meta-llama/Llama-2-7b-hf", "servedModelName": "llama-2-7b"},
         "replicas": 3, "nodeSelector": {"gpu": "h100"}, "args": [], "resources": {"limits": {"nvidia.com/gpu": 2}},
         "tolerations": [{"key": "h100", "operator": "Exists", "effect": "NoSchedule"}]},
        {"name": "code", "model": {"name": "codellama/CodeLlama-7b-hf"}, "replicas": 1,
         "env": [{"name": "HF_TOKEN", "value": "t"}]},
    ],
    "hardwareProfile": {"name": "llama2-7b-a100"},
}
EMU_GROUPS_SPEC = {"emulated": True, "engine": {"replicas": 2}, "engineGroups": [
    {"name": "a", "model": {"name": "model-a"}}, {"name": "b", "model": {"name": "org/model-b"}, "replicas": 1}]}


def _labels_match(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_one_engine_deployment_per_group_behind_one_service():
    kids = _children(GROUPS_SPEC)
    assert sorted(k for k in kids if k[0] in ("Deployment", "Service")) == [
        ("Deployment", "chat-engine-code"), ("Deployment", "chat-engine-llama"),
        ("Deployment", "chat-engine-llama-h100"), ("Deployment", "chat-routerd"),
        ("Service", "chat-engine"), ("Service", "chat-engine-code"), ("Service", "chat-engine-llama"),
        ("Service", "chat-engine-llama-h100"), ("Service", "chat-routerd")]
    deps = {g: kids[("Deployment", f"chat-engine-{g}")] for g in ("llama", "llama-h100", "code")}
    assert {g: d["spec"]["replicas"] for g, d in deps.items()} == {"llama": 2, "llama-h100": 3, "code": 1}
    for g, d in deps.items():
        assert d["metadata"]["labels"]["phasewise.io/engine-group"] == g
        assert d["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"
        assert d["metadata"]["ownerReferences"][0]["uid"] == POOL.uid
        assert d["spec"]["selector"]["matchLabels"] == {"phasewise.io/pool": "chat",
                                                         "app.kubernetes.io/component": "engine",
                                                         "phasewise.io/engine-group": g}
    assert deps["llama"]["metadata"]["labels"]["phasewise.io/model"] == "llama-2-7b"
    assert deps["code"]["metadata"]["labels"]["phasewise.io/model"] == "codellama_CodeLlama-7b-hf"
    assert deps["code"]["metadata"]["annotations"] == {"phasewise.io/model": "codellama/CodeLlama-7b-hf"}
    svc = kids[("Service", "chat-engine")]
    for g, d in deps.items():
        pod_labels = d["spec"]["template"]["metadata"]["labels"]
        assert _labels_match(d["spec"]["selector"], pod_labels), g  # the Deployment owns its pods
        assert all(pod_labels.get(k) == v for k, v in svc["spec"]["selector"].items()), g  # the Service finds them
        for other, od in deps.items():
            if other != g:  # no Deployment selects another group's pods
                assert not _labels_match(od["spec"]["selector"], pod_labels), (other, g)


def test_group_overrides_reach_the_containers():
    kids = _children(GROUPS_SPEC)
    llama, h100, code = (kids[("Deployment", f"chat-engine-{g}")] for g in ("llama", "llama-h100", "code"))
    a, b, c = (_container(d, "vllm") for d in (llama, h100, code))
    assert a["args"] == ["meta-llama/Llama-2-7b-hf", "--served-model-name", "llama-2-7b", "--host", "0.0.0.0",
                         "--port", "8000", "--max-model-len", "4096", "--enable-prompt-tokens-details"]
    assert b["args"] == ["meta-llama/Llama-2-7b-hf", "--served-model-name", "llama-2-7b", "--host", "0.0.0.0",
                         "--port", "8000", "--enable-prompt-tokens-details"]  # args: [] replaces the engine's
    assert c["args"][:3] == ["codellama/CodeLlama-7b-hf", "--served-model-name", "codellama/CodeLlama-7b-hf"]
    assert (a["resources"], b["resources"]) == ({"limits": {"nvidia.com/gpu": 1}}, {"limits": {"nvidia.com/gpu": 2}})
    pods = [d["spec"]["template"]["spec"] for d in (llama, h100, code)]
    assert [p["nodeSelector"] for p in pods] == [{"gpu": "a100"}, {"gpu": "h100"}, {"gpu": "a100"}]
    assert "tolerations" not in pods[0] and pods[1]["tolerations"] == [
        {"key": "h100", "operator": "Exists", "effect": "NoSchedule"}]
    assert {"name": "HF_TOKEN", "value": "t"} in c["env"] and "HF_TOKEN" not in {e["name"] for e in a["env"]}
    for d in (llama, h100, code):
        check_restricted(d["spec"]["template"]["spec"], d["metadata"]["name"])


def test_routerd_serves_the_union_of_the_groups_models(tmp_path):
    cm = _children(GROUPS_SPEC)[("ConfigMap", "chat-routerd")]
    s = _settings_from_configmap(cm, tmp_path)
    # Spec order, the model of two groups once; every group's pods behind the one Service.
    assert s.models == ["llama-2-7b", "codellama/CodeLlama-7b-hf"]
    assert s.kubernetes.service == "chat-engine"


def test_emulated_groups_serve_their_own_model(tmp_path):
    from routerd.emulator.cli import add_parser, settings_from_args

    import argparse

    kids = _children(EMU_GROUPS_SPEC)
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"))
    seen = {}
    for g in ("a", "b"):
        dep = kids[("Deployment", f"chat-engine-{g}")]
        emu = _container(dep, "emulator")
        seen[g] = settings_from_args(parser.parse_args(["emulate", *emu["args"]]), environ={}).model
        assert dep["spec"]["template"]["metadata"]["annotations"]["phasewise.io/model"] == seen[g]
        assert B.ANNOTATION_PROFILE_HASH in dep["spec"]["template"]["metadata"]["annotations"]
    assert seen == {"a": "model-a", "b": "org/model-b"}
    assert kids[("Deployment", "chat-engine-a")]["spec"]["replicas"] == 2
    assert kids[("Deployment", "chat-engine-b")]["spec"]["replicas"] == 1
    assert yaml.safe_load(kids[("ConfigMap", "chat-routerd")]["data"]["routerd.yaml"])["models"] == \
        ["model-a", "org/model-b"]


def test_the_single_model_form_keeps_its_names_labels_and_selector():
    """Existing pools see the same engine Deployment after an upgrade: no group label, so no pod rolls."""
    dep = _children(GPU_SPEC)[("Deployment", "chat-engine")]
    assert dep["metadata"]["labels"] == B.labels("chat", "engine")
    assert "annotations" not in dep["metadata"]
    assert dep["spec"]["template"]["metadata"] == {"labels": B.labels("chat", "engine")}
    assert dep["spec"]["selector"] == {"matchLabels": B.selector("chat", "engine")}
    assert B.engine_group_name("chat", "") == "chat-engine" == B.engine_name("chat")


@pytest.mark.parametrize("served,label", [
    ("llama-2-7b", "llama-2-7b"),
    ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama_Llama-3.1-8B-Instruct"),
    ("/models/x/", "models_x"),
    ("m" * 80, "m" * 46 + "-" + B.short_hash("m" * 80)),
])
def test_model_label_is_a_valid_label_value(served, label):
    import re

    value = B.model_label(served)
    assert value == label
    assert len(value) <= 63 and re.fullmatch(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]", value)


def test_stale_engine_deployments_are_only_the_pools_own_unwanted_ones():
    ps = parse_pool_spec(EMU_GROUPS_SPEC)

    def dep(name, uid=POOL.uid, component="engine"):
        return {"metadata": {"name": name, "labels": {"app.kubernetes.io/component": component},
                             "ownerReferences": [{"uid": uid, "controller": True}]}}

    observed = [dep("chat-engine-a"), dep("chat-engine-b"), dep("chat-engine-gone"), dep("chat-engine"),
                dep("chat-engine-foreign", uid="someone-else"), dep("chat-routerd", component="routerd")]
    assert B.stale_engine_deployments(POOL, ps, observed) == ["chat-engine", "chat-engine-gone"]
    single = parse_pool_spec(EMU_SPEC)
    assert B.stale_engine_deployments(POOL, single, observed) == ["chat-engine-a", "chat-engine-b", "chat-engine-gone"]


def test_a_refused_group_deployment_blames_the_groups_own_field():
    ps = parse_pool_spec(GROUPS_SPEC)
    kids = _children(GROUPS_SPEC)
    msg = 'Deployment.apps "x" is invalid: spec.template.spec.containers[0].resources.limits[nvidia.com/gpu]: Invalid'
    assert B.blame(kids[("Deployment", "chat-engine-llama-h100")], msg, ps) == "spec.engineGroups[1].resources"
    assert B.blame(kids[("Deployment", "chat-engine-llama")], msg, ps) == "spec.engine.resources"  # inherited
    assert B.blame(kids[("Deployment", "chat-engine-code")], "spec.replicas: Invalid value", ps) == \
        "spec.engineGroups[2].replicas"


# ---------------------------------------------------------------- prefix-cache-aware routing

def _routerd_prefix_ready() -> bool:
    """Whether routerd's settings model has the ``prefix`` block yet (issue 14's routerd part)."""
    from routerd.daemon.config import Settings

    return "prefix" in Settings.model_fields


def _emulator_takes_kv_events() -> bool:
    import argparse

    from routerd.emulator.cli import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"))
    _, unknown = parser.parse_known_args(["emulate", "--kv-events-config", "{}"])
    return not unknown


needs_routerd_prefix = pytest.mark.skipif(not _routerd_prefix_ready(),
                                          reason="routerd's Settings has no prefix block yet (issue 14)")
needs_emulator_kv_events = pytest.mark.skipif(not _emulator_takes_kv_events(),
                                              reason="phasewise emulate has no --kv-events-config yet (issue 14)")

PRECISE = {"mode": "precise", "blockSize": 16, "chunkBlocks": 4, "maxPromptTokens": 8192,
           "indexCapacityBlocks": 100000, "tokenizer": "/models/tokenizer.json",
           "kvEvents": {"port": 5600, "topic": "kv", "staleAfterSeconds": 5.0, "maxBlocks": 500000}}
VLLM_KV_CONFIG = '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5600","topic":"kv"}'


def _with_prefix(spec: dict, prefix: dict | None) -> dict:
    s = copy.deepcopy(spec)
    s.setdefault("routing", {})["prefix"] = prefix
    if prefix is None:
        del s["routing"]["prefix"]
    return s


def _settings_dict(spec: dict) -> dict:
    return yaml.safe_load(_routerd_yaml(spec))


def test_precise_prefix_makes_vllm_publish_kv_events_on_a_named_port():
    kids = _children(_with_prefix(GPU_SPEC, PRECISE))
    vllm = _container(kids[("Deployment", "chat-engine")], "vllm")
    assert vllm["args"] == ["meta-llama/Llama-2-7b-hf", "--served-model-name", "llama-2-7b", "--host", "0.0.0.0",
                            "--port", "8000", "--max-model-len", "4096", "--enable-prompt-tokens-details",
                            "--kv-events-config", VLLM_KV_CONFIG]
    # vLLM's KVEventsConfig field names (vllm/config/kv_events.py), publishing on every address
    assert json.loads(vllm["args"][-1]) == {"enable_kv_cache_events": True, "publisher": "zmq",
                                            "endpoint": "tcp://*:5600", "topic": "kv"}
    # ... on the port and topic routerd is told to read
    s = _settings_dict(_with_prefix(GPU_SPEC, PRECISE))
    assert "tcp://*:%d" % s["prefix"]["kv_events"]["port"] == json.loads(vllm["args"][-1])["endpoint"]
    assert s["prefix"]["kv_events"]["topic"] == json.loads(vllm["args"][-1])["topic"]
    assert vllm["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"},
                             {"name": "kv-events", "containerPort": 5600, "protocol": "TCP"}]
    svc = kids[("Service", "chat-engine")]
    assert svc["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"},
        {"name": "state", "port": 50051, "targetPort": "state", "protocol": "TCP", "appProtocol": "kubernetes.io/h2c"},
        {"name": "kv-events", "port": 5600, "targetPort": "kv-events", "protocol": "TCP"}]
    # The sidecar is unchanged: it reads the hit counters from /metrics, not the events.
    assert _container(kids[("Deployment", "chat-engine")], "sidecar") == \
        _container(_children(GPU_SPEC)[("Deployment", "chat-engine")], "sidecar")


def test_precise_prefix_renders_routerd_prefix_settings_by_its_names():
    s = _settings_dict(_with_prefix(GPU_SPEC, PRECISE))
    assert s["prefix"] == {"mode": "precise", "block_size": 16, "chunk_blocks": 4, "max_prompt_tokens": 8192,
                           "index_capacity_blocks": 100000, "tokenizer": "/models/tokenizer.json",
                           "kv_events": {"port": 5600, "topic": "kv", "stale_after_s": 5.0, "max_blocks": 500000}}
    assert s["kubernetes"] == {"enabled": True, "namespace": "llm", "service": "chat-engine",
                               "http_port_name": "http", "state_port_name": "state",
                               "kv_events_port_name": "kv-events"}


def test_precise_prefix_defaults_are_vllms_port_and_topic():
    kids = _children(_with_prefix(GPU_SPEC, {"mode": "precise"}))
    vllm = _container(kids[("Deployment", "chat-engine")], "vllm")
    assert vllm["args"][7:] == ["--max-model-len", "4096", "--enable-prompt-tokens-details", "--kv-events-config",
                                '{"enable_kv_cache_events":true,"publisher":"zmq",'
                                '"endpoint":"tcp://*:5557","topic":""}']
    assert vllm["ports"][1] == {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"}
    assert kids[("Service", "chat-engine")]["spec"]["ports"][2]["port"] == 5557
    # routerd is told the same port and topic, and nothing else it was not given.
    assert _settings_dict(_with_prefix(GPU_SPEC, {"mode": "precise"}))["prefix"] == \
        {"mode": "precise", "kv_events": {"port": 5557, "topic": ""}}


def test_precise_prefix_in_an_emulated_pool():
    kids = _children(_with_prefix(EMU_SPEC, {"mode": "precise"}))
    emu = _container(kids[("Deployment", "chat-engine")], "emulator")
    assert emu["args"] == ["--host", "0.0.0.0", "--port", "8000", "--profile", "/etc/phasewise/profile.yaml",
                           "--model", "m", "--kv-events-config",
                           '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","topic":""}']
    assert emu["ports"][1] == {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"}
    # The emulator's tokens are its byte tokenizer's: routerd tokenizes the same way.
    assert _settings_dict(_with_prefix(EMU_SPEC, {"mode": "precise"}))["prefix"] == \
        {"mode": "precise", "tokenizer": "bytes", "kv_events": {"port": 5557, "topic": ""}}
    # A tokenizer the pool names is kept.
    assert _settings_dict(_with_prefix(EMU_SPEC, {"mode": "precise", "tokenizer": "/t.json"}))["prefix"]["tokenizer"] \
        == "/t.json"
    # Every group's engine publishes.
    groups = _children(_with_prefix(EMU_GROUPS_SPEC, {"mode": "precise"}))
    for g in ("a", "b"):
        emu = _container(groups[("Deployment", f"chat-engine-{g}")], "emulator")
        assert emu["args"][-2] == "--kv-events-config" and emu["ports"][1]["name"] == "kv-events"
    check_restricted(kids[("Deployment", "chat-engine")]["spec"]["template"]["spec"], "precise emulated")


@pytest.mark.parametrize("prefix, expected", [
    (None, None),
    ({}, None),
    ({"mode": "off"}, {"mode": "off"}),
    ({"mode": "approximate", "blockSize": 16, "chunkBlocks": 2, "indexCapacityBlocks": 31250},
     {"mode": "approximate", "block_size": 16, "chunk_blocks": 2, "index_capacity_blocks": 31250}),
    # kvEvents given without precise: passed on as given (routerd ignores them), no engine change.
    ({"mode": "approximate", "kvEvents": {"staleAfterSeconds": 2.5}}, {"mode": "approximate",
                                                                       "kv_events": {"stale_after_s": 2.5}}),
    # No mode: routerd's default mode, with the other fields.
    ({"maxPromptTokens": 4096}, {"max_prompt_tokens": 4096}),
], ids=["unset", "empty", "off", "approximate", "approximate-kv-events", "no-mode"])
def test_other_modes_leave_the_engines_alone(prefix, expected):
    spec = _with_prefix(GPU_SPEC, prefix)
    s = _settings_dict(spec)
    assert s.get("prefix") == expected
    assert "kv_events_port_name" not in s["kubernetes"]
    base, kids = _children(GPU_SPEC), _children(spec)
    for key in (("Deployment", "chat-engine"), ("Service", "chat-engine")):
        assert kids[key] == base[key], key
    # "off" stays a string in the file (unquoted YAML off is a boolean).
    if prefix == {"mode": "off"}:
        assert "mode: 'off'" in _routerd_yaml(spec)


def test_prefix_changes_reload_routerd_unless_they_move_the_kv_events_port_name():
    """block size, capacities, mode approximate/off: a reload; into or out of precise changes the
    kubernetes settings (the kv-events port name), which routerd reads at start: a restart."""
    def restart(prefix):
        dep = _children(_with_prefix(GPU_SPEC, prefix))[("Deployment", "chat-routerd")]
        return dep["spec"]["template"]["metadata"]["annotations"][B.ANNOTATION_RESTART_HASH]

    base = restart(None)
    # (blockSize must equal the profile's 16: check_pool refuses another.)
    assert restart({"mode": "approximate", "blockSize": 16}) == base == restart({"mode": "off"})
    assert restart({"mode": "precise"}) != base
    assert restart({"mode": "precise", "blockSize": 16, "chunkBlocks": 8}) == restart({"mode": "precise"})


@pytest.mark.parametrize("spec, field, words", [
    (_with_prefix(GPU_SPEC, {"mode": "precise", "kvEvents": {"port": 8000}}), "spec.routing.prefix.kvEvents.port",
     "taken by engine.port or sidecar.port"),
    ({**_with_prefix(GPU_SPEC, {"mode": "precise"}), "sidecar": {"port": 5557}}, "spec.routing.prefix.kvEvents.port",
     "port 5557"),
    ({**_with_prefix(GPU_SPEC, {"mode": "precise"}),
      "engine": {**GPU_SPEC["engine"], "args": ["--kv-events-config", "{}"]}}, "spec.engine.args",
     "enable_kv_cache_events must be true"),
    ({**_with_prefix(GROUPS_SPEC, {"mode": "precise"}),
      "engineGroups": [{**GROUPS_SPEC["engineGroups"][0], "args": ["--kv-events-config={}"]}]},
     "spec.engineGroups[0].args", "enable_kv_cache_events must be true"),
], ids=["kv-port-is-engine-port", "kv-default-is-sidecar-port", "own-kv-events-config", "group-kv-events-config"])
def test_precise_prefix_checks_name_the_field(spec, field, words):
    with pytest.raises(SpecError) as e:
        check_pool(parse_pool_spec(spec))
    assert e.value.field == field and words in e.value.message
    # Without precise these are fine: nothing publishes KV events.
    check_pool(parse_pool_spec(_with_prefix(spec, {"mode": "approximate", "kvEvents": {"port": 8000}})))


def _gpu_args(args: list[str], prefix: dict | None = None) -> dict:
    s = _with_prefix(GPU_SPEC, prefix)
    s["engine"] = {**s["engine"], "args": args}
    return s


def test_flag_uses_reads_every_spelling_vllms_parser_does():
    from phasewise_operator.spec import flag_uses

    args = ["--kv-events-config", "{}", "--kv_events_config={}", "--kv-events-config.topic", "t",
            "--kv_events_config.endpoint=tcp://*:1", "--no-kv-events-config", "--kv-events-configs", "x",
            "--kv-events", "--max-model-len", "--kv-events-config"]
    assert flag_uses(args, "--kv-events-config") == [(0, "bare"), (2, "inline"), (3, "dotted"), (5, "dotted"),
                                                     (6, "negated"), (11, "bare")]
    # A value is not a flag, whatever it contains.
    assert flag_uses(["--chat-template", "x --port 1"], "--port") == []
    assert flag_uses(["--no_enable_prompt_tokens_details"], "--enable-prompt-tokens-details") == [(0, "negated")]


@pytest.mark.parametrize("args, words", [
    (["--kv-events-config", '{"enable_kv_cache_events":true,"endpoint":"tcp://*:5600"}'],
     "endpoint 'tcp://*:5600' must be 'tcp://*:5557'"),
    # 0.0.0.0 has no wildcard: vLLM's publisher would connect instead of binding.
    (["--kv-events-config", '{"enable_kv_cache_events":true,"endpoint":"tcp://0.0.0.0:5557"}'],
     "endpoint 'tcp://0.0.0.0:5557' must be 'tcp://*:5557'"),
    (["--kv-events-config", '{"enable_kv_cache_events":true,"topic":"kv"}'], "topic 'kv' must be ''"),
    (["--kv-events-config", '{"enable_kv_cache_events":true,"publisher":"null"}'], "publisher must be zmq"),
    (["--kv_events_config", '{"enable_kv_cache_events":false}'], "enable_kv_cache_events must be true"),
    (["--kv-events-config", "nope"], "--kv-events-config needs a JSON object, got 'nope'"),
    (["--kv-events-config"], "--kv-events-config needs a JSON object, got None"),
    (["--kv-events-config", "[]"], "needs a JSON object"),
    # Dotted keys replace the whole JSON value in vLLM's parser (events would be off): refused.
    (["--kv-events-config.topic", ""], "give --kv-events-config once, as one JSON object"),
    (["--kv-events-config", '{"enable_kv_cache_events":true}', "--kv-events-config.hwm", "10"],
     "give --kv-events-config once"),
    (["--kv-events-config={}", "--kv-events-config={}"], "give --kv-events-config once"),
], ids=["other-port", "connects", "topic", "publisher", "events-off", "not-json", "no-value", "json-list", "dotted",
        "json-and-dotted", "twice"])
def test_own_kv_events_config_must_agree_with_routerd(args, words):
    with pytest.raises(SpecError) as e:
        check_pool(parse_pool_spec(_gpu_args(args, {"mode": "precise"})))
    assert e.value.field == "spec.engine.args" and words in e.value.message, e.value.message
    assert '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","topic":""}' in e.value.message


def test_own_kv_events_config_that_agrees_replaces_the_operators():
    own = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5600", "topic": "kv", "hwm": 5000}'
    for args in (["--kv-events-config", own], [f"--kv-events-config={own}"], ["--kv_events_config", own]):
        kids = _children(_gpu_args(args, PRECISE))
        vllm = _container(kids[("Deployment", "chat-engine")], "vllm")
        assert vllm["args"] == ["meta-llama/Llama-2-7b-hf", "--served-model-name", "llama-2-7b", "--host", "0.0.0.0",
                                "--port", "8000", *args, "--enable-prompt-tokens-details"]
        # The port is still named, listed on the Service, and told to routerd.
        assert vllm["ports"][1] == {"name": "kv-events", "containerPort": 5600, "protocol": "TCP"}
        assert kids[("Service", "chat-engine")]["spec"]["ports"][2]["port"] == 5600
    # Outside precise mode a user's --kv-events-config is theirs, unchecked and alone.
    kids = _children(_gpu_args(["--kv-events-config", "{}"], {"mode": "approximate"}))
    vllm = _container(kids[("Deployment", "chat-engine")], "vllm")
    assert vllm["args"][7:] == ["--kv-events-config", "{}", "--enable-prompt-tokens-details"]
    assert [p["name"] for p in vllm["ports"]] == ["http"]


@pytest.mark.parametrize("args", [["--enable-prompt-tokens-details"], ["--enable_prompt_tokens_details"],
                                  ["--no-enable-prompt-tokens-details"]])
def test_own_prompt_tokens_details_flag_is_not_doubled(args):
    vllm = _container(_children(_gpu_args(["--max-model-len", "4096", *args]))[("Deployment", "chat-engine")], "vllm")
    # The user's spelling stays, the operator adds none ("--no-" turns the counts off: the user's call).
    assert vllm["args"][7:] == ["--max-model-len", "4096", *args]


def test_the_operator_never_pins_a_block_size():
    for prefix in (None, {"mode": "off"}, {"mode": "approximate"}, {"mode": "precise"},
                   {"mode": "precise", "kvEvents": {"port": 5600, "topic": "kv"}}):
        kids = _children(_with_prefix(GPU_SPEC, prefix))
        vllm = _container(kids[("Deployment", "chat-engine")], "vllm")
        assert not any(a.replace("_", "-").startswith("--block-size") for a in vllm["args"]), prefix
        assert "block_size" not in (_settings_dict(_with_prefix(GPU_SPEC, prefix)).get("prefix") or {}), prefix
    # The user's own --block-size is passed on as given.
    vllm = _container(_children(_gpu_args(["--block-size", "32"]))[("Deployment", "chat-engine")], "vllm")
    assert vllm["args"][7:] == ["--block-size", "32", "--enable-prompt-tokens-details"]


@pytest.mark.parametrize("where, args, field, source", [
    ("engine", ["--port", "9000"], "spec.engine.args", "--port is set by the operator from spec.engine.port"),
    ("engine", ["--served-model-name=x"], "spec.engine.args",
     "--served-model-name is set by the operator from spec.model.servedModelName"),
    ("engine", ["--model", "m"], "spec.engine.args", "--model is set by the operator from spec.model.name"),
    ("group", ["--served_model_name", "x"], "spec.engineGroups[0].args",
     "--served-model-name is set by the operator from spec.engineGroups[0].model.servedModelName"),
], ids=["port", "served-name", "model", "group-served-name"])
def test_flags_from_spec_fields_are_refused_in_args(where, args, field, source):
    if where == "engine":
        spec = _gpu_args(args)
    else:
        spec = copy.deepcopy(GROUPS_SPEC)
        spec["engineGroups"][0]["args"] = args
    with pytest.raises(SpecError) as e:
        check_pool(parse_pool_spec(spec))
    assert e.value.field == field and source in e.value.message, e.value.message


@needs_routerd_prefix
def test_prefix_settings_are_what_routerd_accepts(tmp_path):
    s = _settings_from_configmap(_children(_with_prefix(GPU_SPEC, PRECISE))[("ConfigMap", "chat-routerd")], tmp_path)
    p = s.prefix
    assert (p.mode, p.block_size, p.chunk_blocks, p.max_prompt_tokens) == ("precise", 16, 4, 8192)
    assert (p.index_capacity_blocks, p.tokenizer) == (100000, "/models/tokenizer.json")
    assert (p.kv_events.port, p.kv_events.topic, p.kv_events.stale_after_s, p.kv_events.max_blocks) == \
        (5600, "kv", 5.0, 500000)
    assert s.kubernetes.kv_events_port_name == "kv-events"
    for prefix in ({"mode": "off"}, {"mode": "approximate", "blockSize": 16}):
        cm = _children(_with_prefix(GPU_SPEC, prefix))[("ConfigMap", "chat-routerd")]
        assert _settings_from_configmap(cm, tmp_path).prefix.mode == prefix["mode"]


@needs_routerd_prefix
def test_endpointslices_carry_the_kv_events_port_routerd_looks_for():
    from routerd.daemon.endpointslices import endpoints_from_slices

    svc = _children(_with_prefix(GPU_SPEC, {"mode": "precise"}))[("Service", "chat-engine")]
    slice_ = {"addressType": "IPv4", "metadata": {"name": "chat-engine-x"},
              "ports": [{"name": p["name"], "port": p["port"]} for p in svc["spec"]["ports"]],
              "endpoints": [{"addresses": ["10.1.2.3"], "targetRef": {"name": "chat-engine-0"},
                             "conditions": {"ready": True}}]}
    (ep,) = endpoints_from_slices([slice_])
    assert (ep.url, ep.state_address, ep.kv_events) == ("http://10.1.2.3:8000", "10.1.2.3:50051",
                                                        "tcp://10.1.2.3:5557")


@needs_emulator_kv_events
def test_emulator_precise_args_parse_with_phasewise_emulate(tmp_path):
    import argparse

    from routerd.emulator.cli import add_parser, settings_from_args

    kids = _children(_with_prefix(EMU_SPEC, {"mode": "precise", "kvEvents": {"port": 5600, "topic": "kv"}}))
    emu = _container(kids[("Deployment", "chat-engine")], "emulator")
    prof = tmp_path / "profile.yaml"
    prof.write_text(kids[("ConfigMap", "chat-routerd")]["data"]["profile.yaml"])
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["emulate", *[str(prof) if a == B.PROFILE_FILE else a for a in emu["args"]]])
    s = settings_from_args(args, environ={})
    assert s.port == 8000 and s.model == "m"


# ---------------------------------------------------------------- engine groups with their own profile (mixed GPUs)

MIXED_SPEC = {"emulated": True, "engine": {"replicas": 2}, "hardwareProfile": {"name": "llama3.1-8b-h100"},
              "engineGroups": [
                  {"name": "h100", "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}},
                  {"name": "a100", "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}, "replicas": 1,
                   "hardwareProfile": {"name": "llama3.1-8b-a100"}},
                  {"name": "slow", "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}, "replicas": 1,
                   "hardwareProfile": {"inline": {"basedOn": "llama3.1-8b-a100", "grad1": 0.0002,
                                                  "grad2": 0.00002, "overheadS": 0.02,
                                                  "kvCapacityTokens": 262144}}}]}


def _slices_of(svc: dict, pods: list[tuple[str, str]]) -> dict:
    """The EndpointSlice the API server's controller makes for ``svc``: its labels copied, plus
    ``kubernetes.io/service-name`` (k8s.io/endpointslice, setEndpointSliceLabels)."""
    name = svc["metadata"]["name"]
    return {"metadata": {"name": f"{name}-x7k2p", "labels": {**svc["metadata"]["labels"],
                                                            "kubernetes.io/service-name": name}},
            "addressType": "IPv4",
            "ports": [{"name": p["name"], "port": p["port"]} for p in svc["spec"]["ports"]],
            "endpoints": [{"addresses": [ip], "targetRef": {"kind": "Pod", "name": pod},
                           "conditions": {"ready": True}} for pod, ip in pods]}


def test_groups_with_their_own_profile_get_a_service_each_and_routerd_each_endpoints_profile(tmp_path):
    from routerd.daemon.endpointslices import endpoints_from_slices
    from routerd.profiles import get_profile

    kids = _children(MIXED_SPEC)
    svcs = {g: kids[("Service", f"chat-engine-{g}")] for g in ("h100", "a100", "slow")}
    main = kids[("Service", "chat-engine")]
    for g, svc in svcs.items():
        labels = svc["metadata"]["labels"]
        assert labels["phasewise.io/engine-group"] == g and labels["app.kubernetes.io/component"] == "engine-group"
        assert svc["spec"]["selector"] == kids[("Deployment", f"chat-engine-{g}")]["spec"]["selector"]["matchLabels"]
        assert svc["spec"]["ports"] == main["spec"]["ports"] and svc["spec"]["clusterIP"] == "None"
        assert svc["metadata"]["ownerReferences"][0]["uid"] == POOL.uid
    cm = kids[("ConfigMap", "chat-routerd")]
    assert sorted(cm["data"]) == ["profile-a100.yaml", "profile-slow.yaml", "profile.yaml", "routerd.yaml"]
    # The emulators run at their group's profile, from the file mounted beside the pool's.
    for g, want in (("h100", "/etc/phasewise/profile.yaml"), ("a100", "/etc/phasewise/profile-a100.yaml"),
                    ("slow", "/etc/phasewise/profile-slow.yaml")):
        dep = kids[("Deployment", f"chat-engine-{g}")]
        args = _container(dep, "emulator")["args"]
        assert args[args.index("--profile") + 1] == want
        items = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")["configMap"]["items"]
        assert want.rsplit("/", 1)[1] in [i["path"] for i in items]
    router_items = next(v for v in kids[("Deployment", "chat-routerd")]["spec"]["template"]["spec"]["volumes"]
                        if v["name"] == "config")["configMap"]["items"]
    assert {"profile-a100.yaml", "profile-slow.yaml"} <= {i["path"] for i in router_items}

    # routerd: the files as the pod sees them (here under tmp_path), its settings accepted with them...
    for key, text in cm["data"].items():
        (tmp_path / key).write_text(text)
    text = cm["data"]["routerd.yaml"].replace("/etc/phasewise/", f"{tmp_path}/")
    (tmp_path / "routerd.yaml").write_text(text)
    from routerd.daemon.config import load_settings

    s = load_settings(tmp_path / "routerd.yaml", environ={})
    k = s.kubernetes
    assert k.selector == "phasewise.io/pool=chat,app.kubernetes.io/component=engine-group"
    assert k.profile_label == "phasewise.io/engine-group"
    assert k.profiles == {"a100": f"{tmp_path}/profile-a100.yaml", "slow": f"{tmp_path}/profile-slow.yaml"}
    # ...the selector picks exactly the group Services' slices (not the main one's)...
    want = dict(kv.split("=") for kv in k.selector.split(","))
    slices = [_slices_of(svcs["h100"], [("h100-0", "10.0.0.1"), ("h100-1", "10.0.0.2")]),
              _slices_of(svcs["a100"], [("a100-0", "10.0.0.3")]),
              _slices_of(svcs["slow"], [("slow-0", "10.0.0.4")]),
              _slices_of(main, [(p, ip) for p, ip in (("h100-0", "10.0.0.1"), ("a100-0", "10.0.0.3"))])]
    picked = [sl for sl in slices if all(sl["metadata"]["labels"].get(a) == b for a, b in want.items())]
    assert len(picked) == 3
    # ...and each endpoint gets its group's profile (the h100 group: routerd's own).
    eps = {e.name: e.profile for e in endpoints_from_slices(picked, profile_label=k.profile_label, profiles=k.profiles)}
    assert eps == {"h100-0": None, "h100-1": None, "a100-0": k.profiles["a100"], "slow-0": k.profiles["slow"]}
    assert get_profile(eps["a100-0"]).model_dump() == get_profile("llama3.1-8b-a100").model_dump()
    slow = get_profile(eps["slow-0"])
    assert (slow.kv_capacity_tokens, slow.overhead_s) == (262144, 0.02)
    assert slow.block_size == get_profile("llama3.1-8b-a100").block_size


def test_an_unset_policy_is_predicted_latency_on_a_mixed_gpu_pool_and_late_binding_otherwise():
    def policy_of(spec: dict) -> dict:
        cm = _children(spec)[("ConfigMap", "chat-routerd")]
        return yaml.safe_load(cm["data"]["routerd.yaml"])["policy"]

    # Groups of one model on H100, A100 and a slower inline A100: priced per instance by default.
    assert parse_pool_spec(MIXED_SPEC).routing_policy() == "predicted_latency"
    assert policy_of(MIXED_SPEC) == {"name": "predicted_latency", "params": {}}
    # A group naming the pool's own profile is not a mixed pool; neither are groups without one.
    same = copy.deepcopy(MIXED_SPEC)
    for g in same["engineGroups"][1:]:
        g["hardwareProfile"] = {"name": "llama3.1-8b-h100"}
    assert policy_of(same)["name"] == "late_binding"
    assert policy_of({**GROUPS_SPEC, "routing": {}})["name"] == "late_binding"
    # A policy the pool names is kept, and the params of an unset one are checked against the default's.
    named = copy.deepcopy(MIXED_SPEC)
    named["routing"] = {"policy": "late_binding", "params": {"max_waiting": 2}}
    assert policy_of(named) == {"name": "late_binding", "params": {"max_waiting": 2}}
    named["routing"] = {"params": {"max_waiting": 2}}
    with pytest.raises(SpecError) as e:
        check_pool(parse_pool_spec(named))
    assert e.value.field == "spec.routing.params.max_waiting"
    assert "policy predicted_latency, the default for a mixed-GPU pool, takes" in str(e.value)
    # ...unless a group's profile is what is wrong: that decides the default, so it is the error.
    named["engineGroups"][1]["hardwareProfile"] = {"name": "llama2-7b-v100"}
    with pytest.raises(SpecError) as e:
        check_pool(parse_pool_spec(named))
    assert e.value.field == "spec.engineGroups[1].hardwareProfile"


def test_mixed_means_terms_that_differ_counting_the_pools_own_profile():
    from routerd.profiles import get_profile

    h100 = get_profile("llama3.1-8b-h100")
    copy_of_h100 = {"inline": {"basedOn": "llama3.1-8b-h100", "grad1": h100.grad1, "grad2": h100.grad2,
                               "overheadS": h100.overhead_s, "kvCapacityTokens": h100.kv_capacity_tokens,
                               "description": "the H100 terms, written out"}}
    spec = copy.deepcopy(MIXED_SPEC)
    spec["engineGroups"] = spec["engineGroups"][:2]
    spec["engineGroups"][1]["hardwareProfile"] = copy_of_h100
    assert parse_pool_spec(spec).routing_policy() == "late_binding"  # same terms, another name
    spec["engineGroups"][1]["hardwareProfile"]["inline"]["kvCapacityTokens"] = h100.kv_capacity_tokens // 32 * 16
    assert parse_pool_spec(spec).routing_policy() == "predicted_latency"
    # Every group on A100 in an H100 pool: the blind policies would read the H100's limits for all.
    for g in spec["engineGroups"]:
        g["hardwareProfile"] = {"name": "llama3.1-8b-a100"}
    assert parse_pool_spec(spec).routing_policy() == "predicted_latency"
    spec["hardwareProfile"] = {"name": "llama3.1-8b-a100"}
    assert parse_pool_spec(spec).routing_policy() == "late_binding"


def test_a_group_profile_of_another_model_is_refused_naming_the_group():
    bad = copy.deepcopy(MIXED_SPEC)
    bad["engineGroups"][1]["hardwareProfile"] = {"name": "llama2-7b-v100"}
    with pytest.raises(SpecError) as e:
        check_pool(parse_pool_spec(bad))
    assert e.value.field == "spec.engineGroups[1].hardwareProfile"
    assert "different models" in str(e.value)
    bad["engineGroups"][1]["hardwareProfile"] = {"inline": {"basedOn": "llama3.1-8b-a100", "grad1": 1, "grad2": 1,
                                                            "overheadS": 0, "kvCapacityTokens": 100}}
    with pytest.raises(SpecError) as e:
        _children(bad)
    assert e.value.field.startswith("spec.engineGroups[1].hardwareProfile.inline")


def test_group_services_whatever_the_profiles_none_for_one_model_and_stale_ones_are_named():
    # Groups without their own profile keep their Services (giving one a profile, or taking it
    # away, changes only routerd's settings); a single-model pool renders as before.
    kids = _children(GROUPS_SPEC)
    assert sorted(k[1] for k in kids if k[0] == "Service" and k[1].startswith("chat-engine-")) == [
        "chat-engine-code", "chat-engine-llama", "chat-engine-llama-h100"]
    k = yaml.safe_load(kids[("ConfigMap", "chat-routerd")]["data"]["routerd.yaml"])["kubernetes"]
    assert k["selector"] == "phasewise.io/pool=chat,app.kubernetes.io/component=engine-group"
    assert k["profiles"] == {} and "profile-llama.yaml" not in kids[("ConfigMap", "chat-routerd")]["data"]
    single = _children(GPU_SPEC)
    assert not [n for kind, n in single if kind == "Service" and n.startswith("chat-engine-")]
    k = yaml.safe_load(single[("ConfigMap", "chat-routerd")]["data"]["routerd.yaml"])["kubernetes"]
    assert "selector" not in k and "profiles" not in k and k["service"] == "chat-engine"

    def svc(name, uid=POOL.uid, component="engine-group"):
        return {"metadata": {"name": name, "labels": {"app.kubernetes.io/component": component},
                             "ownerReferences": [{"controller": True, "uid": uid}]}}

    observed = [svc("chat-engine-a100"), svc("chat-engine-gone"), svc("chat-engine-other", uid="x"),
                svc("chat-engine", component="engine")]
    assert B.stale_group_services(POOL, parse_pool_spec(MIXED_SPEC), observed) == ["chat-engine-gone"]
    assert B.stale_group_services(POOL, parse_pool_spec(GROUPS_SPEC), observed) == ["chat-engine-a100",
                                                                                    "chat-engine-gone"]
    assert B.stale_group_services(POOL, parse_pool_spec(GPU_SPEC), observed) == ["chat-engine-a100",
                                                                                 "chat-engine-gone"]


def test_a_group_service_name_over_63_characters_is_refused_naming_the_group():
    long_pool = B.PoolRef(name="p" * 50, namespace="llm", uid=POOL.uid, generation=1)
    ps = parse_pool_spec(EMU_GROUPS_SPEC)
    B.pool_children(long_pool, ps, OPS)  # p*50-engine-a: 59 characters
    spec = copy.deepcopy(EMU_GROUPS_SPEC)
    spec["engineGroups"][1]["name"] = "b" * 10  # 50 + 8 + 10 = 68
    with pytest.raises(SpecError) as e:
        B.pool_children(long_pool, parse_pool_spec(spec), OPS)
    assert e.value.field == "spec.engineGroups[1].name" and "68 characters" in str(e.value)
