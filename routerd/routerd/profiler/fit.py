"""Least-squares fits of the latency model's terms from profiler points (numpy only).

Decode: ``gap = overhead + k_seq * B + k_ctx * S`` over :class:`DecodePoint` rows, in relative
terms (each row weighted by ``1 / gap``).
Prefill: ``excess = k_pf * P + k_attn * sum(L**2)`` over :class:`PrefillPoint` rows
(no intercept: the probe's baseline already holds the overhead and the decodes).
Both use ``numpy.linalg.lstsq``; a coefficient that comes out negative (noise around
a term the hardware does not have) is fixed at 0 and the rest refitted, since a
profile's terms must be >= 0, and a point far off the fit (a batch that a burst of
client-side delay spoilt) is left out, at most a fifth of them (:func:`trimmed_fit`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from routerd.profiler.measure import DecodePoint, PrefillPoint


class FitError(ValueError):
    """Too few or degenerate points to fit a term."""


@dataclass
class Fit:
    """Fitted coefficients with their residuals."""

    names: list[str]
    coef: list[float]
    residuals: list[float] = field(default_factory=list)
    """Observed minus fitted, per point (s)."""
    observed: list[float] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    """Indices of points left out as outliers (their residuals are still reported)."""
    note: str = ""
    """What the fit had to give up, for the profile's header (empty when nothing)."""

    def value(self, name: str) -> float:
        """Coefficient ``name``."""
        return self.coef[self.names.index(name)]

    def _kept(self) -> list[int]:
        return [i for i in range(len(self.residuals)) if i not in self.dropped]

    @property
    def rms_s(self) -> float:
        """Root-mean-square residual (s) of the points used."""
        r = [self.residuals[i] for i in self._kept()]
        return float(np.sqrt(np.mean(np.square(r)))) if r else 0.0

    @property
    def max_rel(self) -> float:
        """Largest |residual| / observed over the points used."""
        return max((abs(self.residuals[i]) / abs(self.observed[i]) for i in self._kept() if self.observed[i]),
                   default=0.0)


def trimmed_fit(X: np.ndarray, y: np.ndarray, max_drop_share: float = 0.2) -> tuple[np.ndarray, list[int]]:
    """:func:`nonneg_lstsq`, dropping outlying points one at a time; returns ``(beta, dropped)``.

    A point is an outlier when its residual exceeds both 3 scaled MADs of the residuals
    and 2 % of its observed value (a batch hit by a burst of scheduling delay on a
    loaded client); at most ``max_drop_share`` of the points go, never so many that
    fewer than ``columns + 2`` remain.
    """
    keep = list(range(len(y)))
    dropped: list[int] = []
    limit = min(int(max_drop_share * len(y)), len(y) - X.shape[1] - 2)
    while True:
        beta = nonneg_lstsq(X[keep], y[keep])
        if len(dropped) >= limit:
            return beta, dropped
        r = y[keep] - X[keep] @ beta
        mad = 1.4826 * float(np.median(np.abs(r - np.median(r))))
        worst = int(np.argmax(np.abs(r)))
        if abs(r[worst]) <= max(3 * mad, 0.02 * abs(y[keep][worst])):
            return beta, dropped
        dropped.append(keep.pop(worst))


def nonneg_lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``numpy.linalg.lstsq`` with negative coefficients clamped to 0 and the others refitted."""
    free = list(range(X.shape[1]))
    while True:
        beta = np.zeros(X.shape[1])
        if free:
            sol, *_ = np.linalg.lstsq(X[:, free], y, rcond=None)
            beta[free] = sol
        neg = [j for j in free if beta[j] < 0]
        if not neg:
            return beta
        free.remove(min(neg, key=lambda j: beta[j]))


def fit_decode(points: Sequence[DecodePoint]) -> Fit:
    """``overhead_s``, ``decode_per_seq_s``, ``decode_per_ctx_token_s`` from decode windows.

    Raises:
        FitError: fewer than 3 points, or batch size and context do not vary independently.
    """
    if len(points) < 3:
        raise FitError(f"decode fit needs >= 3 points, got {len(points)}")
    X = np.array([[1.0, p.batch, p.context_tokens] for p in points])
    y = np.array([p.gap_s for p in points])
    if np.linalg.matrix_rank(X) < 3:
        raise FitError("decode points do not vary batch size and context independently")
    if np.any(y <= 0):
        raise FitError("a decode point has a step time <= 0")
    scale = np.abs(X).max(axis=0)
    # Relative residuals (each row divided by its step time): a slowdown of the machine
    # stretches a step by a share of it, so a 64-request step's noise is many times a lone
    # request's, and absolute residuals would let the large batches decide the overhead.
    beta, dropped = trimmed_fit(X / scale / y[:, None], np.ones_like(y))
    beta = beta / scale
    names = ["overhead_s", "decode_per_seq_s", "decode_per_ctx_token_s"]
    return Fit(names, [float(b) for b in beta], [float(r) for r in y - X @ beta], [float(v) for v in y], dropped)


def fit_prefill(points: Sequence[PrefillPoint]) -> Fit:
    """``prefill_per_token_s`` and ``prefill_attn_s`` from prefill batches.

    Raises:
        FitError: fewer than 2 points or a degenerate design.
    """
    if len(points) < 2:
        raise FitError(f"prefill fit needs >= 2 points, got {len(points)}")
    X = np.array([[float(p.prefill_tokens), p.attn_tokens2] for p in points])
    y = np.array([p.excess_s for p in points])
    if np.linalg.matrix_rank(X) < 2:
        raise FitError("prefill points do not vary total tokens and per-request length independently")
    # Scale the columns so lstsq's conditioning does not depend on units.
    scale = np.abs(X).max(axis=0)
    beta, dropped = trimmed_fit(X / scale, y)
    beta = beta / scale
    note = ""
    if beta[0] <= 0 < float(np.max(y)):
        # Noise put all the growth on the quadratic term (the two columns are close when
        # prompts are short against the per-token cost, as on small models): a profile needs
        # the per-token cost, the attention term is the smaller one, so it goes.
        b1, dropped = trimmed_fit(X[:, :1] / scale[:1], y)
        beta = np.array([b1[0] / scale[0], 0.0])
        note = (f"prefill fit: the two-term fit found no cost per token; refitted with the per-token term "
                f"alone (prefill_attn_s = 0) over {len(points) - len(dropped)} batches")
    names = ["prefill_per_token_s", "prefill_attn_s"]
    return Fit(names, [float(b) for b in beta], [float(r) for r in y - X @ beta], [float(v) for v in y], dropped,
               note)
