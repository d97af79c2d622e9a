"""Experiment: does the order of the router queue buy latency or makespan? (issue #3)

Holding policies (``late_binding``) keep requests in the router queue; the simulator
offers the queue head first (FIFO, as the paper's router does). This script re-sorts the
queue before each decision by the predicted output length and compares, on the held-out
samples of the RL evaluation (``routerd.rl.splits``, part ``eval``):

- ``fifo``: arrival order (what ships);
- ``sjf``: shortest predicted output first (ties by arrival);
- ``long_then_sjf``: predicted outputs >= 1000 tokens first, longest first (to start
  the makespan's critical path early), then the rest shortest first;
- ``ljf``: longest predicted output first.

Round robin never holds, so its queue order cannot matter; it is the baseline. The
re-sorting hooks the simulator's private ``_decide`` and is an experiment, not a
feature: ``docs/rl.md`` has the figures.

Usage: python benchmarks/queue_order.py [--workload public-mix] [--instances 4] [--rate 20]
       [--seeds 5] [--requests 1000] [--profile llama2-7b-v100] [--prediction true]
"""

from __future__ import annotations

import argparse
import statistics
from collections import deque

from makespan_bound import add_sample_arguments, check_sample_arguments
from routerd.policies.base import PolicyContext
from routerd.policies.registry import PolicyError, build_policy_from_spec
from routerd.rl import splits
from routerd.sim import ClusterSimulator, prepare_requests
from routerd.sim.prepare import PredictionError
from routerd.sim.report import summarize

ORDERS = {
    "fifo": None,
    "sjf": lambda r: (r.pred_tokens, r.arrival_s, r.id),
    "long_then_sjf": lambda r: ((0, -r.pred_tokens) if r.pred_tokens >= 1000 else (1, r.pred_tokens), r.arrival_s, r.id),
    "ljf": lambda r: (-r.pred_tokens, r.arrival_s, r.id),
}


class OrderedQueueSimulator(ClusterSimulator):
    """The cluster simulator with its router queue re-sorted by ``key`` before each decision."""

    key = None

    def _decide(self, now):
        if self.key is not None and len(self.queue) > 1:
            self.queue = deque(sorted(self.queue, key=self.key))
        return (yield from super()._decide(now))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sample_arguments(ap)
    ap.add_argument("--prediction", default="true", help="prediction mode (phasewise bench --prediction)")
    ap.add_argument("--policy", default="late_binding", help="the holding policy whose queue is re-sorted")
    a = ap.parse_args()
    prof = check_sample_arguments(ap, a)
    try:
        build_policy_from_spec(a.policy, PolicyContext(prof, a.instances, seed=0))
        prepare_requests(splits.sample(a.workload, "eval", 0, 1, a.rate), prof, prediction=a.prediction, seed=0)
    except (PolicyError, PredictionError, ValueError) as e:
        ap.exit(2, f"{ap.prog}: error: {e}\n")
    m = a.instances
    rows = [("round_robin", "fifo")] + [(a.policy, o) for o in ORDERS]
    out: dict[tuple[str, str], list] = {k: [] for k in rows}
    for i in range(a.seeds):
        reqs = splits.sample(a.workload, "eval", i, a.requests, a.rate)
        for spec, order in rows:
            sim = OrderedQueueSimulator(prof, m, build_policy_from_spec(spec, PolicyContext(prof, m, seed=i)))
            sim.key = ORDERS[order]
            s = summarize(sim.run(prepare_requests(reqs, prof, prediction=a.prediction, seed=i).requests))
            out[(spec, order)].append(s)
    base = out[rows[0]]
    print(f"{a.workload}, {m} x {prof.name}, {a.requests} requests at {a.rate:g} req/s, "
          f"held-out samples 0..{a.seeds - 1}, prediction {a.prediction}; means over samples")
    print(f"{'policy':14s} {'queue order':14s} {'E2E s':>7s} {'p99 s':>7s} {'makespan s':>10s} {'preempt':>8s}"
          f" {'dE2E %':>7s} {'dmakespan %':>11s}")
    for k in rows:
        ss = out[k]
        de = statistics.mean(100 * (s.e2e_mean / b.e2e_mean - 1) for s, b in zip(ss, base))
        dm = statistics.mean(100 * (s.makespan / b.makespan - 1) for s, b in zip(ss, base))
        print(f"{k[0]:14s} {k[1]:14s} {statistics.mean(s.e2e_mean for s in ss):7.2f} "
              f"{statistics.mean(s.e2e_p99 for s in ss):7.1f} {statistics.mean(s.makespan for s in ss):10.1f} "
              f"{statistics.mean(s.preemptions for s in ss):8.0f} {de:+7.1f} {dm:+11.1f}")


if __name__ == "__main__":
    main()
