"""``learned_linear``: ``late_binding``'s admission, then the lowest learned linear score.

Issue 18's learned router, the form that beat ``late_binding`` where the Double DQN did not
(docs/rl.md). The request waits at the router, as with ``late_binding``
(``routerd/policies/kv_headroom.py``), until some instance can admit it without preempting:
nothing waiting there (``max_waiting``), a free sequence slot, and KV headroom for its predicted
footprint within ``(1 - reserve_fraction)`` of the cache. Among those instances it takes the one
with the lowest ``w . x``, ``x`` the instance's features (:data:`FEATURES`, layout
:data:`FEATURE_VERSION`, computed by :func:`instance_features`) and ``w`` learned by evolution
strategies on whole simulated samples (``routerd/rl/es.py``: Salimans et al. 2017, antithetic
sampling, common random numbers). ``w = (1, 0, ..., 0)`` is ``late_binding`` itself (least
outstanding tokens among the admissible), where training starts, on a pool of one profile and up
to exact ties: those go to the seeded generator here (``late_binding`` takes the first in view
order; routerd shuffles its views), and each instance's own profile sets its sequence limit
(``late_binding`` applies the first profile's to all).

Features of instance ``i`` for a request of ``p`` prompt and ``d`` predicted output tokens
(all from the router's view, so the same in the simulator and in routerd):

==================  =========================================================================
outstanding_rel     its outstanding tokens (``late_binding``'s score) / the mean over instances
running             requests running / 32
waiting             requests waiting / 8 (0 for an admissible instance unless ``max_waiting``)
kv_usage            KV blocks used / total
decode_short        decoding requests predicted under 256 tokens / 32 (``LoadSummary`` bins)
decode_mid          ... 256-2048 / 32
decode_long         ... over 2048 / 32
pred_x_kv           ``d / 1024 * kv_usage``: long answers into full caches
prompt_x_running    ``p / 1024 * running / 32``: long prefills stalling many decodes
headroom_after      (usable blocks - used - waiting - the request's) / total blocks
==================  =========================================================================

Exact score ties go to the seeded generator (``pick_cheapest``; near-ties with ``ctx.near_tie``,
relative to the lowest score's magnitude: the scores have no unit). A score that is not finite
(only from a non-finite prediction) leaves its instance out.
Per-instance profiles (a mixed pool) set each instance's sequence limit; the features carry no
speed, so on a mixed pool it is a profile-blind heuristic.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

from pydantic import Field

from routerd.policies.base import (
    ClusterView,
    InstanceView,
    PolicyContext,
    PolicyParams,
    PolicySetupError,
    RequestFeatures,
    RoutingPolicy,
    pick_cheapest,
)
from routerd.policies.kv_headroom import blocks_for, kv_deficit_blocks, outstanding_tokens, predicted_footprint_tokens

FEATURE_VERSION = "pw-lin-v1"
FEATURES = ("outstanding_rel", "running", "waiting", "kv_usage", "decode_short", "decode_mid", "decode_long",
            "pred_x_kv", "prompt_x_running", "headroom_after")
FORMAT = "phasewise-linear/1"
DEFAULT_CHECKPOINT = "default"
MAX_WEIGHT = 1e6
"""Largest weight magnitude a checkpoint may hold: the features are about 0..1 (a few units at
most), so beyond it a score means nothing, and products of larger ones can overflow to inf and
NaN. The trained ones are under 10."""
LATE_BINDING_WEIGHTS = (1.0,) + (0.0,) * (len(FEATURES) - 1)
"""The weights under which the policy is ``late_binding`` (training starts here)."""


class LinearCheckpointError(PolicySetupError):
    """A ``learned_linear`` checkpoint is missing, unreadable, or made for another feature layout."""


@dataclass
class LinearCheckpoint:
    """Weights (one per feature of :data:`FEATURES`) and the training record."""

    path: Path
    weights: tuple[float, ...]
    metadata: dict[str, Any]


SHIPPED = {"default": "linear-default", "public-mix": "linear-default", "azure-conv": "linear-azure-conv"}
"""Checkpoints shipped with the package, by name (``checkpoint=NAME``): each trained on 4 x
llama2-7b-v100 at 1.5x round robin's capacity on that workload's training part; ``default`` is
public-mix's. None ships for azure-code: training there did not validate better than
``late_binding``. docs/rl.md has each one's held-out figures."""


def default_checkpoint_path(name: str = DEFAULT_CHECKPOINT) -> Path:
    """The ``linear.json`` of shipped checkpoint ``name`` (:data:`SHIPPED`)."""
    return Path(str(resources.files("routerd") / "data" / "checkpoints" / SHIPPED[name] / "linear.json"))


def save_linear_checkpoint(path: str | Path, weights: Sequence[float], metadata: dict[str, Any]) -> Path:
    """Write ``linear.json`` into folder ``path`` (created): format, feature layout, weights by
    feature name, and ``metadata`` (training and evaluation record). Returns the file."""
    if len(weights) != len(FEATURES):
        raise ValueError(f"{len(weights)} weights for {len(FEATURES)} features")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    doc = {"format": FORMAT, "features": FEATURE_VERSION,
           "weights": {name: float(w) for name, w in zip(FEATURES, weights)}, **metadata}
    out = folder / "linear.json"
    out.write_text(json.dumps(doc, indent=2, sort_keys=True))
    return out


def load_linear_checkpoint(spec: str | Path) -> LinearCheckpoint:
    """A shipped name (:data:`SHIPPED`), or a folder holding ``linear.json`` (or the file itself).

    A shipped name wins over a folder of the same name (give ``./default`` for a local folder).

    Raises:
        LinearCheckpointError: empty, missing or unreadable (not UTF-8, not JSON, nested too
            deep), another format or feature layout, a weight missing, unknown, not a number or
            beyond :data:`MAX_WEIGHT`.
    """
    path = default_checkpoint_path(str(spec)) if str(spec) in SHIPPED else Path(spec)
    if path.is_dir():
        path = path / "linear.json"
    if not str(spec):
        raise LinearCheckpointError("learned_linear checkpoint: empty; give a folder or one of "
                                    f"{', '.join(SHIPPED)}")
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise LinearCheckpointError(f"learned_linear checkpoint {path}: not found") from None
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad UTF-8, bad JSON, huge integers
        raise LinearCheckpointError(f"learned_linear checkpoint {path}: unreadable ({type(e).__name__}: "
                                    f"{str(e)[:200]})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise LinearCheckpointError(f"learned_linear checkpoint {path}: format {doc.get('format') if isinstance(doc, dict) else None!r}, "
                                    f"expected {FORMAT!r}")
    if doc.get("features") != FEATURE_VERSION:
        raise LinearCheckpointError(f"learned_linear checkpoint {path}: features {doc.get('features')!r}, this "
                                    f"version computes {FEATURE_VERSION!r}")
    w = doc.get("weights")
    if not isinstance(w, dict) or set(w) != set(FEATURES):
        have = sorted(w) if isinstance(w, dict) else w
        raise LinearCheckpointError(f"learned_linear checkpoint {path}: weights for {have}, expected {list(FEATURES)}")
    vals = []
    for name in FEATURES:
        v = w[name]
        try:
            ok = not isinstance(v, bool) and isinstance(v, (int, float)) and abs(float(v)) <= MAX_WEIGHT
        except OverflowError:  # an integer past float's range
            ok = False
        if not ok:
            raise LinearCheckpointError(f"learned_linear checkpoint {path}: weight {name}={str(v)[:40]!r} is not a "
                                        f"number within +-{MAX_WEIGHT:g}")
        vals.append(float(v))
    return LinearCheckpoint(path, tuple(vals), doc)


def instance_features(prompt_tokens: int, predicted_output_tokens: float, inst: InstanceView, outstanding: float,
                      mean_outstanding: float, deficit_blocks: int) -> tuple[float, ...]:
    """The :data:`FEATURES` of ``inst`` for a request (module docstring table). ``outstanding``:
    its :func:`outstanding_tokens`; ``mean_outstanding``: their mean over the view's instances
    (>= 1); ``deficit_blocks``: :func:`kv_deficit_blocks` for the request there (its negative
    is the headroom left after placing it)."""
    bins = inst.load_summary().decode_bins
    total = inst.kv_total_blocks if inst.kv_total_blocks > 0 else 1
    kv = inst.kv_usage
    return (outstanding / mean_outstanding, inst.num_running / 32.0, inst.num_waiting / 8.0, kv,
            bins[0] / 32.0, bins[1] / 32.0, bins[2] / 32.0, predicted_output_tokens / 1024.0 * kv,
            prompt_tokens / 1024.0 * inst.num_running / 32.0, -deficit_blocks / total)


class Params(PolicyParams):
    """Parameters of ``learned_linear``."""

    checkpoint: str = DEFAULT_CHECKPOINT
    """Checkpoint folder (``phasewise train-linear --output``) or a shipped one: ``default`` (=
    ``public-mix``) or ``azure-conv``, each trained on 4 x llama2-7b-v100 at 1.5x round robin's
    capacity on that workload's training part."""
    reserve_fraction: float = Field(default=0.05, ge=0.0, lt=1.0)
    """Fraction of each instance's KV blocks kept free for outputs longer than predicted
    (``late_binding``'s default; the shipped weights were trained with it)."""
    max_waiting: int = Field(default=0, ge=0)
    """Most requests an instance may have waiting for it to take one more (``late_binding``'s)."""


class LearnedLinear(RoutingPolicy):
    """``late_binding``'s admission, then the instance with the lowest learned linear score of its load.

    Raises:
        LinearCheckpointError: at construction, for a missing or unusable checkpoint.
    """

    name = "learned_linear"
    Params = Params
    params: Params

    def __init__(self, ctx: PolicyContext, params: PolicyParams | None = None, *,
                 weights: Sequence[float] | None = None) -> None:
        super().__init__(ctx, params)
        self.checkpoint: LinearCheckpoint | None = None
        if weights is None:
            self.checkpoint = load_linear_checkpoint(self.params.checkpoint)
            weights = self.checkpoint.weights
        if len(weights) != len(FEATURES) or not all(math.isfinite(float(w)) and abs(float(w)) <= MAX_WEIGHT
                                                    for w in weights):
            raise LinearCheckpointError(f"learned_linear: {len(FEATURES)} weights within +-{MAX_WEIGHT:g} needed, "
                                        f"got {[float(w) for w in weights]}")
        self.weights = tuple(float(w) for w in weights)
        self._rng = random.Random(ctx.seed)

    def pick(self, request: RequestFeatures, view: ClusterView) -> int | None:
        p = self.params
        ctx = self.ctx
        profiles = ctx.profiles
        need_tokens = predicted_footprint_tokens(request.prompt_tokens, request.predicted_output_tokens,
                                                 ctx.profile.max_model_len)
        insts = view.instances
        outs = [outstanding_tokens(v) for v in insts]
        mean = sum(outs) / len(outs) if outs else 1.0
        if mean < 1.0:
            mean = 1.0
        # w . instance_features(...), multiplied out: the request's terms fold into per-decision
        # coefficients (the same sum; tests/test_policy_learned_linear.py holds the choices to it).
        w0, w1, w2, w3, w4, w5, w6, w7, w8, w9 = self.weights
        c_out = w0 / mean
        c_run = w1 / 32.0 + w8 * request.prompt_tokens / 1024.0 / 32.0
        c_wait = w2 / 8.0
        c_kv = w3 + w7 * request.predicted_output_tokens / 1024.0
        c_b0, c_b1, c_b2 = w4 / 32.0, w5 / 32.0, w6 / 32.0
        scored: list[tuple[float, int]] = []
        for inst, out in zip(insts, outs):
            i = inst.index
            prof = profiles[i] if 0 <= i < len(profiles) else ctx.profile
            if inst.num_waiting > p.max_waiting or inst.num_running + inst.num_waiting >= prof.max_num_seqs:
                continue
            deficit = kv_deficit_blocks(inst, blocks_for(need_tokens, inst.block_size), p.reserve_fraction)
            if deficit > 0:  # late_binding's KV test
                continue
            bins = inst.load_summary().decode_bins
            total = inst.kv_total_blocks if inst.kv_total_blocks > 0 else 1
            score = (c_out * out + c_run * inst.num_running + c_wait * inst.num_waiting + c_kv * inst.kv_usage
                     + c_b0 * bins[0] + c_b1 * bins[1] + c_b2 * bins[2] - w9 * deficit / total)
            if score - score == 0.0:  # finite: a NaN or an infinity (from a non-finite prediction) is not a score
                scored.append((score, i))
        if not scored:
            return None
        return pick_cheapest(scored, ctx.near_tie, self._rng)
