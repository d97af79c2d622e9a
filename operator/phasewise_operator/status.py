"""A pool's status from its children's observed state: pure functions, no API calls.

Conditions follow the Kubernetes API conventions (metav1.Condition; ``lastTransitionTime``
changes only when ``status`` does):

- **Ready**: the pool serves requests: at least one routerd pod and at least one
  instance are ready; with ``spec.engineGroups``, at least one instance of every group
  (a group without one leaves its model unserved). Reasons ``Ready``, ``RouterdNotReady``,
  ``NoReadyInstances``, ``ScaledToZero``, ``NotCreated``.
- **Progressing**: a rollout or scaling is under way (``RollingOut``) or done
  (``Complete``).
- **Degraded**: something needs a person: ``InvalidSpec`` (the message names the field),
  ``CheckpointNotFound``, ``ApplyFailed`` (the API server refused a child),
  ``EngineFailed``/``RouterdFailed``/``PickerFailed`` (a Deployment reports ReplicaFailure or missed
  its progress deadline); else ``AsExpected``.

With ``spec.gateway.picker``, Ready also needs a ready picker (``PickerNotReady``), and
routerd's pods only while ``spec.routerd.replicas`` is above 0 (a gateway-only pool).
With ``spec.gateway.inferencePool`` (:func:`gateway_conditions`):

- **InferencePoolReady**: the InferencePool exists and its selector matches a ready pod.
  Reasons ``Ready``, ``CRDNotInstalled`` (the Gateway API Inference Extension CRD is
  missing: the rest of the pool is reconciled all the same), ``NotCreated``,
  ``NoReadyEndpoints`` (the message names the selector).
- **GatewayAccepted**: every parent (gateway) listed in the InferencePool's
  ``status.parents`` has Accepted and ResolvedRefs True; else the first parent that does
  not, with its own reason and message (``NoParents`` while no gateway lists it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

MESSAGE_MAX = 4096
"""Condition messages are cut to this many characters (the schema allows 32768; an API server's
error can quote a user's value at any length, and a refused status write would leave the
status stale and the handler retrying)."""

_CUT = " ... (truncated)"


def clip(message: str, limit: int = MESSAGE_MAX) -> str:
    """``message`` cut to at most ``limit`` characters, saying so."""
    return message if len(message) <= limit else message[:limit - len(_CUT)] + _CUT


ENDPOINTS_LISTED = 512
"""At most this many endpoints go into ``status.endpoints`` (the status object stays small)."""


@dataclass(frozen=True)
class Problem:
    """Why a pool is Degraded: a CamelCase reason and a message naming the field or object."""

    reason: str
    message: str


@dataclass(frozen=True)
class GroupObserved:
    """One engine group of a multi-model pool with its Deployment as read."""

    name: str
    """``spec.engineGroups[].name``."""
    model: str
    """The group's served model name."""
    deployment_name: str
    deployment: Mapping[str, Any] | None
    """The Deployment as read; None when absent."""
    wanted_replicas: int = 0
    """The spec's replicas, shown as desiredReplicas while the Deployment does not exist yet."""


def _dep_status(dep: Mapping[str, Any] | None) -> dict[str, Any]:
    return dict((dep or {}).get("status") or {})


def _dep_progress(dep: Mapping[str, Any] | None) -> tuple[bool, str]:
    """(rolled out, why not) for a Deployment, the way ``kubectl rollout status`` decides."""
    if dep is None:
        return False, "not created yet"
    st = _dep_status(dep)
    spec = dep.get("spec") or {}
    meta = dep.get("metadata") or {}
    want = int(spec.get("replicas", 1))
    if int(st.get("observedGeneration", 0)) < int(meta.get("generation", 0)):
        return False, "waiting for the Deployment controller"
    updated = int(st.get("updatedReplicas", 0))
    total = int(st.get("replicas", 0))
    available = int(st.get("availableReplicas", 0))
    if updated < want:
        return False, f"{updated}/{want} pods updated"
    if total > updated:
        return False, f"{total - updated} old pods terminating"
    if available < updated:
        return False, f"{available}/{want} pods available"
    return True, ""


def _dep_failure(dep: Mapping[str, Any] | None) -> str | None:
    for c in _dep_status(dep).get("conditions") or []:
        if c.get("type") == "ReplicaFailure" and c.get("status") == "True":
            return c.get("message") or c.get("reason") or "replica failure"
        if c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded":
            return c.get("message") or "progress deadline exceeded"
    return None


def endpoints(slices: Iterable[Mapping[str, Any]], limit: int = ENDPOINTS_LISTED) -> list[dict[str, Any]]:
    """``status.endpoints`` from the engine Service's EndpointSlices, exactly as routerd reads them."""
    from routerd.daemon.endpointslices import endpoints_from_slices

    out = []
    for ep in endpoints_from_slices(slices, http_port_name="http", state_port_name="state")[:limit]:
        item: dict[str, Any] = {"name": ep.name, "url": ep.url, "ready": ep.ready}
        if ep.state_address:
            item["stateAddress"] = ep.state_address
        out.append(item)
    return out


def condition(ctype: str, status: bool, reason: str, message: str, *, now: str, generation: int,
              previous: Iterable[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """A metav1.Condition; ``lastTransitionTime`` is kept from ``previous`` when the status did not change."""
    value = "True" if status else "False"
    message = clip(message)
    since = now
    for c in previous:
        if c.get("type") == ctype and c.get("status") == value and c.get("lastTransitionTime"):
            since = c["lastTransitionTime"]
    return {"type": ctype, "status": value, "reason": reason, "message": message,
            "lastTransitionTime": since, "observedGeneration": generation}


def _desired(dep: Mapping[str, Any] | None) -> int:
    return int(((dep or {}).get("spec") or {}).get("replicas", 1))


def pool_status(*, engine: Mapping[str, Any] | None = None, routerd: Mapping[str, Any] | None,
                slices: Iterable[Mapping[str, Any]], problem: Problem | None, generation: int, now: str,
                previous_conditions: Iterable[Mapping[str, Any]] = (),
                groups: Sequence[GroupObserved] | None = None, picker_wanted: bool = False,
                picker: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The observed part of ``status``: conditions, replicas, readyInstances and endpoints
    (and ``engineGroups``, one entry per group, when ``groups`` is given).

    Desired replica counts are the Deployments' own (what was last applied), so a status
    refresh between a spec change and its reconcile does not misreport.

    Args:
        engine: the single-model pool's engine Deployment as read (None when absent);
            ignored when ``groups`` is given.
        routerd: routerd's Deployment as read (None when absent).
        slices: the engine Service's EndpointSlices.
        problem: why the last reconcile could not apply the spec, or None.
        generation: the ``metadata.generation`` this status describes.
        now: RFC 3339 time for conditions that change now.
        groups: the engine groups of a multi-model pool, in spec order; ``replicas`` and
            ``readyInstances`` are then their sums.
        picker_wanted: the pool runs ``phasewise epp`` (``spec.gateway.picker.enabled``).
        picker: the picker's Deployment as read (None when absent).
    """
    prev = list(previous_conditions)
    multi = groups is not None
    engines = [(g.name, g.model, g.deployment) for g in groups] if multi else [("", "", engine)]
    present = [d for _, _, d in engines if d is not None]
    desired_engine_replicas, desired_routerd_replicas = sum(_desired(d) for d in present), _desired(routerd)
    rst = _dep_status(routerd)
    ready_of = [int(_dep_status(d).get("readyReplicas", 0) or 0) for _, _, d in engines]
    ready_instances = sum(ready_of)
    routerd_ready = int(rst.get("readyReplicas", 0) or 0)
    # A group without ready instances: its model cannot be served, so the pool is not Ready.
    unready = [(name, model, d) for (name, model, d), r in zip(engines, ready_of) if r == 0]
    idle = [(name, model) for name, model, d in engines if d is not None and _desired(d) == 0]

    picker_ready = int(_dep_status(picker).get("readyReplicas", 0) or 0)
    # A gateway-only pool (picker on, routerd scaled to 0) needs no routerd pod.
    routerd_needed = not picker_wanted or desired_routerd_replicas > 0
    if len(present) < len(engines) or routerd is None or not engines or (picker_wanted and picker is None):
        ready = (False, "NotCreated", problem.message if problem else "children not created yet")
    elif desired_engine_replicas == 0:
        ready = (False, "ScaledToZero", "every engine group has 0 replicas" if multi else "spec.engine.replicas is 0")
    elif picker_wanted and picker_ready == 0:
        ready = (False, "PickerNotReady", "no picker pod is ready" if _desired(picker) else
                 "spec.gateway.picker.replicas is 0")
    elif routerd_needed and routerd_ready == 0:
        ready = (False, "RouterdNotReady", "no routerd pod is ready" if desired_routerd_replicas else
                 "spec.routerd.replicas is 0")
    elif multi and idle:
        ready = (False, "ScaledToZero", "; ".join(f"group {n} (model {m}) has 0 replicas" for n, m in idle))
    elif multi and unready:
        ready = (False, "NoReadyInstances", "; ".join(f"group {n} (model {m}): 0/{_desired(d)} instances ready"
                                                      for n, m, d in unready))
    elif ready_instances == 0:
        ready = (False, "NoReadyInstances", f"0/{desired_engine_replicas} instances ready")
    else:
        per_group = (" (" + ", ".join(f"{n} {r}/{_desired(d)}" for (n, _, d), r in zip(engines, ready_of)) + ")"
                     if multi else "")
        ready = (True, "Ready", f"{ready_instances}/{desired_engine_replicas} instances{per_group} and "
                 f"{routerd_ready}/{desired_routerd_replicas} routerd" +
                 (f" and {picker_ready}/{_desired(picker)} picker" if picker_wanted else "") + " ready")

    parts = []
    for name, _, d in engines:
        done, why = _dep_progress(d)
        if not done:
            parts.append(f"engine group {name}: {why}" if multi else f"engine: {why}")
    r_done, r_why = _dep_progress(routerd)
    if not r_done:
        parts.append(f"routerd: {r_why}")
    if picker_wanted:
        p_done, p_why = _dep_progress(picker)
        if not p_done:
            parts.append(f"picker: {p_why}")
    if not parts:
        progressing = (False, "Complete", "engine, routerd and picker are rolled out" if picker_wanted else
                       "engine and routerd are rolled out")
    else:
        progressing = (True, "RollingOut", "; ".join(parts))

    e_fail = next(((name, f) for name, _, d in engines if (f := _dep_failure(d))), None)
    r_fail = _dep_failure(routerd)
    if problem is not None:
        degraded = (True, problem.reason, problem.message)
    elif e_fail:
        where = f"engine Deployment of group {e_fail[0]}" if multi else "engine Deployment"
        degraded = (True, "EngineFailed", f"{where}: {e_fail[1]}")
    elif r_fail:
        degraded = (True, "RouterdFailed", f"routerd Deployment: {r_fail}")
    elif picker_wanted and (p_fail := _dep_failure(picker)):
        degraded = (True, "PickerFailed", f"picker Deployment: {p_fail}")
    else:
        degraded = (False, "AsExpected", "")

    conds = [condition(t, s, reason, msg, now=now, generation=generation, previous=prev)
             for t, (s, reason, msg) in (("Ready", ready), ("Progressing", progressing), ("Degraded", degraded))]
    out: dict[str, Any] = {
        "observedGeneration": generation,
        "conditions": conds,
        "replicas": sum(int(_dep_status(d).get("replicas", 0) or 0) for d in present),
        "readyInstances": ready_instances,
        "endpoints": endpoints(slices),
    }
    if multi:
        out["engineGroups"] = [
            {"name": g.name, "model": g.model, "deployment": g.deployment_name,
             "desiredReplicas": _desired(g.deployment) if g.deployment is not None else g.wanted_replicas,
             "replicas": int(_dep_status(g.deployment).get("replicas", 0) or 0),
             "readyInstances": r}
            for g, r in zip(groups, ready_of)]
    return out


def same_status(current: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether writing ``new`` over ``current`` would change nothing (skips a needless PATCH)."""
    current = current or {}
    return all(current.get(k) == v for k, v in new.items())


GATEWAY_CONDITIONS = ("InferencePoolReady", "GatewayAccepted")
"""Condition types of a pool with ``spec.gateway.inferencePool`` (after Ready, Progressing, Degraded)."""

INFERENCE_POOL_CRD = "inferencepools.inference.networking.k8s.io"


def _mapping(value: Any) -> Mapping[str, Any]:
    """``value`` if it is an object, else ``{}``: gateways write the status this reads, and a broken one
    (``null`` entries, a string where a list belongs) must not break the pool's reconcile."""
    return value if isinstance(value, Mapping) else {}


def _objects(value: Any) -> list[Mapping[str, Any]]:
    """The objects of a list, skipping what is not one; ``[]`` for anything that is not a list."""
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


def _parent_name(parent: Mapping[str, Any]) -> str:
    ref = _mapping(parent.get("parentRef"))
    kind = ref.get("kind") or "Gateway"
    ns = ref.get("namespace")
    return f"{kind} {f'{ns}/' if ns else ''}{ref.get('name') or '?'}"


def _parent_condition(parent: Mapping[str, Any], ctype: str) -> Mapping[str, Any] | None:
    return next((c for c in _objects(parent.get("conditions")) if c.get("type") == ctype), None)


def gateway_conditions(*, crd_served: bool, inference_pool: Mapping[str, Any] | None, name: str, selector: str,
                       target_port: int, ready_endpoints: int, endpoints: int, now: str, generation: int,
                       previous: Iterable[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """``InferencePoolReady`` and ``GatewayAccepted`` for a pool with ``spec.gateway.inferencePool``.

    Args:
        crd_served: whether the API server serves InferencePools (the GIE CRD is installed).
        inference_pool: the InferencePool ``name`` as read (None when absent).
        selector: its pod selector, as a label-selector string (for messages).
        target_port: its target port (for messages).
        ready_endpoints, endpoints: ready and all endpoints of the engine Service, whose
            selector is the InferencePool's.
        previous: the pool's current conditions (``lastTransitionTime`` is kept while unchanged).

    ``GatewayAccepted`` reads ``status.parents[]`` as GIE defines it (``api/v1/inferencepool_types.go``:
    ``ParentStatus`` with conditions ``Accepted`` and ``ResolvedRefs``), written by the gateways.
    """
    prev = list(previous)
    if not crd_served:
        why = (f"the API server does not serve {INFERENCE_POOL_CRD}: install the Gateway API Inference Extension "
               "CRDs (e.g. config/crd/bases/inference.networking.k8s.io_inferencepools.yaml of "
               "sigs.k8s.io/gateway-api-inference-extension v1.6.0); the rest of the pool is reconciled, and the "
               "InferencePool is created once the CRD is there")
        ready = (False, "CRDNotInstalled", why)
        accepted = (False, "CRDNotInstalled", why)
    elif inference_pool is None:
        ready = (False, "NotCreated", f"InferencePool {name} not created yet")
        accepted = (False, "NotCreated", f"InferencePool {name} not created yet")
    else:
        if ready_endpoints == 0:
            ready = (False, "NoReadyEndpoints", f"InferencePool {name}: its selector {selector} matches no ready pod "
                     f"(0/{endpoints} endpoints on port {target_port} ready); gateways answer its routes with 503")
        else:
            ready = (True, "Ready", f"InferencePool {name} selects {ready_endpoints}/{endpoints} ready endpoints "
                     f"on port {target_port}")
        # Malformed parents (null entries, a non-list) are skipped: only gateways write them.
        parents = _objects(_mapping(_mapping(inference_pool).get("status")).get("parents"))
        accepted = (True, "Accepted", "")
        if not parents:
            accepted = (False, "NoParents", f"no gateway lists InferencePool {name} as accepted yet (an HTTPRoute "
                        "whose backendRef is this InferencePool, on a gateway that supports it, makes it a parent)")
        else:
            names = []
            for parent in parents:
                who = _parent_name(parent)
                names.append(who)
                bad = None
                for ctype in ("Accepted", "ResolvedRefs"):
                    c = _parent_condition(parent, ctype)
                    if c is None:
                        bad = (f"Pending{ctype}", f"{who}: no {ctype} condition yet")
                        break
                    if c.get("status") != "True":
                        bad = (c.get("reason") or f"Not{ctype}",
                               f"{who}: {ctype} is {c.get('status')}" +
                               (f" ({c.get('reason')})" if c.get("reason") else "") +
                               (f": {c['message']}" if c.get("message") else ""))
                        break
                if bad is not None:
                    accepted = (False, bad[0], bad[1])
                    break
            else:
                accepted = (True, "Accepted", f"accepted with resolved references by {', '.join(names)}")
    return [condition(t, st, reason, msg, now=now, generation=generation, previous=prev)
            for t, (st, reason, msg) in zip(GATEWAY_CONDITIONS, (ready, accepted))]
