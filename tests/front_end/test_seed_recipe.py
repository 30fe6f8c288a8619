"""The seed document's recipe for a PyTorch script (001: ``smp.init()``, ``smp.DistributedModel``,
``smp.DistributedOptimizer``, a ``@smp.step`` function that calls ``model.backward(loss)``, ``reduce_mean()`` of its
microbatches' losses, ``optimizer.step()`` outside it, a ``DataLoader`` with ``drop_last=True``, the data sharded
when ``smp.dp_size() > 1``) trains a convolutional classifier as the same loop in PyTorch, with Adadelta at the
seed's lr 4.0: with the default configuration and with the seed's second example, two pipeline stages cut by hand
(``with smp.partition(i):`` around the layers ``__init__`` creates) and 4 microbatches.

float32 throughout: the losses and weights differ by reduction order only (rtol 1e-5).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jmp as smp

BATCH, STEPS = 64, 2


class Digits(nn.Module):
    """Convolutions, max pooling and two linear layers, log-probabilities of 10 classes (16x16 images)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3)
        self.conv2 = nn.Conv2d(4, 8, 3)
        self.fc1 = nn.Linear(8 * 6 * 6, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = torch.flatten(F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2), 1)
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


class StagedDigits(Digits):
    """``Digits`` with its convolutions created on stage 0 and its linear layers on stage 1."""

    def __init__(self):
        nn.Module.__init__(self)
        with smp.partition(0):
            self.conv1 = nn.Conv2d(1, 4, 3)
            self.conv2 = nn.Conv2d(4, 8, 3)
        with smp.partition(1):
            self.fc1 = nn.Linear(8 * 6 * 6, 32)
            self.fc2 = nn.Linear(32, 10)


@smp.step
def train_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="mean")
    model.backward(loss)
    return output, loss


def loader() -> torch.utils.data.DataLoader:
    """``STEPS`` full batches and a short one that ``drop_last`` leaves out."""
    generator = torch.Generator().manual_seed(0)
    rows = STEPS * BATCH + 5
    images = torch.randn(rows, 1, 16, 16, generator=generator)
    labels = torch.randint(0, 10, (rows,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=BATCH, drop_last=True)


def pytorch_losses(module: nn.Module) -> list[float]:
    optimizer = torch.optim.Adadelta(module.parameters(), lr=4.0)
    losses = []
    for data, target in loader():
        optimizer.zero_grad()
        loss = F.nll_loss(module(data), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "config, net",
    [
        ({}, Digits),
        (
            {"pipeline_parallel_degree": 2, "microbatches": 4, "auto_partition": False, "default_partition": 0},
            StagedDigits,
        ),
    ],
    ids=["default", "manual-partition-pp2"],
)
def test_the_seed_recipe_trains_as_pytorch(config, net):
    smp.init(config)
    assert smp.dp_size() == 1  # one process loads the whole batch: the seed's sharding branch is not taken
    module = net()
    reference = copy.deepcopy(module)
    optimizer = torch.optim.Adadelta(module.parameters(), lr=4.0)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(optimizer)
    model.train()
    losses = []
    for data, target in loader():
        optimizer.zero_grad()
        _, loss_mb = train_step(model, data, target)
        losses.append(float(loss_mb.reduce_mean()))
        optimizer.step()

    np.testing.assert_allclose(losses, pytorch_losses(reference), rtol=1e-5)
    trained, held = model.state_dict(), model.module.state_dict()  # the torch module holds the weights when read
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(trained[name], value, rtol=1e-5, atol=1e-6)
        assert torch.equal(held[name], trained[name]), name
    assert all(int(s["step"]) == STEPS for s in optimizer.state_dict()["state"].values())
    if config.get("pipeline_parallel_degree"):
        stages = model.pipeline.layout.stages
        assert {n: stages[n][0] for n in ("conv1.weight", "conv2.bias", "fc1.weight", "fc2.bias")} == {
            "conv1.weight": 0,
            "conv2.bias": 0,
            "fc1.weight": 1,
            "fc2.bias": 1,
        }
