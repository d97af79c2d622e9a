"""benchmarks/rl_eval.py: the interval and paired-change arithmetic by hand, and one tiny run."""

from __future__ import annotations

import json
import math

import pytest

from conftest import load_benchmark, policy_params, split_checkpoint
from routerd.policies.base import PolicyContext

rl_eval = load_benchmark("rl_eval")


def test_t_quantiles_from_the_table():
    assert rl_eval.t_quantile_975(1) == 12.706
    assert rl_eval.t_quantile_975(4) == 2.776
    assert rl_eval.t_quantile_975(30) == 2.042
    assert rl_eval.t_quantile_975(31) == 1.96
    with pytest.raises(ValueError):
        rl_eval.t_quantile_975(0)


def test_interval_by_hand():
    # [1..5]: mean 3, sample variance (4+1+0+1+4)/4 = 2.5, df 4 -> t = 2.776.
    iv = rl_eval.interval([1, 2, 3, 4, 5])
    assert iv.mean == 3.0
    assert iv.half_width == pytest.approx(2.776 * math.sqrt(2.5) / math.sqrt(5), rel=1e-12)
    d = iv.as_dict()
    assert (d["low"], d["high"]) == pytest.approx((3 - iv.half_width, 3 + iv.half_width))
    # Two values 10, 14: mean 12, s = sqrt(8), df 1 -> 12.706 * sqrt(8) / sqrt(2) = 25.412.
    assert rl_eval.interval([10, 14]).half_width == pytest.approx(25.412, rel=1e-12)
    # Constant samples have no spread.
    assert rl_eval.interval([7.0, 7.0, 7.0]).half_width == 0.0
    with pytest.raises(ValueError):
        rl_eval.interval([1.0])


def test_paired_change_by_hand():
    # 90 vs 100 -> -10%; 120 vs 100 -> +20%; 50 vs 40 -> +25%.
    ch = rl_eval.paired_change_pct([90, 120, 50], [100, 100, 40])
    assert ch == pytest.approx([-10.0, 20.0, 25.0])
    # The interval is over the per-sample changes, not the change of the means.
    iv = rl_eval.interval(ch)
    assert iv.mean == pytest.approx(35 / 3)
    s = math.sqrt(((-10 - 35 / 3) ** 2 + (20 - 35 / 3) ** 2 + (25 - 35 / 3) ** 2) / 2)
    assert iv.half_width == pytest.approx(4.303 * s / math.sqrt(3))
    with pytest.raises(ValueError):
        rl_eval.paired_change_pct([1.0], [1.0, 2.0])


def test_best_heuristic_matches_trainer():
    pytest.importorskip("gymnasium")  # routerd.rl.train needs the 'rl' extra
    from routerd.rl.train import BEST_HEURISTIC

    assert rl_eval.BEST_HEURISTIC == BEST_HEURISTIC


def test_tiny_run_json(tmp_path, capsys):
    out = tmp_path / "e.json"
    ck2 = policy_params("dqn", 2)["checkpoint"]
    ck3 = policy_params("dqn", 3)["checkpoint"]
    res = rl_eval.main(["--quick", "--seeds", "2", "--requests", "60", "--settings", "paper-mix",
                        "--instances", "2", "--policies", "round_robin,min_min", "--no-progress",
                        "--checkpoint", f"rand={ck2}", "--checkpoint", f"other={ck3}", "--out", str(out)])
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["settings"] == json.loads(json.dumps(res["settings"]))
    (s,) = data["settings"]
    assert (s["setting"], s["instances"], s["requests"], s["seeds"]) == ("paper-mix/2", 2, 60, 2)
    # Generators run at the paper rate: 5 req/s per instance.
    assert s["offered_rate_rps"] == [10.0, 10.0]
    assert s["load"] == pytest.approx(sum(10.0 / c for c in s["capacity_rps"]) / 2)
    # The 3-instance checkpoint is skipped with a note, not an error.
    assert list(s["policies"]) == ["round_robin", "min_min", "dqn rand"]
    assert any("other skipped" in n for n in s["notes"]) and "other skipped" in printed
    for p in s["policies"].values():
        assert set(p["metrics"]) == set(rl_eval.METRICS) | set(rl_eval.CHANGES)
        for k in rl_eval.METRICS:
            v = p["metrics"][k]
            assert len(p["per_sample"][k]) == 2
            assert v["mean"] == pytest.approx(sum(p["per_sample"][k]) / 2)
            assert v["low"] <= v["mean"] <= v["high"]
    rr = s["policies"]["round_robin"]["metrics"]
    for k in rl_eval.CHANGES:
        assert rr[k]["mean"] == 0.0 and rr[k]["half_width"] == 0.0 and rr[k]["per_sample"] == [0.0, 0.0]
    mm = s["policies"]["min_min"]
    assert mm["metrics"]["e2e_mean_change_pct"]["per_sample"] == pytest.approx(
        [100 * (a - b) / b for a, b in zip(mm["per_sample"]["e2e_mean"],
                                           s["policies"]["round_robin"]["per_sample"]["e2e_mean"])])
    assert "== paper-mix/2:" in printed and "+0.0±0.0" in printed


def test_training_seeds_route_their_own_samples(tmp_path, capsys):
    """Under one label, held-out sample i is routed by seed folder i mod k: each per-sample
    figure equals the one of that folder evaluated alone."""
    a = split_checkpoint(tmp_path / "paper-baseline-m2-s0", 2, -1.0)  # every request to instance 0
    b = split_checkpoint(tmp_path / "paper-baseline-m2-s1", 2, 0.2)  # > ~205 prompt tokens to instance 0
    split_checkpoint(tmp_path / "paper-baseline-m3-s0", 3, 0.2)
    (tmp_path / "paper-baseline-m2-s2").mkdir()  # unfinished run: no metadata.json
    res = rl_eval.main(["--seeds", "3", "--requests", "60", "--settings", "paper-mix", "--instances", "2",
                        "--policies", "round_robin", "--no-progress", "--out", str(tmp_path / "e.json"),
                        "--checkpoint", f"a={a}", "--checkpoint", f"b={b}", "--table-dir", str(tmp_path)])
    capsys.readouterr()
    (s,) = res["settings"]
    pol = s["policies"]
    assert list(pol) == ["round_robin", "dqn a", "dqn b", "dqn paper baseline"]
    seeds = pol["dqn paper baseline"]["per_sample"]["e2e_mean"]
    alone_a, alone_b = pol["dqn a"]["per_sample"]["e2e_mean"], pol["dqn b"]["per_sample"]["e2e_mean"]
    assert alone_a != alone_b  # the two networks route differently, so the check below can fail
    assert seeds == [alone_a[0], alone_b[1], alone_a[2]]
    # The 3-instance folder is kept for 3-instance settings; the unfinished one is left out.
    assert [c["instances"] for c in res["checkpoints"]["paper baseline"]] == [2, 2, 3]
    assert any("2 training seeds" in n for n in s["notes"])


def test_table_dir_refuses_an_empty_folder(tmp_path):
    with pytest.raises(rl_eval.UsageError, match="no finished"):
        rl_eval.table_dir_items(str(tmp_path))
    with pytest.raises(rl_eval.UsageError, match="not a folder"):
        rl_eval.table_dir_items(str(tmp_path / "missing"))


@pytest.mark.parametrize("argv, needle", [
    (["--checkpoint", "b=/nonexistent/ck"], "/nonexistent/ck"),
    (["--checkpoint", "nolabel"], "LABEL=DIR"),
    (["--checkpoint", "x=,"], "LABEL=DIR"),
    (["--checkpoint", "x=default,default"], "listed twice"),
    (["--policies", "round_robin,dqn", "--instances", "4,8"], "8"),
    (["--table-dir", "/nonexistent/t"], "/nonexistent/t"),
    (["--settings", "nope"], "nope"),
    (["--seeds", "1"], "--seeds"),
    (["--policies", "min_min"], "round_robin"),
    (["--instances", "4,x"], "--instances"),
])
def test_bad_input_exits_2_with_one_line(argv, needle, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        rl_eval.main(["--quick", "--no-progress", "--out", str(tmp_path / "x.json"), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err


def _t_quantile_975_by_integration(df: int) -> float:
    """t_{0.975, df} from the Student-t density alone: Simpson's rule on [0, x] and bisection."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def mass(x: float, n: int = 2000) -> float:  # P(0 < T < x)
        h = x / n
        f = [c * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i in range(n + 1)]
        return h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    lo, hi = 0.0, 20.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mass(mid) < 0.475 else (lo, mid)
    return (lo + hi) / 2


@pytest.mark.parametrize("df", [2, 4, 9])
def test_t_table_agrees_with_a_numerical_integration(df):
    # The table has 3 decimals: it must be the rounded quantile.
    assert abs(rl_eval.t_quantile_975(df) - _t_quantile_975_by_integration(df)) <= 0.0005


def test_out_that_is_a_folder_is_refused_before_the_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        rl_eval.main(["--quick", "--no-progress", "--requests", "20", "--settings", "paper-mix",
                      "--instances", "2", "--out", str(tmp_path)])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert "== paper-mix" not in out  # nothing was simulated
    assert len(err.strip().splitlines()) == 1 and "--out" in err


def test_trace_setting_without_data_is_refused_before_any_setting_runs(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        rl_eval.main(["--quick", "--no-progress", "--requests", "20", "--settings", "paper-mix,azure-code",
                      "--instances", "2", "--data-dir", str(tmp_path / "none"), "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert "== paper-mix" not in out
    assert len(err.strip().splitlines()) == 1


@pytest.mark.usefixtures("data_dir")  # reads the shared traces: skipped without them
def test_a_trace_too_short_for_the_samples_gets_smaller_disjoint_windows_or_a_usage_error(tmp_path, capsys):
    from routerd.rl import splits

    reqs = splits._trace("azure-code", None)
    cut = int(len(reqs) * splits.TRAIN_FRACTION)
    held_out = len(reqs) - cut
    a = rl_eval.parse_args(["--settings", "paper-mix,azure-code", "--instances", "2", "--seeds", "2",
                            "--requests", str(held_out + 1), "--out", str(tmp_path / "x.json")])
    rl_eval.validate(a)
    n = held_out // 2
    assert a.eval_requests == {"azure-code": n}
    assert f"2 disjoint held-out samples of {n} requests" in capsys.readouterr().out
    # The two windows are consecutive stretches of the held-out part, sharing no request.
    w0, w1 = (splits.sample("azure-code", "eval", i, n, None) for i in (0, 1))
    assert [r.prompt_tokens for r in w0] == [r.prompt_tokens for r in reqs[cut:cut + n]]
    assert [r.prompt_tokens for r in w1] == [r.prompt_tokens for r in reqs[cut + n:cut + 2 * n]]
    with pytest.raises(ValueError, match="would repeat"):
        splits.sample("azure-code", "eval", 2, n, None)
    a = rl_eval.parse_args(["--settings", "azure-code", "--instances", "2", "--seeds", str(held_out),
                            "--out", str(tmp_path / "x.json")])
    with pytest.raises(rl_eval.UsageError, match="azure-code"):
        rl_eval.validate(a)


def _makespan_bound_module():
    return load_benchmark("makespan_bound")


@pytest.mark.parametrize("chunked", [True, False])
def test_makespan_bound_is_below_the_simulated_makespan_with_prefill_attention(chunked):
    # Prefill attention only: a chunked prefill of 256 tokens in 16-token chunks costs
    # sum_k 16 * 16k = 34,816 token^2, about half of the unchunked 256^2 = 65,536. The
    # bound must stay below what the simulator reaches.
    from conftest import toy_profile
    from routerd.model import Request
    from routerd.policies.round_robin import RoundRobin
    from routerd.sim import ClusterSimulator, prepare_requests
    from routerd.sim.report import summarize

    mb = _makespan_bound_module()
    prof = toy_profile(overhead_s=0.0, prefill_per_token_s=0.0, prefill_attn_s=1e-3, decode_per_seq_s=0.0,
                       decode_per_ctx_token_s=0.0, chunked_prefill=chunked, max_model_len=512,
                       max_num_batched_tokens=16 if chunked else 512)
    reqs = prepare_requests([Request(id=0, arrival_s=0.0, prompt_tokens=256, output_tokens=1)], prof).requests
    bound = mb.makespan_lower_bound(prof, 1, reqs)
    run_reqs = prepare_requests([Request(id=0, arrival_s=0.0, prompt_tokens=256, output_tokens=1)], prof).requests
    makespan = summarize(ClusterSimulator(prof, 1, RoundRobin(PolicyContext(prof, 1))).run(run_reqs)).makespan
    assert bound <= makespan + 1e-9
    # and it is the least work: 1-token chunks give sum_k k = p (p + 1) / 2; unchunked p^2
    assert bound == pytest.approx(1e-3 * (256 * 257 / 2 if chunked else 256 * 256))


def test_makespan_bound_by_kv_share_by_hand_and_below_simulated_runs():
    # Overhead only (a = 0.01 s), KV capacity 1024 tokens, 8 slots. One request, p = 40,
    # o = 11: ten decode steps with contexts 41..50 (sum 455). Charged by slot:
    # 10 * 0.01 / 8 = 0.0125 s; by KV share: 0.01 * 455 / (1024 + 8) = 0.0044089 s.
    from conftest import toy_profile
    from routerd.model import Request
    from routerd.policies.base import PolicyContext as Ctx
    from routerd.policies.registry import build_policy_from_spec
    from routerd.sim import ClusterSimulator, prepare_requests
    from routerd.sim.report import summarize

    mb = _makespan_bound_module()
    prof = toy_profile(prefill_per_token_s=0.0, decode_per_seq_s=0.0, decode_per_ctx_token_s=0.0)
    one = prepare_requests([Request(id=0, arrival_s=0.0, prompt_tokens=40, output_tokens=11)], prof).requests
    assert mb.makespan_lower_bound(prof, 1, one, overhead_by_kv=False) == pytest.approx(0.0125)
    assert mb.makespan_lower_bound(prof, 1, one, overhead_by_kv=True) == pytest.approx(0.01 * 455 / 1032)
    assert mb.makespan_lower_bound(prof, 1, one) == pytest.approx(0.0125)

    # Long contexts fill the 1024-token cache long before the 8 slots: the KV charge binds,
    # and it stays below what any policy reaches in the simulator (full profile costs).
    import numpy as np

    rng = np.random.default_rng(3)
    prof = toy_profile(max_model_len=512, max_num_batched_tokens=512)
    reqs = [Request(id=i, arrival_s=0.01 * i, prompt_tokens=int(rng.integers(150, 250)),
                    output_tokens=int(rng.integers(5, 24))) for i in range(120)]
    prep = prepare_requests(reqs, prof).requests
    by_slot = mb.makespan_lower_bound(prof, 2, prep, overhead_by_kv=False)
    by_kv = mb.makespan_lower_bound(prof, 2, prep, overhead_by_kv=True)
    assert by_kv > by_slot
    for spec in ("round_robin", "late_binding", "join_shortest_queue"):
        policy = build_policy_from_spec(spec, Ctx(prof, 2, seed=0))
        makespan = summarize(ClusterSimulator(prof, 2, policy).run(prepare_requests(reqs, prof).requests)).makespan
        assert by_kv <= makespan
