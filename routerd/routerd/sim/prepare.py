"""Turn workload :class:`~routerd.model.Request` objects into simulator requests.

Predictions are computed here, once per request, so the simulator never runs a
predictor in its loop. Requests that cannot run on the profile are handled as vLLM
would: a prompt of ``max_model_len`` tokens or more is rejected (vLLM answers 400),
and an output that would pass ``max_model_len`` is cut to fit (vLLM stops with
finish reason ``length``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

from routerd.model import PREDICTOR_BUCKET_EDGES, Request, bucket_mid_tokens, bucket_of
from routerd.prefix.chain import shared_extents, truncate
from routerd.profiles import HardwareProfile
from routerd.sim.request import SimRequest


class PredictionError(ValueError):
    """An unknown prediction mode."""


PREDICTION_MODES = ("true", "noisy", "given", "none")


@dataclass
class Prepared:
    """Simulator requests plus what was changed to fit the profile."""

    requests: list[SimRequest]
    rejected: list[int]
    """Ids of requests whose prompt is >= ``max_model_len`` (not simulated)."""
    clipped: int
    """Requests whose output was cut to ``max_model_len - prompt`` tokens."""
    kept: list[int] = field(default_factory=list)
    """Position in the input sequence of each simulated request (``requests[i]`` came from
    input ``kept[i]``)."""

    def fresh(self, arrival_s: Sequence[float] | None = None) -> Prepared:
        """New simulator requests in the state :func:`prepare_requests` left them, for another
        run of the same requests (a simulation mutates its requests, so each run needs its own).

        Predictions, clipped outputs and prefix extents are what :func:`prepare_requests`
        computed (none depends on arrival times; the extents are immutable, so shared),
        so this equals preparing the same requests again at a fraction of the cost (on 1,000
        Mooncake requests the extents alone take ~0.08 s per preparation).

        Args:
            arrival_s: one arrival time (s) per *input* request (the simulated ones are
                read at ``kept``), e.g. the input rescaled to another rate; None keeps them.
        """
        out: list[SimRequest] = []
        for i, r in zip(self.kept, self.requests):
            c = SimRequest(r.id, r.arrival_s if arrival_s is None else arrival_s[i], r.prompt, r.output,
                           r.bucket, r.pred_tokens, r.task)
            c.response_id = r.response_id
            c.prefix = r.prefix  # a frozen PrefixBlocks
            c.seq_ext = r.seq_ext
            c.seq_share = r.seq_share
            out.append(c)
        return Prepared(out, list(self.rejected), self.clipped, list(self.kept))


def parse_prediction(mode: str) -> tuple[str, float]:
    """Parse ``true`` | ``noisy[:accuracy]`` | ``given`` | ``none`` into (kind, accuracy).

    Raises:
        PredictionError: unknown mode or accuracy outside (0, 1].
    """
    kind, colon, arg = mode.partition(":")
    if kind not in PREDICTION_MODES:
        raise PredictionError(f"unknown prediction mode {mode!r}; valid: {', '.join(PREDICTION_MODES)}")
    if colon and (kind != "noisy" or not arg):
        raise PredictionError(f"prediction mode {mode!r}: only noisy takes a value, as noisy:ACC")
    acc = 0.7915  # the paper's predictor accuracy (arXiv 2408.13510 Table 1)
    if arg:
        try:
            acc = float(arg)
        except ValueError:
            raise PredictionError(f"prediction mode {mode!r}: accuracy {arg!r} is not a number") from None
        if not 0.0 < acc <= 1.0:
            raise PredictionError(f"prediction mode {mode!r}: accuracy must be in (0, 1]")
    return kind, acc


def prepare_requests(
    requests: Sequence[Request],
    profile: HardwareProfile,
    *,
    prediction: str = "true",
    edges: tuple[int, ...] = PREDICTOR_BUCKET_EDGES,
    seed: int = 0,
) -> Prepared:
    """Build :class:`SimRequest` objects with their predicted buckets.

    Prediction modes: ``true`` gives each request the bucket of its true output length
    (a perfect bucket predictor); ``noisy:ACC`` keeps the true bucket with probability
    ACC and otherwise moves it to a neighbouring bucket (seeded by ``seed``); ``given``
    uses ``Request.predicted_bucket`` (set by a real predictor); ``none`` predicts
    nothing (bucket ``None``, a point estimate of the first bucket's midpoint).

    Raises:
        PredictionError: bad mode, or ``given`` with a request that has no prediction.
    """
    kind, acc = parse_prediction(prediction)
    rng = random.Random(seed)
    n_buckets = len(edges) + 1
    out: list[SimRequest] = []
    with_prefix: list[tuple[SimRequest, tuple[tuple[int, int], ...]]] = []
    rejected: list[int] = []
    kept: list[int] = []
    clipped = 0
    max_len = profile.max_model_len
    for pos, q in enumerate(requests):
        if q.prompt_tokens >= max_len:
            rejected.append(q.id)
            continue
        kept.append(pos)
        output = q.output_tokens
        if q.prompt_tokens + output > max_len:
            output = max_len - q.prompt_tokens
            clipped += 1
        true_b = bucket_of(output, edges)
        if kind == "true":
            b: int | None = true_b
        elif kind == "noisy":
            b = true_b
            if rng.random() >= acc:
                if true_b == 0:
                    b = 1
                elif true_b == n_buckets - 1:
                    b = true_b - 1
                else:
                    b = true_b + (1 if rng.random() < 0.5 else -1)
        elif kind == "given":
            if q.predicted_bucket is None:
                raise PredictionError(f"request {q.id}: prediction mode 'given' but no predicted_bucket")
            b = q.predicted_bucket
            if b >= n_buckets:
                raise PredictionError(f"request {q.id}: predicted_bucket {b} is outside 0..{n_buckets - 1}")
        else:
            b = None
        pred = bucket_mid_tokens(b if b is not None else 0, edges)
        sr = SimRequest(q.id, q.arrival_s, q.prompt_tokens, output, b, pred, q.task)
        if q.prefix is not None:
            sr.response_id = q.response_id
            with_prefix.append((sr, q.prefix))
        out.append(sr)
    if with_prefix:
        _set_extents(with_prefix, profile.block_size)
    return Prepared(out, rejected, clipped, kept)


def _set_extents(items: list[tuple[SimRequest, tuple[tuple[int, int], ...]]], bs: int) -> None:
    """Each request's prompt extents (``prefix``) and whole-sequence extents (``seq_ext``),
    runs of units merged where the workload always traverses them whole
    (:func:`routerd.prefix.chain.shared_extents`). The response is one more unit: its id, or
    ``-(id + 1)`` (unique) when no later prompt resends it."""
    seqs = []
    for sr, units in items:
        rid = sr.response_id if sr.response_id is not None else -(sr.id + 1)
        seqs.append(tuple(units) + ((rid, sr.output),))
    for (sr, _), (ext, shared) in zip(items, shared_extents(seqs, bs)):
        sr.seq_ext = ext
        sr.seq_share = shared
        sr.prefix = truncate(ext, sr.prompt // bs)
