"""The operator against a real kube-apiserver (+ kube-controller-manager when built).

The operator runs in-process (kopf's KopfRunner). There is no kubelet: where a test needs
running instances it plays the kubelet and marks the pods Running and Ready with an IP
(pods/status), so the ReplicaSet, Deployment and EndpointSlice controllers of the real
controller manager do the rest.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "operator"))

from phasewise_operator.kube import ApiError, Kube  # noqa: E402
from stack_processes import wait_until  # noqa: E402

CRDS = [REPO / "crds" / "llmrouterpools.yaml", REPO / "crds" / "llmrouterjobs.yaml"]
G = "phasewise.io/v1alpha1"

OPERATOR_ENV = {
    "PHASEWISE_JOB_POLL_SECONDS": "1",
    "PHASEWISE_RESYNC_SECONDS": "600",
    "PHASEWISE_JOB_POOL_GRACE_SECONDS": "3",
    "PHASEWISE_ROUTERD_IMAGE": "example/routerd:test",
    "PHASEWISE_OPERATOR_IMAGE": "example/operator:test",
}


def wait_for(pred, timeout=20.0, interval=0.1, what="condition"):
    """Poll ``pred()`` until it is truthy and return that value (``stack_processes.wait_until``):
    the operator, the controller manager and kopf write what these tests read asynchronously.

    Raises:
        AssertionError: not within ``timeout`` s; the message names ``what`` and the last value.
    """
    return wait_until(pred, bool, timeout, what, interval_s=interval)


@pytest.fixture(scope="module")
def crds(k8s):
    for f in CRDS:
        k8s.kubectl("apply", "--server-side", "-f", str(f))
    for f in CRDS:
        name = yaml.safe_load(f.read_text())["metadata"]["name"]
        k8s.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")
    return True


@pytest.fixture
def kube(k8s, crds):
    k = Kube(k8s.api_client())
    yield k
    k.close()


class Operator:
    """The operator in a KopfRunner thread; start() and stop() (a restart is both)."""

    def __init__(self, k8s):
        self.k8s = k8s
        self.runner = None
        self.outputs: list[str] = []

    def start(self):
        pytest.importorskip("kopf", reason="the operator needs the extra: pip install -e '.[operator]'")
        from kopf._cogs.helpers import aiohttpcaps
        from kopf.testing import KopfRunner

        # Issue 19's chance "unclosed socket" failures, two sockets to the API server per stop,
        # collected in a later test: a kopf request whose connection finishes opening after the
        # session closed is closed by aiohttp without being awaited (connector.py: "Connector is
        # closed"), and KopfRunner closes its loop at once on aiohttp >= 3.12.4, before the TLS
        # shutdown of that connection has run. KopfRunner's own remedy for older aiohttp (run the
        # loop 1 s more, aiohttp's documented graceful shutdown) lets it finish; a stop costs 1 s.
        aiohttpcaps.AIOHTTP_HAS_GRACEFUL_SHUTDOWN = False
        self.runner = KopfRunner(["run", "--all-namespaces", "--standalone", "-m", "phasewise_operator.handlers"],
                                 timeout=60)
        self.runner.__enter__()

    def stop(self):
        if self.runner is not None:
            self.runner.__exit__(None, None, None)
            self.outputs.append(self.runner.output)
            self.runner = None


@contextlib.contextmanager
def running_operator(k8s, forbidden=("Traceback",)):
    """The operator running with the test settings; afterwards its output must hold none of ``forbidden``."""
    saved = {k: os.environ.get(k) for k in [*OPERATOR_ENV, "KUBECONFIG"]}
    os.environ.update(OPERATOR_ENV, KUBECONFIG=str(k8s.kubeconfig))
    op = Operator(k8s)
    op.start()
    try:
        yield op
    finally:
        op.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        out = "\n".join(op.outputs)
        for needle in forbidden:
            assert needle not in out, out[-6000:]


@pytest.fixture(scope="module")
def operator(k8s, crds):
    with running_operator(k8s) as op:
        yield op


def pool_yaml(name: str, **spec) -> str:
    body = {"apiVersion": G, "kind": "LLMRouterPool", "metadata": {"name": name},
            "spec": {"model": {"name": "llama-2-7b"}, "emulated": True, **spec}}
    return yaml.safe_dump(body)


def apply(k8s, ns: str, text: str, check: bool = True):
    return k8s.kubectl("apply", "-n", ns, "-f", "-", input=text, check=check)


def pool(kube, ns, name):
    return kube.get(G, "LLMRouterPool", ns, name)


def condition(obj, ctype):
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == ctype:
            return c
    return None


def children(kube, ns, name):
    out = {}
    for av, kind in (("v1", "ConfigMap"), ("v1", "Service"), ("v1", "ServiceAccount"), ("apps/v1", "Deployment"),
                     ("rbac.authorization.k8s.io/v1", "Role"), ("rbac.authorization.k8s.io/v1", "RoleBinding")):
        for o in kube.list(av, kind, ns, label_selector=f"phasewise.io/pool={name}"):
            out[(kind, o["metadata"]["name"])] = o
    return out


FAKE_NODE = "fake-node"


def _ensure_node(kube) -> None:
    try:
        kube.request("POST", "/api/v1/nodes", body={"apiVersion": "v1", "kind": "Node",
                                                    "metadata": {"name": FAKE_NODE}})
    except ApiError as e:
        if e.status != 409:
            raise


def make_pods_ready(kube, ns: str, selector: str, base_ip: str = "10.244.0.") -> list[str]:
    """Play the scheduler and the kubelet: every pod of ``selector`` is bound to a node, then Running and
    Ready with an IP (the EndpointSlice controller skips pods without an existing node)."""
    _ensure_node(kube)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    names = []
    for i, p in enumerate(kube.list("v1", "Pod", ns, label_selector=selector)):
        name = p["metadata"]["name"]
        names.append(name)
        if (p.get("status") or {}).get("phase") == "Running":
            continue
        if not p["spec"].get("nodeName"):
            kube.request("POST", f"/api/v1/namespaces/{ns}/pods/{name}/binding", body={
                "apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
                "target": {"apiVersion": "v1", "kind": "Node", "name": FAKE_NODE}})
        ip = f"{base_ip}{10 + i}"
        status = {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "10.0.0.2",
                  "startTime": now, "conditions": [
                      {"type": t, "status": "True", "lastTransitionTime": now}
                      for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]}
        kube.merge_patch("v1", "Pod", ns, name, {"status": status}, subresource="status")
    return names


@pytest.fixture
def kcm(k8s):
    """Skip unless the control plane runs kube-controller-manager (Deployments, Jobs, GC, EndpointSlices)."""
    if not k8s.controller_manager:
        pytest.skip("needs kube-controller-manager (Deployment, Job, EndpointSlice controllers and GC)")


# ---------------------------------------------------------------- the API server's own validation

INVALID = [
    ("negative replicas", {"engine": {"replicas": -1}}, "spec.engine.replicas"),
    ("unknown policy", {"routing": {"policy": "fastest"}}, "spec.routing.policy"),
    ("oracle policy", {"routing": {"policy": "oracle"}}, "spec.routing.policy"),
    ("unknown profile", {"hardwareProfile": {"name": "h100-dream"}}, "spec.hardwareProfile.name"),
    ("emulated with a GPU", {"engine": {"resources": {"limits": {"nvidia.com/gpu": 1}}}}, "spec.engine.resources"),
    ("emulated with vLLM args", {"engine": {"args": ["--enforce-eager"]}}, "spec.engine.args"),
    ("name and inline profile", {"hardwareProfile": {"name": "llama2-7b-v100", "inline": {
        "grad1": 1e-4, "grad2": 1e-5, "overheadS": 0, "kvCapacityTokens": 4096}}}, "spec.hardwareProfile"),
    ("dqn without checkpoint", {"routing": {"policy": "dqn"}}, "spec.routing.checkpoint"),
    ("same ports", {"engine": {"port": 9000}, "sidecar": {"port": 9000}}, "spec.sidecar.port"),
    ("nodePort on ClusterIP", {"routerd": {"service": {"nodePort": 30001}}}, "spec.routerd.service.nodePort"),
    ("unknown predictor", {"predictor": {"name": "oracle-bucket"}}, "spec.predictor.name"),
    ("unknown prefix mode", {"routing": {"prefix": {"mode": "exact"}}}, "spec.routing.prefix.mode"),
    # CEL: the KV-events port (vLLM's 5557 when unset) may not be the engine's or the sidecar's.
    ("kv-events port is the engine port", {"routing": {"prefix": {"mode": "precise", "kvEvents": {"port": 8000}}}},
     "spec.routing.prefix.kvEvents.port"),
    ("default kv-events port is the sidecar port", {"routing": {"prefix": {"mode": "precise"}},
                                                     "sidecar": {"port": 5557}}, "spec.routing.prefix.kvEvents.port"),
]


@pytest.mark.parametrize("label,spec,field", INVALID, ids=[i[0] for i in INVALID])
def test_api_server_rejects_invalid_pools_naming_the_field(k8s, crds, namespace, label, spec, field):
    r = apply(k8s, namespace, pool_yaml("bad", **spec), check=False)
    assert r.returncode != 0, f"{label} was accepted"
    assert field in r.stderr, r.stderr


def test_api_server_rejects_long_names_and_job_edits(k8s, crds, namespace):
    r = apply(k8s, namespace, pool_yaml("p" * 56), check=False)
    assert r.returncode != 0 and "metadata.name" in r.stderr and "55" in r.stderr, r.stderr
    job = {"apiVersion": G, "kind": "LLMRouterJob", "metadata": {"name": "j"},
           "spec": {"poolRef": {"name": "nope"}, "task": "profile"}}
    apply(k8s, namespace, yaml.safe_dump(job))
    job["spec"]["task"] = "train"
    r = apply(k8s, namespace, yaml.safe_dump(job), check=False)
    assert r.returncode != 0 and "immutable" in r.stderr, r.stderr
    bad = {**job, "metadata": {"name": "j2"}, "spec": {"poolRef": {"name": "p"}, "task": "train",
                                                         "profile": {"args": []}}}
    r = apply(k8s, namespace, yaml.safe_dump(bad), check=False)
    assert r.returncode != 0 and "spec.profile" in r.stderr, r.stderr


def test_defaults_are_filled_in_by_the_api_server(k8s, crds, kube, namespace):
    apply(k8s, namespace, pool_yaml("d"))
    spec = pool(kube, namespace, "d")["spec"]
    assert spec["hardwareProfile"] == {"name": "llama2-7b-v100"}
    # No policy default: the operator picks one by the pool's shape (status.activePolicy).
    assert "policy" not in spec["routing"] and spec["engine"]["replicas"] == 1
    assert spec["routerd"]["service"] == {"type": "ClusterIP", "port": 80}
    assert spec["predictor"] == {"name": "default"}  # routerd's shipped length model
    apply(k8s, namespace, pool_yaml("off", predictor={"name": "none"}))
    assert pool(kube, namespace, "off")["spec"]["predictor"] == {"name": "none"}
    # No prefix defaults (routerd's apply); a precise pool on other ports passes the CEL rule.
    assert "prefix" not in spec["routing"]
    apply(k8s, namespace, pool_yaml("pre", routing={"prefix": {"mode": "precise", "kvEvents": {"port": 8000}}},
                                    engine={"port": 9000}))
    assert pool(kube, namespace, "pre")["spec"]["routing"]["prefix"] == {"mode": "precise", "kvEvents": {"port": 8000}}


# ---------------------------------------------------------------- the operator

def test_pool_gets_children_and_status(k8s, kube, operator, namespace):
    t0 = time.monotonic()
    apply(k8s, namespace, pool_yaml("chat", engine={"replicas": 2}))
    p = wait_for(lambda: (lambda o: o if (o.get("status") or {}).get("observedGeneration") == 1 else None)(
        pool(kube, namespace, "chat")), timeout=20, what="status.observedGeneration")
    elapsed = time.monotonic() - t0
    kids = children(kube, namespace, "chat")
    assert sorted(kids) == [
        ("ConfigMap", "chat-routerd"), ("Deployment", "chat-engine"), ("Deployment", "chat-routerd"),
        ("Role", "chat-routerd"), ("RoleBinding", "chat-routerd"), ("Service", "chat-engine"),
        ("Service", "chat-routerd"), ("ServiceAccount", "chat-routerd")]
    uid = p["metadata"]["uid"]
    for obj in kids.values():
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("LLMRouterPool", "chat", uid, True)
    st = p["status"]
    assert condition(p, "Degraded")["status"] == "False"
    assert st["activePolicy"] == "late_binding" and st["activeProfile"] == "llama2-7b-v100"
    assert st["servedModels"] == "llama-2-7b"
    assert st["selector"] == "phasewise.io/pool=chat,app.kubernetes.io/component=engine"
    assert st["routerURL"] == f"http://chat-routerd.{namespace}.svc"
    # The 2 s target is measured by benchmarks/operator_reconcile.py; the bound here is the wait's.
    print(f"\npool apply -> children and status in {elapsed:.2f} s", file=sys.__stderr__)
    assert not p["metadata"].get("finalizers")  # deletion is never blocked by the operator


def test_precise_prefix_pool_exposes_kv_events_and_drops_them_again(k8s, kube, operator, namespace):
    """The API server takes the kv-events container and Service ports (names and ports validated by it),
    and server-side apply removes them when the pool leaves precise mode."""
    apply(k8s, namespace, pool_yaml("px", routing={"prefix": {"mode": "precise", "kvEvents": {"port": 5600}}}))
    wait_for(lambda: (pool(kube, namespace, "px").get("status") or {}).get("observedGeneration") == 1,
             timeout=20, what="pool px's first status write")
    assert condition(pool(kube, namespace, "px"), "Degraded")["status"] == "False"
    svc = kube.get("v1", "Service", namespace, "px-engine")
    assert [(p["name"], p["port"]) for p in svc["spec"]["ports"]] == [("http", 8000), ("state", 50051),
                                                                       ("kv-events", 5600)]
    dep = kube.get("apps/v1", "Deployment", namespace, "px-engine")
    emu = dep["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "kv-events", "containerPort": 5600, "protocol": "TCP"} in emu["ports"]
    assert emu["args"][-2] == "--kv-events-config" and '"endpoint":"tcp://*:5600"' in emu["args"][-1]
    text = kube.get("v1", "ConfigMap", namespace, "px-routerd")["data"]["routerd.yaml"]
    settings = yaml.safe_load(text)
    assert settings["prefix"] == {"mode": "precise", "tokenizer": "bytes", "kv_events": {"port": 5600, "topic": ""}}
    assert settings["kubernetes"]["kv_events_port_name"] == "kv-events"
    k8s.kubectl("patch", "-n", namespace, "llmrouterpool/px", "--type=merge", "-p",
                json.dumps({"spec": {"routing": {"prefix": {"mode": "approximate"}}}}))
    # The operator applies the Service before the Deployment and the ConfigMap and writes the
    # status last: observedGeneration 2 is the point where all of them follow the patch.
    wait_for(lambda: (pool(kube, namespace, "px").get("status") or {}).get("observedGeneration") == 2,
             timeout=20, what="pool px's status for generation 2")
    assert [p["name"] for p in kube.get("v1", "Service", namespace, "px-engine")["spec"]["ports"]] \
        == ["http", "state"]
    dep = kube.get("apps/v1", "Deployment", namespace, "px-engine")
    emu = dep["spec"]["template"]["spec"]["containers"][0]
    assert [p["name"] for p in emu["ports"]] == ["http"] and "--kv-events-config" not in emu["args"]
    settings = yaml.safe_load(kube.get("v1", "ConfigMap", namespace, "px-routerd")["data"]["routerd.yaml"])
    # The merge patch kept kvEvents.port: passed on as given, the engines no longer publish.
    assert settings["prefix"] == {"mode": "approximate", "kv_events": {"port": 5600}}
    assert "kv_events_port_name" not in settings["kubernetes"]


def test_status_follows_the_instances(k8s, kube, operator, namespace, kcm):
    apply(k8s, namespace, pool_yaml("st", engine={"replicas": 2}))
    wait_for(lambda: len(kube.list("v1", "Pod", namespace, label_selector="phasewise.io/pool=st")) >= 3,
             timeout=60, what="3 pods from the Deployment controller")
    rs = kube.request("GET", f"/apis/apps/v1/namespaces/{namespace}/replicasets")["items"]
    assert len(rs) == 2, [r["metadata"]["name"] for r in rs]  # one per Deployment: no spurious rollout
    # The Deployment controller may create the pods before the operator has written the
    # pool's first status (issue 19): wait for the condition, then check what it says.
    ready = wait_for(lambda: condition(pool(kube, namespace, "st"), "Ready"), timeout=30,
                     what="the pool's Ready condition (the operator's first status write)")
    assert ready["status"] == "False", ready
    make_pods_ready(kube, namespace, "phasewise.io/pool=st")
    p = wait_for(lambda: (lambda o: o if (o.get("status") or {}).get("readyInstances") == 2
                          and (condition(o, "Ready") or {}).get("status") == "True" else None)(
        pool(kube, namespace, "st")), timeout=30, what="readyInstances 2 and Ready")
    assert condition(p, "Ready")["reason"] == "Ready"
    # readyInstances comes from the Deployment, endpoints from EndpointSlices, which the
    # endpointslice controller updates later: wait for both Pods to appear there.
    eps = wait_for(lambda: (lambda e: e if len(e) == 2 else None)(
        (pool(kube, namespace, "st").get("status") or {}).get("endpoints") or []),
        timeout=30, what="2 status.endpoints")
    assert len(eps) == 2 and all(e["url"].startswith("http://10.244.0.") and e["url"].endswith(":8000") for e in eps)
    assert all(e["stateAddress"].endswith(":50051") for e in eps)


def test_changes_follow_and_only_start_settings_restart_routerd(k8s, kube, operator, namespace, kcm):
    apply(k8s, namespace, pool_yaml("ch", engine={"replicas": 1}))
    wait_for(lambda: (pool(kube, namespace, "ch").get("status") or {}).get("observedGeneration") == 1,
             what="pool ch's first status write (status.observedGeneration 1)")
    dep0 = kube.get("apps/v1", "Deployment", namespace, "ch-routerd")
    cm0 = kube.get("v1", "ConfigMap", namespace, "ch-routerd")
    k8s.kubectl("scale", "-n", namespace, "llmrouterpool/ch", "--replicas=3")
    wait_for(lambda: kube.get("apps/v1", "Deployment", namespace, "ch-engine")["spec"]["replicas"] == 3,
             what="engine replicas 3 via the scale subresource")
    k8s.kubectl("patch", "-n", namespace, "llmrouterpool/ch", "--type=merge", "-p",
                json.dumps({"spec": {"routing": {"policy": "join_shortest_queue"},
                                     "hardwareProfile": {"name": "llama2-7b-a100"}}}))
    p = wait_for(lambda: (lambda o: o if o["status"].get("activePolicy") == "join_shortest_queue"
                          and o["status"]["observedGeneration"] == o["metadata"]["generation"] else None)(
        pool(kube, namespace, "ch")), what="policy applied")
    assert p["status"]["activeProfile"] == "llama2-7b-a100"
    cm1 = kube.get("v1", "ConfigMap", namespace, "ch-routerd")
    assert "name: join_shortest_queue" in cm1["data"]["routerd.yaml"]
    assert "profile: llama2-7b-a100" in cm1["data"]["routerd.yaml"]
    assert cm1["data"] != cm0["data"]
    dep1 = kube.get("apps/v1", "Deployment", namespace, "ch-routerd")
    assert dep1["spec"]["template"] == dep0["spec"]["template"]  # reloaded, not restarted
    assert dep1["metadata"]["generation"] == dep0["metadata"]["generation"]


def test_bad_content_is_degraded_not_a_crash_loop(k8s, kube, operator, namespace):
    apply(k8s, namespace, pool_yaml("deg", routing={"policy": "late_binding", "params": {"reserve_fraction": 5}}))
    p = wait_for(lambda: (lambda o: o if (condition(o, "Degraded") or {}).get("status") == "True" else None)(
        pool(kube, namespace, "deg")), what="Degraded")
    d = condition(p, "Degraded")
    assert d["reason"] == "InvalidSpec" and d["message"].startswith("spec.routing.params.reserve_fraction:")
    assert kube.get("apps/v1", "Deployment", namespace, "deg-engine") is None
    # The handler's own writes (status, kopf's bookkeeping) may land after the condition: take
    # the version once it stands still for as long as the check below watches it (a shorter
    # settle window could pass between two late writes), then check that nothing retries the
    # permanent error.
    def settled():
        a = pool(kube, namespace, "deg")["metadata"]["resourceVersion"]
        time.sleep(3.0)
        return a if pool(kube, namespace, "deg")["metadata"]["resourceVersion"] == a else None

    rv = wait_for(settled, timeout=60.0, what="the pool's resourceVersion unchanged for 3 s (its writes settled)")
    time.sleep(3)  # a permanent error is not retried: nothing rewrites the pool
    assert pool(kube, namespace, "deg")["metadata"]["resourceVersion"] == rv
    k8s.kubectl("patch", "-n", namespace, "llmrouterpool/deg", "--type=merge", "-p",
                '{"spec": {"routing": {"params": {"reserve_fraction": 0.1}}}}')
    wait_for(lambda: (condition(pool(kube, namespace, "deg"), "Degraded") or {}).get("status") == "False",
             what="Degraded cleared")
    assert kube.get("apps/v1", "Deployment", namespace, "deg-engine") is not None


def test_missing_checkpoint_is_degraded_until_it_appears(k8s, kube, operator, namespace):
    apply(k8s, namespace, pool_yaml("ck", engine={"replicas": 2},
                                    routing={"policy": "dqn", "checkpoint": {"configMap": "ck-weights"}}))
    p = wait_for(lambda: (lambda o: o if (condition(o, "Degraded") or {}).get("reason") == "CheckpointNotFound"
                          else None)(pool(kube, namespace, "ck")), what="CheckpointNotFound")
    assert "spec.routing.checkpoint.configMap" in condition(p, "Degraded")["message"]
    kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ck-weights", "namespace": namespace},
                 "binaryData": {"model.safetensors": base64.b64encode(b"w").decode()},
                 "data": {"metadata.json": json.dumps({"num_instances": 2})}})
    # the handler retries every 10 s until the ConfigMap exists
    p = wait_for(lambda: (lambda o: o if o["status"].get("activeCheckpoint") == "ck-weights" else None)(
        pool(kube, namespace, "ck")), timeout=25, what="checkpoint applied")
    cm = kube.get("v1", "ConfigMap", namespace, "ck-routerd")
    assert cm["binaryData"]["checkpoint-model.safetensors"] == base64.b64encode(b"w").decode()
    assert condition(p, "Degraded")["status"] == "False"


def test_delete_cascades(k8s, kube, operator, namespace, kcm):
    apply(k8s, namespace, pool_yaml("gone"))
    wait_for(lambda: len(children(kube, namespace, "gone")) == 8, what="children")
    k8s.kubectl("delete", "-n", namespace, "llmrouterpool/gone", "--wait=true", "--timeout=30s")
    wait_for(lambda: not children(kube, namespace, "gone"), timeout=30, what="garbage collection")


def groups_pool_yaml(name: str, groups: list[dict], **spec) -> str:
    """An emulated pool with ``spec.engineGroups`` (and no ``spec.model``)."""
    body = {"apiVersion": G, "kind": "LLMRouterPool", "metadata": {"name": name},
            "spec": {"engineGroups": groups, "emulated": True, **spec}}
    return yaml.safe_dump(body)


INVALID_GROUPS = [
    ("model and engineGroups", {"model": {"name": "m"}, "engineGroups": [{"name": "a", "model": {"name": "m"}}]},
     "spec.model (one model) or spec.engineGroups"),
    ("neither model nor engineGroups", {"emulated": True}, "spec.model (one model) or spec.engineGroups"),
    ("duplicate group", {"engineGroups": [{"name": "a", "model": {"name": "m"}},
                                          {"name": "a", "model": {"name": "n"}}]}, "spec.engineGroups[1]"),
    ("reserved group word", {"engineGroups": [{"name": "b-routerd", "model": {"name": "m"}}]},
     "spec.engineGroups[0].name"),
    ("emulated group with a GPU", {"engineGroups": [{"name": "a", "model": {"name": "m"},
                                                     "resources": {"limits": {"nvidia.com/gpu": 1}}}]},
     "spec.engineGroups"),
]


@pytest.mark.parametrize("label,spec,needle", INVALID_GROUPS, ids=[i[0] for i in INVALID_GROUPS])
def test_api_server_rejects_invalid_engine_groups(k8s, crds, namespace, label, spec, needle):
    body = {"apiVersion": G, "kind": "LLMRouterPool", "metadata": {"name": "bad"}, "spec": {"emulated": True, **spec}}
    r = apply(k8s, namespace, yaml.safe_dump(body), check=False)
    assert r.returncode != 0, f"{label} was accepted"
    assert needle in r.stderr, r.stderr


def _group_status(kube, ns, name):
    return {g["name"]: g for g in (pool(kube, ns, name).get("status") or {}).get("engineGroups") or []}


def test_engine_groups_get_a_deployment_each_and_a_removed_one_goes(k8s, kube, operator, namespace):
    groups = [{"name": "a", "model": {"name": "model-a"}, "replicas": 2},
              {"name": "b", "model": {"name": "org/model-b"}}]
    apply(k8s, namespace, groups_pool_yaml("mm", groups, engine={"replicas": 1}))
    wait_for(lambda: (pool(kube, namespace, "mm").get("status") or {}).get("observedGeneration") == 1,
             what="pool mm's first status write (status.observedGeneration 1)")
    kids = children(kube, namespace, "mm")
    assert sorted(k for k in kids if k[0] == "Deployment") == [
        ("Deployment", "mm-engine-a"), ("Deployment", "mm-engine-b"), ("Deployment", "mm-routerd")]
    a, b = kids[("Deployment", "mm-engine-a")], kids[("Deployment", "mm-engine-b")]
    assert (a["spec"]["replicas"], b["spec"]["replicas"]) == (2, 1)  # b: engine.replicas
    for dep, model in ((a, "model-a"), (b, "org/model-b")):
        emu = dep["spec"]["template"]["spec"]["containers"][0]
        assert emu["args"][emu["args"].index("--model") + 1] == model
    assert a["spec"]["selector"]["matchLabels"]["phasewise.io/engine-group"] == "a"
    cm = kids[("ConfigMap", "mm-routerd")]
    assert yaml.safe_load(cm["data"]["routerd.yaml"])["models"] == ["model-a", "org/model-b"]
    st = wait_for(lambda: (lambda g: g if set(g) == {"a", "b"} else None)(_group_status(kube, namespace, "mm")),
                  what="status.engineGroups listing groups a and b")
    assert [(st[g]["model"], st[g]["deployment"], st[g]["desiredReplicas"]) for g in ("a", "b")] == \
        [("model-a", "mm-engine-a", 2), ("org/model-b", "mm-engine-b", 1)]
    # kubectl get's MODEL column: the served names, engine groups or not (spec.model is unset here).
    assert pool(kube, namespace, "mm")["status"]["servedModels"] == "model-a,org/model-b"
    out = k8s.kubectl("get", "llmrouterpools", "mm", "-n", namespace, "--no-headers",
                      "-o", "custom-columns=M:.status.servedModels,P:.status.activePolicy").stdout.split()
    assert out == ["model-a,org/model-b", "late_binding"]
    table = k8s.kubectl("get", "llmrouterpools", "mm", "-n", namespace).stdout.splitlines()
    header = table[0].split()
    assert header[:3] == ["NAME", "MODEL", "POLICY"] and table[1].split()[1:3] == ["model-a,org/model-b", "late_binding"]
    if k8s.controller_manager:  # pods exist only with the Deployment controller
        wait_for(lambda: len(kube.list("v1", "Pod", namespace, label_selector="phasewise.io/pool=mm")) >= 4,
                 timeout=60, what="2 + 1 engine pods and a routerd pod from the Deployment controller")
        make_pods_ready(kube, namespace, "phasewise.io/pool=mm")
        p = wait_for(lambda: (lambda o: o if (condition(o, "Ready") or {}).get("status") == "True" else None)(
            pool(kube, namespace, "mm")), timeout=30, what="pool mm Ready with every group ready")
        assert p["status"]["readyInstances"] == 3
        assert {g["name"]: g["readyInstances"] for g in p["status"]["engineGroups"]} == {"a": 2, "b": 1}
    uid_a = a["metadata"]["uid"]
    apply(k8s, namespace, groups_pool_yaml("mm", groups[:1], engine={"replicas": 1}))
    wait_for(lambda: kube.get("apps/v1", "Deployment", namespace, "mm-engine-b") is None,
             what="group b's Deployment deleted after b left the spec")
    wait_for(lambda: set(_group_status(kube, namespace, "mm")) == {"a"}, what="status.engineGroups only a")
    assert kube.get("apps/v1", "Deployment", namespace, "mm-engine-a")["metadata"]["uid"] == uid_a  # kept
    cm = kube.get("v1", "ConfigMap", namespace, "mm-routerd")
    assert yaml.safe_load(cm["data"]["routerd.yaml"])["models"] == ["model-a"]
    wait_for(lambda: pool(kube, namespace, "mm")["status"].get("servedModels") == "model-a",
             what="status.servedModels without group b")


def test_groups_with_their_own_profile_reach_routerd_through_their_services_slices(
        k8s, kube, operator, namespace, kcm, k8s_client):
    # A mixed-GPU pool: group a on the pool's H100 profile, group b on A100. Each group gets a
    # Service; the EndpointSlice controller copies its labels onto the slices, and routerd's own
    # watcher, with the settings the operator rendered, gives each pod its group's profile.
    from routerd.daemon.config import Settings
    from routerd.daemon.endpointslices import EndpointSliceWatcher

    groups = [{"name": "a", "model": {"name": "llama-3.1-8b"}, "replicas": 2},
              {"name": "b", "model": {"name": "llama-3.1-8b"}, "replicas": 1,
               "hardwareProfile": {"name": "llama3.1-8b-a100"}}]
    apply(k8s, namespace, groups_pool_yaml("mx", groups, engine={"replicas": 1},
                                           hardwareProfile={"name": "llama3.1-8b-h100"}))
    wait_for(lambda: (pool(kube, namespace, "mx").get("status") or {}).get("observedGeneration") == 1,
             what="pool mx's first status write")
    kids = children(kube, namespace, "mx")
    assert {("Service", "mx-engine-a"), ("Service", "mx-engine-b")} <= set(kids)
    cm = kids[("ConfigMap", "mx-routerd")]
    assert "profile-b.yaml" in cm["data"]
    settings = Settings.model_validate(yaml.safe_load(cm["data"]["routerd.yaml"]))
    k = settings.kubernetes
    assert k.profiles == {"b": "/etc/phasewise/profile-b.yaml"}
    # No routing.policy: a mixed-GPU pool gets predicted_latency (and the API server filled in none).
    assert settings.policy.name == "predicted_latency"
    mx = pool(kube, namespace, "mx")
    assert "policy" not in mx["spec"].get("routing", {}) and mx["status"]["activePolicy"] == "predicted_latency"
    wait_for(lambda: len(kube.list("v1", "Pod", namespace, label_selector="phasewise.io/pool=mx")) >= 4,
             timeout=60, what="2 + 1 engine pods and a routerd pod")
    pods = make_pods_ready(kube, namespace, "phasewise.io/pool=mx,app.kubernetes.io/component=engine")
    seen: list = []
    w = EndpointSliceWatcher(namespace, k.service or "", seen.append, api_client=k8s_client,
                             selector=k.selector, profile_label=k.profile_label, profiles=k.profiles,
                             backoff_initial_s=0.2, backoff_max_s=1.0)
    w.start()
    try:
        assert w.wait_synced(15)
        eps = wait_for(lambda: (lambda e: e if len(e) == 3 and all(x.ready for x in e) else None)(w.endpoints),
                       timeout=60, what="3 ready endpoints from the group Services' EndpointSlices")
    finally:
        w.stop()
    by_group = {p: ("b" if "-engine-b-" in p else "a") for p in pods}
    assert {e.name: e.profile for e in eps} == {
        p: ("/etc/phasewise/profile-b.yaml" if g == "b" else None) for p, g in by_group.items()}
    # No group with its own profile any more: only routerd's settings change; the group Services
    # its running pods watch stay, so they keep every endpoint (now all on the pool's profile).
    uids = {g: kube.get("v1", "Service", namespace, f"mx-engine-{g}")["metadata"]["uid"] for g in "ab"}
    groups[1].pop("hardwareProfile")
    apply(k8s, namespace, groups_pool_yaml("mx", groups, engine={"replicas": 1},
                                           hardwareProfile={"name": "llama3.1-8b-h100"}))
    cm = wait_for(lambda: (lambda c: c if "profile-b.yaml" not in c["data"] else None)(
        kube.get("v1", "ConfigMap", namespace, "mx-routerd")), what="group b's profile file gone")
    k = yaml.safe_load(cm["data"]["routerd.yaml"])["kubernetes"]
    assert k["profiles"] == {} and k["selector"] == settings.kubernetes.selector
    assert yaml.safe_load(cm["data"]["routerd.yaml"])["policy"]["name"] == "late_binding"  # one profile again
    wait_for(lambda: pool(kube, namespace, "mx")["status"].get("activePolicy") == "late_binding",
             what="status.activePolicy late_binding once the pool has one profile")
    assert {g: kube.get("v1", "Service", namespace, f"mx-engine-{g}")["metadata"]["uid"] for g in "ab"} == uids
    # A group removed: its Service goes with its Deployment.
    apply(k8s, namespace, groups_pool_yaml("mx", groups[:1], engine={"replicas": 1},
                                           hardwareProfile={"name": "llama3.1-8b-h100"}))
    wait_for(lambda: kube.get("v1", "Service", namespace, "mx-engine-b") is None,
             what="group b's Service deleted with the group")
    assert kube.get("v1", "Service", namespace, "mx-engine-a")["metadata"]["uid"] == uids["a"]


def test_restart_adopts_and_duplicates_nothing(k8s, kube, operator, namespace):
    apply(k8s, namespace, pool_yaml("keep", engine={"replicas": 2}))
    wait_for(lambda: (pool(kube, namespace, "keep").get("status") or {}).get("observedGeneration") == 1,
             what="pool keep's first status write (status.observedGeneration 1)")
    before = {k: (o["metadata"]["uid"], o["metadata"].get("generation"))
              for k, o in children(kube, namespace, "keep").items()}
    operator.stop()
    # while it is down: a child is deleted and the spec changes
    kube.delete("v1", "Service", namespace, "keep-routerd")
    k8s.kubectl("patch", "-n", namespace, "llmrouterpool/keep", "--type=merge", "-p",
                '{"spec": {"engine": {"replicas": 3}}}')
    operator.start()
    p = wait_for(lambda: (lambda o: o if o["status"]["observedGeneration"] == 2 else None)(
        pool(kube, namespace, "keep")), what="reconciled after restart")
    after = children(kube, namespace, "keep")
    assert sorted(after) == sorted(before)  # same set: nothing duplicated, the deleted one is back
    assert after[("Service", "keep-routerd")]["metadata"]["uid"] != before[("Service", "keep-routerd")][0]
    assert after[("Deployment", "keep-engine")]["spec"]["replicas"] == 3
    for k in before:
        if k != ("Service", "keep-routerd"):
            assert after[k]["metadata"]["uid"] == before[k][0], k  # adopted, not recreated
    assert after[("Deployment", "keep-routerd")]["metadata"]["generation"] == \
        before[("Deployment", "keep-routerd")][1]  # its spec did not change, so no rollout either
    assert p["status"]["activePolicy"] == "late_binding"


# ---------------------------------------------------------------- jobs

def _job(name: str, pool_name: str, task: str, **extra) -> str:
    return yaml.safe_dump({"apiVersion": G, "kind": "LLMRouterJob", "metadata": {"name": name},
                           "spec": {"poolRef": {"name": pool_name}, "task": task, **extra}})


def _job_obj(kube, ns, name):
    return kube.get(G, "LLMRouterJob", ns, name)


def test_job_for_a_missing_pool_fails_naming_the_field(k8s, kube, operator, namespace):
    apply(k8s, namespace, _job("orphan", "no-such-pool", "profile"))
    j = wait_for(lambda: (lambda o: o if (o.get("status") or {}).get("phase") == "Failed" else None)(
        _job_obj(kube, namespace, "orphan")), timeout=20, what="Failed")
    assert j["status"]["message"].startswith("spec.poolRef.name: LLMRouterPool 'no-such-pool' not found")
    assert condition(j, "Failed")["status"] == "True"


def _reporter_kube(k8s, kube, ns, sa):
    """A Kube authenticated as the job's reporter ServiceAccount (a TokenRequest token)."""
    from kubernetes import client

    tok = kube.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token",
                       body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                             "spec": {"expirationSeconds": 600}})["status"]["token"]
    cfg = client.Configuration()
    cfg.host = k8s.server
    cfg.ssl_ca_cert = str(k8s.pki / "ca.crt")
    cfg.api_key = {"authorization": f"Bearer {tok}"}
    return Kube(client.ApiClient(cfg), field_manager="phasewise-job-reporter")


def _finish_job_pod(kube, ns, job_name):
    """Play the kubelet for the batch Job's pod: it succeeds."""
    pods = wait_for(lambda: kube.list("v1", "Pod", ns, label_selector=f"batch.kubernetes.io/job-name={job_name}"),
                    what="the batch Job's pod")
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for p in pods:
        kube.merge_patch("v1", "Pod", ns, p["metadata"]["name"], {"status": {
            "phase": "Succeeded", "startTime": now,
            "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": now, "reason": "PodCompleted"}],
            "containerStatuses": [{"name": "report", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
                                   "state": {"terminated": {"exitCode": 0, "reason": "Completed",
                                                            "startedAt": now, "finishedAt": now}}}]}},
            subresource="status")


def test_profile_job_writes_the_fitted_profile_into_the_pool(k8s, kube, operator, namespace, kcm, tmp_path):
    from phasewise_operator import report

    apply(k8s, namespace, pool_yaml("fitme", engine={"replicas": 1}))
    wait_for(lambda: (pool(kube, namespace, "fitme").get("status") or {}).get("observedGeneration") == 1,
             what="pool fitme's first status write (status.observedGeneration 1)")
    apply(k8s, namespace, _job("fit-1", "fitme", "profile"))
    j = wait_for(lambda: (lambda o: o if (o.get("status") or {}).get("phase") == "Pending" else None)(
        _job_obj(kube, namespace, "fit-1")), what="Pending without a ready instance")
    assert "no ready instance" in j["status"]["message"]
    make_pods_ready(kube, namespace, "phasewise.io/pool=fitme,app.kubernetes.io/component=engine", "10.244.1.")
    batch = wait_for(lambda: kube.get("batch/v1", "Job", namespace, "fit-1"), timeout=30, what="batch Job")
    work = batch["spec"]["template"]["spec"]["initContainers"][0]
    assert work["command"][:4] == ["phasewise", "profile", "--endpoint", "http://10.244.1.10:8000"]
    # The operator creates the batch Job, then records the phase: poll, the two writes are apart.
    wait_for(lambda: (_job_obj(kube, namespace, "fit-1").get("status") or {}).get("phase") == "Running",
             what="phase Running")
    # the reporter, with its own ServiceAccount's token, writes what the profiler wrote
    (tmp_path / "profile.yaml").write_text("grad1: 3.1e-4\ngrad2: 3.2e-5\noverhead_s: 0.018\n")
    cm = report.result_configmap("profile", tmp_path, name="fit-1-result", namespace=namespace, owner_name="fit-1",
                                 owner_uid=_job_obj(kube, namespace, "fit-1")["metadata"]["uid"])
    rk = _reporter_kube(k8s, kube, namespace, "fit-1-reporter")
    try:
        report.write(rk, cm)
        report.write(rk, cm)  # a retried pod replaces it
        with pytest.raises(ApiError) as e:  # and may touch no other ConfigMap
            rk.merge_patch("v1", "ConfigMap", namespace, "fitme-routerd", {"data": {"x": "y"}})
        assert e.value.status == 403
    finally:
        rk.close()
    _finish_job_pod(kube, namespace, "fit-1")
    j = wait_for(lambda: (lambda o: o if (o.get("status") or {}).get("phase") == "Succeeded" else None)(
        _job_obj(kube, namespace, "fit-1")), timeout=30, what="Succeeded")
    assert j["status"]["results"]["appliedToPool"] is True
    assert j["status"]["results"]["profile"]["grad1"] == 3.1e-4
    p = wait_for(lambda: (lambda o: o if o["status"].get("activeProfile") == "inline(llama2-7b-v100)" else None)(
        pool(kube, namespace, "fitme")), what="pool uses the fitted profile")
    assert p["spec"]["hardwareProfile"]["inline"]["overheadS"] == 0.018 and "name" not in p["spec"]["hardwareProfile"]
    prof = yaml.safe_load(kube.get("v1", "ConfigMap", namespace, "fitme-routerd")["data"]["profile.yaml"])
    assert (prof["grad1"], prof["overhead_s"], prof["kv_capacity_tokens"]) == (3.1e-4, 0.018, 30208)


def test_train_job_writes_the_checkpoint_into_the_pool(k8s, kube, operator, namespace, kcm, tmp_path):
    from phasewise_operator import report

    apply(k8s, namespace, pool_yaml("learn", engine={"replicas": 2}))
    wait_for(lambda: (pool(kube, namespace, "learn").get("status") or {}).get("observedGeneration") == 1,
             what="pool learn's first status write (status.observedGeneration 1)")
    routerd0 = kube.get("apps/v1", "Deployment", namespace, "learn-routerd")
    apply(k8s, namespace, _job("train-1", "learn", "train", train={"episodes": 2}))
    batch = wait_for(lambda: kube.get("batch/v1", "Job", namespace, "train-1"), timeout=30, what="batch Job")
    cmd = batch["spec"]["template"]["spec"]["initContainers"][0]["command"]
    assert cmd[:2] == ["phasewise", "train"] and cmd[cmd.index("--instances") + 1] == "2"
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "model.safetensors").write_bytes(b"\x00\x01weights")
    (tmp_path / "checkpoint" / "metadata.json").write_text(json.dumps(
        {"format": "phasewise-dqn/1", "num_instances": 2, "evaluation": {"mean_e2e_vs_rr_pct": -2.5}}))
    cm = report.result_configmap("train", tmp_path, name="train-1-result", namespace=namespace,
                                 owner_name="train-1", owner_uid=_job_obj(kube, namespace, "train-1")["metadata"]["uid"])
    rk = _reporter_kube(k8s, kube, namespace, "train-1-reporter")
    try:
        report.write(rk, cm)
    finally:
        rk.close()
    _finish_job_pod(kube, namespace, "train-1")
    j = wait_for(lambda: (lambda o: o if (o.get("status") or {}).get("phase") == "Succeeded" else None)(
        _job_obj(kube, namespace, "train-1")), timeout=30, what="Succeeded")
    assert j["status"]["results"]["checkpoint"] == {"configMap": "train-1-checkpoint",
                                                    "evaluation": {"num_instances": 2, "mean_e2e_vs_rr_pct": -2.5}}
    saved = kube.get("v1", "ConfigMap", namespace, "train-1-checkpoint")
    assert saved["metadata"]["ownerReferences"][0]["kind"] == "LLMRouterPool"
    p = wait_for(lambda: (lambda o: o if o["status"].get("activeCheckpoint") == "train-1-checkpoint" else None)(
        pool(kube, namespace, "learn")), what="pool uses the checkpoint")
    assert p["spec"]["routing"]["checkpoint"] == {"configMap": "train-1-checkpoint"}
    rcm = kube.get("v1", "ConfigMap", namespace, "learn-routerd")
    assert base64.b64decode(rcm["binaryData"]["checkpoint-model.safetensors"]) == b"\x00\x01weights"
    routerd1 = kube.get("apps/v1", "Deployment", namespace, "learn-routerd")
    assert routerd1["spec"]["template"] == routerd0["spec"]["template"]  # routerd reloads it, no restart
    # A 2-instance checkpoint beside 3 replicas: no problem while nothing routes with it (the
    # pool's policy is not dqn), CheckpointMismatch once dqn would load it.
    gen = kube.merge_patch(G, "LLMRouterPool", namespace, "learn",
                           {"spec": {"engine": {"replicas": 3}}})["metadata"]["generation"]
    p = wait_for(lambda: (lambda o: o if o["status"].get("observedGeneration", 0) >= gen else None)(
        pool(kube, namespace, "learn")), what="3 replicas reconciled")
    assert (condition(p, "Degraded") or {}).get("status") == "False", condition(p, "Degraded")
    kube.merge_patch(G, "LLMRouterPool", namespace, "learn", {"spec": {"routing": {"policy": "dqn"}}})
    p = wait_for(lambda: (lambda o: o if (condition(o, "Degraded") or {}).get("reason") == "CheckpointMismatch"
                          else None)(pool(kube, namespace, "learn")), what="CheckpointMismatch under dqn")
    assert "trained for 2 instances; spec.engine.replicas is 3" in condition(p, "Degraded")["message"]
    # Back on late_binding with the checkpoint ConfigMap deleted: nothing reads it, so the pool
    # is applied and healthy, with no checkpoint mounted.
    kube.delete("v1", "ConfigMap", namespace, "train-1-checkpoint")
    kube.merge_patch(G, "LLMRouterPool", namespace, "learn", {"spec": {"routing": {"policy": "late_binding"}}})
    p = wait_for(lambda: (lambda o: o if (o["status"].get("activePolicy") == "late_binding"
                                          and (condition(o, "Degraded") or {}).get("status") == "False") else None)(
        pool(kube, namespace, "learn")), what="healthy under late_binding without its checkpoint")
    assert p["status"]["activeCheckpoint"] == ""
    assert "checkpoint-model.safetensors" not in (kube.get("v1", "ConfigMap", namespace, "learn-routerd")
                                                  .get("binaryData") or {})


# ---------------------------------------------------------------- scale

def test_fifty_pools_all_reconcile(k8s, kube, operator, namespace):
    """50 pools created back to back (API calls, not kubectl, so the operator is what is measured)."""
    t0 = time.monotonic()
    for i in range(50):
        kube.create(yaml.safe_load(pool_yaml(f"p{i:02d}")) | {"metadata": {"name": f"p{i:02d}", "namespace": namespace}})
    t_created = time.monotonic() - t0

    def done():
        items = kube.list(G, "LLMRouterPool", namespace)
        return sum(1 for o in items if (o.get("status") or {}).get("observedGeneration") == 1) == 50

    wait_for(done, timeout=120, interval=0.5, what="50 pools reconciled")
    elapsed = time.monotonic() - t0
    n_deps = len(kube.list("apps/v1", "Deployment", namespace))
    print(f"\n50 pools: created in {t_created:.1f} s, all reconciled {elapsed:.1f} s after the first create",
          file=sys.__stderr__)
    assert n_deps == 100  # the 30 s target is measured by benchmarks/operator_reconcile.py


# ---------------------------------------------------------------- what the operator rendered, running

def test_rendered_stack_serves_and_reloads_a_policy_change(k8s, kube, operator, namespace, tmp_path):
    """routerd, emulators and sidecars booted locally from the ConfigMap and Deployments the operator
    wrote to the API server; a kubectl patch of the policy reaches the running routerd by reload."""
    pytest.importorskip("openai")
    sys.path.insert(0, str(REPO / "tests"))
    from test_operator_local_stack import Stack, check_requests, wait_reloaded

    apply(k8s, namespace, pool_yaml("live", engine={"replicas": 2}, routing={"policy": "least_outstanding_tokens"}))
    wait_for(lambda: (pool(kube, namespace, "live").get("status") or {}).get("observedGeneration") == 1,
             what="pool live's first status write (status.observedGeneration 1)")
    cm = kube.get("v1", "ConfigMap", namespace, "live-routerd")
    stack = Stack(cm, kube.get("apps/v1", "Deployment", namespace, "live-engine"),
                  kube.get("apps/v1", "Deployment", namespace, "live-routerd"), tmp_path)
    try:
        check_requests(stack.url, "llama-2-7b")
        k8s.kubectl("patch", "-n", namespace, "llmrouterpool/live", "--type=merge", "-p",
                    '{"spec": {"routing": {"policy": "join_shortest_queue"}}}')
        new = wait_for(lambda: (lambda c: c if "name: join_shortest_queue" in c["data"]["routerd.yaml"] else None)(
            kube.get("v1", "ConfigMap", namespace, "live-routerd")), what="ConfigMap updated")
        time.sleep(1.1)
        stack.mount(new)
        wait_reloaded(stack.url)
        check_requests(stack.url, "llama-2-7b")
        assert stack.routerd.poll() is None
    finally:
        stack.close()


def test_python_dash_m_entry_point(k8s, kube, crds, namespace):
    """``python -m phasewise_operator`` as its own process: liveness answers, a pool is reconciled,
    SIGTERM ends it cleanly; a bad setting exits 2 with one line."""
    pytest.importorskip("kopf", reason="the operator needs the extra: pip install -e '.[operator]'")
    import signal
    import socket
    import subprocess
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'routerd'}{os.pathsep}{REPO / 'operator'}",
           "KUBECONFIG": str(k8s.kubeconfig), "PHASEWISE_NAMESPACES": namespace,
           "PHASEWISE_PEERING_MODE": "standalone", "PHASEWISE_HEALTH_PORT": str(port)}
    bad = subprocess.run([sys.executable, "-m", "phasewise_operator"], env={**env, "PHASEWISE_RESYNC_SECONDS": "x"},
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "PHASEWISE_RESYNC_SECONDS" in bad.stderr
    proc = subprocess.Popen([sys.executable, "-m", "phasewise_operator"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        def healthy():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return proc.poll() is not None and pytest.fail(proc.stdout.read())
        wait_for(healthy, timeout=60, interval=0.5, what="/healthz")
        apply(k8s, namespace, pool_yaml("main"))
        wait_for(lambda: (pool(kube, namespace, "main").get("status") or {}).get("observedGeneration") == 1,
                 timeout=30, what="reconciled by the process")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
