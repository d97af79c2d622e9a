"""Hostile and careless input against the operator, on a real kube-apiserver (+ controller manager).

Each test is the regression test of a finding: bad input is refused by the schema naming
the field, or the pool / job says what is wrong (Degraded / Failed, the message starting
with the pool's field) -- never a traceback loop of the operator. The module's operator
fixture fails the module when its output holds a traceback.
"""

from __future__ import annotations

import base64
import json
import time

import pytest
import yaml

from k8s.test_operator_api import (  # noqa: F401 - fixtures
    G,
    apply,
    condition,
    crds,
    kube,
    pool,
    pool_yaml,
    running_operator,
    wait_for,
)


@pytest.fixture(scope="module")
def operator(k8s, crds):  # noqa: F811
    with running_operator(k8s, forbidden=("Traceback", "Throttling for")) as op:
        yield op


def _where(kube, ns, name, pred, what, timeout=20.0):
    return wait_for(lambda: (lambda o: o if o is not None and pred(o) else None)(pool(kube, ns, name)),
                    timeout=timeout, what=what)


def _degraded(reason):
    return lambda o: (condition(o, "Degraded") or {}).get("reason") == reason


def _consistent(p):
    """Ready, Progressing and Degraded agree with each other and with the status."""
    ready, prog, deg = (condition(p, t) for t in ("Ready", "Progressing", "Degraded"))
    assert ready and prog and deg, p.get("status")
    st = p["status"]
    assert all(c["observedGeneration"] == st["observedGeneration"] for c in (ready, prog, deg))
    assert (ready["status"] == "True") == (ready["reason"] == "Ready")
    assert (deg["status"] == "False") == (deg["reason"] == "AsExpected")
    if deg["status"] == "False":
        assert deg["message"] == ""
    assert (prog["status"] == "True") == (prog["reason"] == "RollingOut")


# ---------------------------------------------------------------- the schema refuses

def test_duplicate_env_names_are_refused_naming_the_item(k8s, crds, namespace):  # noqa: F811
    # before: accepted, then every apply of the engine Deployment failed ("duplicate entries for key")
    r = apply(k8s, namespace, pool_yaml("dup", engine={"env": [{"name": "A", "value": "1"},
                                                               {"name": "A", "value": "2"}]}), check=False)
    assert r.returncode != 0 and "spec.engine.env[1]" in r.stderr, r.stderr


def test_negative_quantity_strings_are_refused_naming_the_field(k8s, crds, namespace):  # noqa: F811
    r = apply(k8s, namespace, pool_yaml("neg", engine={"resources": {"limits": {"cpu": "-1"}}}), check=False)
    assert r.returncode != 0 and "spec.engine.resources.limits.cpu" in r.stderr, r.stderr
    r = apply(k8s, namespace, pool_yaml("shm", emulated=False, engine={"sharedMemory": "-1Gi"}), check=False)
    assert r.returncode != 0 and "spec.engine.sharedMemory" in r.stderr, r.stderr


# ---------------------------------------------------------------- the operator says what is wrong

def test_corrupt_checkpoint_metadata_is_degraded_not_a_traceback_loop(k8s, kube, operator, namespace):  # noqa: F811
    # before: int("two") raised in every reconcile (a traceback each 5 s) and no status was ever written
    kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "w", "namespace": namespace},
                 "binaryData": {"model.safetensors": base64.b64encode(b"w").decode()},
                 "data": {"metadata.json": json.dumps({"num_instances": "two"})}})
    apply(k8s, namespace, pool_yaml("ckbad", routing={"policy": "dqn", "checkpoint": {"configMap": "w"}}))
    p = _where(kube, namespace, "ckbad", _degraded("InvalidCheckpoint"), "Degraded InvalidCheckpoint")
    msg = condition(p, "Degraded")["message"]
    assert msg.startswith("spec.routing.checkpoint.configMap:") and "num_instances='two'" in msg, msg
    _consistent(p)
    # a checkpoint for another observation layout or format: also refused, naming the key
    kube.merge_patch("v1", "ConfigMap", namespace, "w", {"data": {"metadata.json": json.dumps(
        {"num_instances": 1, "format": "phasewise-dqn/0"})}})
    k8s.kubectl("patch", "-n", namespace, "llmrouterpool/ckbad", "--type=merge", "-p",
                '{"spec": {"routing": {"queueLimit": 7}}}')
    p = _where(kube, namespace, "ckbad", lambda o: "format" in (condition(o, "Degraded") or {}).get("message", ""),
               "format named", timeout=30)
    assert kube.get("apps/v1", "Deployment", namespace, "ckbad-routerd") is None


def test_refused_children_name_the_pool_field(k8s, kube, operator, namespace):  # noqa: F811
    # before: the message named only the child's field (spec.template.spec.containers[0]...)
    cases = {
        "negint": ({"engine": {"resources": {"limits": {"cpu": -1}}}}, "spec.engine.resources"),
        "reqlim": ({"engine": {"resources": {"limits": {"cpu": "1"}, "requests": {"cpu": "2"}}}},
                   "spec.engine.resources"),
        "sidecar": ({"sidecar": {"resources": {"limits": {"cpu": "1"}, "requests": {"cpu": "2"}}}},
                    "spec.sidecar.resources"),
        "nodesel": ({"engine": {"nodeSelector": {"bad key!": "x"}}}, "spec.engine.nodeSelector"),
        "tol": ({"engine": {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}},
                "spec.engine.tolerations"),
        "envname": ({"engine": {"env": [{"name": "1=bad", "value": "x"}]}}, "spec.engine.env"),
        "anno": ({"routerd": {"service": {"annotations": {"bad key!": "x"}}}}, "spec.routerd.service.annotations"),
    }
    for name, (spec, _) in cases.items():
        apply(k8s, namespace, pool_yaml(name, **spec))
    for name, (_, field) in cases.items():
        p = _where(kube, namespace, name, _degraded("ApplyFailed"), f"{name} ApplyFailed")
        msg = condition(p, "Degraded")["message"]
        assert msg.startswith(field + ": "), (name, msg)
        _consistent(p)
    # fixing the field clears it
    k8s.kubectl("patch", "-n", namespace, "llmrouterpool/nodesel", "--type=json", "-p",
                '[{"op": "remove", "path": "/spec/engine/nodeSelector"}]')
    p = _where(kube, namespace, "nodesel", _degraded("AsExpected"), "Degraded cleared")
    _consistent(p)


def test_emulated_pool_may_set_home(k8s, kube, operator, namespace):  # noqa: F811
    # before: the emulator container got HOME twice and the Deployment was refused
    apply(k8s, namespace, pool_yaml("home", engine={"env": [{"name": "HOME", "value": "/var/tmp"}]}))
    p = _where(kube, namespace, "home", lambda o: (o.get("status") or {}).get("observedGeneration") == 1,
               "reconciled")
    assert condition(p, "Degraded")["status"] == "False", condition(p, "Degraded")
    env = kube.get("apps/v1", "Deployment", namespace, "home-engine")["spec"]["template"]["spec"]["containers"][0]["env"]
    assert [e for e in env if e["name"] == "HOME"] == [{"name": "HOME", "value": "/var/tmp"}]


def test_large_spec_does_not_overflow_kopf_annotations(k8s, kube, operator, namespace):  # noqa: F811
    # before: kopf copied the 300 kB spec into an annotation (256 KiB for all of them), every
    # write of it was refused, and kopf retried with a traceback, throttling, forever
    body = yaml.safe_load(pool_yaml("big", engine={"env": [{"name": f"V{i}", "value": "x" * 5000}
                                                           for i in range(60)]}))
    body["metadata"]["namespace"] = namespace
    kube.create(body)  # server-side: kubectl's client-side apply would itself need the annotation
    _where(kube, namespace, "big", lambda o: (o.get("status") or {}).get("observedGeneration") == 1, "reconciled")
    k8s.kubectl("patch", "-n", namespace, "llmrouterpool/big", "--type=merge", "-p",
                '{"spec": {"routing": {"queueLimit": 9}}}')
    p = _where(kube, namespace, "big", lambda o: o["status"]["observedGeneration"] == 2, "update reconciled")
    assert "queue_limit: 9" in kube.get("v1", "ConfigMap", namespace, "big-routerd")["data"]["routerd.yaml"]
    annotations = p["metadata"].get("annotations") or {}
    assert sum(len(v) for v in annotations.values()) < 2000, {k: len(v) for k, v in annotations.items()}
    _consistent(p)


def test_hand_edited_deployment_is_put_back_at_once(k8s, kube, operator, namespace):  # noqa: F811
    # before: a hand edit stayed until the resync (PHASEWISE_RESYNC_SECONDS, 300 s by default)
    apply(k8s, namespace, pool_yaml("hand", engine={"replicas": 2}))
    _where(kube, namespace, "hand", lambda o: (o.get("status") or {}).get("observedGeneration") == 1, "reconciled")
    kube.merge_patch("apps/v1", "Deployment", namespace, "hand-engine", {"spec": {"replicas": 7}})
    k8s.kubectl("scale", "-n", namespace, "deployment/hand-routerd", "--replicas=3")
    wait_for(lambda: kube.get("apps/v1", "Deployment", namespace, "hand-engine")["spec"]["replicas"] == 2,
             timeout=15, what="engine replicas put back")
    wait_for(lambda: kube.get("apps/v1", "Deployment", namespace, "hand-routerd")["spec"]["replicas"] == 1,
             timeout=15, what="routerd replicas put back")
    # the operator's own applies do not loop: the generation settles
    gen = kube.get("apps/v1", "Deployment", namespace, "hand-engine")["metadata"]["generation"]
    time.sleep(2)
    assert kube.get("apps/v1", "Deployment", namespace, "hand-engine")["metadata"]["generation"] == gen


def test_rapid_updates_end_at_the_last_generation(k8s, kube, operator, namespace):  # noqa: F811
    apply(k8s, namespace, pool_yaml("rapid"))
    _where(kube, namespace, "rapid", lambda o: (o.get("status") or {}).get("observedGeneration") == 1, "reconciled")
    for i in range(12):
        k8s.kubectl("patch", "-n", namespace, "llmrouterpool/rapid", "--type=merge", "-p",
                    json.dumps({"spec": {"routing": {"queueLimit": 100 + i}, "engine": {"replicas": i % 4}}}))
    gen = pool(kube, namespace, "rapid")["metadata"]["generation"]
    p = _where(kube, namespace, "rapid", lambda o: o["status"]["observedGeneration"] == gen, f"generation {gen}")
    assert "queue_limit: 111" in kube.get("v1", "ConfigMap", namespace, "rapid-routerd")["data"]["routerd.yaml"]
    assert kube.get("apps/v1", "Deployment", namespace, "rapid-engine")["spec"]["replicas"] == 11 % 4
    deps = kube.list("apps/v1", "Deployment", namespace, label_selector="phasewise.io/pool=rapid")
    assert sorted(d["metadata"]["name"] for d in deps) == ["rapid-engine", "rapid-routerd"]
    _consistent(p)


def test_pool_deleted_mid_run_fails_the_job_and_stops_its_batch_job(k8s, kube, operator, namespace):  # noqa: F811
    apply(k8s, namespace, pool_yaml("gone", engine={"replicas": 2}))
    _where(kube, namespace, "gone", lambda o: (o.get("status") or {}).get("observedGeneration") == 1, "reconciled")
    job = {"apiVersion": G, "kind": "LLMRouterJob", "metadata": {"name": "t1"},
           "spec": {"poolRef": {"name": "gone"}, "task": "train"}}
    apply(k8s, namespace, yaml.safe_dump(job))
    wait_for(lambda: kube.get("batch/v1", "Job", namespace, "t1"), what="batch Job")
    k8s.kubectl("delete", "-n", namespace, "llmrouterpool/gone", "--wait=false")
    j = wait_for(lambda: (lambda o: o if (o.get("status") or {}).get("phase") == "Failed" else None)(
        kube.get(G, "LLMRouterJob", namespace, "t1")), timeout=30, what="job Failed")
    assert j["status"]["message"].startswith("spec.poolRef.name: LLMRouterPool 'gone' not found"), j["status"]
    wait_for(lambda: ((kube.get("batch/v1", "Job", namespace, "t1") or {}).get("spec") or {}).get("suspend") is True,
             what="batch Job suspended")
