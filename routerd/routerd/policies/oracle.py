"""``oracle`` (ORACLE): join the shortest queue measured with *true* output lengths.

Not a published router, and not an upper bound: it is ``join_shortest_queue`` (paper
A.2: fewest prompt + decode tokens still to process) with a perfect length predictor,
so it shows what exact lengths are worth to the token-load family
(``join_shortest_queue``, ``least_outstanding_tokens``, ``min_min``) and nothing more.
Policies that use other signals beat it, because it ignores KV headroom and
preemption: in the policy table of docs/results.md ``mixing_penalty`` and
``late_binding`` have 7-22% lower mean E2E, and issue 13 found ``dqn`` ahead of it on
the default ``phasewise bench`` too. A bound that no router can beat is
``benchmarks/makespan_bound.py`` (a makespan lower bound from each request's least
instance time).

Per resident it counts the remaining prefill tokens (``prompt + generated`` while it
still needs a (re)compute) plus its true remaining decode tokens; the new request adds
its prompt plus its true output on every instance, so it does not change the choice.
Lowest index on ties; it never holds. The name stays ``oracle`` (bench tables, specs and
scripts use it); "oracle" means it reads true output lengths, as ``decode_balancer`` does.

An earlier version estimated each instance's drain time with the latency model;
on the policy table (benchmarks/policy_table.py) it sent requests to whichever
instance's *longest* request ended first and lost to round robin.
"""

from __future__ import annotations

from routerd.policies.base import ClusterView, PolicyParams, RequestFeatures, RoutingPolicy


class Params(PolicyParams):
    """The oracle has no parameters."""


class Oracle(RoutingPolicy):
    """Join-shortest-queue on true outstanding tokens (prefill + decode); an oracle reference, not an upper bound."""

    name = "oracle"
    Params = Params
    oracle = True

    def pick(self, request: RequestFeatures, view: ClusterView) -> int | None:
        if not hasattr(request, "output_tokens"):
            raise TypeError("oracle is an oracle policy: it needs OracleRequestFeatures")
        best = None
        best_w = 0
        for inst in view.instances:
            w = 0
            for r in inst.residents():
                try:
                    out = r.output_tokens  # type: ignore[attr-defined]
                except AttributeError:
                    raise TypeError("oracle is an oracle policy: it needs OracleResident residents") from None
                if r.in_prefill or r.waiting:
                    w += r.prompt_tokens + r.generated_tokens
                w += max(0, out - r.generated_tokens)
            if best is None or w < best_w:
                best, best_w = inst.index, w
        return best
