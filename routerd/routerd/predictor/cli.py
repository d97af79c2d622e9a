"""``phasewise predictor train | eval | predict``.

Wiring (in :mod:`routerd.cli`): ``add_parser(sub)`` adds the ``predictor`` command to
the ``phasewise`` subparsers; ``run(args)`` executes it and returns the exit code. Bad
input ends with one line ``phasewise: error: ...`` on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from .base import PredictorError

#: ``--hint`` values: the n-gram modes (:data:`routerd.predictor.ngram_predictor.HINT_MODES`, kept
#: literal so that building the parser imports no model code); transformer models take all but mixture.
HINT_CHOICES: tuple[str, ...] = ("auto", "true", "predicted", "mixture", "none")
#: Decimals of the printed probabilities (1e-4: finer than any calibration they carry).
PROB_DECIMALS = 4


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``predictor`` with its ``train``, ``eval`` and ``predict`` subcommands."""
    from .train import add_arguments

    p = subparsers.add_parser(
        "predictor",
        help="train, evaluate or run the response-length (bucket) predictor",
        description="Output-length bucket predictor (arXiv 2408.13510 §5.1): a MiniLM classifier with a task "
                    "hint blended with a word n-gram model, a task classifier, and baselines.",
    )
    sub = p.add_subparsers(dest="predictor_command", required=True)

    t = sub.add_parser("train", help="train a predictor: --kind ngram (numpy-served, like the shipped default) "
                                     "or the transformer blend",
                       description="Train on shared/data/prompts (seeded stratified split). --kind ngram: the "
                                   "n-gram bucket model and task classifier served with numpy (needs the "
                                   "'predictor-train' extra, scikit-learn); --kind transformer (default): MiniLM "
                                   "blended with the n-gram model, saved with save_pretrained (needs the "
                                   "'predictor' extra, torch).")
    add_arguments(t)

    e = sub.add_parser("eval", help="Table-1-style report: accuracy, macro-F1, confusion per dataset and task",
                       description="Evaluate a saved model against the majority, task-prior and "
                                   "length(+task) baselines, with and without the task hint.")
    e.add_argument("model", help="a folder saved by 'predictor train', or 'baselines' for the baselines alone")
    e.add_argument("--split", choices=("test", "val"), default="test")
    e.add_argument("--data-dir", default=None, help="shared data directory (../shared/data)")
    e.add_argument("--edges", default=None, help="bucket edges for 'baselines' (default 250,1000,4000)")
    e.add_argument("--out", "-o", default=None, help="also write the report (.json or .md)")

    r = sub.add_parser(
        "predict", help="predict buckets for prompts (default: the shipped n-gram predictor)",
        description="Predict output-length buckets. Input: --prompt TEXT, --prompt-file PATH (raw bytes), or "
                    "--input FILE.jsonl ('-' = stdin) with fields prompt, prompt_tokens, task. Output: one JSON "
                    "object per line: bucket, tokens (its range), probabilities (per class, keyed by token "
                    "range; a model that merged the top buckets has an open last class such as '>=1000'), "
                    "task, task_source (given / predicted / mixture / none) and task_probability, "
                    "prompt_tokens, predictor.")
    r.add_argument("model", nargs="?", default="default",
                   help="'default' (the shipped n-gram predictor, numpy only; the default), a folder saved by "
                        "'predictor train', or a baseline: majority, task-prior, length-only, length+task")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file whose bytes are the prompt (any encoding; bad UTF-8 replaced)")
    src.add_argument("--input", help="JSON-lines file, '-' for stdin")
    r.add_argument("--task", default=None,
                   help="task label for --prompt/--prompt-file (a label the model does not know is ignored, "
                        "with a note)")
    r.add_argument("--prompt-tokens", type=int, default=None,
                   help="prompt length in tokens (default: UTF-8 bytes / 4, rounded up, at least 1)")
    r.add_argument("--hint", choices=HINT_CHOICES, default="auto",
                   help="task hint of a saved model: auto (the request's task when the model knows it, else "
                        "the model's saved choice), true (the known task or none), predicted (the task "
                        "classifier's guess), mixture (n-gram only: averaged over the task classifier's "
                        "posterior), none. Transformer models take auto, true, predicted, none; baselines "
                        "ignore it (default auto)")
    r.add_argument("--data-dir", default=None, help="shared data directory, for the baselines")
    return p


def estimate_tokens(text: str | bytes) -> int:
    """Rough prompt length in tokens when none is given: UTF-8 bytes / 4 (cl100k on English)."""
    raw = text if isinstance(text, bytes) else text.encode("utf-8", errors="replace")
    return max(1, math.ceil(len(raw) / 4))


#: The fields of a ``--input`` line.
JSONL_FIELDS = ("prompt", "prompt_tokens", "task")


def _read_jsonl(path: str) -> list[tuple]:
    raw = sys.stdin.buffer.read() if path == "-" else _read_bytes(path)
    items = []
    ignored: dict[str, int] = {}
    for n, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            # utf-8-sig: a file saved with a byte-order mark is still JSON lines.
            obj = json.loads(line.decode("utf-8-sig" if n == 1 else "utf-8", errors="replace"))
        except json.JSONDecodeError as e:
            raise PredictorError(f"{path}: line {n}: invalid JSON ({e.msg})") from None
        except (ValueError, RecursionError) as e:  # a 5,000-digit integer, nesting 100k deep
            raise PredictorError(f"{path}: line {n}: unreadable JSON ({type(e).__name__}: {str(e)[:80]})") from None
        if not isinstance(obj, dict):
            raise PredictorError(f"{path}: line {n}: expected a JSON object")
        extra = [k for k in obj if k not in JSONL_FIELDS]
        if "prompt" not in obj and "prompt_tokens" not in obj:
            # A misspelt field must not be predicted silently as an empty prompt.
            raise PredictorError(f"{path}: line {n}: needs field prompt or prompt_tokens"
                                 + (f" (got {', '.join(map(repr, extra[:5]))})" if extra else ""))
        for k in extra:
            ignored.setdefault(k, n)
        prompt = obj.get("prompt")
        if prompt is not None and not isinstance(prompt, str):
            raise PredictorError(f"{path}: line {n}: field prompt must be a string or null")
        tokens = obj.get("prompt_tokens")
        if tokens is None:
            tokens = estimate_tokens(prompt or "")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise PredictorError(f"{path}: line {n}: field prompt_tokens must be a non-negative integer")
        task = obj.get("task")
        if task is not None and not isinstance(task, str):
            raise PredictorError(f"{path}: line {n}: field task must be a string or null")
        items.append((prompt, tokens, task))
    if ignored:
        where = ", ".join(f"{k!r} (first on line {n})" for k, n in list(ignored.items())[:5])
        print(f"phasewise: note: {path}: ignored field(s) {where}; the fields are {', '.join(JSONL_FIELDS)}",
              file=sys.stderr)
    return items


def _read_bytes(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise PredictorError(f"{path}: cannot read: {e.strerror or e}") from None


def _bucket_range(b: int, edges: tuple[int, ...]) -> str:
    """Token range of bucket ``b`` under ``edges``: ``"0-249"``, ..., ``">=4000"``."""
    lo = 0 if b == 0 else edges[b - 1]
    return f"{lo}-{edges[b] - 1}" if b < len(edges) else f">={lo}"


def class_ranges(edges: tuple[int, ...], classes: int) -> list[str]:
    """Token range of each of a model's ``classes`` output classes.

    Class ``c`` is bucket ``c``; when training merged the rare top buckets
    (:func:`~routerd.predictor.base.merge_sparse_buckets`) the last class stands for
    "that bucket or above", so its range is open: edges (250, 1000, 4000) with 3 classes
    give ``["0-249", "250-999", ">=1000"]``.
    """
    out = [_bucket_range(c, edges) for c in range(classes)]
    if 0 < classes <= len(edges):
        out[-1] = f">={0 if classes == 1 else edges[classes - 2]}"
    return out


def _set_hint(pred, hint: str) -> str | None:
    """Apply ``--hint`` to ``pred``; returns a note for a predictor that has no hint, else None.

    Raises:
        PredictorError: a mode the model does not take (mixture for a transformer;
            predicted/mixture without a task classifier).
    """
    modes = getattr(type(pred), "HINT_MODES", None)
    if not hasattr(pred, "hint"):
        if hint == "auto":
            return None
        return f"--hint {hint} is ignored: {pred.name} has no hint modes (it uses the task label as given, if at all)"
    if modes is not None and hint not in modes:
        raise PredictorError(f"--hint {hint}: {pred.name} takes {', '.join(modes)}")
    if hint == "predicted" and getattr(pred, "task_model", True) is None:
        raise PredictorError(f"--hint predicted: {pred.name} has no task classifier")
    pred.hint = hint  # the n-gram predictor's setter validates the mode itself
    return None


def _rows(pred, chunk: list[tuple]) -> list[dict]:
    """One output object per item of ``chunk`` (see the ``predict`` description)."""
    import numpy as np

    if hasattr(pred, "explain"):
        probs, info = pred.explain(chunk)
    elif hasattr(pred, "predict_proba"):
        probs, info = pred.predict_proba(chunk), None
    else:
        probs, info = None, None
    if probs is None:
        buckets = [int(b) for b in pred.predict(chunk)]
        return [{"bucket": b, "tokens": _bucket_range(b, pred.edges), "task": task, "prompt_tokens": tokens,
                 "predictor": pred.name} for (_, tokens, task), b in zip(chunk, buckets)]
    probs = np.asarray(probs, dtype=np.float64)
    if probs.ndim != 2 or probs.shape[0] != len(chunk) or probs.shape[1] < 1 or not np.isfinite(probs).all():
        # A damaged model can pass the load checks and still compute NaN (e.g. an all-zero idf).
        where = getattr(pred, "path", None) or pred.name
        raise PredictorError(f"{where}: the model returned probabilities of shape {probs.shape} with non-finite "
                             f"values or the wrong size for {len(chunk)} requests; its weights may be damaged")
    ranges = class_ranges(pred.edges, probs.shape[1])
    out = []
    for i, (_, tokens, task) in enumerate(chunk):
        b = int(probs[i].argmax())
        row = {"bucket": b, "tokens": ranges[b],
               "probabilities": {r: round(float(q), PROB_DECIMALS) for r, q in zip(ranges, probs[i])}}
        if info is not None:
            p = info[i]["task_probability"]
            row.update(task=info[i]["task"], task_source=info[i]["task_source"],
                       task_probability=None if p is None else round(float(p), PROB_DECIMALS))
        else:
            row["task"] = task
        row.update(prompt_tokens=tokens, predictor=pred.name)
        out.append(row)
    return out


def _cmd_predict(args: argparse.Namespace) -> int:
    import numpy as np

    from .assign import load_predictor

    if args.prompt_tokens is not None and args.prompt_tokens < 0:
        raise PredictorError(f"--prompt-tokens must be >= 0, got {args.prompt_tokens}")
    if args.input is not None:
        items = _read_jsonl(args.input)
    else:
        prompt: str | bytes = args.prompt if args.prompt is not None else _read_bytes(args.prompt_file)
        tokens = args.prompt_tokens if args.prompt_tokens is not None else estimate_tokens(prompt)
        items = [(prompt, tokens, args.task)]
    pred = load_predictor(args.model, data_dir=args.data_dir)
    note = _set_hint(pred, args.hint)
    if note:
        print(f"phasewise: note: {note}", file=sys.stderr)
    # Every line is computed before the first is printed: an error leaves no partial output.
    # Floating-point warnings are silenced: _rows refuses non-finite results with one line instead.
    lines = []
    with np.errstate(all="ignore"):
        for k in range(0, len(items), 64):
            lines += [json.dumps(row, allow_nan=False) for row in _rows(pred, items[k: k + 64])]
    if lines:
        sys.stdout.write("\n".join(lines) + "\n")
    unknown = getattr(pred, "unknown_tasks", 0)
    if unknown:
        how = f" (hint {pred.hint}: {pred.auto_missing})" if getattr(pred, "hint", None) == "auto" and \
            hasattr(pred, "auto_missing") else ""
        known = getattr(pred, "tasks", [])
        print(f"phasewise: note: {unknown} request(s) had a task label the model does not know; "
              f"they were predicted as requests without a task{how}"
              + (f"; its tasks: {', '.join(known)}" if known else ""), file=sys.stderr)
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from .base import parse_edges
    from .evaluate import evaluate, format_report, save_report

    model = None if args.model == "baselines" else args.model
    if model is not None and model != "default" and not Path(model).is_dir():
        raise PredictorError(f"{model}: no such model folder (or use 'baselines')")
    edges = parse_edges(args.edges) if args.edges else None
    report = evaluate(model, data_dir=args.data_dir, split=args.split, edges=edges,
                      progress=lambda s: print(f"[eval] {s}", file=sys.stderr, flush=True))
    print(format_report(report))
    if args.out:
        save_report(report, args.out)
        print(f"wrote {args.out}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from .train import args_from_namespace, train

    a = args_from_namespace(args)
    if a.kind == "ngram":
        from .train_ngram import train_ngram

        out = train_ngram(a)
        meta = json.loads((out / "predictor.json").read_text())
        miss = meta["auto_missing"]
        lines = [(s, m["hint_true"], f"without task ({miss})", m[f"hint_{miss}"], m.get("task_accuracy_known"))
                 for s, m in meta["metrics"].items()]
    else:
        out = train(a)
        meta = json.loads((out / "predictor.json").read_text())
        lines = [(s, m["hint_true"]["accuracy"], "without hint", m["hint_none"]["accuracy"], m.get("task_accuracy"))
                 for s, m in meta["metrics"].items()]
    with_what = "task" if a.kind == "ngram" else "hint"
    for split, acc, without, acc_without, task in lines:
        print(f"{split}: accuracy with true {with_what} {acc:.4f}, {without} {acc_without:.4f}"
              + (f", task classifier {task:.4f}" if task is not None else ""))
    print(f"saved {out}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Execute ``phasewise predictor ...``; returns the exit code (2 on bad input)."""
    from routerd.workloads.errors import WorkloadError

    cmd = {"train": _cmd_train, "eval": _cmd_eval, "predict": _cmd_predict}.get(args.predictor_command)
    if cmd is None:
        print(f"phasewise: error: unknown predictor command {args.predictor_command!r}", file=sys.stderr)
        return 2
    try:
        return cmd(args)
    except (PredictorError, WorkloadError) as e:
        print(f"phasewise: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except MemoryError:
        print("phasewise: error: out of memory (is the input a device or larger than memory?)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("phasewise: interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    """``python -m routerd.predictor.cli ...`` (the same as ``phasewise predictor ...``)."""
    parser = argparse.ArgumentParser(prog="phasewise")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:] if sys.argv[1:] and sys.argv[1] == "predictor" else ["predictor", *sys.argv[1:]]))
