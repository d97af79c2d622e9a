"""``phasewise bench`` end to end: outputs, and one-line errors with exit code 2 on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from routerd.cli import main


def test_bench_writes_table_json_and_plot(tmp_path, capsys):
    rc = main(["bench", "--limit", "120", "--policies", "round_robin,join_shortest_queue", "-o", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "round_robin" in out and "join_shortest_queue" in out
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["workload"] == "sample"
    assert data["requests"] + data["rejected"] == 120
    assert [r["policy"] for r in data["results"]] == ["round_robin", "join_shortest_queue"]
    rr = data["results"][0]
    assert rr["e2e_mean_change_pct"] == 0.0
    assert rr["requests"] == data["requests"]
    assert rr["e2e_p50"] <= rr["e2e_p90"] <= rr["e2e_p99"]
    png = (tmp_path / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_is_reproducible(tmp_path):
    args = ["bench", "--limit", "80", "--policies", "random;power_of_two_choices", "--no-plot", "--seed", "3"]
    assert main(args + ["-o", str(tmp_path / "a")]) == 0
    assert main(args + ["-o", str(tmp_path / "b")]) == 0
    strip = lambda d: [{k: v for k, v in r.items() if k != "wall_s"} for r in d["results"]]
    a = json.loads((tmp_path / "a" / "bench.json").read_text())
    b = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert strip(a) == strip(b)


def test_study8_reports_optimum_random_worst(tmp_path, capsys):
    assert main(["bench", "--study8", "--policies", "round_robin", "-o", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "study8.json").read_text())
    assert d["optimum_sum_e2e_s"] <= d["random_mean_sum_e2e_s"] <= d["worst_sum_e2e_s"]
    assert d["optimum_sum_e2e_s"] <= d["policies_sum_e2e_s"]["round_robin"] <= d["worst_sum_e2e_s"]
    assert len(d["requests"]) == 8
    assert all(10 <= r["prompt_tokens"] <= 100 and 10 <= r["output_tokens"] <= 100 for r in d["requests"])


def _bad_csv(tmp_path: Path, body: str) -> str:
    p = tmp_path / "trace.csv"
    p.write_text(body)
    return str(p)


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--policies", "no_such_policy"], ["no_such_policy", "round_robin"]),
        (["--policies", "power_of_two_choices:bogus=1"], ["power_of_two_choices", "bogus"]),
        (["--profile", "h100-imaginary"], ["h100-imaginary", "llama2-7b-v100"]),
        (["--workload", "nope"], ["nope", "azure-conv"]),
        (["--prediction", "psychic"], ["psychic", "noisy"]),
        (["--instances", "0"], ["--instances"]),
    ],
)
def test_bad_names_exit_2_with_one_line(tmp_path, capsys, args, expect):
    rc = main(["bench", "--limit", "10", "--no-plot", "-o", str(tmp_path)] + args)
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("phasewise: error:")
    for word in expect:
        assert word in err


@pytest.mark.parametrize(
    "body, expect",
    [
        ("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.6805900,10\n", ["GeneratedTokens"]),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,ten,5\n", ["row 2", "ContextTokens"]),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,10,-5\n", ["row 2", "GeneratedTokens"]),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:47.0000000,10,5\n"
         "2023-11-16 18:15:46.0000000,10,5\n", ["row 3", "TIMESTAMP"]),
    ],
)
def test_bad_trace_exit_2_naming_file_row_field(tmp_path, capsys, body, expect):
    path = _bad_csv(tmp_path, body)
    rc = main(["bench", "--workload", path, "--no-plot", "-o", str(tmp_path / "o")])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "trace.csv" in err
    for word in expect:
        assert word in err


def test_console_entry_point_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "routerd", "bench", "--policies", "nope", "-o", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "nope" in proc.stderr


def test_given_prediction_without_predictions_is_a_clear_error(tmp_path, capsys):
    assert main(["bench", "--limit", "20", "--prediction", "given", "--no-plot", "-o", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "carries no predictions" in err and "predictor:" in err


def test_bench_records_which_predictor_made_the_predictions(tmp_path, capsys):
    pytest.importorskip("sklearn")  # the 'predictor' extra (the baselines fit with scikit-learn)
    rc = main(["bench", "--limit", "30", "--policies", "round_robin", "--prediction", "predictor:majority",
               "--no-plot", "-o", str(tmp_path)])
    if rc == 2 and "data" in capsys.readouterr().err:
        pytest.skip("no shared data directory for the baseline's training split")
    assert rc == 0
    assert "prediction=predictor:majority" in capsys.readouterr().out
    assert json.loads((tmp_path / "bench.json").read_text())["prediction"] == "predictor:majority"


def test_out_that_is_a_file_fails_before_simulating(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["bench", "--limit", "20", "-o", str(f)]) == 2
    assert "not a folder" in capsys.readouterr().err


def test_policies_command_lists_parameters(capsys):
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    assert "late_binding [default]" in out and "reserve_fraction = 0.05" in out
    assert "decode_balancer [oracle]" in out
    # Docstring markup is for Sphinx, not the terminal.
    assert "``" not in out and ":func:" not in out and ":class:" not in out
    assert "ctx.near_tie" in out


def test_plain_strips_docstring_markup():
    from routerd.cli import _plain

    assert _plain("see ``a.b`` and :func:`~routerd.x.kv_wait_s`,\n  :class:`Foo`") == "see a.b and kv_wait_s, Foo"


@pytest.mark.parametrize(
    "profile_text, expect",
    [
        ("overhead_s: .inf\n", "overhead_s"),
        ("kv_capacity_tokens: 1024\n", "cannot hold one request"),
        ("name: [unclosed\n", "not valid YAML at line"),
    ],
)
def test_bad_profile_files_exit_2(tmp_path, capsys, profile_text, expect):
    from routerd.profiles import _profiles_dir

    base = (_profiles_dir() / "llama2-7b-v100.yaml").read_text()
    key = profile_text.split(":")[0]
    lines = [ln for ln in base.splitlines() if not ln.startswith(key + ":")]
    path = tmp_path / "p.yaml"
    path.write_text(profile_text + "\n".join(lines) + "\n")
    assert main(["bench", "--limit", "10", "--profile", str(path), "--no-plot", "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert expect in err and err.count("\n") == 0


def test_all_requests_rejected_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "long.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,5000,5\n")
    assert main(["bench", "--workload", str(path), "--no-plot", "-o", str(tmp_path / "o")]) == 2
    assert "rejected" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--policies", "queue_kv_scorer:queue_weight=inf"],
                                  ["--action-interval", "1e-9"], ["--prediction", "noisy:"],
                                  ["--prediction", "true:0.5"]])
def test_non_finite_or_degenerate_numbers_are_refused(tmp_path, capsys, args):
    assert main(["bench", "--limit", "10", "--no-plot", "-o", str(tmp_path)] + args) == 2
    assert capsys.readouterr().err.startswith("phasewise: error:")


@pytest.mark.parametrize("args, expect", [(["--rate", "0"], "--rate must be a finite number of requests/s > 0, got 0.0"),
                                          (["--rate", "nan"], "--rate must be"),
                                          (["--limit", "0"], "--limit must be a positive number of requests, got 0")])
def test_rate_and_limit_errors_name_the_flag(tmp_path, capsys, args, expect):
    assert main(["bench", "--no-plot", "-o", str(tmp_path)] + args) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"phasewise: error: {expect}" or (expect in err and err.count("\n") == 0)
    assert "None" not in err


def test_bench_takes_policy_as_an_alias_of_policies(tmp_path):
    # serve and epp take --policy (one); bench's --policies accepts the same spelling.
    assert main(["bench", "--limit", "30", "--policy", "round_robin", "--no-plot", "-o", str(tmp_path)]) == 0
    assert [r["policy"] for r in json.loads((tmp_path / "bench.json").read_text())["results"]] == ["round_robin"]


@pytest.mark.parametrize("instances, has_dqn", [(4, True), (3, False)])
def test_bench_defaults_run_the_shipped_dqn_only_where_it_fits(tmp_path, capsys, instances, has_dqn):
    from routerd.policies.registry import DEFAULT_BENCH_POLICIES

    rc = main(["bench", "--limit", "40", "--instances", str(instances), "--no-plot", "-o", str(tmp_path)])
    assert rc == 0
    err = capsys.readouterr().err
    ran = [r["policy"] for r in json.loads((tmp_path / "bench.json").read_text())["results"]]
    assert ran == [s for s in DEFAULT_BENCH_POLICIES if has_dqn or s != "dqn"]
    assert ("phasewise: note: dqn left out" in err) is (not has_dqn)
    if not has_dqn:
        assert "4 instances" in err and "3" in err


def test_a_named_dqn_trained_on_another_profile_runs_with_a_note(tmp_path, capsys):
    rc = main(["bench", "--limit", "20", "--policies", "round_robin;dqn", "--profile", "llama2-7b-a100",
               "--no-plot", "-o", str(tmp_path)])
    assert rc == 0
    err = capsys.readouterr().err
    assert "phasewise: note: dqn: checkpoint" in err and "trained on profile llama2-7b-v100" in err
    assert "the benchmark uses llama2-7b-a100" in err


def test_a_comma_list_with_parameters_hints_at_semicolons(tmp_path, capsys):
    rc = main(["bench", "--limit", "10", "--policies", "round_robin,dqn:checkpoint=x", "--no-plot",
               "-o", str(tmp_path)])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "separate policies with ';'" in err


# ------------------------------------------------------------------ outputs: checked first, written all or none


def _no_simulation(*a, **k):
    raise AssertionError("simulated before the outputs were checked")


def _files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("blocked, extra", [
    ("o/requests.csv", []), ("o/bench.png", []), ("o/bench.json", []), ("p/change.png", []),
    ("p/e2e_cdf.png", []), ("o/capacity.json", ["--capacity-slo", "ttft_p90=2"]),
    ("p/capacity.png", ["--capacity-slo", "ttft_p90=2"]),
])
def test_an_output_path_that_is_a_folder_fails_before_simulating(tmp_path, capsys, monkeypatch, blocked, extra):
    (tmp_path / blocked).mkdir(parents=True)
    monkeypatch.setattr("routerd.bench.run_bench", _no_simulation)
    monkeypatch.setattr("routerd.bench.capacity_at_slo", _no_simulation)
    rc = main(["bench", "--limit", "10", "--policies", "round_robin,join_shortest_queue",
               "-o", str(tmp_path / "o"), "--plot", str(tmp_path / "p")] + extra)
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("phasewise: error:") and "\n" not in err
    assert str(tmp_path / blocked) in err and "is a folder" in err
    assert _files_under(tmp_path) == []


def test_an_out_folder_that_cannot_be_created_fails_before_simulating(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("x")
    monkeypatch.setattr("routerd.bench.run_bench", _no_simulation)
    assert main(["bench", "--limit", "10", "-o", str(tmp_path / "file" / "sub")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(tmp_path / "file") in err and "not a folder" in err


def test_a_write_error_leaves_no_output_and_is_one_line(tmp_path, capsys, monkeypatch):
    def full_disk(bench, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("routerd.bench_report.plot_bench", full_disk)
    rc = main(["bench", "--limit", "10", "--policies", "round_robin", "-o", str(tmp_path / "o" / "new"),
               "--plot", str(tmp_path / "p")])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err == f"phasewise: error: --out {tmp_path / 'o' / 'new' / 'bench.png'}: cannot write the file " \
                  "(No space left on device)"
    # bench.json and requests.csv came first but were never renamed into place; no temporaries or
    # created folders are left.
    assert list(tmp_path.iterdir()) == []


def test_outputs_replace_old_files_and_leave_no_temporaries(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "bench.json").write_text("old")
    assert main(["bench", "--limit", "10", "--policies", "round_robin", "--no-plot", "-o", str(out)]) == 0
    assert _files_under(out) == ["bench.json", "requests.csv"]
    assert json.loads((out / "bench.json").read_text())["requests"] > 0


@pytest.mark.parametrize("flag", ["--out", "--plot"])
def test_an_empty_output_folder_is_an_error(tmp_path, capsys, monkeypatch, flag):
    monkeypatch.chdir(tmp_path)
    args = ["bench", "--limit", "10", "--no-plot"] + (["--out", ""] if flag == "--out" else
                                                       ["--out", "o", "--plot", ""])
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"phasewise: error: {flag} is empty; give a folder" + (" (default bench-out)" if flag == "--out"
                                                                         else "")
    assert list(tmp_path.iterdir()) == []
