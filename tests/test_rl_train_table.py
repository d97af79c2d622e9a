"""benchmarks/rl_train_table.py: argument errors, and how the shipped default is picked."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from conftest import split_checkpoint

pytest.importorskip("gymnasium")  # routerd.rl.train (used by --pick) needs the 'rl' extra

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "rl_train_table.py"
_spec = importlib.util.spec_from_file_location("rl_train_table", _PATH)
table = importlib.util.module_from_spec(_spec)
sys.modules["rl_train_table"] = table
_spec.loader.exec_module(table)


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


@pytest.mark.parametrize("argv, needle", [
    (["--recipes", "nope"], "nope"),
    (["--variants", "fast"], "fast"),
    (["--seeds", "a"], "comma lists"),
    (["--workers", "0"], "workers"),
    (["--pick", "7"], "no finished run"),
])
def test_bad_arguments_exit_2_with_one_line(argv, needle, tmp_path, capsys):
    assert table.main(["--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err
