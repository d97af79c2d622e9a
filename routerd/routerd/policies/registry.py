"""The policy registry: names to classes, spec parsing and construction with typed parameters.

Every policy is listed here explicitly (no decorators, no import side effects), as
llm-d lists its in-tree plugins in one place. A policy spec on the command line is
``name`` or ``name:key=value,key=value``; values stay strings (``none``/``null``
become None) and each policy's pydantic ``Params`` converts them.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from routerd.policies.base import PolicyContext, PolicySetupError, RoutingPolicy
from routerd.policies.decode_balancer import DecodeBalancer
from routerd.policies.dqn.policy import DQNPolicy
from routerd.policies.dynamo_kv import DynamoKv
from routerd.policies.join_shortest_queue import JoinShortestQueue
from routerd.policies.kv_headroom import LateBinding
from routerd.policies.kv_queue_scorer import QueueKvScorer
from routerd.policies.learned_linear import LearnedLinear
from routerd.policies.least_outstanding_tokens import LeastOutstandingTokens
from routerd.policies.llmd import LlmD
from routerd.policies.lmetric import LMetric
from routerd.policies.max_capacity_usage import MaxCapacityUsage
from routerd.policies.min_min import MinMin
from routerd.policies.mixing_penalty import MixingPenalty
from routerd.policies.oracle import Oracle
from routerd.policies.phasewise import Phasewise
from routerd.policies.power_of_two_choices import PowerOfTwoChoices
from routerd.policies.predicted_latency import PredictedLatency
from routerd.policies.random_choice import RandomChoice
from routerd.policies.round_robin import RoundRobin
from routerd.policies.sglang_cache_aware import SglangCacheAware


class PolicyError(ValueError):
    """An unknown policy name, a malformed spec, or an invalid parameter (named in the message)."""


POLICIES: dict[str, type[RoutingPolicy]] = {
    cls.name: cls
    for cls in (
        RoundRobin,
        RandomChoice,
        JoinShortestQueue,
        LeastOutstandingTokens,
        PowerOfTwoChoices,
        MaxCapacityUsage,
        MinMin,
        QueueKvScorer,
        MixingPenalty,
        LateBinding,
        # The anchors' prefix-cache-aware policies (shared/docs/prefix-routing.md §2).
        LlmD,
        SglangCacheAware,
        DynamoKv,
        LMetric,
        # Phasewise's own (routerd/policies/phasewise.py).
        Phasewise,
        # Model-predictive, per-instance profiles (routerd/policies/predicted_latency.py).
        PredictedLatency,
        DecodeBalancer,
        Oracle,
        DQNPolicy,
        # Learned by evolution strategies on whole samples (routerd/rl/es.py, issue 18).
        LearnedLinear,
    )
}
"""Every routing policy by its ``name``."""

NOT_IN_DEFAULT_BENCH: frozenset[str] = frozenset({"predicted_latency", "learned_linear"})
"""Policies a default ``phasewise bench`` does not run: added after the default table was
published (issue 18); run them with ``--policies``, so the default output stays what it was."""

DEFAULT_BENCH_POLICIES: list[str] = [
    name for name, cls in POLICIES.items() if not cls.oracle and name not in NOT_IN_DEFAULT_BENCH
] + ["oracle"]
"""Policies a benchmark runs unless told otherwise: every non-oracle one (``dqn`` with the
checkpoint shipped for 4 instances of llama2-7b-v100) but :data:`NOT_IN_DEFAULT_BENCH`, then
``oracle``. Use :func:`default_bench_policies`, which leaves ``dqn`` out where that checkpoint
does not fit."""


def default_bench_policies(num_instances: int, profile: str | None = None) -> tuple[list[str], list[str]]:
    """:data:`DEFAULT_BENCH_POLICIES` for ``num_instances`` instances of ``profile``, and notes.

    ``dqn`` stays only when the shipped checkpoint loads, was trained for
    ``num_instances`` instances and (when ``profile`` is given) on that hardware profile;
    otherwise it is left out and a one-line note says why. Returns ``(specs, notes)``.
    """
    from routerd.policies.dqn.checkpoint import DEFAULT_CHECKPOINT, CheckpointError, load_checkpoint

    specs, notes = list(DEFAULT_BENCH_POLICIES), []
    if "dqn" in specs:
        try:
            ck = load_checkpoint(DEFAULT_CHECKPOINT, num_instances=num_instances)
            mismatch = ck.profile_mismatch(profile) if profile is not None else None
        except CheckpointError as e:
            mismatch = str(e)
        if mismatch:
            specs.remove("dqn")
            notes.append(f"dqn left out: {mismatch}")
    return specs, notes


def policy_names() -> list[str]:
    """Registered policy names, in registry order."""
    return list(POLICIES)


def _parse_value(text: str) -> Any:
    return None if text.strip().lower() in ("none", "null") else text.strip()


def parse_policy_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Split ``"name:key=value,key=value"`` into ``(name, {key: value})``.

    Raises:
        PolicyError: empty name, an item without ``=``, an empty key, or a repeated key.
    """
    name, _, rest = spec.partition(":")
    name = name.strip()
    if not name:
        raise PolicyError(f"policy spec {spec!r}: empty policy name")
    params: dict[str, Any] = {}
    if rest.strip():
        # Parameters are separated by ',' or '|' ('|' survives a ','-separated policy list).
        for item in rest.replace("|", ",").split(","):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or not key:
                raise PolicyError(f"policy spec {spec!r}: expected key=value, got {item!r}")
            if key in params:
                raise PolicyError(f"policy spec {spec!r}: parameter {key!r} given twice")
            params[key] = _parse_value(value)
    return name, params


def build_policy(name: str, params: dict[str, Any] | None, ctx: PolicyContext) -> RoutingPolicy:
    """Construct policy ``name`` with ``params`` validated by its ``Params`` model.

    Raises:
        PolicyError: unknown name (the message lists the valid ones), or an invalid
            or unknown parameter (the message names the policy and the field).
    """
    cls = POLICIES.get(name)
    if cls is None:
        hint = ""
        if "," in name and all(part.strip() in POLICIES for part in name.split(",")):
            # "a,b:k=v" was split at ':' first; a list with parameters needs ';'.
            hint = "; separate policies with ';' when one has parameters (e.g. 'round_robin;dqn:checkpoint=DIR')"
        raise PolicyError(f"unknown policy {name!r}; valid: {', '.join(POLICIES)}{hint}")
    try:
        typed = cls.Params.model_validate(params or {})
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or "params"
        fields = ", ".join(cls.Params.model_fields) or "none"
        raise PolicyError(f"policy {name!r}: field {field}: {err['msg']} (fields: {fields})") from None
    try:
        return cls(ctx, typed)
    except PolicySetupError as e:
        raise PolicyError(f"policy {name!r}: {e}") from None


def build_policy_from_spec(spec: str, ctx: PolicyContext) -> RoutingPolicy:
    """``build_policy(*parse_policy_spec(spec), ctx)``."""
    name, params = parse_policy_spec(spec)
    return build_policy(name, params, ctx)
