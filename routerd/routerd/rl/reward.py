"""The three reward variants of arXiv 2408.13510 §5.3/§6 (paper-notes §3).

Per environment step of duration ``dt`` (seconds, the time between two router
decisions; several decisions at the same instant have ``dt = 0``)::

    r = -(dt / step_s) * sum_j (1 / T_j) * (1 - f_j)      # queued + unfinished requests
        + r_w * (requests completed during the step)       # r_w = 60 (paper A.9.3)
        + w_k * h                                          # heuristic guidance

with ``T_j = grad1 * p_j + decode_token_time_s * d_j`` the estimated processing time
(s) of request ``j`` (prompt ``p_j`` and predicted output ``d_j`` tokens; paper §4.2)
and ``f_j = generated / d_j``. The penalty is the paper's per-0.02-s-step term scaled
by the step's length, so decisions at the same instant do not count it twice. ``f_j``
is not clipped (a request that outruns its prediction stops being penalised); this
keeps the sum linear in time, so the simulator maintains it in O(1) per step.

``h = r_mixing(chosen) - max_m r_mixing(m)`` from :mod:`routerd.estimator` (0 for a
hold). The shaping weight ``w_k``:

* ``baseline``: 0;
* ``workload-aware``: 1 at every step;
* ``workload-guided``: ``gamma - gamma_k`` with the guided discount
  ``gamma_k = (1 - exp(-beta_d * k)) * gamma`` (``beta_d = 0.5``, ``k`` the episode
  index), after HuRL (Cheng et al., NeurIPS 2021), so the guidance fades with training.
  As in HuRL the learner also bootstraps with ``gamma_k`` instead of ``gamma``.

Ours (issue 18), ``littles-law``: the reward whose sum is the quantity reported, mean E2E::

    r = -(1 / step_s) * integral over the step of N(t) dt + guidance * h

with ``N(t)`` the requests in the system (arrived, in the router's queue or on an instance,
not finished): the paper's penalty with every ``1/T_j = 1`` and ``f_j = 0``. Over an episode
whose requests all finish, ``sum r = -(sum_j E2E_j) / step_s + guidance * sum h`` (the integral of
``N`` is the sum of the time each request spent in the system, Little's law), so with
``guidance`` 0 maximising the return is minimising mean E2E, with no completion bonus to trade
against it. ``guidance`` (default 0) keeps the paper's shaping term as an option.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

REWARD_VARIANTS = ("baseline", "workload-aware", "workload-guided", "littles-law")


@dataclass(frozen=True)
class RewardConfig:
    """Reward variant and its constants."""

    variant: str = "workload-guided"
    """One of :data:`REWARD_VARIANTS`."""
    r_w: float = 60.0
    """Reward per completed request (paper A.9.3)."""
    gamma: float = 0.99
    """Discount of the learner (not given in the paper)."""
    beta_d: float = 0.5
    """Decay rate of the guidance over episodes (paper §6)."""
    step_s: float = 0.02
    """Duration (s) of the paper's step; the penalty is per ``step_s`` of simulated time."""
    alpha: float = 0.5
    """Estimator weight of the prompt-side term (paper: 0.5)."""
    epsilon: float = 0.1
    """Estimator prefill-impact threshold (s)."""
    guidance: float = 0.0
    """``littles-law`` only: the constant weight of the shaping term ``h`` (0: none)."""

    @property
    def counts_requests(self) -> bool:
        """Whether the penalty counts requests (``littles-law``: ``1/T_j = 1``, no progress
        credit, no completion bonus) instead of the paper's processing-time weighted backlog."""
        return self.variant == "littles-law"

    def __post_init__(self) -> None:
        if self.variant not in REWARD_VARIANTS:
            raise ValueError(f"unknown reward variant {self.variant!r}; valid: {', '.join(REWARD_VARIANTS)}")

    def shaping_weight(self, episode: int) -> float:
        """Weight of ``h`` in episode ``episode`` (0-based)."""
        if self.variant == "baseline":
            return 0.0
        if self.variant == "workload-aware":
            return 1.0
        if self.variant == "littles-law":
            return self.guidance
        return self.gamma - self.discount(episode)

    def discount(self, episode: int) -> float:
        """Discount the learner bootstraps with in ``episode``: ``gamma_k`` when guided, else ``gamma``."""
        if self.variant == "workload-guided":
            return (1.0 - math.exp(-self.beta_d * episode)) * self.gamma
        return self.gamma


def processing_time_s(grad1: float, decode_token_time_s: float, prompt: int, predicted_output: float) -> float:
    """Estimated processing time ``T_j`` (s): prefill at ``grad1`` s/token plus decode iterations."""
    return grad1 * prompt + decode_token_time_s * predicted_output
