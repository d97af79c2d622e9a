"""The API client's pure parts (REST paths, Status errors) and the resync loop's peering rule."""

from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "operator"))

from phasewise_operator.kube import _error, path  # noqa: E402
from phasewise_operator.reconcile import outranked  # noqa: E402


def test_paths():
    assert path("v1", "ConfigMap", "ns", "c") == "/api/v1/namespaces/ns/configmaps/c"
    assert path("apps/v1", "Deployment", "ns") == "/apis/apps/v1/namespaces/ns/deployments"
    assert path("phasewise.io/v1alpha1", "LLMRouterPool", "ns", "p", "status") == \
        "/apis/phasewise.io/v1alpha1/namespaces/ns/llmrouterpools/p/status"
    assert path("phasewise.io/v1alpha1", "LLMRouterJob", None) == "/apis/phasewise.io/v1alpha1/llmrouterjobs"


def test_status_errors_keep_the_servers_message():
    body = json.dumps({"kind": "Status", "status": "Failure", "reason": "Invalid", "code": 422,
                       "message": 'Deployment.apps "x" is invalid: spec.template.spec.containers[0].image: Required value',
                       "details": {"causes": [{"field": "spec.template.spec.containers[0].image"}]}})
    e = _error(422, body.encode())
    assert e.permanent and not e.not_found and e.reason == "Invalid"
    assert "containers[0].image: Required value" in e.message
    assert e.causes == [{"field": "spec.template.spec.containers[0].image"}]
    assert _error(404, b"").not_found
    assert not _error(503, "<html>busy</html>").permanent
    # Forbidden is retried: a Role granted late (or still propagating after helm install) must not
    # leave the pool stopped until the next resync.
    forbidden = json.dumps({"kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403,
                            "message": 'services is forbidden: User "system:serviceaccount:p:op" cannot list '
                                       'resource "services"'})
    assert not _error(403, forbidden.encode()).permanent
    assert _error(503, "<html>busy</html>").message == "<html>busy</html>"


def test_outranked_by_live_higher_priority_peers_only():
    now = dt.datetime(2026, 11, 30, 2, 0, 0, tzinfo=dt.timezone.utc)
    fresh = (now - dt.timedelta(seconds=10)).isoformat()
    stale = (now - dt.timedelta(seconds=61)).isoformat()
    assert outranked({"a@h": {"priority": 7, "lifetime": 60, "lastseen": fresh}}, 5, now)
    assert not outranked({"a@h": {"priority": 7, "lifetime": 60, "lastseen": stale}}, 5, now)  # dead peer
    assert not outranked({"a@h": {"priority": 5, "lifetime": 60, "lastseen": fresh}}, 5, now)  # self or a tie
    assert not outranked({"a@h": {"priority": 3, "lifetime": 60, "lastseen": fresh}}, 5, now)
    assert not outranked(None, 5, now) and not outranked({}, 5, now)
