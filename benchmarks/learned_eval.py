"""Issue 18's evaluation of the learned router on held-out samples, at loads relative to capacity.

For each workload x instance count x load: samples ``0 .. --seeds - 1`` of the workload's
*held-out* part (``routerd.rl.splits.sample(workload, "eval", i, n, rate)``: generators draw seeds
0, 1, ...; traces cut windows from their last 40%; ``routerd/rl/es.py`` trains on the training
part only, and validates on training-part samples 900,000+), each rescaled to ``--loads`` times
round robin's saturated throughput on that sample and pool (``routerd.sim.capacity``), and every
policy run on the same requests (``routerd.bench.run_bench``, prediction ``true``). Printed per
cell: each policy's mean and p99 E2E, and paired 95% t-intervals (``routerd.bench.paired_interval``)
of its change against ``late_binding`` (the best heuristic on homogeneous pools) and against
round robin, mean and p99.

``learned_linear`` runs with the checkpoint named for the workload when one ships
(``checkpoint=azure-conv`` on azure-conv, ...; :data:`routerd.policies.learned_linear.SHIPPED`),
else the default; ``--policies`` takes any specs.

    python benchmarks/learned_eval.py                    # about 6 minutes on 2 cores
    python benchmarks/learned_eval.py --workloads public-mix --instances 8 --loads 1.5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from routerd.bench import load_to_rate, paired_interval, run_bench
from routerd.policies import PolicyContext
from routerd.policies.learned_linear import SHIPPED
from routerd.policies.registry import PolicyError, build_policy_from_spec
from routerd.profiles import ProfileError, get_profile
from routerd.rl import splits
from routerd.workloads.errors import WorkloadError

POLICIES = "round_robin;late_binding;predicted_latency;learned_linear"
COST_PROFILE = "llama3.1-8b-h100"  # room for 32 residents per instance, so every timed pick chooses


def fmt(iv) -> str:
    return f"{iv.mean:+.1f}%" if iv.low is None else f"{iv.mean:+.1f}% [{iv.low:+.1f}, {iv.high:+.1f}]"


def specs_for(workload: str, specs: list[str]) -> list[str]:
    """``learned_linear`` with the checkpoint shipped for ``workload`` (if any, and if the spec sets none)."""
    out = []
    for s in specs:
        if s == "learned_linear" and workload in SHIPPED:
            s = f"learned_linear:checkpoint={workload}"
        out.append(s)
    return out


def decision_cost(prof, m: int, residents: int, picks: int, specs: list[str], seed: int = 0) -> dict[str, tuple[float, float]]:
    """(p50, p99) thread CPU per ``pick`` (us) of each spec, and the share of its picks that
    dispatched, on routerd's own instance views (``routerd.daemon.state.EndpointState``, O(1)
    load aggregates, as a live decision reads them; ``benchmarks/prefix_decision_cost.py``'s
    ``views``) of ``m`` instances of ``prof`` with ``residents`` requests each (3 in 4
    decoding), interleaved. ``prof`` should have room for
    them (a hold costs less than a choice)."""
    import random

    import numpy as np

    from routerd.policies import RequestFeatures
    from routerd.policies.base import ClusterView

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from mixed_pools import time_picks
    from prefix_decision_cost import views  # routerd's own views with residents, as the prefix benchmark builds them

    eps = views(prof, m, residents, np.random.default_rng(seed))
    view = ClusterView(0.0, eps, 1)
    rng = random.Random(seed)
    pols = {s: build_policy_from_spec(s, PolicyContext(prof, m, seed=seed)) for s in specs}
    cost = time_picks(pols, picks, lambda k: RequestFeatures(k, 0.0, rng.randint(20, 2000), 1, 400.0),
                      lambda k: view)
    return {s: (c["p50_us"], c["p99_us"], c["dispatched"]) for s, c in cost.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--workloads", default="public-mix,azure-conv,azure-code", help="','-separated workloads")
    ap.add_argument("--profile", default="llama2-7b-v100", help="every instance's hardware profile")
    ap.add_argument("--instances", default="4", help="','-separated instance counts")
    ap.add_argument("--loads", default="0.8,1.5,2", help="','-separated multiples of round robin's capacity")
    ap.add_argument("--seeds", type=int, default=5, help="held-out samples per cell (>= 2)")
    ap.add_argument("--requests", type=int, default=1000, help="requests per sample")
    ap.add_argument("--policies", default=POLICIES, help="';'-separated specs; must include round_robin and late_binding")
    ap.add_argument("--data-dir", default=None, help="folder with traces/ (default: ../shared/data)")
    ap.add_argument("--out", default="bench-out/learned_eval.json", help="the figures as JSON")
    ap.add_argument("--picks", type=int, default=3000, help="timed picks per policy for the decision cost (0: skip)")
    ap.add_argument("--residents", type=int, default=32, help="residents per instance for the decision cost")
    a = ap.parse_args(argv)
    specs = [s for s in a.policies.split(";") if s]
    if "round_robin" not in specs or "late_binding" not in specs:
        ap.error("--policies must include round_robin and late_binding")
    if a.seeds < 2 or a.requests < 1 or a.picks < 0 or a.residents < 1:
        ap.error("--seeds must be >= 2, --requests and --residents >= 1, --picks >= 0")
    try:
        ms = [int(x) for x in a.instances.split(",")]
        loads = [float(x) for x in a.loads.split(",")]
        if min(ms) < 1 or not all(x > 0 for x in loads):
            raise ValueError(f"--instances and --loads must be > 0, got {a.instances!r} and {a.loads!r}")
        prof = get_profile(a.profile)
        n_of = {}
        for wl in a.workloads.split(","):
            # Disjoint held-out windows: a trace's part holds only so many of --requests.
            n_of[wl] = splits.eval_requests(wl, a.requests, a.seeds, a.data_dir)
            if note := splits.shrink_note(wl, a.requests, n_of[wl], a.seeds):
                print(note)
            splits.sample(wl, "eval", a.seeds - 1, n_of[wl], 20.0, a.data_dir)
            for s in specs_for(wl, specs):
                build_policy_from_spec(s, PolicyContext(prof, ms[0]))
    except (ValueError, ProfileError, PolicyError, WorkloadError) as e:
        ap.error(str(e).splitlines()[0])
    t0 = time.time()
    results = []
    if a.picks:
        cost_specs = ["round_robin", "late_binding", "learned_linear"]
        for m in ms:
            cost = decision_cost(get_profile(COST_PROFILE), m, a.residents, a.picks, cost_specs)
            print(f"decision cost, thread CPU per pick, {m} x {COST_PROFILE} x {a.residents} residents, {a.picks} picks, "
                  "interleaved: " + "; ".join(f"{s} p50 {c[0]:.1f} us p99 {c[1]:.1f} us ({100 * c[2]:.0f}% dispatched)"
                                              for s, c in cost.items()))
            results.append({"decision_cost_us": {s: {"p50": c[0], "p99": c[1], "dispatched": c[2]} for s, c in cost.items()},
                            "instances": m, "residents": a.residents, "profile": COST_PROFILE})
    for wl in a.workloads.split(","):
        wspecs = specs_for(wl, specs)
        for m in ms:
            samples = [splits.sample(wl, "eval", i, n_of[wl], 20.0, a.data_dir) for i in range(a.seeds)]
            for load in loads:
                runs = {s: [] for s in wspecs}
                caps = []
                for i, reqs in enumerate(samples):
                    scaled, cap, _ = load_to_rate(reqs, prof, m, load)
                    caps.append(cap)
                    b = run_bench(scaled, prof, m, wspecs, workload_name=wl, seed=i)
                    for s, r in zip(wspecs, b.results):
                        runs[s].append(r.summary)
                lb, rr = runs["late_binding"], runs["round_robin"]
                print(f"\n### {wl}, {m} x {a.profile}, {load:g}x round robin's capacity (mean {statistics.fmean(caps):.2f} "
                      f"req/s), held-out samples 0-{a.seeds - 1}; {time.time() - t0:.0f} s so far\n")
                print("| policy | mean E2E (s) | p99 E2E (s) | ΔE2E vs late_binding | Δp99 vs late_binding | ΔE2E vs RR | Δp99 vs RR |")
                print("|---|---|---|---|---|---|---|")
                for s in wspecs:
                    xs = runs[s]
                    e, p = [x.e2e_mean for x in xs], [x.e2e_p99 for x in xs]
                    ivs = (paired_interval(e, [x.e2e_mean for x in lb]), paired_interval(p, [x.e2e_p99 for x in lb]),
                           paired_interval(e, [x.e2e_mean for x in rr]), paired_interval(p, [x.e2e_p99 for x in rr]))
                    print(f"| {s} | {statistics.fmean(e):.2f} | {statistics.fmean(p):.2f} | " + " | ".join(map(fmt, ivs)) + " |")
                    results.append({"workload": wl, "instances": m, "load": load, "policy": s, "capacity_rps": caps,
                                    "e2e_mean": e, "e2e_p99": p,
                                    "vs_late_binding_e2e_mean": ivs[0].as_dict(), "vs_late_binding_e2e_p99": ivs[1].as_dict(),
                                    "vs_round_robin_e2e_mean": ivs[2].as_dict(), "vs_round_robin_e2e_p99": ivs[3].as_dict()})
                sys.stdout.flush()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1))
    print(f"\nwrote {a.out} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
