"""Wall time of capacity at SLO for nine policies: the old serial path against the new one, one run.

Workload: the first ``--limit`` (1,000) requests of the Mooncake FAST'25 synthetic trace
(../shared/data/traces), 4 instances of ``llama3.1-8b-h100``, true output buckets, one seed,
limits ``--slo`` (default p90 TTFT <= 3 s and p90 TPOT <= 50 ms: the isolated p90 TTFT of
these long prompts is 2.7-2.95 s depending on the policy, so the search both halves and
doubles), tolerance 2%.

- **old**: the search as it was before issue 32 (:func:`old_capacity_at_slo`, a verbatim copy
  of ``routerd.bench.capacity_at_slo`` then), one policy after another, round robin's
  saturated throughput computed once and given as the start rate (as ``phasewise bench
  --capacity-slo`` did): every probe re-prepares the requests, every policy re-derives the
  isolated schedule. It runs on today's simulator (integer tick grid): with the old tick
  rule a holding policy could loop forever at low rates, which no timing can show.
- **new, 1 job**: :func:`routerd.bench.capacities_at_slo` with ``jobs=1`` (shared start rate,
  isolated schedule and prepared requests; in this process).
- **new, N jobs**: the same in ``--jobs`` worker processes (default: the CPU count), what
  ``phasewise bench --capacity-slo`` now runs.

The script checks that the three give identical results (every field of every
``SloCapacity.as_dict()``, floats compared exactly) and prints each wall time, the CPU
seconds used (this process plus its workers: the work, whatever else runs on the machine)
and the wall-time ratios.
Target (issue 32): the new path under 120 s for nine policies on 1,000 requests on 2 cores.

Usage: python benchmarks/capacity_slo_speed.py [--jobs N] [--limit 1000] [--slo ttft_p90=3,tpot_p90=0.05]
       [--policies a,b,...] [--data-dir ../shared/data] [--skip-old]
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import time

from routerd.bench import (SloCapacity, SloSearch, capacities_at_slo, isolated_requests, meets_slo, parse_slo,
                           policy_context, run_policy, steady_rate_bound)
from routerd.policies.registry import build_policy_from_spec
from routerd.profiles import get_profile
from routerd.sim.capacity import round_robin_capacity
from routerd.sim.report import Summary, summarize
from routerd.workloads.registry import load_workload
from routerd.workloads.traces import rescale_to_rate

POLICIES = ("round_robin", "join_shortest_queue", "late_binding", "llmd", "sglang_cache_aware", "dynamo_kv",
            "lmetric", "phasewise", "predicted_latency")


def old_capacity_at_slo(requests, profile, instances, spec, limits, *, seed=0, prediction="true", tol=0.02,
                        start_rate=None, action_interval_s=0.02, max_steps=16) -> SloCapacity:
    """``routerd.bench.capacity_at_slo`` before issue 32, verbatim (the old serial path)."""
    if not (0 < tol <= 1):
        raise ValueError(f"tol must be in (0, 1], got {tol!r}")
    build_policy_from_spec(spec, policy_context(profile, instances, seed=seed))
    probes: list[tuple[float, bool]] = []
    at: dict[float, Summary] = {}

    def simulate(reqs):
        policy = build_policy_from_spec(spec, policy_context(profile, instances, seed=seed))
        run, _ = run_policy(profile, instances, policy, reqs, prediction=prediction, seed=seed,
                            action_interval_s=action_interval_s)
        return run

    def ok(rate: float) -> bool:
        s = summarize(simulate(rescale_to_rate(list(requests), rate)))
        met = meets_slo(s, limits)
        probes.append((rate, met))
        if met:
            at[rate] = s
        return met

    alone = isolated_requests(requests, profile)
    gap = alone[1].arrival_s if len(alone) > 1 else math.inf
    while True:
        iso_run = simulate(alone)
        longest = max((r.finish_s - r.arrival_s for r in iso_run.requests), default=0.0)
        if longest <= gap:
            break
        gap = 2 * longest
        alone = isolated_requests(requests, profile, gap)
    iso = summarize(iso_run)
    if not meets_slo(iso, limits):
        return SloCapacity(spec, 0.0, None, None, probes, None, False, True, iso)

    sat = steady_rate_bound(iso.requests, iso)
    r = start_rate if start_rate is not None else round_robin_capacity(requests, profile, instances)
    r = min(r, sat)
    lo = hi = None
    if ok(r):
        lo = r
        steps = 0
        while lo < sat and steps < max_steps:
            steps += 1
            r = min(2 * r, sat)
            if not ok(r):
                hi = r
                break
            lo = r
        if hi is None and lo >= sat:
            return SloCapacity(spec, lo, None, at[lo], probes, sat, True, isolated=iso)
    else:
        hi = r
        for _ in range(max_steps):
            r /= 2
            if ok(r):
                lo = r
                break
            hi = r
    if lo is None:
        return SloCapacity(spec, 0.0, hi, None, probes, sat, isolated=iso)
    if hi is not None:
        while hi / lo > 1 + tol:
            mid = math.sqrt(lo * hi)
            if ok(mid):
                lo = mid
            else:
                hi = mid
    return SloCapacity(spec, lo, hi, at[lo], probes, sat, isolated=iso)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="mooncake")
    ap.add_argument("--limit", type=int, default=1000)
    ap.add_argument("--profile", default="llama3.1-8b-h100")
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--slo", default="ttft_p90=3,tpot_p90=0.05")
    ap.add_argument("--tol", type=float, default=0.02)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--skip-old", action="store_true", help="time the new path only")
    a = ap.parse_args()
    limits = parse_slo(a.slo)
    specs = [s for s in a.policies.split(",") if s]
    prof = get_profile(a.profile)
    reqs = load_workload(a.workload, limit=a.limit, data_dir=a.data_dir).requests
    print(f"{a.workload} --limit {a.limit}: {len(reqs)} requests, {a.instances} x {a.profile}, SLO {limits}, "
          f"tol {a.tol:g}, {len(specs)} policies, {os.cpu_count()} CPUs")

    def cpu() -> float:
        # CPU seconds of this process and of its finished worker processes (they are joined
        # when the pool closes): the work done, whatever else shares the machine.
        ch = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + ch.ru_utime + ch.ru_stime

    def timed(fn):
        c, t = cpu(), time.perf_counter()
        out = fn()
        return time.perf_counter() - t, cpu() - c, out

    def old():
        start = round_robin_capacity(reqs, prof, a.instances)
        return {spec: old_capacity_at_slo(reqs, prof, a.instances, spec, limits, tol=a.tol, start_rate=start)
                for spec in specs}

    def new(jobs: int):
        return capacities_at_slo([SloSearch(reqs, prof, a.instances, limits, tol=a.tol)], specs, jobs=jobs)[0]

    load = os.getloadavg()
    results = {}
    if not a.skip_old:
        results["old serial"] = timed(old)
    results["new, 1 job"] = timed(lambda: new(1))
    results[f"new, {a.jobs} jobs"] = timed(lambda: new(a.jobs))

    _, _, ref = next(iter(results.values()))
    print(f"{'policy':22} {'capacity req/s':>14} {'probes':>6}")
    for spec in specs:
        c = ref[spec]
        mark = " (infeasible)" if c.infeasible else " (bound)" if c.at_bound else ""
        print(f"{spec:22} {c.rate_rps:14.4f} {len(c.probes):6d}{mark}")
    same = all(caps[s].as_dict() == ref[s].as_dict() for _, _, caps in results.values() for s in specs)
    print(f"identical results ({', '.join(results)}): {'yes' if same else 'NO'}")
    print(f"load average before the timings: {load[0]:.2f} (1 min), {load[1]:.2f} (5 min)")
    for name, (wall, used, _) in results.items():
        print(f"  {name:14}: {wall:7.2f} s wall, {used:7.2f} s CPU (with workers)")
    names = list(results)
    base = results[names[0]][0]
    for name in names[1:]:
        print(f"  wall {names[0]} / {name}: {base / results[name][0]:.2f}x")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
