"""Per-request latency records and their summaries (TTFT, TPOT, E2E, makespan).

Definitions (vLLM's, ``vllm-and-simulators.md`` §1.1): E2E latency = finish - arrival
at the router; TTFT = first token - arrival; TPOT = (finish - first token) /
(output tokens - 1), for requests with more than one output token; router wait =
dispatch - arrival; makespan = last finish - first arrival. All in seconds.

Prefix caching (vLLM V1's automatic prefix caching): each instance counts, in tokens, the
prompt tokens looked up in its cache and those found (vLLM's ``vllm:prefix_cache_queries``
and ``vllm:prefix_cache_hits`` counters); the hit rate is hits / queries, undefined (None)
when nothing was looked up. A request's ``cached_tokens`` are the prompt tokens its first
admission took from the cache (-1 where the simulator does not track it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from routerd.sim.cluster import ClusterRun


@dataclass(frozen=True)
class Summary:
    """Aggregate figures of one run (seconds unless noted)."""

    requests: int
    e2e_mean: float
    e2e_p50: float
    e2e_p90: float
    e2e_p99: float
    ttft_mean: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    tpot_mean: float
    tpot_p50: float
    tpot_p90: float
    tpot_p99: float
    makespan: float
    preemptions: int
    """Preemptions summed over instances (count)."""
    router_wait_mean: float
    throughput_rps: float
    """Finished requests per second of makespan."""
    output_tokens_per_s: float
    """Output tokens per second of makespan (all instances)."""
    prefix_hits: int = 0
    """Prompt tokens served from the prefix cache, summed over instances (tokens;
    ``vllm:prefix_cache_hits``)."""
    prefix_queries: int = 0
    """Prompt tokens looked up in the prefix cache, summed over instances (tokens;
    ``vllm:prefix_cache_queries``)."""
    prefix_hit_rate: float | None = None
    """``prefix_hits / prefix_queries`` (fraction 0-1); None when there were no queries."""

    def as_dict(self) -> dict[str, float]:
        """Plain dict for JSON."""
        return asdict(self)


def prefix_counters(run: ClusterRun) -> tuple[int, int]:
    """``(hits, queries)`` of the prefix cache in tokens, summed over the run's instances.

    The one place that reads the instances' counters; an instance without them (a
    simulator built before prefix caching) counts as 0 / 0.
    """
    hits = sum(int(getattr(i, "prefix_hits", 0)) for i in run.instances)
    queries = sum(int(getattr(i, "prefix_queries", 0)) for i in run.instances)
    return hits, queries


def arrays(run: ClusterRun) -> dict[str, np.ndarray]:
    """Per-request arrays of length ``len(run.requests)``: id, arrival, dispatch, first_token,
    finish (s), prompt, output, cached (tokens; -1 where not tracked), preemptions, instance."""
    rs = run.requests
    return {
        "id": np.fromiter((r.id for r in rs), np.int64, len(rs)),
        "arrival": np.fromiter((r.arrival_s for r in rs), float, len(rs)),
        "dispatch": np.fromiter((r.dispatch_s for r in rs), float, len(rs)),
        "first_token": np.fromiter((r.first_token_s for r in rs), float, len(rs)),
        "finish": np.fromiter((r.finish_s for r in rs), float, len(rs)),
        "prompt": np.fromiter((r.prompt for r in rs), np.int64, len(rs)),
        "output": np.fromiter((r.output for r in rs), np.int64, len(rs)),
        # The one place that reads a request's cache hit (absent before prefix caching).
        "cached": np.fromiter((getattr(r, "cached_tokens", -1) for r in rs), np.int64, len(rs)),
        "preemptions": np.fromiter((r.preemptions for r in rs), np.int64, len(rs)),
        "instance": np.fromiter((r.instance for r in rs), np.int64, len(rs)),
    }


def summarize(run: ClusterRun) -> Summary:
    """Summary of a finished run.

    Raises:
        ValueError: the run has no requests or some request did not finish.
    """
    a = arrays(run)
    n = len(a["arrival"])
    if n == 0:
        raise ValueError("the run has no requests")
    if (a["finish"] < 0).any():
        raise ValueError(f"{int((a['finish'] < 0).sum())} requests did not finish")
    e2e = a["finish"] - a["arrival"]
    ttft = a["first_token"] - a["arrival"]
    multi = a["output"] > 1
    tpot = (a["finish"][multi] - a["first_token"][multi]) / (a["output"][multi] - 1)
    if tpot.size == 0:
        tpot = np.zeros(1)
    makespan = float(a["finish"].max() - a["arrival"].min())

    def q(x: np.ndarray, p: float) -> float:
        return float(np.percentile(x, p))

    hits, queries = prefix_counters(run)

    return Summary(
        requests=n,
        e2e_mean=float(e2e.mean()), e2e_p50=q(e2e, 50), e2e_p90=q(e2e, 90), e2e_p99=q(e2e, 99),
        ttft_mean=float(ttft.mean()), ttft_p50=q(ttft, 50), ttft_p90=q(ttft, 90), ttft_p99=q(ttft, 99),
        tpot_mean=float(tpot.mean()), tpot_p50=q(tpot, 50), tpot_p90=q(tpot, 90), tpot_p99=q(tpot, 99),
        makespan=makespan,
        preemptions=int(sum(i.preemptions for i in run.instances)),
        router_wait_mean=float((a["dispatch"] - a["arrival"]).mean()),
        throughput_rps=n / makespan if makespan > 0 else float("inf"),
        output_tokens_per_s=float(a["output"].sum()) / makespan if makespan > 0 else float("inf"),
        prefix_hits=hits, prefix_queries=queries,
        prefix_hit_rate=hits / queries if queries > 0 else None,
    )
