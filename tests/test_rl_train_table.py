"""benchmarks/rl_train_table.py: argument errors, and how the shipped default is picked."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import load_benchmark, split_checkpoint

pytest.importorskip("gymnasium")  # routerd.rl.train (used by --pick) needs the 'rl' extra

table = load_benchmark("rl_train_table")


@pytest.mark.usefixtures("data_dir")  # reads the shared traces: skipped without them
def test_pick_ranks_finished_runs_on_training_part_validation(tmp_path, capsys):
    split_checkpoint(tmp_path / "paper-baseline-m2-s0", 2, -1.0, profile="llama2-7b-v100")
    split_checkpoint(tmp_path / "bc-workload-guided-m2-s1", 2, 0.2, profile="llama2-7b-v100")
    split_checkpoint(tmp_path / "paper-baseline-m3-s0", 3, 0.2, profile="llama2-7b-v100")  # another instance count
    (tmp_path / "paper-baseline-m2-s2").mkdir()  # unfinished
    best, scores = table.pick(str(tmp_path), 2, samples=1)
    # One instance for everything is slower than two.
    assert best.endswith("bc-workload-guided-m2-s1")
    assert [Path(f).name for _, f in scores] == ["bc-workload-guided-m2-s1", "paper-baseline-m2-s0"]
    assert scores[0][0] < scores[1][0]
    with pytest.raises(FileNotFoundError, match="8 instances"):
        table.pick(str(tmp_path), 8)


@pytest.mark.usefixtures("data_dir")  # reads the shared traces: skipped without them
def test_pick_skips_an_unusable_run_with_a_note(tmp_path, capsys):
    split_checkpoint(tmp_path / "bc-workload-guided-m2-s1", 2, 0.2, profile="llama2-7b-v100")
    bad = tmp_path / "paper-baseline-m2-s0"
    split_checkpoint(bad, 2, 0.2, profile="llama2-7b-v100")
    (bad / "model.safetensors").write_bytes(b"\x00" * 5)  # truncated
    best, scores = table.pick(str(tmp_path), 2, samples=1)
    assert best.endswith("bc-workload-guided-m2-s1") and len(scores) == 1
    err = capsys.readouterr().err
    assert "skipped: checkpoint" in err and "paper-baseline-m2-s0" in err


@pytest.mark.parametrize("argv, needle", [
    (["--recipes", "nope"], "nope"),
    (["--variants", "fast"], "fast"),
    (["--seeds", "a"], "comma lists"),
    (["--seeds=-1"], "--seeds"),
    (["--instances", "0"], "--instances"),
    (["--workers", "0"], "--workers"),
    (["--recipes", "bc", "--variants", "baseline"], "no run"),
    (["--seeds", "90", "--recipes", "paper", "--variants", "baseline", "--instances", "4"], "overlap"),
    (["--pick", "7"], "no finished run"),
])
def test_bad_arguments_exit_2_with_one_line(argv, needle, tmp_path, capsys):
    assert table.main(["--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err


def test_an_out_that_is_a_file_is_one_line(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    assert table.main(["--out", str(f), "--seeds", "0", "--instances", "2", "--recipes", "paper",
                       "--variants", "baseline"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot create the folder" in err
