"""Simulator speed with prefix caching on, against caching off and the naive reference, one run.

Workload: the Mooncake FAST'25 synthetic trace (3,993 requests with ``hash_ids``,
../shared/data/traces), 4 instances of ``llama3.1-8b-h100``, round robin, native timing.
Best of ``--repeat`` runs of the event loop only (loading and preparing timed apart).
Baselines in the same run: the same trace with ``prefix_caching`` off, and the naive
per-iteration simulator of tests/sim_reference.py (no prefix caching) on instance 0's share.

Targets (issue #13): caching on >= 0.7x caching off, and >= 5x the naive reference.
Usage: python benchmarks/prefix_sim_speed.py [--repeat 3] [--data-dir ../shared/data]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

from routerd.policies.base import PolicyContext
from routerd.policies.registry import build_policy
from routerd.profiles import get_profile
from routerd.sim import ClusterSimulator, prepare_requests
from routerd.workloads.registry import load_workload


def best_run(prof, requests, repeat: int):
    best = float("inf")
    for _ in range(repeat):
        prep = prepare_requests(requests, prof)
        sim = ClusterSimulator(prof, 4, build_policy("round_robin", None, PolicyContext(prof, 4)))
        run = None
        gc.collect()  # the previous run's garbage is not this run's cost
        t = time.perf_counter()
        run = sim.run(prep.requests)
        best = min(best, time.perf_counter() - t)
    return best, prep, run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--profile", default="llama3.1-8b-h100")
    args = ap.parse_args()
    wl = load_workload("mooncake", data_dir=args.data_dir)
    on = get_profile(args.profile)
    off = on.model_copy(update={"prefix_caching": False})
    # Interleaved (off, on, off, on, ...) so that neither gains from running first.
    t_on = t_off = float("inf")
    for _ in range(args.repeat):
        t, _, _ = best_run(off, wl.requests, 1)
        t_off = min(t_off, t)
        t, prep, run = best_run(on, wl.requests, 1)
        t_on = min(t_on, t)
    n = len(prep.requests)
    hits = sum(i.prefix_hits for i in run.instances) / max(1, sum(i.prefix_queries for i in run.instances))
    print(f"{args.profile}, 4 instances, mooncake: {n} requests ({len(prep.rejected)} rejected)")
    print(f"  caching on : {t_on:.3f} s -> {n / t_on:,.0f} simulated requests/s (hit rate {100 * hits:.1f}%)")
    print(f"  caching off: {t_off:.3f} s -> {n / t_off:,.0f} simulated requests/s")
    print(f"  on / off speed ratio: {t_off / t_on:.2f} (target >= 0.7)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from sim_reference import reference_run

    share = [r for r in prep.requests if r.instance == 0]
    gc.collect()
    t = time.perf_counter()
    reference_run(off, [(r.arrival_s, r.prompt, r.output) for r in share])
    ref = time.perf_counter() - t
    one_reqs = [q for q in wl.requests if q.id in {r.id for r in share}]
    best = float("inf")
    for _ in range(args.repeat):
        p1 = prepare_requests(one_reqs, on)
        sim = ClusterSimulator(on, 1, build_policy("round_robin", None, PolicyContext(on, 1)))
        gc.collect()
        t = time.perf_counter()
        sim.run(p1.requests)
        best = min(best, time.perf_counter() - t)
    print(f"  one instance, {len(share)} requests: naive per-iteration (no caching) {len(share) / ref:,.0f} req/s, "
          f"event-skipping with caching {len(share) / best:,.0f} req/s, x{ref / best:.1f} (target >= 5)")


if __name__ == "__main__":
    from routerd.workloads.errors import WorkloadError

    try:
        main()
    except WorkloadError as e:
        raise SystemExit(f"{__file__}: {e}") from None
