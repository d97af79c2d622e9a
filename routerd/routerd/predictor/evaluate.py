"""Table-1-style evaluation: accuracy, macro-F1 and confusion matrices per dataset and task.

Compares, on one split of the seeded stratified split (:func:`routerd.predictor.data.split_rows`):

- ``majority``: the most frequent training bucket;
- ``task-prior``: the most frequent training bucket of the task (needs the task);
- ``length-only``: gradient boosting on prompt length alone;
- ``length+task``: gradient boosting on prompt length and task (the paper's production
  variant, arXiv 2408.13510 A.12);
- ``transformer, no hint`` / ``, predicted hint`` / ``, true hint``: the saved model
  without a task, with the task model's guess, with the true task (the paper's Table 1
  with and without the task hint). A model with an n-gram part (:mod:`.ngram`) is
  named ``transformer + n-gram (w=...)``, with two more rows under the true hint:
  ``transformer alone`` and ``n-gram alone``.

Baselines are fitted on the whole training split (for an n-gram model, on the training
rows of the files it was fitted on, so both saw the same data); the transformer is evaluated as
served (int8). "overall" weights every row equally; "task-balanced" is the mean of the
per-task accuracies, i.e. what a workload drawing tasks uniformly (``public-mix``) sees.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from .base import Item, LengthOnlyPredictor, MajorityPredictor, TaskPriorPredictor, check_edges


def metrics(y_true: np.ndarray, y_pred: np.ndarray, n_buckets: int) -> dict:
    """Accuracy, macro-F1 and confusion matrix of bucket predictions.

    Args:
        y_true, y_pred: int arrays of shape (n,), bucket indices in [0, n_buckets).
        n_buckets: number of buckets (rows/columns of the confusion matrix).

    Returns:
        ``{"n", "accuracy", "macro_f1", "confusion"}``; ``confusion[t][p]`` counts rows
        of true bucket ``t`` predicted ``p``. Macro-F1 averages F1 over the buckets that
        occur in ``y_true`` or ``y_pred`` (as scikit-learn does), 0 for an empty input.
    """
    y_true = np.asarray(y_true, dtype=np.int64)
    y_pred = np.asarray(y_pred, dtype=np.int64)
    cm = np.zeros((n_buckets, n_buckets), dtype=np.int64)
    np.add.at(cm, (y_true, y_pred), 1)
    n = int(cm.sum())
    f1s = []
    for b in range(n_buckets):
        tp = cm[b, b]
        support, predicted = cm[b].sum(), cm[:, b].sum()
        if support == 0 and predicted == 0:
            continue
        f1s.append(2 * tp / (support + predicted))
    return {
        "n": n,
        "accuracy": float(np.trace(cm) / n) if n else 0.0,
        "macro_f1": float(np.mean(f1s)) if f1s else 0.0,
        "confusion": cm.tolist(),
    }


def grouped(rows: Sequence, y_true: np.ndarray, y_pred: np.ndarray, n_buckets: int) -> dict:
    """:func:`metrics` overall, per dataset and per task, plus the task-balanced accuracy."""
    out = {"overall": metrics(y_true, y_pred, n_buckets), "dataset": {}, "task": {}}
    for key, attr in (("dataset", "dataset"), ("task", "task")):
        names = sorted({getattr(r, attr) for r in rows})
        for name in names:
            mask = np.array([getattr(r, attr) == name for r in rows])
            out[key][name] = metrics(y_true[mask], y_pred[mask], n_buckets)
    accs = [m["accuracy"] for m in out["task"].values()]
    out["task_balanced_accuracy"] = float(np.mean(accs)) if accs else 0.0
    return out


def baselines(train_rows: Sequence, train_labels: np.ndarray, edges: Sequence[int]) -> dict[str, object]:
    """The baseline predictors fitted on the training rows (see the module docstring).

    The two gradient-boosting baselines need scikit-learn; without it they are left out."""
    tasks = [r.task for r in train_rows]
    tokens = [r.prompt_tokens for r in train_rows]
    out: dict[str, object] = {
        "majority": MajorityPredictor(edges).fit(train_labels),
        "task-prior": TaskPriorPredictor(edges).fit(tasks, train_labels),
    }
    try:
        import sklearn  # noqa: F401
    except ImportError:
        return out
    out["length-only"] = LengthOnlyPredictor(edges, use_task=False).fit(tokens, tasks, train_labels)
    out["length+task"] = LengthOnlyPredictor(edges, use_task=True).fit(tokens, tasks, train_labels)
    return out


def evaluate(
    model_dir: str | Path | None,
    *,
    data_dir: str | Path | None = None,
    split: str = "test",
    rows: Sequence | None = None,
    edges: Sequence[int] | None = None,
    seed: int | None = None,
    batch_size: int = 64,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """The Table-1 report of a saved model (or of the baselines alone if ``model_dir`` is None).

    The split, edges, data sources and AlpacaEval model are taken from the model's
    metadata unless given. Returns a JSON-able dict: ``{"split", "edges", "rows",
    "results": {predictor: grouped metrics}, "task_accuracy", "model"}``.

    Raises:
        PredictorError: bad model folder / missing torch; WorkloadError: data problems.
    """
    from . import data as D

    meta: dict = {}
    pred = None
    if model_dir is not None:
        from .assign import load_predictor

        pred = load_predictor(str(model_dir))
        meta = pred.meta
    args = meta.get("args", {})
    if getattr(pred, "kind", None) == "ngram":
        # An n-gram model fitted on some files is measured on the whole default split.
        args = {"seed": meta.get("training", {}).get("split_seed", 0)}
    edges = check_edges(edges if edges is not None else meta.get("edges", (250, 1000, 4000)))
    seed = seed if seed is not None else int(args.get("seed", 0))
    if rows is None:
        rows = D.load_rows(data_dir, sources=args.get("sources"),
                           alpaca_model=args.get("alpaca_model", "llama-2-7b-chat-hf"))
    sp = D.split_rows(rows, seed=seed, edges=edges)
    labels = D.labels_of(rows, edges)
    tr = sp["train"]
    if getattr(pred, "kind", None) == "ngram" and meta.get("training", {}).get("datasets"):
        # Baselines see the same training files as the model (the shipped one: permissive files only).
        seen = set(meta["training"]["datasets"])
        tr = np.array([i for i in tr if rows[i].dataset in seen], dtype=np.int64)
    idx = sp[split]
    eval_rows = [rows[i] for i in idx]
    y = labels[idx]
    nb = len(edges) + 1
    batch: list[Item] = [(r.prompt, r.prompt_tokens, r.task) for r in eval_rows]
    results: dict[str, dict] = {}
    for name, p in baselines([rows[i] for i in tr], labels[tr], edges).items():
        results[name] = grouped(eval_rows, y, np.array(p.predict(batch)), nb)
    report = {"split": split, "seed": seed, "edges": list(edges), "rows": len(idx),
              "bucket_counts": np.bincount(y, minlength=nb).tolist(), "results": results,
              "model": str(model_dir) if model_dir else None}
    if "length-only" not in results:
        report["notes"] = ["the length-only and length+task baselines need scikit-learn "
                           "(pip install -e '.[predictor-train]'); they are left out"]
    if getattr(pred, "kind", None) == "ngram":
        _evaluate_ngram(pred, eval_rows, y, nb, batch, batch_size, results, report, progress)
    elif pred is not None:
        served = pred.ngram_weight
        name = "transformer" if pred.ngram is None else f"transformer + n-gram (n-gram weight {served:g})"
        modes = [(f"{name}, no hint", "none", served)]
        if pred.task_model is not None:
            modes.append((f"{name}, predicted hint", "predicted", served))
        modes.append((f"{name}, true hint", "true", served))
        if pred.ngram is not None:
            modes += [("transformer alone, true hint", "true", 0.0), ("n-gram alone, true hint", "true", 1.0)]
        for label, mode, weight in modes:
            if progress:
                progress(label)
            pred.hint, pred.ngram_weight = mode, weight
            out: list[int] = []
            for k in range(0, len(batch), batch_size):
                out.extend(pred.predict(batch[k: k + batch_size]))
            results[label] = grouped(eval_rows, y, np.array(out), nb)
        pred.ngram_weight = served
        if pred.task_model is not None:
            report["task_accuracy"] = task_accuracy(pred, batch, eval_rows, batch_size)
    return report


def task_accuracy(pred, batch: Sequence[Item], eval_rows: Sequence, batch_size: int, *,
                  known: Sequence[str] | None = None) -> dict:
    """The task classifier's accuracy: overall, per task and, with ``known``, on the rows of those tasks."""
    guessed: list[str] = []
    for k in range(0, len(batch), batch_size):
        guessed.extend(pred.predict_tasks(batch[k: k + batch_size]))
    ok = np.array([g == r.task for g, r in zip(guessed, eval_rows)])
    out: dict = {"overall": float(ok.mean()) if ok.size else 0.0}
    if known is not None:
        mask = np.array([r.task in known for r in eval_rows], dtype=bool)
        out["known_tasks"] = float(ok[mask].mean()) if mask.any() else 0.0
    out["task"] = {t: float(ok[[r.task == t for r in eval_rows]].mean()) for t in sorted({r.task for r in eval_rows})}
    return out


def _evaluate_ngram(pred, eval_rows, y, nb, batch, batch_size, results, report, progress) -> None:
    """The n-gram predictor's rows: the true task, and without it under each hint mode."""
    untasked = [(p, n, None) for p, n, _ in batch]
    modes = [("n-gram, true task", "true", batch), ("n-gram, no task", "none", untasked)]
    if pred.task_model is not None:
        modes += [("n-gram, predicted task", "predicted", untasked),
                  ("n-gram, task mixture", "mixture", untasked)]
    saved = pred.hint
    for label, mode, items in modes:
        if progress:
            progress(label)
        pred.hint = mode
        out: list[int] = []
        for k in range(0, len(items), batch_size):
            out.extend(pred.predict(items[k: k + batch_size]))
        results[label + (" (served without a task)" if mode == pred.auto_missing else "")] = \
            grouped(eval_rows, y, np.array(out), nb)
    pred.hint = saved
    if pred.task_model is not None:
        report["task_accuracy"] = task_accuracy(pred, batch, eval_rows, batch_size, known=pred.tasks)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def format_report(report: dict) -> str:
    """Markdown tables: overall, per dataset, per task (accuracy %), and confusion matrices."""
    res = report["results"]
    names = list(res)
    lines = [f"Split `{report['split']}` (seed {report['seed']}): {report['rows']} rows, "
             f"edges {report['edges']}, true buckets {report['bucket_counts']}", ""]
    lines += ["| predictor | accuracy % | macro-F1 | task-balanced acc % |", "|---|---:|---:|---:|"]
    for n in names:
        o = res[n]["overall"]
        lines.append(f"| {n} | {_pct(o['accuracy'])} | {o['macro_f1']:.3f} | {_pct(res[n]['task_balanced_accuracy'])} |")
    for key in ("dataset", "task"):
        groups = list(res[names[0]][key])
        lines += ["", f"Accuracy % (macro-F1) per {key}:", "",
                  f"| {key} | n | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
        for g in groups:
            cells = [f"{_pct(res[n][key][g]['accuracy'])} ({res[n][key][g]['macro_f1']:.2f})" for n in names]
            lines.append(f"| {g} | {res[names[0]][key][g]['n']} | " + " | ".join(cells) + " |")
    if "task_accuracy" in report:
        ta = report["task_accuracy"]
        known = f" ({_pct(ta['known_tasks'])}% on the rows of tasks it knows)" if "known_tasks" in ta else ""
        lines += ["", f"Task classifier accuracy: {_pct(ta['overall'])}%{known} "
                      f"(per task: {', '.join(f'{t} {_pct(a)}' for t, a in ta['task'].items())})"]
    for note in report.get("notes", []):
        lines += ["", f"Note: {note}."]
    lines += ["", "Confusion matrices (rows = true bucket, columns = predicted):", ""]
    for n in names:
        cm = res[n]["overall"]["confusion"]
        lines.append(f"- {n}: " + " ".join(str(r) for r in cm))
    return "\n".join(lines)


def save_report(report: dict, path: str | Path) -> None:
    """Write the report as JSON (``.json``) or Markdown (anything else)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        path.write_text(json.dumps(report, indent=2))
    else:
        path.write_text(format_report(report) + "\n")
