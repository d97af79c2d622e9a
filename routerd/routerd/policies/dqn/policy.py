"""``dqn``: the Double-DQN router loaded from a checkpoint (arXiv 2408.13510 §5.3).

Each decision featurizes the queue head and the cluster (:mod:`.features`), evaluates
the Q-network in numpy (:mod:`.network`) and takes the greedy action: an instance, or
hold when the "no-action" output is highest. ``allow_hold=False`` masks holding.
When the view has another number of instances than the checkpoint was trained for,
it routes round robin and counts the decision in ``fallbacks``.
"""

from __future__ import annotations

import numpy as np

from routerd.policies.base import ClusterView, PolicyContext, PolicyParams, RequestFeatures, RoutingPolicy
from routerd.policies.dqn.checkpoint import DEFAULT_CHECKPOINT, load_checkpoint
from routerd.policies.dqn.features import featurize, obs_dim
from routerd.policies.dqn.network import q_values


class Params(PolicyParams):
    """Parameters of ``dqn``."""

    checkpoint: str = DEFAULT_CHECKPOINT
    """Checkpoint folder (``phasewise train --output``), or ``default`` for the one shipped with
    the package for llama2-7b-v100 and 4 instances (a clone of ``late_binding``: docs/rl.md)."""
    allow_hold: bool = True
    """Whether the agent may hold the request at the router (the paper's no-action)."""


class DQNPolicy(RoutingPolicy):
    """Greedy action of a trained Q-network.

    Raises:
        routerd.policies.dqn.checkpoint.CheckpointError: at construction, for a missing
            or corrupt checkpoint or one made for another instance count.
    """

    name = "dqn"
    order_sensitive = True
    Params = Params

    def __init__(self, ctx: PolicyContext, params: PolicyParams | None = None, *, weights=None) -> None:
        super().__init__(ctx, params)
        p: Params = self.params  # type: ignore[assignment]
        if weights is None:
            self.checkpoint = load_checkpoint(p.checkpoint, num_instances=ctx.num_instances)
            weights = self.checkpoint.weights
        self.weights = weights
        """Network weights (numpy, layout of :mod:`routerd.policies.dqn.network`)."""
        self._x = np.empty(obs_dim(ctx.num_instances), dtype=np.float32)
        self._dt = ctx.profile.decode_token_time_s
        self._buckets = len(ctx.bucket_edges) + 1
        self.fallbacks = 0
        """Decisions made by the round-robin fallback because the instance count differed."""
        self._rr = -1

    def q(self, request: RequestFeatures, view: ClusterView) -> np.ndarray:
        """Q-values (shape ``(m + 1,)``; the last is "hold") for deciding on ``request``."""
        x = featurize(request, view, self._dt, self._buckets, out=self._x)
        return q_values(self.weights, x)

    def pick(self, request: RequestFeatures, view: ClusterView) -> int | None:
        m = len(view.instances)
        if m != self.ctx.num_instances:
            # The network's input and output are sized for the checkpoint's instance count;
            # while the cluster has another size (an endpoint left or joined), fail open
            # to round robin and count it.
            self.fallbacks += 1
            self._rr = (self._rr + 1) % m
            return view.instances[self._rr].index
        q = self.q(request, view)
        if not self.params.allow_hold:  # type: ignore[attr-defined]
            q = q[:m]
        a = int(q.argmax())
        return None if a == m else view.instances[a].index
