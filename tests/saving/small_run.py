"""A small MLP run for the checkpoint API tests, and exact comparison of what a run holds."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import jmp as smp

IN, HIDDEN, OUT = 8, 16, 4


def mlp(hidden: int = HIDDEN, extra_layer: bool = False) -> nn.Sequential:
    layers = [nn.Linear(IN, hidden), nn.ReLU(), nn.Linear(hidden, OUT)]
    if extra_layer:
        layers += [nn.ReLU(), nn.Linear(OUT, OUT)]
    return nn.Sequential(*layers)


@smp.step
def train_step(model, data, target):
    loss = F.cross_entropy(model(data), target)
    model.backward(loss)
    return loss


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(16, IN, generator=generator), torch.randint(0, OUT, (16,), generator=generator)


@dataclass
class Run:
    model: Any
    optimizer: Any = None


def build(module: nn.Module, with_optimizer: bool = True) -> Run:
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2)) if with_optimizer else None
    return Run(model, optimizer)


def train(run: Run, seed: int) -> float:
    run.optimizer.zero_grad()
    loss = train_step(run.model, *batch(seed))
    run.optimizer.step()
    return float(loss.reduce_mean())


def state_of(run: Run) -> tuple[dict, dict | None]:
    model = {name: tensor.clone() for name, tensor in run.model.state_dict().items()}
    optimizer = copy.deepcopy(run.optimizer.state_dict()) if run.optimizer is not None else None
    return model, optimizer


def assert_same(actual: Any, expected: Any, where: str = "") -> None:
    """Equal, tensors exactly (torch.equal), through dicts, lists and tuples."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and torch.equal(actual, expected), f"{where} differs"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), f"{where} keys differ"
        for key, value in expected.items():
            assert_same(actual[key], value, f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), f"{where} differs"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"
