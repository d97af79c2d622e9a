"""What prediction error costs (issue #17, deliverable 5).

What it measures. The policies that route on a predicted decode-length bucket
(``late_binding``, ``min_min``, ``mixing_penalty``, ``dqn`` with the shipped checkpoint
``routerd/routerd/data/checkpoints/dqn-default``, ``phasewise``), each run three ways on
the same requests:

* ``true``: every request gets the bucket of its true (simulated) output length, a perfect
  bucket predictor (``routerd.sim.prepare.prepare_requests`` mode ``true``);
* ``predictor:SPEC``: the buckets of a real length predictor (``--predictor``, default the
  shipped ``default``), assigned once per request up front exactly as ``phasewise bench
  --prediction predictor:SPEC`` does (``routerd.predictor.assign_predictions``, then mode
  ``given``);
* ``none``: no prediction (bucket ``None``; every policy then sees
  ``bucket_mid_tokens(0)`` = 125 tokens as the point estimate).

Round robin, which reads no prediction, is the reference row; it is run in every mode
and the script checks that its figures are identical across modes (so every change is
against one baseline). Per (load, policy, mode) the table gives the means over seeds of
mean E2E, p90 TTFT and makespan (s), the change against round robin (geometric mean of the
per-seed ratios in %, paired 95% t-interval on the log ratios: ``routerd.bench.paired_interval``), and
the change of mean E2E against the same policy with true buckets on the same seed
(paired the same way): the cost of the prediction error itself. A second table gives
the realized accuracy of each mode on the simulated requests: the share whose assigned
bucket equals ``routerd.model.bucket_of`` of the output length the simulator runs
(``PREDICTOR_BUCKET_EDGES`` 250/1000/4000), and the shares predicted too low and too
high. For the predictor it also counts the workload's prompts that lie in the
predictor's training split (``routerd.predictor.data.split_rows`` with the sources and
seed in its metadata; for a saved model without them, the permissive sources
``arena_hard_answers`` + ``gpteacher_gpt4`` and seed 0): an upper bound of what it saw.

Regime: ``public-mix`` on 4 instances of the bench's default profile (``llama2-7b-v100``),
the paper's setting (arXiv 2408.13510 §6: Llama-2-7B on 4 V100s, 2000 requests per
episode, overloaded; ``/work/shared/docs/paper-notes.md`` §1.3 "Load regime"), with the
arrival rate set to 1.5x and 2x round robin's saturated throughput on each seed's
requests (``routerd.bench.load_to_rate``, the project's loads; ``phasewise bench --load``).
Every run is seeded (workload draw, policy, simulation): seeds ``--seed .. --seed +
--seeds - 1``.

Usage:
    PYTHONPATH=routerd .venv/bin/python benchmarks/prediction_cost.py [--seeds 5] [-n 2000]
        [--loads 1.5,2] [--instances 4] [--profile llama2-7b-v100] [--predictor default]
        [--seed 0] [--data-dir DIR] [--out table.md | table.json]

Runtime measured (this machine, 2 cores shared with other work, one used): the default run
(5 seeds x 2,000 requests x 2 loads x 18 simulations = 180 simulations) took 323-382 s with
``--predictor default`` (the shipped n-gram model: 0.1 s to load, 1.8 s to predict the
10,000 requests, 3.2 s to recompute its training split) and 393 s with ``--predictor
task-prior`` (2.5 s to fit it); nearly all of it is the simulations, ~2 s each.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from routerd.model import PREDICTOR_BUCKET_EDGES, bucket_mid_tokens, bucket_of

#: Policies that read the predicted bucket (or the point estimate made from it).
POLICIES: tuple[str, ...] = ("late_binding", "min_min", "mixing_penalty", "dqn", "phasewise")
BASELINE = "round_robin"
WORKLOAD = "public-mix"
#: Summary fields reported, in table order (all in s).
METRICS: tuple[str, ...] = ("e2e_mean", "ttft_p90", "makespan")
_LABELS = {"e2e_mean": "mean E2E s", "ttft_p90": "p90 TTFT s", "makespan": "makespan s"}


# ------------------------------------------------------------------------------ pure helpers


def parse_loads(text: str) -> tuple[float, ...]:
    """``"1.5,2"`` -> ``(1.5, 2.0)``: loads as multiples of round robin's capacity.

    Raises:
        ValueError: an empty list, an item that is not a finite number > 0, or a repeat
            (the message names the item).
    """
    out: list[float] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        try:
            v = float(item)
        except ValueError:
            v = math.nan
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"load {item!r} is not a finite number > 0")
        if v in out:
            raise ValueError(f"load {item!r} given twice")
        out.append(v)
    if not out:
        raise ValueError("no loads given; e.g. 1.5,2")
    return tuple(out)


@dataclass(frozen=True)
class Accuracy:
    """How a mode's buckets compare with the true buckets, over ``requests`` requests."""

    requests: int
    correct: int
    """Assigned bucket == bucket of the simulated output length."""
    under: int
    """Assigned bucket below the true one (the policy expects a shorter decode)."""
    over: int
    """Assigned bucket above the true one."""
    unassigned: int
    """Requests with no bucket (mode ``none``)."""
    true_bucket0: int
    """Requests whose true bucket is 0: what a policy reading ``None`` as bucket 0's
    midpoint gets right."""

    def share(self, count: int) -> float | None:
        """``count`` as a share of the requests that got a bucket (None if none did)."""
        n = self.requests - self.unassigned
        return count / n if n else None

    def __add__(self, other: "Accuracy") -> "Accuracy":
        return Accuracy(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple())))

    def as_tuple(self) -> tuple[int, ...]:
        return (self.requests, self.correct, self.under, self.over, self.unassigned, self.true_bucket0)

    def as_dict(self) -> dict:
        """JSON-ready dict (counts, and shares of the requests that got a bucket)."""
        return {"requests": self.requests, "correct": self.correct, "under": self.under, "over": self.over,
                "unassigned": self.unassigned, "true_bucket0": self.true_bucket0,
                "accuracy": self.share(self.correct), "under_share": self.share(self.under),
                "over_share": self.share(self.over)}


def bucket_accuracy(pairs: Sequence[tuple[int | None, int]],
                    edges: tuple[int, ...] = PREDICTOR_BUCKET_EDGES) -> Accuracy:
    """Compare ``(assigned bucket or None, output tokens)`` pairs with ``bucket_of(output)``.

    The output length is the one simulated (clipped to ``max_model_len - prompt`` where
    vLLM would stop), which is what the policy's guess is judged against.
    """
    correct = under = over = none = zero = 0
    for b, output in pairs:
        t = bucket_of(output, edges)
        zero += t == 0
        if b is None:
            none += 1
        elif b == t:
            correct += 1
        elif b < t:
            under += 1
        else:
            over += 1
    return Accuracy(len(pairs), correct, under, over, none, zero)


def prompt_overlap(prompts: Sequence[str | None], seen: set[str]) -> tuple[int, int, int]:
    """``(requests whose prompt is in seen, distinct such prompts, distinct prompts)``;
    requests without text count as unseen."""
    hit = [p for p in prompts if p is not None and p in seen]
    return len(hit), len(set(hit)), len({p for p in prompts if p is not None})


def iv_text(iv: dict | None) -> str:
    """A paired interval (:meth:`routerd.bench.PairedInterval.as_dict`: ``mean_pct``,
    ``low_pct``, ``high_pct``) as ``"+1.2 [-0.3, +2.7]"`` (% change); the mean alone with
    one seed; ``"-"`` for None."""
    if iv is None:
        return "-"
    if iv["low_pct"] is None:
        return f"{iv['mean_pct']:+.1f}"
    return f"{iv['mean_pct']:+.1f} [{iv['low_pct']:+.1f}, {iv['high_pct']:+.1f}]"


def render(head: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool = False, left: int = 1) -> str:
    """A table: fixed-width text or GitHub markdown; the first ``left`` columns are
    left-aligned, the rest right-aligned."""
    if markdown:
        rule = "|" + "|".join("---" if i < left else "---:" for i in range(len(head))) + "|"
        return "\n".join(["| " + " | ".join(head) + " |", rule] + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(head[i]), *(len(r[i]) for r in rows)) for i in range(len(head))]
    fmt = lambda r: "  ".join(v.ljust(w) if i < left else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(head)] + [fmt(r) for r in rows])


def pct_text(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


# ------------------------------------------------------------------------------ the runs


@dataclass
class Settings:
    """What one invocation runs."""

    seeds: list[int]
    n: int
    loads: tuple[float, ...]
    instances: int
    profile: str
    predictor: str
    data_dir: str | None


def training_prompts(pred, spec: str, data_dir: str | None) -> tuple[set[str], str]:
    """The prompt texts of ``pred``'s training split and a line saying which split that is.

    Recomputed as each trainer does it (:func:`routerd.predictor.data.split_rows`):

    - baselines (``task-prior`` etc., ``routerd.predictor.assign.fit_baseline``): the
      training split of all prompt files, seed 0;
    - an n-gram model (metadata ``training``: ``datasets``, ``split_seed``, ``rows``;
      ``routerd.predictor.train_ngram``): the split of *all* prompt files, then only the
      rows of its ``datasets`` (so the split is not that of the permissive files alone);
    - a transformer (metadata ``data``: ``sources``, ``split.seed``, ``rows``;
      ``routerd.predictor.train``): the split of its ``sources``' rows.

    Without such metadata, the n-gram recipe on the permissive datasets with seed 0 is
    assumed (said in the line). A row count other than the metadata's is reported, since
    the split would then differ. Training may use a subset of the split (per-task caps),
    so the overlap is an upper bound of the prompts the model saw.
    """
    from routerd.predictor import BASELINE_NAMES
    from routerd.predictor import data as D

    meta = getattr(pred, "meta", None) or {}
    ng = meta.get("training") if isinstance(meta.get("training"), dict) else None
    hf = meta.get("data") if isinstance(meta.get("data"), dict) else None
    sources, datasets, seed, want, count_train = None, None, 0, None, True
    alpaca = "llama-2-7b-chat-hf"
    if spec in BASELINE_NAMES:
        how = "all prompt files, split seed 0 (as fit_baseline)"
    elif hf is not None:
        src = hf.get("sources", "all")
        sources = None if src == "all" else list(src)
        split_meta = hf.get("split") if isinstance(hf.get("split"), dict) else {}
        seed = split_meta.get("seed", 0)
        alpaca = hf.get("alpaca_model", alpaca)
        want, count_train = hf.get("rows"), False
        how = f"split of {'all prompt files' if sources is None else ','.join(sources)}, seed {seed} (its metadata)"
    else:
        assumed = ng is None or "datasets" not in ng
        ng = ng or {}
        datasets = set(ng.get("datasets") or ("arena-hard-v0.1", "arena-hard-v2.0", "gpteacher"))
        seed = ng.get("split_seed", 0)
        want = ng.get("rows")
        how = (f"split of all prompt files, seed {seed}, rows of {','.join(sorted(datasets))} "
               + ("(assumed: no training metadata)" if assumed else "(its metadata)"))
    rows = D.load_rows(data_dir, sources=sources, alpaca_model=alpaca)
    split = D.split_rows(rows, seed=int(seed), edges=PREDICTOR_BUCKET_EDGES)
    train = [int(i) for i in split["train"] if datasets is None or rows[int(i)].dataset in datasets]
    got = len(train) if count_train else len(rows)
    if isinstance(want, int) and want != got:
        how += f"; metadata says {want} rows, recomputed {got}: the split may differ"
    return {rows[i].prompt for i in train}, how


def policy_list(profile_name: str, instances: int) -> tuple[list[str], list[str]]:
    """:data:`POLICIES`, minus ``dqn`` where the shipped checkpoint cannot run on
    ``instances`` instances; with notes (also for a checkpoint trained on another profile,
    which still runs)."""
    from routerd.policies.dqn.checkpoint import DEFAULT_CHECKPOINT, CheckpointError, load_checkpoint

    specs, notes = list(POLICIES), []
    try:
        ck = load_checkpoint(DEFAULT_CHECKPOINT, num_instances=instances)
    except CheckpointError as e:
        specs.remove("dqn")
        notes.append(f"dqn left out: {e}")
    else:
        mismatch = ck.profile_mismatch(profile_name)
        if mismatch:
            notes.append(f"dqn: {mismatch}")
        hp = ck.metadata.get("hyperparameters", {})
        notes.append(f"dqn: shipped checkpoint {ck.path.name}, trained on {hp.get('workload')} at "
                     f"{hp.get('rate')} req/s with prediction {hp.get('prediction')!r}, "
                     f"{hp.get('instances')} instances of {hp.get('profile')}")
    return specs, notes


def run(st: Settings, log=lambda s: None) -> dict:
    """Every (load, mode, seed) bench; returns the JSON-ready result (see :func:`report`).

    Raises:
        routerd.predictor.PredictorError, routerd.workloads.WorkloadError,
        routerd.profiles.ProfileError, routerd.policies.registry.PolicyError: bad settings.
    """
    from routerd.bench import SeedsResult, load_to_rate, paired_interval, run_bench, seed_workloads
    from routerd.predictor import assign_predictions, load_predictor
    from routerd.profiles import get_profile
    from routerd.sim.prepare import prepare_requests
    from routerd.workloads.traces import rescale_to_rate

    t_start = time.perf_counter()
    profile = get_profile(st.profile)
    policies, notes = policy_list(profile.name, st.instances)
    specs = [BASELINE, *policies]
    t0 = time.perf_counter()
    pred = load_predictor(st.predictor, data_dir=st.data_dir, edges=PREDICTOR_BUCKET_EDGES)
    load_s = time.perf_counter() - t0
    pmode = f"predictor:{st.predictor}"
    modes = ("true", pmode, "none")
    log(f"predictor {pred.name!r} loaded in {load_s:.1f} s")

    t0 = time.perf_counter()
    seen, split_how = training_prompts(pred, st.predictor, st.data_dir)
    split_s = time.perf_counter() - t0

    wls = seed_workloads(WORKLOAD, st.seeds, n=st.n, data_dir=st.data_dir)
    per_seed = []  # (seed, workload, {mode: (requests, prediction kind)})
    acc: dict[str, list] = {m: [] for m in modes}
    acc_seen: dict[bool, list] = {True: [], False: []}  # the predictor's, by prompt in its training split
    predict_s = 0.0
    for seed, wl in zip(st.seeds, wls):
        t0 = time.perf_counter()
        predicted = assign_predictions(wl.requests, pred, edges=PREDICTOR_BUCKET_EDGES)
        predict_s += time.perf_counter() - t0
        by_mode = {"true": (wl.requests, "true"), pmode: (predicted, "given"), "none": (wl.requests, "none")}
        in_train = {r.id: r.prompt is not None and r.prompt in seen for r in wl.requests}
        for m, (reqs, kind) in by_mode.items():
            prep = prepare_requests(reqs, profile, prediction=kind, edges=PREDICTOR_BUCKET_EDGES, seed=seed)
            acc[m].append(bucket_accuracy([(r.bucket, r.output) for r in prep.requests]))
            if m == pmode:
                for flag in (True, False):
                    acc_seen[flag].append(bucket_accuracy([(r.bucket, r.output) for r in prep.requests
                                                           if in_train[r.id] == flag]))
        per_seed.append((seed, wl, by_mode))
    log(f"predictions for {len(st.seeds)} x {st.n} requests in {predict_s:.1f} s")
    overlap = [prompt_overlap([r.prompt for r in wl.requests], seen) for _, wl, _ in per_seed]
    trained_tasks = getattr(pred, "tasks", None)
    task_cover = None
    if trained_tasks is not None:
        known = set(trained_tasks)
        task_cover = [sum(r.task in known for r in wl.requests) for _, wl, _ in per_seed]

    loads_out = []
    for load in st.loads:
        benches: dict[str, list] = {m: [] for m in modes}
        caps, rates = [], []
        for seed, wl, by_mode in per_seed:
            # Round robin's capacity depends on the requests only, not on their predictions.
            base, cap, rate = load_to_rate(wl.requests, profile, st.instances, load)
            caps.append(cap)
            rates.append(rate)
            for m, (reqs, kind) in by_mode.items():
                reqs = base if reqs is wl.requests else rescale_to_rate(reqs, rate)
                b = run_bench(reqs, profile, st.instances, specs, workload_name=WORKLOAD,
                              prediction=kind, seed=seed)
                b.prediction = m
                benches[m].append(b)
            log(f"load {load:g}x seed {seed}: {len(modes) * len(specs)} simulations done "
                f"({time.perf_counter() - t_start:.0f} s)")
        rr = {m: [[getattr(b.results[0].summary, k) for k in METRICS] for b in benches[m]] for m in modes}
        rr_same = all(rr[m] == rr["true"] for m in modes)
        rows = []
        for m in modes:
            sr = SeedsResult(benches[m])
            ivs = sr.intervals()
            mean = sr.mean_bench()
            for i, spec in enumerate(specs):
                vs_true = {k: paired_interval([getattr(b.results[i].summary, k) for b in benches[m]],
                                              [getattr(b.results[i].summary, k) for b in benches["true"]])
                           for k in METRICS} if m != "true" else None
                rows.append({
                    "policy": spec, "mode": m,
                    **{k: getattr(mean.results[i].summary, k) for k in METRICS},
                    "preemptions": mean.results[i].summary.preemptions,
                    "vs_round_robin": {k: ivs[spec][k].as_dict() for k in METRICS},
                    "vs_true": None if vs_true is None else {k: iv.as_dict() for k, iv in vs_true.items()},
                })
        loads_out.append({"load": load, "capacity_rps": caps, "rate_rps": rates,
                          "round_robin_identical_across_modes": rr_same, "rows": rows})

    prompts_total = sum(o[2] for o in overlap)
    return {
        "settings": {"workload": WORKLOAD, "profile": profile.name, "instances": st.instances, "n": st.n,
                     "seeds": st.seeds, "loads": list(st.loads), "predictor": st.predictor,
                     "predictor_name": pred.name, "policies": specs, "modes": list(modes),
                     "bucket_edges": list(PREDICTOR_BUCKET_EDGES), "none_point_estimate_tokens":
                         bucket_mid_tokens(0, PREDICTOR_BUCKET_EDGES)},
        "notes": notes,
        "accuracy": {m: {"pooled": sum(a[1:], a[0]).as_dict(), "per_seed": [x.as_dict() for x in a]}
                     for m, a in acc.items()},
        "predictor_accuracy_by_training_split": {
            ("prompt in training split" if flag else "prompt not in training split"):
                {"pooled": sum(a[1:], a[0]).as_dict(), "per_seed": [x.as_dict() for x in a]}
            for flag, a in acc_seen.items()},
        "leakage": {"split": split_how, "train_prompts": len(seen),
                    "requests_seen": [o[0] for o in overlap], "distinct_seen": [o[1] for o in overlap],
                    "distinct_prompts": [o[2] for o in overlap],
                    "requests": [len(wl.requests) for _, wl, _ in per_seed],
                    "requests_with_trained_task": task_cover,
                    "trained_tasks": list(trained_tasks) if trained_tasks is not None else None,
                    "distinct_prompts_total": prompts_total},
        "loads": loads_out,
        "timing_s": {"predictor_load": load_s, "predict": predict_s, "split": split_s,
                     "total": time.perf_counter() - t_start},
    }


# ------------------------------------------------------------------------------ report


def result_table(load_entry: dict, markdown: bool = False) -> str:
    """One load's rows: round robin (once, mode "(any)", when its figures are identical in
    every mode; else once per mode), then each policy in each mode."""
    head = (["policy", "prediction"] + [_LABELS[k] for k in METRICS]
            + [f"Δ{_LABELS[k].rsplit(' ', 1)[0]} vs RR % [95% CI]" for k in METRICS] + ["ΔE2E vs true % [95% CI]"])
    same = load_entry["round_robin_identical_across_modes"]
    rows = []
    for r in load_entry["rows"]:
        is_rr = r["policy"] == BASELINE
        if is_rr and same and r["mode"] != "true":
            continue
        figures = [f"{r[k]:.1f}" if k == "makespan" else f"{r[k]:.2f}" for k in METRICS]
        changes = ["ref"] * len(METRICS) if is_rr else [iv_text(r["vs_round_robin"][k]) for k in METRICS]
        vs_true = "-" if is_rr or r["vs_true"] is None else iv_text(r["vs_true"]["e2e_mean"])
        rows.append([r["policy"], "(any)" if is_rr and same else r["mode"]] + figures + changes + [vs_true])
    return render(head, rows, markdown, left=2)


def accuracy_table(res: dict, markdown: bool = False) -> str:
    """Realized accuracy per mode (the predictor's also split by whether the prompt lies in
    its training split), then a line on mode ``none``."""
    head = ["prediction", "requests", "exact bucket %", "too low %", "too high %", "per seed exact %"]
    rows, after = [], []
    for m, a in res["accuracy"].items():
        p = a["pooled"]
        if p["unassigned"] == p["requests"]:
            b0 = 100 * p["true_bucket0"] / p["requests"]
            rows.append([m, str(p["requests"]), "-", "-", "-", "-"])
            after.append(f"{m}: no bucket; every policy sees {res['settings']['none_point_estimate_tokens']:g} "
                         f"tokens (bucket 0's midpoint), the true bucket of {b0:.1f}% of the requests")
            continue
        subs = [(m, a)]
        if m.startswith("predictor:"):
            subs += [(f"{m}, {label}", sub) for label, sub in res["predictor_accuracy_by_training_split"].items()]
        for label, sub in subs:
            q = sub["pooled"]
            rows.append([label if sub is a else "  " + label, str(q["requests"]), pct_text(q["accuracy"]),
                         pct_text(q["under_share"]), pct_text(q["over_share"]),
                         ", ".join(pct_text(x["accuracy"]) for x in sub["per_seed"])])
    return render(head, rows, markdown) + "".join(f"\n\n{x}" if markdown else f"\n{x}" for x in after)


def report(res: dict, command: str, markdown: bool = False) -> str:
    """The whole printout (text) or the markdown file."""
    s = res["settings"]
    lk = res["leakage"]
    tm = res["timing_s"]
    h = "## " if markdown else "== "
    tail = "" if markdown else " =="
    out = []
    if markdown:
        out += ["# What prediction error costs (issue #17, deliverable 5)", "",
                f"Command (from /work/main): `{command}`", ""]
    else:
        out += [f"command: {command}"]
    bullet = "- " if markdown else ""
    out += [f"{bullet}settings: workload={s['workload']} profile={s['profile']} instances={s['instances']} n={s['n']} "
            f"seeds={','.join(map(str, s['seeds']))} loads={','.join(f'{x:g}' for x in s['loads'])}x round robin "
            f"capacity; predictor={s['predictor']} ({s['predictor_name']}); bucket edges "
            f"{'/'.join(map(str, s['bucket_edges']))} tokens"]
    for note in res["notes"]:
        out.append(f"{bullet}note: {note}")
    out.append("")
    out.append(f"{h}realized bucket accuracy on the simulated requests (all seeds pooled){tail}")
    out.append(accuracy_table(res, markdown))
    seen, nreq = sum(lk["requests_seen"]), sum(lk["requests"])
    distinct = ", ".join(f"{a}/{b}" for a, b in zip(lk["distinct_seen"], lk["distinct_prompts"]))
    out += ["", f"{bullet}predictor training split ({lk['split']}): {lk['train_prompts']} prompts; {seen} of {nreq} "
                f"workload requests ({100 * seen / nreq:.1f}%) carry a prompt from it (distinct prompts per seed: "
                f"{distinct})"]
    if lk["requests_with_trained_task"] is not None:
        cov = sum(lk["requests_with_trained_task"])
        out.append(f"{bullet}requests whose task label the predictor was trained on: {cov} of {nreq} "
                   f"({100 * cov / nreq:.1f}%); it treats the other labels as unknown (predicted as a request "
                   "without a task)")
    for ld in res["loads"]:
        cap = statistics.fmean(ld["capacity_rps"])
        rate = statistics.fmean(ld["rate_rps"])
        out += ["", f"{h}load {ld['load']:g}x round robin capacity (mean {cap:.2f} req/s) = mean {rate:.2f} req/s; "
                    f"means over seeds{tail}"]
        out.append(result_table(ld, markdown))
        if markdown:
            out.append("")
        out.append("round_robin: identical figures in every prediction mode (it reads no prediction)"
                   if ld["round_robin_identical_across_modes"] else
                   "note: round_robin differs across prediction modes: the simulator reads the predictions")
    out += ["", "Δ vs RR: mean of the per-seed % changes against round robin on the same seed (paired 95% "
                "t-interval; negative = better). ΔE2E vs true: the same policy with true buckets on the same seed.",
            f"wall time {tm['total']:.0f} s (predictor load {tm['predictor_load']:.1f} s, predictions "
            f"{tm['predict']:.1f} s, training split {tm['split']:.1f} s)"]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------ CLI


def build_parser() -> argparse.ArgumentParser:
    from routerd.cli import DEFAULT_INSTANCES, DEFAULT_PROFILE

    p = argparse.ArgumentParser(prog="prediction_cost",
                                description="Policies that use predicted decode-length buckets, with true, "
                                            "predicted and no buckets, on public-mix at loads relative to "
                                            "round robin's capacity.")
    p.add_argument("--seeds", type=int, default=5, help="seeds SEED..SEED+N-1 (default 5)")
    p.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    p.add_argument("-n", type=int, default=2000, help="requests per seed (default 2000, the paper's episode)")
    p.add_argument("--loads", default="1.5,2", help="multiples of round robin's capacity (default 1.5,2)")
    p.add_argument("--instances", "-m", type=int, default=DEFAULT_INSTANCES, help=f"default {DEFAULT_INSTANCES}")
    p.add_argument("--profile", "-p", default=DEFAULT_PROFILE, help=f"hardware profile (default {DEFAULT_PROFILE})")
    p.add_argument("--predictor", default="default",
                   help="length predictor spec for the predicted mode: default (the shipped model), majority, "
                        "task-prior, length-only, length+task or a model folder (default: default)")
    p.add_argument("--data-dir", default=None, help="folder with prompts/ (default: the usual search, ../shared/data)")
    p.add_argument("--out", "-o", default=None, help="also write the figures to this .md or .json file")
    return p


def _check_out(p: argparse.ArgumentParser, out: str | None) -> Path | None:
    if out is None:
        return None
    path = Path(out)
    if path.suffix not in (".md", ".json"):
        p.error(f"--out {out}: give a .md or .json file name")
    if path.is_dir():
        p.error(f"--out {out}: is a folder")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        p.error(f"--out {out}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        p.error(f"--out {out}: cannot write into {parent}")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    from routerd.policies.base import PolicySetupError
    from routerd.policies.registry import PolicyError
    from routerd.predictor import PredictorError
    from routerd.profiles import ProfileError
    from routerd.workloads.errors import WorkloadError

    p = build_parser()
    a = p.parse_args(argv)
    if a.seeds < 1:
        p.error(f"--seeds must be >= 1, got {a.seeds}")
    if a.n < 2:
        p.error(f"-n must be >= 2 requests (a rate needs two arrivals), got {a.n}")
    if a.instances < 1:
        p.error(f"--instances must be >= 1, got {a.instances}")
    if not a.predictor.strip():
        p.error("--predictor is empty")
    try:
        loads = parse_loads(a.loads)
    except ValueError as e:
        p.error(f"--loads: {e}")
    out = _check_out(p, a.out)
    st = Settings([a.seed + i for i in range(a.seeds)], a.n, loads, a.instances, a.profile, a.predictor.strip(),
                  a.data_dir)
    argv_list = sys.argv[1:] if argv is None else list(argv)
    command = "PYTHONPATH=routerd .venv/bin/python benchmarks/prediction_cost.py " + shlex.join(argv_list)
    try:
        res = run(st, log=lambda s: print(s, file=sys.stderr, flush=True))
    except (PredictorError, WorkloadError, ProfileError, PolicyError, PolicySetupError) as e:
        p.exit(2, f"{p.prog}: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}\n")
    print(report(res, command.strip()), end="")
    if out is not None:
        text = (report(res, command.strip(), markdown=True) if out.suffix == ".md"
                else json.dumps({"command": command.strip(), **res}, indent=2))
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, out)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            p.exit(2, f"{p.prog}: error: --out {out}: cannot write the file ({e.strerror or e})\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
