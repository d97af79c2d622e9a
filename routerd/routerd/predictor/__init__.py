"""Response-length predictor: output-length buckets from prompt text and a task hint.

arXiv 2408.13510 §5.1 predicts each request's output length as a bucket (0-250,
250-1000, 1000-4000, >= 4000 tokens) with a DistilBERT classifier and a task hint.
This package has the interface and baselines (:mod:`.base`, numpy/scikit-learn), the
shipped default, a word n-gram bucket model and task classifier served with numpy alone
(:mod:`.ngram_predictor` over :mod:`.ngram`; trained by :mod:`.train_ngram`), the
data split (:mod:`.data`), the transformer model (:mod:`.hf`, torch/transformers,
imported only when used), training (:mod:`.train`), the Table-1 report
(:mod:`.evaluate`), the CLI (:mod:`.cli`) and the simulator integration
(:mod:`.assign`). Importing this package imports neither torch nor transformers.
"""

from __future__ import annotations

from .assign import BASELINE_NAMES, DEFAULT_PREDICTOR, assign_predictions, load_predictor
from .base import (
    LengthOnlyPredictor,
    LengthPredictor,
    MajorityPredictor,
    PredictorError,
    TaskPriorPredictor,
    parse_edges,
)
from .ngram_predictor import NgramPredictor

__all__ = [
    "BASELINE_NAMES",
    "DEFAULT_PREDICTOR",
    "LengthOnlyPredictor",
    "LengthPredictor",
    "MajorityPredictor",
    "NgramPredictor",
    "PredictorError",
    "TaskPriorPredictor",
    "assign_predictions",
    "load_predictor",
    "parse_edges",
]
