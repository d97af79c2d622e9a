"""kopf handlers: the thin layer between kopf's events and :class:`~phasewise_operator.reconcile.Controller`.

Pools
  create, update (of ``spec``) and resume (operator start) reconcile the pool; events of
  the pool's Deployments, EndpointSlices and InferencePool refresh its status (a deleted child triggers a
  full reconcile, which recreates it); the :class:`~phasewise_operator.reconcile.Resyncer`
  thread re-applies every pool each ``PHASEWISE_RESYNC_SECONDS`` (drift repair). Deletion
  needs no handler: every child carries the pool as controller owner reference, so the
  garbage collector deletes them. No finalizer blocks ``kubectl delete``, even with the
  operator down (kopf timers would add one, hence the thread).

Jobs
  create and resume start the batch Job when the pool is ready for it; events of the
  batch Job, and the resync thread each ``PHASEWISE_JOB_POLL_SECONDS`` while the job is
  not finished, carry it to Succeeded or Failed and write the results back.

A spec that cannot work raises :class:`kopf.PermanentError` after the status says why
(Degraded / Failed, naming the field): kopf then waits for the next spec change instead
of retrying. A missing checkpoint ConfigMap or a transient API error is a
:class:`kopf.TemporaryError` with a delay.

kopf keeps its bookkeeping in annotations under ``phasewise.io/`` (not in ``status``,
whose schema is strict), watches only objects labelled by the operator (server-side
label selectors) and does not scan CRDs or namespaces (no cluster-wide list rights
needed); it waits at start until the CRDs are served.
"""

from __future__ import annotations

import functools
import logging
import time

import kopf

from phasewise_operator.builders import LABEL_JOB, LABEL_MANAGED_BY, LABEL_POOL, MANAGED_BY
from phasewise_operator.gen_crds import GROUP, VERSION
from phasewise_operator.kube import ApiError, Kube
from phasewise_operator.reconcile import Controller, Outcome, Resyncer
from phasewise_operator.settings import from_env

log = logging.getLogger("phasewise_operator")

POOLS = "llmrouterpools"
JOBS = "llmrouterjobs"

CRD_WAIT_S = 120.0


class DigestDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """kopf's last-handled-configuration annotation, holding a SHA-256 of each top-level stanza.

    kopf keeps the whole spec in an annotation to tell spec changes from others, but all
    annotations of an object share 256 KiB: a large spec that the API server accepts
    (long env values or arguments, applied server-side) would make every kopf write
    fail and retry forever. The handlers need only whether ``spec`` changed, which the
    digest tells just as well, in a hundred bytes.
    """

    def build(self, *, body, extra_fields=None):
        import hashlib
        import json

        essence = super().build(body=body, extra_fields=extra_fields)
        return {k: {"sha256": hashlib.sha256(json.dumps(v, sort_keys=True, separators=(",", ":"))
                                             .encode()).hexdigest()}
                for k, v in essence.items()}


def _wait_for_crds(kube: Kube, timeout: float = CRD_WAIT_S) -> None:
    """Block until ``phasewise.io/v1alpha1`` serves both kinds (kopf resolves resources once, at start)."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        try:
            found = {r.get("name") for r in kube.request("GET", f"/apis/{GROUP}/{VERSION}").get("resources", [])}
            if {POOLS, JOBS} <= found:
                return
            last = f"served: {sorted(found)}"
        except ApiError as e:
            last = str(e)
        if time.monotonic() > deadline:
            raise kopf.PermanentError(f"CRDs {POOLS}.{GROUP} and {JOBS}.{GROUP} are not served ({last}); "
                                      "install them (crds/ or the Helm chart)")
        time.sleep(1.0)


@kopf.on.login()
def login(**kwargs) -> kopf.ConnectionInfo | None:
    """In-cluster ServiceAccount, else ``$KUBECONFIG`` as it is now.

    kopf's default login through the kubernetes client library reads KUBECONFIG once, when
    that library is imported; these read it at each (re-)login, also after a 401.
    """
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_) -> None:
    """kopf settings and the shared :class:`Controller` (in ``memo``)."""
    ops = from_env()
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = DigestDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.scanning.disabled = True
    settings.posting.level = logging.WARNING  # Events only for problems, not every success
    settings.watching.label_selectors["apps", "v1", "deployments"] = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
    settings.watching.label_selectors["discovery.k8s.io", "v1", "endpointslices"] = LABEL_POOL
    settings.watching.label_selectors["batch", "v1", "jobs"] = LABEL_JOB
    settings.watching.label_selectors["inference.networking.k8s.io", "v1", "inferencepools"] = \
        f"{LABEL_MANAGED_BY}={MANAGED_BY}"
    settings.execution.max_workers = 16
    if not settings.peering.mandatory:  # `kopf run --peering NAME` (mandatory) names it itself
        settings.peering.name = ops.peering
    kube = Kube.from_environment(ops.field_manager)
    _wait_for_crds(kube)
    memo.controller = Controller(kube, ops)
    peering = None if settings.peering.standalone else settings.peering.name
    memo.resyncer = Resyncer(memo.controller, peering=peering, priority=settings.peering.priority,
                             clusterwide=ops.clusterwide, namespaces=ops.namespaces)
    memo.resyncer.start()
    logger.info(f"phasewise operator: namespaces {list(ops.namespaces) or 'all'}, routerd image "
                f"{ops.routerd_image}, resync every {ops.resync_seconds:g} s")


@kopf.on.cleanup()
def close(memo: kopf.Memo, **_) -> None:
    """Stop the resync loop and close the API connection pool."""
    resyncer = getattr(memo, "resyncer", None)
    if resyncer is not None:
        resyncer.stop()
    controller = getattr(memo, "controller", None)
    if controller is not None:
        controller.kube.close()


def _raise_for(outcome: Outcome) -> None:
    if outcome.ok:
        return
    if outcome.permanent:
        raise kopf.PermanentError(outcome.message)
    raise kopf.TemporaryError(outcome.message, delay=outcome.retry_after or 10.0)


def _api_errors(fn):
    """An API error from the reconcile itself: permanent ones stop, others retry in 10 s."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ApiError as e:
            if e.permanent:
                raise kopf.PermanentError(str(e)) from None
            raise kopf.TemporaryError(str(e), delay=10.0) from None
    return wrapper


# ---------------------------------------------------------------- pools

@kopf.on.create(GROUP, VERSION, POOLS, id="reconcile", backoff=5)
@kopf.on.update(GROUP, VERSION, POOLS, id="reconcile", field="spec", backoff=5)
@kopf.on.resume(GROUP, VERSION, POOLS, id="reconcile", backoff=5)
@_api_errors
def reconcile_pool(namespace: str, name: str, memo: kopf.Memo, **_) -> None:
    """Apply the pool's children and write its status."""
    _raise_for(memo.controller.reconcile_pool(namespace, name))


@kopf.on.delete(GROUP, VERSION, POOLS, id="forget", optional=True)
def forget_pool(namespace: str, name: str, memo: kopf.Memo, **_) -> None:
    """Drop the pool's lock; the garbage collector deletes the children (no finalizer)."""
    memo.controller.forget("pool", namespace, name)


def _child_event(event: dict, namespace: str, labels: dict, memo: kopf.Memo, logger: logging.Logger,
                 deployment: bool = False) -> None:
    pool = labels.get(LABEL_POOL)
    if not pool or not hasattr(memo, "controller"):
        return
    try:
        if event.get("type") == "DELETED":
            memo.controller.reconcile_pool(namespace, pool)
        elif deployment and isinstance(event.get("object"), dict):
            memo.controller.deployment_changed(namespace, pool, event["object"])
        else:
            memo.controller.refresh_pool_status(namespace, pool)
    except ApiError as e:
        logger.warning(f"status of pool {namespace}/{pool}: {e}")


@kopf.on.event("apps", "v1", "deployments", labels={LABEL_MANAGED_BY: MANAGED_BY, LABEL_POOL: kopf.PRESENT})
def deployment_event(event: dict, namespace: str, labels: dict, memo: kopf.Memo, logger: logging.Logger,
                     **_) -> None:
    """A pool's Deployment changed: refresh the pool's status (recreate it if it was deleted, re-apply it
    if it was edited by hand)."""
    _child_event(event, namespace, labels, memo, logger, deployment=True)


@kopf.on.event("discovery.k8s.io", "v1", "endpointslices", labels={LABEL_POOL: kopf.PRESENT})
def endpointslice_event(event: dict, namespace: str, labels: dict, memo: kopf.Memo, logger: logging.Logger,
                        **_) -> None:
    """The engine Service's endpoints changed (the controller copies the Service's labels): refresh status."""
    if event.get("type") == "DELETED":
        return  # a slice going away is not a child the operator recreates
    _child_event(event, namespace, labels, memo, logger)


@kopf.on.event("inference.networking.k8s.io", "v1", "inferencepools",
               labels={LABEL_MANAGED_BY: MANAGED_BY, LABEL_POOL: kopf.PRESENT})
def inferencepool_event(event: dict, namespace: str, labels: dict, memo: kopf.Memo, logger: logging.Logger,
                        **_) -> None:
    """A gateway wrote the InferencePool's status.parents (or it was deleted): refresh the pool's
    GatewayAccepted condition (recreate it).

    Without the Gateway API Inference Extension CRD at the operator's start kopf only warns
    ("Unresolved resources") and serves the rest; the resync thread then carries the
    InferencePool and its status.
    """
    _child_event(event, namespace, labels, memo, logger)


# ---------------------------------------------------------------- jobs

@kopf.on.create(GROUP, VERSION, JOBS, id="run", backoff=5)
@kopf.on.resume(GROUP, VERSION, JOBS, id="run", backoff=5)
@_api_errors
def run_job(namespace: str, name: str, memo: kopf.Memo, **_) -> None:
    """Start the batch Job once the pool can take it; retried until it is started (or failed)."""
    outcome = memo.controller.reconcile_job(namespace, name)
    if outcome.message in ("started", "running"):
        return  # from here the batch Job's events and the resync thread carry the job on
    _raise_for(outcome)


@kopf.on.event("batch", "v1", "jobs", labels={LABEL_JOB: kopf.PRESENT})
def batch_job_event(event: dict, namespace: str, labels: dict, memo: kopf.Memo, logger: logging.Logger,
                    **_) -> None:
    """The batch Job of an LLMRouterJob changed: carry the LLMRouterJob on."""
    if event.get("type") == "DELETED" or not hasattr(memo, "controller"):
        return
    try:
        memo.controller.reconcile_job(namespace, labels[LABEL_JOB])
    except ApiError as e:
        logger.warning(f"job {namespace}/{labels[LABEL_JOB]}: {e}")


@kopf.on.delete(GROUP, VERSION, JOBS, id="forget", optional=True)
def forget_job(namespace: str, name: str, memo: kopf.Memo, **_) -> None:
    """Drop the job's lock; its batch Job, reporter RBAC and result ConfigMap go with it (owner references)."""
    memo.controller.forget("job", namespace, name)
