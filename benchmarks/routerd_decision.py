"""Time one routing decision inside routerd's decision core (no HTTP): the policy's cost per request.

A :class:`routerd.daemon.router.Router` holds 4 endpoints (``llama2-7b-v100``), each with
``--load`` requests in flight whose first token arrived and whose generated tokens
grow, so every instance has a realistic load summary. Each timed decision is one
``Router.try_dispatch_now``: refreshing the candidates' views, the policy's ``pick``,
booking the request and updating the metrics -- what a request costs routerd in
decisions. It is then released (not timed). Each decision is timed by the wall clock
and by the thread's CPU clock (the latter is what it costs; the former also counts
time the thread was preempted, which dominates p99 on a busy machine). The same run
measures the bare ``policy.pick`` for comparison.

Target (issue #5): <= 100 microseconds per decision, round robin and dqn (here a
seeded random network of the trained shape, 64 hidden units; the cost does not depend
on the weights' values).

With ``--models K`` (K > 1) the instances are split round robin over K models (``endpoints[].models``)
and the requests name them in turn: each decision then also looks up its model's precomputed
endpoints and its own policy instance (issue #15, several models behind one routerd).

Usage: python benchmarks/routerd_decision.py [--n 20000] [--load 32] [--instances 4] [--models 1]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

import numpy as np

from routerd.daemon.config import PolicyConfig, RouterConfig
from routerd.daemon.discovery import DiscoveredEndpoint
from routerd.daemon.metrics import Metrics
from routerd.daemon.router import Router, build_routing_policy
from routerd.policies.base import ClusterView
from routerd.policies.dqn.checkpoint import save_checkpoint
from routerd.policies.dqn.features import obs_dim
from routerd.profiles import get_profile


def random_checkpoint(m: int, hidden: int = 64) -> str:
    rng = np.random.default_rng(0)
    d, a = obs_dim(m), m + 1
    w = {"l1.weight": rng.normal(size=(hidden, d)), "l1.bias": rng.normal(size=hidden),
         "l2.weight": rng.normal(size=(hidden, hidden)), "l2.bias": rng.normal(size=hidden),
         "l3.weight": rng.normal(size=(a, hidden)), "l3.bias": rng.normal(size=a)}
    path = tempfile.mkdtemp(prefix="pw-dqn-bench-")
    save_checkpoint(path, w, {"variant": "baseline", "num_instances": m})
    return path


def percentiles(ns: list[int]) -> tuple[float, float, float]:
    a = np.asarray(ns) / 1000.0
    return float(np.percentile(a, 50)), float(np.percentile(a, 99)), float(a.mean())


async def measure(name: str, params: dict, m: int, n: int, load: int, models: int = 1) -> None:
    prof = get_profile("llama2-7b-v100")
    policy = build_routing_policy(PolicyConfig(name=name, params=params), prof, m)
    router = Router(profile=prof, policy=policy, policy_name=name, metrics=Metrics(), config=RouterConfig(),
                    state_max_age_s=2.0)
    names = [f"model-{k}" for k in range(models)] if models > 1 else [None]
    router.set_endpoints([DiscoveredEndpoint(f"e{i}", f"http://10.0.0.{i}:8000",
                                             models=() if names[0] is None else (names[i % models],))
                          for i in range(m)])
    rng = np.random.default_rng(1)
    for ep in router.endpoints:  # background load: decoding requests with progress
        for _ in range(load):
            r = router.new_request(int(rng.integers(50, 2000)), int(rng.integers(0, 4)))
            ep.add(r, 0.0)
            ep.on_first_token(r)
            ep.on_tokens(r, int(rng.integers(1, 500)))
    decide_ns: list[int] = []
    decide_cpu_ns: list[int] = []
    pick_ns: list[int] = []
    wall, cpu = time.perf_counter_ns, time.thread_time_ns
    for k in range(n):
        model = names[k % len(names)]
        r = router.new_request(int(rng.integers(50, 2000)), int(rng.integers(0, 4)), model=model)
        c, t = cpu(), wall()
        ep = router.try_dispatch_now(r)
        t, c = wall() - t, cpu() - c
        decide_ns.append(t)
        decide_cpu_ns.append(c)
        if ep is not None:
            router.finish(r)
        for e in router.endpoints:
            e.refresh(time.monotonic(), 2.0)
        t = wall()
        router._policy_for(model).pick(r.features, ClusterView(time.monotonic(), router._eps_for(model), 1))
        pick_ns.append(wall() - t)
    d50, d99, _ = percentiles(decide_ns[n // 10:])
    c50, c99, _ = percentiles(decide_cpu_ns[n // 10:])
    p50, p99, _ = percentiles(pick_ns[n // 10:])
    print(f"{name:20s} decision wall p50 {d50:6.1f} p99 {d99:7.1f} | CPU p50 {c50:6.1f} p99 {c99:7.1f} | "
          f"pick alone wall p50 {p50:6.1f} p99 {p99:7.1f}   (us; m={m}, {load} in flight per instance, "
          f"{models} model{'s' if models > 1 else ''})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--load", type=int, default=32, help="requests in flight per instance")
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--models", type=int, default=1, help="models the instances are split over")
    a = ap.parse_args()
    if not 1 <= a.models <= a.instances or a.instances % a.models:
        ap.error(f"--models must divide --instances ({a.instances})")
    m = a.instances
    for name, params in (("round_robin", {}), ("dqn", {"checkpoint": random_checkpoint(m // a.models), "allow_hold": False}),
                         ("late_binding", {}), ("join_shortest_queue", {})):
        asyncio.run(measure(name, params, m, a.n, a.load, a.models))


if __name__ == "__main__":
    main()
