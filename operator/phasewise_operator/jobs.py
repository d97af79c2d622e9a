"""An ``LLMRouterJob`` as a batch Job, and its results back into the pool: pure functions, no API calls.

How a job reports its results
-----------------------------
The batch Job's pod has two steps sharing an emptyDir at ``/results``:

1. the init container ``work`` (the routerd image; the trainer image for ``train``) runs
   ``phasewise profile --endpoint URL --model NAME --base-profile <pool's profile>
   --output /results/profile.yaml`` against one ready instance of the pool, or ``phasewise train ... --output
   /results/checkpoint`` with the pool's profile and replica count;
2. the container ``report`` (the operator image) runs ``python -m phasewise_operator.report``,
   which copies the files into the ConfigMap ``<job>-result`` owned by the LLMRouterJob
   (profile: ``profile.yaml`` and an optional ``fit.json``; train: ``model.safetensors``
   as binaryData and ``metadata.json``).

The pod's ServiceAccount ``<job>-reporter`` may only create ConfigMaps and get/update
``<job>-result`` in its namespace. When the batch Job completes, the operator reads the
ConfigMap, writes ``status.results`` and, with ``spec.apply``, the pool: a fitted
profile replaces ``spec.hardwareProfile`` with ``inline`` (``basedOn`` the profile it
refines); a checkpoint is copied to ``<job>-checkpoint``, a ConfigMap owned by the pool
(so it outlives the job), and named in ``spec.routing.checkpoint``. routerd reloads both
without a restart. A ConfigMap carries at most 1 MiB, ample for the DQN's weights.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Mapping

import yaml
from pydantic import ValidationError
from pydantic.alias_generators import to_camel

from phasewise_operator.builders import (
    KEY_PROFILE,
    LABEL_JOB,
    LABEL_POOL,
    PROFILE_FILE,
    Checkpoint,
    PoolRef,
    container_security_context,
    labels,
    owner_reference,
    pod_security_context,
    routerd_name,
)
from phasewise_operator.settings import OperatorSettings
from phasewise_operator.spec import InlineProfile, JobSpec, PoolSpec, SpecError, resolve_profile

RESULTS_DIR = "/results"
RESULT_PROFILE = "profile.yaml"
RESULT_FIT = "fit.json"
RESULT_MODEL = "model.safetensors"
RESULT_METADATA = "metadata.json"

_WORK_DEFAULT_RESOURCES = {
    "profile": {"requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
    "train": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "8Gi"}},
}
_REPORT_RESOURCES = {"requests": {"cpu": "20m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}}


class ResultError(ValueError):
    """A job's result ConfigMap is missing a file or holds something routerd would not accept."""


def reporter_name(job: str) -> str:
    """ServiceAccount, Role and RoleBinding of a job's reporter."""
    return f"{job}-reporter"


def result_configmap_name(job: str) -> str:
    """The ConfigMap a job's reporter writes."""
    return f"{job}-result"


def checkpoint_configmap_name(job: str) -> str:
    """The pool-owned ConfigMap a train job's checkpoint is copied to."""
    return f"{job}-checkpoint"


def _job_meta(job: PoolRef, name: str, pool: str) -> dict[str, Any]:
    lab = labels(pool, "job")
    lab[LABEL_JOB] = job.name
    return {"name": name, "namespace": job.namespace, "labels": lab,
            "ownerReferences": [owner_reference(job, kind="LLMRouterJob")]}


def reporter_rbac(job: PoolRef, pool: str) -> list[dict[str, Any]]:
    """The reporter's ServiceAccount, and a Role that lets it write only ``<job>-result``.

    RBAC cannot limit ``create`` by name, so ``create`` covers ConfigMaps of the namespace;
    everything else is limited to the one name.
    """
    name = reporter_name(job.name)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _job_meta(job, name, pool),
         "automountServiceAccountToken": False},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _job_meta(job, name, pool),
         "rules": [
             {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]},
             {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "update", "patch"],
              "resourceNames": [result_configmap_name(job.name)]},
         ]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": _job_meta(job, name, pool),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": job.namespace}]},
    ]


def work_command(spec: JobSpec, pool_spec: PoolSpec, *, target_url: str | None,
                 target_model: str | None = None) -> list[str]:
    """The ``phasewise`` command line of the work container.

    ``target_model``: the served model of the profiled instance (default: the pool's
    first model); a train job simulates all the pool's instances together.

    Raises:
        SpecError: a profile job without a target instance.
    """
    if spec.task == "profile":
        if not target_url:
            raise SpecError("spec.poolRef.name", "the pool has no ready instance to profile")
        # --base-profile: the pool's current profile supplies what no endpoint reports
        # (max_num_seqs, max_num_batched_tokens, chunked_prefill, grad2, heavy thresholds).
        model = target_model or pool_spec.groups()[0].model.served
        return ["phasewise", "profile", "--endpoint", target_url, "--model", model,
                "--base-profile", PROFILE_FILE, "--output", f"{RESULTS_DIR}/{RESULT_PROFILE}",
                *spec.profile_task.args]
    t = spec.train_task
    cmd = ["phasewise", "train", "--variant", t.variant, "--workload", t.workload,
           "--instances", str(pool_spec.total_replicas()), "--profile", PROFILE_FILE,
           "--episodes", str(t.episodes), "--requests-per-episode", str(t.requests_per_episode),
           "--prediction", t.prediction, "--seed", str(t.seed),
           "--output", f"{RESULTS_DIR}/checkpoint", "--quiet"]
    if t.rate is not None:
        cmd += ["--rate", f"{t.rate:g}"]
    return cmd + t.args


def batch_job(job: PoolRef, spec: JobSpec, pool: PoolRef, pool_spec: PoolSpec, settings: OperatorSettings, *,
              target_url: str | None, target_model: str | None = None) -> dict[str, Any]:
    """The batch Job running the task, owned by the LLMRouterJob.

    Raises:
        SpecError: from :func:`work_command`.
    """
    default_image = settings.trainer_image if spec.task == "train" else settings.routerd_image
    pull = spec.image_pull_policy or settings.image_pull_policy
    given = spec.resources.k8s()
    work = {
        "name": "work",
        "image": spec.image or default_image,
        "imagePullPolicy": pull,
        "command": work_command(spec, pool_spec, target_url=target_url, target_model=target_model),
        "env": [{"name": "HOME", "value": "/tmp"}],
        "resources": given or json.loads(json.dumps(_WORK_DEFAULT_RESOURCES[spec.task])),
        "volumeMounts": [{"name": "results", "mountPath": RESULTS_DIR}, {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": container_security_context(),
        # The last lines of a failed run's output become the termination message: the
        # operator shows it in status.message.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    volumes: list[dict[str, Any]] = [{"name": "results", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
    # Both tasks read the pool's current profile (profile: --base-profile; train: --profile).
    work["volumeMounts"].append({"name": "profile", "mountPath": "/etc/phasewise", "readOnly": True})
    volumes.append({"name": "profile", "configMap": {"name": routerd_name(pool.name),
                                                      "items": [{"key": KEY_PROFILE, "path": KEY_PROFILE}]}})
    report = {
        "name": "report",
        "image": settings.operator_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["python", "-m", "phasewise_operator.report"],
        "args": ["--results", RESULTS_DIR, "--task", spec.task, "--configmap", result_configmap_name(job.name)],
        "env": [
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "PHASEWISE_OWNER_NAME", "value": job.name},
            {"name": "PHASEWISE_OWNER_UID", "value": job.uid},
            {"name": "HOME", "value": "/tmp"},
        ],
        "resources": json.loads(json.dumps(_REPORT_RESOURCES)),
        "volumeMounts": [{"name": "results", "mountPath": RESULTS_DIR, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": container_security_context(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    meta = _job_meta(job, job.name, pool.name)
    pod_labels = dict(meta["labels"])
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "serviceAccountName": reporter_name(job.name),
        "automountServiceAccountToken": True,
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
        "initContainers": [work],
        "containers": [report],
        "volumes": volumes,
    }
    if pool_spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s.name} for s in pool_spec.image_pull_secrets]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": spec.backoff_limit,
            "activeDeadlineSeconds": spec.active_deadline_seconds,
            "template": {"metadata": {"labels": pod_labels}, "spec": pod_spec},
        },
    }


def job_children(job: PoolRef, spec: JobSpec, pool: PoolRef, pool_spec: PoolSpec, settings: OperatorSettings, *,
                 target_url: str | None, target_model: str | None = None) -> list[dict[str, Any]]:
    """Reporter RBAC, then the batch Job, in apply order.

    Raises:
        SpecError: from :func:`work_command`.
    """
    return [*reporter_rbac(job, pool.name),
            batch_job(job, spec, pool, pool_spec, settings, target_url=target_url, target_model=target_model)]


def pick_target(endpoints: list[Mapping[str, Any]], instance: str | None) -> tuple[str | None, str]:
    """The URL of the instance a profile job measures: ``instance`` if given, else the first ready one.

    Returns ``(url or None, why none)``.
    """
    ready = [e for e in endpoints if e.get("ready")]
    if instance:
        for e in ready:
            if e.get("name") == instance:
                return e["url"], ""
        return None, f"instance {instance!r} (spec.profile.instance) is not a ready endpoint of the pool"
    if not ready:
        return None, "the pool has no ready instance yet"
    return ready[0]["url"], ""


# ---------------------------------------------------------------- results

def job_phase(batch: Mapping[str, Any] | None) -> tuple[str, str]:
    """(phase, message) of a batch Job: Pending, Running, Succeeded or Failed."""
    if batch is None:
        return "Pending", "batch Job not created yet"
    for c in (batch.get("status") or {}).get("conditions") or []:
        if c.get("status") != "True":
            continue
        if c.get("type") == "Complete":
            return "Succeeded", ""
        if c.get("type") == "Failed":
            return "Failed", f"batch Job failed: {c.get('reason', '')}: {c.get('message', '')}".rstrip(": ")
    return "Running", ""


def failure_detail(pods: list[Mapping[str, Any]]) -> str:
    """The termination message of the newest failed container of the job's pods ("" if none)."""
    best: tuple[str, str] = ("", "")
    for pod in pods:
        st = pod.get("status") or {}
        for cs in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
            term = ((cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated"))
            if not term or term.get("exitCode", 0) == 0:
                continue
            msg = (term.get("message") or term.get("reason") or "").strip()
            when = term.get("finishedAt") or ""
            text = f"container {cs.get('name')} exited {term.get('exitCode')}" + (f": {msg}" if msg else "")
            if when >= best[0]:
                best = (when, text)
    return best[1][-2000:]


def profile_from_result(data: Mapping[str, str], pool: PoolRef, pool_spec: PoolSpec) -> tuple[dict[str, Any], dict]:
    """The fitted profile as ``hardwareProfile.inline`` (camelCase) and the fit figures.

    The profiler's ``profile.yaml`` holds routerd HardwareProfile terms (snake_case);
    ``grad1``, ``grad2`` and ``overhead_s`` at least. Terms it did not fit
    (e.g. ``kv_capacity_tokens``) keep the pool's current values; ``basedOn`` is the
    shipped profile the pool's current one is, or is based on.

    Raises:
        ResultError: no or unreadable ``profile.yaml``, a missing fitted term, or a
            merged profile routerd rejects (the message names the term).
    """
    text = data.get(RESULT_PROFILE)
    if not text:
        raise ResultError(f"the result has no {RESULT_PROFILE}")
    try:
        fitted = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ResultError(f"{RESULT_PROFILE} is not YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(fitted, dict):
        raise ResultError(f"{RESULT_PROFILE} is not a mapping of profile terms")
    for term in ("grad1", "grad2", "overhead_s"):
        if term not in fitted:
            raise ResultError(f"{RESULT_PROFILE} lacks the fitted term {term}")
    current = resolve_profile(pool_spec, pool_name=pool.name)
    ref = pool_spec.hardware_profile
    based_on = ref.name if ref.name is not None else ref.inline.based_on  # type: ignore[union-attr]
    terms = {k: v for k, v in current.model_dump().items() if k in InlineProfile.model_fields}
    terms.update({k: v for k, v in fitted.items() if k in InlineProfile.model_fields and k != "based_on"})
    terms["based_on"] = based_on
    terms["description"] = str(fitted.get("description") or f"fitted by phasewise profile for pool {pool.name}")[:1024]
    try:
        inline = InlineProfile.model_validate(terms)
        check = pool_spec.model_copy(update={"hardware_profile": pool_spec.hardware_profile.model_copy(
            update={"name": None, "inline": inline})})
        resolve_profile(check, pool_name=pool.name)
    except SpecError as e:
        raise ResultError(f"fitted profile rejected: {e.field.removeprefix('spec.hardwareProfile.')}: {e.message}") \
            from None
    except ValidationError as e:
        err = e.errors()[0]
        term = ".".join(str(x) for x in err["loc"])
        raise ResultError(f"fitted profile rejected: {to_camel(term)}={err.get('input')!r}: {err['msg']}") from None
    fit: dict = {}
    if data.get(RESULT_FIT):
        try:
            loaded = json.loads(data[RESULT_FIT])
            fit = loaded if isinstance(loaded, dict) else {"value": loaded}
        except json.JSONDecodeError:
            fit = {}
    return inline.wire(), fit


def checkpoint_from_configmap(cm: Mapping[str, Any]) -> Checkpoint:
    """A DQN checkpoint from a ConfigMap with ``model.safetensors`` (binaryData) and ``metadata.json`` (data).

    Raises:
        ResultError: a missing key, weights that are not base64, or metadata that is not a JSON object.
    """
    name = (cm.get("metadata") or {}).get("name", "?")
    model = (cm.get("binaryData") or {}).get(RESULT_MODEL)
    meta = (cm.get("data") or {}).get(RESULT_METADATA)
    if not model:
        raise ResultError(f"ConfigMap {name} has no binaryData {RESULT_MODEL}")
    if meta is None:
        raise ResultError(f"ConfigMap {name} has no data {RESULT_METADATA}")
    try:
        base64.b64decode(model, validate=True)
    except ValueError:
        raise ResultError(f"ConfigMap {name}: binaryData {RESULT_MODEL} is not base64") from None
    try:
        parsed = json.loads(meta)
    except json.JSONDecodeError as e:
        raise ResultError(f"ConfigMap {name}: {RESULT_METADATA} is not JSON ({e.msg})") from None
    if not isinstance(parsed, dict):
        raise ResultError(f"ConfigMap {name}: {RESULT_METADATA} is not a JSON object")
    # What routerd's load_checkpoint refuses, checked here so the pool says so (and the
    # operator never trips over a value of the wrong type further on).
    n = parsed.get("num_instances")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ResultError(f"ConfigMap {name}: {RESULT_METADATA} num_instances={n!r} is not a positive integer")
    from routerd.policies.dqn.checkpoint import FORMAT
    from routerd.policies.dqn.features import OBS_VERSION

    for key, want in (("format", FORMAT), ("obs_version", OBS_VERSION)):
        if key in parsed and parsed[key] != want:
            raise ResultError(f"ConfigMap {name}: {RESULT_METADATA} {key} is {parsed[key]!r}, routerd expects "
                              f"{want!r} (retrain with a train LLMRouterJob)")
    return Checkpoint(config_map=name, model_b64=model, metadata_json=meta)


def checkpoint_problem(ckpt: Checkpoint, replicas: int, field: str = "spec.engine.replicas") -> str | None:
    """Why routerd would refuse the checkpoint for a pool of ``replicas`` instances (set at ``field``), or None."""
    n = json.loads(ckpt.metadata_json).get("num_instances")
    if n != replicas:
        return (f"checkpoint {ckpt.config_map} was trained for {n} instances; {field} is {replicas} "
                "(routerd refuses it and routes round robin)")
    return None


def checkpoint_configmap(job: PoolRef, pool: PoolRef, ckpt: Checkpoint) -> dict[str, Any]:
    """``<job>-checkpoint``: the trained checkpoint, owned by the pool so it outlives the job."""
    lab = labels(pool.name, "checkpoint")
    lab[LABEL_JOB] = job.name
    lab[LABEL_POOL] = pool.name
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": checkpoint_configmap_name(job.name), "namespace": pool.namespace, "labels": lab,
                         "ownerReferences": [owner_reference(pool)]},
            "data": {RESULT_METADATA: ckpt.metadata_json},
            "binaryData": {RESULT_MODEL: ckpt.model_b64}}


def evaluation(ckpt: Checkpoint) -> dict[str, Any]:
    """The checkpoint's held-out figures (``metadata.json`` ``evaluation``) with its variant and instances."""
    meta = json.loads(ckpt.metadata_json)
    out = {k: meta[k] for k in ("variant", "num_instances", "profile", "workload") if k in meta}
    ev = meta.get("evaluation")
    if isinstance(ev, dict):
        out.update(ev)
    return out


def profile_pool_patch(inline: Mapping[str, Any]) -> dict[str, Any]:
    """Merge patch of the pool writing a fitted profile (``name`` removed: exactly one of the two)."""
    return {"spec": {"hardwareProfile": {"name": None, "inline": dict(inline)}}}


def checkpoint_pool_patch(config_map: str) -> dict[str, Any]:
    """Merge patch of the pool naming a new DQN checkpoint."""
    return {"spec": {"routing": {"checkpoint": {"configMap": config_map}}}}
