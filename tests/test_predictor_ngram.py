"""The n-gram bucket model: features by hand, probabilities, persistence, bad files and inputs.

Needs scikit-learn (the 'predictor' extra); skipped otherwise. No torch.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytest.importorskip("sklearn")

from routerd.predictor import PredictorError  # noqa: E402
from routerd.predictor.ngram import CONFIG_FILE, WEIGHTS_FILE, NgramModel  # noqa: E402


def _toy(n: int = 60):
    """Prompts whose words decide the class: 'brief' -> 0, 'detailed' -> 1, 'exhaustive' -> 2."""
    words = ["brief reply", "detailed explanation", "exhaustive report"]
    texts, tokens, tasks, labels = [], [], [], []
    for k in range(n):
        c = k % 3
        texts.append(f"please write a {words[c]} about subject {k}")
        tokens.append(8 + k % 5)
        tasks.append("toy:a" if k % 2 else "toy:b")
        labels.append(c)
    return texts, tokens, tasks, labels


@pytest.fixture(scope="module")
def model():
    texts, tokens, tasks, labels = _toy()
    return NgramModel.fit(texts, tokens, tasks, labels, classes=3, C=10.0, task_dropout=0.3, seed=0)


def test_side_features_by_hand(model):
    X = model.features(["brief reply", "brief reply", "brief reply"], [0, 9, 9], ["toy:b", "toy:a", None]).toarray()
    n_text = len(model.featurizer)
    side = X[:, n_text:]
    assert model.tasks == ["toy:a", "toy:b"]
    # columns: one-hot toy:a, toy:b | log1p(tokens) | toy:a x log1p, toy:b x log1p
    l9 = math.log1p(9)
    assert side.tolist() == [[0, 1, 0.0, 0, 0], [1, 0, l9, l9, 0], [0, 0, l9, 0, 0]]
    # TF-IDF part: l2-normalised, and the same text gives the same row whatever the task.
    assert np.allclose(np.linalg.norm(X[:, :n_text], axis=1), 1.0)
    assert np.array_equal(X[0, :n_text], X[2, :n_text])


def test_probabilities_are_the_softmax_of_the_linear_scores(model):
    texts = ["a detailed explanation please", "", "exhaustive report on x"]
    tokens, tasks = [5, 0, 7], ["toy:a", None, "unknown:task"]
    p = model.predict_proba(texts, tokens, tasks)
    z = model.features(texts, tokens, tasks).toarray() @ model.coef.T + model.intercept
    want = np.exp(z - z.max(axis=1, keepdims=True))
    want /= want.sum(axis=1, keepdims=True)
    assert p.shape == (3, 3) and np.allclose(p, want, rtol=0, atol=1e-12)
    assert np.allclose(p.sum(axis=1), 1.0)
    # An unknown task is treated exactly as no task.
    assert np.array_equal(model.predict_proba(["x y"], [3], ["nope"]), model.predict_proba(["x y"], [3], [None]))


def test_learns_the_words_on_unseen_prompts(model):
    texts = [f"please write a {w} about subject {k}" for k, w in
             zip(range(100, 106), ["brief reply", "detailed explanation", "exhaustive report"] * 2)]
    got = model.predict_proba(texts, [9] * 6, [None, "toy:a", "toy:b"] * 2).argmax(axis=1)
    assert got.tolist() == [0, 1, 2, 0, 1, 2]


def test_binary_probabilities_match_sklearn():
    """Two classes: the saved (+-coef/2) softmax equals sklearn's logistic probabilities."""
    from sklearn.linear_model import LogisticRegression

    texts, tokens, tasks, labels = _toy(40)
    labels = [min(c, 1) for c in labels]
    m = NgramModel.fit(texts, tokens, tasks, labels, classes=2, task_dropout=0.0)
    X = m.features(texts, tokens, tasks)
    ref = LogisticRegression(C=1.0, max_iter=3000).fit(X, labels)
    assert np.allclose(m.predict_proba(texts, tokens, tasks), ref.predict_proba(X), atol=1e-9)


def test_missing_class_gets_no_probability():
    texts, tokens, tasks, labels = _toy(30)
    labels = [0 if c == 0 else 2 for c in labels]  # class 1 never seen
    m = NgramModel.fit(texts, tokens, tasks, labels, classes=3)
    p = m.predict_proba(texts, tokens, tasks)
    assert p[:, 1].max() < 1e-12 and set(p.argmax(axis=1)) == {0, 2}
    const = NgramModel.fit(texts, tokens, tasks, [1] * len(texts), classes=3)
    assert const.predict_proba(["anything"], [1], [None]).argmax(axis=1).tolist() == [1]


def test_fit_is_deterministic_and_round_trips(tmp_path, model):
    texts, tokens, tasks, labels = _toy()
    again = NgramModel.fit(texts, tokens, tasks, labels, classes=3, C=10.0, task_dropout=0.3, seed=0)
    assert np.array_equal(again.coef, model.coef) and np.array_equal(again.intercept, model.intercept)
    model.save(tmp_path)
    loaded = NgramModel.load(tmp_path)
    q = (["detailed explanation of it", "brief", ""], [3, 1, 0], ["toy:b", None, "toy:a"])
    assert np.array_equal(loaded.predict_proba(*q), model.predict_proba(*q))
    assert loaded.tasks == model.tasks and loaded.max_chars == model.max_chars
    cfg = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert cfg["settings"]["train_rows"] == 60 and cfg["settings"]["dropout_rows"] == again.settings["dropout_rows"]


def test_bad_inputs_are_cut_or_refused(model):
    big = "exhaustive " * 200_000  # 2.2 MB: only max_chars are read
    p = model.predict_proba([big, "\ud800 lone surrogate", ""], [500_000, 1, 0], [None, None, None])
    assert p.shape == (3, 3) and np.isfinite(p).all()
    assert model.predict_proba([], [], []).shape == (0, 3)
    with pytest.raises(PredictorError, match="2 texts"):
        model.predict_proba(["a", "b"], [1], [None, None])
    with pytest.raises(PredictorError, match="labels must lie"):
        NgramModel.fit(["a b", "c d"], [1, 1], [None, None], [0, 3], classes=3)
    with pytest.raises(PredictorError, match="zero rows"):
        NgramModel.fit([], [], [], [], classes=2)
    with pytest.raises(PredictorError, match="C > 0"):
        NgramModel.fit(["a b"], [1], [None], [0], classes=2, C=0)


def test_bad_folders_name_the_file(tmp_path, model):
    with pytest.raises(PredictorError, match=CONFIG_FILE):
        NgramModel.load(tmp_path)
    model.save(tmp_path)
    cfg_path, w_path = tmp_path / CONFIG_FILE, tmp_path / WEIGHTS_FILE
    good = cfg_path.read_text()
    cfg = json.loads(good)
    cfg["format"] = 99
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(PredictorError, match="format 99"):
        NgramModel.load(tmp_path)
    cfg = json.loads(good)
    cfg["vocabulary"] = cfg["vocabulary"][:-1]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(PredictorError, match=f"{WEIGHTS_FILE}: idf has shape"):
        NgramModel.load(tmp_path)
    cfg = json.loads(good)
    cfg["tasks"] = ["toy:a"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(PredictorError, match=f"{WEIGHTS_FILE}: 'coef' has shape"):
        NgramModel.load(tmp_path)
    cfg_path.write_text(good)
    w_path.write_bytes(b"\x00garbage")
    with pytest.raises(PredictorError, match=f"{WEIGHTS_FILE}: cannot read"):
        NgramModel.load(tmp_path)


def test_non_finite_or_mistyped_weights_and_config_are_refused(tmp_path, model):
    """NaN weights would make every probability NaN and every prediction bucket 0."""
    from safetensors.numpy import load_file, save_file

    model.save(tmp_path)
    cfg_path, w_path = tmp_path / CONFIG_FILE, tmp_path / WEIGHTS_FILE
    good_cfg, good_w = cfg_path.read_text(), load_file(str(w_path))
    cases = [
        ("intercept", np.full(3, np.nan), "'intercept' holds NaN"),
        ("coef", np.where(np.arange(good_w["coef"].size).reshape(good_w["coef"].shape) == 0, np.inf,
                          good_w["coef"]), "'coef' holds NaN or infinite"),
        ("idf", good_w["idf"].astype(np.int64), "'idf' must be a non-empty 1-D float array"),
        ("coef", good_w["coef"][0], "'coef' must be a non-empty 2-D float array"),
        ("coef", good_w["coef"][:1], "coef has 1 classes"),
    ]
    for key, value, msg in cases:
        save_file({**good_w, key: np.ascontiguousarray(value)}, str(w_path))
        with pytest.raises(PredictorError, match=msg) as e:
            NgramModel.load(tmp_path)
        assert WEIGHTS_FILE in str(e.value)
    save_file(good_w, str(w_path))
    for field, value, msg in [("tasks", None, "'tasks' must be a list"), ("tasks", [[1]], "'tasks' must be a list"),
                              ("tasks", ["toy:a", "toy:a"], "'tasks' must be a list"),
                              ("vocabulary", [], "non-empty list"), ("max_chars", 0, "'max_chars' must be"),
                              ("max_chars", 1e300, "'max_chars' must be"), ("settings", [1, 2], "'settings'")]:
        cfg = json.loads(good_cfg)
        cfg[field] = value
        cfg_path.write_text(json.dumps(cfg))
        with pytest.raises(PredictorError, match=msg) as e:
            NgramModel.load(tmp_path)
        assert CONFIG_FILE in str(e.value) or WEIGHTS_FILE in str(e.value)
    cfg_path.write_text(good_cfg)
    assert np.array_equal(NgramModel.load(tmp_path).coef, model.coef)


def test_token_counts_beyond_float_range_are_clamped(model):
    huge = model.predict_proba(["hi", "hi"], [10**400, 2**53], [None, None])
    assert np.isfinite(huge).all() and np.array_equal(huge[0], huge[1])


def test_empty_prompts_still_fit_on_task_and_length():
    # No text at all: the vocabulary is a placeholder and the task decides.
    m = NgramModel.fit([""] * 20, [5] * 20, ["toy:a", "toy:b"] * 10, [0, 1] * 10, classes=2, C=10.0,
                       task_dropout=0.0)
    assert m.predict_proba(["", ""], [5, 5], ["toy:a", "toy:b"]).argmax(axis=1).tolist() == [0, 1]
