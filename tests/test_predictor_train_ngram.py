"""``train_ngram`` on synthetic rows: what it fits on, its choices, its recorded figures.

Fitting needs scikit-learn (the ``predictor-train`` extra): those tests skip without it.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest

from routerd.predictor import data as D
from routerd.predictor.ngram_predictor import NgramPredictor
from routerd.predictor.train import Args
from routerd.predictor.train_ngram import evaluate_split, train_ngram

WORDS = {"toy:short": "brief answer quick reply", "toy:long": "long essay with detail and depth",
         "other:mixed": "explain the topic"}


def _rows() -> list[D.Row]:
    rng = np.random.default_rng(0)
    rows = []
    for task, words in WORDS.items():
        for i in range(90):
            w = words.split()
            text = " ".join(rng.choice(w, size=8)) + f" item{i % 7}"
            if task == "toy:short":
                out = 40
            elif task == "toy:long":
                out = 600
            else:  # the label follows a word, not the task
                long = i % 2 == 0
                text += " elaborate" if long else " tersely"
                out = 700 if long else 30
            rows.append(D.Row(text, 20 + i % 5, out, task))
    return rows


#: The tests that fit a model: scikit-learn is the optional ``predictor-train`` extra.
needs_sklearn = pytest.mark.skipif(
    importlib.util.find_spec("sklearn") is None,
    reason="needs scikit-learn: pip install 'phasewise[predictor-train]'")


def _args(tmp_path, **kw) -> Args:
    a = Args(out=str(tmp_path / "m"), log=False, min_class_rows=5, task_max_per_task=1000)
    for k, v in kw.items():
        setattr(a, k, v)
    return a


@needs_sklearn
def test_fits_only_the_named_datasets_and_records_it(tmp_path):
    rows = _rows()
    out = train_ngram(_args(tmp_path), rows=rows, train_datasets={"toy"})
    pred = NgramPredictor.load(out)
    assert pred.tasks == ["toy:long", "toy:short"]
    tr = pred.meta["training"]
    split = D.split_rows(rows, seed=0)
    assert tr["rows"] == sum(rows[i].dataset == "toy" for i in split["train"])
    assert tr["datasets"] == ["toy"]
    # Validation and test stay the whole split, the other dataset included.
    assert pred.meta["metrics"]["val"]["rows"] == len(split["val"])
    assert set(pred.meta["metrics"]["test"]["dataset"]) == {"other", "toy"}


@needs_sklearn
def test_is_deterministic_and_its_figures_reproduce(tmp_path):
    rows = _rows()
    a = train_ngram(_args(tmp_path / "a"), rows=rows)
    b = train_ngram(_args(tmp_path / "b"), rows=rows)
    assert (a / "weights.safetensors").read_bytes() == (b / "weights.safetensors").read_bytes()
    meta = json.loads((a / "predictor.json").read_text())
    pred = NgramPredictor.load(a)
    split = D.split_rows(rows, seed=0)
    y = np.minimum(D.labels_of(rows), pred.bucket.classes - 1)
    again = evaluate_split(pred, rows, split["val"], y)
    for k in ("hint_true", "hint_none", "hint_predicted", "hint_mixture", "task_accuracy_known"):
        assert again[k] == meta["metrics"]["val"][k]
    # auto_missing is the best of the three on validation (ties to the cheapest).
    best = max(("none", "mixture", "predicted"), key=lambda m: (again[f"hint_{m}"],
                                                               -("none", "mixture", "predicted").index(m)))
    assert meta["auto_missing"] == best == pred.auto_missing
    # The toy tasks are separable by their words: the classifier and the true hint are exact there.
    assert again["dataset"]["toy"]["hint_true"] == 1.0
    assert again["task_accuracy_known"] > 0.9


@needs_sklearn
def test_refuses_too_few_rows(tmp_path):
    from routerd.predictor.base import PredictorError

    with pytest.raises(PredictorError, match="too few rows"):
        train_ngram(_args(tmp_path), rows=_rows()[:3])


def test_says_which_extra_is_missing_without_scikit_learn(tmp_path, monkeypatch):
    from routerd.predictor.base import PredictorError

    monkeypatch.setitem(sys.modules, "sklearn", None)  # import sklearn now raises ImportError
    with pytest.raises(PredictorError) as e:
        train_ngram(_args(tmp_path), rows=_rows())
    assert str(e.value) == "training the n-gram predictor needs scikit-learn: pip install 'phasewise[predictor-train]'"
    assert not (tmp_path / "m").exists()


def test_train_options_that_would_fail_late_or_leak_are_refused_first(tmp_path, capsys):
    from routerd.cli import main

    afile = tmp_path / "afile"
    afile.write_text("x")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    cases = [
        (["--out", ""], "--out is empty"),
        (["--out", str(afile)], f"{afile} is a file"),
        (["--out", str(afile / "sub")], f"{afile} is a file"),
        (["--out", str(busy)], "holds other files (notes.txt)"),
        (["--out", str(tmp_path / "m"), "--sources", ",,"], "names no prompt file"),
        (["--out", str(tmp_path / "m"), "--ngram-c", "inf"], "finite"),
        (["--out", str(tmp_path / "m"), "--ngram-task-c", "0"], "finite and > 0"),
        (["--out", str(tmp_path / "m"), "--min-class-rows", "-5"], "--min-class-rows must be >= 1"),
    ]
    for extra, words in cases:
        rc = main(["predictor", "train", "--kind", "ngram", "--small", *extra])
        err = capsys.readouterr().err
        assert rc == 2 and words in err and err.count("\n") == 1, (extra, err)
    assert (busy / "notes.txt").read_text() == "mine" and sorted(p.name for p in busy.iterdir()) == ["notes.txt"]
    assert not (tmp_path / "m").exists()
