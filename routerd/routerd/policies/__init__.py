"""Routing policies: the interface, the views, and the registry of implementations.

See :mod:`routerd.policies.base` for the contract and :mod:`routerd.policies.registry`
for the list of policies and how to build one from a spec.
"""

from routerd.policies.base import (
    ClusterView,
    InstanceView,
    OracleRequestFeatures,
    OracleResident,
    PolicyContext,
    PolicyParams,
    RequestFeatures,
    ResidentRequest,
    RoutingPolicy,
)
from routerd.policies.registry import (
    DEFAULT_BENCH_POLICIES,
    POLICIES,
    PolicyError,
    build_policy,
    build_policy_from_spec,
    default_bench_policies,
    parse_policy_spec,
    policy_names,
)
from routerd.policies.static_view import StaticInstanceView

__all__ = [
    "DEFAULT_BENCH_POLICIES",
    "POLICIES",
    "ClusterView",
    "InstanceView",
    "OracleRequestFeatures",
    "OracleResident",
    "PolicyContext",
    "PolicyError",
    "PolicyParams",
    "RequestFeatures",
    "ResidentRequest",
    "RoutingPolicy",
    "StaticInstanceView",
    "build_policy",
    "build_policy_from_spec",
    "default_bench_policies",
    "parse_policy_spec",
    "policy_names",
]
