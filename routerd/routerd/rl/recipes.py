"""Named training presets (``phasewise train --recipe``): plain dicts of
:class:`routerd.rl.train.Args` fields, importable without torch or gymnasium."""

from __future__ import annotations

import re

RECIPES: dict[str, dict] = {
    "paper": dict(episodes=30, explore_episodes=20, select_samples=2, select_from=0),
    "bc": dict(episodes=6, explore_episodes=3, eps_start=0.1, eps_end=0.02, learning_rate=1e-4,
               demo_policy="late_binding", demo_episodes=12, pretrain_steps=12_000,
               pretrain_learning_rate=1e-3, pretrain_loss="cross-entropy", select_samples=3, select_from=0),
}
"""Named :class:`Args` presets (``phasewise train --recipe``; benchmarks/rl_train_table.py).

* ``paper``: the paper's Double DQN: 30 episodes, epsilon 1.0 -> 0.05 ending at episode
  20; the saved weights are the episode with the lowest greedy mean E2E latency on 2
  training-part validation samples.
* ``bc``: behaviour cloning, then RL: 12 episodes routed by ``late_binding`` as
  demonstrations, 12,000 cross-entropy steps at lr 1e-3 on them, then 6 RL episodes at
  lr 1e-4 (epsilon 0.1 -> 0.02) with the demonstration margin loss; the saved weights
  are the best of pre-trained and every episode on 3 validation samples. The shipped
  default checkpoint was made with it (docs/rl.md).
"""


RUN_NAME = re.compile(r"^(?P<recipe>[a-z0-9_]+)-(?P<variant>[a-z-]+)-m(?P<m>[0-9]+)-s(?P<seed>[0-9]+)$")
"""Folder names of table runs (:func:`run_name`), as benchmarks/rl_eval.py ``--table-dir`` reads them."""


def run_name(recipe: str, variant: str, m: int, seed: int) -> str:
    """Folder name of one training run of the RL table (``paper-workload-guided-m4-s0``)."""
    return f"{recipe}-{variant}-m{m}-s{seed}"
