"""Training and held-out workload samples for RL (no evaluation data is ever trained on).

* Generated workloads (``public-mix``, ``paper-mix``): training episodes use seeds
  ``>= TRAIN_SEED_BASE``; evaluation uses small seeds (0, 1, 2, ...).
* Traces (``azure-conv``, ``azure-code``, ``mooncake``, ``sample``): the first
  ``TRAIN_FRACTION`` of the requests (by arrival) are for training, the rest are
  held out. An episode is a contiguous window of ``n`` requests, re-based to start at
  0 s and optionally rescaled to ``rate`` req/s.
"""

from __future__ import annotations

import random
from functools import cache
from typing import Sequence

from routerd.model import Request
from routerd.workloads.registry import load_workload
from routerd.workloads.traces import rescale_to_rate

TRAIN_SEED_BASE = 1_000_000
TRAIN_FRACTION = 0.6
VALIDATION_INDEX_BASE = 900_000
"""Training-part sample indices kept for model selection (``VALIDATION_INDEX_BASE + i``): the
trainers (``routerd.rl.train``, ``routerd.rl.es``) never train on them; never the held-out part."""
GENERATORS = ("public-mix", "paper-mix")


@cache
def _trace(name: str, data_dir: str | None) -> tuple[Request, ...]:
    return tuple(load_workload(name, data_dir=data_dir).requests)


def window(reqs: Sequence[Request], start: int, n: int, rate: float | None = None) -> list[Request]:
    """Requests ``start..start+n`` renumbered from 0 and re-based to arrive from 0 s
    (optionally rescaled to ``rate`` req/s)."""
    win = reqs[start:start + n]
    t0 = win[0].arrival_s
    out = [r.model_copy(update={"id": i, "arrival_s": r.arrival_s - t0}) for i, r in enumerate(win)]
    return rescale_to_rate(out, rate) if rate else out


def _part(reqs: Sequence[Request], part: str) -> tuple[int, int]:
    """``[lo, hi)`` of ``part`` in a trace: the first ``TRAIN_FRACTION`` for training, the rest held out."""
    cut = int(len(reqs) * TRAIN_FRACTION)
    return (0, cut) if part == "train" else (cut, len(reqs))


def eval_requests(name: str, n: int, samples: int, data_dir: str | None = None) -> int:
    """The largest window size ``<= n`` (requests) at which the held-out part of ``name`` holds
    ``samples`` disjoint windows (:func:`sample`'s ``"eval"`` indices ``0 .. samples - 1``); ``n``
    for generators, which draw a new sample per index.

    Raises:
        routerd.workloads.WorkloadError: unknown workload or missing data.
        ValueError: the held-out part holds fewer than 2 requests per sample.
    """
    if name in GENERATORS:
        return n
    lo, hi = _part(_trace(name, data_dir), "eval")
    held = hi - lo
    fit = min(n, held // samples)
    if fit < 2:
        raise ValueError(f"workload {name}: the eval part ({held} requests) cannot hold {samples} disjoint samples")
    return fit


def shrink_note(name: str, n: int, fit: int, samples: int) -> str | None:
    """The line a benchmark prints when :func:`eval_requests` gave ``fit < n`` (None otherwise):
    its held-out samples are smaller than asked, so the reader knows what was measured."""
    if fit >= n:
        return None
    return (f"note: {name}: {samples} disjoint held-out samples of {fit} requests "
            f"(the held-out part holds fewer than {samples} x {n})")


def sample(name: str, part: str, index: int, n: int, rate: float | None, data_dir: str | None = None) -> list[Request]:
    """Workload sample number ``index`` of ``part`` (``"train"`` or ``"eval"``).

    Raises:
        routerd.workloads.WorkloadError: unknown workload or missing data.
        ValueError: ``part`` is not train/eval, the trace part is shorter than ``n``, or (eval)
            ``index`` is past the part's disjoint windows of ``n`` requests: a later index would
            repeat an earlier window, and repeated samples make a paired interval look tighter
            than the data allow.
    """
    if part not in ("train", "eval"):
        raise ValueError(f"part must be 'train' or 'eval', got {part!r}")
    if name in GENERATORS:
        seed = TRAIN_SEED_BASE + index if part == "train" else index
        return load_workload(name, n=n, rate=rate if rate else 20.0, seed=seed, data_dir=data_dir).requests
    reqs = _trace(name, data_dir)
    lo, hi = _part(reqs, part)
    if hi - lo < n:
        raise ValueError(f"workload {name}: the {part} part has {hi - lo} requests, fewer than n={n}")
    if part == "train":
        start = random.Random(index).randrange(lo, hi - n + 1)
    else:
        # Evaluation windows tile the held-out part, disjoint, so different indices differ.
        k = (hi - lo) // n
        if not 0 <= index < k:
            raise ValueError(f"workload {name}: the {part} part ({hi - lo} requests) holds {k} disjoint "
                             f"window{'s' if k > 1 else ''} of n={n} requests, so sample {index} would repeat "
                             f"one; use fewer samples or n <= {(hi - lo) // (index + 1)}")
        start = lo + index * n
    return window(reqs, start, n, rate)
