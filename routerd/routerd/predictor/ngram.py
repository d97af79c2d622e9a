"""Word n-gram models served with numpy alone: TF-IDF of the prompt, the task and its length, a linear head.

The transformer predictor reads only the first ``max_length`` (64) tokens of a prompt,
hint included, to stay within 2 ms per request. This model reads up to ``max_chars``
characters of the prompt as word 1- and 2-grams, at a fraction of a millisecond per
request. It is the shipped default predictor's model (:mod:`.ngram_predictor`) and a
member of the transformer blend (:mod:`.hf`, weight chosen on validation by :mod:`.train`).

Why it is here (measured on the default split, seed 0, 2026-11-30; ``docs/predictor.md``):
with the true task hint, it reached 85.0% validation / 84.5% test accuracy, against
82.9% / 82.0% for the default transformer recipe. On ShareGPT it reached 67.0% against
61.0%. Trained on 1,500 ShareGPT rows instead of 7,519, it fell to 63.9%, so more of the
prompt and more rows are what it adds.

Features of one request (a sparse row):

* :class:`Featurizer`: TF-IDF of the word 1- and 2-grams of the first ``max_chars``
  characters, lower-cased, words matched by ``(?u)\\b\\w\\w+\\b``, term frequency
  ``1 + ln(count)``, times the term's IDF, the row scaled to unit L2 norm. This is
  exactly scikit-learn's ``TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True)`` with
  a fixed vocabulary (a test checks equality to 1e-12), reimplemented so that serving
  needs numpy only; scikit-learn builds the vocabulary and IDF at training time;
* the task one-hot (an unknown or missing task is all zeros);
* ``log1p(prompt_tokens)``, and its product with the task one-hot (a length slope per task).

Classifier: scikit-learn ``LogisticRegression`` (multinomial, lbfgs, L2 with inverse
strength ``C``) at training time; at serving, the scores are ``features @ coef.T +
intercept`` and a softmax. Training adds a copy of a ``task_dropout`` share of the rows
with the task removed, so the model also serves requests without a task label.

Saved as a folder: ``ngram.json`` (settings, tasks, vocabulary in column order) and
``ngram.safetensors`` (``idf``, ``coef`` of shape (classes, features), ``intercept``).
No pickle: loading runs no code from the folder.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .base import PredictorError, clean_prompt, softmax_rows

CONFIG_FILE = "ngram.json"
WEIGHTS_FILE = "ngram.safetensors"
FORMAT = 1
#: Prompt token counts above this are treated as this (2**53, the largest exact float).
MAX_TOKENS = 2**53
#: scikit-learn's default ``token_pattern`` (words of two or more word characters).
TOKEN_RE = re.compile(r"(?u)\b\w\w+\b")


class SparseRows(NamedTuple):
    """A sparse matrix of ``n`` rows as coordinates, sorted by row, no duplicates."""

    n: int
    rows: np.ndarray
    """int64 row index of each entry."""
    cols: np.ndarray
    """int64 column (term) index of each entry."""
    vals: np.ndarray
    """float64 value of each entry."""


class Featurizer:
    """TF-IDF rows of word 1- and 2-grams over a fixed vocabulary, in numpy (module docstring).

    Args:
        terms: the vocabulary in column order (distinct strings).
        idf: float array of shape (len(terms),), each term's inverse document frequency.
        max_chars: prompt characters read (the rest is ignored).

    Raises:
        PredictorError: ``idf`` does not match ``terms``, or ``max_chars`` < 1.
    """

    def __init__(self, terms: Sequence[str], idf: np.ndarray, max_chars: int):
        self.terms = list(terms)
        self.index = {t: i for i, t in enumerate(self.terms)}
        self.idf = np.asarray(idf, dtype=np.float64)
        self.max_chars = int(max_chars)
        if self.idf.shape != (len(self.terms),) or len(self.index) != len(self.terms):
            raise PredictorError(f"idf has shape {self.idf.shape} for {len(self.terms)} terms "
                                 f"({len(self.index)} distinct)")
        if self.idf.size and not (self.idf > 0).all():
            # TF-IDF of a term with idf 0 gives 0/0 rows (NaN probabilities); scikit-learn's idf is >= 1.
            raise PredictorError("idf holds zero or negative values (every idf is >= 1 when fitted)")
        if self.max_chars < 1:
            raise PredictorError(f"max_chars must be >= 1, got {self.max_chars}")

    def __len__(self) -> int:
        return len(self.terms)

    @classmethod
    def fit(cls, texts: Sequence[str], *, max_features: int | None = None, min_df: int = 2,
            max_chars: int = 4000) -> "Featurizer":
        """Vocabulary and IDF from training texts with scikit-learn (training only).

        Keeps the ``max_features`` most frequent terms present in at least ``min_df``
        texts; when no term reaches ``min_df`` (tiny data), every term, plus a placeholder
        so the vocabulary is never empty (a model then decides by task and length alone).

        Raises:
            PredictorError: the vocabulary cannot be built.
        """
        from sklearn.feature_extraction.text import TfidfVectorizer

        cut = [clean_prompt(t, max_chars=max_chars) for t in texts]

        def vec(df: int):
            return TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=df, max_features=max_features,
                                   dtype=np.float64)
        try:
            v = vec(min_df).fit(cut)
        except ValueError:
            try:
                v = vec(1).fit(cut + ["placeholder"])
            except ValueError as e:
                raise PredictorError(f"cannot build the n-gram vocabulary: {e}") from None
        terms = [""] * len(v.vocabulary_)
        for term, col in v.vocabulary_.items():
            terms[col] = term
        return cls(terms, v.idf_, max_chars)

    def transform(self, texts: Sequence[object]) -> SparseRows:
        """Unit-L2 TF-IDF rows of ``texts`` (str, bytes or None; cleaned by :func:`clean_prompt`)."""
        get = self.index.get
        ids: list[int] = []
        counts: list[int] = []
        for t in texts:
            words = TOKEN_RE.findall(clean_prompt(t, max_chars=self.max_chars).lower())
            before = len(ids)
            ids.extend([get(w, -1) for w in words])
            ids.extend([get(a + " " + b, -1) for a, b in zip(words, words[1:])])
            counts.append(len(ids) - before)
        n = len(counts)
        if n == 1:
            # One request (routerd's common case): count in a dict, sparing np.unique's sort.
            tally: dict[int, int] = {}
            for i in ids:
                if i >= 0:
                    tally[i] = tally.get(i, 0) + 1
            cols = np.fromiter(tally.keys(), dtype=np.int64, count=len(tally))
            vals = (1.0 + np.log(np.fromiter(tally.values(), dtype=np.float64, count=len(tally)))) * self.idf[cols]
            if vals.size:
                vals /= np.sqrt(vals @ vals)
            return SparseRows(1, np.zeros(len(tally), dtype=np.int64), cols, vals)
        col = np.asarray(ids, dtype=np.int64)
        row = np.repeat(np.arange(n, dtype=np.int64), counts)
        keep = col >= 0
        width = max(len(self.terms), 1)
        key, cnt = np.unique(row[keep] * width + col[keep], return_counts=True)
        rows, cols = key // width, key % width
        vals = (1.0 + np.log(cnt)) * self.idf[cols]
        norm = np.sqrt(np.bincount(rows, weights=vals * vals, minlength=n))
        vals = vals / norm[rows] if vals.size else vals.astype(np.float64)
        return SparseRows(n, rows, cols, vals)


def row_products(x: SparseRows, w: np.ndarray) -> np.ndarray:
    """``x @ w`` for ``w`` of shape (terms, k): float64 of shape (x.n, k).

    One gather of the present terms' rows and a segmented sum; a single row (routerd's
    common case) is one vector-matrix product, which spares numpy's fixed costs."""
    out = np.zeros((x.n, w.shape[1]))
    if not x.vals.size:
        return out
    if x.n == 1:
        out[0] = x.vals @ w[x.cols]
        return out
    starts = np.flatnonzero(np.diff(x.rows, prepend=-1))
    out[x.rows[starts]] = np.add.reduceat(x.vals[:, None] * w[x.cols], starts, axis=0)
    return out


def log_tokens(prompt_tokens: Sequence[int]) -> np.ndarray:
    """``log1p`` of each token count, clamped to 0..:data:`MAX_TOKENS`; float64 of shape (n,).

    Clamped before converting: a Python int beyond float range (10**400) must not raise.
    """
    return np.log1p(np.array([min(max(int(n), 0), MAX_TOKENS) for n in prompt_tokens], dtype=np.float64))


class NgramModel:
    """A linear head over :class:`Featurizer` rows plus task and length features.

    Columns: the featurizer's terms, then the task one-hot (``len(tasks)``), then
    ``log1p(prompt_tokens)``, then task x ``log1p`` (``len(tasks)``). With ``tasks=[]``
    the model ignores the task (the task classifier).

    Attributes: ``featurizer``, ``tasks`` (known task labels), ``classes`` (number of output
    classes), ``max_chars`` (prompt characters read), ``coef`` (float64, (classes, features)),
    ``intercept`` (float64, (classes,)).

    Raises:
        PredictorError: weights whose shape does not match the vocabulary and tasks.
    """

    def __init__(self, featurizer: Featurizer, tasks: Sequence[str], coef: np.ndarray, intercept: np.ndarray,
                 settings: dict | None = None, *, name: str = "coef"):
        self.featurizer = featurizer
        self.tasks = list(tasks)
        self._task_col = {t: i for i, t in enumerate(self.tasks)}
        self.coef = np.ascontiguousarray(coef, dtype=np.float64)
        self.intercept = np.asarray(intercept, dtype=np.float64)
        self.classes = int(self.coef.shape[0]) if self.coef.ndim == 2 else 0
        self.settings = dict(settings or {})
        v, k = len(featurizer), len(self.tasks)
        expected = v + 2 * k + 1
        if self.coef.ndim != 2 or self.coef.shape[1] != expected:
            raise PredictorError(f"'{name}' has shape {self.coef.shape}; expected ({self.classes}, {expected}) "
                                 f"for {v} terms and {k} tasks")
        if self.intercept.shape != (self.classes,):
            iname = name.replace("coef", "intercept") if "coef" in name else "intercept"
            raise PredictorError(f"'{iname}' has shape {self.intercept.shape}; expected ({self.classes},) "
                                 f"for the {self.classes} classes of '{name}'")
        # Serving gathers one row per present term: (features, classes) keeps them contiguous.
        self._text_w = np.ascontiguousarray(self.coef[:, :v].T)
        self._task_w = np.ascontiguousarray(self.coef[:, v: v + k].T)
        self._len_w = self.coef[:, v + k].copy()
        self._task_len_w = np.ascontiguousarray(self.coef[:, v + k + 1:].T)

    @property
    def max_chars(self) -> int:
        return self.featurizer.max_chars

    def task_index(self, tasks: Sequence[object]) -> np.ndarray:
        """Column of each known task, -1 for an unknown or missing one; int64 of shape (n,)."""
        col = self._task_col.get
        return np.array([col(t, -1) if isinstance(t, str) else -1 for t in tasks], dtype=np.int64)

    # ------------------------------------------------------------------ scores
    def text_scores(self, x: SparseRows) -> np.ndarray:
        """``x @ coef[:, :terms].T``: float64 of shape (x.n, classes)."""
        return row_products(x, self._text_w)

    def scores(self, x: SparseRows, prompt_tokens: Sequence[int], tasks: Sequence[object],
               text: np.ndarray | None = None) -> np.ndarray:
        """Linear scores (logits), float64 of shape (n, classes); ``text`` reuses :meth:`text_scores`."""
        n = x.n
        if not (len(prompt_tokens) == len(tasks) == n):
            raise PredictorError(f"{n} texts, {len(prompt_tokens)} token counts and {len(tasks)} tasks")
        z = (self.text_scores(x) if text is None else text) + self.intercept
        lp = log_tokens(prompt_tokens)
        z = z + lp[:, None] * self._len_w
        tc = self.task_index(tasks)
        has = tc >= 0
        if has.any():
            z[has] += self._task_w[tc[has]] + lp[has, None] * self._task_len_w[tc[has]]
        return z

    def scores_per_task(self, text: np.ndarray, prompt_tokens: Sequence[int]) -> np.ndarray:
        """Logits as if each request had each known task: float64 of shape (n, tasks, classes)."""
        lp = log_tokens(prompt_tokens)
        base = text + self.intercept + lp[:, None] * self._len_w
        return base[:, None, :] + self._task_w[None, :, :] + lp[:, None, None] * self._task_len_w[None, :, :]

    def predict_proba(self, texts: Sequence[object], prompt_tokens: Sequence[int],
                      tasks: Sequence[object]) -> np.ndarray:
        """Class probabilities, float64 array of shape (n, classes); rows sum to 1."""
        if len(texts) == 0:
            return np.zeros((0, self.classes))
        return softmax_rows(self.scores(self.featurizer.transform(texts), prompt_tokens, tasks))

    # ------------------------------------------------------------------ training
    def features(self, texts: Sequence[object], prompt_tokens: Sequence[int], tasks: Sequence[object]):
        """SciPy CSR matrix of shape (n, features), the columns of the class docstring (training only)."""
        from scipy.sparse import csr_matrix, hstack

        x = self.featurizer.transform(texts)
        n, k = x.n, len(self.tasks)
        if not (len(prompt_tokens) == len(tasks) == n):
            raise PredictorError(f"{n} texts, {len(prompt_tokens)} token counts and {len(tasks)} tasks")
        text = csr_matrix((x.vals, (x.rows, x.cols)), shape=(n, len(self.featurizer)))
        lp = log_tokens(prompt_tokens)
        tc = self.task_index(tasks)
        rows, cols, vals = list(range(n)), [k] * n, lp.tolist()
        for i in np.flatnonzero(tc >= 0).tolist():
            rows += [i, i]
            cols += [int(tc[i]), k + 1 + int(tc[i])]
            vals += [1.0, float(lp[i])]
        side = csr_matrix((vals, (rows, cols)), shape=(n, 2 * k + 1))
        return hstack([text, side], format="csr")

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
        featurizer: Featurizer | None = None,
        use_task: bool = True,
        class_weight: str | None = None,
    ) -> "NgramModel":
        """Fit on parallel sequences (prompt texts, prompt tokens, task labels, class labels 0..classes-1).

        Needs scikit-learn. ``featurizer`` reuses a vocabulary (otherwise one is fitted on
        ``texts``); ``use_task=False`` fits a model that ignores the task (no task columns,
        no dropout copies); ``class_weight`` is passed to ``LogisticRegression``.
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
        if featurizer is None:
            featurizer = Featurizer.fit(texts, max_features=max_features, min_df=min_df, max_chars=max_chars)
        known = sorted({t for t in tasks if isinstance(t, str)}) if use_task else []
        model = cls(featurizer, known, np.zeros((classes, len(featurizer) + 2 * len(known) + 1)), np.zeros(classes))
        tokens = list(prompt_tokens)
        task_list = list(tasks) if use_task else [None] * n
        rng = np.random.default_rng(seed)
        drop = np.flatnonzero(rng.random(n) < task_dropout) if use_task else np.zeros(0, dtype=np.int64)
        X = model.features(texts + [texts[i] for i in drop], tokens + [tokens[i] for i in drop],
                           task_list + [None] * len(drop))
        yy = np.concatenate([y, y[drop]])
        coef = np.zeros_like(model.coef)
        intercept = np.zeros(classes)
        present = np.unique(yy)
        intercept[:] = -30.0  # classes absent from training: never predicted (a large margin)
        if present.size == 1:
            # sklearn refuses a single class: the exact fit is a constant.
            intercept[present[0]] = 0.0
        else:
            clf = LogisticRegression(C=C, max_iter=max_iter, class_weight=class_weight)
            clf.fit(X, yy)
            coef[present] = clf.coef_ if present.size > 2 else np.vstack([-clf.coef_ / 2, clf.coef_ / 2])
            intercept[present] = clf.intercept_ if present.size > 2 else np.array(
                [-clf.intercept_[0] / 2, clf.intercept_[0] / 2])
        settings = {"C": C, "max_features": max_features, "min_df": min_df, "task_dropout": task_dropout,
                    "seed": seed, "train_rows": n, "dropout_rows": int(drop.size), "class_weight": class_weight}
        return cls(featurizer, known, coef, intercept, settings)

    # ------------------------------------------------------------------ persistence
    def save(self, folder: str | Path, *, dtype=np.float64) -> None:
        """Write ``ngram.json`` and ``ngram.safetensors`` into ``folder`` (created if missing).

        ``dtype`` is the stored float type (float32 halves the file; scores then differ
        by float32 rounding, about 1e-7 relative)."""
        from safetensors.numpy import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config = {"format": FORMAT, "kind": "tfidf-word-1-2+task+length/logistic-regression",
                  "classes": self.classes, "tasks": self.tasks, "max_chars": self.max_chars,
                  "settings": self.settings, "vocabulary": self.featurizer.terms}
        (folder / CONFIG_FILE).write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
        save_file({"idf": self.featurizer.idf.astype(dtype), "coef": self.coef.astype(dtype),
                   "intercept": self.intercept.astype(dtype)}, str(folder / WEIGHTS_FILE))

    @classmethod
    def load(cls, folder: str | Path) -> "NgramModel":
        """Read a folder written by :meth:`save`.

        Raises:
            PredictorError: a missing or unreadable file, another format, or weights that do
                not match the vocabulary and tasks (the message names the file and field).
        """
        folder = Path(folder)
        cfg_path, w_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
        cfg = read_json(cfg_path, "the n-gram model")
        try:
            fmt, terms, tasks = cfg["format"], cfg["vocabulary"], cfg["tasks"]
            max_chars = cfg["max_chars"]
            settings = cfg.get("settings", {})
        except (KeyError, TypeError, AttributeError) as e:
            raise PredictorError(f"{cfg_path}: cannot read the n-gram model ({type(e).__name__}: {e})") from None
        if fmt != FORMAT:
            raise PredictorError(f"{cfg_path}: n-gram format {fmt!r}, this version reads {FORMAT}")
        check_vocabulary(cfg_path, terms)
        check_tasks(cfg_path, "tasks", tasks)
        check_max_chars(cfg_path, max_chars)
        if not isinstance(settings, dict):
            raise PredictorError(f"{cfg_path}: 'settings' must be an object")
        w = read_weights(w_path, {"idf": 1, "coef": 2, "intercept": 1})
        idf, coef, intercept = w["idf"], w["coef"], w["intercept"]
        if idf.shape != (len(terms),):
            raise PredictorError(f"{w_path}: idf has shape {idf.shape}, the vocabulary has {len(terms)} terms")
        if coef.shape[0] < 2:
            raise PredictorError(f"{w_path}: coef has {coef.shape[0]} classes, at least 2 are needed")
        try:
            return cls(Featurizer(terms, idf, max_chars), tasks, coef, intercept, settings)
        except PredictorError as e:
            raise PredictorError(f"{w_path}: {e}") from None


# ----------------------------------------------------------------------------- file checks


def read_json(path: Path, what: str) -> dict:
    """A JSON object from ``path``; :class:`PredictorError` naming the file otherwise."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise PredictorError(f"{path}: cannot read {what} ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise PredictorError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def check_vocabulary(path: Path, terms: object) -> None:
    """``terms`` must be a non-empty list of distinct strings."""
    if (not isinstance(terms, list) or not terms or not all(isinstance(t, str) for t in terms)
            or len(set(terms)) != len(terms)):
        raise PredictorError(f"{path}: the vocabulary must be a non-empty list of distinct strings")


def check_tasks(path: Path, field: str, tasks: object) -> None:
    """``tasks`` must be a list of distinct strings."""
    if not isinstance(tasks, list) or not all(isinstance(t, str) for t in tasks) or len(set(tasks)) != len(tasks):
        raise PredictorError(f"{path}: '{field}' must be a list of distinct strings")


#: The most prompt characters a model may read (it bounds the per-request cost: about
#: 0.9 ms per 4,000 characters, measured with the shipped model).
MAX_CHARS_LIMIT = 100_000


def check_max_chars(path: Path, max_chars: object) -> None:
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or not 1 <= max_chars <= MAX_CHARS_LIMIT:
        raise PredictorError(f"{path}: 'max_chars' must be an integer in 1..{MAX_CHARS_LIMIT}, got {max_chars!r}")


def read_weights(path: Path, ndims: dict[str, int]) -> dict[str, np.ndarray]:
    """The named float tensors of a safetensors file, each with the given number of dimensions.

    Raises:
        PredictorError: the file is missing or unreadable, a tensor is missing, not float,
            empty, of another rank, or holds NaN or infinite values (the message names it).
    """
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        w = load_file(str(path))
        out = {name: w[name] for name in ndims}
    except (OSError, SafetensorError, KeyError, ValueError, TypeError, AttributeError) as e:
        # TypeError / AttributeError: a dtype numpy lacks (bfloat16, float8).
        raise PredictorError(f"{path}: cannot read the n-gram weights ({type(e).__name__}: {e})") from None
    for name, arr in out.items():
        if arr.ndim != ndims[name] or arr.dtype.kind != "f" or arr.size == 0:
            raise PredictorError(f"{path}: '{name}' must be a non-empty {ndims[name]}-D float array, "
                                 f"got shape {arr.shape} of {arr.dtype}")
        if not np.isfinite(arr).all():
            raise PredictorError(f"{path}: '{name}' holds NaN or infinite values")
    return out
