"""Cost of one DQN routing decision (featurize + forward pass) on the CPU.

States come from a simulation in the paper's regime (public-mix at 20 req/s on four
``llama2-7b-v100`` instances, 2,000 requests). Every router decision in that run is
timed with ``time.perf_counter_ns`` around ``DQNPolicy.pick`` (featurize + numpy
forward + argmax). The same run also times ``round_robin.pick`` as a baseline.
Target (issue #3): p99 <= 100 microseconds.

Usage: python benchmarks/dqn_decision_latency.py [--checkpoint DIR] [--n 2000]
(without --checkpoint a seeded random network of the paper's shape is used: the cost
does not depend on the weights' values).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from routerd.policies.base import PolicyContext
from routerd.policies.dqn.checkpoint import save_checkpoint
from routerd.policies.dqn.features import obs_dim
from routerd.policies.registry import build_policy
from routerd.profiles import get_profile
from routerd.sim import ClusterSimulator, prepare_requests
from routerd.workloads.registry import load_workload


class Timed:
    """Wraps a policy and records the wall time of every pick (ns)."""

    def __init__(self, inner):
        self.inner, self.times = inner, []
        self.name, self.oracle, self.ctx = inner.name, inner.oracle, inner.ctx

    def pick(self, request, view):
        t = time.perf_counter_ns()
        out = self.inner.pick(request, view)
        self.times.append(time.perf_counter_ns() - t)
        return out

    def on_complete(self, *a):
        self.inner.on_complete(*a)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--instances", type=int, default=4)
    a = ap.parse_args()
    prof = get_profile("llama2-7b-v100")
    m = a.instances
    ck = a.checkpoint
    if ck is None:
        rng = np.random.default_rng(0)
        d = obs_dim(m)
        w = {"l1.weight": rng.normal(size=(64, d)), "l1.bias": rng.normal(size=64),
             "l2.weight": rng.normal(size=(64, 64)), "l2.bias": rng.normal(size=64),
             "l3.weight": rng.normal(size=(m + 1, 64)), "l3.bias": rng.normal(size=m + 1)}
        ck = save_checkpoint(tempfile.mkdtemp(), w, {"variant": "random", "num_instances": m})
    reqs = load_workload("public-mix", n=a.n, rate=20.0, seed=0).requests
    for spec, params in (("dqn", {"checkpoint": str(ck)}), ("round_robin", None)):
        pol = Timed(build_policy(spec, params, PolicyContext(prof, m)))
        prep = prepare_requests(reqs, prof)
        ClusterSimulator(prof, m, pol).run(prep.requests)
        t = np.array(pol.times) / 1000.0
        print(f"{spec:12} {len(t):7d} decisions: mean {t.mean():6.1f} us  p50 {np.percentile(t, 50):6.1f} us  "
              f"p99 {np.percentile(t, 99):6.1f} us  max {t.max():7.1f} us")


if __name__ == "__main__":
    main()
