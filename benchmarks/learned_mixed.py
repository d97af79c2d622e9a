"""Issue 18 on mixed pools: a speed-aware ``learned_linear``, trained by ES against ``predicted_latency``.

What it measures (one self-contained experiment; nothing in routerd is changed):

1. ``learned_mixed`` (:class:`LearnedMixed`, defined here): ``learned_linear``'s admission
   (``late_binding``'s: nothing waiting, a free sequence slot, KV headroom for the predicted
   footprint) and its 10 load features, plus :data:`SPEED_FEATURES` computed in closed form from
   each instance's *own* profile (``ctx.profiles[i]``, ``routerd/profiles.py``'s terms), from O(1)
   view aggregates (``load_summary``, ``pending_prefill_work``) and never from
   ``predicted_latency``'s forecast. For a request of ``p`` prompt and ``d`` predicted output
   tokens on an instance with ``B`` decodes whose prompts + predictions sum to ``S``:

   ===========  ===============================================================================
   ttft_n       ``k * (queued prefill tokens + p) + k_attn * (queued attended + p^2)``,
                ``k = prefill_per_token + t_dec / max_num_batched_tokens``,
                ``t_dec = overhead + decode_per_seq * B + decode_per_ctx_token * S``
   decode_n     ``d * (t_dec + decode_per_seq + decode_per_ctx_token * (p + d / 2))``
   interf_n     what it adds to the residents: ``B * (prefill_per_token * p + k_attn * p^2)``
                plus its per-step decode cost times the decode steps it shares with them
                (``sum_bins n_b * min(remaining_b, d)``, remaining 64 / 512 / 1536 tokens)
   lone_n       the request's :meth:`lone_request_time` on that profile (pure speed)
   ===========  ===============================================================================

   each divided by the lowest ``ttft + decode + interf`` among the admissible instances (so the
   best is about 1 and a weighted sum of them is a weighted cost in common seconds). Weights
   ``(0 x 10, 1, 1, 1, 0)`` pick the lowest estimated E2E + delay to others (``--start cost``,
   the default start); ``--start e2e`` is ``(0 x 10, 1, 1, 0, 0)``.
2. Training: evolution strategies (``routerd/rl/es.py``'s loop: antithetic pairs, common random
   numbers, fitness-spread-scaled step) on public-mix's *training* part only (sample ``seed *
   100,000 + generation * samples + j``), each sample rescaled to ``--load`` (1.5) times round
   robin's capacity on it and the pool; samples alternate between the ``--train-pools``. Fitness:
   mean E2E change (%) against ``predicted_latency`` on the same samples. Model selection on
   training-part indices 900,000+ (``--validate`` samples of ``--validate-requests``): the
   final weights are kept only if their mean change against ``predicted_latency`` is below the
   start weights' on the same samples.
3. Evaluation on public-mix's *held-out* part (``splits.sample(.., "eval", i, ..)``, indices
   ``--eval-seeds``, default 1-5: index 0 is ``benchmarks/mixed_pools.py``'s seed 0, the window
   ``predicted_latency``'s ``wait_for_kv`` was tuned on), both pools, loads 0.8x / 1.5x / 2x round
   robin's capacity, prediction ``true`` (the bucket of the true length, as mixed_pools.py and
   learned_eval.py): mean and p99 E2E of round_robin, late_binding, predicted_latency, the
   learned weights and the start weights; paired 95% t-intervals (``routerd.bench.paired_interval``)
   against ``predicted_latency`` and round robin.
4. Decision cost: thread CPU per ``pick`` (``time.thread_time_ns``), p50 / p99, of round_robin,
   predicted_latency and learned_mixed interleaved on the same views, 4 instances x
   ``--residents`` (32) residents: hand-made ``StaticInstanceView``s (``benchmarks/mixed_pools.py``'s
   construction: every aggregate is a scan of the residents there), and routerd's own views
   (``EndpointState``, O(1) aggregates, as ``benchmarks/learned_eval.py`` times ``learned_linear``).

    python benchmarks/learned_mixed.py --jobs 2 --seed 1              # train (~3 min on 2 cores), evaluate, time
    python benchmarks/learned_mixed.py --generations 0 --weights FILE  # evaluate saved weights
    python benchmarks/learned_mixed.py --skip-eval --generations 20     # training only

Weights and the full record go to ``--out`` (JSON, default ``bench-out/learned_mixed.json``).

Measured (2026-12-03, 2 cores, ``--jobs 2 --seed 1``, the defaults otherwise): training 185 s;
validation against ``predicted_latency`` start +0.13%, final +0.13%, so the start weights were
kept. Held-out, learned vs ``predicted_latency`` mean E2E: -0.1% [-0.4, +0.3] and -0.4% [-1.1,
+0.2] at 2x, 0.0% [-0.4, +0.4] and -0.2% [-0.8, +0.4] at 1.5x (A100+H100, V100+A100): a tie, not
the issue's -5%. Decision cost on routerd's views: p50 21 us, p99 27 us (``predicted_latency``
234 / 283 us). Why the target is out of reach for instance choice here: at these loads nothing
waits at the router (router wait 0, TTFT ~0.02 s, no preemptions), ``predicted_latency`` already
sends 97-100% of requests to the two fast instances, and what separates it from the lone-request
floor is batching on those (+24% to +47% at 1.5-2x), which no ES direction, weight scan, or even
exact output lengths given to ``predicted_latency`` (within +0.5%) reduced.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from multiprocessing import get_context
from pathlib import Path
from typing import Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # mixed_pools, prefix_decision_cost

from mixed_pools import bucket_request, static_views, time_picks  # noqa: E402
from routerd.bench import load_to_rate, paired_interval, policy_context, run_bench, run_policy
from routerd.policies.base import ClusterView, PolicyContext, PolicyParams, RequestFeatures, RoutingPolicy, pick_cheapest
from routerd.policies.kv_headroom import blocks_for, kv_deficit_blocks, outstanding_tokens, predicted_footprint_tokens
from routerd.policies.learned_linear import FEATURES, Params as LinearParams
from routerd.policies.predicted_latency import PredictedLatency
from routerd.prefix.index import pending_prefill_work
from routerd.profiles import ProfileError, parse_pool, pool_label
from routerd.rl import splits
from routerd.sim.capacity import round_robin_capacity
from routerd.sim.report import summarize
from routerd.workloads.traces import rescale_to_rate

SPEED_FEATURES = ("ttft_n", "decode_n", "interf_n", "lone_n")
ALL_FEATURES = FEATURES + SPEED_FEATURES
STARTS = {
    "cost": (0.0,) * len(FEATURES) + (1.0, 1.0, 1.0, 0.0),
    "e2e": (0.0,) * len(FEATURES) + (1.0, 1.0, 0.0, 0.0),
}
REMAINING_BY_BIN = (64.0, 512.0, 1536.0)
"""Typical predicted decode tokens still to run for a resident of each ``LoadSummary`` bin (<256,
256-2048, >2048): about half of each bin's typical prediction."""
POOLS = "2xllama3.1-8b-a100,2xllama3.1-8b-h100;2xllama2-7b-v100,2xllama2-7b-a100"
WORKLOAD = "public-mix"


class LearnedMixed(RoutingPolicy):
    """``learned_linear`` with per-instance speed features (module docstring): lowest ``w . x``
    among the instances that can admit the request without preempting; holds when none can."""

    name = "learned_mixed"
    Params = LinearParams
    params: LinearParams

    def __init__(self, ctx: PolicyContext, params: PolicyParams | None = None, *, weights: Sequence[float]) -> None:
        super().__init__(ctx, params)
        if len(weights) != len(ALL_FEATURES) or not all(math.isfinite(float(w)) for w in weights):
            raise ValueError(f"learned_mixed: {len(ALL_FEATURES)} finite weights needed, got {list(weights)}")
        self.weights = tuple(float(w) for w in weights)
        self._rng = random.Random(ctx.seed)
        # Per-instance profile constants, looked up once.
        self._k = [(q.overhead_s, q.prefill_per_token_s, q.prefill_attn_s, q.decode_per_seq_s,
                    q.decode_per_ctx_token_s, float(q.max_num_batched_tokens), q.max_num_seqs, q)
                   for q in ctx.profiles]

    def pick(self, request: RequestFeatures, view: ClusterView) -> int | None:
        p = self.params
        ctx = self.ctx
        prompt = request.prompt_tokens
        d = request.predicted_output_tokens
        need_tokens = predicted_footprint_tokens(prompt, d, ctx.profile.max_model_len)
        insts = view.instances
        outs = [outstanding_tokens(v) for v in insts]
        mean = sum(outs) / len(outs) if outs else 1.0
        if mean < 1.0:
            mean = 1.0
        w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, wt, wd, wi, wl = self.weights
        c_out = w0 / mean
        c_run = w1 / 32.0 + w8 * prompt / 1024.0 / 32.0
        c_wait = w2 / 8.0
        c_kv = w3 + w7 * d / 1024.0
        c_b0, c_b1, c_b2 = w4 / 32.0, w5 / 32.0, w6 / 32.0
        r0, r1, r2 = (min(r, d) for r in REMAINING_BY_BIN)
        n_dec = d - 1.0 if d > 1.0 else 0.0
        pp = float(prompt) * prompt
        cands = []
        best = math.inf
        ks = self._k
        for inst, out in zip(insts, outs):
            i = inst.index
            a, k_pf, k_attn, k_seq, k_ctx, budget, max_seqs, prof = ks[i] if 0 <= i < len(ks) else ks[0]
            if inst.num_waiting > p.max_waiting or inst.num_running + inst.num_waiting >= max_seqs:
                continue
            deficit = kv_deficit_blocks(inst, blocks_for(need_tokens, inst.block_size), p.reserve_fraction)
            if deficit > 0:
                continue
            s = inst.load_summary()
            bins = s.decode_bins
            B = bins[0] + bins[1] + bins[2]
            t_dec = a + k_seq * B + k_ctx * s.sum_prompt_and_predicted
            ppw = getattr(inst, "pending_prefill_work", None)
            if ppw is not None:
                q_tok, q_att = ppw()
            else:
                q_tok, q_att = pending_prefill_work(inst)
            own_step = k_seq + k_ctx * (prompt + 0.5 * d)
            ttft = (k_pf + t_dec / budget) * (q_tok + prompt) + k_attn * (q_att + pp)
            dec = d * (t_dec + own_step)
            interf = B * (k_pf * prompt + k_attn * pp) + own_step * (bins[0] * r0 + bins[1] * r1 + bins[2] * r2)
            lone = k_pf * prompt + k_attn * pp + n_dec * (a + k_seq + k_ctx * (prompt + 0.5 * n_dec))
            total = ttft + dec + interf
            if total < best:
                best = total
            total_blocks = inst.kv_total_blocks if inst.kv_total_blocks > 0 else 1
            base = (c_out * out + c_run * inst.num_running + c_wait * inst.num_waiting + c_kv * inst.kv_usage
                    + c_b0 * bins[0] + c_b1 * bins[1] + c_b2 * bins[2] - w9 * deficit / total_blocks)
            cands.append((base, wt * ttft + wd * dec + wi * interf + wl * lone, i))
        if not cands:
            return None
        scale = 1.0 / best if best > 0.0 else 1.0
        scored = []
        for base, speed, i in cands:
            score = base + speed * scale
            if score - score == 0.0:
                scored.append((score, i))
        if not scored:
            return None
        return pick_cheapest(scored, ctx.near_tie, self._rng)


# ---------------------------------------------------------------------------------------------
# Training (routerd/rl/es.py's loop, fitness against predicted_latency on mixed pools)

_A: argparse.Namespace | None = None
_POOLS: list = []
_SAMPLES: dict = {}


def train_sample(pool_i: int, part: str, index: int, n: int) -> list:
    key = (pool_i, part, index, n)
    if key not in _SAMPLES:
        pool = _POOLS[pool_i]
        reqs = splits.sample(WORKLOAD, part, index, n, 20.0, _A.data_dir)
        cap = round_robin_capacity(reqs, pool, len(pool))
        _SAMPLES[key] = rescale_to_rate(reqs, _A.load * cap)
    return _SAMPLES[key]


def mean_e2e(job) -> float:
    """Mean E2E (s) of predicted_latency (weights None) or learned_mixed on one sample (worker)."""
    weights, pool_i, part, index, n = job
    pool = _POOLS[pool_i]
    m = len(pool)
    ctx = policy_context(pool, m, seed=index)
    policy = PredictedLatency(ctx) if weights is None else LearnedMixed(ctx, weights=weights)
    run, _ = run_policy(pool, m, policy, train_sample(pool_i, part, index, n), prediction="true", seed=index)
    return summarize(run).e2e_mean


def change_pct(values, base) -> list[float]:
    return [100.0 * (v - b) / b for v, b in zip(values, base)]


def train(a: argparse.Namespace, start: tuple[float, ...]) -> dict:
    global _A
    _A = a
    t0 = time.perf_counter()
    rng = np.random.default_rng(a.seed)
    theta = np.array(start, dtype=float)
    npools = len(_POOLS)
    history = []
    with get_context("fork").Pool(a.jobs) as pool:
        for g in range(a.generations):
            idx = [a.seed * 100_000 + g * a.samples + j for j in range(a.samples)]
            pidx = [(g * a.samples + j) % npools for j in range(a.samples)]
            eps = rng.standard_normal((a.pairs, len(ALL_FEATURES)))
            cands = [theta + a.sigma * e for e in eps] + [theta - a.sigma * e for e in eps] + [theta]
            jobs = [(None, pi, "train", i, a.requests) for pi, i in zip(pidx, idx)]
            jobs += [(tuple(c), pi, "train", i, a.requests) for c in cands for pi, i in zip(pidx, idx)]
            res = pool.map(mean_e2e, jobs)
            base, runs = res[:a.samples], np.array(res[a.samples:]).reshape(len(cands), a.samples)
            fit = np.array([statistics.fmean(change_pct(r, base)) for r in runs])
            plus, minus = fit[:a.pairs], fit[a.pairs:2 * a.pairs]
            spread = float(np.std(fit[:2 * a.pairs])) + 1e-9
            theta = theta - a.learning_rate * ((plus - minus)[:, None] * eps).sum(0) / (a.pairs * a.sigma * spread)
            history.append({"generation": g, "centre_vs_predicted_latency_pct": float(fit[-1]),
                            "best_candidate_pct": float(fit[:-1].min())})
            print(f"generation {g:3d}: centre {fit[-1]:+.2f}% vs predicted_latency, best candidate "
                  f"{fit[:-1].min():+.2f}% ({time.perf_counter() - t0:.0f} s)", flush=True)
        vidx = [splits.VALIDATION_INDEX_BASE + i for i in range(a.validate)]
        vp = [i % npools for i in range(a.validate)]
        jobs = [(None, pi, "train", i, a.validate_requests) for pi, i in zip(vp, vidx)]
        jobs += [(tuple(start), pi, "train", i, a.validate_requests) for pi, i in zip(vp, vidx)]
        jobs += [(tuple(theta), pi, "train", i, a.validate_requests) for pi, i in zip(vp, vidx)]
        res = pool.map(mean_e2e, jobs) if a.validate else []
    k = a.validate
    base, vs, vf = res[:k], res[k:2 * k], res[2 * k:]
    d_start, d_final = change_pct(vs, base), change_pct(vf, base)
    m_start = statistics.fmean(d_start) if k else math.nan
    m_final = statistics.fmean(d_final) if k else math.nan
    keep = k > 0 and m_final < m_start
    secs = time.perf_counter() - t0
    print(f"trained in {secs:.0f} s ({a.generations} generations x {a.samples} samples x {2 * a.pairs + 2} runs "
          f"of {a.requests} requests); validation ({k} training-part samples 900,000+ of {a.validate_requests}) vs "
          f"predicted_latency: start {m_start:+.2f}%, final {m_final:+.2f}%; kept "
          f"{'final' if keep else 'start'} weights", flush=True)
    print("  per sample start: " + " ".join(f"{x:+.2f}" for x in d_start))
    print("  per sample final: " + " ".join(f"{x:+.2f}" for x in d_final))
    final = [float(x) for x in theta]
    print("  final weights: " + ", ".join(f"{n}={w:+.3f}" for n, w in zip(ALL_FEATURES, final)))
    return {"seconds": secs, "history": history, "start": list(start), "final": final,
            "validation": {"indices": vidx, "start_pct": d_start, "final_pct": d_final,
                           "start_mean_pct": m_start, "final_mean_pct": m_final},
            "chosen": final if keep else list(start), "selected": "final" if keep else "start"}


# ---------------------------------------------------------------------------------------------
# Evaluation and decision cost

def fmt(iv) -> str:
    return f"{iv.mean:+.1f}%" if iv.low is None else f"{iv.mean:+.1f}% [{iv.low:+.1f}, {iv.high:+.1f}]"


def eval_job(job):
    """All policies on one held-out sample, one pool and load (worker)."""
    pool_i, idx, n, load, weights = job
    pool = _POOLS[pool_i]
    m = len(pool)
    reqs = splits.sample(WORKLOAD, "eval", idx, n, 20.0, _A.data_dir)
    offered, cap, _ = load_to_rate(reqs, pool, m, load)
    b = run_bench(offered, pool, m, ["round_robin", "late_binding", "predicted_latency"], workload_name=WORKLOAD,
                  seed=idx)
    out = {r.spec: (r.summary.e2e_mean, r.summary.e2e_p99) for r in b.results}
    for name, w in weights.items():
        run, _ = run_policy(pool, m, LearnedMixed(policy_context(pool, m, seed=idx), weights=w), offered,
                            prediction="true", seed=idx)
        s = summarize(run)
        out[name] = (s.e2e_mean, s.e2e_p99)
    return pool_i, idx, load, cap, out


def evaluate(a: argparse.Namespace, weights: dict[str, Sequence[float]]) -> list[dict]:
    global _A
    _A = a
    seeds, loads = a.eval_seeds, a.loads  # lists (check_args)
    n = splits.eval_requests(WORKLOAD, a.eval_requests, len(seeds), a.data_dir)
    jobs = [(pi, i, n, L, weights) for pi in range(len(_POOLS)) for L in loads for i in seeds]
    t0 = time.perf_counter()
    with get_context("fork").Pool(a.jobs) as pool:
        res = pool.map(eval_job, jobs, chunksize=1)
    print(f"\nevaluation: {len(jobs)} (pool, load, sample) cells in {time.perf_counter() - t0:.0f} s; public-mix "
          f"held-out indices {seeds}, {n} requests each, prediction 'true'")
    rows = []
    names = ["round_robin", "late_binding", "predicted_latency"] + list(weights)
    for pi, pool in enumerate(_POOLS):
        for L in loads:
            cell = sorted((r for r in res if r[0] == pi and r[2] == L), key=lambda r: r[1])
            caps = [r[3] for r in cell]
            get = {s: ([r[4][s][0] for r in cell], [r[4][s][1] for r in cell]) for s in names}
            pl, rr = get["predicted_latency"], get["round_robin"]
            print(f"\n### {pool_label(pool)}, {L:g}x round robin's capacity (mean {statistics.fmean(caps):.2f} req/s)\n")
            print("| policy | mean E2E (s) | p99 E2E (s) | ΔE2E vs predicted_latency | Δp99 vs predicted_latency "
                  "| ΔE2E vs RR | Δp99 vs RR |")
            print("|---|---|---|---|---|---|---|")
            for s in names:
                e, p = get[s]
                ivs = (paired_interval(e, pl[0]), paired_interval(p, pl[1]), paired_interval(e, rr[0]),
                       paired_interval(p, rr[1]))
                print(f"| {s} | {statistics.fmean(e):.2f} | {statistics.fmean(p):.2f} | " + " | ".join(map(fmt, ivs)) + " |")
                rows.append({"pool": pool_label(pool), "load": L, "policy": s, "seeds": seeds, "requests": n,
                             "capacity_rps": caps, "e2e_mean": e, "e2e_p99": p,
                             "vs_predicted_latency_e2e_mean": ivs[0].as_dict(),
                             "vs_predicted_latency_e2e_p99": ivs[1].as_dict(),
                             "vs_round_robin_e2e_mean": ivs[2].as_dict(), "vs_round_robin_e2e_p99": ivs[3].as_dict()})
            sys.stdout.flush()
    return rows


def decision_cost(pool, residents: int, picks: int, weights: Sequence[float], seed: int = 0) -> dict:
    """:func:`time_picks` of round_robin, predicted_latency and learned_mixed on hand-made views
    (``benchmarks/mixed_pools.py``'s :func:`static_views`, whose aggregates are scans)."""
    from routerd.policies import build_policy

    rng = random.Random(seed)
    views = static_views(pool, residents, rng)
    ctx = PolicyContext(pool[0], len(pool), profiles=tuple(pool))
    pols = {name: build_policy(name, {}, ctx) for name in ("round_robin", "predicted_latency")}
    # The views hold waiting residents, so late_binding's admission (max_waiting 0) would hold every
    # request there; max_waiting=8 lets the learned policy score all instances (the priced path).
    pols["learned_mixed"] = LearnedMixed(ctx, LinearParams(max_waiting=8), weights=weights)

    return time_picks(pols, picks, lambda k: bucket_request(rng, k), lambda k: views[k % len(views)])


def decision_cost_routerd(pool, residents: int, picks: int, weights: Sequence[float], seed: int = 0) -> dict:
    """As :func:`decision_cost`, on routerd's own instance views (``routerd.daemon.state.EndpointState``,
    O(1) load aggregates, as a live decision reads them; ``benchmarks/prefix_decision_cost.py``'s
    ``views``, each instance with its own profile), 3 in 4 residents decoding."""
    from routerd.policies import build_policy
    from prefix_decision_cost import views

    view = ClusterView(0.0, views(list(pool), len(pool), residents, np.random.default_rng(seed)), 1)
    ctx = PolicyContext(pool[0], len(pool), seed=seed, profiles=tuple(pool))
    pols = {name: build_policy(name, {}, ctx) for name in ("round_robin", "predicted_latency")}
    pols["learned_mixed"] = LearnedMixed(ctx, weights=weights)
    pols["learned_mixed max_waiting=8"] = LearnedMixed(ctx, LinearParams(max_waiting=8), weights=weights)
    rng = random.Random(seed)
    return time_picks(pols, picks, lambda k: RequestFeatures(k, 0.0, rng.randint(20, 2000), 1, 400.0),
                      lambda k: view)


def check_args(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse settings that cannot run, one line each (``ap.error``, exit 2); turns ``--eval-seeds``
    and ``--loads`` into lists. Held-out seeds must differ: a repeated sample would count twice
    in the paired intervals."""
    if not 0 <= a.seed < 9:
        ap.error("--seed must be 0..8")
    try:
        a.eval_seeds = [int(x) for x in str(a.eval_seeds).split(",")]
    except ValueError:
        ap.error(f"--eval-seeds: ','-separated held-out sample indices, got {a.eval_seeds!r}")
    if min(a.eval_seeds) < 0 or len(set(a.eval_seeds)) != len(a.eval_seeds):
        ap.error(f"--eval-seeds: distinct indices >= 0, got {a.eval_seeds}")
    try:
        a.loads = [float(x) for x in str(a.loads).split(",")]
    except ValueError:
        ap.error(f"--loads: ','-separated multiples of round robin's capacity, got {a.loads!r}")
    for flag, v in [("--loads", x) for x in a.loads] + [("--load", a.load), ("--sigma", a.sigma)]:
        if not (math.isfinite(v) and v > 0):
            ap.error(f"{flag}: finite and > 0, got {v}")
    if not math.isfinite(a.learning_rate):
        ap.error(f"--learning-rate: finite, got {a.learning_rate}")
    for flag, v, low in (("--jobs", a.jobs, 1), ("--samples", a.samples, 1), ("--pairs", a.pairs, 1),
                         ("--requests", a.requests, 2), ("--validate-requests", a.validate_requests, 2),
                         ("--eval-requests", a.eval_requests, 2), ("--residents", a.residents, 1),
                         ("--generations", a.generations, 0), ("--validate", a.validate, 0), ("--picks", a.picks, 0)):
        if v < low:
            ap.error(f"{flag}: at least {low}, got {v}")


def main(argv: list[str] | None = None) -> int:
    global _POOLS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--pools", default=POOLS, help="';'-separated evaluation pools")
    ap.add_argument("--train-pools", default=POOLS, help="';'-separated training pools (samples alternate)")
    ap.add_argument("--start", default="cost", choices=sorted(STARTS), help="start weights")
    ap.add_argument("--weights", default=None, help="JSON file with 'chosen' weights: skip training, evaluate them")
    ap.add_argument("--load", type=float, default=1.5, help="training load (x round robin's capacity)")
    ap.add_argument("--requests", type=int, default=600, help="requests per training sample")
    ap.add_argument("--samples", type=int, default=6, help="training samples per generation")
    ap.add_argument("--generations", type=int, default=25)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--sigma", type=float, default=0.05)
    ap.add_argument("--learning-rate", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0, help="0..8 (training sample indices seed * 100,000 + ...)")
    ap.add_argument("--validate", type=int, default=6, help="validation samples (training part, 900,000+)")
    ap.add_argument("--validate-requests", type=int, default=1000)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--loads", default="0.8,1.5,2", help="evaluation loads")
    ap.add_argument("--eval-seeds", default="1,2,3,4,5", help="held-out sample indices (0: predicted_latency's tuning window)")
    ap.add_argument("--eval-requests", type=int, default=1000)
    ap.add_argument("--skip-eval", action="store_true")
    ap.add_argument("--picks", type=int, default=3000, help="timed picks per policy (0: skip)")
    ap.add_argument("--residents", type=int, default=32)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default="bench-out/learned_mixed.json")
    a = ap.parse_args(argv)
    check_args(ap, a)
    start = STARTS[a.start]
    pools: dict[str, list] = {}
    for flag, text in (("--pools", a.pools), ("--train-pools", a.train_pools)):
        try:
            pools[flag] = [parse_pool(p) for p in text.split(";") if p.strip()]
        except ProfileError as e:
            ap.error(f"{flag}: {e}")
        if not pools[flag]:
            ap.error(f"{flag}: no pool in {text!r}")
    record: dict = {"args": vars(a), "features": list(ALL_FEATURES)}
    if a.weights:
        try:
            doc = json.loads(Path(a.weights).read_text())
            raw = doc["training"]["chosen"] if "training" in doc else doc["chosen"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.error(f"--weights {a.weights}: not a weights file of this script ({type(e).__name__}: {e})")
        if not isinstance(raw, list) or len(raw) != len(ALL_FEATURES):
            ap.error(f"--weights {a.weights}: 'chosen' must be a list of {len(ALL_FEATURES)} numbers, got {str(raw)[:80]}")
        bad = [w for w in raw if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w)]
        if bad:
            ap.error(f"--weights {a.weights}: weights must be finite numbers, got {bad[:3]}")
        chosen = [float(w) for w in raw]
        record["training"] = {"loaded_from": a.weights, "chosen": chosen}
    elif a.generations > 0 or a.validate > 0:
        _POOLS = pools["--train-pools"]
        record["training"] = train(a, start)
        chosen = record["training"]["chosen"]
    else:
        chosen = list(start)
    _POOLS = pools["--pools"]
    if a.picks:
        cost = decision_cost(_POOLS[0], a.residents, a.picks, chosen)
        print(f"\ndecision cost, thread CPU per pick, {len(_POOLS[0])} instances ({pool_label(_POOLS[0])}) x "
              f"{a.residents} residents, {a.picks} picks each, interleaved:")
        for name, c in cost.items():
            print(f"  {name:18} p50 {c['p50_us']:8.1f} us   p99 {c['p99_us']:8.1f} us   "
                  f"({100 * c['dispatched']:.0f}% dispatched)")
        record["decision_cost"] = cost
        cost2 = decision_cost_routerd(_POOLS[0], a.residents, a.picks, chosen)
        print("decision cost on routerd's own views (EndpointState, O(1) aggregates), same pool and residents:")
        for name, c in cost2.items():
            print(f"  {name:28} p50 {c['p50_us']:8.1f} us   p99 {c['p99_us']:8.1f} us   "
                  f"({100 * c['dispatched']:.0f}% dispatched)")
        record["decision_cost_routerd_views"] = cost2
    if not a.skip_eval:
        record["evaluation"] = evaluate(a, {"learned_mixed": tuple(chosen), f"start_{a.start}": start})
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(record, indent=1))
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
