"""Integration with the simulator: load a predictor by spec, predict once per request.

The simulator never runs a predictor in its loop: :func:`assign_predictions` fills
``Request.predicted_bucket`` for a whole workload up front (batches of 64), and the
bench then runs with prediction mode ``given``
(:func:`routerd.sim.prepare.prepare_requests`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from typing import TYPE_CHECKING

from routerd.buckets import PREDICTOR_BUCKET_EDGES

from .base import LengthPredictor, PredictorError, check_edges

if TYPE_CHECKING:  # pydantic is slow to import; the predictor does not need it
    from routerd.model import Request

#: Predictor names that :func:`load_predictor` fits on the training split at load time.
BASELINE_NAMES: tuple[str, ...] = ("majority", "task-prior", "length-only", "length+task")
#: The spec of the shipped n-gram predictor (:func:`routerd.predictor.ngram_predictor.load_shipped`).
DEFAULT_PREDICTOR = "default"


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
    from .base import LengthOnlyPredictor, MajorityPredictor, TaskPriorPredictor

    if name not in BASELINE_NAMES:
        raise PredictorError(f"unknown baseline {name!r}; valid: {', '.join(BASELINE_NAMES)}")
    edges = check_edges(edges)
    if name in ("length-only", "length+task"):
        try:
            import sklearn  # noqa: F401
        except ImportError:
            raise PredictorError(f"baseline {name!r} needs scikit-learn: pip install 'phasewise[predictor-train]' "
                                 f"(or use {DEFAULT_PREDICTOR!r}, majority or task-prior)") from None
    try:
        rows = D.load_rows(data_dir, sources=sources, alpaca_model=alpaca_model)
    except WorkloadError as e:
        raise PredictorError(str(e)) from None
    tr = D.split_rows(rows, seed=seed, edges=edges)["train"]
    labels = D.labels_of(rows, edges)[tr]
    train_rows = [rows[i] for i in tr]
    tasks = [r.task for r in train_rows]
    if name == "majority":
        return MajorityPredictor(edges).fit(labels)
    if name == "task-prior":
        return TaskPriorPredictor(edges).fit(tasks, labels)
    return LengthOnlyPredictor(edges, use_task=name == "length+task").fit(
        [r.prompt_tokens for r in train_rows], tasks, labels)


def load_predictor(
    spec: str,
    *,
    data_dir: str | Path | None = None,
    edges: Sequence[int] | None = None,
) -> LengthPredictor:
    """A predictor from a spec string.

    Specs:

    - ``default``: the shipped n-gram predictor (numpy only; trained on permissively
      licensed prompts, see ``docs/predictor.md``);
    - a folder written by ``phasewise predictor train --kind ngram``: an n-gram
      predictor (numpy only);
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
        raise PredictorError(f"predictor spec is empty; give {DEFAULT_PREDICTOR!r}, a baseline name "
                             f"({', '.join(BASELINE_NAMES)}) or a folder saved by 'phasewise predictor train'")
    spec = spec.strip()
    if spec in BASELINE_NAMES:
        return fit_baseline(spec, data_dir=data_dir, edges=edges if edges is not None else PREDICTOR_BUCKET_EDGES)
    if spec == DEFAULT_PREDICTOR:
        from .ngram_predictor import load_shipped

        pred = load_shipped()
    else:
        pred = _load_folder(spec)
    if edges is not None and check_edges(edges) != pred.edges:
        raise PredictorError(f"{spec}: model trained with bucket edges {list(pred.edges)}, "
                             f"but {list(edges)} were asked for")
    return pred


def _load_folder(spec: str) -> LengthPredictor:
    """The saved predictor in folder ``spec``: n-gram (numpy) or transformer, by its ``kind``."""
    path = Path(spec)
    if not path.exists():
        raise PredictorError(f"unknown predictor {spec!r}: not {DEFAULT_PREDICTOR!r}, not a baseline "
                             f"({', '.join(BASELINE_NAMES)}) and no such folder")
    from .ngram_predictor import KIND, META_FILE, NgramPredictor

    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise PredictorError(f"{path}: not a saved predictor (no {META_FILE})")
    try:
        import json

        kind = json.loads(meta_path.read_text(encoding="utf-8")).get("kind")
    except (OSError, ValueError, AttributeError) as e:
        raise PredictorError(f"{meta_path}: bad predictor metadata ({type(e).__name__}: {e})") from None
    if kind == KIND:
        return NgramPredictor.load(path)
    if kind != "hf":
        raise PredictorError(f"{meta_path}: field 'kind' is {kind!r}, expected {KIND!r} or 'hf'")
    from .hf import HFPredictor

    return HFPredictor.load(path)


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
