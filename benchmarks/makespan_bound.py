"""A lower bound on the makespan any router can reach in the simulator, beside round robin's.

Issue #3 asks the RL router for >= 20% lower makespan than round robin. Whatever a router
does, every request's work must be done on some instance, so

    makespan >= sum over requests of W_r / m

with ``W_r`` the least instance time request r can cost under the simulator's latency
model (``routerd/sim/instance.py``: an iteration costs ``overhead_s + prefill_per_token_s *
prefill tokens + prefill_attn_s * attention + decode_per_seq_s * decoding requests +
decode_per_ctx_token_s * their context``):

    W_r = prefill_per_token_s * p + prefill_attn_s * A(p)           (its prefill)
        + sum_{g=1}^{o-1} (decode_per_seq_s + decode_per_ctx_token_s * (p + g))
        + (o - 1) * overhead_s / max_num_seqs                       (its share of overheads)

for prompt ``p`` and output ``o`` tokens (the first output token comes from the prefill
iteration). ``A(p)`` is the least prefill attention: ``p**2`` unchunked; with chunked
prefill, chunks ``c_k`` cost ``sum_k c_k * (c_1 + .. + c_k) = (p**2 + sum_k c_k**2) / 2``,
least for 1-token chunks: ``p * (p + 1) / 2``.

A second, usually tighter bound shares each iteration's overhead by KV cache instead of
by batch slots. An iteration whose decoding requests have contexts summing to ``S``
tokens holds them in the KV cache, so ``S <= C' = kv_capacity_tokens + max_num_seqs``
(the simulator charges each decode its prompt + generated tokens, one more than the
cache holds; the ``+ max_num_seqs`` covers that). Hence ``overhead_s >= overhead_s * S /
C'``, which charges decode step ``g`` of a request ``overhead_s * (p + g) / C'``:

    W'_r = (the same prefill and per-token terms) + overhead_s * sum_{g=1}^{o-1} (p + g) / C'

Any convex mix of the two charges is also a lower bound on the overhead, and the sum is
linear in the mix, so the best bound is ``max(sum W_r, sum W'_r) / m``. Both leave out
every prefill overhead, recomputation after preemption, idle time and imbalance, so no
schedule beats them. If round robin's makespan is within 20% of the bound, a 20%
reduction is impossible for any policy on that sample.

The samples are the held-out ones the RL evaluation uses (``routerd.rl.splits``, part
``eval``), so the figures hold for the same requests.

Usage: python benchmarks/makespan_bound.py [--workload public-mix] [--instances 4]
       [--rate 20] [--requests 1000] [--seeds 5] [--profile llama2-7b-v100]
"""

from __future__ import annotations

import argparse
import statistics

from routerd.policies.base import PolicyContext
from routerd.policies.registry import build_policy_from_spec
from routerd.profiles import HardwareProfile, ProfileError, get_profile
from routerd.rl import splits
from routerd.sim import ClusterSimulator, prepare_requests
from routerd.sim.report import summarize
from routerd.workloads import WorkloadError


def least_work_s(profile: HardwareProfile, prompt: int, output: int, *, overhead_by_kv: bool = False) -> float:
    """Least instance time (s) one request of ``prompt`` / ``output`` tokens costs (see module doc).

    ``overhead_by_kv`` charges the per-iteration overhead by KV-cache share (``W'_r``)
    instead of by batch slot (``W_r``)."""
    n = max(output - 1, 0)
    ctx = n * prompt + n * (n + 1) // 2
    attn = prompt * (prompt + 1) / 2 if profile.chunked_prefill else prompt * prompt
    if overhead_by_kv:
        overhead = profile.overhead_s * ctx / (profile.kv_capacity_tokens + profile.max_num_seqs)
    else:
        overhead = n * profile.overhead_s / profile.max_num_seqs
    return (profile.prefill_per_token_s * prompt + profile.prefill_attn_s * attn
            + n * profile.decode_per_seq_s + profile.decode_per_ctx_token_s * ctx + overhead)


def makespan_lower_bound(profile: HardwareProfile, m: int, requests, *, overhead_by_kv: bool | None = None) -> float:
    """Lower bound (s) on the makespan of ``requests`` (prepared SimRequests) on ``m`` instances.

    ``overhead_by_kv``: True or False for one charge of the overhead (module doc); None
    (default) for the larger, i.e. tighter, of the two."""
    if overhead_by_kv is None:
        return max(makespan_lower_bound(profile, m, requests, overhead_by_kv=k) for k in (False, True))
    return sum(least_work_s(profile, r.prompt, r.output, overhead_by_kv=overhead_by_kv) for r in requests) / m


def add_sample_arguments(ap: argparse.ArgumentParser) -> None:
    """--workload, --instances, --rate (req/s), --requests, --seeds, --profile: the held-out
    samples 0..N-1 of a workload's ``eval`` part (also used by ``queue_order.py``)."""
    ap.add_argument("--workload", default="public-mix")
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--rate", type=float, default=20.0, help="offered load (requests/s)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--seeds", type=int, default=5, help="held-out samples 0..N-1")
    ap.add_argument("--profile", default="llama2-7b-v100")


def check_sample_arguments(ap: argparse.ArgumentParser, a: argparse.Namespace) -> HardwareProfile:
    """The profile, after checking the options; a bad one exits with one line (status 2)."""
    if a.instances < 1 or a.seeds < 1 or a.requests < 1 or not a.rate > 0:
        ap.error("--instances, --seeds and --requests must be >= 1 and --rate > 0")
    try:
        prof = get_profile(a.profile)
        # Disjoint held-out windows: a trace's part holds only so many of --requests.
        n = splits.eval_requests(a.workload, a.requests, a.seeds)
        splits.sample(a.workload, "eval", a.seeds - 1, n, a.rate)
    except (ProfileError, WorkloadError, ValueError) as e:
        ap.exit(2, f"{ap.prog}: error: {e}\n")
    if note := splits.shrink_note(a.workload, a.requests, n, a.seeds):
        print(note)
    a.requests = n
    return prof


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sample_arguments(ap)
    ap.add_argument("--policies", default="round_robin;late_binding")
    a = ap.parse_args()
    prof = check_sample_arguments(ap, a)
    m = a.instances
    specs = [s for s in a.policies.split(";") if s]
    try:
        for spec in specs:
            build_policy_from_spec(spec, PolicyContext(prof, m, seed=0))
    except ValueError as e:  # PolicyError is a ValueError
        ap.exit(2, f"{ap.prog}: error: {e}\n")
    print(f"{a.workload}, {m} x {prof.name}, {a.requests} requests at {a.rate:g} req/s, held-out samples 0..{a.seeds - 1}")
    print(f"{'sample':>6s} {'by slot':>8s} {'by KV':>8s} {'bound s':>8s} " + " ".join(f"{s[:22]:>22s}" for s in specs)
          + "   (bounds with the overhead charged by batch slot / by KV share, the larger;"
          " makespan s, and bound / makespan)")
    ratios: dict[str, list[float]] = {s: [] for s in specs}
    for i in range(a.seeds):
        reqs = splits.sample(a.workload, "eval", i, a.requests, a.rate)
        prep = prepare_requests(reqs, prof, prediction="true", seed=i)
        by_slot = makespan_lower_bound(prof, m, prep.requests, overhead_by_kv=False)
        by_kv = makespan_lower_bound(prof, m, prep.requests, overhead_by_kv=True)
        bound = max(by_slot, by_kv)
        cells = []
        for spec in specs:
            run_reqs = prepare_requests(reqs, prof, prediction="true", seed=i).requests
            policy = build_policy_from_spec(spec, PolicyContext(prof, m, seed=i))
            mk = summarize(ClusterSimulator(prof, m, policy).run(run_reqs)).makespan
            ratios[spec].append(bound / mk)
            cells.append(f"{mk:9.1f} ({bound / mk:6.1%})")
        print(f"{i:6d} {by_slot:8.1f} {by_kv:8.1f} {bound:8.1f} " + " ".join(f"{c:>22s}" for c in cells))
    for spec in specs:
        r = ratios[spec]
        print(f"{spec}: the bound is {min(r):.1%}-{max(r):.1%} of its makespan (mean {statistics.mean(r):.1%}); "
              f"the largest possible reduction is {1 - max(r):.1%}-{1 - min(r):.1%}")


if __name__ == "__main__":
    main()
