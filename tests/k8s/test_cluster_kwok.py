"""The whole way on a KWOK cluster: helm install, an emulated pool, requests, a drain, a pod killed mid-stream.

kube-apiserver, etcd, kube-controller-manager, kube-scheduler and KWOK's controller
(tests/k8s/harness.py, all built by tools/k8s/build.sh) make a cluster whose pods are
scheduled onto a fake node and become Running with an IP from ``POD_CIDR``; the harness's
PodProcesses runs each pod's containers as local processes on that IP: the operator pod
the chart deploys (``python -m phasewise_operator`` under the chart's ServiceAccount token),
and the pods that operator creates, emulators with their sidecars, routerd, and the picker
with Envoy beside it. routerd and the picker find the engines through their real
EndpointSlice watch of the EndpointSlices kube-controller-manager writes.

The API server refuses loopback addresses in EndpointSlices, so the pod IPs cannot be
127.x.y.z: :func:`test_kwok_cluster` runs the scenario (:func:`test_scenario_in_network_namespace`,
skipped anywhere else) in a private network namespace whose only interface is ``lo``, with
``POD_CIDR`` a local route on ``lo`` (harness.netns_command). Every request goes to an
address of that namespace's loopback device; nothing can leave it.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from k8s.harness import (KWOK_BINARIES, ControlPlane, PodProcesses, bin_dir, inferencepool_crd,
                         missing_binaries, netns_command, netns_unavailable)
from stack_processes import marked_processes, metric_by, metric_sum, scrape, wait_until

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "phasewise"
POD_CIDR = "198.18.0.0/24"
"""RFC 2544's benchmarking range, a local route on ``lo`` of the test's own network namespace."""
INSIDE = "PHASEWISE_KWOK_NETNS"
"""Set (to POD_CIDR) for the pytest run inside the namespace."""
G = "phasewise.io/v1alpha1"
NS, RELEASE_NS, POOL = "llm", "phasewise-system", "chat"
MODEL = "llama-2-7b"
TPOT_S = 0.02
"""The emulators' fixed time per output token (engine.env PHASEWISE_EMULATOR_FIXED_TIMING)."""
ENGINE_SELECTOR = f"phasewise.io/pool={POOL},app.kubernetes.io/component=engine"


def _needs() -> list[str]:
    return [*missing_binaries(bin_dir(), ("etcd", "kube-apiserver", *KWOK_BINARIES, "kubectl", "helm"))]


def test_kwok_cluster(tmp_path):
    """Runs test_scenario_in_network_namespace in its own user, network, PID and mount namespaces."""
    missing = _needs()
    why = netns_unavailable()
    reason = (f"Kubernetes test binaries not built in {bin_dir()}: {', '.join(missing)} (tools/k8s/build.sh)"
              if missing else f"no private network namespace: {why}" if why else None)
    if reason:
        if os.environ.get("PHASEWISE_K8S_REQUIRED"):
            pytest.fail(f"PHASEWISE_K8S_REQUIRED is set but {reason}", pytrace=False)
        pytest.skip(reason)
    pytest.importorskip("openai")
    pytest.importorskip("kopf", reason="the operator needs the extra: pip install -e '.[operator]'")
    out = tmp_path / "inner.log"
    t0 = time.monotonic()
    with open(out, "wb") as f:
        r = subprocess.run(netns_command(
            [sys.executable, "-m", "pytest", "-q", "-s", f"{Path(__file__)}::test_scenario_in_network_namespace",
             "--basetemp", str(tmp_path / "inner")],
            POD_CIDR), cwd=REPO, env={**os.environ, INSIDE: POD_CIDR}, stdout=f, stderr=subprocess.STDOUT,
            timeout=600)
    text = out.read_text(errors="replace")
    print(f"scenario in its network namespace: rc {r.returncode}, {time.monotonic() - t0:.1f} s\n{text[-3000:]}")
    why = "\n".join(ln for ln in text.splitlines() if ln.startswith("E ") and "Error" in ln)[:3000]
    assert r.returncode == 0 and "1 passed" in text, f"{why}\n---- inner output (tail) ----\n{text[-12000:]}"


# --------------------------------------------------------------------------- the scenario


def _pool_yaml(replicas: int) -> str:
    return yaml.safe_dump({
        "apiVersion": G, "kind": "LLMRouterPool", "metadata": {"name": POOL, "namespace": NS},
        "spec": {
            "model": {"name": "meta-llama/Llama-2-7b-hf", "servedModelName": MODEL},
            # Fixed timing: a stream's length in seconds is its token count times TPOT_S,
            # whatever the machine's load does to the simulator's clock.
            "engine": {"replicas": replicas,
                       "env": [{"name": "PHASEWISE_EMULATOR_FIXED_TIMING", "value": f"0.05,{TPOT_S}"}]},
            "hardwareProfile": {"name": "llama2-7b-a100"},
            # Round robin: which engine serves which request is known in advance.
            "routing": {"policy": "round_robin"},
            "emulated": True,
            "gateway": {"inferencePool": {"enabled": True},
                        "picker": {"enabled": True, "envoy": {"enabled": True, "port": 8081}}},
        }})


class Cluster:
    """The running cluster as the scenario reads it."""

    def __init__(self, cp: ControlPlane, pods: PodProcesses) -> None:
        self.cp, self.pods = cp, pods

    def get(self, *args: str) -> dict:
        failed = [e for e in self.pods.errors if "start failed" in e]
        assert not failed, f"a pod's processes could not start: {failed}"
        return json.loads(self.cp.kubectl("get", *args, "-o", "json").stdout)

    def engine_pods(self) -> list[dict]:
        return self.get("pods", "-n", NS, "-l", ENGINE_SELECTOR)["items"]

    def pod(self, component: str) -> dict:
        items = [p for p in self.get("pods", "-n", NS, "-l", f"phasewise.io/pool={POOL},"
                                     f"app.kubernetes.io/component={component}")["items"]
                 if not p["metadata"].get("deletionTimestamp")]
        assert len(items) == 1, [p["metadata"]["name"] for p in items]
        return items[0]

    def endpoints(self) -> list[dict]:
        """The engine Service's EndpointSlice entries (every slice of it)."""
        items = self.get("endpointslices", "-n", NS, "-l", f"kubernetes.io/service-name={POOL}-engine")["items"]
        return [dict(e, ports={p["name"]: p["port"] for p in s.get("ports") or []})
                for s in items for e in s.get("endpoints") or []]

    def serving(self, names: set[str], timeout: float = 120.0) -> dict[str, str]:
        """Wait until exactly the pods ``names`` are the engine Service's ready endpoints, each
        with its processes up and probes passing; returns {pod name: IP}."""
        def probe():
            eps = self.endpoints()
            got = {e["targetRef"]["name"]: e for e in eps if e["conditions"].get("ready")}
            ok = set(got) == names and len(eps) == len(names) and all(
                (run := self.pods.run_of(n, NS)) is not None and self.pods.ready(run) for n in names)
            return ok, {n: e["addresses"][0] for n, e in got.items()}, eps

        ok, ips, _ = wait_until(probe, lambda v: v[0], timeout, f"engine endpoints {sorted(names)} ready and serving",
                                interval_s=0.2)
        return ips

    def wait_ready(self, pod: dict, timeout: float = 120.0) -> str:
        name = pod["metadata"]["name"]
        wait_until(lambda: (r := self.pods.run_of(name, NS)) is not None and self.pods.ready(r), bool, timeout,
                   f"pod {name}'s processes up and ready", interval_s=0.2)
        return self.pods.run_of(name, NS).ip


def _served(ips: dict[str, str]) -> dict[str, float]:
    """Requests each engine's emulator has completed, by pod name (its own vLLM counter)."""
    return {n: metric_sum(scrape(f"http://{ip}:8000/metrics"), "vllm:request_success_total") for n, ip in ips.items()}


def _sees(metrics_url: str, names: set[str], timeout: float = 60.0) -> None:
    """Wait until the router behind ``metrics_url`` (routerd, or the picker) takes new requests to
    exactly the endpoints ``names`` (its EndpointSlice watch has caught up; its gauge
    ``phasewise_endpoint_ready``)."""
    wait_until(lambda: metric_by(scrape(metrics_url), "phasewise_endpoint_ready", "endpoint"),
               lambda v: v == {n: 1.0 for n in names}, timeout, f"{metrics_url} routing to exactly {sorted(names)}",
               interval_s=0.1)


def _running(ips: dict[str, str]) -> dict[str, float]:
    return {n: metric_sum(scrape(f"http://{ip}:8000/metrics"), "vllm:num_requests_running") for n, ip in ips.items()}


class Streams:
    """``n`` streamed chat completions of ``tokens`` tokens each, one thread each; per stream
    the tokens it received and how it ended (None, or the exception). ``chunks`` counts tokens as
    the emulator's filler words (one short word per token): an event may carry several tokens,
    as vLLM's do when its server is behind."""

    def __init__(self, client, n: int, tokens: int) -> None:
        self.chunks = [0] * n
        self.errors: list[BaseException | None] = [None] * n
        self.done = [False] * n
        self.threads = [threading.Thread(target=self._one, args=(client, i, tokens), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()
            time.sleep(0.05)  # in order: round robin hands them out in turn

    def _one(self, client, i: int, tokens: int) -> None:
        try:
            with client.chat.completions.create(model=MODEL, max_tokens=tokens, stream=True,
                                                messages=[{"role": "user", "content": f"stream {i}"}]) as stream:
                for c in stream:
                    if c.choices and c.choices[0].delta.content:
                        self.chunks[i] += len(c.choices[0].delta.content.split())
        except BaseException as e:  # noqa: BLE001 (recorded for the test to judge)
            self.errors[i] = e
        finally:
            self.done[i] = True

    def join(self, timeout: float = 120.0) -> None:
        end = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, end - time.monotonic()))
        assert all(self.done), f"streams still running after {timeout} s: {self.chunks}"


def _stream(client) -> int:
    """Chunks with content of one streamed chat completion of 5 tokens."""
    with client.chat.completions.create(model=MODEL, max_tokens=5, stream=True,
                                        messages=[{"role": "user", "content": "hi"}]) as stream:
        return sum(1 for c in stream if c.choices and c.choices[0].delta.content)


def _completions(client, n: int) -> None:
    for i in range(n):
        r = client.completions.create(model=MODEL, prompt=f"request {i}", max_tokens=4)
        assert r.usage.completion_tokens == 4


def test_scenario_in_network_namespace(tmp_path):
    if not os.environ.get(INSIDE):
        pytest.skip("runs only inside test_kwok_cluster's network namespace")
    import openai

    t0 = time.monotonic()
    marks: dict[str, float] = {}
    cp = ControlPlane(bin_dir(), kwok=True, pod_cidr=os.environ[INSIDE], workdir=tmp_path / "cluster")
    with cp, PodProcesses(cp) as pods:
        try:
            _scenario(Cluster(cp, pods), openai, marks)
        except BaseException:
            print(f"PodProcesses errors: {pods.errors}")
            for r in list(pods.runs.values()):
                for c in r.procs:
                    print(f"---- {r.name}/{c} ({r.state}) ----\n{pods.log(r.name, c, 30, r.namespace)}")
            raise
        marks["total"] = time.monotonic() - t0
        pods.stop()
        assert pods.live_processes() == []
        assert marked_processes(pods.marker) == [], "processes of the pods outlived the harness"
    print("phases (s since start): " + ", ".join(f"{k} {v:.1f}" for k, v in marks.items()))


def _scenario(k: Cluster, openai, marks: dict[str, float]) -> None:
    cp, pods = k.cp, k.pods
    t0 = time.monotonic()
    cp.add_fake_node("kwok-node-0")
    cp.kubectl("apply", "--server-side", "-f", str(inferencepool_crd(cp.bin)))
    cp.kubectl("wait", "--for=condition=Established", "crd/inferencepools.inference.networking.k8s.io",
               "--timeout=60s")
    marks["cluster"] = time.monotonic() - t0

    # ---- helm install: the chart's operator Deployment, its pod Running (helm --wait), its process up.
    r = cp.helm("install", "phasewise", str(CHART), "--namespace", RELEASE_NS, "--create-namespace",
                "--wait", "--timeout", "120s", timeout=180)
    assert "STATUS: deployed" in r.stdout, r.stdout + r.stderr
    op_pod = k.get("pods", "-n", RELEASE_NS, "-l", "app.kubernetes.io/component=operator")["items"]
    assert len(op_pod) == 1 and op_pod[0]["status"]["phase"] == "Running"
    op_name = op_pod[0]["metadata"]["name"]
    wait_until(lambda: pods.run_of(op_name, RELEASE_NS), bool, 60, "the operator pod's process started")
    marks["helm install"] = time.monotonic() - t0

    # ---- kubectl apply of an emulated pool: every pod Running with an IP of the pod range.
    cp.kubectl("create", "namespace", NS)
    cp.kubectl("apply", "-f", "-", input=_pool_yaml(3))
    wait_until(lambda: len([p for p in k.engine_pods() if p["status"].get("phase") == "Running"]) == 3, bool,
               120, "3 engine pods Running", interval_s=0.3)
    engines = {p["metadata"]["name"] for p in k.engine_pods()}
    ips = k.serving(engines)
    assert all(ipaddress.ip_address(ip) in ipaddress.ip_network(POD_CIDR) for ip in ips.values()), ips
    # The EndpointSlice the controller manager wrote: one entry per engine pod, at its IP, with the
    # Service's ports, each endpoint named after its pod.
    eps = k.endpoints()
    assert sorted((e["targetRef"]["name"], e["addresses"][0]) for e in eps) == sorted(ips.items())
    assert all(e["ports"] == {"http": 8000, "state": 50051} and e["conditions"] == {
        "ready": True, "serving": True, "terminating": False} for e in eps), eps
    routerd_ip = k.wait_ready(k.pod("routerd"))
    epp_ip = k.wait_ready(k.pod("epp"))
    def pool_or_operator_failure():
        failed = [ln for ln in pods.log(op_name, "operator", 400, RELEASE_NS).splitlines() if "failed permanently" in ln]
        assert not failed, f"the operator gave up on the pool: {failed}"
        return k.get("llmrouterpool", "-n", NS, POOL)

    pool = wait_until(pool_or_operator_failure, lambda p: (p.get("status") or {}).get(
        "readyInstances") == 3 and any(c["type"] == "Ready" and c["status"] == "True"
                                       for c in p["status"].get("conditions") or []), 60, "pool Ready with 3 instances")
    assert pool["status"]["activePolicy"] == "round_robin"
    ip_pool = k.get("inferencepool", "-n", NS, POOL)
    assert ip_pool["spec"]["endpointPickerRef"]["name"] == f"{POOL}-epp"
    marks["pool running"] = time.monotonic() - t0

    routerd = openai.OpenAI(base_url=f"http://{routerd_ip}:8000/v1", api_key="unused", max_retries=0, timeout=60)
    envoy = openai.OpenAI(base_url=f"http://{epp_ip}:8081/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        _traffic(k, openai, routerd, envoy, ips, routerd_ip, epp_ip, marks, t0)

        # ---- helm uninstall: the operator's pod goes and its process ends; the pool and its data
        # plane stay (the chart keeps its CRDs; pools carry no finalizer).
        cp.helm("uninstall", "phasewise", "--namespace", RELEASE_NS, "--wait", "--timeout", "120s", timeout=180)
        run = pods.run_of(op_name, RELEASE_NS)
        wait_until(lambda: run.state, lambda s: s == "stopped", 90, "the operator's process stopped")
        assert run.killed == set() and run.stop_reason == "deleted", (run.killed, run.stop_reason)
        assert k.get("llmrouterpool", "-n", NS, POOL)["metadata"]["name"] == POOL
        _completions(routerd, 2)  # one on the dead emulator's endpoint: retried on the other
    finally:
        routerd.close()
        envoy.close()
    # Deleting the pool without an operator: the garbage collector takes every child, the pods stop.
    cp.kubectl("delete", "llmrouterpool", "-n", NS, POOL, "--wait=true", "--timeout=60s")
    wait_until(lambda: k.get("pods", "-n", NS)["items"], lambda v: v == [], 120, "every pod of the pool gone",
               interval_s=0.3)
    assert pods.running() == [] and pods.live_processes() == []
    assert pods.unexpected_exits() == []
    marks["uninstalled"] = time.monotonic() - t0


def _traffic(k: Cluster, openai, routerd, envoy, ips, routerd_ip, epp_ip, marks, t0) -> None:
    cp, pods = k.cp, k.pods

    # ---- through routerd (official openai client): round robin, so each engine serves 2 of 6.
    _sees(f"http://{routerd_ip}:8000/metrics", set(ips))
    _sees(f"http://{epp_ip}:9090/metrics", set(ips))
    assert [m.id for m in routerd.models.list().data] == [MODEL]
    before = _served(ips)
    _completions(routerd, 6)
    assert _stream(routerd) == 5
    after = _served(ips)
    assert sorted(after[n] - before[n] for n in ips) == [2, 2, 3], (before, after)
    decisions = metric_by(scrape(f"http://{routerd_ip}:8000/metrics"), "phasewise_decisions_total", "endpoint")
    assert set(decisions) == set(ips) and sorted(decisions.values()) == [2, 2, 3], decisions

    # ---- through Envoy and the picker: the picker names the engine, Envoy sends the request there.
    before = _served(ips)
    _completions(envoy, 3)
    after = _served(ips)
    assert sorted(after[n] - before[n] for n in ips) == [1, 1, 1], (before, after)
    assert _stream(envoy) == 5
    picked = metric_by(scrape(f"http://{epp_ip}:9090/metrics"), "phasewise_decisions_total", "endpoint")
    assert set(picked) == set(ips) and sum(picked.values()) == 4, picked
    marks["requests"] = time.monotonic() - t0

    # ---- scale-down that drains: 6 streams in flight (2 per engine), replicas 3 -> 2; the pod the
    # ReplicaSet deletes terminates (its endpoint turns terminating, no new request), its emulator
    # gets SIGTERM and finishes its 2 streams, then exits 0 and KWOK removes the pod.
    tokens = 150  # 3 s of decoding, within the emulator's 5 s drain after SIGTERM
    streams = Streams(routerd, 6, tokens)
    wait_until(lambda: _running(ips), lambda v: all(x >= 2 for x in v.values()), 30,
               "2 streams running on every engine")
    cp.kubectl("patch", "llmrouterpool", "-n", NS, POOL, "--type=merge", "-p", '{"spec":{"engine":{"replicas":2}}}')
    seen_terminating: dict = {}

    def terminating():
        eps = k.endpoints()
        for e in eps:
            if e["conditions"].get("terminating"):
                seen_terminating.setdefault(e["targetRef"]["name"], e["conditions"])
        return [p["metadata"]["name"] for p in k.engine_pods() if p["metadata"].get("deletionTimestamp")]

    victim = wait_until(terminating, bool, 30, "an engine pod deleted by the scale-down", interval_s=0.1)[0]
    run = pods.run_of(victim, NS)
    wait_until(lambda: (terminating(), run.state)[1], lambda s: s == "stopped", 30,
               f"{victim}'s processes stopped", interval_s=0.1)
    streams.join()
    assert streams.errors == [None] * 6, streams.errors
    assert streams.chunks == [tokens] * 6, streams.chunks
    assert run.stop_reason == "deleted" and run.killed == set() and run.exit_codes == {"emulator": 0, "sidecar": 0}, (
        run.stop_reason, run.killed, run.exit_codes)
    # Seen while it drained: ready false, still serving, terminating (the endpoint routerd stops using).
    assert seen_terminating.get(victim) == {"ready": False, "serving": True, "terminating": True}, seen_terminating
    survivors = set(ips) - {victim}
    ips = k.serving(survivors)
    wait_until(lambda: k.get("llmrouterpool", "-n", NS, POOL)["status"].get("readyInstances"), lambda v: v == 2, 60,
               "pool readyInstances 2")
    _sees(f"http://{routerd_ip}:8000/metrics", survivors)
    before = _served(ips)
    _completions(routerd, 4)
    after = _served(ips)
    assert sorted(after[n] - before[n] for n in ips) == [2, 2], (before, after)
    decisions = metric_by(scrape(f"http://{routerd_ip}:8000/metrics"), "phasewise_decisions_total", "endpoint")
    assert set(decisions) == survivors, decisions  # the removed endpoint's series are gone
    marks["scale-down drained"] = time.monotonic() - t0

    # ---- a pod deleted mid-stream with a 1 s grace period: its emulator cannot drain in time, is
    # killed, and the streams it served end with routerd's error event naming it; the others finish.
    tokens = 250  # 5 s
    streams = Streams(routerd, 4, tokens)
    wait_until(lambda: (_running(ips), streams.chunks), lambda v: all(x >= 2 for x in v[0].values())
               and min(v[1]) >= 3, 30, "2 streams running on each engine, every client reading")
    victim = sorted(ips)[0]
    cp.kubectl("delete", "pod", "-n", NS, victim, "--grace-period=1", "--wait=false")
    run = pods.run_of(victim, NS)
    wait_until(lambda: run.state, lambda s: s == "stopped", 30, f"{victim}'s processes stopped")
    assert "emulator" in run.killed, (run.killed, run.exit_codes)
    streams.join()
    failed = [e for e in streams.errors if e is not None]
    assert len(failed) == 2 and all(c == tokens for c, e in zip(streams.chunks, streams.errors) if e is None), (
        streams.chunks, streams.errors)
    for e in failed:
        assert isinstance(e, openai.APIError) and f"instance {victim} broke off the stream" in str(e), repr(e)
    assert all(3 <= c < tokens for c, e in zip(streams.chunks, streams.errors) if e is not None), streams.chunks
    # The Deployment replaces the pod; routerd finds the new one through the EndpointSlice watch.
    survivor = (set(ips) - {victim}).pop()
    wait_until(lambda: {p["metadata"]["name"] for p in k.engine_pods()} - {survivor, victim}, bool, 60,
               "a replacement engine pod")
    replacement = ({p["metadata"]["name"] for p in k.engine_pods()} - {survivor, victim}).pop()
    ips = k.serving({survivor, replacement})
    _sees(f"http://{routerd_ip}:8000/metrics", set(ips))
    before = _served(ips)
    _completions(routerd, 4)
    after = _served(ips)
    assert sorted(after[n] - before[n] for n in ips) == [2, 2], (before, after)
    marks["mid-stream delete"] = time.monotonic() - t0

    # ---- a container that dies while its pod stays Ready (no kubelet restarts it here): a request
    # routerd sends there fails before its first byte and is retried on the other engine.
    retries0 = metric_sum(scrape(f"http://{routerd_ip}:8000/metrics"), "phasewise_upstream_retries_total")
    dead = pods.run_of(survivor, NS)
    dead.procs["emulator"].kill()
    dead.procs["emulator"].wait()
    before = _served({replacement: ips[replacement]})
    _completions(routerd, 4)
    after = _served({replacement: ips[replacement]})
    assert after[replacement] - before[replacement] == 4, (before, after)
    samples = scrape(f"http://{routerd_ip}:8000/metrics")
    retries = metric_sum(samples, "phasewise_upstream_retries_total")
    # Two ways lose nothing here: routerd sends a request to the dead engine and retries it, or the
    # sidecar reports the engine down first and routerd stops counting it ready (on a slow machine
    # the sidecar's probe can win the race). Either one must have happened.
    ready = metric_by(samples, "phasewise_endpoint_ready", "endpoint").get(survivor)
    assert retries - retries0 >= 1 or ready == 0, (retries0, retries, ready)
    assert [u for u in pods.unexpected_exits() if "emulator exited" not in u or survivor not in u] == []
    marks["retry"] = time.monotonic() - t0
