"""Double-DQN trainer for the router, readable top to bottom (after CleanRL's ``dqn.py``).

``phasewise train`` calls :func:`train`. Hyperparameters the paper gives: layers
(obs, 64), (64, 64), (64, m + 1) with ReLU, batch 512, exploration ending by episode 20,
r_w = 60, alpha = 0.5, beta_d = 0.5, an action every 0.02 s (arXiv 2408.13510 A.9).
The rest are ours, chosen before any evaluation and exposed in :class:`Args`:
gamma 0.998 per 0.02 s of simulated time (a semi-MDP discount, so the horizon is about
10 s however many decisions fall in it), Adam with learning rate 5e-4, replay buffer 100,000 transitions, a hard
target-network update every 1,000 steps, a gradient step every 4 environment steps
after 2,000 warm-up steps, Huber loss, rewards scaled by 0.01, gradient norm clip 10.

Learning from demonstrations (DQfD, Hester et al. 2018, "Deep Q-learning from
Demonstrations", AAAI; our addition, off when ``demo_policy`` is None): before the first
episode, ``demo_episodes`` training episodes are routed by a heuristic (``late_binding``,
the best of the foundation issue) and kept in a separate demonstration buffer; the
network is pre-trained on it for ``pretrain_steps`` gradient steps with the TD loss plus
DQfD's large-margin loss ``max_a [Q(s, a) + l(a_E, a)] - Q(s, a_E)`` (``l`` = ``demo_margin``
for a != a_E, weight ``demo_weight``); during RL every minibatch draws ``demo_fraction``
of its transitions from that buffer, with the margin loss on those. Without it, every
variant learned to hold 60-90% of requests without targeting the holds and lost
15-45% mean E2E to round robin on held-out samples (docs/rl.md).

Model selection: after pre-training and after every episode from ``select_from`` on, the
greedy network is run on ``select_samples`` validation samples drawn from the training part
(indices ``SELECT_INDEX_BASE + i``, never used as training episodes, never the held-out
part) and the weights with the lowest mean E2E latency are the ones saved.
"""

from __future__ import annotations

import copy
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import numpy as np

from routerd.policies.base import PolicyContext
from routerd.policies.dqn.checkpoint import save_checkpoint
from routerd.policies.dqn.features import obs_dim
from routerd.policies.round_robin import RoundRobin
from routerd.profiles import get_profile
from routerd.rl import splits
from routerd.rl.env import RoutingEnv
from routerd.rl.qnet import build_torch_qnet
from routerd.rl.reward import REWARD_VARIANTS, RewardConfig
from routerd.sim import ClusterSimulator, prepare_requests
from routerd.sim.report import summarize


@dataclass
class Args:
    """Everything a training run depends on (recorded in the checkpoint)."""

    variant: str = "workload-guided"
    """Reward variant: baseline, workload-aware or workload-guided."""
    workload: str = "public-mix"
    """Training workload (its training part only; see routerd.rl.splits)."""
    profile: str = "llama2-7b-v100"
    instances: int = 4
    episodes: int = 30
    """Training episodes; exploration ends at ``explore_episodes``."""
    requests_per_episode: int = 1000
    rate: float | None = 20.0
    """Arrival rate (req/s) of the episodes; None keeps a trace's own rate."""
    seed: int = 0
    output: str = "checkpoints/dqn"
    prediction: str = "true"
    gamma: float = 0.998
    """Discount per ``step_s`` (0.02 s) of simulated time."""
    learning_rate: float = 5e-4
    buffer_size: int = 100_000
    batch_size: int = 512
    learning_starts: int = 2_000
    train_frequency: int = 4
    target_update_steps: int = 1_000
    eps_start: float = 1.0
    eps_end: float = 0.05
    explore_episodes: int = 20
    reward_scale: float = 0.01
    hidden: int = 64
    r_w: float = 60.0
    beta_d: float = 0.5
    alpha: float = 0.5
    mix_epsilon: float = 0.1
    potential_shaping: float = 0.0
    """Weight ``c`` of potential-based shaping (Ng et al. 1999) with Phi(s) = -c * P(s),
    P the penalty rate (per step_s) at the decision: adds gamma^dt * Phi(s') - Phi(s) to
    each reward. It leaves the optimal policy unchanged and centres the values, which
    are otherwise dominated by the size of the backlog. 0 disables it."""
    guide_policy: str | None = None
    """Heuristic whose action replaces a random one in ``guide_mix`` of exploratory steps
    (policy spec, e.g. ``late_binding``); None explores uniformly as in the paper."""
    guide_mix: float = 0.5
    demo_policy: str | None = None
    """Heuristic demonstrating the task (policy spec, e.g. ``late_binding``) for DQfD
    pre-training and the demonstration share of each minibatch; None: plain Double DQN."""
    demo_episodes: int = 6
    """Training episodes routed by ``demo_policy`` into the demonstration buffer."""
    pretrain_steps: int = 3_000
    """Gradient steps on demonstrations alone before the first RL episode."""
    pretrain_learning_rate: float = 1e-3
    """Adam learning rate of the pre-training steps (the RL phase uses ``learning_rate``)."""
    pretrain_loss: str = "dqfd"
    """``dqfd`` (TD + large-margin loss) or ``cross-entropy`` (behaviour cloning: the
    outputs trained as logits of the demonstrated action)."""
    demo_margin: float = 0.8
    """DQfD's margin l(a_E, a) for actions other than the demonstrated one (in Q units,
    after ``reward_scale``)."""
    demo_weight: float = 1.0
    """Weight of the large-margin loss against the TD loss."""
    demo_fraction: float = 0.25
    """Share of each RL minibatch drawn from the demonstration buffer (0..1)."""
    select_samples: int = 0
    """Validation samples (from the training part) for picking the saved weights; 0 saves
    the last weights."""
    select_from: int = 0
    """First episode after which the greedy network is validated (with ``select_samples``)."""
    eval_episodes: int = 3
    """Held-out samples for the evaluation figures stored in the checkpoint."""
    torch_threads: int = 1
    data_dir: str | None = None
    extra: dict = field(default_factory=dict)


SELECT_INDEX_BASE = splits.VALIDATION_INDEX_BASE
"""Training-part sample indices used for model selection, disjoint from training episodes
(which use ``seed * 10_000 + episode``) and from demonstrations (``DEMO_INDEX_BASE + i``)."""
DEMO_INDEX_BASE = 800_000


class ReplayBuffer:
    """Fixed-size ring buffer of transitions (numpy)."""

    def __init__(self, size: int, obs: int, rng: np.random.Generator) -> None:
        self.obs = np.zeros((size, obs), np.float32)
        self.next_obs = np.zeros((size, obs), np.float32)
        self.actions = np.zeros(size, np.int64)
        self.rewards = np.zeros(size, np.float32)
        self.dones = np.zeros(size, np.float32)
        self.steps = np.zeros(size, np.float32)  # elapsed time in units of step_s
        self.size, self.pos, self.full, self.rng = size, 0, False, rng

    def add(self, o, a, r, o2, d, k) -> None:
        i = self.pos
        self.obs[i], self.actions[i], self.rewards[i], self.next_obs[i], self.dones[i] = o, a, r, o2, d
        self.steps[i] = k
        self.pos = (i + 1) % self.size
        self.full = self.full or self.pos == 0

    def sample(self, n: int):
        idx = self.rng.integers(0, self.size if self.full else self.pos, n)
        return (self.obs[idx], self.actions[idx], self.rewards[idx], self.next_obs[idx], self.dones[idx],
                self.steps[idx])


def epsilon_for(args: Args, episode: int) -> float:
    """Linear decay from eps_start to eps_end over the exploration episodes, then greedy."""
    if episode >= args.explore_episodes:
        return 0.0
    frac = episode / max(1, args.explore_episodes - 1)
    return args.eps_start + frac * (args.eps_end - args.eps_start)


def collect_demonstrations(env: RoutingEnv, policy_spec: str, episodes: int, seed: int, reward_scale: float,
                           buffer: ReplayBuffer, log: Callable[[str], None]) -> None:
    """Route ``episodes`` training episodes with heuristic ``policy_spec`` and store every
    transition (scaled reward) in ``buffer``; the demonstrated action is the stored action."""
    from routerd.policies.registry import build_policy_from_spec

    for i in range(episodes):
        index = DEMO_INDEX_BASE + seed * 1_000 + i
        guide = build_policy_from_spec(policy_spec, PolicyContext(env.profile, env.m, seed=index))
        if guide.oracle:
            # The agent never sees true lengths, so it cannot learn from a policy that does.
            raise ValueError(f"demo_policy {policy_spec!r} is an oracle (it reads true output lengths); "
                             f"demonstrations must come from a policy that sees what the agent sees")
        obs, _ = env.reset(seed=index)
        done = False
        while not done:
            action = env.action_of(guide)
            next_obs, r, done, _, info = env.step(action)
            buffer.add(obs, action, r * reward_scale, next_obs, float(done), info["dt"] / env.reward_cfg.step_s)
            obs = next_obs
        log(f"demonstration {i}: {policy_spec}, {env.decisions} decisions, hold rate "
            f"{env.holds / max(1, env.decisions):.2f}, mean E2E {summarize(env.run).e2e_mean:.2f}s")


def large_margin_loss(q, actions, margin: float):
    """DQfD's supervised loss (Hester et al. 2018, eq. 2), batch mean:
    ``max_a [Q(s, a) + l(a_E, a)] - Q(s, a_E)`` with ``l = margin`` for ``a != a_E``, else 0.

    ``q``: (B, A) tensor; ``actions``: (B,) int64 demonstrated actions."""
    import torch

    l = torch.full_like(q, margin)
    l.scatter_(1, actions.unsqueeze(1), 0.0)
    return ((q + l).max(dim=1).values - q.gather(1, actions.unsqueeze(1)).squeeze(1)).mean()


def simulate(profile, m: int, make_policy, requests, prediction: str, seed: int):
    """Summary (:class:`routerd.sim.report.Summary`) of ``make_policy(PolicyContext)``
    routing ``requests`` on ``m`` instances, predictions prepared with ``seed``."""
    prep = prepare_requests(requests, profile, prediction=prediction, seed=seed)
    return summarize(ClusterSimulator(profile, m, make_policy(PolicyContext(profile, m, seed=seed))).run(prep.requests))


def greedy_e2e(weights, profile, m: int, args: Args, part: str, indices) -> float:
    """Mean E2E latency (s) of the greedy network over workload samples ``indices`` of ``part``."""
    from routerd.policies.dqn.policy import DQNPolicy

    return statistics.mean(
        simulate(profile, m, lambda c: DQNPolicy(c, weights=weights),
                 splits.sample(args.workload, part, i, args.requests_per_episode, args.rate, args.data_dir),
                 args.prediction, i).e2e_mean
        for i in indices)


def round_robin_e2e(profile, m: int, requests, prediction: str, seed: int) -> float:
    """Mean E2E latency (s) of round robin on ``requests`` (the per-episode reference)."""
    return simulate(profile, m, RoundRobin, requests, prediction, seed).e2e_mean


def check_sample_indices(args: Args) -> None:
    """Refuse a seed outside numpy's range, or one whose training, demonstration and
    validation sample indices overlap (e.g. seed 90: training episode ``e`` is validation
    sample ``e``; seed 100: demonstration ``i`` is validation sample ``i``)."""
    if not 0 <= args.seed < 2**32:
        raise ValueError(f"seed must be in 0..2**32-1, got {args.seed}")
    parts = {"training episodes": range(args.seed * 10_000, args.seed * 10_000 + args.episodes)}
    if args.demo_policy:
        start = DEMO_INDEX_BASE + args.seed * 1_000
        parts["demonstrations"] = range(start, start + args.demo_episodes)
    if args.select_samples:
        parts["validation samples"] = range(SELECT_INDEX_BASE, SELECT_INDEX_BASE + args.select_samples)
    names = list(parts)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ra, rb = parts[a], parts[b]
            if ra and rb and ra.start < rb.stop and rb.start < ra.stop:
                raise ValueError(f"seed {args.seed}: the {a} (samples {ra.start}..{ra.stop - 1}) overlap the {b} "
                                 f"(samples {rb.start}..{rb.stop - 1}) of the training part; use another seed")


def train(args: Args, log: Callable[[str], None] = print, progress: bool = True) -> Path:
    """Train a Double DQN and write a checkpoint folder to ``args.output``; returns its path.

    Raises:
        ValueError: unknown variant or bad numbers; routerd.profiles.ProfileError;
            routerd.workloads.WorkloadError.
    """
    import torch
    import torch.nn.functional as F

    if args.variant not in REWARD_VARIANTS:
        raise ValueError(f"unknown variant {args.variant!r}; valid: {', '.join(REWARD_VARIANTS)}")
    if args.instances < 1 or args.episodes < 1 or args.requests_per_episode < 1:
        raise ValueError("instances, episodes and requests_per_episode must be >= 1")
    if args.pretrain_loss not in ("dqfd", "cross-entropy"):
        raise ValueError(f"pretrain_loss must be 'dqfd' or 'cross-entropy', got {args.pretrain_loss!r}")
    if not 0.0 <= args.demo_fraction < 1.0:
        raise ValueError(f"demo_fraction must be in [0, 1), got {args.demo_fraction}")
    check_sample_indices(args)
    # The held-out evaluation runs last: a held-out part too short for an episode must
    # fail now, not after training with nothing saved.
    splits.sample(args.workload, "eval", 0, args.requests_per_episode, args.rate, args.data_dir)
    t_start = time.perf_counter()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.torch_threads)
    profile = get_profile(args.profile)
    m = args.instances
    reward = RewardConfig(args.variant, r_w=args.r_w, gamma=args.gamma, beta_d=args.beta_d,
                          alpha=args.alpha, epsilon=args.mix_epsilon)
    n, rate = args.requests_per_episode, args.rate

    def workload_fn(index: int):
        return splits.sample(args.workload, "train", index, n, rate, args.data_dir)

    env = RoutingEnv(profile, m, workload_fn, reward, prediction=args.prediction)
    q_net = build_torch_qnet(obs_dim(m), m + 1, args.hidden)
    target = copy.deepcopy(q_net)
    opt = torch.optim.Adam(q_net.parameters(), lr=args.learning_rate)
    rb = ReplayBuffer(args.buffer_size, obs_dim(m), np.random.default_rng(args.seed))
    rng = random.Random(args.seed)

    def td_loss(batch, gamma_k: float):
        o, a, rr, o2, d, k = (torch.from_numpy(x) for x in batch)
        with torch.no_grad():
            # Double DQN: the online network picks, the target network evaluates.
            a2 = q_net(o2).argmax(dim=1, keepdim=True)
            # Discount per step_s of simulated time (a semi-MDP): decisions at the
            # same instant do not discount each other.
            y = rr + torch.pow(gamma_k, k) * (1.0 - d) * target(o2).gather(1, a2).squeeze(1)
        q_all = q_net(o)
        return F.smooth_l1_loss(q_all.gather(1, a.unsqueeze(1)).squeeze(1), y), q_all, a

    def gradient_step(loss) -> None:
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(q_net.parameters(), 10.0)
        opt.step()

    def snapshot() -> dict:
        return {k: v.detach().cpu().numpy().copy() for k, v in q_net.state_dict().items()}

    select_idx = [SELECT_INDEX_BASE + i for i in range(args.select_samples)]
    best: tuple[float, dict, str] | None = None

    def consider(label: str) -> None:
        nonlocal best
        if not select_idx:
            return
        w = snapshot()
        e2e = greedy_e2e(w, profile, m, args, "train", select_idx)
        log(f"selection: {label} greedy mean E2E {e2e:.2f}s on {len(select_idx)} validation samples"
            f"{' (best so far)' if best is None or e2e < best[0] else ''}")
        if best is None or e2e < best[0]:
            best = (e2e, w, label)

    demo = None
    n_demo = 0
    if args.demo_policy:
        demo = ReplayBuffer(args.buffer_size, obs_dim(m), np.random.default_rng(args.seed + 1))
        collect_demonstrations(env, args.demo_policy, args.demo_episodes, args.seed, args.reward_scale, demo, log)
        gamma0 = reward.discount(0)
        for group in opt.param_groups:
            group["lr"] = args.pretrain_learning_rate
        for step in range(1, args.pretrain_steps + 1):
            batch = demo.sample(args.batch_size)
            if args.pretrain_loss == "cross-entropy":
                gradient_step(F.cross_entropy(q_net(torch.from_numpy(batch[0])), torch.from_numpy(batch[1])))
                continue
            loss, q_all, a = td_loss(batch, gamma0)
            gradient_step(loss + args.demo_weight * large_margin_loss(q_all, a, args.demo_margin))
            if step % args.target_update_steps == 0:
                target.load_state_dict(q_net.state_dict())
        target.load_state_dict(q_net.state_dict())
        for group in opt.param_groups:
            group["lr"] = args.learning_rate
        n_demo = int(round(args.batch_size * args.demo_fraction))
        log(f"pre-trained {args.pretrain_steps} steps on {demo.pos if not demo.full else demo.size} "
            f"demonstrated transitions")
        consider("pre-trained")
    guide = None
    if args.guide_policy:
        from routerd.policies.registry import build_policy_from_spec

        guide = build_policy_from_spec(args.guide_policy, PolicyContext(profile, m, seed=args.seed))
    global_step = 0
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=args.episodes, desc=f"train {args.variant}", unit="episode")
    history = []
    for episode in range(args.episodes):
        env.set_episode(episode)
        eps = epsilon_for(args, episode)
        gamma_k = reward.discount(episode)
        ep_index = args.seed * 10_000 + episode
        obs, _ = env.reset(seed=ep_index)
        ep_return, done = 0.0, False
        phi = -args.potential_shaping * env.sim.penalty_rate(env.sim.now)
        while not done:
            if rng.random() < eps:
                if guide is not None and rng.random() < args.guide_mix:
                    action = env.action_of(guide)
                else:
                    action = rng.randrange(m + 1)
            else:
                with torch.no_grad():
                    action = int(q_net(torch.from_numpy(obs)).argmax())
            next_obs, r, done, _, info = env.step(action)
            ep_return += r
            k = info["dt"] / reward.step_s
            if args.potential_shaping:
                phi2 = 0.0 if done else -args.potential_shaping * env.sim.penalty_rate(env.sim.now)
                r += (gamma_k ** k) * phi2 - phi
                phi = phi2
            rb.add(obs, action, r * args.reward_scale, next_obs, float(done), k)
            obs = next_obs
            global_step += 1
            if global_step > args.learning_starts and global_step % args.train_frequency == 0:
                loss, _, _ = td_loss(rb.sample(args.batch_size - n_demo), gamma_k)
                if n_demo:
                    d_loss, q_all, a = td_loss(demo.sample(n_demo), gamma_k)
                    share = n_demo / args.batch_size
                    loss = (1 - share) * loss + share * d_loss + args.demo_weight * large_margin_loss(
                        q_all, a, args.demo_margin)
                gradient_step(loss)
            if global_step % args.target_update_steps == 0:
                target.load_state_dict(q_net.state_dict())
        s = summarize(env.run)
        rr_e2e = round_robin_e2e(profile, m, workload_fn(ep_index), args.prediction, ep_index)
        rec = {"episode": episode, "return": ep_return, "epsilon": eps, "steps": env.decisions,
               "hold_rate": env.holds / max(1, env.decisions), "e2e_mean": s.e2e_mean,
               "rr_e2e_mean": rr_e2e, "e2e_vs_rr_pct": 100.0 * (s.e2e_mean - rr_e2e) / rr_e2e,
               "makespan": s.makespan, "preemptions": s.preemptions}
        history.append(rec)
        log(f"episode {episode:3d} return {ep_return:12.1f} eps {eps:.2f} steps {env.decisions:6d} "
            f"hold {rec['hold_rate']:.2f} e2e {s.e2e_mean:7.2f}s vs RR {rec['e2e_vs_rr_pct']:+6.1f}% "
            f"preempt {s.preemptions}")
        if bar is not None:
            bar.update(1)
        if episode >= args.select_from:
            consider(f"episode {episode}")
    if bar is not None:
        bar.close()
    weights = snapshot() if best is None else best[1]
    selected = "last episode" if best is None else best[2]
    train_s = time.perf_counter() - t_start
    evaluation = evaluate_weights(weights, profile, m, args)
    meta = {
        "variant": args.variant, "num_instances": m, "obs_dim": obs_dim(m), "hidden": args.hidden,
        "profile": profile.name, "workload": {"name": args.workload, "part": "train",
                                              "requests_per_episode": n, "rate": rate},
        "hyperparameters": {k: v for k, v in asdict(args).items() if k not in ("output", "data_dir", "extra")},
        "training": {"seconds": train_s, "steps": global_step, "history": history, "selected": selected,
                     "selection_e2e_mean": None if best is None else best[0]},
        "evaluation": evaluation,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    path = save_checkpoint(args.output, weights, meta)
    log(f"trained in {train_s:.0f} s ({global_step} steps; saved weights: {selected}); held-out mean E2E vs RR "
        f"{evaluation['e2e_vs_rr_pct_mean']:+.1f}%, vs {BEST_HEURISTIC} {evaluation['e2e_vs_heuristic_pct_mean']:+.1f}%; "
        f"wrote {path}")
    return path


BEST_HEURISTIC = "late_binding"
"""The foundation issue's best heuristic on the policy table (docs/results.md); the
evaluation stored in a checkpoint compares against it as well as round robin."""


def evaluate_weights(weights, profile, m: int, args: Args) -> dict:
    """Greedy policy vs round robin and vs :data:`BEST_HEURISTIC` on ``args.eval_episodes``
    held-out samples (mean E2E latency and makespan in s, changes in %)."""
    from routerd.policies.dqn.policy import DQNPolicy
    from routerd.policies.registry import build_policy_from_spec

    def run(make, reqs, i):
        return simulate(profile, m, make, reqs, args.prediction, i)

    rows = []
    for i in range(args.eval_episodes):
        reqs = splits.sample(args.workload, "eval", i, args.requests_per_episode, args.rate, args.data_dir)
        s = run(lambda c: DQNPolicy(c, weights=weights), reqs, i)
        base = run(RoundRobin, reqs, i)
        heur = run(lambda c: build_policy_from_spec(BEST_HEURISTIC, c), reqs, i)
        rows.append({"sample": i, "e2e_mean": s.e2e_mean, "rr_e2e_mean": base.e2e_mean,
                     "heuristic_e2e_mean": heur.e2e_mean,
                     "makespan": s.makespan, "rr_makespan": base.makespan, "heuristic_makespan": heur.makespan,
                     "e2e_vs_rr_pct": 100 * (s.e2e_mean - base.e2e_mean) / base.e2e_mean,
                     "makespan_vs_rr_pct": 100 * (s.makespan - base.makespan) / base.makespan,
                     "e2e_vs_heuristic_pct": 100 * (s.e2e_mean - heur.e2e_mean) / heur.e2e_mean})
    return {"workload": args.workload, "part": "eval", "heuristic": BEST_HEURISTIC, "samples": rows,
            "e2e_vs_rr_pct_mean": statistics.mean(r["e2e_vs_rr_pct"] for r in rows),
            "makespan_vs_rr_pct_mean": statistics.mean(r["makespan_vs_rr_pct"] for r in rows),
            "e2e_vs_heuristic_pct_mean": statistics.mean(r["e2e_vs_heuristic_pct"] for r in rows)}


if __name__ == "__main__":  # pragma: no cover - use `phasewise train`
    import sys

    a = Args(episodes=int(sys.argv[1]) if len(sys.argv) > 1 else 30)
    train(a)
