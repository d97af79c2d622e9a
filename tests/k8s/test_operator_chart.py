"""The Helm chart against a real API server: install, the operator under the chart's own RBAC, upgrade, uninstall.

The operator runs in-process (KopfRunner) with a token of the chart's ServiceAccount, in
kopf's mandatory peering mode with the chart's peering object, so a permission the chart
forgot shows up as a 403 here.
"""

from __future__ import annotations

import base64
import os
import re
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "phasewise"
sys.path.insert(0, str(REPO / "operator"))

from k8s.test_operator_api import wait_for  # noqa: E402
from phasewise_operator.kube import Kube  # noqa: E402

G = "phasewise.io/v1alpha1"


@pytest.fixture
def helm_ok(k8s):
    from k8s.harness import bin_dir, missing_binaries

    if missing_binaries(bin_dir(), ("helm", "kubectl")):
        if os.environ.get("PHASEWISE_K8S_REQUIRED"):
            pytest.fail("PHASEWISE_K8S_REQUIRED is set but helm/kubectl are not built", pytrace=False)
        pytest.skip("helm or kubectl not built (tools/k8s/build.sh)")
    return True


def _adopt_crds(k8s, release: str, ns: str) -> None:
    """CRDs applied earlier with kubectl: give them Helm's ownership metadata so the release adopts them."""
    for name in ("llmrouterpools.phasewise.io", "llmrouterjobs.phasewise.io"):
        if k8s.kubectl("get", "crd", name, check=False).returncode == 0:
            k8s.kubectl("label", "--overwrite", "crd", name, "app.kubernetes.io/managed-by=Helm")
            k8s.kubectl("annotate", "--overwrite", "crd", name, f"meta.helm.sh/release-name={release}",
                        f"meta.helm.sh/release-namespace={ns}")


def _token_kubeconfig(k8s, kube: Kube, ns: str, sa: str, path: Path) -> Path:
    tok = kube.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token",
                       body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                             "spec": {"expirationSeconds": 3600}})["status"]["token"]
    ca = base64.b64encode((k8s.pki / "ca.crt").read_bytes()).decode()
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "t", "cluster": {"server": k8s.server, "certificate-authority-data": ca}}],
        "users": [{"name": sa, "user": {"token": tok}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": sa}}],
        "current-context": "t"}))
    return path


def test_helm_install_operator_rbac_upgrade_uninstall(k8s, helm_ok, tmp_path):
    pytest.importorskip("kopf", reason="the operator needs the extra: pip install -e '.[operator]'")
    from kopf.testing import KopfRunner

    release, ns, work_ns = "phasewise", "phasewise-system", "phasewise-workload"
    for n in (ns, work_ns):
        k8s.kubectl("create", "namespace", n, check=False)
    _adopt_crds(k8s, release, ns)
    r = k8s.helm("install", release, str(CHART), "--namespace", ns, "--timeout", "60s")
    assert "STATUS: deployed" in r.stdout, r.stdout + r.stderr
    admin = Kube(k8s.api_client())
    try:
        dep = admin.get("apps/v1", "Deployment", ns, "phasewise-operator")
        assert dep is not None
        assert admin.request("GET", "/apis/kopf.dev/v1/clusterkopfpeerings/phasewise")["metadata"]["name"] == "phasewise"
        crd = admin.request("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/llmrouterpools.phasewise.io")
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"

        # The operator as the chart runs it: its env, the chart's ServiceAccount token, mandatory peering.
        env = {e["name"]: e["value"] for e in dep["spec"]["template"]["spec"]["containers"][0]["env"] if "value" in e}
        env.update(PHASEWISE_JOB_POLL_SECONDS="1", PHASEWISE_JOB_POOL_GRACE_SECONDS="2",
                   KUBECONFIG=str(_token_kubeconfig(k8s, admin, ns, "phasewise", tmp_path / "sa.kubeconfig")))
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            runner = KopfRunner(["run", "--all-namespaces", "--peering", "phasewise", "--priority", "100",
                                 "-m", "phasewise_operator.handlers"], timeout=60)
            with runner:
                k8s.kubectl("apply", "-n", work_ns, "-f", "-", input=yaml.safe_dump({
                    "apiVersion": G, "kind": "LLMRouterPool", "metadata": {"name": "rbac"},
                    "spec": {"model": {"name": "m"}, "emulated": True}}))
                k8s.kubectl("apply", "-n", work_ns, "-f", "-", input=yaml.safe_dump({
                    "apiVersion": G, "kind": "LLMRouterJob", "metadata": {"name": "rbac-train"},
                    "spec": {"poolRef": {"name": "rbac"}, "task": "train"}}))
                k8s.kubectl("apply", "-n", work_ns, "-f", "-", input=yaml.safe_dump({
                    "apiVersion": G, "kind": "LLMRouterJob", "metadata": {"name": "rbac-orphan"},
                    "spec": {"poolRef": {"name": "nope"}, "task": "profile"}}))
                p = wait_for(lambda: (lambda o: o if (o.get("status") or {}).get("observedGeneration") == 1 else None)(
                    admin.get(G, "LLMRouterPool", work_ns, "rbac")), timeout=30, what="pool reconciled")
                assert p["status"]["activePolicy"] == "late_binding"
                # Removing an engine group deletes its Deployment: the chart grants deployments delete.
                groups = [{"name": "a", "model": {"name": "model-a"}}, {"name": "b", "model": {"name": "model-b"}}]
                for listed in (groups, groups[:1]):
                    k8s.kubectl("apply", "-n", work_ns, "-f", "-", input=yaml.safe_dump({
                        "apiVersion": G, "kind": "LLMRouterPool", "metadata": {"name": "rbac-groups"},
                        "spec": {"engineGroups": listed, "emulated": True}}))
                    if len(listed) == 2:
                        wait_for(lambda: admin.get("apps/v1", "Deployment", work_ns, "rbac-groups-engine-b"),
                                 timeout=30, what="group b's Deployment created under the chart's RBAC")
                wait_for(lambda: admin.get("apps/v1", "Deployment", work_ns, "rbac-groups-engine-b") is None,
                         timeout=30, what="group b's Deployment deleted under the chart's RBAC")
                wait_for(lambda: admin.get("batch/v1", "Job", work_ns, "rbac-train"), timeout=30,
                         what="train batch Job (reporter Role and RoleBinding created under the chart's RBAC)")
                wait_for(lambda: ((admin.get(G, "LLMRouterJob", work_ns, "rbac-orphan") or {}).get("status") or {})
                         .get("phase") == "Failed", timeout=30, what="orphan job Failed")
                # kopf writes its record into the peering object from its own task: wait for it.
                wait_for(lambda: admin.request("GET", "/apis/kopf.dev/v1/clusterkopfpeerings/phasewise").get("status"),
                         timeout=30, what="the operator's record in the peering object's status")
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        out = runner.output
        # An RBAC denial reads 'User "system:serviceaccount:NS:NAME" cannot VERB resource ...' (kopf's own
        # watches raise APIForbiddenError). Pools of earlier tests in namespaces being deleted get a
        # different 403 ("unable to create new content ... being terminated"), which is not the chart's.
        assert not re.search(r'User \\?"system:serviceaccount:[^"\\]+\\?" cannot', out), out[-4000:]
        assert "APIForbiddenError" not in out and "Traceback" not in out, out[-4000:]

        r = k8s.helm("upgrade", release, str(CHART), "--namespace", ns, "--set", "operator.resyncSeconds=60",
                     "--timeout", "60s")
        assert "STATUS: deployed" in r.stdout
        dep = admin.get("apps/v1", "Deployment", ns, "phasewise-operator")
        env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["PHASEWISE_RESYNC_SECONDS"] == "60"

        k8s.helm("uninstall", release, "--namespace", ns, "--timeout", "60s")
        assert admin.get("apps/v1", "Deployment", ns, "phasewise-operator") is None
        assert admin.request("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
                             "llmrouterpools.phasewise.io")  # kept
        assert admin.get(G, "LLMRouterPool", work_ns, "rbac") is not None  # pools survive an uninstall
    finally:
        admin.close()
