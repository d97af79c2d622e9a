"""``phasewise bench``: run several routing policies on one workload and compare them.

Every policy sees the same requests (same arrivals, lengths and predictions), the same
number of instances and the same hardware profiles (one for every instance, or one per
instance in a mixed pool: :func:`routerd.profiles.parse_pool`); each run is seeded, so a
bench is reproducible. Summaries are computed by :func:`routerd.sim.report.summarize`.

Beyond one run: :func:`seed_workloads` draws one workload per seed (a generator re-drawn,
a trace re-windowed), :class:`SeedsResult` pairs each policy with round robin seed by seed
(:func:`paired_interval`: the geometric-mean change in % with a 95% t-interval on the
per-seed log ratios, transformed back),
:func:`load_to_rate` sets the arrival rate relative to round robin's capacity, and
:func:`capacity_at_slo` finds the highest arrival rate at which a policy meets latency
limits.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from routerd.model import PREDICTOR_BUCKET_EDGES, Request
from routerd.policies.base import PolicyContext, RoutingPolicy
from routerd.policies.registry import build_policy_from_spec, parse_policy_spec
from routerd.profiles import HardwareProfile, ProfileError, as_pool, pool_admission_profile, pool_label
from routerd.sim import ClusterSimulator, prepare_requests
from routerd.sim.report import Summary, arrays, summarize


@dataclass
class PolicyResult:
    """One policy's run: its spec, summary, router decisions and holds."""

    spec: str
    summary: Summary
    decisions: int
    holds: int
    wall_s: float
    forced_dispatches: int = 0
    records: dict[str, np.ndarray] | None = field(default=None, repr=False)
    """Per-request arrays of the run (:func:`routerd.sim.report.arrays`), for the
    per-request CSV and the CDF plots; None where not kept."""


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
    header_extra: str = ""
    """Text appended to the table's header line (a ``--load`` or ``--max-model-len`` note)."""
    seed_label: str | None = None
    """Set on a table of means over seeds: replaces ``seed=S`` in the header."""

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
                row["ttft_p90_change_pct"] = pct(r.summary.ttft_p90, base.summary.ttft_p90)
            rows.append(row)
        return {
            "workload": self.workload, "profile": self.profile, "instances": self.instances,
            "prediction": self.prediction, "seed": self.seed, "requests": self.requests,
            "rejected": self.rejected, "clipped": self.clipped, "results": rows,
        }


def pct(value: float, base: float) -> float:
    """Change of ``value`` against ``base`` in percent (negative = lower = better)."""
    return 100.0 * (value - base) / base if base else 0.0


#: Every instance's profile, or one profile per instance (a mixed pool).
PoolSpec = HardwareProfile | Sequence[HardwareProfile]


def policy_context(profile: PoolSpec, instances: int, *, seed: int = 0,
                   bucket_edges: tuple[int, ...] = PREDICTOR_BUCKET_EDGES) -> PolicyContext:
    """The :class:`PolicyContext` of a pool: ``profile`` is the pool's first profile and
    ``profiles`` one per instance (equal for a homogeneous pool)."""
    pool = as_pool(profile, instances)
    return PolicyContext(pool[0], instances, seed=seed, bucket_edges=bucket_edges, profiles=pool)


def run_policy(
    profile: PoolSpec,
    instances: int,
    policy: RoutingPolicy,
    requests: Sequence[Request],
    *,
    prediction: str = "true",
    seed: int = 0,
    action_interval_s: float = 0.02,
    progress: Callable[[int], None] | None = None,
):
    """Simulate one policy; returns ``(ClusterRun, Prepared)``. ``profile``: every instance's,
    or one per instance (requests are then prepared against
    :func:`routerd.profiles.pool_admission_profile`)."""
    pool = as_pool(profile, instances)
    prep = prepare_requests(requests, pool_admission_profile(pool), prediction=prediction,
                            edges=policy.ctx.bucket_edges, seed=seed)
    sim = ClusterSimulator(pool, instances, policy, action_interval_s=action_interval_s)
    return sim.run(prep.requests, progress=progress), prep


def run_bench(
    requests: Sequence[Request],
    profile: PoolSpec,
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

    ``profile`` is every instance's profile or one per instance (a mixed pool); the result's
    ``profile`` is then :func:`routerd.profiles.pool_label` (``2xA,2xB``).

    Raises:
        routerd.policies.registry.PolicyError: an unknown policy or a bad parameter.
        routerd.sim.PredictionError: a bad prediction mode.
    """
    import time

    ctx_edges = PREDICTOR_BUCKET_EDGES
    pool = as_pool(profile, instances)
    # Build all policies first so a typo fails before any simulation time is spent.
    policies = [
        build_policy_from_spec(spec, policy_context(pool, instances, seed=seed, bucket_edges=ctx_edges))
        for spec in policy_specs
    ]
    out: BenchResult | None = None
    max_len = pool_admission_profile(pool).max_model_len
    fitting = sum(1 for r in requests if r.prompt_tokens < max_len)
    for spec, policy in zip(policy_specs, policies):
        progress = progress_factory(spec, fitting) if progress_factory else None
        t0 = time.perf_counter()
        run, prep = run_policy(pool, instances, policy, requests, prediction=prediction, seed=seed,
                               action_interval_s=action_interval_s, progress=progress)
        wall = time.perf_counter() - t0
        if out is None:
            out = BenchResult(workload_name, pool_label(pool), instances, prediction, seed,
                              len(prep.requests), len(prep.rejected), prep.clipped)
        out.results.append(PolicyResult(spec, summarize(run), run.decisions, run.holds, wall,
                                        run.forced_dispatches, arrays(run)))
    assert out is not None
    return out


# ---------------------------------------------------------------------------------------------
# Profile override


def with_max_model_len(profile: HardwareProfile, max_model_len: int) -> HardwareProfile:
    """``profile`` with ``max_model_len`` (tokens) replaced, re-validated.

    ``model_copy(update=...)`` skips validation, so the copy is validated again: a value the
    KV cache cannot hold (vLLM refuses to start then) or one a non-chunked prefill budget
    cannot take fails as a profile file would.

    Raises:
        ProfileError: the profile's one-line error, naming ``max_model_len``.
    """
    from pydantic import ValidationError

    try:
        return HardwareProfile.model_validate(profile.model_copy(update={"max_model_len": max_model_len}).model_dump())
    except ValidationError as e:
        msg = e.errors()[0]["msg"].removeprefix("Value error, ")
        raise ProfileError(f"profile {profile.name!r}: field max_model_len: --max-model-len {max_model_len}: "
                           f"{msg}") from None


# ---------------------------------------------------------------------------------------------
# Several seeds: one workload per seed, paired intervals against round robin


def seed_workloads(
    name: str,
    seeds: Sequence[int],
    *,
    rate: float | None = None,
    limit: int | None = None,
    n: int | None = None,
    data_dir: str | Path | None = None,
):
    """One :class:`routerd.workloads.registry.Workload` per seed, as the workload allows.

    - Generators (``public-mix``, ``paper-mix``, ``shared-prefix[:SPEC]``) are re-drawn with
      each seed.
    - Traces take no seed (:func:`~routerd.workloads.registry.load_workload`), so the
      ``i``-th seed gets the ``i``-th contiguous window of the trace: windows of ``limit``
      requests (the trace must hold ``len(seeds) * limit``), or, without ``limit``, the
      trace cut into ``len(seeds)`` equal windows. Ids are renumbered from 0; arrival times
      keep the trace's clock (only differences matter); ``rate`` rescales each window.

    With one seed this is exactly ``load_workload(name, rate=, limit=, n=, seed=)``.

    Raises:
        routerd.workloads.WorkloadError: as ``load_workload``, or a trace too short for the
            windows (each window needs at least 2 requests, so at least ``2 * len(seeds)``; with
            ``limit``, at least ``len(seeds) * limit``), or ``limit < 2``.
    """
    from routerd.workloads.errors import WorkloadError
    from routerd.workloads.registry import Workload, load_workload
    from routerd.workloads.traces import rescale_to_rate

    from routerd.workloads import registry

    # Generators take ``n`` and ``seed`` (``shared-prefix:SPEC`` is one of them too).
    generators = getattr(registry, "GENERATOR_NAMES", ("public-mix", "paper-mix"))
    seeds = list(seeds)
    if len(seeds) == 1 or name.partition(":")[0] in generators:
        return [load_workload(name, rate=rate, limit=limit, n=n, seed=s, data_dir=data_dir) for s in seeds]
    k = len(seeds)
    # A window of one request has no queueing and no spread: each seed needs at least 2.
    if limit is not None and limit < 2:
        raise WorkloadError(f"workload {name!r}: --limit {limit} with {k} seeds: each seed's window needs at "
                            "least 2 requests; use --limit >= 2")
    full = load_workload(name, limit=None if limit is None else limit * k, n=n, data_dir=data_dir)
    have = len(full.requests)
    if limit is None and have < 2 * k:
        raise WorkloadError(
            f"workload {name!r}: {have} requests cannot be cut into {k} windows (one per seed): each window "
            f"needs at least 2 requests, so {k} seeds need at least {2 * k} requests; use fewer seeds")
    size = limit if limit is not None else have // k
    if have < size * k:
        raise WorkloadError(
            f"workload {name!r}: {have} requests cannot give {k} windows (one per seed) of {size} requests "
            f"(--limit {limit}): {size * k} needed; use fewer seeds or a smaller --limit")
    out = []
    for i in range(k):
        win = full.requests[i * size:(i + 1) * size]
        if i:
            win = [r.model_copy(update={"id": j}) for j, r in enumerate(win)]
        desc = f"{full.description}; window {i} (requests {i * size}-{(i + 1) * size - 1})"
        if rate is not None:
            win = rescale_to_rate(win, rate)
            desc += f", rescaled to {rate:g} req/s"
        out.append(Workload(full.name, win, desc, full.native_rate))
    return out


def load_to_rate(requests: Sequence[Request], profile: PoolSpec, instances: int, load: float):
    """Rescale ``requests`` to ``load`` times round robin's saturated throughput.

    Capacity is :func:`routerd.sim.capacity.round_robin_capacity` on these requests and
    this pool (the project's definition of load, ``docs/results.md``: 0.8x, 1.5x, 2x);
    ``profile`` is every instance's profile or one per instance (a mixed pool).

    Returns:
        ``(requests, capacity_rps, rate_rps)``.

    Raises:
        ValueError: ``load`` is not a finite number > 0.
    """
    from routerd.sim.capacity import round_robin_capacity
    from routerd.workloads.traces import rescale_to_rate

    if not (isinstance(load, (int, float)) and math.isfinite(load) and load > 0):
        raise ValueError(f"load must be a finite number > 0, got {load!r}")
    cap = round_robin_capacity(requests, profile, instances)
    rate = load * cap
    return rescale_to_rate(list(requests), rate), cap, rate


#: Two-sided 95% quantiles of Student's t, ``t_{0.975, df}`` (any statistics table, e.g.
#: NIST/SEMATECH e-Handbook §1.3.6.7.2); ``math.inf`` is the normal 1.959964.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110,
         18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060,
         26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980,
         math.inf: 1.959964}


def t975(df: int) -> float:
    """``t_{0.975, df}``: exact (3 decimals) for df 1-30, 40, 60, 120; between table rows
    linear in ``1/df`` (the standard interpolation for t tables), error < 0.002.

    Raises:
        ValueError: ``df < 1``.
    """
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df in _T975:
        return _T975[df]
    keys = sorted(_T975)
    hi = next(k for k in keys if k > df)
    lo = max(k for k in keys if k < df)
    w = (1 / lo - 1 / df) / (1 / lo - (0.0 if hi == math.inf else 1 / hi))
    return _T975[lo] + w * (_T975[hi] - _T975[lo])


@dataclass(frozen=True)
class PairedInterval:
    """A paired 95% interval of a policy's change against round robin, in %
    (:func:`paired_interval`: a t-interval on the per-seed log ratios, transformed back, so
    every bound is above -100%)."""

    mean: float
    """The change of the geometric mean ratio, ``100 * (exp(mean(l)) - 1)`` with
    ``l_i = ln(values_i / base_i)`` (%); NaN where a value is not > 0 (see ``diffs``)."""
    low: float | None
    """``100 * (exp(mean(l) - t * s / sqrt(n)) - 1)`` (%), > -100; None with one seed or a
    value not > 0."""
    high: float | None
    """``100 * (exp(mean(l) + t * s / sqrt(n)) - 1)`` (%); None with one seed or a value
    not > 0."""
    n: int
    """Seeds (pairs)."""
    diffs: tuple[float, ...]
    """The per-seed changes ``d_i = 100 * (values_i - base_i) / base_i`` (%)."""

    def as_dict(self) -> dict:
        """JSON-ready dict."""
        return {"mean_pct": self.mean, "low_pct": self.low, "high_pct": self.high, "n": self.n,
                "per_seed_pct": list(self.diffs)}


#: How :func:`paired_interval` builds its interval, for the notes under tables and plots.
INTERVAL_METHOD = ("change of the geometric mean of the per-seed ratios policy/round_robin, with a paired "
                   "95% t-interval on the per-seed log ratios transformed back (always > -100%)")


def paired_interval(values: Sequence[float], base: Sequence[float]) -> PairedInterval:
    """Paired 95% interval of the change of ``values`` against ``base``, seed by seed, in %.

    With the per-seed log ratios ``l_i = ln(values_i / base_i)`` for the ``n`` seeds (policy
    and round robin on the same workload draw, so seed-to-seed workload variation cancels),
    the paired t-interval ``mean(l) ± t_{0.975, n-1} * stdev(l) / sqrt(n)`` (``stdev`` the
    sample standard deviation, divisor ``n - 1``; Montgomery & Runger, Applied Statistics,
    §10-4) is transformed back to a change in %: ``100 * (exp(x) - 1)``. The point estimate
    is then the change of the geometric mean of the ratios, ``100 * (exp(mean(l)) - 1)``,
    and the interval that of the ratio of geometric means (Bland & Altman, "Transformations,
    means, and confidence intervals", BMJ 312:1079, 1996). Unlike a t-interval of the
    percent changes themselves, whose lower end can fall below -100% (e.g.
    ``-63.8 [-133.1, +5.6]``, a latency below zero), both ends stay in the metric's range:
    above -100% for a positive quantity.

    Every value and base must be > 0 (latencies, makespans, rates): the log ratio of a
    zero is undefined. ``diffs`` keeps the plain per-seed changes in %.

    Raises:
        ValueError: the sequences differ in length or are empty, or a value or base is not
            a finite number > 0 (the message names the first such pair).
    """
    if len(values) != len(base) or not values:
        raise ValueError(f"paired interval needs equal, non-empty sequences, got {len(values)} and {len(base)}")
    for i, (v, b) in enumerate(zip(values, base)):
        if not (math.isfinite(v) and math.isfinite(b) and v > 0 and b > 0):
            raise ValueError(f"paired interval on log ratios needs finite values > 0: pair {i} is {v!r} against "
                             f"{b!r}")
    d = tuple(pct(v, b) for v, b in zip(values, base))
    logs = [math.log(v / b) for v, b in zip(values, base)]
    n = len(logs)
    m = statistics.fmean(logs)
    mean = 100.0 * math.expm1(m)
    if n < 2:
        return PairedInterval(mean, None, None, n, d)
    half = t975(n - 1) * statistics.stdev(logs) / math.sqrt(n)
    return PairedInterval(mean, 100.0 * math.expm1(m - half), 100.0 * math.expm1(m + half), n, d)


def paired_interval_or_nan(values: Sequence[float], base: Sequence[float]) -> PairedInterval:
    """:func:`paired_interval`, or where a value or base is not a finite number > 0 (no log
    ratio) the documented fallback: mean NaN, no bounds, ``diffs`` the plain per-seed
    changes in % (:func:`pct`, 0 for a zero base)."""
    try:
        return paired_interval(values, base)
    except ValueError:
        if len(values) != len(base) or not values:
            raise
        return PairedInterval(math.nan, None, None, len(values), tuple(pct(v, b) for v, b in zip(values, base)))


#: Summary fields compared seed by seed against round robin.
INTERVAL_METRICS = ("e2e_mean", "ttft_p90", "makespan")


@dataclass
class SeedsResult:
    """One :class:`BenchResult` per seed, the same policies in the same order."""

    runs: list[BenchResult]

    @property
    def seeds(self) -> list[int]:
        """The seeds, in run order."""
        return [b.seed for b in self.runs]

    def intervals(self) -> dict[str, dict[str, PairedInterval]]:
        """``policy spec -> metric -> PairedInterval`` for every policy and
        :data:`INTERVAL_METRICS` (:func:`paired_interval_or_nan`: a metric that is 0 in some
        seed gets a NaN mean and no bounds); empty when no ``round_robin`` ran."""
        if self.runs[0].baseline() is None:
            return {}
        out: dict[str, dict[str, PairedInterval]] = {}
        for i, r in enumerate(self.runs[0].results):
            out[r.spec] = {
                m: paired_interval_or_nan([getattr(b.results[i].summary, m) for b in self.runs],
                                           [getattr(b.baseline().summary, m) for b in self.runs])
                for m in INTERVAL_METRICS
            }
        return out

    def mean_bench(self) -> BenchResult:
        """The runs averaged: each summary field is its mean over seeds, except the prefix
        hit rate (pooled: summed hits / summed queries); requests, rejected, clipped are sums."""
        if len(self.runs) == 1:
            return self.runs[0]
        first = self.runs[0]
        out = BenchResult(first.workload, first.profile, first.instances, first.prediction, first.seed,
                          sum(b.requests for b in self.runs), sum(b.rejected for b in self.runs),
                          sum(b.clipped for b in self.runs), header_extra=first.header_extra,
                          seed_label=",".join(str(s) for s in self.seeds) + " (means over seeds)")
        for i, r in enumerate(first.results):
            sums = [b.results[i].summary for b in self.runs]
            vals = {f.name: statistics.fmean(getattr(s, f.name) for s in sums)
                    for f in fields(Summary) if f.name != "prefix_hit_rate"}
            q = sum(s.prefix_queries for s in sums)
            vals["prefix_hit_rate"] = sum(s.prefix_hits for s in sums) / q if q > 0 else None
            runs = [b.results[i] for b in self.runs]
            out.results.append(PolicyResult(
                r.spec, Summary(**vals), round(statistics.fmean(x.decisions for x in runs)),
                round(statistics.fmean(x.holds for x in runs)), statistics.fmean(x.wall_s for x in runs),
                round(statistics.fmean(x.forced_dispatches for x in runs))))
        return out

    def as_dict(self) -> dict:
        """JSON-ready dict: one seed gives :meth:`BenchResult.as_dict` unchanged; several give
        the means (as that dict), ``seeds``, ``intervals`` (policy -> metric -> interval) and
        ``per_seed`` (one :meth:`BenchResult.as_dict` per seed)."""
        if len(self.runs) == 1:
            return self.runs[0].as_dict()
        d = self.mean_bench().as_dict()
        d["seed"] = self.seeds[0]
        d["seeds"] = self.seeds
        d["intervals"] = {spec: {m: iv.as_dict() for m, iv in per.items()}
                          for spec, per in self.intervals().items()}
        d["per_seed"] = [b.as_dict() for b in self.runs]
        return d


#: Columns of the per-request CSV, in order (times in s, lengths in tokens).
REQUEST_COLUMNS = ("policy", "seed", "request_id", "arrival_s", "instance", "prompt_tokens", "output_tokens",
                   "cached_tokens", "ttft_s", "e2e_s", "tpot_s", "preemptions")


def request_rows(benches: Sequence[BenchResult]):
    """One tuple per simulated request per policy per seed, in :data:`REQUEST_COLUMNS` order.

    ``ttft_s = first token - arrival``, ``e2e_s = finish - arrival``, ``tpot_s = (finish -
    first token) / (output - 1)`` (None for one output token), as
    :mod:`routerd.sim.report` defines them; ``cached_tokens`` is -1 where not tracked.
    Policies run without records (``records=None``) give no rows.
    """
    for b in benches:
        for r in b.results:
            a = r.records
            if a is None:
                continue
            for k in range(len(a["id"])):
                arr, ft, fin, out = float(a["arrival"][k]), float(a["first_token"][k]), float(a["finish"][k]), \
                    int(a["output"][k])
                yield (r.spec, b.seed, int(a["id"][k]), arr, int(a["instance"][k]), int(a["prompt"][k]), out,
                       int(a["cached"][k]), ft - arr, fin - arr, (fin - ft) / (out - 1) if out > 1 else None,
                       int(a["preemptions"][k]))


# ---------------------------------------------------------------------------------------------
# Capacity at SLO

#: Summary fields an SLO may limit (seconds).
SLO_METRICS = tuple(f"{m}_{p}" for m in ("ttft", "tpot", "e2e") for p in ("mean", "p50", "p90", "p99"))


def parse_slo(text: str) -> dict[str, float]:
    """``"ttft_p90=2,tpot_p90=0.05"`` -> ``{"ttft_p90": 2.0, "tpot_p90": 0.05}`` (seconds).

    Raises:
        ValueError: an empty text, a key not in :data:`SLO_METRICS`, a repeated key, or a
            value that is not a finite number > 0 (the message names the item).
    """
    out: dict[str, float] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        key, eq, val = item.partition("=")
        key = key.strip()
        if not eq or key not in SLO_METRICS:
            raise ValueError(f"SLO item {item!r}: expected METRIC=SECONDS with METRIC one of {', '.join(SLO_METRICS)}")
        if key in out:
            raise ValueError(f"SLO item {item!r}: {key} given twice")
        try:
            v = float(val)
        except ValueError:
            v = math.nan
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"SLO item {item!r}: the limit must be a finite number of seconds > 0")
        out[key] = v
    if not out:
        raise ValueError("the SLO is empty; e.g. ttft_p90=2,tpot_p90=0.05")
    return out


def meets_slo(summary: Summary, limits: dict[str, float]) -> bool:
    """Whether every limited summary field is at or below its limit (seconds)."""
    return all(getattr(summary, k) <= v for k, v in limits.items())


@dataclass
class SloCapacity:
    """One policy's capacity at SLO (:func:`capacity_at_slo`)."""

    spec: str
    rate_rps: float
    """Highest probed arrival rate that met the SLO (req/s); 0.0 if none did. Never above
    ``bound_rps``."""
    fail_rate_rps: float | None
    """Lowest probed rate above ``rate_rps`` that failed it (req/s), within ``(1 + tol)``
    of ``rate_rps`` once bisection ended; None if none failed up to the probe limit."""
    summary: Summary | None
    """The run at ``rate_rps`` (None if no rate met the SLO)."""
    probes: list[tuple[float, bool]]
    """Every ``(rate_rps, met)`` evaluated, in order (the isolated run not included)."""
    bound_rps: float | None = None
    """The highest rate the sample can measure (req/s, :func:`steady_rate_bound`): above it
    the arrivals span fewer than :data:`STEADY_LIFETIMES` request lifetimes and a burst can
    drain within the limits. The search's upper bound; None where not computed."""
    at_bound: bool = False
    """True when the SLO still held at ``bound_rps``: ``rate_rps`` is then that bound, a lower
    bound of the SLO limit the sample is too short to find (more requests are needed)."""
    infeasible: bool = False
    """True when the SLO failed even in the isolated run (every request alone on an idle
    cluster, :func:`isolated_requests`): no arrival rate can meet it, so ``rate_rps`` is 0,
    no rate was probed (``probes`` empty, ``bound_rps`` and ``fail_rate_rps`` None) and
    ``isolated`` holds the figures reached."""
    isolated: Summary | None = None
    """The isolated run (:func:`isolated_requests`), the best any rate can do on these
    requests under this policy; None where not run."""

    def violations(self, limits: dict[str, float]) -> dict[str, float]:
        """The limited summary fields the isolated run exceeded: field -> value reached (s);
        empty when not ``infeasible``."""
        if not self.infeasible or self.isolated is None:
            return {}
        return {k: getattr(self.isolated, k) for k, v in limits.items() if getattr(self.isolated, k) > v}

    def as_dict(self) -> dict:
        """JSON-ready dict."""
        return {"policy": self.spec, "rate_rps": self.rate_rps, "fail_rate_rps": self.fail_rate_rps,
                "bound_rps": self.bound_rps, "at_bound": self.at_bound,
                "infeasible": self.infeasible,
                "evaluations": len(self.probes), "probes": [list(p) for p in self.probes],
                "summary": self.summary.as_dict() if self.summary else None,
                "isolated_summary": self.isolated.as_dict() if self.isolated else None}


def isolated_gap(requests: Sequence[Request], profile: PoolSpec) -> float:
    """The default gap of :func:`isolated_requests` (s): twice the longest lone E2E
    (:meth:`routerd.profiles.HardwareProfile.lone_request_time`) over ``requests`` and the
    pool's distinct profiles."""
    profs = [profile] if isinstance(profile, HardwareProfile) else list({id(p): p for p in profile}.values())
    return 2 * max(p.lone_request_time(r.prompt_tokens, max(r.output_tokens, 1)) for r in requests for p in profs)


def isolated_requests(requests: Sequence[Request], profile: PoolSpec,
                      gap_s: float | None = None) -> list[Request]:
    """``requests`` re-timed so that none overlaps another: in arrival order, request ``i``
    arrives at ``i * gap_s`` (ids, token counts and prefixes unchanged).

    ``gap_s`` defaults to twice the longest lone E2E (:func:`isolated_gap`:
    :meth:`routerd.profiles.HardwareProfile.lone_request_time`, which ignores chunked
    prefill, hence the margin; the slowest of a pool's profiles); :func:`capacity_at_slo`
    checks the run and widens the gap if
    some request still took longer than it. Returns a new list sorted by ``arrival_s``.

    Raises:
        ValueError: no requests, or ``gap_s`` not a finite number > 0.
    """
    if not requests:
        raise ValueError("no requests to space out")
    if gap_s is None:
        gap_s = isolated_gap(requests, profile)
    if not (math.isfinite(gap_s) and gap_s > 0):
        raise ValueError(f"gap_s must be a finite number of seconds > 0, got {gap_s!r}")
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    return [r.model_copy(update={"arrival_s": i * gap_s}) for i, r in enumerate(ordered)]


STEADY_LIFETIMES = 4.0
"""A capacity probe needs the sample's arrivals to span at least this many request lifetimes
(the isolated run's p90 E2E), or the run is mostly its fill and drain transients."""


def steady_rate_bound(requests: int, isolated: Summary) -> float:
    """The highest arrival rate (req/s) at which ``requests`` requests still span
    :data:`STEADY_LIFETIMES` lifetimes: ``requests / (STEADY_LIFETIMES * isolated.e2e_p90)``.

    Why not the policy's own saturated throughput (all requests offered at once): that run
    is a different regime, not an upper bound of capacity. A prefix-aware policy dispatching
    a whole flood at once sees no cached prefix anywhere yet, scatters every group and caches
    poorly, so its flood throughput can be far below the rate it sustains at the SLO (measured
    on shared-prefix:llmd-capacity, 4 x llama3.1-8b-h100, 1,300 requests: the SLO held at 6.5
    req/s for every cache-aware policy, above several of their flood throughputs).
    """
    return requests / (STEADY_LIFETIMES * isolated.e2e_p90) if isolated.e2e_p90 > 0 else math.inf


class SloSearch:
    """The inputs of :func:`capacity_at_slo` on one workload draw, and what every policy
    searched on it shares, computed once: round robin's saturated throughput (the start
    rate), the isolated schedule (:func:`isolated_gap`) and the prepared simulator requests
    (:meth:`routerd.sim.prepare.Prepared.fresh` gives each probe its own copy at its rate;
    re-preparing took ~0.06-0.09 s of a 0.2-0.7 s probe on 1,000 Mooncake requests).

    What it does not share is the isolated run itself: its outcome depends on the policy
    (which instance's prefix cache a request finds, and in a mixed pool which profile serves
    it; on 1,000 Mooncake requests, 4 x llama3.1-8b-h100, its p90 TTFT is 2.89 s under
    round robin and 2.70 s under llmd), and it decides feasibility and the steady-rate bound.
    :meth:`run` is deterministic, so a search run in another process returns the same result.
    Arguments as :func:`capacity_at_slo`.

    Raises:
        ValueError: ``tol`` not in (0, 1], an empty ``limits`` or an unknown field in it.
    """

    def __init__(self, requests: Sequence[Request], profile: PoolSpec, instances: int, limits: dict[str, float],
                 *, seed: int = 0, prediction: str = "true", tol: float = 0.02, start_rate: float | None = None,
                 action_interval_s: float = 0.02, max_steps: int = 16) -> None:
        if not (0 < tol <= 1):
            raise ValueError(f"tol must be in (0, 1], got {tol!r}")
        if not limits or any(k not in SLO_METRICS for k in limits):
            raise ValueError(f"limits must name some of {', '.join(SLO_METRICS)}, got {sorted(limits)}")
        self.requests = list(requests)
        self.profile = profile
        self.instances = instances
        self.limits = dict(limits)
        self.seed = seed
        self.prediction = prediction
        self.tol = tol
        self.action_interval_s = action_interval_s
        self.max_steps = max_steps
        self._start_rate = start_rate
        self.pool = as_pool(profile, instances)
        self.gap_s = isolated_gap(self.requests, profile) if self.requests else math.inf
        # isolated_requests keeps arrival order: with sorted input (as the simulator needs) the
        # isolated run is the same requests re-timed, so the prepared copies serve it too.
        self._sorted = all(a.arrival_s <= b.arrival_s for a, b in zip(self.requests, self.requests[1:]))
        self._prepared: dict[tuple[int, ...], object] = {}

    @property
    def start_rate(self) -> float:
        """The first rate probed (req/s): as given, else round robin's saturated throughput
        (:func:`routerd.sim.capacity.round_robin_capacity`), computed once."""
        if self._start_rate is None:
            from routerd.sim.capacity import round_robin_capacity

            self._start_rate = round_robin_capacity(self.requests, self.profile, self.instances)
        return self._start_rate

    def _template(self, edges: tuple[int, ...]):
        prep = self._prepared.get(edges)
        if prep is None:
            prep = self._prepared[edges] = prepare_requests(
                self.requests, pool_admission_profile(self.pool), prediction=self.prediction, edges=edges,
                seed=self.seed)
        return prep

    def _simulate(self, spec: str, arrivals: Sequence[float] | None, reqs: list[Request] | None = None):
        """One fresh, seeded run of ``spec``: the requests at ``arrivals`` (one per input
        request) from the prepared copies, or ``reqs`` prepared anew."""
        policy = build_policy_from_spec(spec, policy_context(self.profile, self.instances, seed=self.seed))
        if reqs is not None:
            run, _ = run_policy(self.profile, self.instances, policy, reqs, prediction=self.prediction,
                                seed=self.seed, action_interval_s=self.action_interval_s)
            return run
        prep = self._template(policy.ctx.bucket_edges).fresh(arrivals)
        sim = ClusterSimulator(self.pool, self.instances, policy, action_interval_s=self.action_interval_s)
        return sim.run(prep.requests)

    def _isolated(self, spec: str, gap: float):
        if self._sorted:
            return self._simulate(spec, [i * gap for i in range(len(self.requests))])
        return self._simulate(spec, None, isolated_requests(self.requests, self.profile, gap))

    def run(self, spec: str) -> SloCapacity:
        """The search for policy ``spec`` (:func:`capacity_at_slo`).

        Raises:
            routerd.policies.registry.PolicyError: a bad policy spec.
        """
        from routerd.workloads.traces import rescale_to_rate

        limits, tol, max_steps = self.limits, self.tol, self.max_steps
        build_policy_from_spec(spec, policy_context(self.profile, self.instances, seed=self.seed))  # fails first
        if not self.requests:
            raise ValueError("no requests to space out")
        probes: list[tuple[float, bool]] = []
        at: dict[float, Summary] = {}

        def ok(rate: float) -> bool:
            arrivals = [r.arrival_s for r in rescale_to_rate(self.requests, rate)]
            s = summarize(self._simulate(spec, arrivals))
            met = meets_slo(s, limits)
            probes.append((rate, met))
            if met:
                at[rate] = s
            return met

        gap = self.gap_s if len(self.requests) > 1 else math.inf
        while True:
            iso_run = self._isolated(spec, gap if math.isfinite(gap) else self.gap_s)
            longest = max((r.finish_s - r.arrival_s for r in iso_run.requests), default=0.0)
            if longest <= gap:  # every request finished before the next arrived: none overlapped
                break
            gap = 2 * longest  # E2E only grows with overlap, so at twice the longest seen none overlaps
        iso = summarize(iso_run)
        if not meets_slo(iso, limits):
            return SloCapacity(spec, 0.0, None, None, probes, None, False, True, iso)

        sat = steady_rate_bound(iso.requests, iso)
        r = min(self.start_rate, sat)
        lo: float | None = None
        hi: float | None = None
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
                return SloCapacity(spec, lo, None, at[lo], probes, sat, True, isolated=iso)  # at the bound
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


def capacity_at_slo(
    requests: Sequence[Request],
    profile: PoolSpec,
    instances: int,
    spec: str,
    limits: dict[str, float],
    *,
    seed: int = 0,
    prediction: str = "true",
    tol: float = 0.02,
    start_rate: float | None = None,
    action_interval_s: float = 0.02,
    max_steps: int = 16,
) -> SloCapacity:
    """The highest arrival rate (req/s) at which policy ``spec`` meets ``limits``.

    First the requests are run isolated (:func:`isolated_requests`: each alone on an idle
    cluster, the gap widened until every request finished before the next arrived): no
    arrival rate can do better, so if the SLO fails there the search stops at once with
    ``rate_rps`` 0 and ``infeasible=True`` (e.g. prompts whose own prefill exceeds a TTFT
    limit; halving the rate would never help).

    Otherwise the rate scales the workload's arrival times (:func:`routerd.workloads.traces.rescale_to_rate`,
    the shape of the arrival process kept), as loads relative to capacity are set
    (``docs/results.md``). A fixed number of requests squeezed into a burst can still drain
    within the limits, so no rate above :func:`steady_rate_bound` (the arrivals must span
    :data:`STEADY_LIFETIMES` lifetimes) is probed. From ``start_rate`` (default: round robin's saturated throughput,
    :func:`routerd.sim.capacity.round_robin_capacity`; capped at the bound) the rate is
    doubled (up to the bound) until the SLO fails, or halved until it holds (at most
    ``max_steps`` times each), then bisected geometrically until ``fail / ok <= 1 + tol``.
    If the SLO still holds at the bound, the result is the bound with ``at_bound=True``:
    the sample is too short to find the limit. Each probe is a fresh, seeded simulation
    (new policy, same ``seed``), so the result is reproducible. Bisection assumes that
    meeting the SLO is monotone in the rate; ``probes`` records every evaluation so a
    non-monotone case can be seen. Requests the profile rejects (prompt >= ``max_model_len``)
    are not counted, as in :func:`run_bench`. Several policies: :func:`capacities_at_slo`
    (the same results, in parallel processes, shared work done once).

    Args:
        limits: summary field -> limit in s (:func:`parse_slo`).
        tol: relative tolerance of the answer (0.02 = within 2%).

    Raises:
        ValueError: ``tol`` not in (0, 1], an empty ``limits`` or an unknown field in it.
        routerd.policies.registry.PolicyError: a bad policy spec.
    """
    return SloSearch(requests, profile, instances, limits, seed=seed, prediction=prediction, tol=tol,
                     start_rate=start_rate, action_interval_s=action_interval_s, max_steps=max_steps).run(spec)


#: The searches of the worker processes of :func:`capacities_at_slo` (set by its initializer).
_WORKER_SEARCHES: list[SloSearch] = []


def _init_slo_worker(searches: list[SloSearch]) -> None:
    global _WORKER_SEARCHES
    _WORKER_SEARCHES = searches


def _run_slo_task(task: tuple[int, str]) -> SloCapacity:
    i, spec = task
    return _WORKER_SEARCHES[i].run(spec)


def default_jobs() -> int:
    """Worker processes by default: ``os.cpu_count()`` (1 where unknown)."""
    import os

    return os.cpu_count() or 1


def capacities_at_slo(searches: Sequence[SloSearch], specs: Sequence[str], *,
                      jobs: int | None = None) -> list[dict[str, SloCapacity]]:
    """:meth:`SloSearch.run` for every policy in ``specs`` on every search (one per seed):
    per search, ``spec -> SloCapacity`` in ``specs`` order.

    The ``len(searches) * len(specs)`` searches are independent, so they run in ``jobs``
    worker processes (default :func:`default_jobs`; 1, or a single search, runs them here,
    in order). Every search is a deterministic function of its inputs (seeded policies,
    seeded preparation, a fresh simulation per probe, xxHash64 prefix keys), so the results
    are identical to a serial run whatever ``jobs`` is. Each search's start rate (round
    robin's saturated throughput) is computed once, here, before the workers start, and
    shared by every policy; each worker prepares each draw's requests once.

    Raises:
        ValueError: ``jobs < 1``.
        routerd.policies.registry.PolicyError: a bad spec (checked before any simulation).
    """
    jobs = default_jobs() if jobs is None else jobs
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    for search in searches:
        for spec in specs:  # a bad spec fails before any simulation
            build_policy_from_spec(spec, policy_context(search.profile, search.instances, seed=search.seed))
    for search in searches:
        search.start_rate  # noqa: B018 - computed once, before the workers copy the searches
    tasks = [(i, spec) for i in range(len(searches)) for spec in specs]
    workers = min(jobs, len(tasks))
    if workers <= 1:
        results = [searches[i].run(spec) for i, spec in tasks]
    else:
        import multiprocessing
        import threading
        from concurrent.futures import ProcessPoolExecutor

        # fork: the workers start with the workload and modules already loaded (no pickling of
        # the searches); where fork is unsafe or missing, the platform's default (they are pickled).
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("fork" if "fork" in methods and threading.active_count() == 1 else None)
        with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_slo_worker,
                                 initargs=(list(searches),)) as pool:
            results = list(pool.map(_run_slo_task, tasks))
    out: list[dict[str, SloCapacity]] = [{} for _ in searches]
    for (i, spec), cap in zip(tasks, results):
        out[i][spec] = cap
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
