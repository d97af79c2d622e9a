"""The Q-network: layers (obs, 64), (64, 64), (64, m + 1) with ReLU (arXiv 2408.13510 A.9.3).

Weights are stored in safetensors under the names ``l1.weight``, ``l1.bias``,
``l2.*``, ``l3.*`` (torch ``nn.Linear`` layout: weight is ``(out, in)``).
:func:`q_values` evaluates them with numpy, so serving needs no torch;
:func:`routerd.rl.qnet.build_torch_qnet` makes the trainable torch module with the
same names.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

LAYERS = ("l1", "l2", "l3")
TENSORS = tuple(f"{layer}.{part}" for layer in LAYERS for part in ("weight", "bias"))
"""Every tensor name a checkpoint holds."""


def q_values(weights: Mapping[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """Q-values, shape ``(..., m + 1)``, of observations ``x`` of shape ``(..., obs_dim)``."""
    h = x @ weights["l1.weight"].T + weights["l1.bias"]
    np.maximum(h, 0.0, out=h)
    h = h @ weights["l2.weight"].T + weights["l2.bias"]
    np.maximum(h, 0.0, out=h)
    return h @ weights["l3.weight"].T + weights["l3.bias"]


def check_shapes(weights: Mapping[str, np.ndarray], obs: int, actions: int) -> None:
    """Raise ValueError naming the tensor whose shape does not fit ``obs`` inputs and ``actions``
    outputs, or that is not a finite float array."""
    for name in TENSORS:
        if name not in weights:
            raise ValueError(f"missing tensor {name!r}")
    w1, w2, w3 = weights["l1.weight"], weights["l2.weight"], weights["l3.weight"]
    if w1.ndim != 2 or w1.shape[1] != obs:
        raise ValueError(f"l1.weight has shape {tuple(w1.shape)}, expected (hidden, {obs})")
    if w2.ndim != 2 or w2.shape[1] != w1.shape[0]:
        raise ValueError(f"l2.weight has shape {tuple(w2.shape)}, expected (hidden, {w1.shape[0]})")
    if w3.ndim != 2 or w3.shape != (actions, w2.shape[0]):
        raise ValueError(f"l3.weight has shape {tuple(w3.shape)}, expected ({actions}, {w2.shape[0]})")
    for layer, w in zip(LAYERS, (w1, w2, w3)):
        b = weights[f"{layer}.bias"]
        if b.shape != (w.shape[0],):
            raise ValueError(f"{layer}.bias has shape {tuple(b.shape)}, expected ({w.shape[0]},)")
    for name in TENSORS:
        t = np.asarray(weights[name])
        if t.dtype.kind != "f":
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}, expected a float type")
        if not np.isfinite(t).all():
            # A NaN row makes every Q-value NaN and argmax pick action 0 for every request.
            raise ValueError(f"tensor {name!r} holds {int((~np.isfinite(t)).sum())} non-finite values (NaN or inf)")
