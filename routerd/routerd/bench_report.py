"""Rendering of bench results: text tables, the per-request CSV and PNG plots (matplotlib,
Agg backend)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Sequence

from routerd.bench import (INTERVAL_METHOD, INTERVAL_METRICS, REQUEST_COLUMNS, BenchResult, PairedInterval,
                           SeedsResult, SloCapacity, StudyResult, paired_interval_or_nan, pct, request_rows)

_COLUMNS = (
    ("policy", "{}"),
    ("E2E mean", "{:.2f}"), ("p50", "{:.2f}"), ("p90", "{:.2f}"), ("p99", "{:.2f}"),
    ("TTFT mean", "{:.2f}"), ("p90", "{:.2f}"), ("p99", "{:.2f}"),
    ("TPOT mean ms", "{:.1f}"), ("p99", "{:.1f}"),
    ("makespan", "{:.1f}"), ("preempt", "{}"), ("wait", "{:.2f}"), ("prefix hit %", "{:.1f}"),
    ("ΔE2E %", "{:+.1f}"), ("ΔTTFT p90 %", "{:+.1f}"), ("Δmakespan %", "{:+.1f}"),
)
#: Labels of :data:`routerd.bench.INTERVAL_METRICS`.
_METRIC_LABELS = {"e2e_mean": "mean E2E", "ttft_p90": "p90 TTFT", "makespan": "makespan"}
#: The note printed under every table of paired intervals (:func:`routerd.bench.paired_interval`).
INTERVAL_NOTE = ("Δ % [95% CI] = 100·(exp(mean(l)) - 1) [100·(exp(mean(l) ∓ t(0.975, n-1)·s_l/√n) - 1)], "
                 "l_i = ln(policy_i / round_robin_i) per seed: the " + INTERVAL_METHOD
                 + " (Bland & Altman, BMJ 1996)")


def _cell(fmt: str, v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and v != v:
        return "n/a"
    if fmt == "{}" and isinstance(v, float):
        return f"{v:.0f}"  # a count averaged over seeds
    return fmt.format(v)


def format_table(bench: BenchResult) -> str:
    """The bench as a fixed-width table (times in s, TPOT in ms, prefix hit rate in % of
    looked-up prompt tokens or "-" with no lookups, Δ in % against round_robin). On a table of
    means over seeds (``seed_label`` set) the Δ columns are headed "... of means": the change
    of the mean, unlike :func:`format_intervals`' geometric mean of the per-seed ratios."""
    base = bench.baseline()
    rows = []
    for r in bench.results:
        s = r.summary
        nan = float("nan")
        d_e2e = pct(s.e2e_mean, base.summary.e2e_mean) if base else nan
        d_ttft = pct(s.ttft_p90, base.summary.ttft_p90) if base else nan
        d_mk = pct(s.makespan, base.summary.makespan) if base else nan
        hit = None if s.prefix_hit_rate is None else 100 * s.prefix_hit_rate
        vals = (r.spec, s.e2e_mean, s.e2e_p50, s.e2e_p90, s.e2e_p99, s.ttft_mean, s.ttft_p90, s.ttft_p99,
                1000 * s.tpot_mean, 1000 * s.tpot_p99, s.makespan, s.preemptions, s.router_wait_mean, hit,
                d_e2e, d_ttft, d_mk)
        rows.append([_cell(fmt, v) for (_, fmt), v in zip(_COLUMNS, vals)])
    head = [c for c, _ in _COLUMNS]
    if bench.seed_label:
        # Over seeds these are changes of the means, not the paired interval table's geometric mean of ratios.
        head = [h + " of means" if h.startswith("Δ") else h for h in head]
    widths = [max(len(head[i]), *(len(row[i]) for row in rows)) for i in range(len(head))]
    lines = [
        f"workload={bench.workload} profile={bench.profile} instances={bench.instances} "
        f"requests={bench.requests} prediction={bench.prediction} "
        + (f"seeds={bench.seed_label}" if bench.seed_label else f"seed={bench.seed}")
        + bench.header_extra
        + (f" rejected={bench.rejected} (prompt >= max_model_len)" if bench.rejected else "")
        + (f" clipped={bench.clipped} (output cut to max_model_len - prompt)" if bench.clipped else "")
        + ("" if base else " (no round_robin in the list: no change column)"),
        "  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(head, widths))),
    ]
    for row in rows:
        lines.append("  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


def plot_bench(bench: BenchResult, path: str | Path) -> None:
    """Bar charts of mean/p99 E2E latency and makespan per policy, written as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.spec for r in bench.results]
    mean = [r.summary.e2e_mean for r in bench.results]
    p99 = [r.summary.e2e_p99 for r in bench.results]
    mk = [r.summary.makespan for r in bench.results]
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 0.9 * len(names) + 4), 4.5))
    x = range(len(names))
    axes[0].bar([i - 0.2 for i in x], mean, width=0.4, label="mean")
    axes[0].bar([i + 0.2 for i in x], p99, width=0.4, label="p99")
    axes[0].set_ylabel("E2E latency (s)")
    axes[0].legend(loc="upper left", bbox_to_anchor=(0.0, 1.15), ncol=2, frameon=False)
    axes[1].bar(list(x), mk, color="tab:green")
    axes[1].set_ylabel("makespan (s)")
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
    fig.suptitle(f"{bench.workload} · {bench.profile} · {bench.instances} instances · {bench.requests} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_study(study: StudyResult) -> str:
    """The 8-request study beside the paper's Fig. 2 figures."""
    w = max(22, *(len(s) + 2 for s in study.policies))
    lines = [
        "8 requests at 1 req/s, prompt/output 10-100 tokens, 2 instances, all 256 assignments",
        "metric: sum of the 8 E2E latencies (s)",
        f"{'':{w}}{'this model':>12}{'paper':>10}",
        f"{'optimum':{w}}{study.optimum:12.2f}{27.03:10.2f}",
        f"{'random (mean)':{w}}{study.random_mean:12.2f}{29.81:10.2f}",
        f"{'worst':{w}}{study.worst:12.2f}{32.34:10.2f}",
        f"{'random vs optimum %':{w}}{pct(study.random_mean, study.optimum):12.2f}{pct(29.81, 27.03):10.2f}",
        f"{'worst vs optimum %':{w}}{pct(study.worst, study.optimum):12.2f}{pct(32.34, 27.03):10.2f}",
        f"preemptions: best assignment {study.preemptions_best}, worst {study.preemptions_worst}",
    ]
    for spec, v in study.policies.items():
        d = pct(v, study.optimum)
        lines.append(f"{spec:{w}}{v:12.2f}   ({0.0 if abs(d) < 0.005 else d:+.2f}% vs optimum)")
    return "\n".join(lines)


def _iv_text(iv: PairedInterval) -> str:
    if iv.mean != iv.mean:
        return "n/a"  # a value <= 0 in some seed: no log ratio (paired_interval_or_nan)
    if iv.low is None:
        return f"{iv.mean:+.1f}"
    return f"{iv.mean:+.1f} [{iv.low:+.1f}, {iv.high:+.1f}]"


def format_intervals(seeds: SeedsResult) -> str:
    """Per policy, the change against round robin of mean E2E, p90 TTFT and makespan: the
    change in % of the geometric mean of the per-seed ratios with its paired 95% interval
    on the log ratios, transformed back (:func:`routerd.bench.paired_interval`; always
    above -100%), the method stated in a note under the table; empty without round_robin."""
    ivs = seeds.intervals()
    if not ivs:
        return ""
    head = ["policy"] + [f"paired Δ{_METRIC_LABELS[m]} % [95% CI]" for m in INTERVAL_METRICS]
    rows = [[spec] + [_iv_text(per[m]) for m in INTERVAL_METRICS] for spec, per in ivs.items()
            if spec != "round_robin"]
    if not rows:
        return ""
    widths = [max(len(head[i]), *(len(r[i]) for r in rows)) for i in range(len(head))]
    lines = [f"change vs round_robin, paired over seeds {','.join(map(str, seeds.seeds))} "
             f"(the table above shows the change of the means)",
             "  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(head, widths)))]
    for r in rows:
        lines.append("  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))))
    lines.append(INTERVAL_NOTE)
    if any(iv.mean != iv.mean for per in ivs.values() for iv in per.values()):
        lines.append("n/a: the metric was 0 in some seed, so it has no log ratio")
    return "\n".join(lines)



def format_capacity(caps: dict[str, list[SloCapacity]], limits: dict[str, float], seeds: Sequence[int],
                    tol: float) -> str:
    """Capacity at SLO per policy: mean over seeds in req/s, the ratio to round robin's mean,
    and the change in % against round robin (:func:`routerd.bench.paired_interval`: the
    geometric mean of the per-seed ratios, with several seeds its paired 95% interval on the
    log ratios; "n/a" where a capacity is 0), the method stated under the table."""
    slo = ", ".join(f"{k} <= {v:g} s" for k, v in limits.items())
    rr = caps.get("round_robin")
    rr_mean = sum(c.rate_rps for c in rr) / len(rr) if rr else None
    head = ["policy", "capacity req/s", "vs round_robin", "Δ % [95% CI]", "probes"]
    rows = []
    undefined = False  # some Δ is n/a: a policy's capacity of 0 has no log ratio
    for spec, cs in caps.items():
        mean = sum(c.rate_rps for c in cs) / len(cs)
        ratio = f"{mean / rr_mean:.2f}x" if rr_mean else "-"
        if rr and all(c.rate_rps > 0 for c in rr):
            delta = _iv_text(paired_interval_or_nan([c.rate_rps for c in cs], [c.rate_rps for c in rr]))
            undefined = undefined or delta == "n/a"
        else:
            delta = "-"
        mark = (" (infeasible)" if any(c.infeasible for c in cs)
                else " (bound)" if any(c.at_bound for c in cs)
                else " (>=)" if any(c.fail_rate_rps is None and c.rate_rps > 0 for c in cs) else "")
        rows.append([spec, f"{mean:.3f}" + mark, ratio, delta, str(sum(len(c.probes) for c in cs))])
    widths = [max(len(head[i]), *(len(r[i]) for r in rows)) for i in range(len(head))]
    lines = [f"capacity at SLO ({slo}); bisection over the arrival rate to within {100 * tol:g}%; "
             f"seeds {','.join(map(str, seeds))}"
             + ("" if rr else " (no round_robin in the list: no ratio)"),
             "  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(head, widths)))]
    for r in rows:
        lines.append("  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))))
    if any(c.at_bound for cs in caps.values() for c in cs):
        n = max((c.summary.requests for cs in caps.values() for c in cs if c.at_bound and c.summary),
                default=0)
        lines.append("(bound): the SLO still held at the highest rate the sample can measure (its arrivals "
                     "spanning 4 request lifetimes), so the value shown is that rate: the sample is too short "
                     "to find the SLO limit" + (f" ({n} requests)" if n else "") + "; run more requests (-n or --limit)")
    if any(c.fail_rate_rps is None and c.rate_rps > 0 and not c.at_bound for cs in caps.values() for c in cs):
        lines.append("(>=): the SLO still held at the highest rate probed")
    if any(c.rate_rps == 0 and not c.infeasible for cs in caps.values() for c in cs):
        lines.append("0: the SLO failed even at the lowest rate probed")
    if rr and all(c.rate_rps > 0 for c in rr):
        lines.append(INTERVAL_NOTE + ("; n/a: a capacity of 0 has no log ratio" if undefined else ""))
    for spec, cs in caps.items():
        for seed, c in zip(seeds, cs):
            if c.infeasible:
                lines.append(f"(infeasible) {spec}" + (f", seed {seed}" if len(cs) > 1 else "") + ": "
                             + infeasible_note(c, limits))
    return "\n".join(lines)


def _metric_label(field: str) -> str:
    """``"ttft_p90"`` -> ``"p90 TTFT"``, ``"e2e_mean"`` -> ``"mean E2E"``."""
    metric, _, stat = field.partition("_")
    return f"{stat} {metric.upper()}"


def infeasible_note(cap: SloCapacity, limits: dict[str, float]) -> str:
    """One line for an ``infeasible`` result: each limit the isolated run exceeded, with the
    value reached, e.g. ``"p90 TTFT 2.89 s > 2 s even with every request alone: no rate meets
    this SLO; raise the limit"``."""
    over = cap.violations(limits)
    what = ", ".join(f"{_metric_label(k)} {v:.3g} s > {limits[k]:g} s" for k, v in over.items())
    return (f"{what} even with every request alone: no rate meets this SLO; "
            f"raise the limit{'s' if len(over) > 1 else ''}")


def write_requests_csv(benches: Sequence[BenchResult], path: str | Path) -> int:
    """Write :func:`routerd.bench.request_rows` as CSV with a header of
    :data:`routerd.bench.REQUEST_COLUMNS` (floats in Python's shortest round-trip form,
    empty ``tpot_s`` for one-token outputs); returns the number of rows."""
    n = 0
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(REQUEST_COLUMNS)
        for row in request_rows(benches):
            w.writerow(["" if v is None else repr(v) if isinstance(v, float) else v for v in row])
            n += 1
    return n


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _styles(k: int):
    """Colour and line style per policy index, distinct for up to 40 policies."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return cmap(k % 10), ("-", "--", ":", "-.")[(k // 10) % 4]


def plot_changes(seeds: SeedsResult, path: str | Path) -> bool:
    """Horizontal bars of each policy's change against round robin (mean E2E, p90 TTFT,
    makespan, in %: the geometric mean of the per-seed ratios), with the paired 95%
    intervals on the log ratios (:func:`routerd.bench.paired_interval`) as error bars when
    there are several seeds; the method is stated in a caption. Returns False (nothing
    written) without round_robin."""
    ivs = seeds.intervals()
    specs = [s for s in ivs if s != "round_robin"]
    if not specs:
        return False
    plt = _pyplot()
    k = len(INTERVAL_METRICS)
    fig, ax = plt.subplots(figsize=(9.5, 1.6 + 0.45 * len(specs)))
    h = 0.8 / k
    colors = ("tab:blue", "tab:orange", "tab:green")
    for j, m in enumerate(INTERVAL_METRICS):
        y = [i + (j - (k - 1) / 2) * h for i in range(len(specs))]
        vals = [ivs[s][m].mean for s in specs]
        err = None
        if seeds.runs and len(seeds.runs) > 1:
            # The interval is asymmetric around the geometric-mean change; none (0) where undefined.
            err = [[ivs[s][m].mean - ivs[s][m].low if ivs[s][m].low is not None else 0.0 for s in specs],
                   [ivs[s][m].high - ivs[s][m].mean if ivs[s][m].high is not None else 0.0 for s in specs]]
        ax.barh(y, vals, height=h, xerr=err, capsize=3, color=colors[j], label=_METRIC_LABELS[m])
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_yticks(list(range(len(specs))))
    ax.set_yticklabels(specs, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("change vs round_robin (%, geometric mean of per-seed ratios)   ← better")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    b = seeds.runs[0]
    n = len(seeds.runs)
    ax.set_title(f"{b.workload} · {b.profile} · {b.instances} instances · "
                 + (f"{n} seeds, 95% paired intervals on log ratios" if n > 1
                    else f"seed {b.seed} (one seed: no interval)"),
                 fontsize=10)
    if n > 1:
        fig.text(0.01, 0.005, "bars: change of the geometric mean of the per-seed ratios policy / round_robin; "
                 "whiskers: paired 95% t-interval on the per-seed log ratios, transformed back by "
                 "100·(exp(x) - 1), so always > -100% (Bland & Altman, BMJ 1996)", fontsize=7,
                 ha="left", va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.05 if n > 1 else 0, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_cdfs(benches: Sequence[BenchResult], ttft_path: str | Path, e2e_path: str | Path) -> None:
    """Empirical CDFs of TTFT and of E2E latency per policy (requests of all seeds pooled;
    log time axis, as both are heavy-tailed under load), one PNG each."""
    import numpy as np

    plt = _pyplot()
    specs = [r.spec for r in benches[0].results]
    for key, label, path in (("ttft", "TTFT (s)", ttft_path), ("e2e", "E2E latency (s)", e2e_path)):
        fig, ax = plt.subplots(figsize=(8.5 + (2.5 if len(specs) > 8 else 0.0), 5.0))
        for i, spec in enumerate(specs):
            xs = []
            for b in benches:
                a = b.results[i].records
                if a is None:
                    continue
                end = a["first_token"] if key == "ttft" else a["finish"]
                xs.append(end - a["arrival"])
            if not xs:
                continue
            x = np.sort(np.concatenate(xs))
            y = np.arange(1, len(x) + 1) / len(x)
            color, style = _styles(i)
            ax.step(np.maximum(x, 1e-4), y, where="post", color=color, linestyle=style, label=spec, linewidth=1.3)
        ax.set_xscale("log")
        ax.set_xlabel(label + ", log scale")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.0)
        for q in (0.5, 0.9, 0.99):
            ax.axhline(q, color="grey", linewidth=0.5, alpha=0.5)
        ax.grid(which="both", axis="x", alpha=0.2)
        if len(specs) > 8:  # outside, so the legend hides no curve
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        else:
            ax.legend(fontsize=7, loc="upper left")
        b = benches[0]
        ax.set_title(f"{label.split(' (')[0]} CDF · {b.workload} · {b.profile} · {b.instances} instances · "
                     f"{len(benches)} seed{'s' if len(benches) > 1 else ''}", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def plot_capacity(caps: dict[str, list[SloCapacity]], limits: dict[str, float], path: str | Path) -> None:
    """Horizontal bars of capacity at SLO per policy (req/s, mean over seeds; the seeds'
    range as error bars)."""
    plt = _pyplot()
    specs = list(caps)
    mean = [sum(c.rate_rps for c in caps[s]) / len(caps[s]) for s in specs]
    lo = [m - min(c.rate_rps for c in caps[s]) for m, s in zip(mean, specs)]
    hi = [max(c.rate_rps for c in caps[s]) - m for m, s in zip(mean, specs)]
    fig, ax = plt.subplots(figsize=(8.5, 1.2 + 0.4 * len(specs)))
    ax.barh(range(len(specs)), mean, xerr=[lo, hi], capsize=3, color="tab:blue")
    ax.set_yticks(list(range(len(specs))))
    ax.set_yticklabels(specs, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("highest arrival rate meeting the SLO (req/s)   better →")
    ax.grid(axis="x", alpha=0.3)
    n = max(len(cs) for cs in caps.values())
    ax.set_title("capacity at SLO: " + ", ".join(f"{k} ≤ {v:g} s" for k, v in limits.items())
                 + (f" · mean of {n} seeds, bars: range" if n > 1 else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
