"""Simulator speed: simulated requests per wall-clock second, one process.

Workload: the full Azure LLM inference 2023 conversation trace (19,366 requests,
../shared/data/traces), 4 instances, round robin, at the trace's native rate.
Reported for both shipped profiles, best of ``--repeat`` runs (the loop only;
loading and preparing the trace are timed separately). The baseline in the same
run is the naive per-iteration reference simulator of tests/sim_reference.py on a
prefix of the same trace, so the ratio shows what event skipping buys.

Target (issue #2): >= 20,000 simulated requests/s with 4 instances.
Usage: python benchmarks/sim_speed.py [--repeat 3] [--data-dir ../shared/data]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from routerd.policies.base import PolicyContext
from routerd.policies.registry import build_policy
from routerd.profiles import get_profile
from routerd.sim import ClusterSimulator, prepare_requests
from routerd.workloads.registry import load_workload


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--reference-requests", type=int, default=2000)
    args = ap.parse_args()
    t0 = time.perf_counter()
    wl = load_workload("azure-conv", data_dir=args.data_dir)
    print(f"loaded {len(wl.requests)} requests in {time.perf_counter() - t0:.2f} s")
    for name in ("llama2-7b-a100", "llama2-7b-v100"):
        prof = get_profile(name)
        best = float("inf")
        for _ in range(args.repeat):
            prep = prepare_requests(wl.requests, prof)
            sim = ClusterSimulator(prof, 4, build_policy("round_robin", None, PolicyContext(prof, 4)))
            t = time.perf_counter()
            run = sim.run(prep.requests)
            best = min(best, time.perf_counter() - t)
        n = len(prep.requests)
        iters = sum(i.iterations for i in run.instances)
        print(f"{name}: {n} requests ({len(prep.rejected)} rejected: prompt >= max_model_len), "
              f"{iters} engine iterations simulated in {best:.3f} s -> {n / best:,.0f} simulated requests/s, "
              f"{iters / best:,.0f} iterations/s")
        if name == "llama2-7b-a100":
            # Same-run baseline: the naive per-iteration simulator on one instance's share.
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from sim_reference import reference_run

            share = [r for r in prep.requests if r.instance == 0][: args.reference_requests]
            reqs = [(r.arrival_s, r.prompt, r.output) for r in share]
            t = time.perf_counter()
            reference_run(prof, reqs)
            ref = time.perf_counter() - t
            sim1 = ClusterSimulator(prof, 1, build_policy("round_robin", None, PolicyContext(prof, 1)))
            prep1 = prepare_requests(
                [q for q in wl.requests if q.id in {r.id for r in share}], prof)
            t = time.perf_counter()
            sim1.run(prep1.requests)
            fast = time.perf_counter() - t
            print(f"  one instance, {len(reqs)} requests: naive per-iteration {len(reqs) / ref:,.0f} req/s, "
                  f"event-skipping {len(reqs) / fast:,.0f} req/s, speed-up x{ref / fast:.1f}")


if __name__ == "__main__":
    from routerd.workloads.errors import WorkloadError

    try:
        main()
    except WorkloadError as e:
        raise SystemExit(f"{__file__}: {e}") from None
