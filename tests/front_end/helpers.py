"""A small model, data, and a plain PyTorch training loop to compare the front end with."""

from __future__ import annotations

import copy

import jax
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import jmp as smp


class SmallNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 5)

    def forward(self, x):
        return self.fc2(F.gelu(self.norm(self.fc1(x))))


def batches(count: int, batch: int = 32, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, 10, generator=generator), torch.randint(0, 5, (batch,), generator=generator))
        for _ in range(count)
    ]


def torch_losses(module: nn.Module, make_optimizer, data, make_scheduler=None) -> list[float]:
    """A copy of ``module`` trained on ``data`` by a fresh torch optimizer: the loss of each step."""
    module = copy.deepcopy(module)
    optimizer = make_optimizer(module)
    return torch_train(module, optimizer, data, make_scheduler(optimizer) if make_scheduler else None)


def torch_train(module: nn.Module, optimizer, data, scheduler=None) -> list[float]:
    """Plain PyTorch training of ``module`` in place: the loss of each step."""
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = F.cross_entropy(module(x), y)
        loss.backward()
        optimizer.step()
        if scheduler:
            scheduler.step()
        losses.append(loss.item())
    return losses


@smp.step
def train_step(model, data, target):
    """The seed's step function, with cross-entropy."""
    output = model(data)
    loss = F.cross_entropy(output, target)
    model.backward(loss)
    return output, loss


def named_grads(grads) -> dict[str, np.ndarray]:
    """Gradients of a DistributedModel (an nnx.State) by torch parameter name."""
    return {
        ".".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]
    }


_COMPILES = [0]


def _count(name: str, *_args, **_kwargs) -> None:
    if name == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count)


def compilations() -> int:
    """XLA compilations so far in this process."""
    return _COMPILES[0]
