"""``phasewise bench``: run several routing policies on one workload and compare them.

Every policy sees the same requests (same arrivals, lengths and predictions), the same
number of instances and the same hardware profile; each run is seeded, so a bench is
reproducible. Summaries are computed by :func:`routerd.sim.report.summarize`.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

from routerd.model import PREDICTOR_BUCKET_EDGES, Request
from routerd.policies.base import PolicyContext, RoutingPolicy
from routerd.policies.registry import build_policy_from_spec, parse_policy_spec
from routerd.profiles import HardwareProfile
from routerd.sim import ClusterSimulator, prepare_requests
from routerd.sim.report import Summary, summarize


@dataclass
class PolicyResult:
    """One policy's run: its spec, summary, router decisions and holds."""

    spec: str
    summary: Summary
    decisions: int
    holds: int
    wall_s: float
    forced_dispatches: int = 0


@dataclass
class BenchResult:
    """All runs of one bench plus what they ran on."""

    workload: str
    profile: str
    instances: int
    prediction: str
    seed: int
    requests: int
    rejected: int
    clipped: int
    results: list[PolicyResult] = field(default_factory=list)

    def baseline(self) -> PolicyResult | None:
        """The ``round_robin`` result, the reference of every change in %."""
        for r in self.results:
            if parse_policy_spec(r.spec)[0] == "round_robin":
                return r
        return None

    def as_dict(self) -> dict:
        """JSON-ready dict (config, per-policy summaries, change vs round_robin in %)."""
        base = self.baseline()
        rows = []
        for r in self.results:
            row = {"policy": r.spec, "decisions": r.decisions, "holds": r.holds,
                   "forced_dispatches": r.forced_dispatches, "wall_s": r.wall_s,
                   **r.summary.as_dict()}
            if base is not None:
                row["e2e_mean_change_pct"] = pct(r.summary.e2e_mean, base.summary.e2e_mean)
                row["makespan_change_pct"] = pct(r.summary.makespan, base.summary.makespan)
            rows.append(row)
        return {
            "workload": self.workload, "profile": self.profile, "instances": self.instances,
            "prediction": self.prediction, "seed": self.seed, "requests": self.requests,
            "rejected": self.rejected, "clipped": self.clipped, "results": rows,
        }


def pct(value: float, base: float) -> float:
    """Change of ``value`` against ``base`` in percent (negative = lower = better)."""
    return 100.0 * (value - base) / base if base else 0.0


def run_policy(
    profile: HardwareProfile,
    instances: int,
    policy: RoutingPolicy,
    requests: Sequence[Request],
    *,
    prediction: str = "true",
    seed: int = 0,
    action_interval_s: float = 0.02,
    progress: Callable[[int], None] | None = None,
):
    """Simulate one policy; returns ``(ClusterRun, Prepared)``."""
    prep = prepare_requests(requests, profile, prediction=prediction, edges=policy.ctx.bucket_edges, seed=seed)
    sim = ClusterSimulator(profile, instances, policy, action_interval_s=action_interval_s)
    return sim.run(prep.requests, progress=progress), prep


def run_bench(
    requests: Sequence[Request],
    profile: HardwareProfile,
    instances: int,
    policy_specs: Sequence[str],
    *,
    workload_name: str = "",
    prediction: str = "true",
    seed: int = 0,
    action_interval_s: float = 0.02,
    progress_factory: Callable[[str, int], Callable[[int], None] | None] | None = None,
) -> BenchResult:
    """Run every policy in ``policy_specs`` (``name[:key=value,...]``) on ``requests``.

    Raises:
        routerd.policies.registry.PolicyError: an unknown policy or a bad parameter.
        routerd.sim.PredictionError: a bad prediction mode.
    """
    import time

    ctx_edges = PREDICTOR_BUCKET_EDGES
    # Build all policies first so a typo fails before any simulation time is spent.
    policies = [
        build_policy_from_spec(spec, PolicyContext(profile, instances, seed=seed, bucket_edges=ctx_edges))
        for spec in policy_specs
    ]
    out: BenchResult | None = None
    fitting = sum(1 for r in requests if r.prompt_tokens < profile.max_model_len)
    for spec, policy in zip(policy_specs, policies):
        progress = progress_factory(spec, fitting) if progress_factory else None
        t0 = time.perf_counter()
        run, prep = run_policy(profile, instances, policy, requests, prediction=prediction, seed=seed,
                               action_interval_s=action_interval_s, progress=progress)
        wall = time.perf_counter() - t0
        if out is None:
            out = BenchResult(workload_name, profile.name, instances, prediction, seed,
                              len(prep.requests), len(prep.rejected), prep.clipped)
        out.results.append(PolicyResult(spec, summarize(run), run.decisions, run.holds, wall,
                                        run.forced_dispatches))
    assert out is not None
    return out


# ---------------------------------------------------------------------------------------------
# The paper's 8-request study (arXiv 2408.13510 §4.3, Fig. 2)


class _FixedAssignment(RoutingPolicy):
    """Sends request ``i`` to instance ``assignment[i]`` (for exhaustive enumeration)."""

    name = "fixed_assignment"

    def __init__(self, ctx: PolicyContext, assignment: Sequence[int]) -> None:
        super().__init__(ctx)
        self.assignment = assignment

    def pick(self, request, view):
        return self.assignment[request.id]


@dataclass
class StudyResult:
    """Sum of E2E latencies (s) of the 8 requests under each assignment and each policy."""

    requests: list[Request]
    optimum: float
    random_mean: float
    worst: float
    best_assignment: tuple[int, ...]
    worst_assignment: tuple[int, ...]
    preemptions_best: int
    preemptions_worst: int
    policies: dict[str, float]

    def as_dict(self) -> dict:
        """JSON-ready dict."""
        return {
            "requests": [r.model_dump(include={"id", "arrival_s", "prompt_tokens", "output_tokens"})
                         for r in self.requests],
            "optimum_sum_e2e_s": self.optimum, "random_mean_sum_e2e_s": self.random_mean,
            "worst_sum_e2e_s": self.worst, "best_assignment": list(self.best_assignment),
            "worst_assignment": list(self.worst_assignment),
            "random_vs_optimum_pct": pct(self.random_mean, self.optimum),
            "worst_vs_optimum_pct": pct(self.worst, self.optimum),
            "policies_sum_e2e_s": self.policies,
            "paper": {"optimum": 27.03, "random_mean": 29.81, "worst": 32.34},
        }


def eight_request_requests(seed: int = 0, n: int = 8, lo: int = 10, hi: int = 100) -> list[Request]:
    """The study's workload: ``n`` requests at 1 req/s, prompt and output uniform in [lo, hi] tokens."""
    rng = random.Random(seed)
    return [Request(id=i, arrival_s=float(i), prompt_tokens=rng.randint(lo, hi), output_tokens=rng.randint(lo, hi))
            for i in range(n)]


def eight_request_study(
    profile: HardwareProfile,
    policy_specs: Sequence[str],
    *,
    seed: int = 0,
    prediction: str = "true",
) -> StudyResult:
    """Enumerate all 2^8 assignments of the study's 8 requests to 2 instances.

    The metric is the *sum* of the 8 E2E latencies, the reading of Fig. 2 under which
    its 27-32 s values make sense (paper-notes.md §5.5). "Random" is the mean over all
    256 assignments, i.e. the expectation of uniform random routing.
    """
    reqs = eight_request_requests(seed)
    n = len(reqs)
    totals: list[tuple[float, tuple[int, ...], int]] = []
    ctx = PolicyContext(profile, 2, seed=seed)
    for assignment in itertools.product((0, 1), repeat=n):
        run, _ = run_policy(profile, 2, _FixedAssignment(ctx, assignment), reqs, prediction=prediction, seed=seed)
        s = sum(r.finish_s - r.arrival_s for r in run.requests)
        totals.append((s, assignment, sum(i.preemptions for i in run.instances)))
    best = min(totals)
    worst = max(totals)
    mean = sum(t[0] for t in totals) / len(totals)
    pol: dict[str, float] = {}
    for spec in policy_specs:
        policy = build_policy_from_spec(spec, ctx)
        run, _ = run_policy(profile, 2, policy, reqs, prediction=prediction, seed=seed)
        pol[spec] = sum(r.finish_s - r.arrival_s for r in run.requests)
    return StudyResult(reqs, best[0], mean, worst[0], best[1], worst[1], best[2], worst[2], pol)
