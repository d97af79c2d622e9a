"""Discrete-event simulation of vLLM V1 instances behind a router."""

from routerd.sim.cluster import ClusterRun, ClusterSimulator, SimulationError
from routerd.sim.instance import SimInstance
from routerd.sim.prepare import PredictionError, Prepared, prepare_requests
from routerd.sim.request import SimRequest

__all__ = [
    "ClusterRun", "ClusterSimulator", "PredictionError", "Prepared", "SimInstance",
    "SimRequest", "SimulationError", "prepare_requests",
]
