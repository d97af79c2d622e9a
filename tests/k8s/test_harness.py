"""The real-API-server harness works: objects round-trip, GC cascades, kubectl and helm talk to it."""

from __future__ import annotations

import json
import time

import pytest
from kubernetes import client
from stack_processes import wait_until


def _wait(pred, what, timeout=60.0, interval=0.2):
    """Poll ``pred()`` until true (``stack_processes.wait_until``); AssertionError naming ``what``."""
    return wait_until(pred, bool, timeout, what, interval_s=interval)


def test_version_is_stamped(k8s, k8s_client):
    from k8s.harness import versions

    v = client.VersionApi(k8s_client).get_code()
    assert v.git_version == f"v{versions()['kubernetes']}"
    assert (v.major, v.minor) == ("1", versions()["kubernetes"].split(".")[1])


def test_namespace_and_configmap_round_trip(k8s_client, namespace):
    core = client.CoreV1Api(k8s_client)
    assert namespace in {n.metadata.name for n in core.list_namespace().items}
    core.create_namespaced_config_map(namespace, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="cfg", labels={"app": "phasewise"}),
        data={"policy": "round_robin"}))
    got = core.read_namespaced_config_map("cfg", namespace)
    assert got.data == {"policy": "round_robin"}
    assert [c.metadata.name for c in core.list_namespaced_config_map(
        namespace, label_selector="app=phasewise").items] == ["cfg"]


def test_rbac_is_enforced_for_a_service_account_token(k8s, k8s_client, namespace):
    """--authorization-mode=RBAC: a ServiceAccount token (TokenRequest) gets 403 until bound."""
    core = client.CoreV1Api(k8s_client)
    core.create_namespaced_service_account(namespace, client.V1ServiceAccount(
        metadata=client.V1ObjectMeta(name="reader")))
    token = core.create_namespaced_service_account_token("reader", namespace, client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=600))).status.token
    cfg = client.Configuration()
    cfg.host = k8s.server
    cfg.ssl_ca_cert = str(k8s.pki / "ca.crt")
    cfg.api_key = {"authorization": f"Bearer {token}"}
    with client.ApiClient(cfg) as sa_client:
        sa_core = client.CoreV1Api(sa_client)
        with pytest.raises(client.ApiException) as e:
            sa_core.list_namespaced_config_map(namespace)
        assert e.value.status == 403
        rbac = client.RbacAuthorizationV1Api(k8s_client)
        rbac.create_namespaced_role(namespace, client.V1Role(
            metadata=client.V1ObjectMeta(name="read-cm"),
            rules=[client.V1PolicyRule(api_groups=[""], resources=["configmaps"], verbs=["list"])]))
        rbac.create_namespaced_role_binding(namespace, client.V1RoleBinding(
            metadata=client.V1ObjectMeta(name="read-cm"),
            role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name="read-cm"),
            subjects=[client.RbacV1Subject(kind="ServiceAccount", name="reader", namespace=namespace)]))
        # RBAC's authorizer learns of the new binding through its informers, a moment later.
        _wait(lambda: _can_list(sa_core, namespace), "the ServiceAccount allowed to list ConfigMaps by its new "
              "RoleBinding", timeout=30)


def _can_list(core, ns) -> bool:
    try:
        core.list_namespaced_config_map(ns)
        return True
    except client.ApiException:
        return False


def test_deleting_an_owner_garbage_collects_its_child(k8s, k8s_client, namespace):
    if not k8s.controller_manager:
        pytest.skip("garbage collection needs kube-controller-manager")
    core = client.CoreV1Api(k8s_client)
    owner = core.create_namespaced_config_map(namespace, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="owner")))
    core.create_namespaced_config_map(namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(
        name="child", owner_references=[client.V1OwnerReference(
            api_version="v1", kind="ConfigMap", name="owner", uid=owner.metadata.uid)])))
    core.delete_namespaced_config_map("owner", namespace)
    t = time.monotonic()

    def child_gone():
        try:
            core.read_namespaced_config_map("child", namespace)
            return False
        except client.ApiException as e:
            return e.status == 404

    _wait(child_gone, "the child ConfigMap garbage-collected after its owner's deletion")
    print(f"\nchild garbage-collected {time.monotonic() - t:.2f} s after its owner's deletion")


def test_controller_manager_finalises_namespace_deletion(k8s, k8s_client):
    if not k8s.controller_manager:
        pytest.skip("namespace deletion needs kube-controller-manager")
    core = client.CoreV1Api(k8s_client)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="t-doomed")))
    core.create_namespaced_config_map("t-doomed", client.V1ConfigMap(metadata=client.V1ObjectMeta(name="x")))
    core.delete_namespace("t-doomed")

    def gone():
        try:
            core.read_namespace("t-doomed")
            return False
        except client.ApiException as e:
            return e.status == 404

    _wait(gone, "namespace t-doomed finalised and gone")


def test_kubectl_talks_to_the_api_server(k8s, namespace):
    if not (k8s.bin / "kubectl").exists():
        pytest.skip("kubectl not built")
    k8s.kubectl("-n", namespace, "create", "configmap", "from-kubectl", "--from-literal=a=1")
    out = json.loads(k8s.kubectl("-n", namespace, "get", "configmap", "from-kubectl", "-o", "json").stdout)
    assert out["data"] == {"a": "1"}
    # Server-side dry run: what the chart tests will use to validate rendered manifests.
    r = k8s.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "dry", "namespace": namespace}, "data": {"b": "2"}}))
    assert "(server dry run)" in r.stdout


def test_helm_install_upgrade_uninstall(k8s, k8s_client, namespace, tmp_path):
    if not (k8s.bin / "helm").exists():
        pytest.skip("helm not built")
    chart = tmp_path / "mini"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text(
        "apiVersion: v2\nname: mini\nversion: 0.1.0\nkubeVersion: '>=1.30.0-0'\n")
    (chart / "values.yaml").write_text("greeting: hello\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-cm\n"
        "data:\n  greeting: {{ .Values.greeting | quote }}\n"
        "  kube: {{ .Capabilities.KubeVersion.Version | quote }}\n")
    k8s.helm("lint", str(chart))
    k8s.helm("install", "r1", str(chart), "-n", namespace)
    core = client.CoreV1Api(k8s_client)
    cm = core.read_namespaced_config_map("r1-cm", namespace)
    assert cm.data["greeting"] == "hello"
    # The API server's stamped version reached helm's capabilities (kubeVersion check passed).
    from k8s.harness import versions

    assert cm.data["kube"] == f"v{versions()['kubernetes']}"
    k8s.helm("upgrade", "r1", str(chart), "-n", namespace, "--set", "greeting=bye")
    assert core.read_namespaced_config_map("r1-cm", namespace).data["greeting"] == "bye"
    k8s.helm("uninstall", "r1", "-n", namespace)
    with pytest.raises(client.ApiException) as e:
        core.read_namespaced_config_map("r1-cm", namespace)
    assert e.value.status == 404


def test_restart_keeps_the_data(k8s, k8s_client, namespace):
    core = client.CoreV1Api(k8s_client)
    core.create_namespaced_config_map(namespace, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="durable"), data={"k": "v"}))
    took = k8s.restart_apiserver()
    print(f"\nkube-apiserver restarted in {took:.1f} s")
    assert core.read_namespaced_config_map("durable", namespace).data == {"k": "v"}


def test_api_server_refuses_loopback_endpointslice_addresses(k8s_client, namespace):
    """Why the KWOK cluster test (test_cluster_kwok.py) runs in a private network namespace: pod IPs
    from a loopback range never reach an EndpointSlice (the EndpointSlice controller's writes fail
    the same way), so they come from a range routed to that namespace's lo instead."""
    disc = client.DiscoveryV1Api(k8s_client)

    def eps(ip):
        return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"generateName": "lo-", "labels": {"kubernetes.io/service-name": "lo"}},
                "addressType": "IPv4", "ports": [{"name": "http", "port": 8000}],
                "endpoints": [{"addresses": [ip]}]}

    with pytest.raises(client.ApiException) as e:
        disc.create_namespaced_endpoint_slice(namespace, eps("127.0.0.5"))
    assert e.value.status == 422 and "may not be in the loopback range" in e.value.body
    disc.create_namespaced_endpoint_slice(namespace, eps("198.18.0.5"))  # the KWOK test's range is fine


def test_pod_processes_rewrite_expand_and_cidr_guard():
    """PodProcesses' view of a pod made local (no binaries needed): mount paths and the pod's own
    0.0.0.0 / 127.0.0.1 in one pass, a kubelet's $(VAR) expansion, and the pod-range guard."""
    from pathlib import Path

    from k8s.harness import PodProcesses, _expand, check_isolated_pod_cidr, isolated_network

    mounts = {"/etc/phasewise": Path("/tmp/p/volumes/config"), "/tmp": Path("/tmp/p/volumes/tmp")}
    got = PodProcesses._rewrite("--profile /etc/phasewise/profile.yaml --home /tmp --metrics-url "
                                "http://127.0.0.1:8000/metrics --listen 0.0.0.0:50051 127.0.0.10 /etc/phasewisex",
                                mounts, "198.18.0.7")
    assert got == ("--profile /tmp/p/volumes/config/profile.yaml --home /tmp/p/volumes/tmp --metrics-url "
                   "http://198.18.0.7:8000/metrics --listen 198.18.0.7:50051 127.0.0.10 /etc/phasewisex")
    assert _expand("--instance $(POD_NAME) $$(POD_NAME) $(NOPE)", {"POD_NAME": "p-1"}) == \
        "--instance p-1 $(POD_NAME) $(NOPE)"
    with pytest.raises(ValueError, match="loopback"):
        check_isolated_pod_cidr("127.1.0.0/24")
    if not isolated_network():  # this machine's own namespace has real interfaces: refused
        with pytest.raises(ValueError, match="interfaces besides lo"):
            check_isolated_pod_cidr("198.18.0.0/24")
