"""The one routing-policy interface and the read-only views a policy decides on.

A policy sees what a real router can see (llm-d's endpoint picker is the model):
per instance the running and waiting counts, KV-cache usage, and for each resident
request its prompt tokens, tokens generated so far and predicted decode bucket. It
never sees true output lengths, except a policy whose class sets ``oracle = True``:
only those are handed :class:`OracleRequestFeatures` / :class:`OracleResident`
objects (the simulator enforces this; see ``tests/test_policies_contract.py``).

``pick`` returns the index of the chosen instance, or ``None`` to hold the request
in the router queue (the paper's "no-action", arXiv 2408.13510 §5.3).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol, Sequence

from pydantic import BaseModel, ConfigDict

from routerd.model import PREDICTOR_BUCKET_EDGES

if TYPE_CHECKING:
    from routerd.prefix.chain import PrefixBlocks
    from routerd.profiles import HardwareProfile


@dataclass(slots=True, frozen=True)
class RequestFeatures:
    """What the router knows about a request before it is dispatched."""

    id: int
    arrival_s: float
    """Arrival time at the router (s)."""
    prompt_tokens: int
    predicted_bucket: int | None
    """Predicted output bucket (index into the context's ``bucket_edges``) or None."""
    predicted_output_tokens: float
    """A point estimate of the output length from the predicted bucket (tokens)."""
    task: str | None = None
    prefix: "PrefixBlocks | None" = None
    """The prompt's full KV blocks as hash-chain extents (:mod:`routerd.prefix.chain`), what a
    router can compute from the prompt; None when the prompt has no prefix identity."""


@dataclass(slots=True, frozen=True)
class OracleRequestFeatures(RequestFeatures):
    """Features plus the true output length; only for ``oracle = True`` policies."""

    output_tokens: int = 0


@dataclass(slots=True, frozen=True)
class ResidentRequest:
    """A request that an instance holds (waiting, prefilling or decoding)."""

    prompt_tokens: int
    generated_tokens: int
    """Output tokens generated so far (kept across a preemption)."""
    predicted_bucket: int | None
    predicted_output_tokens: float
    in_prefill: bool
    """True while the prompt (or a recompute after preemption) is not fully computed."""
    waiting: bool
    """True while in the instance's waiting queue (not yet admitted, or preempted)."""


@dataclass(slots=True, frozen=True)
class OracleResident(ResidentRequest):
    """Resident request plus its true output length; only for oracle policies."""

    output_tokens: int = 0


#: Edges (tokens) of the predicted-output bins in :class:`LoadSummary` and the DQN
#: observation: 0-256, 256-2048, >= 2048 (arXiv 2408.13510 A.9).
LOAD_BINS: tuple[int, int] = (256, 2048)


def load_bin(predicted_output_tokens: float) -> int:
    """Bin index (0, 1, 2) of a predicted output length in :data:`LOAD_BINS`."""
    if predicted_output_tokens < LOAD_BINS[0]:
        return 0
    return 1 if predicted_output_tokens < LOAD_BINS[1] else 2


@dataclass(slots=True, frozen=True)
class LoadSummary:
    """Aggregates of one instance's residents, cheap to read at every decision."""

    in_prefill: int
    """Requests waiting or still prefilling (count)."""
    decode_bins: tuple[int, int, int]
    """Decoding requests by predicted output length bin (:data:`LOAD_BINS`)."""
    min_predicted_remaining: float | None
    """Smallest predicted remaining decode among decoding requests (tokens), None if none."""
    residents: int
    """Running + waiting requests."""
    sum_prompt_and_predicted: float
    """Sum over residents of prompt + predicted output tokens (the estimator's load)."""


def summarize_residents(residents: Sequence[ResidentRequest]) -> LoadSummary:
    """:class:`LoadSummary` computed from a resident list (O(residents))."""
    in_prefill = 0
    bins = [0, 0, 0]
    min_rem: float | None = None
    total = 0.0
    for r in residents:
        total += r.prompt_tokens + r.predicted_output_tokens
        if r.in_prefill:
            in_prefill += 1
            continue
        bins[load_bin(r.predicted_output_tokens)] += 1
        rem = r.predicted_output_tokens - r.generated_tokens
        if min_rem is None or rem < min_rem:
            min_rem = rem
    return LoadSummary(in_prefill, (bins[0], bins[1], bins[2]), min_rem, len(residents), total)


class InstanceView(Protocol):
    """State of one serving instance at the decision time (read-only).

    A view may also offer aggregates it keeps incrementally, which the scanning
    helpers use instead of walking :meth:`residents` (they must return exactly what
    the scan would):

    * ``outstanding_tokens() -> float | None``: the JSQ metric
      (:func:`routerd.policies.join_shortest_queue.outstanding_tokens`), tokens;
      None when it cannot answer exactly;
    * ``waiting_kv_blocks() -> int``: :func:`routerd.policies.kv_headroom.waiting_kv_blocks`, blocks.
    """

    index: int
    num_running: int
    num_waiting: int
    kv_used_blocks: int
    kv_total_blocks: int
    block_size: int

    @property
    def kv_usage(self) -> float:
        """Used / total KV blocks, 0..1 (``vllm:kv_cache_usage_perc``)."""
        ...

    def residents(self) -> Sequence[ResidentRequest]:
        """Requests on the instance: running first (admission order), then waiting."""
        ...

    def load_summary(self) -> LoadSummary:
        """Aggregates of the residents (equal to ``summarize_residents(self.residents())``)."""
        ...


@dataclass(slots=True)
class ClusterView:
    """The router's view of the cluster at one decision."""

    now: float
    """Current time (s)."""
    instances: Sequence[InstanceView]
    queue_len: int
    """Requests in the router queue, including the one being decided."""


@dataclass(slots=True)
class PolicyContext:
    """Static facts a policy may use, given once at construction."""

    profile: "HardwareProfile"
    num_instances: int
    seed: int = 0
    bucket_edges: tuple[int, ...] = field(default=PREDICTOR_BUCKET_EDGES)
    near_tie: float = 0.0
    """Relative width of a near-tie for the load-scoring policies (``join_shortest_queue``,
    ``least_outstanding_tokens``, ``late_binding``, ``phasewise``, ``predicted_latency``,
    ``learned_linear``: within ``near_tie * |best|`` for the last two): a candidate whose score is
    at most ``best * (1 + near_tie)`` counts as tied with the best, and one of those is
    picked at random (the policy's seeded generator). 0 (the simulator's setting): the best
    alone, as each policy's source defines it. routerd sets ``router.near_tie`` so that
    replicas deciding on the same stale view do not all pick the same instance (issue 15)."""
    profiles: "tuple[HardwareProfile, ...]" = ()
    """One profile per instance, by instance index (a mixed pool: GPUs of several generations
    serving one model). Empty (the default) means ``profile`` for every instance, filled in at
    construction. In a mixed pool ``profile`` is the pool's first profile: the one profile a
    profile-blind policy is configured with, as routerd's single ``profile`` setting is."""

    def __post_init__(self) -> None:
        if not self.profiles:
            self.profiles = (self.profile,) * self.num_instances
        elif len(self.profiles) != self.num_instances:
            raise ValueError(f"PolicyContext: {len(self.profiles)} profiles for {self.num_instances} instances")
        else:
            self.profiles = tuple(self.profiles)

    @property
    def homogeneous(self) -> bool:
        """True when every instance has the same profile (compared by value)."""
        first = self.profiles[0] if self.profiles else self.profile
        return all(p is first or p == first for p in self.profiles)


class PolicySetupError(ValueError):
    """A policy cannot be built from valid parameters (e.g. its checkpoint is missing or unfit)."""


class PolicyParams(BaseModel):
    """Base of each policy's typed parameters (unknown keys are rejected)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, allow_inf_nan=False)


class RoutingPolicy(ABC):
    """One routing policy. Subclasses set ``name``, ``Params`` and implement ``pick``."""

    name: ClassVar[str]
    Params: ClassVar[type[PolicyParams]] = PolicyParams
    oracle: ClassVar[bool] = False
    """True only for policies allowed to read true output lengths (upper bounds)."""
    order_sensitive: ClassVar[bool] = False
    """True when the choice depends on the order of ``view.instances`` beyond breaking ties
    (round robin's position, a DQN's input slots). routerd hands every other policy its
    candidates in a random order per decision, so their "first among equals" tie-break is
    random and several routerd replicas do not all pick the same idle instance."""

    def __init__(self, ctx: PolicyContext, params: PolicyParams | None = None) -> None:
        self.ctx = ctx
        self.params = params if params is not None else self.Params()

    @abstractmethod
    def pick(self, request: RequestFeatures, view: ClusterView) -> int | None:
        """Choose an instance index for ``request``, or ``None`` to hold it."""

    def on_complete(self, instance: int, request_id: int, now: float) -> None:  # noqa: B027
        """Told when a request finishes on ``instance`` (optional hook)."""


def queue_scores(instances: Sequence[InstanceView]) -> list[float]:
    """llm-d's queue scorer per instance, in view order: ``(max_q - q) / (max_q - min_q)`` over
    the candidates' waiting-queue sizes, 1 for every instance when all are equal
    (``llm-d/llm-d-router:pkg/epp/framework/plugins/scheduling/scorer/queue``)."""
    waits = [inst.num_waiting for inst in instances]
    lo, hi = min(waits), max(waits)
    span = hi - lo
    return [1.0 if span == 0 else (hi - w) / span for w in waits]


def pick_near_best(scored: Sequence[tuple[float, int]], near_tie: float, rng: "random.Random") -> int | None:
    """The instance index of the lowest score (>= 0, lower is better) among ``scored``
    (score, index) pairs in view order, or None when it is empty.

    ``near_tie`` 0: the first lowest, as the policies always chose (view order breaks exact
    ties; routerd shuffles the view). ``near_tie`` > 0: uniformly one of those whose score is
    at most ``best * (1 + near_tie)`` (see :attr:`PolicyContext.near_tie`).
    """
    if not scored:
        return None
    lo, first = min(scored, key=lambda x: x[0])
    if near_tie <= 0.0:
        return first
    bound = lo * (1.0 + near_tie) + 1e-12
    return pick_tie([i for s, i in scored if s <= bound], rng)


def pick_cheapest(scored: Sequence[tuple[float, int]], near_tie: float, rng: "random.Random") -> int:
    """The instance index of the lowest cost among ``scored`` (cost in seconds, index) pairs (not
    empty): uniformly one of those within ``max(1e-12, near_tie * |lowest|)`` of it, so exact
    ties (1e-12 s) always go to the seeded generator, near-ties too with ``near_tie`` > 0 (the
    rule of the policies pricing in seconds: ``phasewise``, ``predicted_latency``)."""
    lo = min(c for c, _ in scored)
    bound = lo + max(1e-12, near_tie * abs(lo))
    return pick_tie([i for c, i in scored if c <= bound], rng)


def pick_tie(best: Sequence[int], rng: "random.Random") -> int:
    """One of ``best`` (equal top candidates), uniformly with the policy's seeded generator."""
    return best[0] if len(best) == 1 else best[rng.randrange(len(best))]

