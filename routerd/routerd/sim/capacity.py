"""Round robin's saturated throughput: the "capacity" that offered loads are scaled against."""

from __future__ import annotations

from typing import Sequence

from routerd.model import Request
from routerd.policies.base import PolicyContext
from routerd.policies.round_robin import RoundRobin
from routerd.profiles import HardwareProfile
from routerd.sim.cluster import ClusterSimulator
from routerd.sim.prepare import prepare_requests
from routerd.sim.report import summarize
from routerd.workloads.traces import rescale_to_rate

FLOOD_RATE = 1000.0
"""Arrival rate (req/s) at which every request is queued almost at once, so round robin's
finished requests per second of makespan is its saturated throughput."""


def round_robin_capacity(requests: Sequence[Request], profile: HardwareProfile, m: int) -> float:
    """Round robin's saturated throughput (req/s) on ``requests`` over ``m`` instances: the
    requests offered at :data:`FLOOD_RATE`, finished requests / makespan. It depends on the
    sample (its longest outputs drain last), so compare loads only at equal request counts."""
    prep = prepare_requests(rescale_to_rate(list(requests), FLOOD_RATE), profile)
    run = ClusterSimulator(profile, m, RoundRobin(PolicyContext(profile, m))).run(prep.requests)
    return summarize(run).throughput_rps
