"""A pool's status from observed Deployments and EndpointSlices (pure)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "operator"))

from phasewise_operator import status as S  # noqa: E402

T0, T1 = "2026-11-30T01:00:00Z", "2026-11-30T01:05:00Z"


def dep(replicas=3, ready=3, updated=None, available=None, total=None, generation=1, observed=1, conditions=()):
    updated = ready if updated is None else updated
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": observed, "replicas": replicas if total is None else total,
                       "readyReplicas": ready, "updatedReplicas": updated,
                       "availableReplicas": ready if available is None else available,
                       "conditions": list(conditions)}}


def slice_(*eps):
    return {"addressType": "IPv4", "metadata": {"name": "s1"},
            "ports": [{"name": "http", "port": 8000}, {"name": "state", "port": 50051}],
            "endpoints": [{"addresses": [ip], "targetRef": {"name": name}, "conditions": {"ready": ready}}
                          for name, ip, ready in eps]}


def conds(st):
    return {c["type"]: (c["status"], c["reason"]) for c in st["conditions"]}


def test_ready_pool():
    st = S.pool_status(engine=dep(3, 3), routerd=dep(1, 1), slices=[slice_(("e-0", "10.0.0.1", True))],
                       problem=None, generation=4, now=T0)
    assert conds(st) == {"Ready": ("True", "Ready"), "Progressing": ("False", "Complete"),
                         "Degraded": ("False", "AsExpected")}
    assert st["observedGeneration"] == 4 and all(c["observedGeneration"] == 4 for c in st["conditions"])
    assert st["replicas"] == 3 and st["readyInstances"] == 3
    assert st["endpoints"] == [{"name": "e-0", "url": "http://10.0.0.1:8000", "ready": True,
                                "stateAddress": "10.0.0.1:50051"}]
    assert "3/3 instances and 1/1 routerd ready" in st["conditions"][0]["message"]


def test_rolling_out_and_partially_ready():
    st = S.pool_status(engine=dep(4, 1, updated=2), routerd=dep(1, 1), slices=[], problem=None, generation=2, now=T0)
    c = conds(st)
    assert c["Ready"] == ("True", "Ready")  # one instance serves
    assert c["Progressing"] == ("True", "RollingOut")
    assert "engine: 2/4 pods updated" in next(x for x in st["conditions"] if x["type"] == "Progressing")["message"]
    st = S.pool_status(engine=dep(3, 3, generation=5, observed=4), routerd=dep(1, 1), slices=[], problem=None,
                       generation=5, now=T0)
    assert conds(st)["Progressing"] == ("True", "RollingOut")  # controller has not seen the new spec
    st = S.pool_status(engine=dep(2, 2, total=3), routerd=dep(1, 1), slices=[], problem=None, generation=5, now=T0)
    assert "1 old pods terminating" in st["conditions"][1]["message"]


def test_not_ready_reasons():
    assert conds(S.pool_status(engine=None, routerd=None, slices=[], problem=None, generation=1, now=T0))["Ready"] == \
        ("False", "NotCreated")
    assert conds(S.pool_status(engine=dep(0, 0), routerd=dep(1, 1), slices=[], problem=None, generation=1,
                               now=T0))["Ready"] == ("False", "ScaledToZero")
    assert conds(S.pool_status(engine=dep(2, 2), routerd=dep(1, 0), slices=[], problem=None, generation=1,
                               now=T0))["Ready"] == ("False", "RouterdNotReady")
    assert conds(S.pool_status(engine=dep(2, 0), routerd=dep(1, 1), slices=[], problem=None, generation=1,
                               now=T0))["Ready"] == ("False", "NoReadyInstances")


def test_degraded():
    p = S.Problem("InvalidSpec", "spec.routing.policy: unknown policy 'x'")
    st = S.pool_status(engine=dep(), routerd=dep(1, 1), slices=[], problem=p, generation=1, now=T0)
    d = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert (d["status"], d["reason"], d["message"]) == ("True", "InvalidSpec", "spec.routing.policy: unknown policy 'x'")
    failing = dep(conditions=[{"type": "ReplicaFailure", "status": "True", "message": "pods \"x\" is forbidden"}])
    assert conds(S.pool_status(engine=failing, routerd=dep(1, 1), slices=[], problem=None, generation=1,
                               now=T0))["Degraded"] == ("True", "EngineFailed")
    stuck = dep(conditions=[{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}])
    assert conds(S.pool_status(engine=dep(), routerd=stuck, slices=[], problem=None, generation=1,
                               now=T0))["Degraded"] == ("True", "RouterdFailed")


def test_transition_time_kept_until_status_changes():
    first = S.pool_status(engine=dep(), routerd=dep(1, 1), slices=[], problem=None, generation=1, now=T0)
    same = S.pool_status(engine=dep(), routerd=dep(1, 1), slices=[], problem=None, generation=2, now=T1,
                         previous_conditions=first["conditions"])
    assert all(c["lastTransitionTime"] == T0 for c in same["conditions"])
    flipped = S.pool_status(engine=dep(3, 0), routerd=dep(1, 1), slices=[], problem=None, generation=2, now=T1,
                            previous_conditions=first["conditions"])
    times = {c["type"]: c["lastTransitionTime"] for c in flipped["conditions"]}
    assert times == {"Ready": T1, "Progressing": T1, "Degraded": T0}
    assert S.same_status({"a": 1, "b": 2}, {"a": 1}) and not S.same_status({"a": 1}, {"a": 2})


def test_endpoints_listed_up_to_the_limit():
    many = slice_(*[(f"e-{i:04d}", f"10.0.{i // 256}.{i % 256}", i % 2 == 0) for i in range(600)])
    eps = S.endpoints([many])
    assert len(eps) == S.ENDPOINTS_LISTED == 512
    assert eps[0]["name"] == "e-0000" and eps[1]["ready"] is False


# ---------------------------------------------------------------- engine groups

def _groups(*specs):
    """GroupObserved for (name, model, Deployment or None) triples."""
    return [S.GroupObserved(n, m, f"p-engine-{n}", d, 2) for n, m, d in specs]


def _cond(st, ctype):
    return next(c for c in st["conditions"] if c["type"] == ctype)


def test_groups_status_sums_and_lists_every_group():
    groups = _groups(("a", "llama", dep(2, 2)), ("b", "code", dep(3, 1, updated=3, available=1)))
    st = S.pool_status(routerd=dep(1, 1), slices=[], problem=None, generation=3, now=T0, groups=groups)
    assert st["replicas"] == 2 + 3 and st["readyInstances"] == 2 + 1
    assert st["engineGroups"] == [
        {"name": "a", "model": "llama", "deployment": "p-engine-a", "desiredReplicas": 2, "replicas": 2,
         "readyInstances": 2},
        {"name": "b", "model": "code", "deployment": "p-engine-b", "desiredReplicas": 3, "replicas": 3,
         "readyInstances": 1}]
    ready = _cond(st, "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "Ready")
    assert ready["message"] == "3/5 instances (a 2/2, b 1/3) and 1/1 routerd ready"
    prog = _cond(st, "Progressing")
    assert (prog["status"], prog["message"]) == ("True", "engine group b: 1/3 pods available")


def test_groups_ready_only_when_every_group_has_a_ready_instance():
    st = S.pool_status(routerd=dep(1, 1), slices=[], problem=None, generation=1, now=T0,
                       groups=_groups(("a", "llama", dep(2, 2)), ("b", "code", dep(2, 0))))
    ready = _cond(st, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "NoReadyInstances")
    assert ready["message"] == "group b (model code): 0/2 instances ready"
    assert st["readyInstances"] == 2  # the aggregate still counts what is ready
    st = S.pool_status(routerd=dep(1, 1), slices=[], problem=None, generation=1, now=T0,
                       groups=_groups(("a", "llama", dep(2, 2)), ("b", "code", dep(0, 0))))
    assert (_cond(st, "Ready")["reason"], _cond(st, "Ready")["message"]) == \
        ("ScaledToZero", "group b (model code) has 0 replicas")
    st = S.pool_status(routerd=dep(1, 1), slices=[], problem=None, generation=1, now=T0,
                       groups=_groups(("a", "llama", dep(0, 0)), ("b", "code", dep(0, 0))))
    assert _cond(st, "Ready")["message"] == "every engine group has 0 replicas"


def test_groups_not_created_and_failed():
    st = S.pool_status(routerd=dep(1, 1), slices=[], problem=None, generation=1, now=T0,
                       groups=_groups(("a", "llama", dep(2, 2)), ("b", "code", None)))
    assert conds(st)["Ready"] == ("False", "NotCreated")
    assert st["engineGroups"][1] == {"name": "b", "model": "code", "deployment": "p-engine-b",
                                     "desiredReplicas": 2, "replicas": 0, "readyInstances": 0}
    assert "engine group b: not created yet" in _cond(st, "Progressing")["message"]
    failing = dep(conditions=[{"type": "ReplicaFailure", "status": "True", "message": "quota exceeded"}])
    st = S.pool_status(routerd=dep(1, 1), slices=[], problem=None, generation=1, now=T0,
                       groups=_groups(("a", "llama", dep(2, 2)), ("b", "code", failing)))
    d = _cond(st, "Degraded")
    assert (d["reason"], d["message"]) == ("EngineFailed", "engine Deployment of group b: quota exceeded")


def test_single_model_status_has_no_groups_list():
    st = S.pool_status(engine=dep(3, 3), routerd=dep(1, 1), slices=[], problem=None, generation=1, now=T0)
    assert "engineGroups" not in st
