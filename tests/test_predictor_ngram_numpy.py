"""The numpy n-gram featurizer and heads against independent computations.

- :class:`Featurizer` against scikit-learn's ``TfidfVectorizer`` with the same vocabulary
  and IDF (the definition it reimplements);
- the heads' numpy scores against SciPy sparse products of :meth:`NgramModel.features`;
- :class:`NgramPredictor`'s hint modes against the formulas in its docstring.

Every test fits a vocabulary (:meth:`Featurizer.fit` uses scikit-learn, the optional
``predictor-train`` extra) and checks against scikit-learn or SciPy: they skip without it.
"""

from __future__ import annotations

import numpy as np
import pytest

from routerd.predictor.base import PredictorError, softmax_rows
from routerd.predictor.ngram import Featurizer, NgramModel
from routerd.predictor.ngram_predictor import NgramPredictor

TEXTS = [
    "Write a long essay about the Roman empire and its fall",
    "write code: a python function that sorts a list",
    "",
    "a",  # no word of two characters
    "Hello hello HELLO world world",  # repeated terms: sublinear tf
    "İstanbul straße ÉCOLE école naïve café",  # lower() changes length for İ
    "tabs\tand\nnewlines\r\nand   spaces",
    "emoji 😀 between words 😀 words",
    "x" * 5000 + " tail words past the cut",
    "123 456 7_8 under_score",
]
TASKS = ["toy:long", "toy:code", None, "toy:long", "toy:code", "toy:long", None, "toy:code", "toy:long", None]
LABELS = [2, 1, 0, 0, 1, 2, 0, 1, 2, 0]


@pytest.fixture(scope="module")
def featurizer():
    pytest.importorskip("sklearn", reason="needs scikit-learn: pip install 'phasewise[predictor-train]'")
    return Featurizer.fit(TEXTS * 2, min_df=1, max_chars=300)


def test_featurizer_equals_sklearn_tfidf(featurizer):
    from sklearn.feature_extraction.text import TfidfVectorizer

    vec = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, dtype=np.float64,
                          vocabulary={t: i for i, t in enumerate(featurizer.terms)})
    vec.idf_ = featurizer.idf
    probe = TEXTS + ["zzqq yyxx vvkk", "Roman empire roman EMPIRE fall"]
    want = vec.transform([t[:300] for t in probe]).toarray()
    x = featurizer.transform(probe)
    got = np.zeros_like(want)
    got[x.rows, x.cols] = x.vals
    assert x.n == len(probe)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    # Rows with any term have unit norm; the empty and unseen rows are all zeros.
    norms = np.linalg.norm(got, axis=1)
    assert np.allclose(norms[norms > 0], 1.0)
    assert norms[2] == 0 and norms[3] == 0 and norms[len(TEXTS)] == 0


def test_featurizer_reads_only_max_chars(featurizer):
    x = featurizer.transform(["x" * 5000 + " tail words"])
    tail = {featurizer.index[t] for t in ("tail", "words", "tail words") if t in featurizer.index}
    assert not tail & set(x.cols.tolist())


def test_featurizer_cleans_bytes_surrogates_and_none(featurizer):
    x = featurizer.transform([b"write code \xff\xfe", "\ud800 write code", None])
    want = featurizer.transform(["write code \ufffd\ufffd", "? write code", ""])
    assert np.array_equal(x.rows, want.rows) and np.array_equal(x.cols, want.cols)
    np.testing.assert_allclose(x.vals, want.vals)


@pytest.fixture(scope="module")
def bucket(featurizer):
    return NgramModel.fit(TEXTS, [12, 9, 0, 1, 5, 8, 6, 7, 1300, 4], TASKS, LABELS, classes=3, C=10.0,
                          task_dropout=0.5, seed=1, featurizer=featurizer)


def test_numpy_scores_equal_scipy_product(bucket):
    tokens = [12, 9, 0, 1, 5, 8, 6, 7, 1300, 4]
    tasks = ["toy:code", "toy:long", None, "nope", "toy:code", None, "toy:long", None, None, "toy:code"]
    X = bucket.features(TEXTS, tokens, tasks)
    want = softmax_rows(X @ bucket.coef.T + bucket.intercept)
    got = bucket.predict_proba(TEXTS, tokens, tasks)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_scores_per_task_match_scores_with_that_task(bucket):
    x = bucket.featurizer.transform(TEXTS)
    tokens = list(range(len(TEXTS)))
    text = bucket.text_scores(x)
    per = bucket.scores_per_task(text, tokens)
    assert per.shape == (len(TEXTS), len(bucket.tasks), 3)
    for j, t in enumerate(bucket.tasks):
        np.testing.assert_allclose(per[:, j], bucket.scores(x, tokens, [t] * len(TEXTS)), atol=1e-12)


def _predictor(bucket, featurizer, hint="auto", auto_missing="mixture"):
    code = {t: i for i, t in enumerate(bucket.tasks)}
    rows = [i for i, t in enumerate(TASKS) if t is not None]
    task = NgramModel.fit([TEXTS[i] for i in rows], [5] * len(rows), [None] * len(rows),
                          [code[TASKS[i]] for i in rows], classes=len(bucket.tasks), C=10.0,
                          featurizer=featurizer, use_task=False)
    meta = {"name": "toy", "edges": [250, 1000, 4000], "auto_missing": auto_missing}
    return NgramPredictor(meta, bucket, task, hint=hint)


def test_hint_modes_follow_their_formulas(bucket, featurizer):
    p = _predictor(bucket, featurizer)
    batch = [(TEXTS[0], 12, None), (TEXTS[1], 9, "toy:code"), (TEXTS[4], 5, "unknown:task")]
    probs, info = p.explain(batch)
    post = softmax_rows(p.task_model.scores(featurizer.transform([b[0] for b in batch]), [12, 9, 5], [None] * 3))
    # mixture: sum_t P(t|x) P(b|x,t)
    for i in (0, 2):
        want = sum(post[i, j] * bucket.predict_proba([batch[i][0]], [batch[i][1]], [t])[0]
                   for j, t in enumerate(bucket.tasks))
        np.testing.assert_allclose(probs[i], want, atol=1e-12)
        assert info[i]["task_source"] == "mixture" and info[i]["task"] == bucket.tasks[int(post[i].argmax())]
    np.testing.assert_allclose(probs[1], bucket.predict_proba([TEXTS[1]], [9], ["toy:code"])[0], atol=1e-12)
    assert info[1] == {"task": "toy:code", "task_source": "given", "task_probability": None, "text": True}
    assert p.unknown_tasks == 1
    np.testing.assert_allclose(probs.sum(axis=1), 1.0)

    p.hint = "predicted"
    probs, info = p.explain(batch)
    for i in range(3):
        t = bucket.tasks[int(post[i].argmax())]
        np.testing.assert_allclose(probs[i], bucket.predict_proba([batch[i][0]], [batch[i][1]], [t])[0], atol=1e-12)
        assert info[i]["task"] == t and info[i]["task_probability"] == pytest.approx(post[i].max())
    p.hint = "none"
    probs, info = p.explain(batch)
    np.testing.assert_allclose(probs, bucket.predict_proba([b[0] for b in batch], [b[1] for b in batch],
                                                           [None] * 3), atol=1e-12)
    assert [d["task_source"] for d in info] == ["none"] * 3
    p.hint = "true"
    _, info = p.explain(batch)
    assert [d["task_source"] for d in info] == ["none", "given", "none"]
    with pytest.raises(PredictorError, match="hint mode"):
        p.hint = "sometimes"


def test_save_load_roundtrip_float32(bucket, featurizer, tmp_path):
    p = _predictor(bucket, featurizer)
    p.save(tmp_path / "m")
    q = NgramPredictor.load(tmp_path / "m")
    batch = [(t, n, k) for t, n, k in zip(TEXTS, range(len(TEXTS)), TASKS)]
    np.testing.assert_allclose(q.predict_proba(batch), p.predict_proba(batch), atol=1e-5)
    assert q.auto_missing == "mixture" and q.tasks == p.tasks and q.edges == (250, 1000, 4000)
    assert q.predict([]) == [] and q.predict_proba([]).shape == (0, 3)
