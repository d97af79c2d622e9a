"""The n-gram length predictor: bucket model and task classifier on one vocabulary, numpy only.

This is the predictor Phasewise ships and uses by default (``load_predictor("default")``,
the folder ``routerd/data/predictor/default``). It needs numpy and safetensors, never
torch, scikit-learn or pickle: weights are safetensors, settings and vocabulary JSON.
scikit-learn is needed only to train one (:mod:`routerd.predictor.train_ngram`,
``pip install 'phasewise[predictor-train]'``).

Two linear heads share one :class:`~routerd.predictor.ngram.Featurizer` (word 1-2-gram
TF-IDF of the first ``max_chars`` characters), so a request is tokenised once:

- the **bucket model** (:class:`~routerd.predictor.ngram.NgramModel`): TF-IDF, task
  one-hot, ``log1p(prompt_tokens)`` and task x ``log1p``; trained with a share of rows
  whose task is removed, so it also predicts without a task;
- the **task classifier**: the same TF-IDF and ``log1p(prompt_tokens)``, the task labels
  as classes.

Task hint modes (``hint``), for the arXiv 2408.13510 §5.1 task hint:

- ``true``: the request's task when the model knows it, otherwise none;
- ``none``: never a task;
- ``predicted``: always the task classifier's most likely task;
- ``mixture``: the bucket probabilities averaged over the task classifier's posterior,
  ``P(b | x) = sum_t P(t | x) P(b | x, t)`` (cheap: the TF-IDF part of the score is
  shared by every task);
- ``auto`` (default): the request's task when known; otherwise ``auto_missing``, the one
  of ``none`` / ``predicted`` / ``mixture`` with the best validation accuracy when the
  tasks are removed (chosen at training time, saved in ``predictor.json``).

Requests **without prompt text** (traces, token-id prompts; ``None`` or blank after
cleaning) get the training prior instead of the model: the class frequencies of the
training rows of the request's task, or of all training rows (``prior`` in
``predictor.json``). The model learned its length slope beside the words of each prompt;
measured on the Azure traces, applying it to a bare length put 0.9% (conv) and 2.2%
(code) of requests in the right bucket, against 56.1% and 98.8% for the majority bucket.
The ``text`` field of :meth:`NgramPredictor.explain` says which was used. A folder
without ``prior`` uses the model for them too.

Folder layout: ``predictor.json`` (``kind: "ngram"``, edges, classes, tasks, settings,
training data and licences, metrics), ``vocabulary.json`` (terms in column order),
``weights.safetensors`` (``idf``, ``bucket.coef``, ``bucket.intercept``, ``task.coef``,
``task.intercept``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .base import Item, PredictorError, check_edges, clean_prompt, clean_task, softmax_rows, unpack
from .ngram import (Featurizer, NgramModel, check_max_chars, check_tasks, check_vocabulary, read_json,
                    read_weights, row_products)

META_FILE = "predictor.json"
VOCAB_FILE = "vocabulary.json"
WEIGHTS_FILE = "weights.safetensors"
KIND = "ngram"
FORMAT = 1
HINT_MODES: tuple[str, ...] = ("auto", "true", "predicted", "mixture", "none")
#: What ``auto`` may do for a request without a known task.
MISSING_MODES: tuple[str, ...] = ("none", "predicted", "mixture")


def shipped_dir() -> Path:
    """The folder of the shipped default predictor inside the installed package."""
    return Path(__file__).resolve().parent.parent / "data" / "predictor" / "default"


class NgramPredictor:
    """A saved n-gram predictor (module docstring); a :class:`~routerd.predictor.base.LengthPredictor`.

    Args:
        meta: the ``predictor.json`` object (``edges``, ``auto_missing`` ...).
        bucket: the bucket model; ``task``: the task classifier (its classes are
            ``bucket.tasks``, in that order) or None.
        hint: one of :data:`HINT_MODES`.
        path: the folder it was loaded from (for messages), or None.

    Raises:
        PredictorError: an unknown hint mode, ``predicted``/``mixture`` without a task
            classifier, or heads that do not fit together.
    """

    kind = KIND

    def __init__(self, meta: dict, bucket: NgramModel, task: NgramModel | None, *, hint: str = "auto",
                 path: Path | None = None):
        where = f"{path / META_FILE}: " if path is not None else ""
        self.path = path
        self.meta = meta
        self.edges = check_edges(meta["edges"])
        self.bucket = bucket
        self.task_model = task
        self.featurizer = bucket.featurizer
        self.tasks = list(bucket.tasks)
        if bucket.classes > len(self.edges) + 1:
            raise PredictorError(f"{where}field 'edges' gives {len(self.edges) + 1} buckets, but the bucket "
                                 f"model has {bucket.classes} classes")
        if task is not None:
            if task.featurizer is not bucket.featurizer or task.tasks:
                raise PredictorError(f"{where}the task classifier must share the vocabulary and ignore the task")
            if task.classes != len(self.tasks):
                raise PredictorError(f"{where}the task classifier has {task.classes} classes, "
                                     f"the bucket model knows {len(self.tasks)} tasks")
        self.auto_missing = meta.get("auto_missing", "none")
        if self.auto_missing not in MISSING_MODES:
            raise PredictorError(f"{where}field 'auto_missing' is {self.auto_missing!r}; valid: "
                                 f"{', '.join(MISSING_MODES)}")
        if self.auto_missing != "none" and task is None:
            raise PredictorError(f"{where}field 'auto_missing' is {self.auto_missing!r}, which needs a task "
                                 "classifier, but field 'task_classifier' is false")
        if not isinstance(meta.get("name", "model"), str):
            raise PredictorError(f"{where}field 'name' must be a string")
        self.prior, self.task_prior = self._read_prior(meta.get("prior"), where)
        # Both heads' term weights side by side: a request's terms are gathered once.
        self._both_w = None if task is None else np.ascontiguousarray(np.hstack([bucket._text_w, task._text_w]))
        self.hint = hint
        self.unknown_tasks = 0
        """Requests seen with a task label outside :attr:`tasks` (predicted as if it had none)."""

    def _read_prior(self, prior: object, where: str) -> tuple[np.ndarray | None, dict[str, np.ndarray]]:
        """(overall class frequencies, per-task frequencies) from ``meta['prior']``, or (None, {})."""
        if prior is None:
            return None, {}
        c = self.bucket.classes

        def freqs(v: object, field: str) -> np.ndarray:
            ok = (isinstance(v, list) and len(v) == c
                  and all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in v))
            if not ok or sum(v) <= 0:
                raise PredictorError(f"{where}field {field!r} must be {c} non-negative numbers, not all 0")
            a = np.asarray(v, dtype=np.float64)
            return a / a.sum()
        if not isinstance(prior, dict) or not isinstance(prior.get("tasks", {}), dict):
            raise PredictorError(f"{where}field 'prior' must be an object with 'all' and 'tasks'")
        return freqs(prior.get("all"), "prior.all"), {
            t: freqs(v, f"prior.tasks.{t}") for t, v in prior.get("tasks", {}).items() if t in self.tasks}

    @property
    def hint(self) -> str:
        return self._hint

    @hint.setter
    def hint(self, mode: str) -> None:
        if mode not in HINT_MODES:
            raise PredictorError(f"unknown hint mode {mode!r}; valid: {', '.join(HINT_MODES)}")
        if mode in ("predicted", "mixture") and self.task_model is None:
            raise PredictorError(f"hint mode {mode!r} needs a task classifier, which this model lacks")
        self._hint = mode

    @property
    def name(self) -> str:
        """``ngram:<name>[<hint mode>]``, e.g. ``ngram:default[auto]``."""
        return f"ngram:{self.meta.get('name', 'model')}[{self.hint}]"

    # ------------------------------------------------------------------ inference
    def _modes(self, known: list[str | None]) -> list[str]:
        """Per request: ``given`` (its own task), ``none``, ``predicted`` or ``mixture``."""
        if self.hint == "none":
            return ["none"] * len(known)
        if self.hint == "true":
            return ["given" if t is not None else "none" for t in known]
        if self.hint in ("predicted", "mixture"):
            return [self.hint] * len(known)
        return ["given" if t is not None else self.auto_missing for t in known]

    def explain(self, batch: Sequence[Item]) -> tuple[np.ndarray, list[dict]]:
        """Class probabilities (float64, (n, classes), rows sum to 1) and, per request, the task used.

        Each dict holds ``task`` (the label used, or None), ``task_source`` (``given``,
        ``predicted``, ``mixture``: the most likely task of the posterior, or ``none``),
        ``task_probability`` (the classifier's probability of that task, or None) and
        ``text`` (False when the request had no prompt text and got the training prior).

        Raises:
            PredictorError: a malformed batch (see :func:`~routerd.predictor.base.unpack`).
        """
        prompts, tokens, tasks = unpack(batch)
        n = len(prompts)
        if n == 0:
            return np.zeros((0, self.bucket.classes)), []
        known = [clean_task(t, self.tasks) for t in tasks]
        self.unknown_tasks += sum(1 for t, k in zip(tasks, known) if t is not None and k is None)
        modes = self._modes(known)
        x = self.featurizer.transform(prompts)
        # No text: the prior (module docstring); a task can then only be the given one.
        bare = np.zeros(n, dtype=bool) if self.prior is None else np.bincount(x.rows, minlength=n) == 0
        if bare.any():
            bare &= np.array([not clean_prompt(p).strip() for p in prompts])
            for i in np.flatnonzero(bare):
                modes[i] = "given" if modes[i] == "given" else "none"
        need_post = any(m in ("predicted", "mixture") for m in modes)
        c = self.bucket.classes
        if need_post:
            both = row_products(x, self._both_w)
            text, task_text = both[:, :c], both[:, c:]
        else:
            text = row_products(x, self.bucket._text_w)
        used: list[str | None] = [k if m == "given" else None for k, m in zip(known, modes)]
        post = None
        if need_post:
            post = softmax_rows(self.task_model.scores(x, tokens, [None] * n, text=task_text))
            top = post.argmax(axis=1)
            for i, m in enumerate(modes):
                if m == "predicted":
                    used[i] = self.tasks[int(top[i])]
        probs = softmax_rows(self.bucket.scores(x, tokens, used, text=text))
        mix = [i for i, m in enumerate(modes) if m == "mixture"]
        if mix:
            per = self.bucket.scores_per_task(text[mix], [tokens[i] for i in mix])  # (m, tasks, classes)
            per = np.exp(per - per.max(axis=2, keepdims=True))
            per /= per.sum(axis=2, keepdims=True)
            probs[mix] = np.einsum("mt,mtc->mc", post[mix], per)
        for i in np.flatnonzero(bare):
            probs[i] = self.task_prior.get(used[i], self.prior) if used[i] is not None else self.prior
        info = []
        for i, m in enumerate(modes):
            if m in ("predicted", "mixture"):
                t = int(post[i].argmax())
                info.append({"task": self.tasks[t], "task_source": m, "task_probability": float(post[i, t]),
                             "text": True})
            else:
                info.append({"task": used[i], "task_source": m, "task_probability": None, "text": not bool(bare[i])})
        return probs, info

    def predict_proba(self, batch: Sequence[Item]) -> np.ndarray:
        """Class probabilities, float64 of shape (len(batch), classes); see :meth:`explain`."""
        return self.explain(batch)[0]

    def predict(self, batch: Sequence[Item]) -> list[int]:
        """Bucket of each item (never above the model's last class)."""
        return [int(b) for b in self.predict_proba(batch).argmax(axis=1)]

    def predict_tasks(self, batch: Sequence[Item]) -> list[str]:
        """The task classifier's most likely task for each item (its ``task`` field is ignored)."""
        if self.task_model is None:
            raise PredictorError("this model has no task classifier")
        prompts, tokens, _ = unpack(batch)
        if not prompts:
            return []
        x = self.featurizer.transform(prompts)
        top = self.task_model.scores(x, tokens, [None] * len(prompts)).argmax(axis=1)
        return [self.tasks[int(i)] for i in top]

    # ------------------------------------------------------------------ persistence
    def save(self, folder: str | Path, *, dtype=np.float32) -> Path:
        """Write the three files of the module docstring into ``folder`` (created if missing).

        Weights are stored as ``dtype`` (float32 by default: half the size; scores change
        by float32 rounding, about 1e-7 relative). Returns the folder."""
        from safetensors.numpy import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        meta = dict(self.meta)
        meta.update(kind=KIND, format=FORMAT, edges=list(self.edges), classes=self.bucket.classes,
                    tasks=self.tasks, max_chars=self.featurizer.max_chars, auto_missing=self.auto_missing,
                    task_classifier=self.task_model is not None)
        tensors = {"idf": self.featurizer.idf.astype(dtype), "bucket.coef": self.bucket.coef.astype(dtype),
                   "bucket.intercept": self.bucket.intercept.astype(dtype)}
        if self.task_model is not None:
            tensors["task.coef"] = self.task_model.coef.astype(dtype)
            tensors["task.intercept"] = self.task_model.intercept.astype(dtype)
        (folder / VOCAB_FILE).write_text(json.dumps(self.featurizer.terms, ensure_ascii=False), encoding="utf-8")
        save_file(tensors, str(folder / WEIGHTS_FILE))
        # safetensors writes 0600; a model folder is read by other users (a service account, a container).
        (folder / WEIGHTS_FILE).chmod(0o644)
        (folder / META_FILE).write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        return folder

    @classmethod
    def load(cls, folder: str | Path, *, hint: str = "auto") -> "NgramPredictor":
        """Load a folder written by :meth:`save`.

        Raises:
            PredictorError: a missing, unreadable or inconsistent file; the message names
                the file and the field.
        """
        folder = Path(folder)
        meta_path, vocab_path, w_path = folder / META_FILE, folder / VOCAB_FILE, folder / WEIGHTS_FILE
        meta = read_json(meta_path, "the predictor metadata")
        if meta.get("kind") != KIND:
            raise PredictorError(f"{meta_path}: field 'kind' is {meta.get('kind')!r}, expected {KIND!r}")
        if meta.get("format") != FORMAT or isinstance(meta.get("format"), bool):
            raise PredictorError(f"{meta_path}: field 'format' is {meta.get('format')!r}, this version reads {FORMAT}")
        for key in ("edges", "tasks", "max_chars"):
            if key not in meta:
                raise PredictorError(f"{meta_path}: field {key!r} is missing")
        edges = meta["edges"]
        if not isinstance(edges, list) or not all(isinstance(e, int) and not isinstance(e, bool) for e in edges):
            raise PredictorError(f"{meta_path}: field 'edges' must be a list of integers")
        try:
            check_edges(edges)
        except PredictorError as e:
            raise PredictorError(f"{meta_path}: field 'edges': {e}") from None
        check_tasks(meta_path, "tasks", meta["tasks"])
        check_max_chars(meta_path, meta["max_chars"])
        try:
            terms = json.loads(vocab_path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as e:
            raise PredictorError(f"{vocab_path}: cannot read the vocabulary ({type(e).__name__}: {e})") from None
        check_vocabulary(vocab_path, terms)
        names = {"idf": 1, "bucket.coef": 2, "bucket.intercept": 1}
        has_task = meta.get("task_classifier", False)
        if not isinstance(has_task, bool):
            raise PredictorError(f"{meta_path}: field 'task_classifier' must be true or false")
        if has_task:
            names.update({"task.coef": 2, "task.intercept": 1})
        w = read_weights(w_path, names)
        try:
            feat = Featurizer(terms, w["idf"], meta["max_chars"])
            bucket = NgramModel(feat, meta["tasks"], w["bucket.coef"], w["bucket.intercept"], name="bucket.coef")
            task = NgramModel(feat, [], w["task.coef"], w["task.intercept"], name="task.coef") if has_task else None
            if bucket.classes < 2:
                raise PredictorError(f"bucket.coef has {bucket.classes} classes, at least 2 are needed")
        except PredictorError as e:
            raise PredictorError(f"{w_path}: {e}") from None
        if "classes" in meta and meta["classes"] != bucket.classes:
            raise PredictorError(f"{meta_path}: field 'classes' is {meta['classes']!r}, but bucket.coef in "
                                 f"{WEIGHTS_FILE} has {bucket.classes}")
        return cls(meta, bucket, task, hint=hint, path=folder)


def load_shipped(hint: str = "auto") -> NgramPredictor:
    """The shipped default predictor (:func:`shipped_dir`).

    Raises:
        PredictorError: the folder is missing or damaged (a broken install).
    """
    folder = shipped_dir()
    if not (folder / META_FILE).is_file():
        raise PredictorError(f"{folder}: the shipped predictor is missing from this install")
    return NgramPredictor.load(folder, hint=hint)
