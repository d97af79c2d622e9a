"""spec.gateway against a real kube-apiserver with the Gateway API Inference Extension's own InferencePool CRD.

The InferencePool CRD is GIE's file from its Go module (tools/k8s/build.sh copies it into the
binaries' cache). There is no gateway here: the tests write an InferencePool's status.parents
themselves, as a gateway controller would, and check what the pool's status makes of it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "operator"))

from k8s.harness import ControlPlane, inferencepool_crd  # noqa: E402
from k8s.test_operator_api import (CRDS, G, apply, condition, crds, kube, make_pods_ready, pool,  # noqa: E402,F401
                                   running_operator, wait_for)
from phasewise_operator.kube import Kube  # noqa: E402

IP = "inference.networking.k8s.io/v1"


@pytest.fixture(scope="module")
def gw_operator(k8s, crds, inferencepool_crd_installed):  # noqa: F811
    """The operator, started after the InferencePool CRD exists (so kopf watches InferencePools)."""
    with running_operator(k8s) as op:
        yield op


def gateway_pool(name: str, gateway: dict | None, **spec) -> str:
    body = {"apiVersion": G, "kind": "LLMRouterPool", "metadata": {"name": name},
            "spec": {"model": {"name": "llama-3.1-8b"}, "emulated": True, "engine": {"replicas": 2}, **spec}}
    if gateway is not None:
        body["spec"]["gateway"] = gateway
    return yaml.safe_dump(body)


GATEWAY = {"inferencePool": {"enabled": True, "failureMode": "FailClose"},
           "picker": {"enabled": True, "podDisruptionBudget": {"maxUnavailable": 1},
                      "envoy": {"enabled": True, "port": 8081}}}


def _parent(name: str, ns: str, resolved: tuple[str, str, str]) -> dict:
    now = "2026-12-02T10:00:00Z"
    return {"parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": ns, "name": name},
            "controllerName": "example.com/gateway-controller",
            "conditions": [
                {"type": "Accepted", "status": "True", "reason": "Accepted", "message": "", "lastTransitionTime": now,
                 "observedGeneration": 1},
                {"type": "ResolvedRefs", "status": resolved[0], "reason": resolved[1], "message": resolved[2],
                 "lastTransitionTime": now, "observedGeneration": 1}]}


def test_gateway_pool_gets_its_inference_pool_picker_and_parents_status(k8s, kube, gw_operator,  # noqa: F811
                                                                        namespace):
    pytest.importorskip("routerd.epp.envoy_config", reason="standalone mode renders routerd's Envoy bootstrap")
    ns = namespace
    apply(k8s, ns, gateway_pool("chat", GATEWAY))
    ip = wait_for(lambda: kube.get(IP, "InferencePool", ns, "chat"), timeout=30, what="InferencePool created")
    p = pool(kube, ns, "chat")
    assert ip["metadata"]["ownerReferences"] == [{"apiVersion": G, "kind": "LLMRouterPool", "name": "chat",
                                                  "uid": p["metadata"]["uid"], "controller": True,
                                                  "blockOwnerDeletion": True}]
    assert ip["metadata"]["labels"]["phasewise.io/pool"] == "chat"
    assert ip["spec"]["selector"] == {"matchLabels": {"phasewise.io/pool": "chat",
                                                      "app.kubernetes.io/component": "engine"}}
    assert ip["spec"]["targetPorts"] == [{"number": 8000}]
    assert ip["spec"]["appProtocol"] == "http"
    assert ip["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": "chat-epp",
                                               "port": {"number": 9002}, "failureMode": "FailClose"}
    engine = kube.get("apps/v1", "Deployment", ns, "chat-engine")
    assert ip["spec"]["selector"]["matchLabels"].items() <= \
        engine["spec"]["template"]["metadata"]["labels"].items()

    # The picker: its Deployment, Service, Envoy ConfigMap, budget, and routerd's ConfigMap with epp.
    dep = kube.get("apps/v1", "Deployment", ns, "chat-epp")
    containers = {c["name"]: c for c in dep["spec"]["template"]["spec"]["containers"]}
    assert sorted(containers) == ["envoy", "epp"]
    assert containers["epp"]["command"] == ["phasewise", "epp"]
    assert containers["epp"]["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert containers["epp"]["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    assert containers["envoy"]["image"] == "envoyproxy/envoy:v1.40.0"
    svc = kube.get("v1", "Service", ns, "chat-epp")
    assert {(pt["name"], pt["port"], pt.get("appProtocol")) for pt in svc["spec"]["ports"]} == {
        ("grpc-ext-proc", 9002, "kubernetes.io/h2c"), ("grpc-health", 9003, "kubernetes.io/h2c"),
        ("metrics", 9090, "http"), ("http", 8081, "http")}
    envoy_cm = kube.get("v1", "ConfigMap", ns, "chat-epp-envoy")
    boot = yaml.safe_load(envoy_cm["data"]["envoy.yaml"])
    assert "static_resources" in boot and "127.0.0.1" in envoy_cm["data"]["envoy.yaml"]
    routerd_yaml = yaml.safe_load(kube.get("v1", "ConfigMap", ns, "chat-routerd")["data"]["routerd.yaml"])
    assert routerd_yaml["epp"]["port"] == 9002 and routerd_yaml["epp"]["mode"] == "full-duplex"
    pdb = kube.get("policy/v1", "PodDisruptionBudget", ns, "chat-epp")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"] == dep["spec"]["selector"]

    # No pod is ready and no gateway lists the InferencePool yet: both conditions say so.
    def cond(ctype, reason):
        c = condition(pool(kube, ns, "chat"), ctype)
        return c if c is not None and c["reason"] == reason else None

    ready = wait_for(lambda: cond("InferencePoolReady", "NoReadyEndpoints"), timeout=30,
                     what="InferencePoolReady NoReadyEndpoints")
    assert "phasewise.io/pool=chat,app.kubernetes.io/component=engine matches no ready pod" in ready["message"]
    assert wait_for(lambda: cond("GatewayAccepted", "NoParents"), timeout=30, what="GatewayAccepted NoParents")

    # A gateway reports that it cannot resolve the picker: the pool shows the parent's reason and message.
    parents = [_parent("inference-gateway", ns, ("False", "InvalidExtensionRef", "Service chat-epp has no port 9002"))]
    kube.merge_patch(IP, "InferencePool", ns, "chat", {"status": {"parents": parents}}, subresource="status")
    bad = wait_for(lambda: cond("GatewayAccepted", "InvalidExtensionRef"), timeout=30,
                   what="GatewayAccepted from the parent's ResolvedRefs")
    assert bad["status"] == "False"
    assert bad["message"] == (f"Gateway {ns}/inference-gateway: ResolvedRefs is False (InvalidExtensionRef): "
                              "Service chat-epp has no port 9002")
    parents[0]["conditions"][1].update(status="True", reason="ResolvedRefs", message="")
    kube.merge_patch(IP, "InferencePool", ns, "chat", {"status": {"parents": parents}}, subresource="status")
    ok = wait_for(lambda: cond("GatewayAccepted", "Accepted"), timeout=30, what="GatewayAccepted True")
    assert ok["status"] == "True" and f"Gateway {ns}/inference-gateway" in ok["message"]

    if k8s.controller_manager:  # engine pods exist only with the ReplicaSet controller
        wait_for(lambda: len(kube.list("v1", "Pod", ns, label_selector="phasewise.io/pool=chat,"
                                       "app.kubernetes.io/component=engine")) == 2, timeout=30, what="2 engine pods")
        make_pods_ready(kube, ns, "phasewise.io/pool=chat,app.kubernetes.io/component=engine")
        # The EndpointSlice controller may publish the two pods in separate writes, so the condition
        # can pass through "1/1" on its way; wait for the state with both.
        up = wait_for(lambda: (c := cond("InferencePoolReady", "Ready")) is not None
                      and "2/2 ready endpoints on port 8000" in c["message"] and c,
                      timeout=30, what="InferencePoolReady with 2/2 ready endpoints")
        assert up["status"] == "True"

    # The section removed: the operator deletes what it made for it, and its conditions go.
    apply(k8s, ns, gateway_pool("chat", None))
    wait_for(lambda: kube.get(IP, "InferencePool", ns, "chat") is None, timeout=30, what="InferencePool deleted")
    for av, kind, name in (("apps/v1", "Deployment", "chat-epp"), ("v1", "Service", "chat-epp"),
                           ("v1", "ConfigMap", "chat-epp-envoy"), ("policy/v1", "PodDisruptionBudget", "chat-epp")):
        wait_for(lambda: kube.get(av, kind, ns, name) is None, timeout=30, what=f"{kind} {name} deleted")
    wait_for(lambda: condition(pool(kube, ns, "chat"), "GatewayAccepted") is None, timeout=30,
             what="gateway conditions gone")
    assert kube.get("apps/v1", "Deployment", ns, "chat-routerd") is not None


BAD_GATEWAYS = [
    ({"inferencePool": {"enabled": True}}, "spec.gateway.picker.enabled"),
    ({"picker": {"enabled": True, "envoy": {"enabled": True, "port": 9002}}}, "spec.gateway.picker.envoy.port"),
    ({"picker": {"enabled": True, "envoy": {"enabled": True, "port": 9901}}}, "spec.gateway.picker.envoy.port"),
    ({"picker": {"enabled": True, "mode": "efficient"}}, "spec.gateway.picker.mode"),
    ({"picker": {"envoy": {"enabled": True}}}, "spec.gateway.picker.envoy.enabled"),
    ({"picker": {"enabled": True}, "inferencePool": {"targetPortNumber": 50051}},
     "spec.gateway.inferencePool.targetPortNumber"),
    ({"inferencePool": {"failureMode": "FailSometimes"}}, "spec.gateway.inferencePool.failureMode"),
]


@pytest.mark.parametrize("gateway,field", BAD_GATEWAYS, ids=[f"{i}-{f}" for i, (_, f) in enumerate(BAD_GATEWAYS)])
def test_api_server_refuses_bad_gateway_specs_naming_the_field(k8s, crds, namespace, gateway, field):  # noqa: F811
    r = apply(k8s, namespace, gateway_pool("bad", gateway), check=False)
    assert r.returncode != 0, r.stdout
    assert field in r.stderr, r.stderr


def test_without_the_inferencepool_crd_the_rest_is_reconciled_and_the_condition_says_why(tmp_path, monkeypatch):
    """A cluster without GIE's CRDs: the pool's other children are applied, a condition names the missing CRD,
    the operator does not crash; once the CRD is installed, the next reconcile creates the InferencePool."""
    pytest.importorskip("routerd.epp.envoy_config", reason="standalone mode renders routerd's Envoy bootstrap")
    from k8s.harness import bin_dir, missing_binaries

    if missing_binaries(bin_dir(), ("etcd", "kube-apiserver", "kubectl")):
        pytest.skip("needs etcd, kube-apiserver and kubectl (tools/k8s/build.sh)")
    monkeypatch.setenv("PHASEWISE_GATEWAY_CRD_RETRY_SECONDS", "2")
    cp = ControlPlane(bin_dir(), workdir=tmp_path / "cp")
    cp.start()
    try:
        for f in CRDS:
            cp.kubectl("apply", "--server-side", "-f", str(f))
        cp.kubectl("wait", "--for=condition=Established", "crd/llmrouterpools.phasewise.io", "--timeout=60s")
        cp.kubectl("create", "namespace", "gw")
        k = Kube(cp.api_client())
        try:
            with running_operator(cp) as op:
                apply(cp, "gw", gateway_pool("chat", GATEWAY))

                def missing():
                    c = condition(k.get(G, "LLMRouterPool", "gw", "chat"), "InferencePoolReady")
                    return c if c is not None and c["reason"] == "CRDNotInstalled" else None

                c = wait_for(missing, timeout=30, what="InferencePoolReady CRDNotInstalled")
                assert c["status"] == "False"
                assert "inferencepools.inference.networking.k8s.io" in c["message"]
                for av, kind, name in (("apps/v1", "Deployment", "chat-routerd"), ("apps/v1", "Deployment", "chat-engine"),
                                       ("apps/v1", "Deployment", "chat-epp"), ("v1", "Service", "chat-epp")):
                    assert k.get(av, kind, "gw", name) is not None, (kind, name)
                degraded = condition(k.get(G, "LLMRouterPool", "gw", "chat"), "Degraded")
                assert degraded["status"] == "False", degraded

                path = inferencepool_crd(cp.bin)
                if not path.is_file():
                    pytest.skip(f"{path} missing (tools/k8s/build.sh --crds)")
                cp.kubectl("apply", "--server-side", "-f", str(path))
                cp.kubectl("wait", "--for=condition=Established", "crd/inferencepools.inference.networking.k8s.io",
                           "--timeout=60s")
                # kopf retries the reconcile every PHASEWISE_GATEWAY_CRD_RETRY_SECONDS while the CRD is missing.
                ip = wait_for(lambda: k.get(IP, "InferencePool", "gw", "chat"), timeout=30,
                              what="InferencePool created once its CRD exists")
                assert ip["spec"]["endpointPickerRef"]["name"] == "chat-epp"
                wait_for(lambda: (condition(k.get(G, "LLMRouterPool", "gw", "chat"), "InferencePoolReady") or {})
                         .get("reason") == "NoReadyEndpoints", timeout=30, what="condition past CRDNotInstalled")
            out = "\n".join(op.outputs)
            assert "Traceback" not in out, out[-4000:]
        finally:
            k.close()
    finally:
        cp.stop()


def test_gpu_example_values_pass_the_api_server(k8s, crds, inferencepool_crd_installed, namespace,  # noqa: F811
                                                tmp_path):
    """charts/phasewise/examples/llama-3.1-8b-gpu.yaml: the pool `helm template` renders and every child the
    operator builds from it (GPU Deployments, budgets, picker, InferencePool) pass a server-side dry run."""
    from k8s.harness import bin_dir, missing_binaries

    if missing_binaries(bin_dir(), ("helm",)):
        if __import__("os").environ.get("PHASEWISE_K8S_REQUIRED"):
            pytest.fail("PHASEWISE_K8S_REQUIRED is set but helm is not built", pytrace=False)
        pytest.skip("helm not built (tools/k8s/build.sh)")
    pytest.importorskip("routerd.epp.envoy_config")
    from phasewise_operator import builders as B
    from phasewise_operator.settings import OperatorSettings
    from phasewise_operator.spec import check_pool, parse_pool_spec

    chart = REPO / "charts" / "phasewise"
    r = k8s.helm("template", "phasewise", str(chart), "--namespace", namespace, "-f",
                 str(chart / "examples" / "llama-3.1-8b-gpu.yaml"))
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    (pool_doc,) = [d for d in docs if d["kind"] == "LLMRouterPool"]
    created = k8s.kubectl("apply", "--server-side", "--dry-run=server", "-n", namespace, "-o", "yaml", "-f", "-",
                          input=yaml.safe_dump(pool_doc))
    stored = yaml.safe_load(created.stdout)
    assert stored["spec"]["gateway"]["inferencePool"]["failureMode"] == "FailClose"
    assert stored["spec"]["engine"]["resources"]["limits"]["nvidia.com/gpu"] == 1
    spec = parse_pool_spec(stored["spec"])  # with the API server's defaults filled in
    check_pool(spec)
    ref = B.PoolRef(pool_doc["metadata"]["name"], namespace, "00000000-0000-4000-8000-000000000001")
    children = B.pool_children(ref, spec, OperatorSettings())
    kinds = sorted({o["kind"] for o in children})
    assert kinds == ["ConfigMap", "Deployment", "InferencePool", "PodDisruptionBudget", "Role", "RoleBinding",
                     "Service", "ServiceAccount"]
    # The owner does not exist: a dry run checks the objects, not the garbage collector's reference.
    for obj in children:
        obj["metadata"].pop("ownerReferences")
    text = "\n---\n".join(yaml.safe_dump(o) for o in children)
    r = k8s.kubectl("apply", "--server-side", "--dry-run=server", "-n", namespace, "-f", "-", input=text,
                    check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("serverside-applied (server dry run)") == len(children), r.stdout
