"""The shipped default predictor: its licences, its recorded figures, its size."""

from __future__ import annotations

import numpy as np

from routerd.predictor import data as D
from routerd.predictor import load_predictor
from routerd.predictor.ngram_predictor import shipped_dir


def test_shipped_model_is_trained_only_on_redistributable_data():
    pred = load_predictor("default")
    training = pred.meta["training"]
    assert set(training["sources"]) <= set(D.PERMISSIVE_SOURCES)
    assert all(D.source_of(ds) in D.PERMISSIVE_SOURCES for ds in training["datasets"])
    assert training["licenses"] == {s: D.SOURCE_LICENSES[s] for s in training["sources"]}
    # Every task the model knows comes from a permissive file.
    assert all(D.source_of(t.split(":", 1)[0]) in D.PERMISSIVE_SOURCES for t in pred.tasks)


def test_shipped_model_fits_the_size_budget():
    size = sum(f.stat().st_size for f in shipped_dir().iterdir())
    assert size <= 5_000_000, size


def test_shipped_model_reproduces_its_recorded_test_figures(data_dir):
    """The figures in predictor.json (and docs/predictor.md) are those of the files shipped."""
    pred = load_predictor("default")
    rows = D.load_rows(data_dir)
    edges = pred.edges
    split = D.split_rows(rows, seed=pred.meta["training"]["split_seed"], edges=edges)
    idx = split["test"]
    y = np.minimum(D.labels_of(rows, edges)[idx], pred.bucket.classes - 1)
    recorded = pred.meta["metrics"]["test"]
    assert recorded["rows"] == len(idx)
    for mode, with_task in (("true", True), (pred.auto_missing, False)):
        pred.hint = mode
        got = []
        batch = [(rows[i].prompt, rows[i].prompt_tokens, rows[i].task if with_task else None) for i in idx]
        for k in range(0, len(batch), 64):
            got += pred.predict(batch[k: k + 64])
        assert float(np.mean(np.array(got) == y)) == recorded[f"hint_{mode}"]
