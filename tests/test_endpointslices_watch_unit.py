"""The EndpointSlice watcher's own watch loop against a scripted API (no API server): every
watch response it opens is closed, one that arrives after ``stop()`` included (issue 19),
and ERROR events and HTTP errors surface as :class:`WatchError` with their status."""

from __future__ import annotations

import json

import pytest

from routerd.daemon.endpointslices import EndpointSliceWatcher, WatchError


class FakeResponse:
    def __init__(self, status=200, events=(), reason="OK"):
        self.status, self.reason = status, reason
        self._body = b"".join(json.dumps(e).encode() + b"\n" for e in events)
        self.closed = self.released = 0
        self.connection = None

    def stream(self, amt=None, decode_content=False):
        yield self._body

    def close(self):
        self.closed += 1

    def release_conn(self):
        self.released += 1


class ScriptedApi:
    def __init__(self, watcher, response, stop_during_call=False):
        self.watcher, self.response, self.stop_during_call = watcher, response, stop_during_call

    def list_namespaced_endpoint_slice(self, namespace, **kw):
        assert kw["watch"] is True and kw["_preload_content"] is False
        if self.stop_during_call:
            self.watcher._stop.set()  # stop() lands while the watch request is in flight
        return self.response


def _watcher(updates):
    return EndpointSliceWatcher("ns", "svc", updates.append, api_client=object())


def _slice(name, rv, ip):
    return {"metadata": {"name": name, "resourceVersion": rv},
            "ports": [{"name": "http", "port": 8000}],
            "endpoints": [{"addresses": [ip], "targetRef": {"name": name + "-pod"}}]}


def test_a_watch_that_arrives_after_stop_is_closed_at_once_without_reading():
    updates = []
    w = _watcher(updates)
    resp = FakeResponse(events=[{"type": "ADDED", "object": _slice("a", "7", "10.0.0.1")}])
    w._api = ScriptedApi(w, resp, stop_during_call=True)
    assert w._watch_from("5") == "5"  # nothing read: resourceVersion unchanged
    assert (resp.closed, resp.released) == (1, 1)
    assert updates == [] and w._resp is None


def test_events_are_applied_and_the_response_closed_when_the_watch_ends():
    updates = []
    w = _watcher(updates)
    resp = FakeResponse(events=[
        {"type": "ADDED", "object": _slice("a", "7", "10.0.0.1")},
        {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}},
        {"type": "DELETED", "object": _slice("a", "11", "10.0.0.1")},
    ])
    w._api = ScriptedApi(w, resp)
    assert w._watch_from("5") == "11"
    assert [[e.url for e in u] for u in updates] == [["http://10.0.0.1:8000"], []]
    assert (resp.closed, resp.released) == (1, 1)


@pytest.mark.parametrize("resp, status", [
    (FakeResponse(events=[{"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired",
                                                        "message": "too old resource version"}}]), 410),
    (FakeResponse(status=403, reason="Forbidden"), 403),
])
def test_errors_raise_watch_error_with_the_status_and_still_close(resp, status):
    w = _watcher([])
    w._api = ScriptedApi(w, resp)
    with pytest.raises(WatchError, match=f"HTTP {status}") as e:
        w._watch_from("5")
    assert e.value.status == status
    assert (resp.closed, resp.released) == (1, 1)


def test_an_unknown_event_type_is_an_error():
    w = _watcher([])
    resp = FakeResponse(events=[{"type": "SURPRISE", "object": {}}])
    w._api = ScriptedApi(w, resp)
    with pytest.raises(RuntimeError, match="unexpected watch event 'SURPRISE'"):
        w._watch_from("5")
    assert resp.closed == 1


def test_a_given_client_is_copied_into_a_private_one_without_urllib3_retries():
    client = pytest.importorskip("kubernetes.client")
    cfg = client.Configuration()
    cfg.host = "https://127.0.0.1:6443"
    cfg.retries = 5
    given = client.ApiClient(cfg)
    w = EndpointSliceWatcher("ns", "svc", lambda eps: None, api_client=given,
                             backoff_initial_s=0.01, backoff_max_s=0.02)
    w._run = lambda: None  # no thread work: only what start() builds is checked
    w.start()
    own = w._api_client
    assert own is not given and w._owns_client
    assert own.configuration.host == cfg.host and own.configuration.retries is False
    assert given.configuration.retries == 5  # the caller's configuration is untouched
    w.stop()
    assert w._api_client is None  # the private client was closed
    given.close()
