"""Predictor interface, input cleaning and the two non-neural predictors.

A *length predictor* maps a batch of requests, each given as ``(prompt, prompt_tokens,
task)``, to output-length bucket indices (see :func:`routerd.model.bucket_of`):

- ``prompt``: the prompt text (``str``), raw bytes (decoded as UTF-8, bad bytes
  replaced), or ``None`` when the workload has no text;
- ``prompt_tokens``: prompt length in tokens (an ``int`` >= 0);
- ``task``: the task label (e.g. ``"sharegpt_v3_partial:chat"``) or ``None``. A label
  the predictor was not trained on is treated as ``None`` (never an error).

Bad input never crashes a predictor: text is decoded and truncated before it reaches a
tokenizer, and only a malformed *batch* (a non-integer or negative token count, an item
that is not a 3-tuple) raises :class:`PredictorError` with a one-line message.

This module needs only numpy (scikit-learn for :class:`LengthOnlyPredictor`, imported
when one is built); torch and transformers live in :mod:`routerd.predictor.hf`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Protocol, Union, runtime_checkable

import numpy as np

from routerd.buckets import PREDICTOR_BUCKET_EDGES

#: One request as a predictor sees it: (prompt text or bytes or None, prompt tokens, task or None).
Item = tuple[Union[str, bytes, None], int, Union[str, None]]


class PredictorError(ValueError):
    """Bad predictor input or spec: the message is one line, meant for a terminal."""


@runtime_checkable
class LengthPredictor(Protocol):
    """Predicts output-length buckets.

    ``edges`` are the bucket edges in tokens (the predictor's buckets are
    ``bucket_of(tokens, edges)``); ``name`` a short label for reports.
    """

    name: str
    edges: tuple[int, ...]

    def predict(self, batch: Sequence[Item]) -> list[int]:
        """Bucket index (0..len(edges)) for each item of ``batch``, in order."""
        ...


# ----------------------------------------------------------------------------- inputs


def softmax_rows(z: np.ndarray) -> np.ndarray:
    """Row-wise softmax of scores of shape (n, classes), float64; each row sums to 1."""
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)



def clean_prompt(prompt: object, max_chars: int | None = None) -> str:
    """Prompt text safe for a tokenizer: ``None`` -> ``""``, bytes decoded as UTF-8 with
    bad bytes replaced, lone surrogates replaced, then cut to ``max_chars`` characters.

    Cutting *before* tokenizing bounds the cost of a 1 MB prompt (tokenizers only
    truncate after encoding everything). Non-text objects raise :class:`PredictorError`.
    """
    if prompt is None:
        return ""
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raw = bytes(prompt)
        if max_chars is not None:
            raw = raw[: 4 * max_chars]  # a UTF-8 character is at most 4 bytes
        text = raw.decode("utf-8", errors="replace")
    elif isinstance(prompt, str):
        text = prompt
    else:
        raise PredictorError(f"prompt must be text, bytes or None, got {type(prompt).__name__}")
    if max_chars is not None:
        text = text[:max_chars]
    # A str may hold lone surrogates (e.g. from surrogateescape decoding); the Rust
    # tokenizers refuse them, so round-trip through UTF-8 with replacement.
    return text.encode("utf-8", errors="replace").decode("utf-8")


def clean_tokens(n: object) -> int:
    """A prompt token count as a non-negative int; anything else raises :class:`PredictorError`."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise PredictorError(f"prompt_tokens must be a non-negative integer, got {n!r}")
    return int(n)


def clean_task(task: object, known: Sequence[str] | set[str]) -> str | None:
    """``task`` if it is one of ``known``, else ``None`` (unknown labels are not errors)."""
    return task if isinstance(task, str) and task in known else None


def unpack(batch: Sequence[Item]) -> tuple[list[object], list[int], list[object]]:
    """Split a batch into (prompts, prompt_tokens, tasks); validates shapes and counts."""
    prompts: list[object] = []
    tokens: list[int] = []
    tasks: list[object] = []
    for k, item in enumerate(batch):
        if not isinstance(item, tuple) or len(item) != 3:
            raise PredictorError(f"batch item {k}: expected (prompt, prompt_tokens, task), got {item!r:.80}")
        prompts.append(item[0])
        tokens.append(clean_tokens(item[1]))
        tasks.append(item[2])
    return prompts, tokens, tasks


# ----------------------------------------------------------------------------- edges


def parse_edges(spec: str) -> tuple[int, ...]:
    """Bucket edges from ``"250,1000,4000"`` or ``"profile:NAME_OR_YAML"``.

    ``profile:NAME`` uses :meth:`HardwareProfile.derived_bucket_edges` (decode time
    0.5 s x 4^k at the instance's decode throughput, paper §5.1). Edges must be strictly
    increasing positive integers.

    Raises:
        PredictorError: malformed list, non-increasing edges, or an unknown profile.
    """
    spec = spec.strip()
    if spec.startswith("profile:"):
        from routerd.profiles import ProfileError, get_profile

        name = spec[len("profile:"):]
        try:
            profile = get_profile(name)
        except ProfileError as e:  # names the file already
            raise PredictorError(str(e)) from None
        try:
            edges = profile.derived_bucket_edges()
        except ProfileError as e:
            raise PredictorError(f"{name}: {e}") from None
    else:
        try:
            edges = tuple(int(x) for x in spec.split(",") if x.strip())
        except ValueError:
            raise PredictorError(f"bucket edges {spec!r}: expected integers like 250,1000,4000 or profile:NAME") from None
    return check_edges(edges)


def check_edges(edges: Sequence[int]) -> tuple[int, ...]:
    """``edges`` as a tuple if non-empty, positive and strictly increasing; else :class:`PredictorError`."""
    edges = tuple(int(e) for e in edges)
    if not edges or edges[0] < 1 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise PredictorError(f"bucket edges {list(edges)} must be positive and strictly increasing")
    return edges


def merge_sparse_buckets(counts: Sequence[int], min_rows: int) -> int:
    """Number of classes to train when the top buckets are too rare.

    ``counts[b]`` is the number of training rows in bucket ``b``. The top buckets are
    merged downwards until the last class has >= ``min_rows`` rows (at least 2 classes
    stay). Class ``c`` then stands for bucket ``c``, and the last class for "bucket
    ``n_classes - 1`` or above", so a predicted class *is* a bucket index.

    Example: counts (14000, 6000, 280, 14), min_rows 100 -> 3 classes (bucket 3 merged into 2).
    """
    n = len(counts)
    while n > 2 and sum(counts[n - 1:]) < min_rows:
        n -= 1
    return n


# ----------------------------------------------------------------------------- baselines


class MajorityPredictor:
    """Always the most frequent training bucket (the majority-class baseline)."""

    def __init__(self, edges: Sequence[int] = PREDICTOR_BUCKET_EDGES, name: str = "majority"):
        self.edges = check_edges(edges)
        self.name = name
        self.bucket = 0

    def fit(self, labels: Sequence[int]) -> "MajorityPredictor":
        """Learn the majority bucket; ties go to the smaller bucket."""
        c = Counter(int(x) for x in labels)
        if not c:
            raise PredictorError("cannot fit on zero rows")
        self.bucket = min(c, key=lambda b: (-c[b], b))
        return self

    def predict(self, batch: Sequence[Item]) -> list[int]:
        unpack(batch)
        return [self.bucket] * len(batch)


class TaskPriorPredictor:
    """Most frequent training bucket of the request's task (the per-task prior).

    Unknown or missing tasks get the global majority bucket. Ties go to the smaller
    bucket. Reads neither the prompt text nor its length.
    """

    def __init__(self, edges: Sequence[int] = PREDICTOR_BUCKET_EDGES, name: str = "task-prior"):
        self.edges = check_edges(edges)
        self.name = name
        self.by_task: dict[str, int] = {}
        self.default = 0

    def fit(self, tasks: Sequence[str | None], labels: Sequence[int]) -> "TaskPriorPredictor":
        """Learn one bucket per task from parallel sequences of tasks and bucket labels."""
        if len(tasks) != len(labels):
            raise PredictorError(f"{len(tasks)} tasks but {len(labels)} labels")
        per: dict[str, Counter] = {}
        for t, y in zip(tasks, labels):
            if t is not None:
                per.setdefault(t, Counter())[int(y)] += 1
        self.by_task = {t: min(c, key=lambda b: (-c[b], b)) for t, c in sorted(per.items())}
        self.default = MajorityPredictor(self.edges).fit(labels).bucket
        return self

    def predict(self, batch: Sequence[Item]) -> list[int]:
        _, _, tasks = unpack(batch)
        return [self.by_task.get(t, self.default) if isinstance(t, str) else self.default for t in tasks]


class LengthOnlyPredictor:
    """Gradient boosting on prompt length (and, if ``use_task``, the task label).

    Features per request: ``log1p(prompt_tokens)`` and, with ``use_task``, the task as a
    categorical code (unknown/missing task -> a missing value, which the model routes
    by its learned default). scikit-learn's ``HistGradientBoostingClassifier`` with a
    fixed seed and no early stopping, so a fit is deterministic.
    """

    def __init__(
        self,
        edges: Sequence[int] = PREDICTOR_BUCKET_EDGES,
        *,
        use_task: bool = True,
        name: str | None = None,
        max_iter: int = 100,
        seed: int = 0,
    ):
        self.edges = check_edges(edges)
        self.use_task = use_task
        self.name = name or ("length+task" if use_task else "length-only")
        self.tasks: list[str] = []
        self.max_iter = max_iter
        self.seed = seed
        self.model = None
        self.constant: int | None = None

    def _features(self, tokens: Sequence[int], tasks: Sequence[object]) -> np.ndarray:
        x = np.log1p(np.asarray(tokens, dtype=np.float64)).reshape(-1, 1)
        if not self.use_task:
            return x
        code = {t: float(i) for i, t in enumerate(self.tasks)}
        col = np.array([code.get(t, math.nan) if isinstance(t, str) else math.nan for t in tasks])
        return np.hstack([x, col.reshape(-1, 1)])

    def fit(self, prompt_tokens: Sequence[int], tasks: Sequence[str | None], labels: Sequence[int]) -> "LengthOnlyPredictor":
        """Fit on parallel sequences: prompt tokens, task labels, bucket labels."""
        from sklearn.ensemble import HistGradientBoostingClassifier

        y = np.asarray(labels, dtype=np.int64)
        if y.size == 0:
            raise PredictorError("cannot fit on zero rows")
        self.tasks = sorted({t for t in tasks if t is not None})
        if np.unique(y).size == 1:
            # sklearn refuses a single class; a constant predictor is the exact answer.
            self.constant, self.model = int(y[0]), None
            return self
        self.constant = None
        model = HistGradientBoostingClassifier(
            max_iter=self.max_iter,
            learning_rate=0.1,
            max_leaf_nodes=15,
            min_samples_leaf=20,
            categorical_features=[1] if self.use_task else None,
            early_stopping=False,
            random_state=self.seed,
        )
        with _one_thread():
            model.fit(self._features(prompt_tokens, tasks), y)
        self.model = model
        return self

    def predict(self, batch: Sequence[Item]) -> list[int]:
        _, tokens, tasks = unpack(batch)
        if not tokens:
            return []
        if self.constant is not None:
            return [self.constant] * len(tokens)
        if self.model is None:
            raise PredictorError(f"{self.name}: predictor is not fitted")
        with _one_thread():
            return [int(b) for b in self.model.predict(self._features(tokens, tasks))]


def _one_thread():
    """Run scikit-learn's OpenMP code on one thread.

    On two cores shared with other work, OpenMP workers spin-wait on a busy core:
    measured here, fitting 400 rows took 48 s with the default threads and well under
    a second with one.
    """
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1, user_api="openmp")
