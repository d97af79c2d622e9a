"""Prefix-cache-aware routing table: every policy on prefix workloads and a control.

For each workload x pool x evaluation seed: round robin's saturated throughput on that
sample is its capacity (``routerd.sim.capacity``); the sample is offered at each load (a
multiple of that capacity) to every policy, and each policy's mean E2E, p90 TTFT and
prefix-cache hit rate are paired seed by seed against round robin and against the best
anchor of that cell (95% t-intervals, ``routerd.bench.paired_interval``). With
``--capacity``, each policy's capacity at SLO (the highest rate whose p90 TTFT and p90 TPOT
meet the limits, ``routerd.bench.capacity_at_slo``) is found per seed as well.

Seeds: generators (``shared-prefix``) are drawn with the seed; traces are cut into
consecutive windows, window ``i`` for seed ``i`` (``routerd.bench.seed_workloads``). Seed 0
is the training window (policy parameters were chosen on it); report evaluation seeds >= 1.

    python benchmarks/prefix_table.py                       # the docs/prefix.md table
    python benchmarks/prefix_table.py --capacity            # plus capacity at SLO
    python benchmarks/prefix_table.py --workloads mooncake --pools 4xllama3.1-8b-h100 --loads 1.5 --seeds 1

Prints a markdown table per cell and writes ``--out`` (JSON) with every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from routerd.bench import capacity_at_slo, load_to_rate, paired_interval, seed_workloads
from routerd.policies.base import PolicyContext
from routerd.policies.registry import build_policy_from_spec
from routerd.profiles import get_profile
from routerd.sim import ClusterSimulator, prepare_requests
from routerd.sim.report import summarize

ANCHORS = ("llmd", "llmd:prefix_source=precise", "sglang_cache_aware", "dynamo_kv", "lmetric")
"""The anchors' cache-aware policies at their defaults (plus llm-d's precise mode)."""
POLICIES = ("round_robin", "join_shortest_queue", "late_binding", "mixing_penalty") + ANCHORS + ("phasewise",)
WORKLOADS = ("shared-prefix:llmd-capacity", "mooncake", "azure-conv")
POOLS = ("4xllama3.1-8b-h100", "16xllama3.1-8b-h100", "4xllama3.1-8b-a100", "16xllama3.1-8b-a100")


def parse_pool(text: str) -> tuple[int, str]:
    """``COUNTxPROFILE`` -> (count, profile name)."""
    count, sep, prof = text.partition("x")
    if not sep or not count.isdigit() or int(count) < 1:
        raise SystemExit(f"prefix_table: --pools entry {text!r} is not COUNTxPROFILE (e.g. 4xllama3.1-8b-h100)")
    get_profile(prof)
    return int(count), prof


def lone_ttft_p90(requests, profile) -> float:
    """p90 over requests of the TTFT each would see alone on an idle instance, uncached (s):
    its prompt in chunks of ``max_num_batched_tokens`` through the profile's step time."""
    times = []
    bs = profile.max_num_batched_tokens
    for r in requests:
        if r.prompt_tokens >= profile.max_model_len:
            continue
        t, done = 0.0, 0
        while done < r.prompt_tokens:
            c = min(bs, r.prompt_tokens - done)
            t += profile.prefill_time(c, done)
            done += c
        times.append(t)
    times.sort()
    return times[min(len(times) - 1, int(0.9 * len(times)))]


def auto_slo(requests, profile) -> str:
    """The issue's limits (p90 TTFT <= 2 s, p90 TPOT <= 50 ms), with the TTFT limit raised to
    1.5x the p90 of the requests' own uncached prefill alone (rounded up to 0.5 s) where that is
    longer: no router can beat an idle instance, and Mooncake's p90 prompt (38.6K tokens) takes
    3.4 s alone on ``llama3.1-8b-h100`` (9.7 s on the A100)."""
    ttft = max(2.0, math.ceil(1.5 * lone_ttft_p90(requests, profile) / 0.5) * 0.5)
    return f"ttft_p90={ttft:g},tpot_p90=0.05"


def run_one(requests, profile, m: int, spec: str, seed: int):
    pol = build_policy_from_spec(spec, PolicyContext(profile, m, seed=seed))
    prep = prepare_requests(requests, profile, seed=seed)
    run = ClusterSimulator(profile, m, pol).run(prep.requests)
    return summarize(run)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--pools", default=",".join(POOLS[:2]), help="COUNTxPROFILE list")
    ap.add_argument("--loads", default="0.8,1.5,2", help="multiples of round robin's capacity")
    ap.add_argument("--seeds", default="1,2,3", help="evaluation seeds (0 is the training window)")
    ap.add_argument("--policies", default=";".join(POLICIES), help="';'-separated policy specs")
    ap.add_argument("--requests", type=int, default=600,
                    help="requests per sample for 4 instances; scaled with the pool size (x m/4)")
    ap.add_argument("--capacity", action="store_true", help="also find each policy's capacity at SLO")
    ap.add_argument("--slo", default="auto",
                    help="capacity-at-SLO limits (s), e.g. ttft_p90=2,tpot_p90=0.05; auto: see auto_slo()")
    ap.add_argument("--out", default="prefix_table.json")
    a = ap.parse_args(argv)

    from routerd.bench import parse_slo

    specs = [s for s in a.policies.split(";") if s]
    if "round_robin" not in specs:
        raise SystemExit("prefix_table: --policies must include round_robin (the baseline)")
    for s in specs:
        build_policy_from_spec(s, PolicyContext(get_profile("llama3.1-8b-h100"), 4))
    seeds = [int(x) for x in a.seeds.split(",")]
    loads = [float(x) for x in a.loads.split(",")]
    pools = [parse_pool(p) for p in a.pools.split(",")]
    results: list[dict] = []
    t_start = time.time()
    for wl in a.workloads.split(","):
        for m, prof_name in pools:
            profile = get_profile(prof_name)
            n = a.requests * max(1, m // 4)
            gen = wl.startswith("shared-prefix")
            every = seed_workloads(wl, list(range(max(seeds) + 1)), n=n if gen else None, limit=None if gen else n)
            samples = [every[s] for s in seeds]
            cells: dict[float, dict[str, list]] = {L: {s: [] for s in specs} for L in loads}
            caps = []
            slo_caps: dict[str, list[float]] = {s: [] for s in specs}
            slo = auto_slo(samples[0].requests, profile) if a.slo == "auto" else a.slo
            limits = parse_slo(slo)
            for seed, w in zip(seeds, samples):
                reqs = w.requests
                for L in loads:
                    offered, cap, rate = load_to_rate(reqs, profile, m, L)
                    if L == loads[0]:
                        caps.append(cap)
                    for s in specs:
                        cells[L][s].append(run_one(offered, profile, m, s, seed))
                if a.capacity:
                    for s in specs:
                        c = capacity_at_slo(reqs, profile, m, s, limits, seed=seed, tol=0.05)
                        slo_caps[s].append(c.rate_rps)
            print(f"\n### {wl}, {m} x {prof_name}: round robin capacity "
                  f"{sum(caps) / len(caps):.3g} req/s (mean of {len(caps)} samples of {n} requests); "
                  f"seeds {seeds}; {time.time() - t_start:.0f} s so far")
            for L in loads:
                rr = cells[L]["round_robin"]
                anchors = [s for s in specs if s in ANCHORS]

                def mean(xs):
                    return sum(xs) / len(xs)

                best_anchor = min(anchors, key=lambda s: mean([x.e2e_mean for x in cells[L][s]])) if anchors else None
                print(f"\nload {L}x (best anchor by mean E2E: {best_anchor})\n")
                print("| policy | mean E2E (s) | p90 TTFT (s) | hit rate | ΔE2E vs RR | Δp90 TTFT vs RR | "
                      "ΔE2E vs best anchor | Δp90 TTFT vs best anchor |")
                print("|---|---|---|---|---|---|---|---|")
                for s in specs:
                    xs = cells[L][s]
                    row = {"workload": wl, "instances": m, "profile": prof_name, "load": L, "policy": s,
                           "seeds": seeds, "e2e_mean": [x.e2e_mean for x in xs], "ttft_p90": [x.ttft_p90 for x in xs],
                           "ttft_mean": [x.ttft_mean for x in xs], "tpot_p90": [x.tpot_p90 for x in xs],
                           "hit_rate": [x.prefix_hit_rate for x in xs], "preemptions": [x.preemptions for x in xs]}

                    def iv(metric, base):
                        v = paired_interval([getattr(x, metric) for x in xs], [getattr(x, metric) for x in base])
                        return v

                    def fmt(v):
                        if v.low is None:
                            return f"{v.mean:+.1f}%"
                        return f"{v.mean:+.1f}% [{v.low:+.1f}, {v.high:+.1f}]"

                    d_rr_e, d_rr_t = iv("e2e_mean", rr), iv("ttft_p90", rr)
                    row["vs_rr"] = {"e2e_mean": d_rr_e.as_dict(), "ttft_p90": d_rr_t.as_dict()}
                    if best_anchor is not None:
                        ba = cells[L][best_anchor]
                        d_ba_e, d_ba_t = iv("e2e_mean", ba), iv("ttft_p90", ba)
                        row["vs_best_anchor"] = {"anchor": best_anchor, "e2e_mean": d_ba_e.as_dict(),
                                                 "ttft_p90": d_ba_t.as_dict()}
                        ba_txt = f"{fmt(d_ba_e)} | {fmt(d_ba_t)}"
                    else:
                        ba_txt = "- | -"
                    hits = [h for h in row["hit_rate"] if h is not None]
                    hit_txt = f"{100 * mean(hits):.1f}%" if hits else "-"
                    print(f"| {s} | {mean(row['e2e_mean']):.2f} | {mean(row['ttft_p90']):.2f} | {hit_txt} | "
                          f"{fmt(d_rr_e)} | {fmt(d_rr_t)} | {ba_txt} |")
                    results.append(row)
            if a.capacity:
                rr_c = slo_caps["round_robin"]
                print(f"\ncapacity at SLO ({slo}), req/s, mean over seeds; ratio to round robin\n")
                print("| policy | capacity (req/s) | x round robin | per seed |")
                print("|---|---|---|---|")
                for s in specs:
                    c = slo_caps[s]
                    ratio = [x / r if r > 0 else math.nan for x, r in zip(c, rr_c)]
                    print(f"| {s} | {sum(c) / len(c):.3g} | {sum(ratio) / len(ratio):.2f} | "
                          f"{', '.join(f'{x:.3g}' for x in c)} |")
                    results.append({"workload": wl, "instances": m, "profile": prof_name, "policy": s,
                                    "seeds": seeds, "capacity_at_slo_rps": c, "slo": slo})
            sys.stdout.flush()
    Path(a.out).write_text(json.dumps(results, indent=1))
    print(f"\nwrote {a.out} ({time.time() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
