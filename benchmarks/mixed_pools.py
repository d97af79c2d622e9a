"""Mixed pools (issue 18): profile-blind heuristics against ``predicted_latency``, and its decision cost.

For each pool x workload x evaluation seed: round robin's saturated throughput on that sample
and pool (``routerd.sim.capacity.round_robin_capacity``: requests offered at 1,000 req/s,
finished / makespan), the sample rescaled to each load (``--loads`` times that capacity), and
every policy run on the same requests (``routerd.bench.run_bench``, prediction ``true``: the
bucket of the true length). Mean and p99 E2E of each policy; ``predicted_latency`` paired seed by
seed (95% t-interval, ``routerd.bench.paired_interval``) against round robin and against the
best profile-blind heuristic of the cell (lowest mean E2E over the seeds among
``--blind``: every policy but ``predicted_latency`` reads one profile, the pool's first).

Seeds: generators (public-mix) are drawn with the seed; traces are cut into consecutive windows
of ``--requests``, window ``i`` for seed ``i`` (``routerd.bench.seed_workloads``). Seed 0 is the
training window: anything tuned was tuned there; report seeds >= 1 (the default 1-5).

Decision cost: thread CPU time (``time.thread_time_ns``) of each ``pick`` on hand-made views of
4 instances (the first pool) with ``--residents`` residents each (7 of 8 decoding, the rest
waiting; lengths drawn from public-mix's buckets), ``round_robin`` and ``predicted_latency``
interleaved in the same run.

    python benchmarks/mixed_pools.py                      # the default run (about 4 minutes on 2 cores)
    python benchmarks/mixed_pools.py --seeds 0 --policies "round_robin;predicted_latency:delay_weight=0.5"
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from routerd.bench import load_to_rate, paired_interval, run_bench, seed_workloads
from routerd.model import PREDICTOR_BUCKET_EDGES, bucket_mid_tokens
from routerd.policies import PolicyContext, ResidentRequest, RequestFeatures, StaticInstanceView, build_policy
from routerd.policies.base import ClusterView
from routerd.policies.kv_headroom import blocks_for
from routerd.policies.registry import PolicyError, build_policy_from_spec
from routerd.profiles import ProfileError, parse_pool, pool_label
from routerd.workloads.errors import WorkloadError

POOLS = "2xllama3.1-8b-a100,2xllama3.1-8b-h100;2xllama2-7b-v100,2xllama2-7b-a100"
WORKLOADS = "public-mix,azure-conv,azure-code"
BLIND = ("round_robin", "join_shortest_queue", "late_binding", "phasewise")
POLICIES = BLIND + ("predicted_latency",)


def fmt(iv) -> str:
    if iv.low is None:
        return f"{iv.mean:+.1f}%"
    return f"{iv.mean:+.1f}% [{iv.low:+.1f}, {iv.high:+.1f}]"


def static_views(pool, residents: int, rng: random.Random, count: int = 64) -> list[ClusterView]:
    """``count`` cluster views of hand-made instances, one per profile of ``pool``, each with
    ``residents`` residents (7 in 8 decoding, the rest waiting; lengths from public-mix's
    buckets), drawn from ``rng``. Every aggregate of these views is a scan of the residents."""
    m = len(pool)

    def resident(waiting: bool) -> ResidentRequest:
        b = rng.choice((0, 0, 1, 1, 2))
        pred = bucket_mid_tokens(b, PREDICTOR_BUCKET_EDGES)
        gen = 0 if waiting else rng.randint(0, int(1.2 * pred))
        return ResidentRequest(rng.randint(20, 2000), gen, b, pred, waiting, waiting)

    views = []
    for _ in range(count):
        insts = []
        for i in range(m):
            n_wait = residents // 8
            rs = [resident(False) for _ in range(residents - n_wait)] + [resident(True) for _ in range(n_wait)]
            bs = pool[i].block_size
            # A small GPU (a V100's 1,888 blocks) cannot hold 32 such residents: its view gets the
            # blocks they hold, so the decision is priced at the asked residency.
            held = sum(blocks_for(r.prompt_tokens + r.generated_tokens, bs) for r in rs)
            insts.append(StaticInstanceView.from_residents(i, rs, kv_total_blocks=max(pool[i].num_blocks, held),
                                                           block_size=bs))
        views.append(ClusterView(0.0, insts, 1))
    return views


def time_picks(pols: dict, picks: int, request, view) -> dict[str, dict[str, float]]:
    """p50 / p99 thread CPU time per ``pick`` (us, ``time.thread_time_ns``) and the share of
    picks that dispatched, of each of ``pols`` (name -> policy) on the same ``picks`` requests
    and views, interleaved: ``request(k)`` and ``view(k)`` give pick ``k``'s."""
    times: dict[str, list[int]] = {name: [] for name in pols}
    sent = dict.fromkeys(pols, 0)
    for k in range(picks):
        r, v = request(k), view(k)
        for name, p in pols.items():
            t0 = time.thread_time_ns()
            c = p.pick(r, v)
            times[name].append(time.thread_time_ns() - t0)
            sent[name] += c is not None
    out = {}
    for name, ts in times.items():
        ts.sort()
        out[name] = {"p50_us": ts[len(ts) // 2] / 1e3, "p99_us": ts[int(0.99 * (len(ts) - 1))] / 1e3,
                     "dispatched": sent[name] / max(1, picks)}
    return out


def bucket_request(rng: random.Random, k: int) -> RequestFeatures:
    """Request ``k`` of a decision-cost run: 20-2,000 prompt tokens, a predicted bucket at random."""
    b = rng.choice((0, 1, 2))
    return RequestFeatures(k, 0.0, rng.randint(20, 2000), b, bucket_mid_tokens(b, PREDICTOR_BUCKET_EDGES))


def decision_cost(pool, residents: int, picks: int, seed: int = 0) -> dict[str, dict[str, float]]:
    """:func:`time_picks` of round robin and ``predicted_latency`` on the same views
    (:func:`static_views`)."""
    rng = random.Random(seed)
    views = static_views(pool, residents, rng)
    ctx = PolicyContext(pool[0], len(pool), profiles=tuple(pool))
    pols = {name: build_policy(name, {}, ctx) for name in ("round_robin", "predicted_latency")}
    return time_picks(pols, picks, lambda k: bucket_request(rng, k), lambda k: views[k % len(views)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--pools", default=POOLS, help="';'-separated pools, each COUNTxPROFILE,...")
    ap.add_argument("--workloads", default=WORKLOADS, help="','-separated workload names")
    ap.add_argument("--loads", default="0.8,1.5,2", help="multiples of round robin's capacity")
    ap.add_argument("--seeds", default="1,2,3,4,5", help="','-separated list of the evaluation seeds to run (0 is the training window)")
    ap.add_argument("--requests", type=int, default=1000, help="requests per sample")
    ap.add_argument("--policies", default=";".join(POLICIES), help="';'-separated specs; must include round_robin and a predicted_latency spec")
    ap.add_argument("--blind", default=",".join(BLIND), help="the profile-blind heuristics to compare against")
    ap.add_argument("--residents", type=int, default=32, help="residents per instance for the decision cost")
    ap.add_argument("--picks", type=int, default=2000, help="timed picks per policy (0: skip)")
    ap.add_argument("--data-dir", default=None, help="folder with traces/ (default: ../shared/data)")
    ap.add_argument("--out", default="bench-out/mixed_pools.json",
                    help="the figures as JSON (default under bench-out/, which git ignores)")
    a = ap.parse_args(argv)

    specs = [s for s in a.policies.split(";") if s]
    blind = [s for s in a.blind.split(",") if s in specs]
    target = next((s for s in specs if s.startswith("predicted_latency")), None)
    if "round_robin" not in specs or target is None:
        raise SystemExit("mixed_pools: --policies must include round_robin and predicted_latency")
    try:
        seeds = [int(x) for x in a.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds: a ','-separated list of integers, got {a.seeds!r}")
    try:
        loads = [float(x) for x in a.loads.split(",")]
    except ValueError:
        ap.error(f"--loads: a ','-separated list of numbers, got {a.loads!r}")
    try:
        pools = [parse_pool(p) for p in a.pools.split(";") if p.strip()]
        for spec in specs:  # a misspelled policy or parameter fails here, before any run
            build_policy_from_spec(spec, PolicyContext(pools[0][0], len(pools[0]), profiles=tuple(pools[0])))
    except (ProfileError, PolicyError, ValueError, IndexError) as e:
        ap.error(str(e).splitlines()[0] if str(e) else f"no pool in --pools {a.pools!r}")
    t_start = time.time()
    results: list[dict] = []
    skipped = ran = 0
    if a.picks:
        cost = decision_cost(pools[0], a.residents, a.picks)
        print(f"decision cost, thread CPU per pick, {len(pools[0])} instances ({pool_label(pools[0])}) x "
              f"{a.residents} residents, {a.picks} picks each, interleaved:")
        for name, c in cost.items():
            print(f"  {name:18} p50 {c['p50_us']:8.1f} us   p99 {c['p99_us']:8.1f} us")
        results.append({"decision_cost": cost, "residents": a.residents, "pool": pool_label(pools[0])})
    for pool in pools:
        m = len(pool)
        label = pool_label(pool)
        for wl in a.workloads.split(","):
            gen = wl in ("public-mix", "paper-mix")
            try:
                every = seed_workloads(wl, list(range(max(seeds) + 1)), n=a.requests if gen else None,
                                       limit=None if gen else a.requests, data_dir=a.data_dir)
            except WorkloadError as e:
                print(f"\n### {wl}, {label}: skipped ({e})")
                skipped += 1
                continue
            ran += 1
            cells: dict[float, dict[str, list]] = {L: {s: [] for s in specs} for L in loads}
            caps = []
            for seed in seeds:
                reqs = every[seed].requests
                for L in loads:
                    offered, cap, rate = load_to_rate(reqs, pool, m, L)
                    if L == loads[0]:
                        caps.append(cap)
                    b = run_bench(offered, pool, m, specs, workload_name=wl, seed=seed)
                    for r in b.results:
                        cells[L][r.spec].append(r.summary)
            print(f"\n### {wl}, {label}: round robin capacity {statistics.fmean(caps):.3g} req/s (mean of "
                  f"{len(caps)} samples of {a.requests} requests); seeds {seeds}; {time.time() - t_start:.0f} s so far")
            for L in loads:
                c = cells[L]
                best = min(blind, key=lambda s: statistics.fmean(x.e2e_mean for x in c[s]))
                print(f"\nload {L:g}x (best profile-blind heuristic by mean E2E: {best})\n")
                print(f"| policy | mean E2E (s) | p99 E2E (s) | ΔE2E vs RR | ΔE2E vs {best} | Δp99 vs {best} |")
                print("|---|---|---|---|---|---|")
                for s in specs:
                    xs = c[s]
                    vs_rr = paired_interval([x.e2e_mean for x in xs], [x.e2e_mean for x in c["round_robin"]])
                    vs_b = paired_interval([x.e2e_mean for x in xs], [x.e2e_mean for x in c[best]])
                    vs_b99 = paired_interval([x.e2e_p99 for x in xs], [x.e2e_p99 for x in c[best]])
                    print(f"| {s} | {statistics.fmean(x.e2e_mean for x in xs):.2f} | "
                          f"{statistics.fmean(x.e2e_p99 for x in xs):.2f} | {fmt(vs_rr)} | {fmt(vs_b)} | {fmt(vs_b99)} |")
                    results.append({"pool": label, "workload": wl, "load": L, "policy": s, "seeds": seeds,
                                    "capacity_rps": caps, "best_blind": best,
                                    "e2e_mean": [x.e2e_mean for x in xs], "e2e_p99": [x.e2e_p99 for x in xs],
                                    "preemptions": [x.preemptions for x in xs],
                                    "vs_round_robin_e2e_mean": vs_rr.as_dict(),
                                    "vs_best_blind_e2e_mean": vs_b.as_dict(),
                                    "vs_best_blind_e2e_p99": vs_b99.as_dict()})
            sys.stdout.flush()
    if not ran:
        print(f"\nmixed_pools: all {skipped} cases skipped (the reasons are above: a workload name, or traces "
              "not found: give them with --data-dir or PHASEWISE_DATA_DIR, ../shared/data by default); "
              "nothing written", file=sys.stderr)
        return 1
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1))
    print(f"\nwrote {a.out} ({time.time() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
