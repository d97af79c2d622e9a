"""Observation of the DQN router: layout ``pw-obs-v1``.

The paper's state (arXiv 2408.13510 §5.3, A.9), generalised to ``m`` instances, is
``3 + 6 * m`` floats (27 for m = 4, the width of the paper's input layer):

====================  ===================================================================
index                 feature (scaled to about [0, 4])
====================  ===================================================================
0                     router queue length, capped at 512 (4 x max batch 128), / 512
1                     next request's prompt tokens / 1024, capped at 8
2                     next request's predicted output bucket / (buckets - 1); 0 if unknown
3 + 6i + 0            instance i: requests waiting or prefilling / 32
3 + 6i + 1..3         instance i: decoding requests whose *predicted* output is in
                      0-256, 256-2048, >= 2048 tokens (paper's 3 decode buckets) / 32
3 + 6i + 4            instance i: free KV capacity, 1 - kv_usage, rounded to 2 decimals
3 + 6i + 5            instance i: estimated time to its earliest completion (s) = smallest
                      predicted remaining decode x profile.decode_token_time_s, rounded to
                      2 decimals, / 10; 0 when nothing decodes
====================  ===================================================================

Instances are in view order; action ``i < m`` sends the request to
``view.instances[i]`` and action ``m`` holds it. Changing anything here means a new
:data:`OBS_VERSION`; checkpoints record the version they were trained with.
"""

from __future__ import annotations

import numpy as np

from routerd.policies.base import ClusterView, RequestFeatures

OBS_VERSION = "pw-obs-v1"
ROUTER_FEATURES = 3
PER_INSTANCE = 6
QUEUE_CAP = 512
COUNT_SCALE = 32.0

# round(v, 2) costs about 0.4 µs (a correctly rounded decimal conversion), twice per
# instance per decision, while its inputs repeat: KV usage takes kv_total_blocks + 1
# values and the predicted remaining decode is a multiple of 0.5 token. Memoizing it is
# the same function on the same input, so the observation stays bit-identical.
_ROUNDED: dict[float, float] = {}
_ROUNDED_MAX = 1 << 14


def _round2(v: float) -> float:
    """``round(v, 2)``, memoized (see ``_ROUNDED``)."""
    if v == 0.0 or v - v != 0.0:
        # round() returns zeros (keeping the sign), infinities and NaN unchanged; they are
        # kept out of the memo because -0.0 == 0.0 would share a key and NaN never matches.
        return v
    if len(_ROUNDED) >= _ROUNDED_MAX:
        _ROUNDED.clear()
    r = _ROUNDED[v] = round(v, 2)
    return r


def obs_dim(num_instances: int) -> int:
    """Observation width for ``num_instances`` instances."""
    return ROUTER_FEATURES + PER_INSTANCE * num_instances


def featurize(
    request: RequestFeatures,
    view: ClusterView,
    decode_token_time_s: float,
    num_buckets: int = 4,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Observation vector (float32, shape ``(obs_dim(m),)``) for deciding on ``request``.

    Args:
        request: the router-queue head.
        view: the cluster at decision time; each instance must offer ``load_summary()``.
        decode_token_time_s: seconds per decode iteration (the profile's), to turn
            tokens into the paper's time-to-completion feature.
        num_buckets: number of predictor buckets (4 for edges 250/1000/4000).
        out: optional array to fill in place.
    """
    m = len(view.instances)
    x = out if out is not None else np.empty(obs_dim(m), dtype=np.float32)
    q = view.queue_len
    x[0] = (q if q < QUEUE_CAP else QUEUE_CAP) / QUEUE_CAP
    p = request.prompt_tokens / 1024.0
    x[1] = p if p < 8.0 else 8.0
    b = request.predicted_bucket
    x[2] = 0.0 if b is None else b / max(1, num_buckets - 1)
    rounded = _ROUNDED.get
    j = ROUTER_FEATURES
    for inst in view.instances:
        s = inst.load_summary()
        x[j] = s.in_prefill / COUNT_SCALE
        d = s.decode_bins
        x[j + 1] = d[0] / COUNT_SCALE
        x[j + 2] = d[1] / COUNT_SCALE
        x[j + 3] = d[2] / COUNT_SCALE
        free = 1.0 - inst.kv_usage
        r = rounded(free)
        x[j + 4] = r if r is not None else _round2(free)
        rem = s.min_predicted_remaining
        if rem is None:
            x[j + 5] = 0.0
        else:
            # max(rem, 0.0) without the call: the same result for every float, -0.0 and NaN included.
            t = (0.0 if rem < 0.0 else rem) * decode_token_time_s
            r = rounded(t)
            x[j + 5] = (r if r is not None else _round2(t)) / 10.0
        j += PER_INSTANCE
    return x
