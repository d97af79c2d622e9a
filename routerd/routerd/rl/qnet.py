"""The trainable torch Q-network, same layout and tensor names as
:mod:`routerd.policies.dqn.network` (``l1``, ``l2``, ``l3``; arXiv 2408.13510 A.9.3)."""

from __future__ import annotations


def build_torch_qnet(obs: int, actions: int, hidden: int = 64):
    """The torch module (imports torch lazily): Linear-ReLU-Linear-ReLU-Linear."""
    import torch
    from torch import nn

    class QNetwork(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1 = nn.Linear(obs, hidden)
            self.l2 = nn.Linear(hidden, hidden)
            self.l3 = nn.Linear(hidden, actions)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))

    return QNetwork()
