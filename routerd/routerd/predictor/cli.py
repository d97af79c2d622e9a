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

    t = sub.add_parser("train", help="fine-tune the bucket and task classifiers, fit the n-gram model, save them",
                       description="Train on shared/data/prompts (seeded stratified split) and save with "
                                   "save_pretrained plus predictor.json. Needs the 'predictor' extra.")
    add_arguments(t)

    e = sub.add_parser("eval", help="Table-1-style report: accuracy, macro-F1, confusion per dataset and task",
                       description="Evaluate a saved model against the majority, task-prior and "
                                   "length(+task) baselines, with and without the task hint.")
    e.add_argument("model", help="a folder saved by 'predictor train', or 'baselines' for the baselines alone")
    e.add_argument("--split", choices=("test", "val"), default="test")
    e.add_argument("--data-dir", default=None, help="shared data directory (../shared/data)")
    e.add_argument("--edges", default=None, help="bucket edges for 'baselines' (default 250,1000,4000)")
    e.add_argument("--out", "-o", default=None, help="also write the report (.json or .md)")

    r = sub.add_parser("predict", help="predict buckets for prompts",
                       description="Predict output-length buckets. Input: --prompt TEXT, --prompt-file PATH "
                                   "(raw bytes), or --input FILE.jsonl ('-' = stdin) with fields prompt, "
                                   "prompt_tokens, task. Output: one JSON object per line.")
    r.add_argument("model", help="a saved folder or a baseline: majority, task-prior, length-only, length+task")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file whose bytes are the prompt (any encoding; bad UTF-8 replaced)")
    src.add_argument("--input", help="JSON-lines file, '-' for stdin")
    r.add_argument("--task", default=None, help="task label for --prompt/--prompt-file")
    r.add_argument("--prompt-tokens", type=int, default=None,
                   help="prompt length in tokens (default: UTF-8 bytes / 4, rounded up, at least 1)")
    r.add_argument("--hint", choices=("auto", "true", "predicted", "none"), default="auto",
                   help="transformer only: which task hint to use (default auto)")
    r.add_argument("--data-dir", default=None, help="shared data directory, for the baselines")
    return p


def estimate_tokens(text: str | bytes) -> int:
    """Rough prompt length in tokens when none is given: UTF-8 bytes / 4 (cl100k on English)."""
    raw = text if isinstance(text, bytes) else text.encode("utf-8", errors="replace")
    return max(1, math.ceil(len(raw) / 4))


def _read_jsonl(path: str) -> list[tuple]:
    raw = sys.stdin.buffer.read() if path == "-" else _read_bytes(path)
    items = []
    for n, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line.decode("utf-8", errors="replace"))
        except json.JSONDecodeError as e:
            raise PredictorError(f"{path}: line {n}: invalid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise PredictorError(f"{path}: line {n}: expected a JSON object")
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
    return items


def _read_bytes(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise PredictorError(f"{path}: cannot read: {e.strerror or e}") from None


def _bucket_range(b: int, edges: tuple[int, ...]) -> str:
    lo = 0 if b == 0 else edges[b - 1]
    return f"{lo}-{edges[b] - 1}" if b < len(edges) else f">={lo}"


def _cmd_predict(args: argparse.Namespace) -> int:
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
    if hasattr(pred, "hint"):
        pred.hint = args.hint
    for k in range(0, len(items), 64):
        chunk = items[k: k + 64]
        buckets = pred.predict(chunk)
        for (_, tokens, task), b in zip(chunk, buckets):
            print(json.dumps({"bucket": b, "tokens": _bucket_range(b, pred.edges), "prompt_tokens": tokens,
                              "task": task, "predictor": pred.name}))
    unknown = getattr(pred, "unknown_tasks", 0)
    if unknown:
        print(f"phasewise: note: {unknown} request(s) had a task label the model does not know; "
              "they were predicted without it", file=sys.stderr)
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from .base import parse_edges
    from .evaluate import evaluate, format_report, save_report

    model = None if args.model == "baselines" else args.model
    if model is not None and not Path(model).is_dir():
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

    out = train(args_from_namespace(args))
    meta = json.loads((out / "predictor.json").read_text())
    for split, m in meta["metrics"].items():
        print(f"{split}: accuracy with true hint {m['hint_true']['accuracy']:.4f}, "
              f"without hint {m['hint_none']['accuracy']:.4f}"
              + (f", task classifier {m['task_accuracy']:.4f}" if "task_accuracy" in m else ""))
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
