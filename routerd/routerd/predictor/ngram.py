"""Word n-gram bucket model: TF-IDF of the prompt, the task and its length, logistic regression.

The transformer predictor reads only the first ``max_length`` (64) tokens of a prompt,
hint included, to stay within 2 ms per request. This model reads up to ``max_chars``
characters of the prompt as word 1- and 2-grams, at a few microseconds per request, and
the predictor blends the two models' class probabilities (:mod:`.hf`, weight chosen on
validation by :mod:`.train`).

Why it is here (measured on the default split, seed 0, 2026-11-30; ``docs/predictor.md``):
with the true task hint, it reached 85.0% validation / 84.5% test accuracy, against
82.9% / 82.0% for the default transformer recipe. On ShareGPT it reached 67.0% against
61.0%. Trained on 1,500 ShareGPT rows instead of 7,519, it fell to 63.9%, so more of the
prompt and more rows are what it adds.

Features of one request (a sparse row):

* scikit-learn ``TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True)`` over
  the first ``max_chars`` characters, keeping the ``max_features`` most frequent terms;
* the task one-hot (an unknown or missing task is all zeros);
* ``log1p(prompt_tokens)``, and its product with the task one-hot (a length slope per task).

Classifier: scikit-learn ``LogisticRegression`` (multinomial, lbfgs, L2 with inverse
strength ``C``). Training adds a copy of a ``task_dropout`` share of the rows with the
task removed, so the model also serves requests without a task label.

Saved as a folder: ``ngram.json`` (settings, tasks, vocabulary in column order) and
``ngram.safetensors`` (``idf``, ``coef`` of shape (classes, features), ``intercept``).
No pickle: loading runs no code from the folder.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .base import PredictorError, clean_prompt, softmax_rows

CONFIG_FILE = "ngram.json"
WEIGHTS_FILE = "ngram.safetensors"
FORMAT = 1
#: Prompt token counts above this are treated as this (2**53, the largest exact float).
MAX_TOKENS = 2**53


def _vectorizer(vocabulary=None, *, max_features: int | None = None, min_df: int = 2):
    from sklearn.feature_extraction.text import TfidfVectorizer

    if vocabulary is not None:
        return TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, vocabulary=vocabulary, dtype=np.float64)
    return TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=min_df, max_features=max_features,
                           dtype=np.float64)


class NgramModel:
    """A fitted n-gram bucket model (see the module docstring).

    Attributes: ``tasks`` (known task labels, sorted), ``classes`` (number of output
    classes), ``max_chars`` (prompt characters read).
    """

    def __init__(self, vectorizer, tasks: Sequence[str], coef: np.ndarray, intercept: np.ndarray,
                 max_chars: int, settings: dict | None = None):
        self.vectorizer = vectorizer
        self.tasks = list(tasks)
        self._task_col = {t: i for i, t in enumerate(self.tasks)}
        self.coef = np.ascontiguousarray(coef, dtype=np.float64)
        self.intercept = np.asarray(intercept, dtype=np.float64)
        self.classes = int(self.coef.shape[0])
        self.max_chars = int(max_chars)
        self.settings = dict(settings or {})
        n_text = len(vectorizer.vocabulary_) if hasattr(vectorizer, "vocabulary_") else len(vectorizer.vocabulary)
        expected = n_text + 2 * len(self.tasks) + 1
        if self.coef.shape[1] != expected or self.intercept.shape != (self.classes,):
            raise PredictorError(f"n-gram weights have shape {self.coef.shape} / {self.intercept.shape}; "
                                 f"expected ({self.classes}, {expected}) for {n_text} terms and {len(self.tasks)} tasks")

    # ------------------------------------------------------------------ features
    def features(self, texts: Sequence[str], prompt_tokens: Sequence[int], tasks: Sequence[str | None]):
        """Sparse CSR matrix of shape (n, features): TF-IDF | task one-hot | log1p(tokens) | task x log1p."""
        from scipy.sparse import csr_matrix, hstack

        n = len(texts)
        if not (len(prompt_tokens) == len(tasks) == n):
            raise PredictorError(f"{n} texts, {len(prompt_tokens)} token counts and {len(tasks)} tasks")
        tfidf = self.vectorizer.transform([t[: self.max_chars] for t in texts])
        k = len(self.tasks)
        # Clamp before converting: a Python int beyond float range (10**400) must not raise.
        lp = np.log1p(np.array([min(max(int(n), 0), MAX_TOKENS) for n in prompt_tokens], dtype=np.float64))
        rows, cols, vals = [], [], []
        for i, t in enumerate(tasks):
            c = self._task_col.get(t) if isinstance(t, str) else None
            rows.append(i), cols.append(k), vals.append(lp[i])
            if c is not None:
                rows += [i, i]
                cols += [c, k + 1 + c]
                vals += [1.0, lp[i]]
        side = csr_matrix((vals, (rows, cols)), shape=(n, 2 * k + 1))
        return hstack([tfidf, side], format="csr")

    def predict_proba(self, texts: Sequence[str], prompt_tokens: Sequence[int],
                      tasks: Sequence[str | None]) -> np.ndarray:
        """Class probabilities, float64 array of shape (n, classes); rows sum to 1."""
        if len(texts) == 0:
            return np.zeros((0, self.classes))
        return softmax_rows(self.features(texts, prompt_tokens, tasks) @ self.coef.T + self.intercept)

    # ------------------------------------------------------------------ fit
    @classmethod
    def fit(
        cls,
        texts: Sequence[str],
        prompt_tokens: Sequence[int],
        tasks: Sequence[str | None],
        labels: Sequence[int],
        *,
        classes: int,
        C: float = 1.0,
        max_features: int = 300_000,
        min_df: int = 2,
        max_chars: int = 4000,
        task_dropout: float = 0.3,
        seed: int = 0,
        max_iter: int = 3000,
    ) -> "NgramModel":
        """Fit on parallel sequences (prompt texts, prompt tokens, task labels, class labels 0..classes-1).

        Deterministic for the same inputs and ``seed`` (the seed picks the task-dropout rows).

        Raises:
            PredictorError: mismatched lengths, no rows, labels outside ``0..classes-1``,
                or settings out of range.
        """
        from sklearn.linear_model import LogisticRegression

        y = np.asarray(labels, dtype=np.int64)
        n = len(texts)
        if not (len(prompt_tokens) == len(tasks) == y.size == n):
            raise PredictorError(f"{n} texts, {len(prompt_tokens)} token counts, {len(tasks)} tasks, {y.size} labels")
        if n == 0:
            raise PredictorError("cannot fit the n-gram model on zero rows")
        if classes < 2 or y.min() < 0 or y.max() >= classes:
            raise PredictorError(f"labels must lie in 0..{classes - 1} with classes >= 2")
        if not (C > 0 and 0.0 <= task_dropout <= 1.0 and max_chars > 0 and max_features > 0 and min_df >= 1):
            raise PredictorError("need C > 0, 0 <= task_dropout <= 1, max_chars > 0, max_features > 0, min_df >= 1")
        texts = [clean_prompt(t, max_chars=max_chars) for t in texts]
        vec = _vectorizer(max_features=max_features, min_df=min_df)
        try:
            vec.fit(texts)
        except ValueError:
            # No term reaches min_df, or every prompt is empty: keep every term, plus one
            # placeholder so the vocabulary is never empty (the model then decides by task
            # and length alone).
            vec = _vectorizer(max_features=max_features, min_df=1)
            try:
                vec.fit(texts + ["placeholder"])
            except ValueError as e:
                raise PredictorError(f"cannot build the n-gram vocabulary: {e}") from None
        known = sorted({t for t in tasks if isinstance(t, str)})
        model = cls(vec, known, np.zeros((classes, len(vec.vocabulary_) + 2 * len(known) + 1)),
                    np.zeros(classes), max_chars)
        tokens = list(prompt_tokens)
        task_list = list(tasks)
        rng = np.random.default_rng(seed)
        drop = np.flatnonzero(rng.random(n) < task_dropout)
        X = model.features(texts + [texts[i] for i in drop], tokens + [tokens[i] for i in drop],
                           task_list + [None] * len(drop))
        yy = np.concatenate([y, y[drop]])
        coef = np.zeros_like(model.coef)
        intercept = np.zeros(classes)
        present = np.unique(yy)
        if present.size == 1:
            # sklearn refuses a single class: the exact fit is a constant (a large margin).
            intercept[:] = -30.0
            intercept[present[0]] = 0.0
        else:
            clf = LogisticRegression(C=C, max_iter=max_iter)
            clf.fit(X, yy)
            coef[present] = clf.coef_ if present.size > 2 else np.vstack([-clf.coef_ / 2, clf.coef_ / 2])
            intercept[:] = -30.0
            intercept[present] = clf.intercept_ if present.size > 2 else np.array(
                [-clf.intercept_[0] / 2, clf.intercept_[0] / 2])
        settings = {"C": C, "max_features": max_features, "min_df": min_df, "task_dropout": task_dropout,
                    "seed": seed, "train_rows": n, "dropout_rows": int(drop.size)}
        return cls(vec, known, coef, intercept, max_chars, settings)

    # ------------------------------------------------------------------ persistence
    def save(self, folder: str | Path) -> None:
        """Write ``ngram.json`` and ``ngram.safetensors`` into ``folder`` (created if missing)."""
        from safetensors.numpy import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        vocab = self.vectorizer.vocabulary_
        terms = [""] * len(vocab)
        for term, col in vocab.items():
            terms[col] = term
        config = {"format": FORMAT, "kind": "tfidf-word-1-2+task+length/logistic-regression",
                  "classes": self.classes, "tasks": self.tasks, "max_chars": self.max_chars,
                  "settings": self.settings, "vocabulary": terms}
        (folder / CONFIG_FILE).write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
        save_file({"idf": np.asarray(self.vectorizer.idf_, dtype=np.float64), "coef": self.coef,
                   "intercept": self.intercept}, str(folder / WEIGHTS_FILE))

    @classmethod
    def load(cls, folder: str | Path) -> "NgramModel":
        """Read a folder written by :meth:`save`.

        Raises:
            PredictorError: a missing or unreadable file, another format, or weights that do
                not match the vocabulary and tasks (the message names the file).
        """
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        folder = Path(folder)
        cfg_path, w_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            fmt, terms, tasks = cfg["format"], cfg["vocabulary"], cfg["tasks"]
            max_chars = cfg["max_chars"]
            settings = cfg.get("settings", {})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise PredictorError(f"{cfg_path}: cannot read the n-gram model ({type(e).__name__}: {e})") from None
        if fmt != FORMAT:
            raise PredictorError(f"{cfg_path}: n-gram format {fmt!r}, this version reads {FORMAT}")
        if (not isinstance(terms, list) or not terms or not all(isinstance(t, str) for t in terms)
                or len(set(terms)) != len(terms)):
            raise PredictorError(f"{cfg_path}: the vocabulary must be a non-empty list of distinct strings")
        if not isinstance(tasks, list) or not all(isinstance(t, str) for t in tasks) or len(set(tasks)) != len(tasks):
            raise PredictorError(f"{cfg_path}: 'tasks' must be a list of distinct strings")
        if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 1:
            raise PredictorError(f"{cfg_path}: 'max_chars' must be a positive integer, got {max_chars!r}")
        if not isinstance(settings, dict):
            raise PredictorError(f"{cfg_path}: 'settings' must be an object")
        try:
            w = load_file(str(w_path))
            idf, coef, intercept = w["idf"], w["coef"], w["intercept"]
        except (OSError, SafetensorError, KeyError) as e:
            raise PredictorError(f"{w_path}: cannot read the n-gram weights ({type(e).__name__}: {e})") from None
        for name, arr, ndim in (("idf", idf, 1), ("coef", coef, 2), ("intercept", intercept, 1)):
            if arr.ndim != ndim or arr.dtype.kind != "f" or arr.size == 0:
                raise PredictorError(f"{w_path}: '{name}' must be a non-empty {ndim}-D float array, "
                                     f"got shape {arr.shape} of {arr.dtype}")
            if not np.isfinite(arr).all():
                raise PredictorError(f"{w_path}: '{name}' holds NaN or infinite values")
        if idf.shape != (len(terms),):
            raise PredictorError(f"{w_path}: idf has shape {idf.shape}, the vocabulary has {len(terms)} terms")
        if coef.shape[0] < 2:
            raise PredictorError(f"{w_path}: coef has {coef.shape[0]} classes, at least 2 are needed")
        vec = _vectorizer({t: i for i, t in enumerate(terms)})
        vec.idf_ = idf
        try:
            return cls(vec, tasks, coef, intercept, max_chars, settings)
        except PredictorError as e:
            raise PredictorError(f"{w_path}: {e}") from None
