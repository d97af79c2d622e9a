"""Evolution strategies for ``learned_linear``'s weights, readable top to bottom.

Why not per-decision credit: one routing decision moves a whole sample's mean E2E by up to
+-3%, chaotically (``benchmarks/rollout_advantage.py``, docs/rl.md), so the Double DQN's and a
rollout regressor's per-decision targets are mostly noise. ES scores a policy by what is reported,
the mean E2E of whole samples, and needs no gradient through the simulator (Salimans et al. 2017,
"Evolution Strategies as a Scalable Alternative to Reinforcement Learning", arXiv 1703.03864).

The loop (``python -m routerd.rl.es``; :class:`ESArgs` holds every setting):

1. Start at ``late_binding``'s weights (:data:`LATE_BINDING_WEIGHTS`): learn from the best
   heuristic's decisions first, then improve on them.
2. Each generation draws ``samples`` fresh samples of the workload's *training* part
   (``routerd.rl.splits``; sample ``seed * 100,000 + generation * samples + j``), each rescaled to
   ``load`` times round robin's capacity on it (``routerd.sim.capacity``), and simulates on every
   one of them ``late_binding`` (the baseline), the centre ``theta`` and ``pairs`` antithetic
   pairs ``theta +- sigma * eps`` (common random numbers: the same requests, lengths and
   predictions for all).
3. Each candidate's fitness is its mean E2E change against ``late_binding`` on the same samples
   (%, lower is better); the step is ``theta -= lr * sum_k (F(+k) - F(-k)) eps_k / (pairs * sigma
   * std(F))`` (antithetic estimator, scaled by the fitnesses' spread so the step size does not
   depend on the load).
4. After ``generations``, model selection on ``validate`` samples of the training part never
   trained on (indices 900,000+, ``validate_requests`` each): the final ``theta`` against
   ``late_binding`` on the same samples. ``theta`` is kept only if its mean change is below 0,
   else the checkpoint holds ``late_binding``'s weights and says so (``selected``).

Everything is seeded (``numpy.random.default_rng(seed)``; the simulator is deterministic per
sample), so a run is reproducible. Cost: ``generations * samples * (2 * pairs + 2)`` simulations
of ``requests`` requests and ``2 * validate`` of ``validate_requests``, spread over ``jobs``
processes. Every setting, the output folder included, is checked before the first simulation.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from routerd.policies.base import PolicyContext
from routerd.policies.kv_headroom import LateBinding
from routerd.policies.learned_linear import FEATURES, LATE_BINDING_WEIGHTS, LearnedLinear, save_linear_checkpoint
from routerd.profiles import get_profile
from routerd.rl import splits
from routerd.sim import ClusterSimulator, prepare_requests
from routerd.sim.capacity import round_robin_capacity
from routerd.sim.report import summarize
from routerd.workloads.traces import rescale_to_rate

VALIDATE_INDEX_BASE = splits.VALIDATION_INDEX_BASE


@dataclass
class ESArgs:
    """Everything a training run depends on (recorded in the checkpoint)."""

    profile: str = "llama2-7b-v100"
    instances: int = 4
    workload: str = "public-mix"
    load: float = 1.5
    """Offered load as a multiple of round robin's capacity on each sample."""
    requests: int = 400
    """Requests per training sample."""
    samples: int = 4
    """Fresh training samples per generation."""
    generations: int = 40
    pairs: int = 6
    """Antithetic pairs per generation."""
    sigma: float = 0.15
    """Perturbation scale (the features are scaled to about 0..1)."""
    learning_rate: float = 0.08
    seed: int = 0
    validate: int = 6
    validate_requests: int = 1000
    jobs: int = 2
    output: str = "checkpoints/linear"
    data_dir: str | None = None


_ARGS: ESArgs | None = None  # the run's settings, for the worker processes (fork)
_SAMPLES: dict[tuple[str, int, int], list] = {}


def workload_sample(args: ESArgs, part: str, index: int, n: int) -> list:
    """Sample ``index`` of ``part``, ``n`` requests at ``args.load`` times round robin's capacity on it."""
    reqs = splits.sample(args.workload, part, index, n, 20.0, args.data_dir)
    cap = round_robin_capacity(reqs, get_profile(args.profile), args.instances)
    return rescale_to_rate(reqs, args.load * cap)


def mean_e2e(job: tuple[Sequence[float] | None, str, int, int]) -> float:
    """Mean E2E (s) of ``late_binding`` (weights None) or ``learned_linear`` with the weights on
    one sample (worker side; samples are built once per process)."""
    weights, part, index, n = job
    args = _ARGS
    key = (part, index, n)
    if key not in _SAMPLES:
        _SAMPLES[key] = workload_sample(args, part, index, n)
    prof = get_profile(args.profile)
    ctx = PolicyContext(prof, args.instances, seed=index)
    policy = LateBinding(ctx) if weights is None else LearnedLinear(ctx, weights=weights)
    prep = prepare_requests(_SAMPLES[key], prof, prediction="true", seed=index)
    return summarize(ClusterSimulator(prof, args.instances, policy).run(prep.requests)).e2e_mean


def change_pct(values: Sequence[float], base: Sequence[float]) -> list[float]:
    return [100.0 * (v - b) / b for v, b in zip(values, base)]


def train_es(args: ESArgs, log: Callable[[str], None] = print) -> Path:
    """Run the loop of the module docstring and write ``linear.json`` into ``args.output``.

    Raises:
        ValueError: a setting out of range; routerd.profiles.ProfileError;
            routerd.workloads.WorkloadError (checked before any simulation).
    """
    global _ARGS
    for name in ("instances", "requests", "samples", "generations", "pairs", "validate", "validate_requests", "jobs"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(args, name)}")
    for name in ("load", "sigma", "learning_rate"):
        v = getattr(args, name)
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {v}")
    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out}: exists and is not a folder")
    parent = next((p for p in (out, *out.parents) if p.exists()), Path("."))
    if not (parent.is_dir() and os.access(parent, os.W_OK)):
        raise ValueError(f"output {out}: cannot be created ({parent} is not a writable folder)")
    if not 0 <= args.seed < 9:
        raise ValueError(f"seed must be 0..8 (sample indices seed * 100,000 + ... stay below the validation "
                         f"samples' 900,000), got {args.seed}")
    get_profile(args.profile)
    # Fail now, not after training: the workload, and samples as long as training and validation need.
    splits.sample(args.workload, "train", 0, args.requests, 20.0, args.data_dir)
    splits.sample(args.workload, "train", VALIDATE_INDEX_BASE, args.validate_requests, 20.0, args.data_dir)
    _ARGS = args
    _SAMPLES.clear()
    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    theta = np.array(LATE_BINDING_WEIGHTS, dtype=float)
    history = []
    with get_context("fork").Pool(args.jobs) as pool:
        for g in range(args.generations):
            idx = [args.seed * 100_000 + g * args.samples + j for j in range(args.samples)]
            eps = rng.standard_normal((args.pairs, len(FEATURES)))
            cands = [theta + args.sigma * e for e in eps] + [theta - args.sigma * e for e in eps] + [theta]
            jobs = [(None, "train", i, args.requests) for i in idx]
            jobs += [(tuple(c), "train", i, args.requests) for c in cands for i in idx]
            res = pool.map(mean_e2e, jobs)
            base, runs = res[:args.samples], np.array(res[args.samples:]).reshape(len(cands), args.samples)
            fit = np.array([statistics.fmean(change_pct(r, base)) for r in runs])
            plus, minus = fit[:args.pairs], fit[args.pairs:2 * args.pairs]
            spread = float(np.std(fit[:2 * args.pairs])) + 1e-9
            theta = theta - args.learning_rate * ((plus - minus)[:, None] * eps).sum(0) / (args.pairs * args.sigma * spread)
            history.append({"generation": g, "centre_vs_late_binding_pct": float(fit[-1]),
                            "best_vs_late_binding_pct": float(fit[:-1].min())})
            log(f"generation {g:3d}: centre {fit[-1]:+.2f}% vs late_binding, best candidate {fit[:-1].min():+.2f}% "
                f"({time.perf_counter() - t0:.0f} s)")
        vidx = [VALIDATE_INDEX_BASE + i for i in range(args.validate)]
        res = pool.map(mean_e2e, [(None, "train", i, args.validate_requests) for i in vidx]
                       + [(tuple(theta), "train", i, args.validate_requests) for i in vidx])
    base, learned = res[:args.validate], res[args.validate:]
    d = change_pct(learned, base)
    keep = statistics.fmean(d) < 0.0
    weights = tuple(float(x) for x in theta) if keep else LATE_BINDING_WEIGHTS
    train_s = time.perf_counter() - t0
    meta = {
        "profile": args.profile, "num_instances": args.instances,
        "workload": {"name": args.workload, "part": "train", "requests": args.requests, "load": args.load},
        "hyperparameters": {k: v for k, v in asdict(args).items() if k not in ("output", "data_dir", "jobs")},
        "training": {"seconds": train_s, "history": history, "final_weights": [float(x) for x in theta],
                     "selected": "learned" if keep else "late_binding (the learned weights did not validate better)"},
        "validation": {"samples": vidx, "requests": args.validate_requests, "vs_late_binding_pct": d,
                       "mean_vs_late_binding_pct": statistics.fmean(d)},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    path = save_linear_checkpoint(args.output, weights, meta)
    log(f"trained in {train_s:.0f} s; validation vs late_binding {statistics.fmean(d):+.2f}% "
        f"(per sample {' '.join(f'{x:+.2f}' for x in d)}); kept {meta['training']['selected']}; wrote {path}")
    return path


#: Each :class:`ESArgs` field's help on the command line.
HELP = {
    "profile": "every instance's hardware profile (a shipped name or a YAML path)",
    "instances": "instances in the simulated pool",
    "workload": "training workload (its training part only, routerd.rl.splits)",
    "load": "offered load as a multiple of round robin's capacity on each sample",
    "requests": "requests per training sample",
    "samples": "fresh training samples per generation",
    "generations": "ES generations",
    "pairs": "antithetic pairs per generation",
    "sigma": "perturbation scale (the features are scaled to about 0..1)",
    "learning_rate": "step size",
    "seed": "random seed, 0..8 (sample indices and perturbations)",
    "validate": "validation samples (training part, never trained on) for model selection",
    "validate_requests": "requests per validation sample",
    "jobs": "worker processes",
    "output": "folder to write linear.json into",
    "data_dir": "folder with traces/ (default ../shared/data)",
}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """Every :class:`ESArgs` field as ``--field-name`` with its default (``python -m routerd.rl.es``
    and ``phasewise train-linear``)."""
    for name, value in asdict(ESArgs()).items():
        kind = type(value) if value is not None else str
        ap.add_argument("--" + name.replace("_", "-"), type=kind, default=value,
                        help=f"{HELP[name]} (default: {value})")


def main(argv: list[str] | None = None) -> int:
    """``python -m routerd.rl.es``: every :class:`ESArgs` field as ``--field-name``."""
    ap = argparse.ArgumentParser(prog="python -m routerd.rl.es", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    a = ap.parse_args(argv)
    try:
        train_es(ESArgs(**vars(a)))
    except ValueError as e:  # ProfileError and WorkloadError are ValueErrors too
        ap.error(str(e).splitlines()[0])
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
