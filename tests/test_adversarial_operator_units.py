"""Regression tests (no API server) for what hostile or careless input did to the operator's pure parts.

The same findings are exercised against a real API server in tests/k8s/test_adversarial_operator.py.
"""

from __future__ import annotations

import base64
import json

import pytest

from phasewise_operator import builders as B
from phasewise_operator import jobs as J
from phasewise_operator import status as S
from phasewise_operator.builders import PoolRef
from phasewise_operator.settings import OperatorSettings
from phasewise_operator.spec import parse_pool_spec

POOL = PoolRef("p", "ns", "uid-1", 1)


def _ckpt(meta) -> dict:
    return {"metadata": {"name": "w"},
            "binaryData": {"model.safetensors": base64.b64encode(b"\x00w").decode()},
            "data": {"metadata.json": meta if isinstance(meta, str) else json.dumps(meta)}}


@pytest.mark.parametrize("meta,needle", [
    ({"num_instances": "two"}, "num_instances='two'"),      # was: ValueError in every reconcile
    ({"num_instances": [1]}, "num_instances=[1]"),          # was: TypeError
    ({"num_instances": True}, "num_instances=True"),
    ({"num_instances": 0}, "num_instances=0"),
    ({}, "num_instances=None"),                             # routerd refuses it too
    ({"num_instances": 2, "format": "phasewise-dqn/0"}, "format is 'phasewise-dqn/0'"),
    ({"num_instances": 2, "obs_version": "pw-obs-v0"}, "obs_version is 'pw-obs-v0'"),
])
def test_checkpoint_metadata_routerd_would_refuse_is_a_result_error(meta, needle):
    with pytest.raises(J.ResultError) as e:
        J.checkpoint_from_configmap(_ckpt(meta))
    assert needle in str(e.value) and "ConfigMap w" in str(e.value)


def test_checkpoint_problem_on_a_valid_checkpoint():
    ck = J.checkpoint_from_configmap(_ckpt({"num_instances": 2, "format": "phasewise-dqn/1"}))
    assert J.checkpoint_problem(ck, 2) is None
    assert "trained for 2 instances; spec.engine.replicas is 0" in J.checkpoint_problem(ck, 0)


@pytest.mark.parametrize("emulated", [True, False])
def test_user_env_replaces_the_operators_own_variables(emulated):
    spec = parse_pool_spec({"model": {"name": "m"}, "emulated": emulated,
                            "engine": {"env": [{"name": "HOME", "value": "/var/tmp"}, {"name": "X", "value": "1"}]}})
    dep = B.engine_deployment(POOL, spec, OperatorSettings())
    env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
    names = [e["name"] for e in env]
    assert len(names) == len(set(names)), names
    assert {"name": "HOME", "value": "/var/tmp"} in env and {"name": "X", "value": "1"} in env


def _child(kind, component):
    return {"kind": kind, "metadata": {"name": f"p-{component}", "labels": B.labels("p", component)}}


@pytest.mark.parametrize("kind,component,message,field", [
    ("Deployment", "engine", 'spec.template.spec.containers[0].resources.limits[cpu]: Invalid value: "-1"',
     "spec.engine.resources"),
    ("Deployment", "engine", '.spec.template.spec.containers[name="emulator"].env: duplicate entries for key',
     "spec.engine.env"),
    ("Deployment", "engine", "spec.template.spec.containers[1].resources.requests: Invalid value",
     "spec.sidecar.resources"),
    ("Deployment", "engine", "spec.template.spec.volumes[2].emptyDir.sizeLimit: Forbidden", "spec.engine.sharedMemory"),
    ("Deployment", "engine", "spec.template.spec.nodeSelector: Invalid value", "spec.engine.nodeSelector"),
    ("Deployment", "engine", "spec.template.spec.tolerations[0].operator: Invalid value", "spec.engine.tolerations"),
    ("Deployment", "routerd", "spec.template.spec.containers[0].resources.limits[memory]: Invalid",
     "spec.routerd.resources"),
    ("Service", "routerd", 'metadata.annotations: Invalid value: "bad key!"', "spec.routerd.service.annotations"),
    ("Service", "routerd", "spec.ports[0].nodePort: Invalid value: 30080: provided port is already allocated",
     "spec.routerd.service.nodePort"),
    ("ConfigMap", "routerd", "exceeded quota", None),
])
def test_a_refused_child_is_blamed_on_the_pool_field(kind, component, message, field):
    assert B.blame(_child(kind, component), message) == field


def test_long_condition_messages_are_cut():
    c = S.condition("Degraded", True, "ApplyFailed", "x" * 100_000, now="t", generation=1)
    assert len(c["message"]) == S.MESSAGE_MAX and c["message"].endswith("(truncated)")
    assert S.condition("Ready", True, "Ready", "short", now="t", generation=1)["message"] == "short"


def test_kopf_diffbase_holds_digests_not_the_spec():
    kopf = pytest.importorskip("kopf")  # the 'operator' extra

    from phasewise_operator.handlers import DigestDiffBaseStorage

    st = DigestDiffBaseStorage(prefix="phasewise.io", key="last-handled-configuration")
    big = {"apiVersion": "phasewise.io/v1alpha1", "kind": "LLMRouterPool",
           "metadata": {"name": "p", "labels": {"a": "b"}, "uid": "u", "resourceVersion": "1"},
           "spec": {"engine": {"env": [{"name": f"V{i}", "value": "x" * 5000} for i in range(60)]}},
           "status": {"observedGeneration": 1}}
    e1 = st.build(body=kopf.Body(big))
    assert set(e1) == {"spec", "metadata"} and len(json.dumps(e1)) < 300
    changed = json.loads(json.dumps(big))
    changed["status"] = {"observedGeneration": 2}
    changed["metadata"]["resourceVersion"] = "2"
    assert st.build(body=kopf.Body(changed)) == e1  # status and system fields are not changes
    changed["spec"]["engine"]["replicas"] = 3
    e2 = st.build(body=kopf.Body(changed))
    assert e2["spec"] != e1["spec"] and e2["metadata"] == e1["metadata"]


class _FakeKube:
    def __init__(self):
        self.calls = []


def test_deployment_changed_reapplies_only_after_a_foreign_edit(monkeypatch):
    from phasewise_operator.reconcile import Controller

    c = Controller(_FakeKube(), OperatorSettings())
    seen = []
    monkeypatch.setattr(c, "reconcile_pool", lambda ns, name: seen.append(("reconcile", name)))
    monkeypatch.setattr(c, "refresh_pool_status", lambda ns, name: seen.append(("refresh", name)))
    dep = {"metadata": {"name": "p-engine", "uid": "d1", "generation": 3}}
    c.deployment_changed("ns", "p", dep)  # nothing applied yet (operator just started): status only
    c._applied_generations[("ns", "p")] = {"d1": 3}
    c.deployment_changed("ns", "p", dep)  # the operator's own apply
    c.deployment_changed("ns", "p", {"metadata": {"name": "p-engine", "uid": "d1", "generation": 4}})  # by hand
    assert seen == [("refresh", "p"), ("refresh", "p"), ("reconcile", "p")]
    c.forget("pool", "ns", "p")
    assert ("ns", "p") not in c._applied_generations


def test_prune_deletes_a_removed_groups_deployment_and_forgets_its_generation():
    from phasewise_operator import builders
    from phasewise_operator.reconcile import Controller, Outcome
    from phasewise_operator.spec import parse_pool_spec

    pool = builders.PoolRef("p", "ns", "pool-uid")
    owner = [{"controller": True, "uid": "pool-uid"}]

    def dep(name, uid, owners=owner):
        return {"metadata": {"name": name, "uid": uid, "ownerReferences": owners,
                             "labels": {builders.LABEL_POOL: "p", builders.LABEL_COMPONENT: "engine"}}}

    class Kube(_FakeKube):
        def list(self, api, kind, namespace, label_selector=None):
            return [dep("p-engine-a", "ua"), dep("p-engine-b", "ub"),
                    dep("p-engine-c", "uc", owners=[{"controller": True, "uid": "someone-else"}])]

        def delete(self, api, kind, namespace, name):
            self.calls.append(("delete", kind, namespace, name))

    kube = Kube()
    c = Controller(kube, OperatorSettings())
    c._applied_generations[("ns", "p")] = {"ua": 2, "ub": 5}
    spec = parse_pool_spec({"engineGroups": [{"name": "a", "model": {"name": "m"}}], "emulated": True})
    outcome = Outcome(ok=True, message="")
    assert c._prune(pool, spec, outcome) is None
    # b left the spec and is the pool's own: deleted; c carries the labels but another owner.
    assert kube.calls == [("delete", "Deployment", "ns", "p-engine-b")]
    assert outcome.deleted == ["Deployment/p-engine-b"]
    assert c._applied_generations[("ns", "p")] == {"ua": 2}
