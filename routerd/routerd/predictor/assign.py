"""Integration with the simulator: load a predictor by spec, predict once per request.

The simulator never runs a predictor in its loop: :func:`assign_predictions` fills
``Request.predicted_bucket`` for a whole workload up front (batches of 64), and the
bench then runs with prediction mode ``given``
(:func:`routerd.sim.prepare.prepare_requests`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from routerd.model import PREDICTOR_BUCKET_EDGES, Request

from .base import LengthPredictor, PredictorError, check_edges

#: Predictor names that :func:`load_predictor` fits on the training split at load time.
BASELINE_NAMES: tuple[str, ...] = ("majority", "task-prior", "length-only", "length+task")


def fit_baseline(
    name: str,
    *,
    data_dir: str | Path | None = None,
    edges: Sequence[int] = PREDICTOR_BUCKET_EDGES,
    seed: int = 0,
    sources: Sequence[str] | None = None,
    alpaca_model: str | None = "llama-2-7b-chat-hf",
) -> LengthPredictor:
    """A baseline (:data:`BASELINE_NAMES`) fitted on the training split of the prompt data.

    Uses the same rows and seeded split as training (:mod:`routerd.predictor.data`), so
    the baseline never sees validation or test prompts. Takes ~2 s (reading the files).

    Raises:
        PredictorError: unknown name, or the data cannot be read (message from the loader).
    """
    from routerd.workloads.errors import WorkloadError

    from . import data as D
    from .evaluate import baselines

    if name not in BASELINE_NAMES:
        raise PredictorError(f"unknown baseline {name!r}; valid: {', '.join(BASELINE_NAMES)}")
    edges = check_edges(edges)
    try:
        rows = D.load_rows(data_dir, sources=sources, alpaca_model=alpaca_model)
    except WorkloadError as e:
        raise PredictorError(str(e)) from None
    tr = D.split_rows(rows, seed=seed, edges=edges)["train"]
    labels = D.labels_of(rows, edges)
    return baselines([rows[i] for i in tr], labels[tr], edges)[name]


def load_predictor(
    spec: str,
    *,
    data_dir: str | Path | None = None,
    edges: Sequence[int] | None = None,
) -> LengthPredictor:
    """A predictor from a spec string.

    Specs:

    - ``majority`` | ``task-prior`` | ``length-only`` | ``length+task``: a baseline
      fitted now on the training split of ``shared/data/prompts`` (``data_dir``, or the
      usual search), bucket edges ``edges`` (default 250, 1000, 4000);
    - a folder written by ``phasewise predictor train``: the transformer predictor
      (needs ``pip install 'phasewise[predictor]'``), int8, task hint from the request's
      task or, when it has none, from the task classifier.

    Raises:
        PredictorError: a one-line message for an unknown spec, a missing folder or
            extra, bad metadata, or edges that differ from a saved model's.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise PredictorError("predictor spec is empty; give a baseline name "
                             f"({', '.join(BASELINE_NAMES)}) or a folder saved by 'phasewise predictor train'")
    spec = spec.strip()
    if spec in BASELINE_NAMES:
        return fit_baseline(spec, data_dir=data_dir, edges=edges if edges is not None else PREDICTOR_BUCKET_EDGES)
    path = Path(spec)
    if not path.exists():
        raise PredictorError(f"unknown predictor {spec!r}: not a baseline ({', '.join(BASELINE_NAMES)}) "
                             "and no such folder")
    from .hf import HFPredictor

    pred = HFPredictor.load(path)
    if edges is not None and check_edges(edges) != pred.edges:
        raise PredictorError(f"{path}: model trained with bucket edges {list(pred.edges)}, "
                             f"but {list(edges)} were asked for")
    return pred


def assign_predictions(
    requests: Sequence[Request],
    predictor: LengthPredictor,
    *,
    batch_size: int = 64,
    edges: Sequence[int] | None = None,
) -> list[Request]:
    """Copies of ``requests`` with ``predicted_bucket`` set by ``predictor``.

    Requests are predicted in batches of ``batch_size`` (the unit the speed target is
    measured in), in order, once each. Requests without text (traces) pass
    ``prompt=None``; the baselines and the task prior need none.

    Args:
        requests: the workload.
        predictor: any :class:`~routerd.predictor.base.LengthPredictor`.
        batch_size: requests per ``predict`` call.
        edges: the bucket edges the simulator/policy will use; a predictor with other
            edges is refused (its bucket indices would mean other lengths).

    Raises:
        PredictorError: mismatched edges, or a prediction outside ``0..len(edges)``.
    """
    if edges is not None and check_edges(edges) != tuple(predictor.edges):
        raise PredictorError(f"predictor {predictor.name!r} uses bucket edges {list(predictor.edges)}, "
                             f"the policy uses {list(edges)}")
    if batch_size < 1:
        raise PredictorError(f"batch_size must be >= 1, got {batch_size}")
    n_buckets = len(predictor.edges) + 1
    out: list[Request] = []
    for k in range(0, len(requests), batch_size):
        chunk = requests[k: k + batch_size]
        buckets = predictor.predict([(q.prompt, q.prompt_tokens, q.task) for q in chunk])
        if len(buckets) != len(chunk):
            raise PredictorError(f"predictor {predictor.name!r} returned {len(buckets)} buckets for {len(chunk)} requests")
        for q, b in zip(chunk, buckets):
            if not 0 <= int(b) < n_buckets:
                raise PredictorError(f"predictor {predictor.name!r} returned bucket {b} for request {q.id}")
            out.append(q.model_copy(update={"predicted_bucket": int(b)}))
    return out
