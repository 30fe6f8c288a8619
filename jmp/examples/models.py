"""The seed scripts' ``GroupedNet``: a convolutional front (``net1``) and a linear back (``net2``), one per stage."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ConvGroup(nn.Module):
    """conv -> relu -> conv -> relu -> max_pool -> flatten (28x28x1 -> 9216)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        return torch.flatten(x, 1)


class DenseGroup(nn.Module):
    """dropout -> linear -> relu -> dropout -> linear -> log_softmax (9216 -> 10 log-probabilities)."""

    def __init__(self) -> None:
        super().__init__()
        self.dropout1 = nn.Dropout(0.25)
        self.fc1 = nn.Linear(9216, 128)
        self.dropout2 = nn.Dropout(0.5)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout1(x)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


class GroupedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = ConvGroup()
        self.net2 = DenseGroup()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.net1(x))
