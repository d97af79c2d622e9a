"""Length-predictor report: Table-1-style accuracy, and what prediction error costs the router.

Part 1 (``routerd.predictor.evaluate``): on the held-out test split (seeded, grouped by
prompt, stratified by task and bucket), accuracy / macro-F1 / confusion overall, per
dataset and per task, for the majority, task-prior, length-only and length+task
baselines and the transformer without hint, with the task model's hint and with the
true hint.

Part 2 (``--bench``): a public-mix-style workload drawn ONLY from held-out (test-split)
prompts — tasks uniformly, rows uniformly within a task, prompts <= 1000 tokens,
Poisson arrivals — simulated with policies that read the predicted bucket, once per
prediction source: ``true`` (perfect buckets), the transformer, the length+task and
task-prior baselines (``given``: predicted once per request by
``assign_predictions``), and ``none``. The table shows each policy's mean E2E latency
and makespan and their change against the same policy with true buckets.

Usage: python benchmarks/predictor_report.py --model DIR [--out predictor-report] [--bench]
       [--n 2000] [--rate 20] [--seeds 2] [--profile llama2-7b-v100] [--instances 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

DEFAULT_POLICIES = ["round_robin", "min_min", "mixing_penalty", "late_binding", "decode_balancer"]


def heldout_workload(rows, test_idx, n: int, rate: float, seed: int, max_prompt_tokens: int = 1000):
    """Requests drawn from test-split rows only (see the module docstring)."""
    from routerd.model import Request
    from routerd.workloads.traces import poisson_arrivals

    by_task: dict[str, list] = {}
    for i in test_idx:
        r = rows[int(i)]
        if r.prompt_tokens <= max_prompt_tokens:
            by_task.setdefault(r.task, []).append(r)
    tasks = sorted(by_task)
    rng = np.random.default_rng(seed)
    gi = rng.integers(0, len(tasks), size=n)
    ri = [int(rng.integers(0, len(by_task[tasks[g]]))) for g in gi]
    arrivals = poisson_arrivals(n, rate, rng)
    return [Request(id=k, arrival_s=float(arrivals[k]), prompt_tokens=by_task[tasks[g]][j].prompt_tokens,
                    output_tokens=by_task[tasks[g]][j].response_tokens, prompt=by_task[tasks[g]][j].prompt,
                    task=tasks[g]) for k, (g, j) in enumerate(zip(gi, ri))]


def bench_part(args, rows, split, edges) -> dict:
    from routerd.bench import pct, run_bench
    from routerd.policies.registry import POLICIES
    from routerd.predictor import assign_predictions, load_predictor
    from routerd.predictor.assign import fit_baseline
    from routerd.profiles import get_profile

    policies = [p for p in args.policies.split(",") if p.split(":")[0] in POLICIES]
    rl = [name for name in POLICIES if "dqn" in name or name.startswith("rl")]
    profile = get_profile(args.profile)
    predictors = {"length+task": fit_baseline("length+task", data_dir=args.data_dir, edges=edges),
                  "task-prior": fit_baseline("task-prior", data_dir=args.data_dir, edges=edges)}
    if args.model:
        predictors = {"transformer": load_predictor(args.model), **predictors}
    sources = ["true"] + list(predictors) + ["none"]
    acc: dict[str, dict[str, dict[str, list[float]]]] = {}
    pred_acc: dict[str, list[float]] = {}
    for seed in range(args.seeds):
        reqs = heldout_workload(rows, split["test"], args.n, args.rate, seed)
        from routerd.model import bucket_of

        truth = [bucket_of(q.output_tokens, edges) for q in reqs]
        for src in sources:
            if src in predictors:
                t = time.perf_counter()
                given = assign_predictions(reqs, predictors[src], edges=edges)
                pred_acc.setdefault(src, []).append(float(np.mean([q.predicted_bucket == b
                                                                   for q, b in zip(given, truth)])))
                print(f"[bench] seed {seed}: {src} predicted {len(reqs)} requests in "
                      f"{time.perf_counter() - t:.1f} s, accuracy {pred_acc[src][-1]:.3f}", file=sys.stderr)
                res = run_bench(given, profile, args.instances, policies, workload_name="heldout-mix",
                                prediction="given", seed=seed)
            else:
                res = run_bench(reqs, profile, args.instances, policies, workload_name="heldout-mix",
                                prediction=src, seed=seed)
            for r in res.results:
                d = acc.setdefault(r.spec, {}).setdefault(src, {"e2e_mean": [], "makespan": []})
                d["e2e_mean"].append(r.summary.e2e_mean)
                d["makespan"].append(r.summary.makespan)
    table = {}
    for pol, by_src in acc.items():
        base = {k: statistics.mean(v) for k, v in by_src["true"].items()}
        table[pol] = {src: {"e2e_mean": statistics.mean(v["e2e_mean"]), "makespan": statistics.mean(v["makespan"]),
                            "e2e_vs_true_pct": pct(statistics.mean(v["e2e_mean"]), base["e2e_mean"]),
                            "makespan_vs_true_pct": pct(statistics.mean(v["makespan"]), base["makespan"])}
                      for src, v in by_src.items()}
    return {"profile": args.profile, "instances": args.instances, "n": args.n, "rate": args.rate,
            "seeds": args.seeds, "policies": policies, "rl_policies_registered": rl,
            "prediction_accuracy": {k: statistics.mean(v) for k, v in pred_acc.items()}, "table": table}


def format_bench(b: dict) -> str:
    srcs = list(next(iter(b["table"].values())))
    lines = [f"Held-out mix: {b['n']} requests at {b['rate']} req/s, {b['instances']} x {b['profile']}, "
             f"{b['seeds']} seed(s). Bucket accuracy on these requests: "
             + ", ".join(f"{k} {100 * v:.1f}%" for k, v in b["prediction_accuracy"].items()),
             "", "Mean E2E latency s (change vs true buckets %) / makespan s (change %):", "",
             "| policy | " + " | ".join(srcs) + " |", "|---|" + "---:|" * len(srcs)]
    for pol, row in b["table"].items():
        cells = [f"{row[s]['e2e_mean']:.1f} ({row[s]['e2e_vs_true_pct']:+.1f}) / {row[s]['makespan']:.0f} "
                 f"({row[s]['makespan_vs_true_pct']:+.1f})" for s in srcs]
        lines.append(f"| {pol} | " + " | ".join(cells) + " |")
    if not b["rl_policies_registered"]:
        lines += ["", "No RL policy is registered in this checkout; rerun with --policies including it once it is."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="folder saved by 'phasewise predictor train'")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--split", default="test", choices=("test", "val"))
    ap.add_argument("--out", default="predictor-report")
    ap.add_argument("--bench", action="store_true", help="also run part 2 (prediction error cost in the simulator)")
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    ap.add_argument("--profile", default="llama2-7b-v100")
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--seeds", type=int, default=2)
    args = ap.parse_args()

    from routerd.predictor import data as D
    from routerd.predictor.evaluate import evaluate, format_report

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    report = evaluate(args.model, data_dir=args.data_dir, split=args.split,
                      progress=lambda s: print(f"[eval] {s}", file=sys.stderr, flush=True))
    text = format_report(report)
    print(text)
    print(f"\n(part 1: {time.perf_counter() - t:.0f} s)")
    (out / "table1.json").write_text(json.dumps(report, indent=2))
    (out / "table1.md").write_text(text + "\n")
    if args.bench:
        rows = D.load_rows(args.data_dir)
        edges = tuple(report["edges"])
        split = D.split_rows(rows, seed=report["seed"], edges=edges)
        b = bench_part(args, rows, split, edges)
        btext = format_bench(b)
        print("\n" + btext)
        (out / "bench.json").write_text(json.dumps(b, indent=2))
        (out / "bench.md").write_text(btext + "\n")
    print(f"wrote {out}/")


if __name__ == "__main__":
    main()
