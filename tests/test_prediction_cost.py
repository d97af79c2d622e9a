"""benchmarks/prediction_cost.py: its pure helpers by hand, option errors, and one tiny run."""

from __future__ import annotations

import json

import pytest

from conftest import load_benchmark
from routerd.bench import paired_interval

pc = load_benchmark("prediction_cost")


def test_parse_loads():
    assert pc.parse_loads("1.5,2") == (1.5, 2.0)
    assert pc.parse_loads(" 0.8 , ") == (0.8,)
    for bad, word in (("", "no loads"), ("1.5,x", "'x'"), ("0", "'0'"), ("-1", "'-1'"), ("inf", "'inf'"),
                      ("nan", "'nan'"), ("2,2.0", "twice")):
        with pytest.raises(ValueError, match=word):
            pc.parse_loads(bad)


def test_bucket_accuracy_by_hand():
    # Edges 250/1000/4000: 10 -> 0, 300 -> 1, 999 -> 1, 1000 -> 2, 5000 -> 3.
    pairs = [(0, 10), (1, 300), (0, 999), (3, 1000), (3, 5000), (None, 10), (None, 300)]
    a = pc.bucket_accuracy(pairs)
    assert a.as_tuple() == (7, 3, 1, 1, 2, 2)  # requests, correct, under, over, unassigned, true bucket 0
    assert a.share(a.correct) == pytest.approx(3 / 5)  # shares of the 5 that got a bucket
    d = a.as_dict()
    assert (d["accuracy"], d["under_share"], d["over_share"]) == pytest.approx((0.6, 0.2, 0.2))
    # Other edges: 10 is bucket 1 of (5,), so bucket 1 is right there and bucket 0 too low.
    assert pc.bucket_accuracy([(1, 10), (0, 10)], edges=(5,)).as_tuple() == (2, 1, 1, 0, 0, 0)


def test_accuracy_of_no_prediction_and_pooling():
    none = pc.bucket_accuracy([(None, 10), (None, 4000)])
    assert none.share(none.correct) is None and none.unassigned == 2 and none.true_bucket0 == 1
    both = none + pc.bucket_accuracy([(0, 10)])
    assert both.as_tuple() == (3, 1, 0, 0, 2, 2)
    assert both.share(both.correct) == 1.0


def test_prompt_overlap():
    assert pc.prompt_overlap(["a", "b", "a", None, "c"], {"a", "c", "z"}) == (3, 2, 3)
    assert pc.prompt_overlap([None], {"a"}) == (0, 0, 0)


def test_iv_text_and_render():
    iv = paired_interval([11.0, 12.0, 13.0], [10.0, 10.0, 10.0])  # +10, +20, +30 %
    # Geometric mean ratio (1.1 * 1.2 * 1.3)^(1/3) = 1.716^(1/3) = 1.1972158 (+19.7%); log ratios
    # 0.0953102, 0.1823216, 0.2623643: mean 0.1799987, sd 0.0835512, half width
    # 4.303 * 0.0835512 / sqrt(3) = 0.2075694: exp(-0.0275707) - 1 = -2.72%, exp(0.3875681) - 1 = +47.34%.
    assert pc.iv_text(iv.as_dict()) == "+19.7 [-2.7, +47.3]"
    assert iv.low == pytest.approx(-2.7194, abs=2e-3) and iv.high == pytest.approx(47.34, abs=5e-3)
    assert pc.iv_text(paired_interval([9.0], [10.0]).as_dict()) == "-10.0"
    assert pc.iv_text(None) == "-"
    text = pc.render(["policy", "x"], [["rr", "1.0"], ["late_binding", "12.5"]])
    assert text.splitlines() == ["policy           x", "rr             1.0", "late_binding  12.5"]
    md = pc.render(["policy", "x"], [["rr", "1.0"]], markdown=True)
    assert md.splitlines() == ["| policy | x |", "|---|---:|", "| rr | 1.0 |"]


@pytest.mark.parametrize("argv, words", [
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["-n", "1"], "-n must be >= 2"),
    (["--instances", "0"], "--instances must be >= 1"),
    (["--loads", "1.5,abc"], "--loads: load 'abc'"),
    (["--predictor", " "], "--predictor is empty"),
    (["--out", "table.txt"], "give a .md or .json"),
    (["--out", "/nonexistent-folder/x.md"], "does not exist"),
    (["--seeds", "two"], "invalid int value"),
])
def test_bad_options_are_one_line_errors(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        pc.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert words in err[-1] and "Traceback" not in "\n".join(err)


def test_unknown_predictor_is_one_line_error(capsys, data_dir, tmp_path):
    out = tmp_path / "x.json"
    with pytest.raises(SystemExit) as e:
        pc.main(["--predictor", str(tmp_path / "missing"), "-n", "20", "--seeds", "1", "--out", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "unknown predictor" in err[-1]
    assert not out.exists()  # nothing half-written


def test_tiny_run(data_dir, tmp_path, capsys):
    out = tmp_path / "pc.json"
    assert pc.main(["-n", "40", "--seeds", "2", "--loads", "1.5", "--predictor", "majority",
                    "--data-dir", str(data_dir), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "round_robin" in printed and "predictor:majority" in printed
    acc = res["accuracy"]
    # True buckets are right by construction; no prediction assigns no bucket.
    assert acc["true"]["pooled"]["accuracy"] == 1.0 and acc["true"]["pooled"]["requests"] == 80
    assert acc["none"]["pooled"]["unassigned"] == 80
    # The majority baseline predicts bucket 0 (the most frequent) for every request: exactly the
    # requests whose true bucket is 0 are right, and none is predicted too high.
    maj = acc["predictor:majority"]["pooled"]
    assert maj["correct"] == maj["true_bucket0"] == acc["true"]["pooled"]["true_bucket0"]
    assert maj["over"] == 0 and maj["under"] == 80 - maj["correct"]
    split = res["predictor_accuracy_by_training_split"]
    assert sum(v["pooled"]["requests"] for v in split.values()) == 80
    assert sum(res["leakage"]["requests_seen"]) == split["prompt in training split"]["pooled"]["requests"]
    (ld,) = res["loads"]
    # Round robin reads no prediction: its figures must not depend on the mode.
    assert ld["round_robin_identical_across_modes"] is True
    assert ld["rate_rps"] == pytest.approx([1.5 * c for c in ld["capacity_rps"]])
    specs = res["settings"]["policies"]
    assert len(ld["rows"]) == 3 * len(specs)
    for r in ld["rows"]:
        assert r["vs_round_robin"]["e2e_mean"]["n"] == 2
        assert (r["vs_true"] is None) == (r["mode"] == "true")
        if r["policy"] == "round_robin":
            assert r["vs_round_robin"]["e2e_mean"]["mean_pct"] == 0.0
