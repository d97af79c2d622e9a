"""Gymnasium environment over the cluster simulator: one step per router decision.

``reset`` starts a new episode (a fresh workload sample from ``workload_fn(seed)``) and
returns the observation of the first decision; ``step(action)`` applies the action to
the router-queue head (``0..m-1`` an instance, ``m`` hold) and runs the simulation to
the next decision. The router is asked on every arrival, after completions while
requests wait, and every ``action_interval_s`` (0.02 s) while its queue is not empty
(see :mod:`routerd.sim.cluster`). The observation is :mod:`routerd.policies.dqn.features`
(layout ``pw-obs-v1``); the reward is :mod:`routerd.rl.reward`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import gymnasium as gym
import numpy as np

from routerd.estimator import MixingParams, r_mixing_from_load
from routerd.model import PREDICTOR_BUCKET_EDGES, Request
from routerd.policies.base import PolicyContext
from routerd.policies.dqn.features import featurize, obs_dim
from routerd.policies.round_robin import RoundRobin
from routerd.profiles import HardwareProfile
from routerd.rl.reward import RewardConfig, processing_time_s
from routerd.sim import ClusterSimulator, prepare_requests


#: KV margin of :meth:`RoutingEnv.action_mask`: ``late_binding``'s default ``reserve_fraction``.
MASK_RESERVE_FRACTION = 0.05


class RoutingEnv(gym.Env):
    """Routing as an MDP (arXiv 2408.13510 §5.3), generalised to ``m`` instances.

    Args:
        profile: hardware profile of every instance.
        num_instances: ``m``; actions are ``0..m`` (``m`` = hold).
        workload_fn: ``seed -> list[Request]`` (sorted by arrival) for each episode.
        reward: reward variant and constants.
        prediction: prediction mode for :func:`routerd.sim.prepare_requests`.
        action_interval_s: router tick while requests are held (s).
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        profile: HardwareProfile,
        num_instances: int,
        workload_fn: Callable[[int], Sequence[Request]],
        reward: RewardConfig = RewardConfig(),
        *,
        prediction: str = "true",
        action_interval_s: float = 0.02,
    ) -> None:
        self.profile = profile
        self.m = num_instances
        self.workload_fn = workload_fn
        self.reward_cfg = reward
        self.prediction = prediction
        self.action_interval_s = action_interval_s
        self.mixing = MixingParams(alpha=reward.alpha, epsilon=reward.epsilon)
        self.episode = 0
        self.shaping_weight = reward.shaping_weight(0)
        d = obs_dim(num_instances)
        self.observation_space = gym.spaces.Box(low=-1.0, high=16.0, shape=(d,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(num_instances + 1)
        self._buckets = len(PREDICTOR_BUCKET_EDGES) + 1
        self._gen = None
        self.sim: ClusterSimulator | None = None
        self.run = None

    # -- helpers ----------------------------------------------------------------
    def _obs(self) -> np.ndarray:
        sim = self.sim
        return featurize(self._head.features, sim.view(sim.now), self.profile.decode_token_time_s, self._buckets)

    def action_of(self, policy) -> int:
        """The action ``policy`` would take now (its instance index, or ``m`` for hold)."""
        sim = self.sim
        view = sim.view(sim.now)
        choice = policy.pick(self._head.features, view)
        return self.m if choice is None else [v.index for v in view.instances].index(choice)

    def action_mask(self) -> np.ndarray:
        """Which actions are allowed now: bool of shape ``(m + 1,)``. Instance ``i`` is allowed
        when it can admit the queue head without preempting (``late_binding``'s test: KV blocks
        for its prompt plus predicted output within ``(1 - reserve) * total - used - waiting``,
        nothing waiting there and a free sequence slot, ``routerd/policies/kv_headroom.py``); hold
        (``m``) always is.
        With every instance full only hold remains, as ``late_binding`` holds."""
        from routerd.policies.kv_headroom import blocks_for, kv_deficit_blocks, predicted_footprint_tokens

        sim = self.sim
        p = self.profile
        f = self._head.features
        need = blocks_for(predicted_footprint_tokens(f.prompt_tokens, f.predicted_output_tokens, p.max_model_len),
                          p.block_size)
        mask = np.ones(self.m + 1, dtype=bool)
        for i, v in enumerate(sim.view(sim.now).instances):
            mask[i] = (v.num_waiting == 0 and v.num_running + v.num_waiting < p.max_num_seqs
                       and kv_deficit_blocks(v, need, MASK_RESERVE_FRACTION) <= 0)
        return mask

    def set_episode(self, episode: int) -> None:
        """Set the episode index ``k`` that the guided shaping weight depends on."""
        self.episode = episode
        self.shaping_weight = self.reward_cfg.shaping_weight(episode)

    # -- gymnasium API ------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        seed = 0 if seed is None else seed
        requests = list(self.workload_fn(seed))
        prep = prepare_requests(requests, self.profile, prediction=self.prediction, seed=seed)
        p = self.profile
        counts = self.reward_cfg.counts_requests
        for r in prep.requests:
            if counts:  # littles-law: the penalty rate is the number of requests in the system
                r.inv_T, r.w = 1.0, 0.0
                continue
            t = processing_time_s(p.grad1, p.decode_token_time_s, r.prompt, r.pred_tokens)
            r.inv_T = 1.0 / t
            r.w = r.inv_T / r.pred_tokens
        self.requests = prep.requests
        ctx = PolicyContext(p, self.m, seed=seed)
        self.sim = ClusterSimulator(p, self.m, RoundRobin(ctx), action_interval_s=self.action_interval_s)
        self.sim.track_penalty = True
        self._gen = self.sim.steps(prep.requests)
        self._head = next(self._gen)
        self._t = self.sim.now
        self._integral = self.sim.penalty_integral
        self._finished = 0
        self.holds = 0
        self.decisions = 0
        return self._obs(), {"time": self._t}

    def step(self, action: int):
        sim = self.sim
        m = self.m
        a = int(action)
        if not 0 <= a <= m:
            raise ValueError(f"action {action!r} outside 0..{m}")
        h = 0.0
        if a < m and self.shaping_weight:
            head = self._head
            scores = []
            for v in sim.view(sim.now).instances:
                s = v.load_summary()
                scores.append(r_mixing_from_load(self.profile, s.residents, s.sum_prompt_and_predicted,
                                                 head.prompt, head.pred_tokens, self.mixing))
            h = scores[a] - max(scores)
        self.decisions += 1
        if a == m:
            self.holds += 1
        terminated = False
        try:
            self._head = self._gen.send(None if a == m else a)
        except StopIteration as stop:
            self.run = stop.value
            terminated = True
        now = sim.now
        dt = now - self._t
        self._t = now
        done = sim.finished - self._finished
        self._finished = sim.finished
        # The penalty is integrated over simulated time by the simulator, so stretches
        # without decisions (an empty queue, the final drain) are charged too.
        penalty = sim.penalty_integral - self._integral
        self._integral = sim.penalty_integral
        r_cfg = self.reward_cfg
        bonus = 0.0 if r_cfg.counts_requests else r_cfg.r_w * done
        reward = -penalty / r_cfg.step_s + bonus + self.shaping_weight * h
        obs = np.zeros(self.observation_space.shape, dtype=np.float32) if terminated else self._obs()
        return obs, float(reward), terminated, False, {"time": now, "dt": dt, "completed": done, "h": h}
