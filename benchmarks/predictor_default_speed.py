"""Cost of the shipped n-gram predictor: CPU per request, import and load time, size (issue #17).

Targets: <= 0.3 ms CPU per request in batches of 64 and <= 1 ms for a single request,
one thread; import of the predictor on a core install <= 0.3 s; package size increase
<= 5 MB. Printed, in the same run:

- ``shipped, batch 64`` / ``shipped, single request``: :class:`NgramPredictor.predict`
  end to end (cleaning, tokenising, TF-IDF, both heads, softmax) on held-out test
  prompts with their task given, and again with every task removed (the ``auto`` mode's
  fallback, which also runs the task classifier);
- the baselines: the transformer blend when torch is installed (``--model DIR``: a folder
  saved by ``phasewise predictor train``, timed as served; without it, the transformer
  part of an untrained model of the default shape, int8, whose cost does not depend on
  its weights), and scikit-learn's ``TfidfVectorizer.transform`` + sparse product, the
  n-gram model's previous serving path, on the same vocabulary;
- ``import``: a fresh interpreter importing ``routerd.predictor`` and loading the
  shipped model with torch, scikit-learn and SciPy made unimportable (a core install),
  beside ``import numpy`` alone, median of 5;
- ``size``: bytes of the shipped folder, raw and zip-deflated (as in a wheel).

CPU is ``time.process_time`` of this process; BLAS/OpenMP threads are pinned to 1.
Usage: python benchmarks/predictor_default_speed.py [--n 640] [--repeats 5] [--model DIR] [--predictor DIR]
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "PHASEWISE_TORCH_THREADS"):
    os.environ[_v] = "1"

import argparse  # noqa: E402
import io  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import zipfile  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BLOCK = ("import sys\n"
         "class _Block:\n"
         "    def find_spec(self, name, path=None, target=None):\n"
         "        if name.split('.')[0] in ('torch', 'sklearn', 'scipy', 'transformers'):\n"
         "            raise ImportError('blocked: ' + name)\n"
         "sys.meta_path.insert(0, _Block())\n")


def per_request(fn, batch: list, size: int, repeats: int) -> float:
    """Median over ``repeats`` of CPU ms per request, calling ``fn`` on chunks of ``size``."""
    fn(batch[:size])  # warm-up
    out = []
    for _ in range(repeats):
        c = time.process_time()
        for k in range(0, len(batch), size):
            fn(batch[k: k + size])
        out.append((time.process_time() - c) * 1000 / len(batch))
    return statistics.median(out)


def subprocess_seconds(code: str, runs: int = 5) -> float:
    """Median wall seconds a fresh interpreter reports for the timed part of ``code``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "routerd"))
    vals = []
    for _ in range(runs):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        vals.append(float(r.stdout.strip().splitlines()[-1]))
    return statistics.median(vals)


def folder_size(folder: Path) -> tuple[int, int]:
    raw = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for f in sorted(folder.iterdir()):
            z.write(f, f.name)
    return raw, len(buf.getvalue())


def sklearn_path(pred):
    """The previous serving path on the same vocabulary: TfidfVectorizer + SciPy product."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    from routerd.predictor.base import softmax_rows, unpack

    feat, head = pred.featurizer, pred.bucket
    vec = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, vocabulary=feat.index, dtype=float)
    vec.idf_ = feat.idf

    def run(batch):
        prompts, tokens, tasks = unpack(batch)
        X = vec.transform([p[: feat.max_chars] for p in prompts])
        text = X @ head.coef[:, : len(feat)].T
        return softmax_rows(head.scores(feat.transform([""] * len(prompts)), tokens, tasks, text=text)).argmax(1)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=640, help="held-out prompts (a multiple of 64)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default=None, help="a trained transformer folder to time as served (needs torch)")
    ap.add_argument("--predictor", default="default",
                    help="the n-gram predictor to time: default (shipped) or a folder from 'train --kind ngram'")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--dataset", default=None, help="only this dataset's test prompts (e.g. sharegpt_v3_partial)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from predictor_speed import prompts  # the same held-out prompts as the transformer benchmark

    from routerd.predictor import load_predictor
    from routerd.predictor.ngram_predictor import shipped_dir

    batch = prompts(args.n, args.data_dir, args.dataset)
    untasked = [(p, n, None) for p, n, _ in batch]
    pred = load_predictor(args.predictor)
    print(f"{len(batch)} held-out test prompts{' of ' + args.dataset if args.dataset else ''}, "
          f"mean {statistics.mean(len(p) for p, _, _ in batch):.0f} characters; {pred.name}, "
          f"{len(pred.featurizer)} terms, auto_missing={pred.auto_missing}; 1 thread, CPU ms per request")
    rows = [
        ("shipped, batch 64, task given", per_request(pred.predict, batch, 64, args.repeats)),
        ("shipped, single request, task given", per_request(pred.predict, batch, 1, args.repeats)),
        ("shipped, batch 64, no task", per_request(pred.predict, untasked, 64, args.repeats)),
        ("shipped, single request, no task", per_request(pred.predict, untasked, 1, args.repeats)),
    ]
    try:
        rows.append(("baseline: scikit-learn TF-IDF path, batch 64", per_request(sklearn_path(pred), batch, 64,
                                                                                  args.repeats)))
    except ImportError:
        print("(scikit-learn not installed: its baseline row is skipped)")
    try:
        from predictor_speed import build_untrained

        from routerd.predictor.hf import HFPredictor

        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(args.model) if args.model else build_untrained(1, 64, Path(tmp) / "m")
            hf = HFPredictor.load(folder, quantize=True, threads=1, hint="true", chunk=16)
            label = "served blend" if args.model else "transformer part (untrained, default shape, int8)"
            rows.append((f"baseline: {label}, batch 64", per_request(hf.predict, batch, 64, max(1, args.repeats // 2))))
    except (ImportError, Exception) as e:  # noqa: BLE001 - a missing extra or model only skips the baseline
        print(f"(transformer baseline skipped: {type(e).__name__}: {str(e).splitlines()[0][:120]})")
    width = max(len(r[0]) for r in rows)
    for label, ms in rows:
        print(f"{label:<{width}}  {ms:6.3f} ms")
    base = rows[0][1]
    for label, ms in rows[4:]:
        print(f"{label.replace('baseline: ', ''):<{width}}  {ms / base:6.1f}x the shipped batch-64 cost")

    imp = subprocess_seconds(BLOCK + "import time; t = time.perf_counter()\nimport routerd.predictor\n"
                             "print(time.perf_counter() - t)")
    load = subprocess_seconds(BLOCK + "import time\nfrom routerd.predictor import load_predictor\n"
                              "t = time.perf_counter(); p = load_predictor('default'); p.predict([('hi', 1, None)])\n"
                              "print(time.perf_counter() - t)")
    npy = subprocess_seconds("import time; t = time.perf_counter()\nimport numpy\nprint(time.perf_counter() - t)")
    print(f"import routerd.predictor (torch, sklearn, scipy blocked): {imp:.3f} s; import numpy alone {npy:.3f} s; "
          f"load the shipped model and predict once {load:.3f} s (medians of 5 fresh interpreters)")
    raw, zipped = folder_size(shipped_dir())
    print(f"shipped folder {shipped_dir().relative_to(ROOT)}: {raw / 1e6:.2f} MB raw, {zipped / 1e6:.2f} MB zip-deflated")
    print(f"targets: batch 64 <= 0.3 ms {'met' if rows[0][1] <= 0.3 else 'NOT met'}; single <= 1 ms "
          f"{'met' if rows[1][1] <= 1.0 else 'NOT met'}; import <= 0.3 s {'met' if imp <= 0.3 else 'NOT met'}; "
          f"size <= 5 MB {'met' if raw <= 5e6 else 'NOT met'}")


if __name__ == "__main__":
    main()
