"""EndpointSlices -> routerd endpoints: the pure translation, table-driven (no API server)."""

from __future__ import annotations

import pytest

from routerd.daemon.discovery import DiscoveredEndpoint as E
from routerd.daemon.endpointslices import endpoints_from_slices

HTTP_STATE = [{"name": "http", "port": 8000, "protocol": "TCP"},
              {"name": "state", "port": 50051, "protocol": "TCP"}]


def ep(addr, pod=None, **cond):
    e = {"addresses": [addr], "conditions": cond}
    if pod:
        e["targetRef"] = {"kind": "Pod", "name": pod, "namespace": "ns"}
    return e


def sl(name, endpoints, ports=HTTP_STATE, family="IPv4", labels=None):
    meta = {"name": name} if labels is None else {"name": name, "labels": labels}
    return {"metadata": meta, "addressType": family, "ports": ports, "endpoints": endpoints}


GROUP = "phasewise.io/engine-group"
MIXED = {"profile_label": GROUP, "profiles": {"a100": "llama3.1-8b-a100", "h100": "/etc/routerd/profile-h100.yaml"}}


CASES = {
    "empty": ([], {}, []),
    "one ready pod with sidecar": (
        [sl("s1", [ep("10.0.0.7", "vllm-0", ready=True)])], {},
        [E("vllm-0", "http://10.0.0.7:8000", "10.0.0.7:50051", True)]),
    "conditions absent count as ready": (
        [sl("s1", [{"addresses": ["10.0.0.7"], "targetRef": {"name": "p"}}])], {},
        [E("p", "http://10.0.0.7:8000", "10.0.0.7:50051", True)]),
    "ready None counts as ready": (
        [sl("s1", [ep("10.0.0.7", "p", ready=None, serving=None)])], {},
        [E("p", "http://10.0.0.7:8000", "10.0.0.7:50051", True)]),
    "not ready": (
        [sl("s1", [ep("10.0.0.7", "p", ready=False)])], {},
        [E("p", "http://10.0.0.7:8000", "10.0.0.7:50051", False)]),
    "terminating but still serving is not ready": (
        [sl("s1", [ep("10.0.0.7", "p", ready=False, serving=True, terminating=True)])], {},
        [E("p", "http://10.0.0.7:8000", "10.0.0.7:50051", False)]),
    "terminating wins over ready=True": (
        [sl("s1", [ep("10.0.0.7", "p", ready=True, terminating=True)])], {},
        [E("p", "http://10.0.0.7:8000", "10.0.0.7:50051", False)]),
    "terminating False is ready": (
        [sl("s1", [ep("10.0.0.7", "p", ready=True, terminating=False)])], {},
        [E("p", "http://10.0.0.7:8000", "10.0.0.7:50051", True)]),
    "no targetRef: the address is the name": (
        [sl("s1", [ep("10.0.0.9")])], {},
        [E("10.0.0.9", "http://10.0.0.9:8000", "10.0.0.9:50051", True)]),
    "IPv6 in brackets": (
        [sl("s1", [ep("fd00::7", "p")], family="IPv6")], {},
        [E("p", "http://[fd00::7]:8000", "[fd00::7]:50051", True)]),
    "no state port: no state address": (
        [sl("s1", [ep("10.0.0.7", "p")], ports=[{"name": "http", "port": 8000}])], {},
        [E("p", "http://10.0.0.7:8000", None, True)]),
    "state_port_name None ignores the state port": (
        [sl("s1", [ep("10.0.0.7", "p")])], {"state_port_name": None},
        [E("p", "http://10.0.0.7:8000", None, True)]),
    "custom port names": (
        [sl("s1", [ep("10.0.0.7", "p")], ports=[{"name": "openai", "port": 9000},
                                                {"name": "grpc", "port": 9001}])],
        {"http_port_name": "openai", "state_port_name": "grpc"},
        [E("p", "http://10.0.0.7:9000", "10.0.0.7:9001", True)]),
    "slice without the http port contributes nothing": (
        [sl("s1", [ep("10.0.0.7", "p")], ports=[{"name": "metrics", "port": 9100}])], {}, []),
    "slice with ports null contributes nothing": (
        [sl("s1", [ep("10.0.0.7", "p")], ports=None)], {}, []),
    "a single unnamed port serves as http, not as the sidecar": (
        [sl("s1", [ep("10.0.0.7", "p")], ports=[{"name": "", "port": 8000}])], {},
        [E("p", "http://10.0.0.7:8000", None, True)]),
    "endpoint without addresses is skipped": (
        [sl("s1", [{"addresses": [], "targetRef": {"name": "p"}}])], {}, []),
    "endpoints null": ([sl("s1", None)], {}, []),
    "first address is used": (
        [sl("s1", [{"addresses": ["10.0.0.7", "10.0.0.8"], "targetRef": {"name": "p"}}])], {},
        [E("p", "http://10.0.0.7:8000", "10.0.0.7:50051", True)]),
    "slices merge, sorted by name": (
        [sl("s2", [ep("10.0.0.2", "b", ready=True)]),
         sl("s1", [ep("10.0.0.1", "a", ready=False), ep("10.0.0.3", "c")])], {},
        [E("a", "http://10.0.0.1:8000", "10.0.0.1:50051", False),
         E("b", "http://10.0.0.2:8000", "10.0.0.2:50051", True),
         E("c", "http://10.0.0.3:8000", "10.0.0.3:50051", True)]),
    "ports may differ per slice": (
        [sl("s1", [ep("10.0.0.1", "a")]),
         sl("s2", [ep("10.0.0.2", "b")], ports=[{"name": "http", "port": 8080}])], {},
        [E("a", "http://10.0.0.1:8000", "10.0.0.1:50051", True),
         E("b", "http://10.0.0.2:8080", None, True)]),
    "a pod in two slices is kept once, from the first slice by name": (
        [sl("s2", [ep("10.0.0.1", "a", ready=False)]), sl("s1", [ep("10.0.0.1", "a", ready=True)])], {},
        [E("a", "http://10.0.0.1:8000", "10.0.0.1:50051", True)]),
    "each slice's group label picks its endpoints' profile": (
        [sl("g-a", [ep("10.0.0.1", "a")], labels={GROUP: "a100"}),
         sl("g-h", [ep("10.0.0.2", "h")], labels={GROUP: "h100", "other": "x"})], MIXED,
        [E("a", "http://10.0.0.1:8000", "10.0.0.1:50051", True, profile="llama3.1-8b-a100"),
         E("h", "http://10.0.0.2:8000", "10.0.0.2:50051", True, profile="/etc/routerd/profile-h100.yaml")]),
    "a slice without the label, or with a value not listed, keeps routerd's profile": (
        [sl("g-x", [ep("10.0.0.1", "a")], labels={GROUP: "v100"}), sl("plain", [ep("10.0.0.2", "b")])], MIXED,
        [E("a", "http://10.0.0.1:8000", "10.0.0.1:50051", True),
         E("b", "http://10.0.0.2:8000", "10.0.0.2:50051", True)]),
    "labels are read only with a profile_label": (
        [sl("g-a", [ep("10.0.0.1", "a")], labels={GROUP: "a100"})], {"profiles": MIXED["profiles"]},
        [E("a", "http://10.0.0.1:8000", "10.0.0.1:50051", True)]),
    "dual stack: the IPv4 copy wins": (
        [sl("a-v6", [ep("fd00::1", "a")], family="IPv6"), sl("z-v4", [ep("10.0.0.1", "a")])], {},
        [E("a", "http://10.0.0.1:8000", "10.0.0.1:50051", True)]),
}


@pytest.mark.parametrize("slices,kwargs,want", list(CASES.values()), ids=list(CASES))
def test_endpoints_from_slices(slices, kwargs, want):
    assert endpoints_from_slices(slices, **kwargs) == want


def test_output_is_hashable_and_comparable_for_change_detection():
    a = endpoints_from_slices([sl("s1", [ep("10.0.0.1", "a"), ep("10.0.0.2", "b")])])
    b = endpoints_from_slices([sl("s1", [ep("10.0.0.2", "b"), ep("10.0.0.1", "a")])])
    assert tuple(a) == tuple(b) and hash(tuple(a)) == hash(tuple(b))


def test_stop_closes_only_the_api_client_the_watcher_built(monkeypatch):
    pytest.importorskip("kubernetes")
    import routerd.daemon.endpointslices as es

    class FakeClient:
        closed = 0

        def close(self):
            self.closed += 1

        def call_api(self, *a, **k):  # every request fails: the watcher backs off and retries
            raise ConnectionError("no cluster here")

        def select_header_accept(self, *a, **k):
            return "application/json"

        def select_header_content_type(self, *a, **k):
            return "application/json"

    built = FakeClient()
    monkeypatch.setattr(es, "_default_api_client", lambda: built)
    w = es.EndpointSliceWatcher("ns", "svc", lambda eps: None, backoff_initial_s=0.01, backoff_max_s=0.02)
    w.start()
    w.stop()
    assert built.closed == 1
    given = FakeClient()
    w2 = es.EndpointSliceWatcher("ns", "svc", lambda eps: None, api_client=given, backoff_initial_s=0.01)
    w2.start()
    w2.stop()
    assert given.closed == 0  # the caller's client stays the caller's to close


@pytest.mark.parametrize("bad", ["", " ", "vllm-0.example", "10.0.0.300", "http://10.0.0.9", None, 7])
def test_an_entry_without_an_ip_address_is_skipped_and_named(bad):
    """Issue 15: an empty or non-IP address became a ready endpoint dialled as ``http://:8720``."""
    skipped: list[str] = []
    got = endpoints_from_slices([sl("s1", [ep(bad, "vllm-bad", ready=True), ep("10.0.0.8", "vllm-ok", ready=True)])],
                                skipped=skipped)
    assert got == [E("vllm-ok", "http://10.0.0.8:8000", "10.0.0.8:50051", True)]
    assert skipped == [f"EndpointSlice s1: endpoint address {bad!r} is not an IP address"]
    ipv6 = endpoints_from_slices([sl("s6", [ep("fd00::7", "v6", ready=True)], family="IPv6")])
    assert ipv6 == [E("v6", "http://[fd00::7]:8000", "[fd00::7]:50051", True)]  # IPv6 is an IP address
