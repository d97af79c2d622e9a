"""The one module that talks to the Kubernetes API server.

Children are written with server-side apply (``PATCH`` with
``application/apply-patch+yaml``, field manager ``phasewise-operator``, ``force=true``):
applying the same manifest twice changes nothing, fields the operator stopped setting
are removed, and a hand edit of a field the operator owns is put back at the next
reconcile. Status is written with a JSON merge patch on the ``status`` subresource.

Paths come from a fixed table of the kinds the operator touches, so no API discovery
round trip is needed at start.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping
from urllib.parse import quote

from phasewise_operator.gen_crds import API_VERSION

log = logging.getLogger("phasewise_operator.kube")

RESOURCES: dict[tuple[str, str], str] = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Service"): "services",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "Pod"): "pods",
    ("v1", "Event"): "events",
    ("apps/v1", "Deployment"): "deployments",
    ("batch/v1", "Job"): "jobs",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("discovery.k8s.io/v1", "EndpointSlice"): "endpointslices",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepools",
    (API_VERSION, "LLMRouterPool"): "llmrouterpools",
    (API_VERSION, "LLMRouterJob"): "llmrouterjobs",
}
"""(apiVersion, kind) -> plural of every namespaced kind the operator reads or writes."""


@dataclass
class ApiError(Exception):
    """The API server refused a request; ``message`` is its own explanation (naming the field)."""

    status: int
    reason: str
    message: str
    causes: list[dict[str, Any]] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.status} {self.reason}: {self.message}"

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def permanent(self) -> bool:
        """Whether retrying the same request cannot help (invalid, unsupported, ...). 403 is not:
        RBAC changes without the spec changing (a Role granted late, or still propagating right
        after ``helm install``), so a forbidden call is retried with the transient errors' delay
        instead of waiting for the next resync."""
        return self.status in (400, 405, 415, 422)


def path(api_version: str, kind: str, namespace: str | None, name: str | None = None,
         subresource: str | None = None) -> str:
    """The REST path of an object (or of the collection when ``name`` is None).

    Raises:
        KeyError: a kind not in :data:`RESOURCES`.
    """
    plural = RESOURCES[(api_version, kind)]
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespace is not None:
        base += f"/namespaces/{quote(namespace, safe='')}"
    base += f"/{plural}"
    if name is not None:
        base += f"/{quote(name, safe='')}"
        if subresource:
            base += f"/{subresource}"
    return base


def _error(status: int, body: bytes | str | None) -> ApiError:
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else (body or "")
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, ValueError):
        data = None
    if isinstance(data, dict) and data.get("kind") == "Status":
        return ApiError(status, str(data.get("reason") or ""), str(data.get("message") or text),
                        list((data.get("details") or {}).get("causes") or []))
    return ApiError(status, "", text[:500] or f"HTTP {status}")


class Kube:
    """A thin JSON client over ``kubernetes.client.ApiClient`` (thread-safe; kopf runs sync handlers in threads)."""

    def __init__(self, api_client, field_manager: str = "phasewise-operator") -> None:
        self.api = api_client
        self.field_manager = field_manager

    @classmethod
    def from_environment(cls, field_manager: str = "phasewise-operator") -> "Kube":
        """In-cluster credentials when running in a pod, else the kubeconfig (``KUBECONFIG``)."""
        from kubernetes import client, config

        cfg = client.Configuration()
        try:
            # Re-reads the projected token when it rotates (bound tokens expire).
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException:
            # KUBECONFIG as it is now: the client library reads it once, at its import.
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None, client_configuration=cfg)
        # kopf runs up to 16 sync handlers at once, each holding a connection.
        cfg.connection_pool_maxsize = 32
        return cls(client.ApiClient(cfg), field_manager)

    def close(self) -> None:
        """Close the underlying connection pool."""
        self.api.close()

    # ------------------------------------------------------------ transport

    def request(self, method: str, url_path: str, *, query: Iterable[tuple[str, Any]] = (),
                body: Any = None, content_type: str = "application/json") -> dict[str, Any]:
        """One API call; the decoded JSON response ({} when empty).

        Raises:
            ApiError: any non-2xx answer.
        """
        from kubernetes.client.exceptions import ApiException

        headers = {"Accept": "application/json"}
        if body is not None:
            # The REST client serialises a dict body as JSON for +json and +yaml types alike
            # (JSON is YAML), so apply patches go out as JSON.
            headers["Content-Type"] = content_type
        req = self.api.param_serialize(method, url_path, query_params=list(query), header_params=headers,
                                       body=body, auth_settings=["BearerToken"])
        try:
            resp = self.api.call_api(*req)
            resp.read()
        except ApiException as e:
            raise _error(e.status or 0, e.body) from None
        if not 200 <= resp.status <= 299:
            raise _error(resp.status, resp.data)
        return json.loads(resp.data) if resp.data else {}

    # ------------------------------------------------------------ verbs

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return self.request("GET", path(api_version, kind, namespace, name))
        except ApiError as e:
            if e.not_found:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str | None, *,
             label_selector: str | None = None) -> list[dict[str, Any]]:
        """Every object of a kind in a namespace, or in all when ``namespace`` is None (optionally
        matching a label selector)."""
        query = [("labelSelector", label_selector)] if label_selector else []
        items: list[dict[str, Any]] = []
        cont = None
        while True:
            q = list(query) + ([("continue", cont)] if cont else []) + [("limit", 500)]
            page = self.request("GET", path(api_version, kind, namespace), query=q)
            items += page.get("items") or []
            cont = (page.get("metadata") or {}).get("continue")
            if not cont:
                return items

    def serves(self, api_version: str, plural: str) -> bool:
        """Whether the API server serves ``plural`` in ``api_version`` (its CRD is installed and established).

        Discovery, readable by every authenticated user (``system:discovery``): a 404 of the
        group/version means the CRD is not installed, which a 404 of one object cannot tell apart.
        """
        try:
            found = self.request("GET", f"/apis/{api_version}")
        except ApiError as e:
            if e.not_found:
                return False
            raise
        return any(r.get("name") == plural for r in found.get("resources") or [])

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply ``obj`` (created when absent); the object as stored."""
        meta = obj["metadata"]
        return self.request(
            "PATCH", path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"]),
            query=[("fieldManager", self.field_manager), ("force", "true")],
            body=obj, content_type="application/apply-patch+yaml")

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Create ``obj``. Raises :class:`ApiError` (409 when it exists)."""
        meta = obj["metadata"]
        return self.request("POST", path(obj["apiVersion"], obj["kind"], meta.get("namespace")),
                            query=[("fieldManager", self.field_manager)], body=obj)

    def merge_patch(self, api_version: str, kind: str, namespace: str, name: str, patch: Mapping[str, Any], *,
                    subresource: str | None = None) -> dict[str, Any]:
        """JSON merge patch (RFC 7386) of an object or of its ``subresource`` (e.g. ``status``)."""
        return self.request("PATCH", path(api_version, kind, namespace, name, subresource),
                            query=[("fieldManager", self.field_manager)], body=patch,
                            content_type="application/merge-patch+json")

    def patch_status(self, api_version: str, kind: str, namespace: str, name: str,
                     status: Mapping[str, Any]) -> dict[str, Any] | None:
        """Merge ``status`` into the object's status subresource; None when the object is gone."""
        try:
            return self.merge_patch(api_version, kind, namespace, name, {"status": dict(status)},
                                    subresource="status")
        except ApiError as e:
            if e.not_found:
                return None
            raise

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Delete in the foreground's absence (background propagation); False when already gone."""
        try:
            self.request("DELETE", path(api_version, kind, namespace, name),
                         body={"propagationPolicy": "Background"})
            return True
        except ApiError as e:
            if e.not_found:
                return False
            raise
