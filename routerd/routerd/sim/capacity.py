"""Round robin's saturated throughput: the "capacity" that offered loads are scaled against."""

from __future__ import annotations

from typing import Sequence

from routerd.model import Request
from routerd.policies.base import PolicyContext
from routerd.policies.round_robin import RoundRobin
from routerd.profiles import HardwareProfile, as_pool, pool_admission_profile
from routerd.sim.cluster import ClusterSimulator
from routerd.sim.prepare import prepare_requests
from routerd.sim.report import summarize
from routerd.workloads.traces import rescale_to_rate

FLOOD_RATE = 1000.0
"""Arrival rate (req/s) at which every request is queued almost at once, so round robin's
finished requests per second of makespan is its saturated throughput."""


def round_robin_capacity(requests: Sequence[Request], profile: HardwareProfile | Sequence[HardwareProfile],
                         m: int) -> float:
    """Round robin's saturated throughput (req/s) on ``requests`` over ``m`` instances: the
    requests offered at :data:`FLOOD_RATE`, finished requests / makespan. It depends on the
    sample (its longest outputs drain last), so compare loads only at equal request counts.

    ``profile`` is every instance's profile or one per instance (a mixed pool). In a mixed pool
    round robin gives every instance the same share, so the slowest instances set the makespan:
    this is round robin's capacity on that pool, not the pool's (a profile-aware router can
    serve more), which is what loads relative to round robin are meant to show."""
    pool = as_pool(profile, m)
    ref = pool_admission_profile(pool)
    prep = prepare_requests(rescale_to_rate(list(requests), FLOOD_RATE), ref)
    ctx = PolicyContext(pool[0], m, profiles=pool)
    run = ClusterSimulator(pool, m, RoundRobin(ctx)).run(prep.requests)
    return summarize(run).throughput_rps
