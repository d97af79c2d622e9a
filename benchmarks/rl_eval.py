"""Evaluation protocol of the RL router (issue #3, deliverable 5): held-out samples, seeds, 95% intervals.

What it measures. For each *setting* (a workload on ``m`` instances of ``--profile``,
default ``llama2-7b-v100``) and each policy, the simulator is run on ``--seeds``
held-out workload samples (``routerd.rl.splits.sample(workload, "eval", i, n, rate)``
for i = 0 .. seeds-1: generators use seeds 0, 1, ...; traces use windows of their last
40%; training never sees either). Per setting and policy it reports the mean over
samples and a 95% Student-t confidence interval of

* mean E2E latency (s), p99 E2E latency (s), makespan (s), preemptions (count, summed
  over instances) and mean router wait (s) (``routerd.sim.report.summarize``);
* the paired change of mean E2E and of makespan against round robin on the same sample
  (%, negative = better), i.e. the interval of the per-sample differences.

Settings (``--settings``, ``--instances``; default all three workloads on 4 and 8):

* ``public-mix`` at the paper's regime: 5 req/s per instance (4 instances at 20 req/s,
  8 at 40 req/s, arXiv 2408.13510 §6);
* ``azure-conv`` and ``azure-code`` (Azure LLM inference 2023): each held-out window is
  rescaled so that offered load / capacity equals public-mix's at the paper rate for the
  same ``m``. Capacity is round robin's saturated throughput (req/s over the makespan of
  the sample offered at 1,000 req/s), measured in the same run exactly as
  ``benchmarks/policy_table.py`` does, per sample; the load of public-mix is the mean of
  its per-sample ratios. The rates used are printed;
* ``paper-mix`` (synthetic, no data files) runs at the paper rate like public-mix; it is
  not in the default list (it exists for fast checks).

Policies: round_robin, join_shortest_queue, max_capacity_usage, min_min, mixing_penalty
and late_binding (the best heuristic of the foundation issue, ``routerd.rl.train.
BEST_HEURISTIC``), or ``--policies``; plus one ``dqn`` row per ``--checkpoint
LABEL=DIR[,DIR...]``. Several folders under one label are training seeds of one recipe:
in a setting with ``m`` instances, the folders trained for ``m`` are used in the order
given and held-out sample ``i`` is routed by folder ``i mod k``. With 5 samples and 5
seeds each row's interval thus spans both training seeds and workload samples, and
stays paired with round robin on the same sample. ``--table-dir DIR`` adds every
``<recipe>-<variant>-m<M>-s<SEED>`` folder of ``benchmarks/rl_train_table.py`` under the
label ``<recipe> <variant>``, seeds in increasing order.
A label with no folder for a setting's instance count is skipped there (with a note).
A checkpoint trained on a workload is evaluated on that workload's held-out part, which
never overlaps its training part (``routerd.rl.splits``); the other workloads test it
on traffic it was not trained on.

Usage:
    PYTHONPATH=routerd python benchmarks/rl_eval.py [--seeds 5] [--requests 1000]
        [--settings public-mix,azure-conv,azure-code] [--instances 4,8]
        [--checkpoint baseline=ckpts/b --checkpoint workload-guided=ckpts/g1,ckpts/g2 ...]
        [--table-dir ckpts]
        [--prediction true] [--out rl-eval.json] [--quick]

``--quick`` = 2 seeds, 300 requests, public-mix on 4 instances (explicit flags win).

Runtime measured (2 CPU cores, one used; heuristics only, no checkpoints): the default run
(5 seeds x 1,000 requests x 6 settings x 6 policies, 240 simulations) took 122 s;
``--quick`` took 4 s.
A DQN checkpoint costs about as much as one heuristic (a random 4-instance network added 1 s to ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from routerd.bench import pct
from routerd.policies.base import PolicyContext
from routerd.policies.dqn.checkpoint import CheckpointError, load_checkpoint
from routerd.policies.dqn.policy import DQNPolicy
from routerd.policies.registry import PolicyError, build_policy_from_spec
from routerd.profiles import ProfileError, get_profile
from routerd.rl import splits
from routerd.rl.recipes import RUN_NAME
from routerd.sim import ClusterSimulator, prepare_requests
from routerd.sim.prepare import PredictionError, parse_prediction
from routerd.sim.capacity import round_robin_capacity
from routerd.sim.report import summarize
from routerd.workloads.errors import WorkloadError
from routerd.workloads.traces import rescale_to_rate

BEST_HEURISTIC = "late_binding"
"""Same value as ``routerd.rl.train.BEST_HEURISTIC`` (not imported: that module pulls in
the trainer; a test checks the two agree)."""
HEURISTICS = ("round_robin", "join_shortest_queue", "max_capacity_usage", "min_min", "mixing_penalty",
              BEST_HEURISTIC)
WORKLOADS = ("public-mix", "azure-conv", "azure-code", "paper-mix")
DEFAULT_SETTINGS = ("public-mix", "azure-conv", "azure-code")
GENERATORS = splits.GENERATORS
PAPER_RATE_PER_INSTANCE = 5.0
"""Offered req/s per instance of the paper's regime: 20 req/s on 4 V100s (arXiv 2408.13510 §6);
8 instances get 40 req/s."""
METRICS = ("e2e_mean", "e2e_p99", "makespan", "preemptions", "router_wait_mean")
CHANGES = ("e2e_mean_change_pct", "makespan_change_pct")

# Two-sided 95% Student-t quantiles t_{0.975, df} for df = 1..30, from the NIST/SEMATECH
# e-Handbook of Statistical Methods, table 1.3.6.7.2 "Critical values of the Student's t
# distribution" (column 0.975). Beyond 30 the normal quantile 1.96 is used, which is at
# most 4% narrower than the t interval (t_{0.975,31} = 2.040).
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
        2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
        2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


class UsageError(ValueError):
    """Bad command-line input (one line; the script exits with status 2)."""


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (table above)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return T975[df - 1] if df <= len(T975) else 1.96


@dataclass(frozen=True)
class Interval:
    """Mean of a sample and the half-width of its 95% confidence interval (same units)."""

    mean: float
    half_width: float

    def as_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "half_width": self.half_width,
                "low": self.mean - self.half_width, "high": self.mean + self.half_width}


def interval(values: Sequence[float]) -> Interval:
    """Mean and 95% half-width ``t_{0.975, n-1} * s / sqrt(n)`` (s: sample standard deviation).

    Raises:
        ValueError: fewer than 2 values (no interval exists).
    """
    n = len(values)
    if n < 2:
        raise ValueError(f"an interval needs at least 2 values, got {n}")
    return Interval(statistics.fmean(values), t_quantile_975(n - 1) * statistics.stdev(values) / math.sqrt(n))


def paired_change_pct(values: Sequence[float], base: Sequence[float]) -> list[float]:
    """Per-sample change of ``values[i]`` against ``base[i]`` in % (negative = lower)."""
    if len(values) != len(base):
        raise ValueError(f"paired samples differ in length: {len(values)} vs {len(base)}")
    return [pct(v, b) for v, b in zip(values, base)]


def _split_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=None, help="held-out samples per setting (default 5; >= 2)")
    ap.add_argument("--requests", type=int, default=None, help="requests per sample (default 1000)")
    ap.add_argument("--settings", default=None, help=f"comma list of {', '.join(WORKLOADS)} "
                                                     f"(default {','.join(DEFAULT_SETTINGS)})")
    ap.add_argument("--instances", default=None, help="comma list of instance counts (default 4,8)")
    ap.add_argument("--policies", default=None, help=f"comma list of heuristic specs (default {','.join(HEURISTICS)})")
    ap.add_argument("--checkpoint", action="append", default=[], metavar="LABEL=DIR[,DIR...]",
                    help="DQN checkpoint folders (training seeds) to evaluate under LABEL (repeatable)")
    ap.add_argument("--table-dir", default=None,
                    help="add every <recipe>-<variant>-m<M>-s<SEED> folder of benchmarks/rl_train_table.py")
    ap.add_argument("--prediction", default="true", help="prediction mode (true | noisy[:ACC] | none)")
    ap.add_argument("--profile", default="llama2-7b-v100")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default="rl-eval.json", help="JSON output file")
    ap.add_argument("--quick", action="store_true", help="2 seeds, 300 requests, public-mix on 4 instances")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    a = ap.parse_args(argv)
    quick = {"seeds": 2, "requests": 300, "settings": "public-mix", "instances": "4"}
    full = {"seeds": 5, "requests": 1000, "settings": ",".join(DEFAULT_SETTINGS), "instances": "4,8"}
    for k, v in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


def validate(a: argparse.Namespace) -> None:
    """Check the arguments and load the checkpoints (into ``a.ckpts``).

    Raises:
        UsageError: the message names the bad value.
    """
    if a.seeds < 2:
        raise UsageError(f"--seeds must be >= 2 for a confidence interval, got {a.seeds}")
    if a.requests < 2:
        raise UsageError(f"--requests must be >= 2, got {a.requests}")
    a.settings = _split_list(a.settings)
    bad = [s for s in a.settings if s not in WORKLOADS]
    if bad or not a.settings:
        raise UsageError(f"--settings: unknown {', '.join(bad) or '(empty)'}; valid: {', '.join(WORKLOADS)}")
    try:
        a.instances = [int(x) for x in _split_list(a.instances)]
    except ValueError:
        raise UsageError(f"--instances must be a comma list of integers, got {a.instances!r}") from None
    if not a.instances or min(a.instances) < 1:
        raise UsageError(f"--instances must be integers >= 1, got {a.instances}")
    a.policies = _split_list(a.policies) if a.policies is not None else list(HEURISTICS)
    if "round_robin" not in a.policies:
        # Every change is paired against round robin on the same sample.
        raise UsageError("--policies must include round_robin (the reference of every change)")
    try:
        parse_prediction(a.prediction)
        a.profile_obj = get_profile(a.profile)
    except PredictionError as e:
        raise UsageError(f"--prediction: {e}") from None
    except ProfileError as e:
        raise UsageError(f"--profile: {e}") from None
    if not Path(a.out).resolve().parent.is_dir():
        # Checked now so a long run does not end unable to write its result.
        raise UsageError(f"--out {a.out}: folder {Path(a.out).resolve().parent} does not exist")
    if Path(a.out).is_dir():
        raise UsageError(f"--out {a.out}: is a folder; give a file name (e.g. {Path(a.out) / 'rl-eval.json'})")
    a.eval_requests = {}  # per trace: requests per held-out sample, lowered to fit --seeds disjoint windows
    for workload in a.settings:
        # A trace's data and held-out length are checked now, not after the settings before it ran.
        if workload not in GENERATORS:
            try:
                # Disjoint held-out windows: a trace's part holds only so many of --requests.
                n = splits.eval_requests(workload, a.requests, a.seeds, a.data_dir)
                splits.sample(workload, "eval", a.seeds - 1, n, None, a.data_dir)
            except ValueError as e:  # WorkloadError (missing data), or a held-out part too short
                raise UsageError(f"--settings {workload}: {e}") from None
            if note := splits.shrink_note(workload, a.requests, n, a.seeds):
                print(note)
            a.eval_requests[workload] = n
    for spec in a.policies:
        for m in a.instances:  # e.g. dqn's checkpoint fits one instance count only
            try:
                build_policy_from_spec(spec, PolicyContext(a.profile_obj, m))
            except PolicyError as e:
                raise UsageError(f"--policies: {e}") from None
    items = list(a.checkpoint)
    if a.table_dir is not None:
        items += table_dir_items(a.table_dir)
    a.ckpts = {}
    for item in items:
        label, eq, paths = item.partition("=")
        label = label.strip()
        folders = [p.strip() for p in paths.split(",") if p.strip()]
        if not eq or not label or not folders:
            raise UsageError(f"--checkpoint expects LABEL=DIR[,DIR...], got {item!r}")
        if label in a.ckpts or label in a.policies:
            raise UsageError(f"--checkpoint label {label!r} is used twice")
        seen = [Path(f).resolve() for f in folders]
        if len(set(seen)) != len(seen):
            # Each folder stands for one training seed; a repeat would weigh one seed twice.
            raise UsageError(f"--checkpoint {label}: a folder is listed twice")
        try:
            a.ckpts[label] = [load_checkpoint(f) for f in folders]
        except CheckpointError as e:
            raise UsageError(str(e)) from None


def table_dir_items(folder: str) -> list[str]:
    """``LABEL=DIR,DIR,...`` items for the trained runs in ``folder`` (``routerd.rl.recipes.RUN_NAME``):
    one label ``<recipe> <variant>`` per recipe and variant, folders of every instance count,
    ordered by instance count then seed. Folders without ``metadata.json`` (unfinished runs)
    are left out.

    Raises:
        UsageError: ``folder`` is not a folder or holds no finished run.
    """
    root = Path(folder)
    if not root.is_dir():
        raise UsageError(f"--table-dir {folder}: not a folder")
    runs: dict[str, list[tuple[int, int, Path]]] = {}
    for d in root.iterdir():
        mt = RUN_NAME.match(d.name)
        if mt and (d / "metadata.json").is_file():
            runs.setdefault(f"{mt['recipe']} {mt['variant']}", []).append((int(mt["m"]), int(mt["seed"]), d))
    if not runs:
        raise UsageError(f"--table-dir {folder}: no finished <recipe>-<variant>-m<M>-s<SEED> checkpoint folder")
    return [f"{label}=" + ",".join(str(d) for _, _, d in sorted(v)) for label, v in sorted(runs.items())]


def checkpoint_workload(ck) -> str | None:
    """Name of the workload a checkpoint was trained on, if its metadata records one."""
    w = ck.metadata.get("workload")
    return w.get("name") if isinstance(w, dict) else (w if isinstance(w, str) else None)


def run_one(policy, profile, m: int, requests, prediction: str, seed: int) -> dict[str, float]:
    """Simulate ``policy`` on ``requests``; the metrics of :data:`METRICS` plus hold counts."""
    prep = prepare_requests(requests, profile, prediction=prediction, seed=seed)
    sim = ClusterSimulator(profile, m, policy)
    s = summarize(sim.run(prep.requests))
    out = {k: float(getattr(s, k)) for k in METRICS}
    out["hold_rate"] = sim.holds / max(1, sim.decisions)
    out["forced_dispatches"] = float(sim.forced_dispatches)
    return out


def evaluate(a: argparse.Namespace, log=print) -> dict:
    """Run every setting; returns the JSON-ready result (see :func:`main`)."""
    from tqdm import tqdm

    profile = a.profile_obj
    t0 = time.perf_counter()
    samples: dict[tuple[str, int, int], list] = {}
    caps: dict[tuple[str, int, int], float] = {}
    # Requests per held-out sample: validate lowers a trace's to fit --seeds disjoint windows.
    n_of = getattr(a, "eval_requests", {})

    def sample(workload: str, i: int, m: int):
        # Generators are drawn at the paper rate for m; traces keep their own rate until rescaled.
        key = (workload, i, m if workload in GENERATORS else 0)
        if key not in samples:
            rate = PAPER_RATE_PER_INSTANCE * m if workload in GENERATORS else None
            try:
                samples[key] = splits.sample(workload, "eval", i, n_of.get(workload, a.requests), rate, a.data_dir)
            except ValueError as e:  # WorkloadError (missing data), or a held-out part shorter than n
                raise UsageError(str(e)) from None
        return samples[key]

    def cap(workload: str, i: int, m: int) -> float:
        if (workload, i, m) not in caps:
            caps[(workload, i, m)] = round_robin_capacity(sample(workload, i, m), profile, m)
        return caps[(workload, i, m)]

    jobs = [(w, m) for w in a.settings for m in a.instances]
    n_pol = len(a.policies) + len(a.ckpts)
    bar = tqdm(total=len(jobs) * a.seeds * (n_pol + 2), unit="run", desc="rl_eval", file=sys.stderr,
               disable=a.no_progress)
    for label, cks in a.ckpts.items():
        for ck in cks:
            wl = checkpoint_workload(ck)
            trained = f"the training part of {wl}" if wl else "an unrecorded workload"
            log(f"checkpoint {label}: {ck.path} (variant {ck.metadata.get('variant')}, {ck.num_instances} "
                f"instances, profile {ck.metadata.get('profile')}, trained on {trained})")
    results = []
    for workload, m in jobs:
        notes = []
        seeds = range(a.seeds)
        if workload in GENERATORS:
            rates = [PAPER_RATE_PER_INSTANCE * m] * a.seeds
            caps_used = [cap(workload, i, m) for i in seeds]
            bar.update(2 * a.seeds)
            load = statistics.fmean(r / c for r, c in zip(rates, caps_used))
            ref = f"the paper rate, {PAPER_RATE_PER_INSTANCE:g} req/s per instance"
        else:
            # Same load relative to capacity as public-mix at the paper rate on the same m.
            load = statistics.fmean(PAPER_RATE_PER_INSTANCE * m / cap("public-mix", i, m) for i in seeds)
            bar.update(a.seeds)
            caps_used = [cap(workload, i, m) for i in seeds]
            bar.update(a.seeds)
            rates = [load * c for c in caps_used]
            ref = (f"{load:.2f} x RR capacity = public-mix's load at {PAPER_RATE_PER_INSTANCE * m:g} req/s "
                   f"on {m} instances")
        reqs = [sample(workload, i, m) if workload in GENERATORS else rescale_to_rate(sample(workload, i, m), r)
                for i, r in zip(seeds, rates)]
        # label -> (spec, make(ctx, sample index) -> policy)
        policies: dict[str, tuple[str, object]] = {}
        for spec in a.policies:
            label = f"{spec} (best heuristic)" if spec == BEST_HEURISTIC else spec
            policies[label] = (spec, lambda ctx, i, s=spec: build_policy_from_spec(s, ctx))
        for label, cks in a.ckpts.items():
            fits = [c for c in cks if c.num_instances == m]
            if not fits:
                have = sorted({c.num_instances for c in cks})
                notes.append(f"checkpoint {label} skipped: trained for {', '.join(map(str, have))} instances, "
                             f"setting has {m}")
                bar.update(a.seeds)
                continue
            ck = fits[0]
            if len(fits) > 1:
                notes.append(f"checkpoint {label}: {len(fits)} training seeds; held-out sample i is routed by "
                             f"seed folder i mod {len(fits)}")
            wl = checkpoint_workload(ck)
            if wl == workload:
                notes.append(f"checkpoint {label}: evaluated on {workload}'s held-out part (never trained on, "
                             f"routerd.rl.splits)")
            elif wl:
                notes.append(f"checkpoint {label}: trained on {wl}, evaluated on a different workload")
            if ck.metadata.get("profile") not in (None, profile.name):
                notes.append(f"checkpoint {label}: trained on profile {ck.metadata.get('profile')}, "
                             f"evaluated on {profile.name}")
            policies[f"dqn {label}"] = (",".join(f"dqn:checkpoint={c.path}" for c in fits),
                                        lambda ctx, i, f=fits: DQNPolicy(ctx, weights=f[i % len(f)].weights))
        per: dict[str, dict[str, list[float]]] = {}
        for label, (_, make) in policies.items():
            rows = []
            for i in seeds:
                bar.set_postfix_str(f"{workload}/{m} {label} #{i}")
                rows.append(run_one(make(PolicyContext(profile, m, seed=i), i), profile, m, reqs[i], a.prediction, i))
                bar.update(1)
            per[label] = {k: [r[k] for r in rows] for k in rows[0]}
        rr = per["round_robin"]
        table = {}
        for label, d in per.items():
            entry = {"spec": policies[label][0], "per_sample": d,
                     "metrics": {k: interval(d[k]).as_dict() for k in METRICS}}
            for key, metric in zip(CHANGES, ("e2e_mean", "makespan")):
                ch = paired_change_pct(d[metric], rr[metric])
                entry["metrics"][key] = {**interval(ch).as_dict(), "per_sample": ch}
            entry["hold_rate_mean"] = statistics.fmean(d["hold_rate"])
            table[label] = entry
        res = {"setting": f"{workload}/{m}", "workload": workload, "profile": profile.name, "instances": m,
               "requests": n_of.get(workload, a.requests), "seeds": a.seeds,
               "sample_indices": list(seeds), "part": "eval",
               "capacity_rps": caps_used, "offered_rate_rps": rates, "load": load, "load_reference": ref,
               "notes": notes, "policies": table}
        results.append(res)
        print_setting(res, log)
    bar.close()
    return {"protocol": "held-out samples of routerd.rl.splits (part eval), 95% Student-t intervals over samples; "
                        "changes paired against round_robin on the same sample",
            "command": "benchmarks/rl_eval.py " + " ".join(a.argv), "prediction": a.prediction,
            "profile": profile.name, "seeds": a.seeds, "requests": a.requests,
            "checkpoints": {k: [{"path": str(c.path), "variant": c.metadata.get("variant"),
                                 "instances": c.num_instances, "workload": checkpoint_workload(c),
                                 "training_seconds": (c.metadata.get("training") or {}).get("seconds")}
                                for c in cks]
                            for k, cks in a.ckpts.items()},
            "wall_s": time.perf_counter() - t0, "settings": results}


def print_setting(res: dict, log=print) -> None:
    """The plain-text table of one setting: mean ± 95% half-width per metric."""
    r = res["offered_rate_rps"]
    log(f"\n== {res['setting']}: {res['workload']}, {res['profile']}, {res['instances']} instances, "
        f"{res['requests']} requests x {res['seeds']} held-out samples ==")
    log(f"offered {statistics.fmean(r):.2f} req/s (samples {min(r):.2f}..{max(r):.2f}); "
        f"RR capacity {statistics.fmean(res['capacity_rps']):.2f} req/s; load {res['load']:.2f} x capacity "
        f"({res['load_reference']})")
    for n in res["notes"]:
        log(f"note: {n}")
    cols = (("E2E mean s", "e2e_mean", 2), ("E2E p99 s", "e2e_p99", 1), ("makespan s", "makespan", 1),
            ("preempt", "preemptions", 0), ("wait s", "router_wait_mean", 2),
            ("ΔE2E %", "e2e_mean_change_pct", 1), ("Δmakespan %", "makespan_change_pct", 1))
    log(f"{'policy (mean ± 95% CI)':32}" + "".join(f"{h:>15}" for h, _, _ in cols))
    for label, e in res["policies"].items():
        cells = []
        for _, k, d in cols:
            v = e["metrics"][k]
            sign = "+" if k.endswith("pct") else ""
            cells.append(f"{v['mean']:{sign}.{d}f}±{v['half_width']:.{d}f}".rjust(15))
        log(f"{label:32}" + "".join(cells))


def main(argv: Sequence[str] | None = None) -> dict:
    """Parse ``argv``, run the evaluation, print the tables, write ``--out``; returns the result.

    JSON: ``settings[]`` with ``setting``, ``workload``, ``instances``, ``capacity_rps``,
    ``offered_rate_rps`` (per sample), ``load``, ``notes`` and ``policies[label]`` =
    ``{spec, per_sample, metrics: {metric: {mean, half_width, low, high}}}`` for the metrics
    in :data:`METRICS` and :data:`CHANGES`.

    Bad input prints one line naming it and exits with status 2.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    a.argv = argv
    try:
        validate(a)
        out = evaluate(a)
    except (UsageError, WorkloadError, PredictionError) as e:
        # PredictionError: --prediction given with requests that carry no prediction.
        print(f"rl_eval.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        Path(a.out).write_text(json.dumps(out, indent=2))
    except OSError as e:
        print(f"rl_eval.py: error: cannot write --out {a.out}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"\nwrote {a.out} ({out['wall_s']:.0f} s)")
    return out


if __name__ == "__main__":
    main()
