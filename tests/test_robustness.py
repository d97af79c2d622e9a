"""The robustness grid (``routerd.robustness``, ``benchmarks/robustness.py``).

Checked: bad input is one line on stderr and exit 2 before anything runs; a tiny grid writes
the cell files it should and a second invocation reuses them (the runner is replaced by one that
fails if called); an interrupted grid resumes with only the unfinished cells; a candidate added
later runs only its own runs; the aggregation (best other policy, the loss rule, the TTFT rule,
the geometric mean over cells) on synthetic cell data computed by hand; and the classification of
policies into prediction readers and prediction-blind ones, including that a blind policy's run
does not change with the buckets.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from routerd import robustness as rb
from routerd.robustness import (
    ANCHORS,
    DEFAULT_POLICIES,
    PREDICTION_BLIND,
    PREDICTION_READERS,
    TRUE,
    Cell,
    GridConfig,
    cell_path,
    format_summary,
    full_column,
    geometric_mean,
    main,
    summarize,
)

REPO = Path(__file__).resolve().parents[1]
TINY = ["--workloads", "conversations", "--pools", "2xllama3.1-8b-h100", "--loads", "1.5", "--seeds", "2",
        "--policies", "round_robin", "lmetric", "phasewise", "-n", "60", "--jobs", "1", "--no-plot"]


def never(_args):
    raise AssertionError("a cell ran although its file was complete")


def one_line_exit_2(capsys, argv, words, out=None):
    rc = main(argv + ["--out", str(out)] if out is not None else argv, runner=never)
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("robustness.py: error: "), err
    assert words in err, err
    return err


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(("argv", "words"), [
    (["--workloads", "conversations", "nosuch"], "workload 'nosuch': unknown workload 'nosuch'"),
    (["--workloads", "conversations:colour=red"], "conversations option 'colour' is not a parameter"),
    (["--pools", "4xnosuch-gpu"], "pool '4xnosuch-gpu'"),
    (["--pools", "llama3.1-8b-h100"],
     "pool 'llama3.1-8b-h100': pool item 'llama3.1-8b-h100': expected COUNT x PROFILE"),
    (["--policies", "round_robin", "nosuch"], "policy 'nosuch': unknown policy 'nosuch'"),
    (["--policy-spec", "phasewise:nosuch=1"], "policy 'phasewise:nosuch=1'"),
    (["--loads", "0"], "load 0.0 is not a multiple of round robin's capacity in (0, 1000]"),
    (["--loads", "1e308"], "load 1e+308 is not a multiple of round robin's capacity in (0, 1000]"),
    (["--loads", "1", "1.0"], "--loads: 1.0 is given twice"),
    (["--workloads", "conversations", "conversations"], "--workloads: 'conversations' is given twice"),
    (["--policy-spec", "lmetric"], "--policy-spec 'lmetric' is also in --policies"),
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["-n", "1"], "--limit must be an integer >= 2"),
    (["--prediction", "predictor:/no/such/folder"], "--prediction predictor:/no/such/folder"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, argv, words):
    # The tiny grid's arguments, the flags argv names replaced by argv's values.
    flags = {a for a in argv if a.startswith("-")}
    kept, i = [], 0
    while i < len(TINY):
        if TINY[i] in flags:
            i += 1
            while i < len(TINY) and not TINY[i].startswith("-"):
                i += 1
            continue
        kept.append(TINY[i])
        i += 1
    one_line_exit_2(capsys, kept + argv, words, out=tmp_path / "o")
    assert not list((tmp_path / "o").glob("cells/*.json"))


def test_unwritable_output_folder(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    one_line_exit_2(capsys, TINY + ["--out", ""], "--out is empty")  # not the current folder
    assert not (tmp_path / "cells").exists()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    one_line_exit_2(capsys, TINY, "--out", out=blocker / "sub")
    one_line_exit_2(capsys, TINY, "cannot be written", out=blocker)


def test_cli_script_bad_input_exit_2(tmp_path):
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "robustness.py"), "--out", str(tmp_path / "o"),
                        "--workloads", "conversations", "--pools", "3xnope"],  # no data folder needed
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and "pool '3xnope'" in p.stderr


# --------------------------------------------------------------------------- a tiny grid


def test_tiny_grid_writes_cells_and_reuses_them(capsys, tmp_path):
    out = tmp_path / "o"
    assert main(TINY + ["--out", str(out)]) == 0
    files = sorted((out / "cells").iterdir())
    assert [f.suffix for f in files] == [".json"]  # one cell, no temporary file left over
    config = rb.config_from_args(rb.build_parser().parse_args(TINY + ["--out", str(out)]))
    cell = Cell("conversations", "2xllama3.1-8b-h100", 1.5)
    assert files[0] == cell_path(out, cell, config)
    data = json.loads(files[0].read_text())
    assert data["seeds"] == [0, 1] and data["requests_per_seed"] == 60 and data["instances"] == 2
    assert set(data["columns"]) == {"predictor:default", TRUE}
    assert list(data["columns"]["predictor:default"]) == ["round_robin", "lmetric", "phasewise"]
    assert list(data["columns"][TRUE]) == ["phasewise"]  # only the prediction reader is re-run
    for e in data["columns"]["predictor:default"].values():
        assert all(len(v) == 2 for v in e["per_seed"].values())
        assert e["mean"]["e2e_mean"] == pytest.approx(sum(e["per_seed"]["e2e_mean"]) / 2)
    iv = data["intervals"]["predictor:default"]["phasewise"]
    assert iv["best_other"] in ("round_robin", "lmetric") and iv["vs_best"]["e2e_mean"]["n"] == 2
    assert set(iv["vs"]) == {"round_robin", "lmetric"}
    assert (out / "summary.md").exists() and (out / "summary.json").exists()
    assert "| phasewise | predictor:default | 1 |" in capsys.readouterr().out

    # Second invocation: nothing runs, the file is untouched.
    mtime = files[0].stat().st_mtime_ns
    assert main(TINY + ["--out", str(out)], runner=never) == 0
    assert files[0].stat().st_mtime_ns == mtime
    assert "1 done, 0 to run" in capsys.readouterr().out

    # A candidate added later: only its runs (a reader: both columns) run, the rest is kept.
    more = TINY + ["--out", str(out), "--policy-spec", "phasewise:interference_weight=0.2"]
    calls = []

    def counting(args):
        cell, data2 = rb._run_one(args)
        calls.append(data2["ran"])
        return cell, data2

    assert main(more, runner=counting) == 0
    assert calls == [2]
    new = json.loads(files[0].read_text())
    for spec in ("round_robin", "lmetric", "phasewise"):
        old_runs, new_runs = data["columns"]["predictor:default"], new["columns"]["predictor:default"]
        assert new_runs[spec]["per_seed"] == old_runs[spec]["per_seed"]
    assert "phasewise:interference_weight=0.2" in new["columns"][TRUE]
    text = (out / "summary.md").read_text()
    assert "## phasewise:interference_weight=0.2, predictions: predictor:default" in text


def test_interrupted_grid_resumes_without_redoing_finished_cells(tmp_path):
    out = tmp_path / "o"
    argv = TINY[:] + ["--out", str(out)]
    argv[argv.index("--loads") + 1: argv.index("--loads") + 2] = ["1.0", "1.5"]
    seen = []

    def dies_on_second(args):
        seen.append(args[0])
        if len(seen) == 2:
            raise KeyboardInterrupt
        return rb._run_one(args)

    assert main(argv, runner=dies_on_second) == 130  # a one-line message, no traceback
    assert len(list((out / "cells").glob("*.json"))) == 1
    assert not [p for p in (out / "cells").iterdir() if p.suffix != ".json"]
    again = []

    def counting(args):
        again.append(args[0])
        return rb._run_one(args)

    assert main(argv, runner=counting) == 0
    assert again == [seen[1]]  # only the cell that had not finished
    assert len(list((out / "cells").glob("*.json"))) == 2


def test_cells_in_parallel_processes_match_one_process(tmp_path):
    argv = TINY[:]
    argv[argv.index("--loads") + 1: argv.index("--loads") + 2] = ["1.0", "1.5"]
    argv[argv.index("--jobs") + 1] = "2"
    assert main(argv + ["--out", str(tmp_path / "a")]) == 0
    argv[argv.index("--jobs") + 1] = "1"
    assert main(argv + ["--out", str(tmp_path / "b")]) == 0
    for f in sorted((tmp_path / "a" / "cells").iterdir()):
        a = json.loads(f.read_text())
        b = json.loads((tmp_path / "b" / "cells" / f.name).read_text())
        assert {c: {s: e["per_seed"] for s, e in v.items()} for c, v in a["columns"].items()} == \
            {c: {s: e["per_seed"] for s, e in v.items()} for c, v in b["columns"].items()}


# --------------------------------------------------------------------------- aggregation by hand


def entry(values, ttft=None):
    per = {m: list(values) for m in rb.METRICS}
    per["ttft_p90"] = list(ttft if ttft is not None else values)
    return {"per_seed": per, "mean": {m: sum(v) / len(v) for m, v in per.items()}}


def cell(workload, policies, true=None, pool="4xllama3.1-8b-h100", load=1.5):
    return {"version": rb.FORMAT_VERSION, "workload": workload, "pool": pool, "load": load,
            "prediction": "predictor:default",
            "columns": {"predictor:default": policies, **({TRUE: true} if true is not None else {})}}


def test_best_other_loss_rule_and_ttft_rule_by_hand():
    base = [10.0, 20.0, 30.0]
    c = cell("w", {
        "round_robin": entry([40.0, 50.0, 60.0]),
        "lmetric": entry(base, ttft=[1.0, 1.0, 1.0]),
        "llmd": entry([11.0, 22.0, 33.0]),
        # +10% every seed (a hair of spread): the interval lies wholly above +1% -> a loss.
        "phasewise": entry([11.0, 22.0, 33.0001], ttft=[1.04, 1.04, 1.04]),
    })
    [s] = summarize([c], ["phasewise"], "predictor:default")
    [r] = s.rows
    assert r.best == "lmetric"  # lowest mean E2E among the non-candidates (20.0)
    assert r.e2e["mean_pct"] == pytest.approx(10.0, abs=0.01)
    assert r.e2e["low_pct"] > 1.0 and r.loss is True
    assert r.ttft_p90_pct == pytest.approx(4.0) and r.ttft_ok is True  # +4% <= +5%
    assert r.anchor_ratio["lmetric"] == pytest.approx(66.0001 / 3 / 20.0)
    assert r.anchor_ratio["llmd"] == pytest.approx(66.0001 / 66.0)

    # +0.5% every seed: the interval lies below +1% -> not a loss; TTFT +6% -> a violation.
    c["columns"]["predictor:default"]["phasewise"] = entry([10.05, 20.1, 30.1501], ttft=[1.06] * 3)
    [s] = summarize([c], ["phasewise"], "predictor:default")
    assert s.rows[0].loss is False and s.rows[0].ttft_ok is False and s.ttft_violations == 1
    assert s.rows[0].e2e["high_pct"] < 1.0

    # Spread across 0 (-20%, +30%): not a loss although the mean is above +1%.
    c["columns"]["predictor:default"]["phasewise"] = entry([8.0, 26.0, 33.0])
    [s] = summarize([c], ["phasewise"], "predictor:default")
    assert s.rows[0].e2e["mean_pct"] > 1.0 and s.rows[0].e2e["low_pct"] < 0 and s.rows[0].loss is False

    # A zero has no log ratio: the change of the means (7.5 vs 5), no bounds, no verdict.
    zero = cell("w", {"lmetric": entry([10.0, 0.0]), "phasewise": entry([12.0, 3.0])})
    [s] = summarize([zero], ["phasewise"], "predictor:default")
    assert s.rows[0].e2e == {"mean_pct": pytest.approx(50.0), "low_pct": None, "high_pct": None, "n": 2}
    assert s.rows[0].loss is None

    # One seed: no interval, so no verdict.
    one = cell("w", {"lmetric": entry([10.0]), "phasewise": entry([12.0])})
    [s] = summarize([one], ["phasewise"], "predictor:default")
    assert s.rows[0].e2e["low_pct"] is None and s.rows[0].loss is None and s.losses == 0


def test_candidates_are_not_each_others_best_other():
    c = cell("w", {"lmetric": entry([10.0, 10.0]), "phasewise": entry([5.0, 5.0]),
                   "phasewise:x=1": entry([6.0, 6.0])})
    out = summarize([c], ["phasewise", "phasewise:x=1"], "predictor:default")
    assert [s.candidate for s in out] == ["phasewise", "phasewise:x=1"]
    assert [s.rows[0].best for s in out] == ["lmetric", "lmetric"]


def test_geometric_mean_over_cells_by_hand():
    assert geometric_mean([0.9, 1.0, 0.81]) == pytest.approx(0.9)
    with pytest.raises(ValueError):
        geometric_mean([])
    with pytest.raises(ValueError):
        geometric_mean([1.0, 0.0])
    # phasewise / lmetric = 0.9, 1.0, 0.81 -> 0.9 (meets <= 0.97); / llmd = 1.0, 1.0, 0.95 -> 0.983 (misses).
    cells = [cell(f"w{k}", {"lmetric": entry([100.0, 100.0]), "llmd": entry([100.0 * r_lm / r_llmd] * 2),
                            "phasewise": entry([100.0 * r_lm] * 2)})
             for k, (r_lm, r_llmd) in enumerate(((0.9, 1.0), (1.0, 1.0), (0.81, 0.95)))]
    [s] = summarize(cells, ["phasewise"], "predictor:default")
    assert s.geomean_ratio("lmetric") == pytest.approx(0.9)
    assert s.geomean_ratio("llmd") == pytest.approx((1.0 * 1.0 * 0.95) ** (1 / 3))
    assert s.geomean_ratio("dynamo_kv") is None  # not in the cells
    d = s.as_dict()
    assert d["anchor_target_met"]["lmetric"] is True and d["anchor_target_met"]["llmd"] is False
    text = format_summary([s], seeds=2, limit=10)
    assert "0.900" in text and "0.983 (miss)" in text


def test_true_column_takes_blind_policies_from_the_main_column():
    main_col = {"round_robin": entry([10.0, 10.0]), "lmetric": entry([8.0, 8.0]), "phasewise": entry([9.0, 9.0])}
    c = cell("w", main_col, true={"phasewise": entry([7.0, 7.0])})
    col = full_column(c, TRUE)
    assert col["lmetric"] is main_col["lmetric"] and col["round_robin"] is main_col["round_robin"]
    assert col["phasewise"]["mean"]["e2e_mean"] == 7.0
    [s] = summarize([c], ["phasewise"], TRUE)
    assert s.rows[0].best == "lmetric" and s.rows[0].e2e["mean_pct"] == pytest.approx(-12.5)
    text = format_summary([s], seeds=2, limit=10)
    assert "| w | 4xllama3.1-8b-h100 | 1.5 | lmetric | -12.5" in text


def test_plot_is_optional(tmp_path, monkeypatch):
    c = cell("w", {"lmetric": entry([10.0, 11.0]), "phasewise": entry([9.0, 10.5])})
    s = summarize([c], ["phasewise"], "predictor:default")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert rb.plot_summary(s, tmp_path / "p.png") is False and not (tmp_path / "p.png").exists()


# --------------------------------------------------------------------------- configuration


def test_default_grid_is_the_issue_grid():
    c = GridConfig()
    assert len(c.cells()) == 7 * 7 * 3 and len(c.seeds) >= 3
    assert set(ANCHORS) <= set(c.policies) and {"late_binding", "join_shortest_queue", "predicted_latency",
                                                  "phasewise", "round_robin"} <= set(c.policies)
    assert c.columns() == ("predictor:default", TRUE)
    assert [s for col, s in c.runs() if col == TRUE] == ["late_binding", "join_shortest_queue",
                                                        "predicted_latency", "phasewise"]
    from routerd.profiles import parse_pool
    for p in c.pools:
        parse_pool(p)


def test_every_policy_is_classified():
    from routerd.policies.registry import POLICIES

    assert PREDICTION_READERS.isdisjoint(PREDICTION_BLIND)
    assert PREDICTION_READERS | PREDICTION_BLIND == set(POLICIES)


def test_blind_policies_ignore_the_buckets():
    """The reason a blind policy is not re-run under ``true``: its run is the same whatever the
    buckets (every bucket 0 against the true ones)."""
    from routerd.bench import load_to_rate, run_bench, seed_workloads
    from routerd.profiles import get_profile

    prof = get_profile("llama3.1-8b-h100")
    reqs = seed_workloads("conversations", [0], limit=150)[0].requests
    reqs, _, _ = load_to_rate(reqs, prof, 3, 1.5)
    zero = [r.model_copy(update={"predicted_bucket": 0}) for r in reqs]
    blind = [s for s in DEFAULT_POLICIES if s in PREDICTION_BLIND]
    assert blind == ["round_robin", "llmd", "sglang_cache_aware", "dynamo_kv", "lmetric", "queue_kv_scorer"]
    a = run_bench(reqs, prof, 3, blind, prediction="true")
    b = run_bench(zero, prof, 3, blind, prediction="given")
    for x, y in zip(a.results, b.results):
        assert x.summary == y.summary, x.spec
    assert not math.isnan(a.results[0].summary.e2e_mean)


def test_a_cell_is_what_phasewise_bench_measures(tmp_path, capsys):
    """A cell's runs are ``phasewise bench --load X --seeds S --limit N --prediction
    predictor:default`` on the same pool, number for number (so any cell can be re-run alone)."""
    from routerd.cli import main as cli_main

    argv = ["--workload", "conversations", "--instances", "2xllama3.1-8b-h100", "--load", "1.5", "--seeds", "2",
            "--limit", "60", "--prediction", "predictor:default", "--policies", "round_robin,lmetric,phasewise",
            "--out", str(tmp_path / "bench"), "--no-plot"]
    assert cli_main(["bench", *argv]) == 0
    assert main(TINY + ["--out", str(tmp_path / "grid"), "--no-true"]) == 0
    capsys.readouterr()
    bench = json.loads((tmp_path / "bench" / "bench.json").read_text())
    [f] = (tmp_path / "grid" / "cells").iterdir()
    grid = json.loads(f.read_text())["columns"]["predictor:default"]
    for i, run in enumerate(bench["per_seed"]):
        for r in run["results"]:
            for m in ("e2e_mean", "ttft_p90", "tpot_mean", "makespan"):
                assert grid[r["policy"]]["per_seed"][m][i] == r[m], (r["policy"], m, i)


def test_leave_one_workload_out_by_hand():
    from routerd.robustness import leave_one_workload_out

    # Ratios to the best other policy (lmetric at 100 s in every cell), per workload:
    #        a     b     c
    # A     0.80  0.90  1.20
    # B     0.90  0.95  0.90
    # Without a: A's geomean over b, c = sqrt(0.90 * 1.20) = 1.039 > B's sqrt(0.95 * 0.90) = 0.925 -> B,
    # held out 0.90. Without b: A sqrt(0.8 * 1.2) = 0.980 > B sqrt(0.9 * 0.9) = 0.9 -> B, held out 0.95.
    # Without c: A sqrt(0.8 * 0.9) = 0.849 < B sqrt(0.9 * 0.95) = 0.925 -> A, held out 1.20 (a loss).
    table = {"A": (0.80, 0.90, 1.20), "B": (0.90, 0.95, 0.90)}
    cells = [cell(w, {"lmetric": entry([100.0, 100.0]),
                      "phasewise": entry([100.0 * table["A"][k]] * 2),
                      "phasewise:x=1": entry([100.0 * table["B"][k]] * 2)})
             for k, w in enumerate("abc")]
    sums = summarize(cells, ["phasewise", "phasewise:x=1"], "predictor:default")
    folds = {f.workload: f for f in leave_one_workload_out(sums)}
    assert {w: f.chosen for w, f in folds.items()} == {"a": "phasewise:x=1", "b": "phasewise:x=1", "c": "phasewise"}
    assert folds["a"].train_geomean == pytest.approx(math.sqrt(0.95 * 0.90))
    assert folds["a"].held_out_geomean == pytest.approx(0.90)
    assert folds["b"].held_out_geomean == pytest.approx(0.95)
    assert folds["c"].train_geomean == pytest.approx(math.sqrt(0.8 * 0.9))
    assert folds["c"].held_out_geomean == pytest.approx(1.20)
    assert "## Leave one workload out, predictions: predictor:default" in format_summary(sums, seeds=2, limit=10)
    assert leave_one_workload_out(sums[:1]) == []  # one candidate: nothing to choose


def test_a_cell_file_of_the_wrong_shape_runs_again(tmp_path, capsys):
    out = tmp_path / "o"
    argv = TINY[:] + ["--out", str(out)]
    assert main(argv) == 0
    [path] = list((out / "cells").glob("*.json"))
    good = json.loads(path.read_text())
    for broken in ({**good, "columns": []}, {**good, "load": "1.5"},
                   {k: v for k, v in good.items() if k != "workload"}):
        path.write_text(json.dumps(broken))
        assert rb.read_cell(path) is None  # counted as missing: runs again, no crash in the summary
    ran = []

    def counting(args):
        ran.append(args[0])
        return rb._run_one(args)

    assert main(argv, runner=counting) == 0 and len(ran) == 1
    assert rb.read_cell(path) is not None


def test_a_cell_that_cannot_run_names_itself(tmp_path, capsys):
    def fails(args):
        raise rb.CellError(f"cell {args[0].label}: mean rate is undefined")

    assert main(TINY[:] + ["--out", str(tmp_path / "o")], runner=fails) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cell conversations | 2xllama3.1-8b-h100 | 1.5x" in err, err
