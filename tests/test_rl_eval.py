"""benchmarks/rl_eval.py: the interval and paired-change arithmetic by hand, and one tiny run."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from conftest import policy_params

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "rl_eval.py"
_spec = importlib.util.spec_from_file_location("rl_eval", _PATH)
rl_eval = importlib.util.module_from_spec(_spec)
sys.modules["rl_eval"] = rl_eval  # dataclasses look their module up while the class is built
_spec.loader.exec_module(rl_eval)


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


@pytest.mark.parametrize("argv, needle", [
    (["--checkpoint", "b=/nonexistent/ck"], "/nonexistent/ck"),
    (["--checkpoint", "nolabel"], "LABEL=DIR"),
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
