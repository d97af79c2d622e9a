"""Cluster simulator: a router with a queue in front of several simulated vLLM instances.

The event loop is a heap of ``(time, seq, event)`` with a per-run sequence number for
deterministic tie-breaks; arrivals are merged in from the time-sorted workload.
The router decides on every arrival, after every completion while requests wait in
its queue, and every ``action_interval_s`` (default 0.02 s, the paper's action
interval, arXiv 2408.13510 §6) while its queue is non-empty. At each decision it
offers the queue head to the policy until the policy holds (returns ``None``) or the
queue is empty.

Ticks lie on a grid of whole nanoseconds, ``k * interval_ns / 1e9`` s for integers ``k``
(:func:`tick_time`), and the next one is the first grid time strictly after ``now``
(:func:`next_tick`), found with exact comparisons: float division (``now / interval``)
can round to just below an integer at large times (527269.7 / 0.02 = 26363484.999999996),
which put the next tick at ``now`` itself and looped forever at one instant.
"""

from __future__ import annotations

import heapq
import math
from numbers import Integral
from collections import deque
from dataclasses import dataclass
from typing import Callable, Generator, Sequence

from routerd.policies.base import (
    ClusterView,
    LoadSummary,
    OracleRequestFeatures,
    OracleResident,
    RequestFeatures,
    ResidentRequest,
    RoutingPolicy,
)
from routerd.prefix.chain import PrefixBlocks
from routerd.profiles import HardwareProfile, as_pool
from routerd.sim.instance import AdmissionGate, SimInstance
from routerd.sim.request import DECODE, WAITING, SimRequest


NS_PER_S = 1_000_000_000
"""Nanoseconds per second: the router tick grid is kept in whole nanoseconds."""


def interval_ns(interval_s: float) -> int:
    """A tick interval in whole nanoseconds: ``round(interval_s * 1e9)`` (0.02 s -> 20,000,000).

    Raises:
        ValueError: not a finite number of seconds >= 1 ns.
    """
    if not (math.isfinite(interval_s) and interval_s * NS_PER_S >= 0.5):
        raise ValueError(f"tick interval must be a finite number of seconds >= 1e-9, got {interval_s!r}")
    return max(1, round(interval_s * NS_PER_S))


def tick_time(k: int, step_ns: int) -> float:
    """Time (s) of grid point ``k``: ``k * step_ns / 1e9``, computed as an integer product
    and one correctly rounded integer division (Python's ``int / int``), so every grid point
    is the float nearest its exact value and the grid is non-decreasing in ``k``."""
    return k * step_ns / NS_PER_S


def next_tick(now: float, step_ns: int) -> tuple[int, float]:
    """``(k, t)``: the first grid point strictly after ``now`` (s) on the grid of
    ``step_ns`` ns, ``t = tick_time(k, step_ns)``, so ``tick_time(k - 1) <= now < t``.

    ``k`` is estimated in floating point and then corrected with exact float comparisons
    against the grid points themselves, so ``t > now`` holds whatever the rounding of the
    estimate (at 527269.7 s and 0.02 s, ``now / 0.02`` is 26363484.999999996, and
    ``floor(now / 0.02) + 1`` times 0.02 is ``now`` again). ``t - now`` is at most one
    interval (plus the rounding of ``t``, half an ulp). Grid points are distinct while the
    interval exceeds the float spacing at ``now`` (at 1e9 s, 1.2e-7 s).
    """
    k = math.floor(now * NS_PER_S / step_ns) + 1
    while tick_time(k - 1, step_ns) > now:
        k -= 1
    while tick_time(k, step_ns) <= now:
        k += 1
    return k, tick_time(k, step_ns)


class SimulationError(RuntimeError):
    """The simulation cannot proceed (a policy returned an invalid choice)."""


class SimInstanceView:
    """:class:`routerd.policies.base.InstanceView` of a simulated instance at one time."""

    __slots__ = ("index", "num_running", "num_waiting", "kv_used_blocks", "kv_total_blocks",
                 "block_size", "_inst", "_now", "_oracle", "_D")

    def __init__(self, inst: SimInstance, now: float, oracle: bool) -> None:
        self.index = inst.index
        self.num_running = len(inst.running)
        self.num_waiting = len(inst.waiting)
        self._D, self.kv_used_blocks = inst.observe(now)
        self.kv_total_blocks = inst.total_blocks
        self.block_size = inst.bs
        self._inst = inst
        self._now = now
        self._oracle = oracle

    @property
    def kv_usage(self) -> float:
        """Used / total KV blocks (0..1)."""
        return self.kv_used_blocks / self.kv_total_blocks

    def load_summary(self) -> LoadSummary:
        """Aggregates kept incrementally by the instance: O(1) apart from stale heap entries."""
        inst = self._inst
        h = inst.dec_hist
        return LoadSummary(len(inst.waiting) + inst.n_prefill, (h[0], h[1], h[2]),
                           inst.min_predicted_remaining(self._D),
                           inst.n_res, inst.sum_pd)

    def engine_cached_blocks(self, prefix: PrefixBlocks) -> int:
        """Leading blocks of ``prefix`` in this instance's prefix cache (blocks), as vLLM's KV
        events report them to a precise index, or held by a prompt dispatched here whose blocks
        are not computed yet (:attr:`SimInstance.pending`: routerd counts those until their events
        come); 0 with prefix caching off."""
        inst = self._inst
        pc = inst.pc
        if pc is None:
            return 0
        n = pc.match(prefix.extents)
        if inst.pending:
            m = inst.pending_match(prefix.extents)
            if m > n:
                return m
        return n

    def pending_prefill_tokens(self) -> int:
        """Prompt tokens still to prefill here (tokens): waiting requests' lookups as the engine
        would do them now, plus the unfinished chunks of prefilling ones."""
        return self.pending_prefill_work()[0]

    def pending_prefill_work(self) -> tuple[int, int]:
        """``(tokens, attended)`` still to prefill here: the tokens (as
        :meth:`pending_prefill_tokens`) and the sum over requests of ``u * (c + u)`` for ``u``
        tokens to compute after ``c`` cached or computed ones (tokens^2), the two terms of the
        profile's prefill time (``routerd/profiles.py``)."""
        inst = self._inst
        pc = inst.pc
        bs = inst.bs
        total = 0
        attended = 0
        for r in inst.waiting:
            done = 0
            st = r.pst
            if st is not None:
                hit = pc.match(st.ext)
                cap = (r.target - 1) // bs
                done = bs * (hit if hit < cap else cap)
            u = r.target - done
            total += u
            attended += u * r.target
        if inst.n_prefill:
            for r in inst.running:
                if r.state != DECODE:
                    u = r.target - r.computed
                    total += u
                    attended += u * r.target
        return total, attended

    def residents(self) -> list[ResidentRequest]:
        """Running requests (admission order) then waiting ones, as the router sees them."""
        inst = self._inst
        D = self._D
        out: list[ResidentRequest] = []
        for group in (inst.running, inst.waiting):
            for r in group:
                gen = r.gen_base + D - r.dec_base if r.state == DECODE else r.generated
                if self._oracle:
                    out.append(OracleResident(r.prompt, gen, r.bucket, r.pred_tokens,
                                              r.state != DECODE, r.state == WAITING, r.output))
                else:
                    out.append(ResidentRequest(r.prompt, gen, r.bucket, r.pred_tokens,
                                               r.state != DECODE, r.state == WAITING))
        return out


class _LazyViews(Sequence[SimInstanceView]):
    """Instance views built on first access (round robin looks at one, JSQ at all)."""

    __slots__ = ("_insts", "_now", "_oracle", "_cache")

    def __init__(self, insts: list[SimInstance], now: float, oracle: bool) -> None:
        self._insts = insts
        self._now = now
        self._oracle = oracle
        self._cache: list[SimInstanceView | None] = [None] * len(insts)

    def __len__(self) -> int:
        return len(self._insts)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        v = self._cache[i]
        if v is None:
            v = self._cache[i] = SimInstanceView(self._insts[i], self._now, self._oracle)
        return v

    def __iter__(self):
        for i in range(len(self._insts)):
            yield self[i]


@dataclass
class ClusterRun:
    """Everything one simulation produced (see :mod:`routerd.sim.report` for summaries)."""

    requests: list[SimRequest]
    """All simulated requests, in workload order, with their timestamps filled in."""
    instances: list[SimInstance]
    end_s: float
    """Simulated time of the last event (s)."""
    decisions: int
    """Calls to ``policy.pick``."""
    holds: int
    """Decisions that returned ``None`` (request held at the router)."""
    forced_dispatches: int = 0
    """Requests dispatched round robin because the policy held them on an idle cluster."""


class ClusterSimulator:
    """Runs one workload through a router policy and ``num_instances`` instances.

    Args:
        profile: hardware profile of every instance, or one profile per instance (a mixed
            pool, :func:`routerd.profiles.as_pool`; ``self.profile`` is then the first).
        num_instances: number of instances (>= 1).
        policy: the routing policy (see :mod:`routerd.policies`).
        action_interval_s: router tick while requests are held (s), rounded to whole
            nanoseconds (:func:`interval_ns`); ticks fall on its grid (:func:`next_tick`).
        admission_gate: ``"full"`` or ``"chunk"`` (see :class:`SimInstance`).
    """

    def __init__(
        self,
        profile: HardwareProfile | Sequence[HardwareProfile],
        num_instances: int,
        policy: RoutingPolicy,
        *,
        action_interval_s: float = 0.02,
        admission_gate: AdmissionGate = "full",
    ) -> None:
        if num_instances < 1:
            raise ValueError(f"num_instances must be >= 1, got {num_instances}")
        if not (1e-4 <= action_interval_s < math.inf):
            raise ValueError(f"action_interval_s must be a finite number of seconds >= 1e-4, got {action_interval_s}")
        self.profiles = as_pool(profile, num_instances)
        self.profile = self.profiles[0]
        self.policy = policy
        self.action_interval_s = action_interval_s
        self._tick_ns = interval_ns(action_interval_s)
        self._heap: list[tuple[float, int, object]] = []
        self._seq = 0
        self.instances = [
            SimInstance(i, prof, self._schedule_step, self._first_token, self._finish, admission_gate)
            for i, prof in enumerate(self.profiles)
        ]
        self.queue: deque[SimRequest] = deque()
        self._idle_dispatched: list[SimInstance] = []
        self._tick_pending = False
        self._completed_since_decide = False
        self._oracle = bool(getattr(policy, "oracle", False))
        self.decisions = 0
        self.holds = 0
        self.finished = 0
        self.arrived = 0
        self.now = 0.0
        self.queue_inv_T = 0.0  # RL reward: sum of 1/T_j over the router queue
        self.idle_hold_limit_s = 1.0
        """A request held this long while every instance is idle is dispatched round robin."""
        self.forced_dispatches = 0
        """Dispatches forced by ``idle_hold_limit_s`` (a policy that would hold forever)."""
        self._idle_from: float | None = None
        self._force_rr = -1
        self.track_penalty = False
        """When True, integrate the RL penalty over simulated time (see penalty_integral)."""
        self.penalty_integral = 0.0
        """Integral over time (s) of sum_j (1/T_j)(1 - f_j) over queued and resident requests."""
        self._pen_t = 0.0
        self._pen_rate = 0.0
        self.on_finish: Callable[[SimRequest, float], None] | None = None

    # -- event plumbing -------------------------------------------------------
    def _push(self, t: float, ev: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, ev))

    def _schedule_step(self, t: float, inst: SimInstance) -> None:
        self._push(t, (inst, inst.version))

    def _first_token(self, r: SimRequest, t: float) -> None:
        pass

    def _finish(self, r: SimRequest, t: float) -> None:
        self.finished += 1
        self._completed_since_decide = True
        self.policy.on_complete(r.instance, r.id, t)
        if self.on_finish is not None:
            self.on_finish(r, t)

    # -- router ---------------------------------------------------------------
    def view(self, now: float) -> ClusterView:
        """The router's view at ``now`` (what a policy is given)."""
        oracle = self._oracle
        return ClusterView(now, _LazyViews(self.instances, now, oracle), len(self.queue))

    def dispatch(self, r: SimRequest, choice: int, now: float) -> None:
        """Send ``r`` to instance ``choice`` at ``now``."""
        r.dispatch_s = now
        inst = self.instances[choice]
        if not inst.busy:
            self._idle_dispatched.append(inst)
        inst.enqueue(r, now)

    def _decide(self, now: float) -> Generator[SimRequest, int | None, None]:
        """Offer queued requests (yielded) until the answer is ``None`` (hold) or the queue empties."""
        q = self.queue
        n = len(self.instances)
        self._completed_since_decide = False
        while q:
            r = q[0]
            self.decisions += 1
            choice = yield r
            if choice is None:
                self.holds += 1
                if self._idle_since(now) < self.idle_hold_limit_s:
                    break
                # Holding while every instance is idle would never end: fail open.
                self.forced_dispatches += 1
                self._force_rr = (self._force_rr + 1) % n
                choice = self._force_rr
            if type(choice) is not int and isinstance(choice, Integral) and not isinstance(choice, bool):
                choice = int(choice)  # numpy integers are fine
            if type(choice) is not int or not 0 <= choice < n:
                raise SimulationError(
                    f"policy {self.policy.name!r} returned {choice!r} for request {r.id}; "
                    f"expected an instance index 0..{n - 1} or None"
                )
            q.popleft()
            self.queue_inv_T -= r.inv_T
            self.dispatch(r, choice, now)
        if self._idle_dispatched:
            # Requests dispatched in one round at the same instant share the first step.
            for inst in self._idle_dispatched:
                inst.start(now)
            self._idle_dispatched.clear()
        if q and not self._tick_pending:
            self._tick_pending = True
            # Strictly after now, on the grid (a tick at now would be popped at once, held
            # again and re-pushed at now: a livelock at one instant).
            self._push(next_tick(now, self._tick_ns)[1], None)

    def _idle_since(self, now: float) -> float:
        """Seconds every instance has been idle while the router held requests (0 if busy)."""
        for inst in self.instances:
            if inst.busy or inst.running or inst.waiting:
                self._idle_from = None
                return 0.0
        if self._idle_from is None:
            self._idle_from = now
        return now - self._idle_from

    def penalty_rate(self, now: float) -> float:
        """sum_j (1/T_j)(1 - f_j) over the router queue and every instance at ``now``."""
        total = self.queue_inv_T
        for inst in self.instances:
            total += inst.unfinished_penalty(inst.decode_iters_at(now))
        return total

    def _integrate(self, now: float) -> None:
        # Left Riemann sum over events: the state only changes at events (and f_j grows
        # within decode segments, which this slightly over-counts).
        self.penalty_integral += self._pen_rate * (now - self._pen_t)
        self._pen_t = now

    # -- run ------------------------------------------------------------------
    def steps(
        self, requests: Sequence[SimRequest], progress: Callable[[int], None] | None = None
    ) -> Generator[SimRequest, int | None, ClusterRun]:
        """Simulate as a generator that yields each router decision.

        Each yielded request is the router-queue head at ``self.now``; send back an
        instance index or ``None`` (hold). Returns (``StopIteration.value``) the
        :class:`ClusterRun` once every request has finished. ``requests`` must be sorted
        by arrival. This is what the RL environment steps through; :meth:`run` drives it
        with the policy.
        """
        prev = -math.inf
        for r in requests:
            if r.arrival_s < prev:
                raise ValueError(f"requests must be sorted by arrival: request {r.id} arrives at "
                                 f"{r.arrival_s} s, before its predecessor at {prev} s")
            prev = r.arrival_s
            if r.features is None:
                r.features = make_features(r, self._oracle)
        heap = self._heap
        pop = heapq.heappop
        arrivals = list(requests)
        ai = 0
        na = len(arrivals)
        now = 0.0
        reported = 0
        track = self.track_penalty
        while ai < na or heap:
            if track:
                if self.now > self._pen_t:
                    self._integrate(self.now)
                self._pen_rate = self.penalty_rate(self.now)
            if heap and (ai >= na or heap[0][0] < arrivals[ai].arrival_s):
                now, _, ev = pop(heap)
                if track:
                    self._integrate(now)
                self.now = now
                if ev is None:
                    self._tick_pending = False
                    if self.queue:
                        yield from self._decide(now)
                    continue
                inst, version = ev  # type: ignore[misc]
                if version != inst.version:
                    continue
                inst.step_end(now)
                if self._completed_since_decide and self.queue:
                    yield from self._decide(now)
                if progress is not None and self.finished - reported >= 256:
                    progress(self.finished - reported)
                    reported = self.finished
            else:
                now = arrivals[ai].arrival_s
                if track:
                    self._integrate(now)
                self.now = now
                # Simultaneous arrivals reach the router together.
                while ai < na and arrivals[ai].arrival_s == now:
                    self.queue.append(arrivals[ai])
                    self.queue_inv_T += arrivals[ai].inv_T
                    self.arrived += 1
                    ai += 1
                yield from self._decide(now)
        if progress is not None and self.finished > reported:
            progress(self.finished - reported)
        if self.finished != na:
            raise SimulationError(f"{na - self.finished} of {na} requests never finished: a request "
                                  "needs more KV blocks than the instance has")
        return ClusterRun(list(requests), self.instances, now, self.decisions, self.holds,
                          self.forced_dispatches)

    def run(self, requests: Sequence[SimRequest], progress: Callable[[int], None] | None = None) -> ClusterRun:
        """Simulate until every request has finished; ``requests`` must be sorted by arrival.

        ``progress`` (optional) is called with the number of newly finished requests.
        """
        gen = self.steps(requests, progress)
        pick = self.policy.pick
        try:
            r = next(gen)
            while True:
                r = gen.send(pick(r.features, self.view(self.now)))
        except StopIteration as stop:
            return stop.value


def make_features(r: SimRequest, oracle: bool) -> RequestFeatures:
    """The router-visible features of a request (with the true length only for oracles)."""
    if oracle:
        return OracleRequestFeatures(r.id, r.arrival_s, r.prompt, r.bucket, r.pred_tokens, r.task,
                                     r.prefix, output_tokens=r.output)
    return RequestFeatures(r.id, r.arrival_s, r.prompt, r.bucket, r.pred_tokens, r.task, r.prefix)
