"""Does the RL reward rank routing policies the way their latencies do?

Runs fixed policies through ``routerd.rl.env.RoutingEnv`` (training part of public-mix,
20 req/s, 4 x llama2-7b-v100, 1,000 requests) and prints each one's undiscounted
return beside its mean E2E latency, makespan and preemptions. A reward worth learning
from should rank the better-latency policies higher.

Usage: python benchmarks/reward_check.py [--variant baseline] [--seeds 2]
"""

from __future__ import annotations

import argparse

from routerd.policies.base import PolicyContext
from routerd.policies.registry import build_policy
from routerd.profiles import get_profile
from routerd.rl import splits
from routerd.rl.env import RoutingEnv
from routerd.rl.reward import RewardConfig
from routerd.sim.report import summarize


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="baseline")
    ap.add_argument("--seeds", type=int, default=2)
    a = ap.parse_args()
    prof = get_profile("llama2-7b-v100")
    for name in ("round_robin", "join_shortest_queue", "late_binding", "max_capacity_usage"):
        for seed in range(a.seeds):
            env = RoutingEnv(prof, 4, lambda s: splits.sample("public-mix", "train", s, 1000, 20.0),
                             RewardConfig(a.variant))
            env.reset(seed=seed)
            pol = build_policy(name, None, PolicyContext(prof, 4, seed=seed))
            ret, done = 0.0, False
            while not done:
                _, r, done, _, _ = env.step(env.action_of(pol))
                ret += r
            s = summarize(env.run)
            print(f"{name:22} seed {seed} return {ret:12.0f}  e2e {s.e2e_mean:6.2f} s  makespan {s.makespan:6.1f} s"
                  f"  preemptions {s.preemptions}  decisions {env.decisions}")


if __name__ == "__main__":
    main()
