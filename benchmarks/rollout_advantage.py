"""How much one routing decision is worth: exact paired advantages of one-decision deviations
from a heuristic, and whether a model fitted on them improves the heuristic (issue 18).

The simulator is deterministic for a seed, so re-running a sample with decision ``k`` forced to
another action and every other decision the heuristic's gives that deviation's exact effect on
the sample's mean E2E, with common random numbers (the same arrivals, lengths and predictions):
the advantage that rollout-based policy improvement (Bertsekas' rollout algorithm;
classification-based approximate policy iteration, Lagoudakis & Parr, ICML 2003) learns from.
The heuristic is asked at every decision, the forced one included, so its own state (a seeded
tie-break generator) moves as in the undisturbed run.

Part 1 (always): ``--episodes`` samples of the workload's *training* part
(``routerd.rl.splits``; generators use seeds >= 1,000,000), each at ``--load`` times round robin's
capacity on that sample (``routerd.sim.capacity``); ``--states`` decisions drawn per sample among
those where the heuristic dispatches; every other instance forced there. Printed: the
distribution over states of the best deviation's change of mean E2E (%), and of every
deviation's.

Part 2 (``--fit``, needs scikit-learn: ``pip install -e '.[predictor-train]'``): a gradient-boosted
regressor maps per-instance features (the request's prompt and predicted output, the router
queue, the instance's running, waiting, KV usage, KV deficit for the request, decode bins,
outstanding tokens relative to the mean, and whether the heuristic chose it) to that instance's
advantage; the improved policy takes the heuristic's action unless the model predicts another
instance better by more than ``tau`` percent. Validated on ``--validate`` samples of the training
part never labelled (indices 900,000+), against the heuristic on the same sample, for each tau.

Measured (2026-12-03, ``--episodes 40 --states 60 --fit``, 12 min on 2 cores: 4 x llama2-7b-v100,
public-mix, late_binding, 1.5x): over 7,200 one-decision deviations the sample's mean E2E moved
by -2.74% to +3.82% (10th-90th percentile -0.73% to +0.87%); at 73% of the 2,400 decisions some
other instance was better, by 0.17% at the median decision. The fitted policy (training
correlation 0.60) changed mean E2E by -0.00% [-0.61, +0.60] (tau 0, deviating at 55% of
decisions), +0.47% [-0.38, +1.33], +0.87% [+0.19, +1.55] and +0.78% [+0.25, +1.30] (tau 0.1, 0.2,
0.4) on 6 validation samples of 1,000 requests: no gain. One decision's effect is as large as
the gains sought, and the state does not predict it well enough to act on.

Usage: python benchmarks/rollout_advantage.py [--profile llama2-7b-v100] [--instances 4]
       [--workload public-mix] [--load 1.5] [--requests 400] [--episodes 8] [--states 30]
       [--heuristic late_binding] [--fit --validate 6 --validate-requests 1000] [--jobs 2]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from multiprocessing import get_context
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "routerd"))

from routerd.bench import paired_interval  # noqa: E402
from routerd.policies.base import ClusterView, PolicyContext, RequestFeatures  # noqa: E402
from routerd.policies.kv_headroom import (  # noqa: E402
    blocks_for,
    kv_deficit_blocks,
    outstanding_tokens,
    predicted_footprint_tokens,
)
from routerd.policies.registry import PolicyError, build_policy_from_spec  # noqa: E402
from routerd.profiles import ProfileError, get_profile  # noqa: E402
from routerd.rl import splits  # noqa: E402
from routerd.sim import ClusterSimulator, prepare_requests  # noqa: E402
from routerd.sim.capacity import round_robin_capacity  # noqa: E402
from routerd.sim.report import summarize  # noqa: E402
from routerd.workloads.errors import WorkloadError  # noqa: E402
from routerd.workloads.traces import rescale_to_rate  # noqa: E402

VALIDATE_INDEX_BASE = splits.VALIDATION_INDEX_BASE  # never a labelled sample
A: argparse.Namespace  # the parsed arguments, read by the worker processes (fork)


def features(f: RequestFeatures, view: ClusterView, chosen: int) -> np.ndarray:
    """Per-instance rows (float32, shape ``(m, 12)``) for deciding on ``f``; ``chosen`` is the
    heuristic's view position (-1: it holds)."""
    prof = get_profile(A.profile)
    need = blocks_for(predicted_footprint_tokens(f.prompt_tokens, f.predicted_output_tokens, prof.max_model_len),
                      prof.block_size)
    out = [outstanding_tokens(v) for v in view.instances]
    mean = max(1.0, float(np.mean(out)))
    rows = []
    for i, (v, o) in enumerate(zip(view.instances, out)):
        b = v.load_summary().decode_bins
        rows.append([f.prompt_tokens / 1024, f.predicted_output_tokens / 1024, view.queue_len / 32,
                     v.num_running / 32, v.num_waiting / 8, v.kv_usage,
                     kv_deficit_blocks(v, need, 0.05) / max(1, need) / 10, b[0] / 32, b[1] / 32, b[2] / 32,
                     o / mean, 1.0 if i == chosen else 0.0])
    return np.asarray(rows, np.float32)


class Deviating:
    """The heuristic, asked at every decision; decision ``force_at`` (0-based) forced to view
    position ``force_to``; with ``model``, the improved policy (module docstring)."""

    def __init__(self, ctx: PolicyContext, force_at: int = -1, force_to: int | None = None, *,
                 record: bool = False, model=None, tau: float = 0.0) -> None:
        self.h = build_policy_from_spec(A.heuristic, ctx)
        self.force_at, self.force_to, self.record, self.model, self.tau = force_at, force_to, record, model, tau
        self.decisions = 0
        self.deviations = 0
        self.states: list[tuple[np.ndarray, int]] = []

    def __getattr__(self, name):  # the simulator's callbacks (on_complete, ...) go to the heuristic
        return getattr(self.h, name)

    def pick(self, f: RequestFeatures, view: ClusterView) -> int | None:
        choice = self.h.pick(f, view)
        pos = -1 if choice is None else [v.index for v in view.instances].index(choice)
        if self.record or self.model is not None:
            x = features(f, view, pos)
            if self.record:
                self.states.append((x, pos))
            if self.model is not None and pos >= 0:
                pred = self.model.predict(x)
                j = int(np.argmin(pred))
                if j != pos and pred[j] - pred[pos] < -self.tau:
                    choice = view.instances[j].index
                    self.deviations += 1
        if self.decisions == self.force_at:
            choice = None if self.force_to is None else view.instances[self.force_to].index
        self.decisions += 1
        return choice


def sample(part: str, index: int, n: int) -> list:
    """Sample ``index`` of ``part``, at ``--load`` times round robin's capacity on it."""
    reqs = splits.sample(A.workload, part, index, n, 20.0, A.data_dir)
    cap = round_robin_capacity(reqs, get_profile(A.profile), A.instances)
    return rescale_to_rate(reqs, A.load * cap)


def e2e_mean(reqs: list, policy: Deviating) -> float:
    prof = get_profile(A.profile)
    prep = prepare_requests(reqs, prof, prediction="true", seed=0)
    return summarize(ClusterSimulator(prof, A.instances, policy).run(prep.requests)).e2e_mean


def ctx() -> PolicyContext:
    return PolicyContext(get_profile(A.profile), A.instances, seed=0)


def label(index: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(features, advantages %)`` of ``--states`` decisions of training sample ``index``."""
    reqs = sample("train", index, A.requests)
    base_policy = Deviating(ctx(), record=True)
    base = e2e_mean(reqs, base_policy)
    rng = random.Random(index)
    ks = [k for k in rng.sample(range(base_policy.decisions), min(A.states, base_policy.decisions))
          if base_policy.states[k][1] >= 0]
    out = []
    for k in ks:
        x, pos = base_policy.states[k]
        y = np.zeros(A.instances, np.float32)
        for a in range(A.instances):
            if a != pos:
                y[a] = 100.0 * (e2e_mean(reqs, Deviating(ctx(), k, a)) - base) / base
        out.append((x, y))
    return out


MODEL = None


def validate(job: tuple[int, float]) -> tuple[float, float, float]:
    """(the improved policy's mean E2E, the heuristic's (s), the share of decisions it changed)."""
    index, tau = job
    reqs = sample("train", index, A.validate_requests)
    base = e2e_mean(reqs, Deviating(ctx()))
    improved = Deviating(ctx(), model=MODEL, tau=tau)
    return e2e_mean(reqs, improved), base, improved.deviations / max(1, improved.decisions)


def main() -> int:
    global A, MODEL
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--profile", default="llama2-7b-v100", help="hardware profile of every instance")
    ap.add_argument("--instances", type=int, default=4, help="instances in the pool")
    ap.add_argument("--workload", default="public-mix", help="workload (its training part only)")
    ap.add_argument("--load", type=float, default=1.5, help="multiple of round robin's capacity")
    ap.add_argument("--requests", type=int, default=400, help="requests per labelled sample")
    ap.add_argument("--episodes", type=int, default=8, help="labelled training samples")
    ap.add_argument("--states", type=int, default=30, help="decisions drawn per labelled sample")
    ap.add_argument("--heuristic", default="late_binding", help="policy spec whose decisions are deviated from")
    ap.add_argument("--fit", action="store_true", help="fit the improved policy and validate it (scikit-learn)")
    ap.add_argument("--validate", type=int, default=6, help="validation samples (training part, unlabelled)")
    ap.add_argument("--validate-requests", type=int, default=1000, help="requests per validation sample")
    ap.add_argument("--taus", default="0,0.1,0.2,0.4", help="predicted advantage (%%) needed to deviate")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--data-dir", default=None, help="folder with traces/ (default: ../shared/data)")
    A = ap.parse_args()
    for name in ("instances", "requests", "episodes", "states", "validate", "validate_requests", "jobs"):
        if getattr(A, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: at least 1, got {getattr(A, name)}")
    if not A.load > 0:
        ap.error(f"--load: a number > 0, got {A.load}")
    try:
        get_profile(A.profile)
        build_policy_from_spec(A.heuristic, ctx())
        splits.sample(A.workload, "train", 0, A.requests, 20.0, A.data_dir)
        taus = [float(t) for t in A.taus.split(",")]
    except (ProfileError, PolicyError, WorkloadError, ValueError) as e:
        ap.error(str(e).splitlines()[0])
    if A.fit:
        try:
            from sklearn.ensemble import HistGradientBoostingRegressor
        except ImportError:
            ap.error("--fit needs scikit-learn: pip install -e '.[predictor-train]'")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # scikit-learn's OpenMP pool and fork do not mix
    t0 = time.perf_counter()
    with get_context("fork").Pool(A.jobs) as pool:
        labelled = [s for ep in pool.map(label, range(A.episodes)) for s in ep]
    X = np.stack([x for x, _ in labelled])
    Y = np.stack([y for _, y in labelled])
    best = Y.min(axis=1)
    devs = np.concatenate([np.delete(y, int(np.argmax(x[:, -1]))) for x, y in labelled])
    q = (0, 10, 25, 50, 75, 90, 100)
    print(f"{A.heuristic} on {A.instances} x {A.profile}, {A.workload} at {A.load}x round robin's capacity: "
          f"{len(labelled)} decisions (up to {A.states} from each of {A.episodes} samples of {A.requests} requests), "
          f"{len(devs)} deviations simulated ({time.perf_counter() - t0:.0f} s); negative = lower mean E2E than "
          f"{A.heuristic}'s own run")
    print("every deviation, change of the sample's mean E2E (%), percentiles " + str(q) + ": "
          + " ".join(f"{v:+.2f}" for v in np.percentile(devs, q)))
    print("best deviation per decision (%): " + " ".join(f"{v:+.2f}" for v in np.percentile(best, q))
          + f"; the heuristic's action is best at {100.0 * float(np.mean(best >= 0)):.0f}% of decisions")
    if not A.fit:
        return 0
    rows, ys = X.reshape(-1, X.shape[-1]), Y.reshape(-1)
    MODEL = HistGradientBoostingRegressor(max_iter=300, learning_rate=0.05, max_leaf_nodes=15,
                                          random_state=0).fit(rows, ys)
    r = float(np.corrcoef(MODEL.predict(rows), ys)[0, 1])
    print(f"fitted on {len(rows)} instance rows; training correlation {r:.2f}")
    for tau in taus:
        with get_context("fork").Pool(A.jobs) as pool:
            res = pool.map(validate, [(VALIDATE_INDEX_BASE + i, tau) for i in range(A.validate)])
        iv = paired_interval([e for e, _, _ in res], [b for _, b, _ in res])
        span = "" if iv.low is None else f" [{iv.low:+.2f}, {iv.high:+.2f}]"
        print(f"tau {tau:g}: mean E2E vs {A.heuristic} {iv.mean:+.2f}%{span} (geometric mean, paired 95% t-interval on log ratios; per sample "
              + " ".join(f"{v:+.2f}" for v in iv.diffs) + f"); deviates at {100 * np.mean([r[2] for r in res]):.1f}% "
              "of decisions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
