"""Operator reconcile latency against a real kube-apiserver (issue #6 targets).

Starts etcd + kube-apiserver (+ kube-controller-manager) from ``tools/k8s/build.sh``'s
cache with the test harness (``tests/k8s/harness.py``), installs the CRDs, runs the
operator in-process (kopf), then measures:

1. **Single pool apply:** the time from the API create of one emulated pool to the moment
   all its 8 children exist and ``status.observedGeneration == 1`` (with conditions).
   Repeated ``--single`` times (fresh pool names); min / median / max are printed.
   Target: <= 2 s.
2. **50 pools:** 50 pools created back to back through the API in one namespace; the
   time from the first create until every pool has ``observedGeneration == 1``, and how
   long the creates alone took. Target: <= 30 s.

Usage: PYTHONPATH=routerd:operator python benchmarks/operator_reconcile.py [--single 5] [--pools 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "operator")]

from k8s.harness import ControlPlane, bin_dir, missing_binaries  # noqa: E402
from phasewise_operator.kube import Kube  # noqa: E402

G = "phasewise.io/v1alpha1"
CHILDREN = (("v1", "ConfigMap"), ("v1", "Service"), ("v1", "ServiceAccount"), ("apps/v1", "Deployment"),
            ("rbac.authorization.k8s.io/v1", "Role"), ("rbac.authorization.k8s.io/v1", "RoleBinding"))


def out(line: str) -> None:
    """Print past kopf's KopfRunner, which captures sys.stdout while it runs."""
    print(line, file=sys.__stdout__, flush=True)


def pool(name: str, ns: str) -> dict:
    return {"apiVersion": G, "kind": "LLMRouterPool", "metadata": {"name": name, "namespace": ns},
            "spec": {"model": {"name": "llama-2-7b"}, "emulated": True, "engine": {"replicas": 2}}}


def reconciled(kube: Kube, ns: str, name: str) -> bool:
    p = kube.get(G, "LLMRouterPool", ns, name)
    st = (p or {}).get("status") or {}
    if st.get("observedGeneration") != 1 or not st.get("conditions"):
        return False
    n = sum(len(kube.list(av, kind, ns, label_selector=f"phasewise.io/pool={name}")) for av, kind in CHILDREN)
    return n == 8


def wait(pred, timeout: float, interval: float) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise SystemExit(f"timed out after {timeout} s")
        time.sleep(interval)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--single", type=int, default=5)
    ap.add_argument("--pools", type=int, default=50)
    a = ap.parse_args()
    d = bin_dir()
    missing = missing_binaries(d, ("etcd", "kube-apiserver", "kubectl"))
    if missing:
        print(f"missing binaries in {d}: {', '.join(missing)}; run tools/k8s/build.sh", file=sys.stderr)
        return 2
    cp = ControlPlane(d, controller_manager=not missing_binaries(d, ("kube-controller-manager",)))
    cp.start()
    print(f"control plane up in {cp.timings['total']:.1f} s")
    runner = None
    try:
        for f in ("llmrouterpools.yaml", "llmrouterjobs.yaml"):
            cp.kubectl("apply", "--server-side", "-f", str(REPO / "crds" / f))
            name = yaml.safe_load((REPO / "crds" / f).read_text())["metadata"]["name"]
            cp.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")
        os.environ.update(KUBECONFIG=str(cp.kubeconfig), PHASEWISE_RESYNC_SECONDS="600",
                          PHASEWISE_ROUTERD_IMAGE="example/routerd:bench",
                          PHASEWISE_OPERATOR_IMAGE="example/operator:bench")
        from kopf.testing import KopfRunner

        runner = KopfRunner(["run", "--all-namespaces", "--standalone", "-m", "phasewise_operator.handlers"],
                            timeout=120)
        runner.__enter__()
        kube = Kube(cp.api_client())
        ns = f"bench-{uuid.uuid4().hex[:6]}"
        cp.kubectl("create", "namespace", ns)
        time.sleep(2)  # let the operator's watches settle before timing
        singles = []
        for i in range(a.single):
            name = f"single-{i}"
            t0 = time.monotonic()
            kube.create(pool(name, ns))
            wait(lambda: reconciled(kube, ns, name), timeout=60, interval=0.02)
            singles.append(time.monotonic() - t0)
        out(f"single pool apply -> 8 children + status: min {min(singles):.2f} s, "
              f"median {statistics.median(singles):.2f} s, max {max(singles):.2f} s over {a.single} (target <= 2 s)")
        ns2 = f"bench-{uuid.uuid4().hex[:6]}"
        cp.kubectl("create", "namespace", ns2)
        t0 = time.monotonic()
        for i in range(a.pools):
            kube.create(pool(f"p{i:02d}", ns2))
        created = time.monotonic() - t0

        def all_done() -> bool:
            items = kube.list(G, "LLMRouterPool", ns2)
            return sum(1 for o in items if (o.get("status") or {}).get("observedGeneration") == 1) == a.pools

        wait(all_done, timeout=300, interval=0.2)
        total = time.monotonic() - t0
        n_deps = len(kube.list("apps/v1", "Deployment", ns2))
        out(f"{a.pools} pools: creates took {created:.1f} s; all reconciled {total:.1f} s after the first create "
              f"({n_deps} Deployments) (target <= 30 s)")
        kube.close()
    finally:
        if runner is not None:
            runner.__exit__(None, None, None)
        cp.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
