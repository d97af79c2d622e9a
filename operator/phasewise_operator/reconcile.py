"""Reconciliation of pools and jobs: read the current state, apply the desired one, write status.

:class:`Controller` holds no state of its own beyond per-object locks; everything is
read from the API server on each call, so a restarted operator carries on where the
last one stopped (server-side apply adopts the existing children by name instead of
creating duplicates). Every entry point (kopf create/update/resume handlers, the resync
timer, child events) funnels into :meth:`Controller.reconcile_pool` or
:meth:`Controller.refresh_pool_status`, which take the pool's lock and re-read the
pool: whichever runs last acts on the newest spec.

Errors come back as :class:`Outcome` values, never exceptions, so the kopf layer
decides between "done", "retry later" and "retrying cannot help".
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from phasewise_operator import builders, jobs, status
from phasewise_operator.builders import PoolRef
from phasewise_operator.gen_crds import API_VERSION
from phasewise_operator.kube import ApiError, Kube
from phasewise_operator.settings import OperatorSettings
from phasewise_operator.spec import SpecError, check_pool, parse_job_spec, parse_pool_spec, profile_label

log = logging.getLogger("phasewise_operator")

POOL = (API_VERSION, "LLMRouterPool")
JOB = (API_VERSION, "LLMRouterJob")

#: Degraded reasons that only a reconcile can clear (a status refresh keeps them).
RECONCILE_PROBLEMS = {"InvalidSpec", "CheckpointNotFound", "InvalidCheckpoint", "CheckpointMismatch", "ApplyFailed"}


def now_rfc3339() -> str:
    """The current UTC time as Kubernetes writes it (seconds, ``Z``)."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _age_s(timestamp: str | None) -> float:
    if not timestamp:
        return 0.0
    t = dt.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    return (dt.datetime.now(dt.timezone.utc) - t).total_seconds()


@dataclass
class Outcome:
    """What a reconcile achieved: ``ok``; else ``retry_after`` seconds (temporary) or permanent."""

    ok: bool = True
    message: str = ""
    retry_after: float | None = None
    permanent: bool = False
    applied: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    """Children deleted because the spec no longer has them (an engine group's Deployment)."""


class Controller:
    """Pool and job reconciliation against one API server."""

    def __init__(self, kube: Kube, settings: OperatorSettings) -> None:
        self.kube = kube
        self.settings = settings
        self._locks: dict[tuple[str, str, str], threading.Lock] = {}
        self._guard = threading.Lock()
        self._refresh_pending: set[tuple[str, str]] = set()
        # (namespace, pool) -> {Deployment uid: metadata.generation after this operator's last apply}
        self._applied_generations: dict[tuple[str, str], dict[str, int]] = {}
        self._unmounted: dict[tuple[str, str], str] = {}
        """Per pool, why its checkpoint is not mounted under a policy that does not read it (logged once)."""

    def _lock(self, kind: str, namespace: str, name: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault((kind, namespace, name), threading.Lock())

    def forget(self, kind: str, namespace: str, name: str) -> None:
        """Drop the lock of a deleted object."""
        with self._guard:
            self._locks.pop((kind, namespace, name), None)
            if kind == "pool":
                self._applied_generations.pop((namespace, name), None)
                self._unmounted.pop((namespace, name), None)

    # ------------------------------------------------------------ pools

    def _engines(self, pool: PoolRef) -> list[dict]:
        """Every engine Deployment labelled as the pool's (the single one, or one per group, plus any of a
        group just removed)."""
        return self.kube.list("apps/v1", "Deployment", pool.namespace,
                              label_selector=f"{builders.LABEL_POOL}={pool.name},"
                                             f"{builders.LABEL_COMPONENT}=engine")

    def _observe(self, pool: PoolRef, spec) -> tuple[dict | None, list[status.GroupObserved] | None,
                                                     dict | None, list[dict]]:
        """(single engine Deployment, groups or None, routerd Deployment, EndpointSlices) as read now.

        ``spec`` None (it does not parse): the groups are those the existing Deployments
        are labelled with, so the status still describes what runs.
        """
        k = self.kube
        engines = {d["metadata"]["name"]: d for d in self._engines(pool)}
        groups: list[status.GroupObserved] | None = None
        if spec is not None and spec.multi_model:
            groups = []
            for g in spec.groups():
                name = builders.engine_group_name(pool.name, g.name)
                groups.append(status.GroupObserved(g.name, g.model.served, name, engines.get(name), g.replicas))
        elif spec is None:
            labelled = sorted((d for d in engines.values()
                               if (d["metadata"].get("labels") or {}).get(builders.LABEL_ENGINE_GROUP)),
                              key=lambda d: d["metadata"]["name"])
            if labelled:
                groups = [status.GroupObserved(d["metadata"]["labels"][builders.LABEL_ENGINE_GROUP],
                                               (d["metadata"].get("annotations") or {}).get(
                                                   builders.ANNOTATION_MODEL, ""), d["metadata"]["name"], d)
                          for d in labelled]
        engine = engines.get(builders.engine_name(pool.name))
        routerd = k.get("apps/v1", "Deployment", pool.namespace, builders.routerd_name(pool.name))
        slices = k.list("discovery.k8s.io/v1", "EndpointSlice", pool.namespace,
                        label_selector=f"kubernetes.io/service-name={builders.engine_name(pool.name)}")
        return engine, groups, routerd, slices

    def _prune(self, pool: PoolRef, spec, outcome: Outcome) -> status.Problem | None:
        """Delete the engine Deployments the pool owns but its spec no longer has (a removed group, or
        ``P-engine`` after a switch to engineGroups); the garbage collector takes their pods.

        Runs after every wanted child is applied, so a switch to groups starts the new
        Deployments before the old one goes. Returns the problem when a delete is refused.
        """
        engines = self._engines(pool)
        uids = {d["metadata"]["name"]: d["metadata"].get("uid") for d in engines}
        for name in builders.stale_engine_deployments(pool, spec, engines):
            try:
                self.kube.delete("apps/v1", "Deployment", pool.namespace, name)
            except ApiError as e:
                what = f"Deployment {name} (an engine group no longer in the spec): deleting it: {e.message}"
                outcome.ok, outcome.message, outcome.permanent = False, what, e.permanent
                outcome.retry_after = None if e.permanent else 10.0
                return status.Problem("ApplyFailed", what)
            outcome.deleted.append(f"Deployment/{name}")
            with self._guard:  # its generation no longer needs remembering
                self._applied_generations.get((pool.namespace, pool.name), {}).pop(uids.get(name), None)
            log.info(f"pool {pool.namespace}/{pool.name}: deleted Deployment {name}, no longer in the spec")
        return None

    def _prune_optional(self, pool: PoolRef, spec, outcome: Outcome) -> status.Problem | None:
        """Delete the optional children the spec no longer wants (picker, its Envoy ConfigMap, the
        InferencePool, budgets, per-group engine Services), where they exist and this pool is their
        controller."""
        targets = list(builders.optional_children(pool, spec))
        pdbs = self.kube.list("policy/v1", "PodDisruptionBudget", pool.namespace,
                              label_selector=f"{builders.LABEL_POOL}={pool.name},{builders.LABEL_COMPONENT}=engine")
        targets += [("policy/v1", "PodDisruptionBudget", n) for n in builders.stale_engine_budgets(pool, spec, pdbs)]
        services = self.kube.list("v1", "Service", pool.namespace,
                                  label_selector=f"{builders.LABEL_POOL}={pool.name},"
                                                 f"{builders.LABEL_COMPONENT}={builders.GROUP_SERVICE_COMPONENT}")
        targets += [("v1", "Service", n) for n in builders.stale_group_services(pool, spec, services)]
        for api_version, kind, name in targets:
            try:
                obj = self.kube.get(api_version, kind, pool.namespace, name)
                refs = ((obj or {}).get("metadata") or {}).get("ownerReferences") or []
                if obj is None or not any(r.get("controller") and r.get("uid") == pool.uid for r in refs):
                    continue
                self.kube.delete(api_version, kind, pool.namespace, name)
            except ApiError as e:
                if e.not_found:
                    continue  # the InferencePool's CRD is not installed: nothing to delete
                what = f"{kind} {name} (no longer in the spec): deleting it: {e.message}"
                outcome.ok, outcome.message, outcome.permanent = False, what, e.permanent
                outcome.retry_after = None if e.permanent else 10.0
                return status.Problem("ApplyFailed", what)
            outcome.deleted.append(f"{kind}/{name}")
            log.info(f"pool {pool.namespace}/{pool.name}: deleted {kind} {name}, no longer in the spec")
        return None

    def _load_checkpoint(self, pool: PoolRef, spec,
                         policy: str) -> tuple[builders.Checkpoint | None, status.Problem | None]:
        """The pool's checkpoint ConfigMap, or why it cannot be used. Only ``policy`` dqn reads
        it: under another one (a train job leaves its checkpoint in a pool routed by, say,
        ``late_binding``) a missing or unreadable one is not mounted and is no problem, said in
        the log once per reason, and looked up again when the policy becomes dqn."""
        ref = spec.routing.checkpoint
        key = (pool.namespace, pool.name)
        problem = None
        if ref is not None:
            cm = self.kube.get("v1", "ConfigMap", pool.namespace, ref.config_map)
            if cm is None:
                problem = status.Problem("CheckpointNotFound", f"spec.routing.checkpoint.configMap: ConfigMap "
                                         f"{ref.config_map!r} not found in namespace {pool.namespace}")
            else:
                try:
                    return jobs.checkpoint_from_configmap(cm), None
                except jobs.ResultError as e:
                    problem = status.Problem("InvalidCheckpoint", f"spec.routing.checkpoint.configMap: {e}")
        if problem is None or policy == "dqn":
            self._unmounted.pop(key, None)
            return None, problem
        if self._unmounted.get(key) != problem.message:
            log.info("pool %s/%s: checkpoint not mounted (%s); policy %s does not read it",
                     pool.namespace, pool.name, problem.message, policy)
        self._unmounted[key] = problem.message
        return None, None

    def reconcile_pool(self, namespace: str, name: str) -> Outcome:
        """Apply every child of the pool and write its status.

        Returns an :class:`Outcome`: permanent for a spec the operator cannot act on
        (Degraded, reason InvalidSpec, the message naming the field) or a child the API
        server refuses; ``retry_after`` when a referenced checkpoint ConfigMap is missing.
        """
        with self._lock("pool", namespace, name):
            body = self.kube.get(*POOL, namespace, name)
            if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
                return Outcome(message="pool is gone")
            meta = body["metadata"]
            pool = PoolRef(name, namespace, meta["uid"], int(meta.get("generation", 1)))
            outcome = Outcome()
            problem: status.Problem | None = None
            extra: dict[str, Any] = {}
            spec = None
            try:
                spec = parse_pool_spec(body.get("spec"))
                check_pool(spec)
            except SpecError as e:
                problem = status.Problem("InvalidSpec", str(e))
                outcome = Outcome(ok=False, message=str(e), permanent=True)
            if problem is None:
                policy = spec.routing_policy()  # resolves every group's profile: once per reconcile
                ckpt, problem = self._load_checkpoint(pool, spec, policy)
                if problem is not None:
                    outcome = Outcome(ok=False, message=problem.message,
                                      retry_after=10.0)  # a fixed ConfigMap or spec is seen soon
            if problem is None:
                try:
                    children = builders.pool_children(pool, spec, self.settings, checkpoint=ckpt)
                except SpecError as e:
                    problem = status.Problem("InvalidSpec", str(e))
                    outcome = Outcome(ok=False, message=str(e), permanent=True)
            gateway_crd_missing = False
            if problem is None:
                for obj in children:
                    try:
                        stored = self.kube.apply(obj)
                    except ApiError as e:
                        if obj["kind"] == "InferencePool" and e.not_found:
                            # The GIE CRD is not installed: the InferencePoolReady condition says so and
                            # everything else is applied; retried until the CRD appears.
                            gateway_crd_missing = True
                            continue
                        what = f"{obj['kind']} {obj['metadata']['name']}: {e.message}"
                        field_ = builders.blame(obj, e.message, spec)
                        if field_:
                            what = f"{field_}: {what}"
                        problem = status.Problem("ApplyFailed", what)
                        outcome = Outcome(ok=False, message=what, permanent=e.permanent,
                                          retry_after=None if e.permanent else 10.0)
                        break
                    outcome.applied.append(f"{obj['kind']}/{obj['metadata']['name']}")
                    smeta = (stored or {}).get("metadata") or {}
                    if obj["kind"] == "Deployment" and smeta.get("uid"):
                        with self._guard:
                            self._applied_generations.setdefault((namespace, name), {})[smeta["uid"]] = \
                                int(smeta.get("generation", 0))
            if problem is None:
                problem = self._prune(pool, spec, outcome)
            if problem is None:
                problem = self._prune_optional(pool, spec, outcome)
            if problem is None and gateway_crd_missing:
                retry = self.settings.gateway_crd_retry_seconds
                outcome.ok, outcome.retry_after = False, retry
                outcome.message = (f"spec.gateway.inferencePool: the API server does not serve "
                                   f"{status.INFERENCE_POOL_CRD} (install the Gateway API Inference Extension CRDs); "
                                   f"everything else is applied, retrying in {retry:g} s")
            if problem is None:
                cm = next(c for c in children if c["kind"] == "ConfigMap")
                extra = {
                    "activePolicy": policy,
                    "servedModels": ",".join(spec.served_models()),
                    "activeProfile": profile_label(spec),
                    "activeCheckpoint": ckpt.config_map if ckpt else "",
                    "configHash": builders.short_hash(cm.get("data", {}) | cm.get("binaryData", {})),
                }
                if ckpt is not None and policy == "dqn":
                    # Only dqn loads it: a train job writes its checkpoint into a pool routed by
                    # another policy, whose routerd never reads it, so no shape can be wrong there.
                    mismatch = jobs.checkpoint_problem(ckpt, spec.total_replicas(), _replicas_field(spec))
                    if mismatch:
                        # Applied all the same: routerd falls back to round robin and says so.
                        problem = status.Problem("CheckpointMismatch", "spec.routing.checkpoint: " + mismatch)
            if spec is not None:
                extra["routerURL"] = builders.router_url(pool, spec)
            extra["selector"] = builders.selector_string(name, "engine")
            self._write_pool_status(pool, body, problem, extra)
            return outcome

    def _write_pool_status(self, pool: PoolRef, body: dict, problem: status.Problem | None,
                           extra: dict[str, Any]) -> None:
        try:
            spec = parse_pool_spec(body.get("spec"))
        except SpecError:
            spec = None  # the status then describes the Deployments that exist
        engine, groups, routerd, slices = self._observe(pool, spec)
        current = body.get("status") or {}
        picker_wanted = spec is not None and spec.picker
        picker = (self.kube.get("apps/v1", "Deployment", pool.namespace, builders.picker_name(pool.name))
                  if picker_wanted else None)
        now = now_rfc3339()
        previous = current.get("conditions") or []
        new = status.pool_status(engine=engine, groups=groups, routerd=routerd, slices=slices, problem=problem,
                                 generation=pool.generation, now=now, previous_conditions=previous,
                                 picker_wanted=picker_wanted, picker=picker)
        if spec is not None and spec.inference_pool:
            served = self.kube.serves(builders.INFERENCE_POOL_API, builders.INFERENCE_POOL_PLURAL)
            ip = (self.kube.get(builders.INFERENCE_POOL_API, "InferencePool", pool.namespace,
                                builders.inference_pool_name(pool.name)) if served else None)
            eps = new["endpoints"]
            new["conditions"] += status.gateway_conditions(
                crd_served=served, inference_pool=ip, name=builders.inference_pool_name(pool.name),
                selector=builders.selector_string(pool.name, "engine"), target_port=spec.target_port,
                ready_endpoints=sum(1 for e in eps if e.get("ready")), endpoints=len(eps), now=now,
                generation=pool.generation, previous=previous)
        if groups is None and current.get("engineGroups") is not None:
            new["engineGroups"] = None  # back to one model: the merge patch removes the list
        new.update(extra)
        if not status.same_status(current, new):
            self.kube.patch_status(*POOL, pool.namespace, pool.name, new)

    def deployment_changed(self, namespace: str, pool: str, deployment: dict) -> None:
        """A Deployment of the pool changed: re-apply the pool when someone else changed its spec (a
        hand edit, ``kubectl scale deployment``), else refresh the pool's status.

        The spec changed when its ``metadata.generation`` is past the one this operator's
        last apply returned. That check is repeated under the pool's lock, where an apply
        in flight has recorded its own generation, so the operator's own writes do not
        trigger a second reconcile.
        """
        meta = deployment.get("metadata") or {}
        uid, generation = meta.get("uid"), int(meta.get("generation", 0) or 0)

        def drifted() -> bool:
            with self._guard:
                known = self._applied_generations.get((namespace, pool), {}).get(uid)
            return known is not None and generation > known

        if uid and drifted():
            with self._lock("pool", namespace, pool):
                again = drifted()
            if again:
                log.info(f"Deployment {namespace}/{meta.get('name')} was changed by hand (generation "
                         f"{generation}): re-applying pool {pool}")
                self.reconcile_pool(namespace, pool)
                return
        self.refresh_pool_status(namespace, pool)

    def refresh_pool_status(self, namespace: str, name: str) -> None:
        """Rewrite the observed part of the status after a child changed (no apply).

        A Degraded problem found by the last reconcile of this generation is kept. Bursts
        coalesce: while one refresh of the pool waits for the lock (and so has read nothing
        yet), further ones return at once, since that one will see their changes.
        """
        key = (namespace, name)
        with self._guard:
            if key in self._refresh_pending:
                return
            self._refresh_pending.add(key)
        with self._lock("pool", namespace, name):
            with self._guard:
                self._refresh_pending.discard(key)
            body = self.kube.get(*POOL, namespace, name)
            if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
                return
            meta, current = body["metadata"], body.get("status") or {}
            generation = int(current.get("observedGeneration", 0))
            if not generation:
                return  # never reconciled yet: the reconcile writes the first status
            problem = None
            for c in current.get("conditions") or []:
                if c.get("type") == "Degraded" and c.get("status") == "True" and c.get("reason") in RECONCILE_PROBLEMS:
                    problem = status.Problem(c["reason"], c.get("message", ""))
            self._write_pool_status(PoolRef(name, namespace, meta["uid"], generation), body, problem, {})

    # ------------------------------------------------------------ jobs

    def _job_status(self, namespace: str, name: str, st: dict[str, Any], now: str, previous: dict) -> None:
        phase = st.get("phase") or "Pending"
        if st.get("message"):
            st["message"] = status.clip(st["message"])
        gen = int(st.get("observedGeneration", 1))
        prev = previous.get("conditions") or []
        st["conditions"] = [
            status.condition("Complete", phase == "Succeeded", phase, "", now=now, generation=gen, previous=prev),
            status.condition("Failed", phase == "Failed", phase, st.get("message", "") if phase == "Failed" else "",
                             now=now, generation=gen, previous=prev),
        ]
        if not status.same_status(previous, st):
            self.kube.patch_status(*JOB, namespace, name, st)

    def _stop_batch(self, namespace: str, name: str) -> None:
        """Suspend the job's batch Job if it exists and runs (its pods are terminated; nothing is deleted)."""
        batch = self.kube.get("batch/v1", "Job", namespace, name)
        if batch is None or jobs.job_phase(batch)[0] in ("Succeeded", "Failed") or \
                (batch.get("spec") or {}).get("suspend"):
            return
        try:
            self.kube.merge_patch("batch/v1", "Job", namespace, name, {"spec": {"suspend": True}})
        except ApiError as e:
            log.warning(f"suspending batch Job {namespace}/{name}: {e}")

    def reconcile_job(self, namespace: str, name: str) -> Outcome:
        """Start the batch Job once the pool is ready for it; when it ends, write results (and the pool).

        Returns ``retry_after`` while waiting (for the pool, a ready instance, or the
        batch Job), ok once the job is Succeeded or Failed.
        """
        with self._lock("job", namespace, name):
            body = self.kube.get(*JOB, namespace, name)
            if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
                return Outcome(message="job is gone")
            meta, previous = body["metadata"], body.get("status") or {}
            if previous.get("phase") in ("Succeeded", "Failed"):
                return Outcome(message=f"job already {previous['phase']}")
            now = now_rfc3339()
            gen = int(meta.get("generation", 1))
            st: dict[str, Any] = {"observedGeneration": gen}
            job = PoolRef(name, namespace, meta["uid"], gen)

            def fail(message: str) -> Outcome:
                st.update(phase="Failed", message=message, completionTime=now)
                self._job_status(namespace, name, st, now, previous)
                return Outcome(ok=False, message=message, permanent=True)

            def wait(message: str, after: float) -> Outcome:
                if _age_s(meta.get("creationTimestamp")) > spec.active_deadline_seconds:
                    return fail(f"gave up after spec.activeDeadlineSeconds={spec.active_deadline_seconds}: {message}")
                st.update(phase="Pending", message=message)
                self._job_status(namespace, name, st, now, previous)
                return Outcome(ok=False, message=message, retry_after=after)

            try:
                spec = parse_job_spec(body.get("spec"))
            except SpecError as e:
                return fail(str(e))
            pool_body = self.kube.get(*POOL, namespace, spec.pool_ref.name)
            if pool_body is None:
                msg = f"spec.poolRef.name: LLMRouterPool {spec.pool_ref.name!r} not found in namespace {namespace}"
                if _age_s(meta.get("creationTimestamp")) > self.settings.job_pool_grace_seconds:
                    self._stop_batch(namespace, name)  # deleted mid-run: its result has nowhere to go
                    return fail(msg)
                return wait(msg, 10.0)
            pmeta = pool_body["metadata"]
            pool = PoolRef(pmeta["name"], namespace, pmeta["uid"], int(pmeta.get("generation", 1)))
            try:
                pool_spec = parse_pool_spec(pool_body.get("spec"))
                check_pool(pool_spec)
            except SpecError as e:
                return fail(f"spec.poolRef.name: pool {pool.name} has an invalid spec: {e}")

            batch = self.kube.get("batch/v1", "Job", namespace, name)
            if batch is None:
                target = target_model = None
                if spec.task == "profile":
                    eps = status.endpoints(self.kube.list(
                        "discovery.k8s.io/v1", "EndpointSlice", namespace,
                        label_selector=f"kubernetes.io/service-name={builders.engine_name(pool.name)}"))
                    target, why = jobs.pick_target(eps, spec.profile_task.instance)
                    if target is None:
                        return wait(why, 10.0)
                    st["target"] = target
                    target_model = self._target_model(namespace, pool_spec, eps, target)
                elif self.kube.get("v1", "ConfigMap", namespace, builders.routerd_name(pool.name)) is None:
                    return wait(f"pool {pool.name} has no ConfigMap {builders.routerd_name(pool.name)} yet", 10.0)
                else:
                    st["target"] = f"pool {pool.name}: {pool_spec.total_replicas()} instances"
                try:
                    for obj in jobs.job_children(job, spec, pool, pool_spec, self.settings, target_url=target,
                                                 target_model=target_model):
                        self.kube.apply(obj)
                except ApiError as e:
                    if e.permanent:
                        return fail(f"creating the batch Job: {e.message}")
                    return wait(f"creating the batch Job: {e.message}", 10.0)
                st.update(phase="Running", jobName=name, message="", startTime=now)
                self._job_status(namespace, name, st, now, previous)
                return Outcome(ok=False, message="started", retry_after=self.settings.job_poll_seconds)

            st["jobName"] = name
            bstatus = batch.get("status") or {}
            if bstatus.get("startTime"):
                st["startTime"] = bstatus["startTime"]
            phase, msg = jobs.job_phase(batch)
            if phase in ("Running", "Pending"):
                st.update(phase="Running", message="")
                self._job_status(namespace, name, st, now, previous)
                return Outcome(ok=False, message="running", retry_after=self.settings.job_poll_seconds)
            if phase == "Failed":
                pods = self.kube.list("v1", "Pod", namespace, label_selector=f"batch.kubernetes.io/job-name={name}")
                detail = jobs.failure_detail(pods)
                return fail(msg + (f"; {detail}" if detail else ""))
            return self._finish_job(job, spec, pool, pool_spec, st, now, previous, bstatus)

    def _target_model(self, namespace: str, pool_spec, eps: list[dict], url: str) -> str | None:
        """The served model of the instance at ``url`` (a multi-model pool: from its pod's engine-group
        label); None = the pool's first model."""
        if not pool_spec.multi_model:
            return None
        pod_name = next((e["name"] for e in eps if e.get("url") == url), None)
        pod = self.kube.get("v1", "Pod", namespace, pod_name) if pod_name else None
        group = ((pod or {}).get("metadata", {}).get("labels") or {}).get(builders.LABEL_ENGINE_GROUP)
        return next((g.model.served for g in pool_spec.groups() if g.name == group), None)

    def _finish_job(self, job: PoolRef, spec, pool: PoolRef, pool_spec, st: dict, now: str, previous: dict,
                    bstatus: dict) -> Outcome:
        ns = job.namespace
        completed = bstatus.get("completionTime") or now

        def fail(message: str) -> Outcome:
            st.update(phase="Failed", message=message, completionTime=completed)
            self._job_status(ns, job.name, st, now, previous)
            return Outcome(ok=False, message=message, permanent=True)

        cm_name = jobs.result_configmap_name(job.name)
        cm = self.kube.get("v1", "ConfigMap", ns, cm_name)
        if cm is None:
            return fail(f"the batch Job succeeded but wrote no ConfigMap {cm_name}")
        results: dict[str, Any] = {"configMap": cm_name, "appliedToPool": False}
        try:
            if spec.task == "profile":
                inline, fit = jobs.profile_from_result(cm.get("data") or {}, pool, pool_spec)
                results["profile"] = inline
                if fit:
                    results["fit"] = fit
                if spec.apply:
                    self.kube.merge_patch(*POOL, ns, pool.name, jobs.profile_pool_patch(inline))
                    results["appliedToPool"] = True
            else:
                ckpt = jobs.checkpoint_from_configmap(cm)
                saved = jobs.checkpoint_configmap(job, pool, ckpt)
                self.kube.apply(saved)
                results["checkpoint"] = {"configMap": saved["metadata"]["name"], "evaluation": jobs.evaluation(ckpt)}
                if spec.apply:
                    self.kube.merge_patch(*POOL, ns, pool.name,
                                          jobs.checkpoint_pool_patch(saved["metadata"]["name"]))
                    results["appliedToPool"] = True
        except jobs.ResultError as e:
            st["results"] = results
            return fail(f"ConfigMap {cm_name}: {e}")
        except ApiError as e:
            if e.permanent or e.not_found:
                st["results"] = results
                return fail(f"writing the result into pool {pool.name}: {e.message}")
            return Outcome(ok=False, message=str(e), retry_after=10.0)
        st.update(phase="Succeeded", message="", completionTime=completed, results=results)
        self._job_status(ns, job.name, st, now, previous)
        return Outcome(message="succeeded")


def _replicas_field(spec) -> str:
    """Where a pool's instance count is set, for messages."""
    return "the engine groups' replicas (sum)" if spec.multi_model else "spec.engine.replicas"


# ---------------------------------------------------------------- periodic resync

def outranked(peers: dict[str, Any] | None, priority: int, now: dt.datetime | None = None) -> bool:
    """Whether a live peer in a kopf peering object's ``status`` has a higher priority than ``priority``.

    kopf pauses the event handlers of an outranked replica; the resync loop follows suit.
    A peer is live until ``lastseen + lifetime`` (kopf's rule, lifetime 60 s by default).
    """
    now = now or dt.datetime.now(dt.timezone.utc)
    for info in (peers or {}).values():
        if not isinstance(info, dict) or int(info.get("priority", 0)) <= priority:
            continue
        seen = info.get("lastseen")
        try:
            last = dt.datetime.fromisoformat(seen) if seen else now
        except ValueError:
            last = now
        if last.tzinfo is None:
            last = last.replace(tzinfo=dt.timezone.utc)
        if last + dt.timedelta(seconds=int(info.get("lifetime", 60))) > now:
            return True
    return False


class Resyncer:
    """A background thread: re-applies every pool each ``resync_seconds`` and carries unfinished jobs on
    each ``job_poll_seconds``.

    kopf timers would do the same per object, but kopf puts a finalizer on every object
    with a timer, so pools could not be deleted while the operator is down. This loop
    needs none. It skips its rounds while a live peer outranks this replica (the replica
    kopf pauses).
    """

    def __init__(self, controller: Controller, *, peering: str | None, priority: int, clusterwide: bool,
                 namespaces: tuple[str, ...]) -> None:
        self.c = controller
        self.peering = peering
        self.priority = priority
        self.clusterwide = clusterwide
        self.namespaces = namespaces
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phasewise-resync", daemon=True)
        self.rounds = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _scopes(self) -> list[str | None]:
        return [None] if self.clusterwide else list(self.namespaces)

    def active(self) -> bool:
        """False while a live peer with a higher priority exists (peering off: always True)."""
        if not self.peering:
            return True
        scopes = ([f"/apis/kopf.dev/v1/clusterkopfpeerings/{self.peering}"] if self.clusterwide else
                  [f"/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings/{self.peering}" for ns in self.namespaces])
        for url in scopes:
            try:
                obj = self.c.kube.request("GET", url)
            except ApiError:
                continue  # no peering object: kopf runs standalone too
            if outranked(obj.get("status"), self.priority):
                return False
        return True

    def _items(self, kind: str) -> list[dict]:
        out: list[dict] = []
        for ns in self._scopes():
            out += self.c.kube.list(API_VERSION, kind, ns)  # type: ignore[arg-type]
        return out

    def run_once(self, pools: bool, jobs_: bool) -> None:
        """One round: pools and/or unfinished jobs (errors are logged, never raised)."""
        if not self.active():
            return
        try:
            if jobs_:
                for j in self._items("LLMRouterJob"):
                    if (j.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                        self.c.reconcile_job(j["metadata"]["namespace"], j["metadata"]["name"])
            if pools:
                for p in self._items("LLMRouterPool"):
                    self.c.reconcile_pool(p["metadata"]["namespace"], p["metadata"]["name"])
        except ApiError as e:
            log.warning("resync: %s", e)
        except Exception:  # noqa: BLE001 - the loop must outlive any one bad round
            log.exception("resync round failed")
        self.rounds += 1

    def _run(self) -> None:
        s = self.c.settings
        next_pools = time.monotonic() + s.resync_seconds
        next_jobs = time.monotonic() + s.job_poll_seconds
        while not self._stop.wait(max(0.05, min(next_pools, next_jobs) - time.monotonic())):
            now = time.monotonic()
            pools, jobs_ = now >= next_pools, now >= next_jobs
            self.run_once(pools, jobs_)
            if pools:
                next_pools = time.monotonic() + s.resync_seconds
            if jobs_:
                next_jobs = time.monotonic() + s.job_poll_seconds
