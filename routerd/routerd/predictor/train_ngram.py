"""Train the n-gram predictor (:mod:`.ngram_predictor`), top to bottom. Needs scikit-learn only.

Run it as ``phasewise predictor train --kind ngram --out DIR`` (``pip install
'phasewise[predictor-train]'``). The shipped default was made with
``--sources permissive`` (see ``docs/predictor.md`` for the command and its figures).
What happens, in order:

1. **Data.** All rows of ``shared/data/prompts`` (:mod:`routerd.predictor.data`), split
   80/10/10 by prompt, stratified by (task, bucket), seed ``--seed``: the same split as
   the transformer's when it trains on every file, so the figures compare. With
   ``--sources``, only the *training* rows of those files are used to fit; validation and
   test stay the whole split (and are also reported per dataset), so a model trained on
   some files is measured on prompts unlike its training data too. Top buckets with
   fewer than ``--min-class-rows`` training rows merge downwards (as the transformer's).
2. **Vocabulary.** Word 1-2-grams of the first 4,000 characters of the training prompts
   in at least 2 of them, the ``--ngram-max-features`` most frequent
   (:meth:`~routerd.predictor.ngram.Featurizer.fit`).
3. **Bucket model.** Logistic regression (C ``--ngram-c``) on TF-IDF, task one-hot,
   ``log1p(prompt_tokens)`` and task x ``log1p``; a ``--hint-dropout`` share of the rows
   is added again without its task so the model also serves requests without one.
4. **Task classifier.** Logistic regression (C ``--ngram-task-c``) on the same TF-IDF and
   ``log1p(prompt_tokens)`` with the task as the class, on at most ``--task-max-per-task``
   rows per task (so 7.5k chat rows do not drown 200 of a small task).
5. **Prior.** The training class counts, overall and per task: what requests without
   prompt text get (:mod:`.ngram_predictor`).
6. **Save and reload** as served: float32 safetensors, then every figure below is
   measured on the reloaded model.
7. **Choices on validation.** ``auto_missing`` (what ``auto`` does for a request
   without a known task) is the one of ``none``, ``predicted`` and ``mixture`` with the
   best validation accuracy with every task removed (ties: ``none``, then ``mixture``).
8. **Test.** Measured once, after every choice: accuracy with the true task, without,
   with each hint mode; per dataset; the task classifier's accuracy on the rows whose
   task it knows, and on all rows.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from routerd.predictor import data as D
from routerd.predictor.base import PredictorError, merge_sparse_buckets
from routerd.predictor.ngram import Featurizer, NgramModel
from routerd.predictor.ngram_predictor import MISSING_MODES, NgramPredictor

#: Order in which ``auto_missing`` ties are broken (the cheapest first).
_TIE_ORDER = ("none", "mixture", "predicted")


def _log(args, msg: str) -> None:
    if args.log:
        print(f"[train] {msg}", file=sys.stderr, flush=True)


def _accuracy(pred: NgramPredictor, rows: Sequence[D.Row], idx: np.ndarray, y: np.ndarray, *,
              with_task: bool) -> np.ndarray:
    """Per-row correctness (bool array) of ``pred`` under its current hint mode."""
    batch = [(rows[i].prompt, rows[i].prompt_tokens, rows[i].task if with_task else None) for i in idx]
    out = np.zeros(len(idx), dtype=bool)
    for k in range(0, len(batch), 256):
        out[k: k + 256] = np.asarray(pred.predict(batch[k: k + 256])) == y[idx[k: k + 256]]
    return out


def evaluate_split(pred: NgramPredictor, rows: Sequence[D.Row], idx: np.ndarray, y: np.ndarray) -> dict:
    """Accuracy of every hint mode, per dataset, and of the task classifier, on rows ``idx``."""
    saved = pred.hint
    res: dict = {"rows": int(len(idx))}
    per_mode: dict[str, np.ndarray] = {}
    try:
        pred.hint = "true"
        per_mode["hint_true"] = _accuracy(pred, rows, idx, y, with_task=True)
        for m in MISSING_MODES:
            if m != "none" and pred.task_model is None:
                continue
            pred.hint = m
            per_mode[f"hint_{m}"] = _accuracy(pred, rows, idx, y, with_task=False)
    finally:
        pred.hint = saved
    for k, ok in per_mode.items():
        res[k] = float(ok.mean()) if ok.size else 0.0
    res["dataset"] = {}
    for ds in sorted({rows[i].dataset for i in idx}):
        mask = np.array([rows[i].dataset == ds for i in idx])
        res["dataset"][ds] = {"rows": int(mask.sum()),
                              **{k: float(ok[mask].mean()) for k, ok in per_mode.items()}}
    if pred.task_model is not None:
        guessed = []
        batch = [(rows[i].prompt, rows[i].prompt_tokens, None) for i in idx]
        for k in range(0, len(batch), 256):
            guessed += pred.predict_tasks(batch[k: k + 256])
        truth = [rows[i].task for i in idx]
        ok = np.array([g == t for g, t in zip(guessed, truth)])
        known = np.array([t in pred.tasks for t in truth])
        res["task_accuracy_known"] = float(ok[known].mean()) if known.any() else 0.0
        res["task_accuracy_all"] = float(ok.mean()) if ok.size else 0.0
        res["rows_with_known_task"] = int(known.sum())
    return res


def train_ngram(args, *, rows: Sequence[D.Row] | None = None, train_datasets: set[str] | None = None) -> Path:
    """Steps 1-8 of the module docstring; returns the output folder.

    Args:
        args: a :class:`routerd.predictor.train.Args` (``out``, ``data_dir``, ``sources``,
            ``edges``, ``seed``, ``min_class_rows``, ``ngram_c``, ``ngram_max_features``,
            ``hint_dropout``, ``task_max_per_task``, ``ngram_max_train_per_task``,
            ``max_eval_per_task``, ``skip_test``, ``log``, ``name``).
        rows: rows to use instead of reading ``args.data_dir`` (tests).
        train_datasets: with ``rows``, the datasets (``Row.dataset``) to fit on (None: all).

    Raises:
        PredictorError: too few rows or classes, bad settings, missing scikit-learn.
        routerd.workloads.errors.WorkloadError: data directory or prompt file problems.
    """
    try:
        import sklearn  # noqa: F401
    except ImportError:
        raise PredictorError("training the n-gram predictor needs scikit-learn: "
                             "pip install 'phasewise[predictor-train]'") from None
    t0 = time.perf_counter()
    # ---- 1. data
    if rows is None:
        rows = D.load_rows(args.data_dir, alpaca_model=args.alpaca_model)
        if args.sources:
            train_datasets = {r.dataset for r in D.load_rows(args.data_dir, sources=args.sources,
                                                            alpaca_model=args.alpaca_model)}
    if not rows:
        raise PredictorError("no training rows")
    edges = tuple(args.edges)
    split = D.split_rows(rows, seed=args.seed, edges=edges)
    labels = D.labels_of(rows, edges)
    train_idx = split["train"]
    if train_datasets is not None:
        train_idx = np.array([i for i in train_idx if rows[i].dataset in train_datasets], dtype=np.int64)
    train_idx = D.cap_per_task(rows, train_idx, args.ngram_max_train_per_task, seed=args.seed)
    val_idx = D.cap_per_task(rows, split["val"], args.max_eval_per_task, seed=args.seed)
    test_idx = D.cap_per_task(rows, split["test"], args.max_eval_per_task, seed=args.seed)
    if len(train_idx) == 0 or len(val_idx) == 0:
        raise PredictorError(f"too few rows to train and validate ({len(train_idx)} training, "
                             f"{len(val_idx)} validation)")
    n_classes = merge_sparse_buckets(np.bincount(labels[train_idx], minlength=len(edges) + 1).tolist(),
                                     args.min_class_rows)
    y = np.minimum(labels, n_classes - 1)
    texts = [rows[i].prompt for i in train_idx]
    tokens = [rows[i].prompt_tokens for i in train_idx]
    tasks = [rows[i].task for i in train_idx]
    _log(args, f"{len(rows)} rows, split {[len(split[s]) for s in D.SPLITS]}, fitting on {len(train_idx)} "
               f"({len(set(tasks))} tasks), {n_classes} classes")

    # ---- 2. vocabulary
    feat = Featurizer.fit(texts, max_features=args.ngram_max_features, min_df=2)
    # ---- 3. bucket model
    bucket = NgramModel.fit(texts, tokens, tasks, y[train_idx], classes=n_classes, C=args.ngram_c,
                            task_dropout=args.hint_dropout, seed=args.seed, featurizer=feat)
    _log(args, f"bucket model: {len(feat)} terms, {time.perf_counter() - t0:.0f} s")
    # ---- 4. task classifier
    task_model = None
    if len(bucket.tasks) >= 2:
        code = {t: i for i, t in enumerate(bucket.tasks)}
        t_idx = D.cap_per_task(rows, train_idx, args.task_max_per_task, seed=args.seed)
        task_model = NgramModel.fit([rows[i].prompt for i in t_idx], [rows[i].prompt_tokens for i in t_idx],
                                    [None] * len(t_idx), [code[rows[i].task] for i in t_idx],
                                    classes=len(bucket.tasks), C=args.ngram_task_c, featurizer=feat,
                                    use_task=False)
        _log(args, f"task classifier: {len(t_idx)} rows, {time.perf_counter() - t0:.0f} s")

    # ---- 5. prior, 6. save and reload as served
    # The prior for requests without text: training class counts, overall and per task.
    prior = {"all": np.bincount(y[train_idx], minlength=n_classes).tolist(),
             "tasks": {t: np.bincount(y[[i for i in train_idx if rows[i].task == t]], minlength=n_classes).tolist()
                       for t in bucket.tasks}}
    meta = {"name": getattr(args, "name", None) or Path(args.out).name or "model", "auto_missing": "none",
            "edges": list(edges), "prior": prior,
            "training": training_record(args, rows, train_idx, train_datasets, edges, n_classes, feat)}
    out = NgramPredictor(meta, bucket, task_model).save(args.out)
    pred = NgramPredictor.load(out)

    # ---- 7. choices on validation
    val = evaluate_split(pred, rows, val_idx, y)
    cands = [m for m in _TIE_ORDER if f"hint_{m}" in val]
    pred.auto_missing = max(cands, key=lambda m: (val[f"hint_{m}"], -_TIE_ORDER.index(m)))
    metrics = {"val": val}
    # ---- 8. test, once
    if not args.skip_test and len(test_idx):
        metrics["test"] = evaluate_split(pred, rows, test_idx, y)
    pred.meta.update(auto_missing=pred.auto_missing, metrics=metrics,
                     train_seconds=round(time.perf_counter() - t0, 1))
    pred.save(out)
    for s, m in metrics.items():
        _log(args, f"{s}: true task {m['hint_true']:.4f}, no task {m['hint_none']:.4f}, "
                   f"auto without task ({pred.auto_missing}) {m['hint_' + pred.auto_missing]:.4f}"
                   + (f", task classifier {m['task_accuracy_known']:.4f}" if "task_accuracy_known" in m else ""))
    return out


def training_record(args, rows, train_idx, train_datasets, edges, n_classes, feat) -> dict:
    """What the model was fitted on (files, licences, rows) and with which settings."""
    used = sorted({rows[i].dataset for i in train_idx})
    sources = sorted(args.sources) if args.sources else sorted({D.source_of(ds) for ds in used})
    return {
        "sources": sources,
        "licenses": {s: D.SOURCE_LICENSES.get(s, "unknown") for s in sources},
        "datasets": used,
        "rows": int(len(train_idx)),
        "split_seed": args.seed,
        "edges": list(edges),
        "classes": n_classes,
        "terms": len(feat),
        "settings": {"C": args.ngram_c, "task_C": args.ngram_task_c, "max_features": args.ngram_max_features,
                     "min_df": 2,
                     "max_chars": feat.max_chars, "task_dropout": args.hint_dropout,
                     "task_max_per_task": args.task_max_per_task, "min_class_rows": args.min_class_rows},
    }
