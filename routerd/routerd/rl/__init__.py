"""Reinforcement learning for the router: environment, reward and Double-DQN trainer.

Needs the ``rl`` extra (torch, gymnasium) for training; the trained policy itself
(:mod:`routerd.policies.dqn`) runs with numpy only.
"""
