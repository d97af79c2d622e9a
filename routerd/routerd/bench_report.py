"""Rendering of bench results: a text table and a PNG plot (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

from routerd.bench import BenchResult, StudyResult, pct

_COLUMNS = (
    ("policy", "{}"),
    ("E2E mean", "{:.2f}"), ("p50", "{:.2f}"), ("p90", "{:.2f}"), ("p99", "{:.2f}"),
    ("TTFT mean", "{:.2f}"), ("p99", "{:.2f}"),
    ("TPOT mean ms", "{:.1f}"), ("p99", "{:.1f}"),
    ("makespan", "{:.1f}"), ("preempt", "{}"), ("wait", "{:.2f}"),
    ("ΔE2E %", "{:+.1f}"), ("Δmakespan %", "{:+.1f}"),
)


def format_table(bench: BenchResult) -> str:
    """The bench as a fixed-width table (times in s, TPOT in ms, Δ against round_robin)."""
    base = bench.baseline()
    rows = []
    for r in bench.results:
        s = r.summary
        d_e2e = pct(s.e2e_mean, base.summary.e2e_mean) if base else float("nan")
        d_mk = pct(s.makespan, base.summary.makespan) if base else float("nan")
        vals = (r.spec, s.e2e_mean, s.e2e_p50, s.e2e_p90, s.e2e_p99, s.ttft_mean, s.ttft_p99,
                1000 * s.tpot_mean, 1000 * s.tpot_p99, s.makespan, s.preemptions, s.router_wait_mean,
                d_e2e, d_mk)
        rows.append([fmt.format(v) if not (isinstance(v, float) and v != v) else "n/a"
                     for (_, fmt), v in zip(_COLUMNS, vals)])
    head = [c for c, _ in _COLUMNS]
    widths = [max(len(head[i]), *(len(row[i]) for row in rows)) for i in range(len(head))]
    lines = [
        f"workload={bench.workload} profile={bench.profile} instances={bench.instances} "
        f"requests={bench.requests} prediction={bench.prediction} seed={bench.seed}"
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
