"""CPU cost of the length predictor per request, in batches of 64 (issue #4 target: <= 2 ms).

Measures ``HFPredictor.predict`` end to end (text cleaning, tokenizing, the forward
pass, argmax) on real prompts of the held-out test split (or of every prompt file if
no split is available), batches of 64, after one warm-up batch, and prints ms per
request for:

- ``served``: the saved model as served: int8 dynamic quantization, length-sorted
  chunks of 16, torch threads = ``--threads``;
- ``fp32, one padded batch``: the same weights unoptimised (fp32, all 64 padded to the
  longest) — the ratio served/unoptimised is printed;
- for a model with an n-gram part (``blend`` in its metadata): each part alone, the
  transformer (n-gram weight 0) and the n-gram model (weight 1), and the blend with the
  transformer run on every request; ``served`` is the blend as shipped, where requests
  the n-gram model is confident about skip the transformer (the share is printed: it
  depends on the prompts, so ``--dataset`` times one dataset's prompts alone);
- ``MiniLM-L6 fp32`` (``--full``): the untruncated 6-layer encoder at the same input
  length, the closest stand-in for the paper's DistilBERT (0.8 s per batch of 64 on CPU).

``--model`` is a folder saved by ``phasewise predictor train``; without it an
untrained model with the default architecture (1 layer, 64 tokens) is built — speed
does not depend on the weights. The machine's cores may be shared: run it twice.

Usage: python benchmarks/predictor_speed.py [--model DIR] [--n 640] [--threads 1] [--full]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def build_untrained(layers: int, max_length: int, out: Path) -> Path:
    from routerd.predictor import hf as H

    tok, model = H.load_classifier(H.base_model_dir(), num_labels=3, num_hidden_layers=layers)
    for sub in ("bucket", "task"):
        model.save_pretrained(out / sub)
        tok.save_pretrained(out / sub)
    meta = {"kind": "hf", "edges": [250, 1000, 4000], "tasks": ["a", "b", "c"], "max_length": max_length,
            "use_length": True, "args": {}}
    (out / H.META_FILE).write_text(json.dumps(meta))
    return out


def prompts(n: int, data_dir: str | None, dataset: str | None = None) -> list[tuple]:
    from routerd.predictor import data as D

    rows = D.load_rows(data_dir)
    test = D.split_rows(rows, seed=0)["test"]
    if dataset is not None:
        test = [i for i in test if rows[int(i)].dataset == dataset]
        if not test:
            raise SystemExit(f"predictor_speed: no test rows of dataset {dataset!r}; "
                             f"known: {', '.join(sorted({r.dataset for r in rows}))}")
    # Every 1/n-th test row, so all tasks and lengths appear (the split is sorted by task).
    step = max(1, len(test) // n)
    pick = [rows[int(i)] for i in test[::step][:n]]
    return [(r.prompt, r.prompt_tokens, r.task) for r in pick]


def time_per_request(pred, batch: list[tuple], repeats: int) -> tuple[float, float]:
    """(wall, CPU) ms per request over all batches of 64, each the median over ``repeats``.

    CPU is this process's user + system time (``time.process_time``), all threads
    together: with 2 torch threads it can be up to twice the wall time."""
    pred.predict(batch[:64])  # warm-up (allocations, lazy init)
    walls, cpus = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        for k in range(0, len(batch), 64):
            pred.predict(batch[k: k + 64])
        walls.append((time.perf_counter() - t) * 1000 / len(batch))
        cpus.append((time.process_time() - c) * 1000 / len(batch))
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="saved predictor folder (default: untrained, same shape)")
    ap.add_argument("--layers", type=int, default=1, help="layers of the untrained model")
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--n", type=int, default=640, help="requests (multiple of 64)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--full", action="store_true", help="also time the untruncated 6-layer MiniLM (slow)")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--dataset", default=None, help="time only this dataset's test prompts (e.g. sharegpt_v3_partial)")
    args = ap.parse_args()

    os.environ["PHASEWISE_TORCH_THREADS"] = str(args.threads)
    from routerd.predictor.hf import HFPredictor

    batch = prompts(args.n, args.data_dir, args.dataset)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else build_untrained(args.layers, args.max_length, Path(tmp) / "m")
        served = HFPredictor.load(model, quantize=True, threads=args.threads, hint="true", chunk=16)
        plain = HFPredictor.load(model, quantize=False, threads=args.threads, hint="true", chunk=64)
        layers = served.bucket_model.config.num_hidden_layers
        t_served, c_served = time_per_request(served, batch, args.repeats)
        t_plain, c_plain = time_per_request(plain, batch, args.repeats)
        print(f"{len(batch)} held-out prompts{' of ' + args.dataset if args.dataset else ''}, batches of 64, {args.threads} torch thread(s), "
              f"{layers} layer(s), max {served.max_length} tokens, task hint given")
        print(f"served (int8, length-sorted chunks of 16): {t_served:.2f} ms/request wall, {c_served:.2f} ms CPU")
        print(f"unoptimised (fp32, one padded batch):      {t_plain:.2f} ms/request wall, {c_plain:.2f} ms CPU"
              + (" (same blend and cascade)" if served.ngram is not None else ""))
        print(f"speed-up served vs unoptimised:            {t_plain / t_served:.2f}x")
        if served.ngram is not None:
            w, skip = served.ngram_weight, served.skip_above
            for label, part, sk in (("transformer part alone", 0.0, None), ("n-gram part alone", 1.0, None),
                                    ("blend, transformer on every request", w, None)):
                served.ngram_weight, served.skip_above = part, sk
                tw, tc = time_per_request(served, batch, args.repeats)
                print(f"{label + ':':43s}{tw:.2f} ms/request wall, {tc:.2f} ms CPU")
            served.ngram_weight, served.skip_above = w, skip
            if skip is not None and 0 < w < 1:
                conf = served.ngram.predict_proba([p for p, _, _ in batch], [n for _, n, _ in batch],
                                                  [t for _, _, t in batch]).max(axis=1)
                share = f"; {float((conf >= skip).mean()):.1%} of these requests skip the transformer"
            else:
                share = ""
            print(f"(served blends them with n-gram weight {w:g}, transformer skipped at n-gram "
                  f"confidence >= {skip}{share})")
        if args.full:
            full = build_untrained(6, served.max_length, Path(tmp) / "full")
            p6 = HFPredictor.load(full, quantize=False, threads=args.threads, hint="true", chunk=64)
            t6, _ = time_per_request(p6, batch[:128], 1)
            print(f"MiniLM-L6 fp32 (6 layers, one padded batch): {t6:.2f} ms/request "
                  f"({t6 / t_served:.1f}x the served model)")
        print(f"target <= 2 ms/request: wall {'met' if t_served <= 2.0 else 'NOT met'}, "
              f"CPU {'met' if c_served <= 2.0 else 'NOT met'}")


if __name__ == "__main__":
    main()
