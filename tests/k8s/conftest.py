"""Fixtures for tests against a real Kubernetes API server (tests/k8s/harness.py).

The binaries come from ``tools/k8s/build.sh``. Without them these tests are skipped,
unless ``PHASEWISE_K8S_REQUIRED`` is set (CI sets it after building): then they fail.
``PHASEWISE_K8S_KCM=0`` runs the control plane without kube-controller-manager.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from k8s.harness import ControlPlane, bin_dir, inferencepool_crd, missing_binaries

_HERE = Path(__file__).resolve().parent


def pytest_configure(config):
    config.addinivalue_line("markers", "k8s: needs the real-API-server test binaries (tools/k8s/build.sh)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.k8s)


def _require_binaries(names) -> Path:
    d = bin_dir()
    missing = missing_binaries(d, names)
    if missing:
        reason = (f"Kubernetes test binaries not built in {d}: {', '.join(missing)}; "
                  f"run tools/k8s/build.sh (or set PHASEWISE_K8S_BIN)")
        if os.environ.get("PHASEWISE_K8S_REQUIRED"):
            pytest.fail(f"PHASEWISE_K8S_REQUIRED is set but {reason}", pytrace=False)
        pytest.skip(reason)
    return d


@pytest.fixture(scope="session")
def k8s() -> ControlPlane:
    """A session-wide etcd + kube-apiserver (+ kube-controller-manager when built)."""
    d = _require_binaries(("etcd", "kube-apiserver"))
    kcm = os.environ.get("PHASEWISE_K8S_KCM", "1") != "0" and not missing_binaries(
        d, ("kube-controller-manager",))
    cp = ControlPlane(d, controller_manager=kcm)
    cp.start()
    print(f"\nk8s control plane {cp.server} up in {cp.timings['total']:.1f} s "
          f"({', '.join(f'{k} {v:.1f} s' for k, v in cp.timings.items() if k != 'total')}); "
          f"workdir {cp.workdir}")
    yield cp
    cp.stop()


@pytest.fixture(scope="module")
def k8s_uncached() -> ControlPlane:
    """A private etcd + kube-apiserver for one test module, without the controller manager,
    whose API server serves watches straight from etcd (``--watch-cache=false``): after
    ``compact_etcd()`` a watch from an older resourceVersion gets a real ``410 Gone``.
    Private, so its tests may restart it without disturbing the session's."""
    d = _require_binaries(("etcd", "kube-apiserver"))
    cp = ControlPlane(d, apiserver_args=("--watch-cache=false",))
    cp.start()
    yield cp
    cp.stop()


@pytest.fixture
def k8s_client(k8s):
    """An ApiClient for the session control plane, closed after the test."""
    c = k8s.api_client()
    yield c
    c.close()


@pytest.fixture
def namespace(k8s, k8s_client) -> str:
    """A fresh namespace per test (deleted afterwards; finalised only with the controller manager)."""
    from kubernetes import client

    name = f"t-{uuid.uuid4().hex[:10]}"
    core = client.CoreV1Api(k8s_client)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    core.delete_namespace(name)


@pytest.fixture(scope="session")
def inferencepool_crd_installed(k8s) -> Path:
    """The Gateway API Inference Extension's own InferencePool CRD, applied to the session's API server
    (copied from its Go module by ``tools/k8s/build.sh``; skipped, or failed when required, without it)."""
    path = inferencepool_crd(k8s.bin)
    if not path.is_file():
        reason = f"InferencePool CRD not in {path}; run tools/k8s/build.sh --crds"
        if os.environ.get("PHASEWISE_K8S_REQUIRED"):
            pytest.fail(f"PHASEWISE_K8S_REQUIRED is set but {reason}", pytrace=False)
        pytest.skip(reason)
    k8s.kubectl("apply", "--server-side", "-f", str(path))
    k8s.kubectl("wait", "--for=condition=Established", "crd/inferencepools.inference.networking.k8s.io",
                "--timeout=60s")
    return path
