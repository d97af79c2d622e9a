"""``phasewise bench`` for prefix-aware work (issue 13, item 6): the p90 TTFT and prefix hit
rate columns, ``--seeds`` with paired intervals, per-request CSV, capacity at SLO, plots,
``--max-model-len`` and ``--load``."""

from __future__ import annotations

import csv
import json
import math
import statistics
from types import SimpleNamespace

import pytest

from routerd.bench import (BenchResult, PolicyResult, SeedsResult, capacity_at_slo, meets_slo, paired_interval,
                           parse_slo, run_bench, t975, with_max_model_len)
from routerd.bench_report import format_table
from routerd.cli import main
from routerd.policies.base import PolicyContext
from routerd.policies.registry import build_policy_from_spec
from routerd.profiles import ProfileError, get_profile
from routerd.sim import ClusterSimulator, prepare_requests
from routerd.sim.capacity import round_robin_capacity
from routerd.sim.report import prefix_counters, summarize
from routerd.workloads.registry import load_workload
from routerd.workloads.traces import mean_rate, rescale_to_rate

PROFILE = "llama2-7b-v100"


# ------------------------------------------------------------------ paired intervals


def test_paired_interval_by_hand_on_three_seeds():
    # Per-seed ratios 9/10 = 0.9, 19/20 = 0.95, 34/40 = 0.85 (changes -10%, -5%, -15%).
    iv = paired_interval([9.0, 19.0, 34.0], [10.0, 20.0, 40.0])
    assert iv.diffs == pytest.approx((-10.0, -5.0, -15.0))
    # Geometric mean ratio: cube root of 0.9 * 0.95 * 0.85 = 0.72675 -> 0.8990731, i.e. -10.0927%.
    assert iv.mean == pytest.approx(100 * (0.72675 ** (1 / 3) - 1))
    assert iv.mean == pytest.approx(-10.0927, abs=1e-4)
    # Log ratios -0.1053605, -0.0512933, -0.1625189: mean -0.1063909, sample sd 0.0556199;
    # t_{0.975,2} = 4.303, half width 4.303 * 0.0556199 / sqrt(3) = 0.1381786;
    # exp(-0.2445695) - 1 = -21.696%, exp(0.0317877) - 1 = +3.230%.
    assert iv.low == pytest.approx(-21.696, abs=2e-3) and iv.high == pytest.approx(3.230, abs=2e-3)
    assert iv.n == 3
    one = paired_interval([9.0], [10.0])
    assert one.mean == pytest.approx(-10.0) and one.low is None and one.high is None
    with pytest.raises(ValueError):
        paired_interval([1.0, 2.0], [1.0])


def test_paired_interval_stays_above_minus_100_percent():
    # Changes -90%, -50%, -10%: the t-interval of the percent changes is -50 ± 4.303 * 40 / sqrt(3)
    # = [-149.4, +49.4], below -100% (a latency under zero). On log ratios ln 0.1, ln 0.5, ln 0.9:
    # mean -1.0336980 (geometric mean ratio 0.045^(1/3) = 0.3556893, -64.431%), sd 1.1374970,
    # half width 4.303 * 1.1374970 / sqrt(3) = 2.8259180: [exp(-3.859616) - 1, exp(1.792220) - 1]
    # = [-97.892%, +500.27%].
    iv = paired_interval([10.0, 50.0, 90.0], [100.0, 100.0, 100.0])
    assert iv.mean == pytest.approx(-64.431, abs=1e-3)
    assert iv.low == pytest.approx(-97.892, abs=2e-3) and iv.high == pytest.approx(500.27, abs=0.05)
    assert -100.0 < iv.low < iv.mean < iv.high


def test_paired_interval_matches_scipy_on_log_ratios():
    stats = pytest.importorskip("scipy.stats")
    import numpy as np

    rng = np.random.default_rng(32)
    for n in (2, 3, 5, 10):
        base = rng.uniform(0.5, 50.0, n)
        vals = base * rng.lognormal(0.0, 0.8, n)
        iv = paired_interval(list(vals), list(base))
        lo, hi = stats.t.interval(0.95, n - 1, loc=np.mean(np.log(vals / base)),
                                  scale=stats.sem(np.log(vals / base)))
        gm = stats.gmean(vals / base)
        assert iv.mean == pytest.approx(100 * (gm - 1), rel=1e-9, abs=1e-9)
        # 3-decimal t table against scipy's exact quantile.
        assert 1 + iv.low / 100 == pytest.approx(math.exp(lo), rel=2e-3)
        assert 1 + iv.high / 100 == pytest.approx(math.exp(hi), rel=2e-3)
        assert iv.low > -100.0


def test_paired_interval_rejects_zero_and_negative_values():
    for vals, base in (([0.0, 1.0], [1.0, 1.0]), ([1.0, 1.0], [1.0, 0.0]), ([-1.0, 1.0], [1.0, 1.0]),
                       ([math.nan, 1.0], [1.0, 1.0])):
        with pytest.raises(ValueError, match="log ratios needs finite values > 0"):
            paired_interval(vals, base)
    from routerd.bench import paired_interval_or_nan

    fb = paired_interval_or_nan([0.0, 2.0], [1.0, 1.0])
    assert math.isnan(fb.mean) and fb.low is None and fb.high is None
    assert fb.diffs == (-100.0, 100.0) and fb.n == 2


def test_t_table_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in list(range(1, 31)) + [35, 40, 50, 60, 90, 120, 200, 1000]:
        assert t975(df) == pytest.approx(stats.t.ppf(0.975, df), abs=2e-3), df


def test_seeds_report_paired_intervals_of_the_per_seed_runs(tmp_path, capsys):
    rc = main(["bench", "--limit", "40", "--seeds", "3", "--policies", "round_robin,join_shortest_queue",
               "--no-plot", "-o", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "seeds=0,1,2" in out and "[95% CI]" in out
    d = json.loads((tmp_path / "bench.json").read_text())
    assert d["seeds"] == [0, 1, 2] and len(d["per_seed"]) == 3
    assert "l_i = ln(policy_i / round_robin_i)" in out  # the method, under the interval table
    for metric in ("e2e_mean", "ttft_p90", "makespan"):
        pol = [s["results"][1][metric] for s in d["per_seed"]]
        rr = [s["results"][0][metric] for s in d["per_seed"]]
        ratios = [p / b for p, b in zip(pol, rr)]
        # Geometric mean of the ratios; the t-interval on their logs, transformed back.
        logs = [math.log(x) for x in ratios]
        half = 4.303 * statistics.stdev(logs) / math.sqrt(3)
        iv = d["intervals"]["join_shortest_queue"][metric]
        assert iv["mean_pct"] == pytest.approx(100 * (statistics.geometric_mean(ratios) - 1))
        assert iv["low_pct"] == pytest.approx(100 * (statistics.geometric_mean(ratios) * math.exp(-half) - 1))
        assert iv["high_pct"] == pytest.approx(100 * (statistics.geometric_mean(ratios) * math.exp(half) - 1))
        assert iv["per_seed_pct"] == pytest.approx([100 * (x - 1) for x in ratios])
    # The trace is re-windowed per seed: window i holds requests 40*i .. 40*i+39 of the trace.
    trace = load_workload("sample", limit=120).requests
    for i, s in enumerate(d["per_seed"]):
        fits = sum(1 for r in trace[40 * i:40 * (i + 1)] if r.prompt_tokens < get_profile(PROFILE).max_model_len)
        assert s["requests"] == fits
    assert len({s["results"][0]["makespan"] for s in d["per_seed"]}) == 3
    # The means row is the mean over seeds.
    assert d["results"][0]["e2e_mean"] == pytest.approx(statistics.mean(s["results"][0]["e2e_mean"]
                                                                        for s in d["per_seed"]))


def test_one_seed_is_the_plain_bench(tmp_path):
    assert main(["bench", "--limit", "60", "--policies", "round_robin;random", "--seed", "4", "--no-plot",
                 "-o", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "bench.json").read_text())
    assert "seeds" not in d and "per_seed" not in d
    direct = run_bench(load_workload("sample", limit=60).requests, get_profile(PROFILE), 4,
                       ["round_robin", "random"], seed=4)
    for row, r in zip(d["results"], direct.results):
        assert {k: row[k] for k in r.summary.as_dict()} == r.summary.as_dict()


def test_too_many_windows_is_a_one_line_error(tmp_path, capsys):
    rc = main(["bench", "--limit", "1500", "--seeds", "2", "--no-plot", "-o", str(tmp_path)])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "2000 requests cannot give 2 windows" in err
    assert not (tmp_path / "bench.json").exists()


# ------------------------------------------------------------------ per-request CSV


def _simulate(requests, spec, seed, m=4):
    profile = get_profile(PROFILE)
    policy = build_policy_from_spec(spec, PolicyContext(profile, m, seed=seed))
    prep = prepare_requests(requests, profile, seed=seed)
    return ClusterSimulator(profile, m, policy).run(prep.requests)


def test_request_csv_has_one_row_per_simulated_request_with_the_simulators_values(tmp_path):
    specs = ["round_robin", "power_of_two_choices"]
    assert main(["bench", "--limit", "30", "--seeds", "2", "--seed", "5", "--policies", ",".join(specs),
                 "--no-plot", "-o", str(tmp_path)]) == 0
    with open(tmp_path / "requests.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["policy", "seed", "request_id", "arrival_s", "instance", "prompt_tokens",
                             "output_tokens", "cached_tokens", "ttft_s", "e2e_s", "tpot_s", "preemptions"]
    trace = load_workload("sample", limit=60).requests
    windows = {5: trace[:30], 6: [r.model_copy(update={"id": j}) for j, r in enumerate(trace[30:60])]}
    expected = []
    for seed, reqs in windows.items():
        for spec in specs:
            for r in _simulate(reqs, spec, seed).requests:
                tpot = "" if r.output <= 1 else (r.finish_s - r.first_token_s) / (r.output - 1)
                expected.append((spec, seed, r.id, r.arrival_s, r.instance, r.prompt, r.output,
                                 getattr(r, "cached_tokens", -1), r.first_token_s - r.arrival_s,
                                 r.finish_s - r.arrival_s, tpot, r.preemptions))
    got = [(r["policy"], int(r["seed"]), int(r["request_id"]), float(r["arrival_s"]), int(r["instance"]),
            int(r["prompt_tokens"]), int(r["output_tokens"]), int(r["cached_tokens"]), float(r["ttft_s"]),
            float(r["e2e_s"]), "" if r["tpot_s"] == "" else float(r["tpot_s"]), int(r["preemptions"]))
           for r in rows]
    assert got == expected  # exact: floats are written in round-trip form
    assert len(rows) == sum(json.loads((tmp_path / "bench.json").read_text())["per_seed"][i]["requests"]
                            for i in range(2)) * len(specs)


# ------------------------------------------------------------------ prefix hit rate


def test_prefix_counters_and_hit_rate_column():
    inst = [SimpleNamespace(prefix_hits=30, prefix_queries=100), SimpleNamespace(prefix_hits=10, prefix_queries=60),
            SimpleNamespace()]  # an instance without counters counts 0 / 0
    assert prefix_counters(SimpleNamespace(instances=inst)) == (40, 160)
    assert prefix_counters(SimpleNamespace(instances=[SimpleNamespace()])) == (0, 0)
    run = _simulate(load_workload("sample", limit=20).requests, "round_robin", 0)
    s = summarize(run)
    hits, queries = prefix_counters(run)
    assert (s.prefix_hits, s.prefix_queries) == (hits, queries)
    assert s.prefix_hit_rate == (hits / queries if queries else None)
    assert s.ttft_p50 <= s.ttft_p90 <= s.ttft_p99

    def table(summary):
        b = BenchResult("w", "p", 1, "true", 0, 1, 0, 0, [PolicyResult("round_robin", summary, 0, 0, 0.0)])
        head, row = format_table(b).splitlines()[1:3]
        col = head.index("prefix hit %") + len("prefix hit %")
        return row[:col].split()[-1]

    from dataclasses import replace

    assert table(replace(s, prefix_hits=0, prefix_queries=0, prefix_hit_rate=None)) == "-"
    assert table(replace(s, prefix_hits=3, prefix_queries=8, prefix_hit_rate=3 / 8)) == "37.5"
    # Pooled over seeds: summed hits / summed queries, not the mean of the rates.
    b1 = BenchResult("w", "p", 1, "true", 0, 1, 0, 0,
                     [PolicyResult("round_robin", replace(s, prefix_hits=1, prefix_queries=10, prefix_hit_rate=0.1),
                                   0, 0, 0.0)])
    b2 = BenchResult("w", "p", 1, "true", 1, 1, 0, 0,
                     [PolicyResult("round_robin", replace(s, prefix_hits=9, prefix_queries=10, prefix_hit_rate=0.9),
                                   0, 0, 0.0)])
    assert SeedsResult([b1, b2]).mean_bench().results[0].summary.prefix_hit_rate == pytest.approx(0.5)


# ------------------------------------------------------------------ capacity at SLO


def _tiny():
    return load_workload("sample", limit=40).requests


def test_capacity_at_slo_meets_the_slo_and_tolerance_above_does_not():
    profile, reqs, tol = get_profile(PROFILE), _tiny(), 0.05
    limits = {"ttft_p90": 1.0, "tpot_p90": 0.08}
    cap = capacity_at_slo(reqs, profile, 2, "round_robin", limits, tol=tol)
    assert cap.rate_rps > 0 and cap.fail_rate_rps is not None
    assert cap.fail_rate_rps <= cap.rate_rps * (1 + tol) + 1e-12

    def summary_at(rate):
        return summarize(_simulate(rescale_to_rate(reqs, rate), "round_robin", 0, m=2))

    s = summary_at(cap.rate_rps)
    assert meets_slo(s, limits) and s == cap.summary
    assert s.ttft_p90 <= 1.0 and s.tpot_p90 <= 0.08
    assert not meets_slo(summary_at(cap.fail_rate_rps), limits)
    assert not meets_slo(summary_at(cap.rate_rps * (1 + tol)), limits)
    # Every probe's verdict is what a fresh simulation at that rate says.
    for rate, met in cap.probes[:3]:
        assert meets_slo(summary_at(rate), limits) == met
    assert mean_rate(rescale_to_rate(reqs, cap.rate_rps)) == pytest.approx(cap.rate_rps)


def test_looser_slo_never_gives_lower_capacity():
    profile, reqs = get_profile(PROFILE), _tiny()
    start = round_robin_capacity(reqs, profile, 2)
    # Limits from 1 s up: at low rates p90 TTFT is about 0.95 s here (long prompts prefilled alone).
    caps = [capacity_at_slo(reqs, profile, 2, "join_shortest_queue", {"ttft_p90": t, "tpot_p90": 0.1},
                            tol=0.05, start_rate=start).rate_rps for t in (1.0, 1.5, 3.0)]
    assert 0 < caps[0] <= caps[1] <= caps[2]
    again = capacity_at_slo(reqs, profile, 2, "join_shortest_queue", {"ttft_p90": 1.5, "tpot_p90": 0.1},
                            tol=0.05, start_rate=start)
    assert again.rate_rps == caps[1]  # seeded: reproducible


def test_unreachable_slo_gives_zero():
    # No request's TTFT can be under 1 µs: the SLO fails even with every request alone, so
    # no rate is probed (before, the rate was halved max_steps times first).
    cap = capacity_at_slo(_tiny(), get_profile(PROFILE), 2, "round_robin", {"ttft_p90": 1e-6}, max_steps=3)
    assert cap.rate_rps == 0.0 and cap.summary is None and cap.probes == []
    assert cap.infeasible and cap.bound_rps is None and cap.fail_rate_rps is None


def _lone_ttft_p90():
    """p90 TTFT of the simulated sample requests each alone: the prefill of the whole prompt
    in one iteration (profile.prefill_time; these prompts fit one chunk), by hand."""
    profile = get_profile(PROFILE)
    fits = [r for r in _tiny() if r.prompt_tokens < profile.max_model_len]
    assert max(r.prompt_tokens for r in fits) <= profile.max_num_batched_tokens  # one chunk each
    return statistics.quantiles([profile.prefill_time(r.prompt_tokens) for r in fits], n=10,
                                method="inclusive")[-1]


def test_slo_infeasible_even_alone_stops_at_once_and_names_the_value():
    # p90 TTFT alone is ~0.94 s here: 0.5 s cannot be met at any rate. Before, the search
    # halved the rate 16 times and reported a bare 0.
    profile, limits = get_profile(PROFILE), {"ttft_p90": 0.5, "tpot_p90": 0.08}
    cap = capacity_at_slo(_tiny(), profile, 2, "round_robin", limits, tol=0.05)
    lone = _lone_ttft_p90()
    assert 0.5 < lone < 1.0
    assert cap.infeasible and cap.rate_rps == 0.0 and cap.probes == [] and cap.summary is None
    assert cap.isolated.ttft_p90 == pytest.approx(lone, rel=1e-9)
    assert cap.violations(limits) == {"ttft_p90": pytest.approx(lone, rel=1e-9)}  # TPOT alone is within
    d = cap.as_dict()
    assert d["infeasible"] is True and d["rate_rps"] == 0.0 and d["evaluations"] == 0
    assert d["isolated_summary"]["ttft_p90"] == pytest.approx(lone, rel=1e-9)


def test_isolated_requests_do_not_overlap():
    from routerd.bench import isolated_requests

    profile, reqs = get_profile(PROFILE), _tiny()
    alone = isolated_requests(reqs, profile)
    gap = alone[1].arrival_s
    lone = [profile.lone_request_time(r.prompt_tokens, r.output_tokens) for r in reqs]
    assert gap == pytest.approx(2 * max(lone))
    assert [r.arrival_s for r in alone] == pytest.approx([i * gap for i in range(len(reqs))])
    assert [r.id for r in alone] == [r.id for r in reqs]
    run = _simulate(alone, "round_robin", 0, m=2)
    # Each request ran on an idle instance: its E2E is the lone-request formula's on the tokens
    # simulated (outputs cut at max_model_len), and under the gap.
    assert len(run.requests) > 30
    for r in run.requests:
        assert r.finish_s - r.arrival_s == pytest.approx(profile.lone_request_time(r.prompt, r.output), rel=1e-9)
        assert r.finish_s - r.arrival_s < gap


def test_feasible_slo_keeps_the_isolated_run_and_is_not_flagged():
    cap = capacity_at_slo(_tiny(), get_profile(PROFILE), 2, "round_robin", {"ttft_p90": 1.0, "tpot_p90": 0.08},
                          tol=0.05)
    assert not cap.infeasible and cap.rate_rps > 0
    assert cap.isolated.ttft_p90 == pytest.approx(_lone_ttft_p90(), rel=1e-9)
    assert cap.violations({"ttft_p90": 1.0, "tpot_p90": 0.08}) == {}


def test_capacity_cli_prints_an_infeasible_slo(tmp_path, capsys):
    rc = main(["bench", "--limit", "40", "--instances", "2", "--policies", "round_robin,join_shortest_queue",
               "--capacity-slo", "ttft_p90=0.5,tpot_p90=0.08", "--no-plot", "-o", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    note = (f"p90 TTFT {_lone_ttft_p90():.3g} s > 0.5 s even with every request alone: no rate meets this SLO; "
            f"raise the limit")
    assert f"(infeasible) round_robin: {note}" in out and f"(infeasible) join_shortest_queue: {note}" in out
    assert "0.000 (infeasible)" in out and "failed even at the lowest rate probed" not in out
    d = json.loads((tmp_path / "capacity.json").read_text())["results"]
    assert all(r[0]["infeasible"] is True and r[0]["rate_rps"] == 0.0 and r[0]["probes"] == [] for r in d.values())


def test_parse_slo():
    assert parse_slo("ttft_p90=2, tpot_p90=0.05") == {"ttft_p90": 2.0, "tpot_p90": 0.05}
    for bad in ("", "ttft_p90", "ttft_p95=1", "ttft_p90=-1", "ttft_p90=nan", "ttft_p90=1,ttft_p90=2",
                "ttft_p90=x"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_capacity_slo_cli_writes_json_and_plot(tmp_path, capsys):
    rc = main(["bench", "--limit", "40", "--instances", "2", "--policies", "round_robin,join_shortest_queue",
               "--capacity-slo", "ttft_p90=1,tpot_p90=0.08", "--slo-tolerance", "0.05", "-o", str(tmp_path / "o"),
               "--plot", str(tmp_path / "p")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "capacity at SLO" in out and "vs round_robin" in out
    d = json.loads((tmp_path / "o" / "capacity.json").read_text())
    direct = capacity_at_slo(_tiny(), get_profile(PROFILE), 2, "round_robin", {"ttft_p90": 1.0, "tpot_p90": 0.08},
                             tol=0.05)
    assert d["results"]["round_robin"][0]["rate_rps"] == pytest.approx(direct.rate_rps)
    assert (tmp_path / "p" / "capacity.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args", [["--capacity-slo", "ttft_p95=1"], ["--capacity-slo", "ttft_p90=1", "--rate", "3"],
                                  ["--capacity-slo", "ttft_p90=1", "--slo-tolerance", "0"],
                                  ["--load", "0"], ["--load", "1.5", "--rate", "2"], ["--seeds", "0"],
                                  ["--capacity-slo", "ttft_p90=1", "--jobs", "0"]])
def test_bad_bench_options_are_one_line_errors(tmp_path, capsys, args):
    assert main(["bench", "--limit", "10", "--no-plot", "-o", str(tmp_path)] + args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("phasewise: error:") and "\n" not in err


# ------------------------------------------------------------------ --max-model-len


def test_max_model_len_override_is_revalidated():
    p = get_profile(PROFILE)
    q = with_max_model_len(p, 1024)
    assert q.max_model_len == 1024 and q.kv_capacity_tokens == p.kv_capacity_tokens
    with pytest.raises(ProfileError, match="cannot hold one request of max_model_len=40000"):
        with_max_model_len(p, 40000)
    with pytest.raises(ProfileError, match="max_num_batched_tokens must be >= max_model_len"):
        with_max_model_len(p, 8192)  # the V100 profile has no chunked prefill and a 4,096-token budget


@pytest.mark.parametrize("value, text", [("40000", "cannot hold one request"), ("0", "must be >= 1"),
                                         ("8192", "max_num_batched_tokens")])
def test_max_model_len_errors_exit_2_with_nothing_written(tmp_path, capsys, value, text):
    out = tmp_path / "o"
    assert main(["bench", "--limit", "10", "--max-model-len", value, "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and text in err and "max_model_len" in err.replace("-", "_")
    assert not out.exists()


def test_max_model_len_changes_which_requests_are_rejected(tmp_path, capsys):
    assert main(["bench", "--limit", "100", "--max-model-len", "1024", "--policies", "round_robin", "--no-plot",
                 "-o", str(tmp_path)]) == 0
    assert "max_model_len=1024" in capsys.readouterr().out
    d = json.loads((tmp_path / "bench.json").read_text())
    reqs = load_workload("sample", limit=100).requests
    assert d["max_model_len"] == 1024
    assert d["rejected"] == sum(1 for r in reqs if r.prompt_tokens >= 1024) > 0


# ------------------------------------------------------------------ --load


def test_load_sets_the_rate_relative_to_round_robin_capacity(tmp_path):
    assert main(["bench", "--limit", "60", "--load", "1.5", "--policies", "round_robin", "--no-plot",
                 "-o", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "bench.json").read_text())
    reqs = load_workload("sample", limit=60).requests
    cap = round_robin_capacity(reqs, get_profile(PROFILE), 4)
    assert d["load"]["capacity_rps"] == [pytest.approx(cap)]
    assert d["load"]["rate_rps"] == [pytest.approx(1.5 * cap)]
    with open(tmp_path / "requests.csv", newline="") as f:
        arrivals = {int(r["request_id"]): float(r["arrival_s"]) for r in csv.DictReader(f)}
    scale = mean_rate(reqs) / (1.5 * cap)
    for r in reqs:
        if r.id in arrivals:
            assert arrivals[r.id] == pytest.approx(r.arrival_s * scale)


# ------------------------------------------------------------------ plots


@pytest.mark.parametrize("seeds", ["1", "2"])
def test_plots_written(tmp_path, seeds):
    assert main(["bench", "--limit", "40", "--seeds", seeds, "--policies", "round_robin,join_shortest_queue",
                 "--no-plot", "-o", str(tmp_path / "o"), "--plot", str(tmp_path / "p")]) == 0
    for name in ("change.png", "ttft_cdf.png", "e2e_cdf.png"):
        data = (tmp_path / "p" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    assert not (tmp_path / "o" / "bench.png").exists()


# ------------------------------------------------------------------ capacity bounded by the sample


def test_capacity_never_exceeds_the_samples_steady_rate_bound():
    # 40 requests and a loose SLO: even all 40 at once drain within it, so without a bound
    # the search doubled the rate 16 times (65,536x round robin's capacity).
    from routerd.bench import STEADY_LIFETIMES, steady_rate_bound

    profile, reqs = get_profile(PROFILE), _tiny()
    limits = {"ttft_p90": 1000.0, "tpot_p90": 10.0}
    for spec in ("round_robin", "join_shortest_queue"):
        cap = capacity_at_slo(reqs, profile, 2, spec, limits, tol=0.05)
        iso = cap.isolated
        # requests / (4 lifetimes), by hand from the isolated run's p90 E2E
        assert cap.bound_rps == pytest.approx(iso.requests / (STEADY_LIFETIMES * iso.e2e_p90))
        assert cap.bound_rps == pytest.approx(steady_rate_bound(iso.requests, iso))
        assert cap.at_bound and cap.fail_rate_rps is None and cap.rate_rps == pytest.approx(cap.bound_rps)
        assert max(rate for rate, _ in cap.probes) <= cap.bound_rps * (1 + 1e-12)
        assert meets_slo(cap.summary, limits)
        assert cap.as_dict()["at_bound"] is True


def test_capacity_below_the_bound_is_not_flagged():
    cap = capacity_at_slo(_tiny(), get_profile(PROFILE), 2, "round_robin", {"ttft_p90": 1.0, "tpot_p90": 0.08},
                          tol=0.05)
    assert not cap.at_bound and cap.fail_rate_rps is not None
    assert cap.rate_rps < cap.bound_rps


def test_capacity_cli_notes_a_sample_too_short(tmp_path, capsys):
    rc = main(["bench", "--limit", "40", "--instances", "2", "--policies", "round_robin",
               "--capacity-slo", "ttft_p90=1000", "--slo-tolerance", "0.05", "-o", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    fits = sum(1 for r in _tiny() if r.prompt_tokens < get_profile(PROFILE).max_model_len)  # simulated ones
    assert "(bound)" in out and f"the sample is too short to find the SLO limit ({fits} requests)" in out
    assert "run more requests" in out and "(>=)" not in out
    r = json.loads((tmp_path / "capacity.json").read_text())["results"]["round_robin"][0]
    assert r["at_bound"] is True and r["rate_rps"] == r["bound_rps"]


# ------------------------------------------------------------------ --seeds on a short trace


def _trace(tmp_path, prompts):
    p = tmp_path / "trace.csv"
    rows = "".join(f"2023-11-16 18:15:{10 + i:02d}.0000000,{n},5\n" for i, n in enumerate(prompts))
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows)
    return str(p)


def test_too_few_requests_for_the_seeds_states_the_rule(tmp_path, capsys):
    rc = main(["bench", "--workload", _trace(tmp_path, [10, 20, 30]), "--seeds", "3", "--no-plot",
               "-o", str(tmp_path / "o")])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "of 1 requests" not in err
    assert "each window needs at least 2 requests" in err and "3 seeds need at least 6 requests" in err
    rc = main(["bench", "--limit", "1", "--seeds", "2", "--no-plot", "-o", str(tmp_path / "o")])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert "--limit 1" in err and "at least 2 requests" in err
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------ many rejected requests


@pytest.mark.parametrize("long, noted", [(3, True), (1, False)])
def test_many_rejected_requests_give_a_note(tmp_path, capsys, long, noted):
    # max_model_len of llama2-7b-v100 is 4096: prompts of 5000 tokens are rejected.
    prompts = [5000] * long + [100] * (10 - long)
    rc = main(["bench", "--workload", _trace(tmp_path, prompts), "--policies", "round_robin", "--no-plot",
               "-o", str(tmp_path / "o")])
    assert rc == 0
    err = capsys.readouterr().err
    assert json.loads((tmp_path / "o" / "bench.json").read_text())["rejected"] == long
    if noted:  # 30% > 10%
        assert f"{long} of 10 requests" in err and "(30%)" in err and "max_model_len=4096" in err
        assert "--profile llama3.1-8b-h100" in err and "--max-model-len" in err
    else:  # 10% is not more than 10%
        assert "rejected" not in err


# ------------------------------------------------------------------ Δ labels over seeds


def test_change_of_means_and_mean_of_paired_changes_are_labelled_apart():
    from dataclasses import replace

    from routerd.bench_report import format_intervals

    s = summarize(_simulate(load_workload("sample", limit=10).requests, "round_robin", 0))
    # Round robin p90 TTFT 10 s and 100 s over two seeds, the policy 5 s and 110 s: the change
    # of the means is (57.5 - 55) / 55 = +4.5%, the paired change the geometric mean of the
    # ratios 0.5 and 1.1, sqrt(0.55) = 0.7416198, i.e. -25.8%.
    runs = [BenchResult("w", "p", 1, "true", seed, 1, 0, 0,
                        [PolicyResult("round_robin", replace(s, ttft_p90=rr), 0, 0, 0.0),
                         PolicyResult("jsq", replace(s, ttft_p90=pol), 0, 0, 0.0)])
            for seed, rr, pol in ((0, 10.0, 5.0), (1, 100.0, 110.0))]
    seeds = SeedsResult(runs)
    table = format_table(seeds.mean_bench()).splitlines()
    col = table[1].index("ΔTTFT p90 % of means") + len("ΔTTFT p90 % of means")
    assert table[3][:col].split()[-1] == "+4.5"
    ivs = format_intervals(seeds).splitlines()
    head = "paired Δp90 TTFT % [95% CI]"
    assert head in ivs[1] and "of the means" in ivs[0]
    start = ivs[1].index(head)
    assert ivs[2][start:start + len(head)].split()[0] == "-25.8"
    assert ivs[3].startswith("Δ % [95% CI] = 100·(exp(mean(l)) - 1)") and "geometric mean" in ivs[3]
    # One seed: the plain table keeps the plain headings.
    assert "of means" not in format_table(runs[0])


# ------------------------------------------------------------------ capacity at SLO: shared work, parallel


def _slots(r):
    return {k: getattr(r, k) for k in type(r).__slots__ if k != "features"}


def test_prepared_fresh_equals_preparing_the_retimed_requests_again():
    from routerd.sim.prepare import prepare_requests as prep_fn

    # Prefix identity with clipped outputs (shared-prefix: 2,200-token prompts, 200-token outputs,
    # max_model_len 2,300), and the sample on the V100 profile (rejected prompts), both with
    # noisy predictions (a seeded draw per request).
    cases = [(with_max_model_len(get_profile("llama3.1-8b-h100"), 2300),
              load_workload("shared-prefix", n=60, rate=5.0, seed=3).requests),
             (get_profile(PROFILE), load_workload("sample", limit=200).requests)]
    for prof, reqs in cases:
        base = prep_fn(reqs, prof, prediction="noisy:0.5", seed=7)
        assert base.rejected or (base.clipped and all(r.prefix is not None for r in base.requests))
        for rate in (0.5, 40.0):
            moved = rescale_to_rate(reqs, rate)
            again = prep_fn(moved, prof, prediction="noisy:0.5", seed=7)
            fresh = base.fresh([r.arrival_s for r in moved])
            assert [_slots(r) for r in fresh.requests] == [_slots(r) for r in again.requests]
            assert (fresh.rejected, fresh.clipped, fresh.kept) == (again.rejected, again.clipped, again.kept)
            assert all(a is not b for a, b in zip(fresh.requests, base.requests))  # new objects
        # A run mutates its requests; a fresh copy starts from the prepared state again.
        run = ClusterSimulator(prof, 2, build_policy_from_spec("round_robin", PolicyContext(prof, 2))).run(
            base.fresh().requests)
        assert all(r.finish_s > 0 for r in run.requests)
        assert [_slots(r) for r in base.fresh().requests] == \
            [_slots(r) for r in prep_fn(reqs, prof, prediction="noisy:0.5", seed=7).requests]


def test_capacities_in_parallel_equal_the_serial_searches():
    from routerd.bench import SloSearch, capacities_at_slo

    prof = get_profile("llama3.1-8b-h100")
    # Limits that the 80 requests can find (below the steady-rate bound): capacities 8.6-12.7 req/s.
    limits = {"ttft_p90": 0.1, "tpot_p90": 0.01}
    specs = ["round_robin", "late_binding", "llmd", "dynamo_kv"]
    draws = [load_workload("shared-prefix", n=80, rate=5.0, seed=s).requests for s in (0, 1)]

    def searches():
        return [SloSearch(reqs, prof, 2, limits, seed=s, tol=0.05) for s, reqs in zip((0, 1), draws)]

    serial = capacities_at_slo(searches(), specs, jobs=1)
    parallel = capacities_at_slo(searches(), specs, jobs=2)
    assert [list(d) for d in parallel] == [specs, specs]
    assert [{k: c.as_dict() for k, c in d.items()} for d in parallel] == \
        [{k: c.as_dict() for k, c in d.items()} for d in serial]
    # ... and both equal capacity_at_slo, policy by policy (the searches as one call each).
    for s, reqs, d in zip((0, 1), draws, serial):
        for spec in specs:
            one = capacity_at_slo(reqs, prof, 2, spec, limits, seed=s, tol=0.05)
            assert one.as_dict() == d[spec].as_dict()
    found = [c for d in serial for c in d.values()]
    assert all(c.rate_rps > 0 and c.fail_rate_rps is not None and not c.at_bound for c in found)  # real searches
    # Round robin's saturated throughput was the first probe of every policy (computed once).
    for s, d, srch in zip((0, 1), serial, searches()):
        start = round_robin_capacity(draws[s], prof, 2)
        assert srch.start_rate == start
        for c in d.values():
            if c.probes:
                assert c.probes[0][0] == min(start, c.bound_rps)


def test_capacities_reject_bad_jobs_and_specs_before_simulating():
    from routerd.bench import SloSearch, capacities_at_slo
    from routerd.policies.registry import PolicyError

    search = SloSearch(_tiny(), get_profile(PROFILE), 2, {"ttft_p90": 1.0})
    with pytest.raises(ValueError, match="jobs must be >= 1"):
        capacities_at_slo([search], ["round_robin"], jobs=0)
    with pytest.raises(PolicyError):
        capacities_at_slo([search], ["round_robin", "no_such_policy"], jobs=2)
    assert search._prepared == {}  # nothing was simulated


def test_capacity_cli_jobs_gives_the_same_json(tmp_path):
    args = ["bench", "--limit", "40", "--instances", "2", "--policies", "round_robin,join_shortest_queue,late_binding",
            "--capacity-slo", "ttft_p90=1,tpot_p90=0.08", "--slo-tolerance", "0.05", "--seeds", "2"]
    assert main(args + ["--jobs", "1", "-o", str(tmp_path / "a")]) == 0
    assert main(args + ["--jobs", "2", "-o", str(tmp_path / "b")]) == 0
    a = json.loads((tmp_path / "a" / "capacity.json").read_text())
    b = json.loads((tmp_path / "b" / "capacity.json").read_text())
    assert a == b and a["results"]["round_robin"][0]["rate_rps"] > 0


def test_capacity_search_equals_the_old_serial_path():
    # benchmarks/capacity_slo_speed.py keeps the search as it was before issue 32 (re-preparing
    # every probe, the isolated schedule per policy); the shared-work search gives the same results.
    from conftest import load_benchmark

    old = load_benchmark("capacity_slo_speed").old_capacity_at_slo
    prof = get_profile("llama3.1-8b-h100")
    reqs = load_workload("shared-prefix", n=80, rate=5.0, seed=1).requests
    for spec in ("round_robin", "late_binding", "llmd"):
        for limits in ({"ttft_p90": 0.1, "tpot_p90": 0.01}, {"ttft_p90": 0.01}):
            a = old(reqs, prof, 2, spec, limits, tol=0.05)
            b = capacity_at_slo(reqs, prof, 2, spec, limits, tol=0.05)
            assert a.as_dict() == b.as_dict()
    a = old(_tiny(), get_profile(PROFILE), 2, "join_shortest_queue", {"ttft_p90": 1.0, "tpot_p90": 0.08}, tol=0.05)
    b = capacity_at_slo(_tiny(), get_profile(PROFILE), 2, "join_shortest_queue", {"ttft_p90": 1.0, "tpot_p90": 0.08},
                        tol=0.05)
    assert a.as_dict() == b.as_dict() and a.rate_rps > 0


def test_a_zero_metric_gives_no_interval_but_the_report_and_plot_still_render(tmp_path):
    from dataclasses import replace

    from routerd.bench_report import format_intervals, plot_changes

    s = summarize(_simulate(load_workload("sample", limit=10).requests, "round_robin", 0))
    # The policy's p90 TTFT is 0 in seed 1: no log ratio there (the plain changes are -50% and -100%).
    runs = [BenchResult("w", "p", 1, "true", seed, 1, 0, 0,
                        [PolicyResult("round_robin", replace(s, ttft_p90=rr), 0, 0, 0.0),
                         PolicyResult("jsq", replace(s, ttft_p90=pol), 0, 0, 0.0)])
            for seed, rr, pol in ((0, 10.0, 5.0), (1, 100.0, 0.0))]
    seeds = SeedsResult(runs)
    iv = seeds.intervals()["jsq"]["ttft_p90"]
    assert math.isnan(iv.mean) and iv.low is None and iv.diffs == (-50.0, -100.0)
    assert seeds.intervals()["jsq"]["e2e_mean"].mean == 0.0  # the other metrics are unaffected
    text = format_intervals(seeds)
    assert "n/a" in text and "has no log ratio" in text
    assert plot_changes(seeds, tmp_path / "change.png")
    assert (tmp_path / "change.png").read_bytes()[:4] == b"\x89PNG"
