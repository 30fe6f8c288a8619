"""Stochastic depth (a ``StochasticDepth`` module with torchvision's semantics, written here) in a train-mode
``@smp.step`` under sharded data parallelism. jmp draws its own masks, so they are read back from the step's logits
(``benchmarks.image_zoo``'s ``drop_path_masks``: exactly one combination of kept and dropped paths gives each row's
logits), and PyTorch in float64 under those masks is the reference for the loss and every gradient. Mode "row" draws
a mask per row; mode "batch" one for the whole batch, the same on every device. ``benchmarks/image_zoo.py`` does the
same with timm's ViT and ConvNeXt.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jmp as smp
from benchmarks.image_zoo import drop_path_masks, with_masks
from tests.front_end.helpers import named_grads
from tests.helpers import assert_close

ROWS, WIDTH, CLASSES = 16, 32, 5


class StochasticDepth(nn.Module):
    """Keeps its input with probability ``1 - p``, scaled by ``1 / (1 - p)``, per row (``mode="row"``) or for the
    whole batch (``"batch"``), drawn as torchvision's ``stochastic_depth`` draws it: a fresh ``torch.empty`` filled
    in place by ``bernoulli_`` and divided in place."""

    def __init__(self, p: float, mode: str):
        super().__init__()
        self.p, self.mode = p, mode

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = 1.0 - self.p
        shape = [x.shape[0]] + [1] * (x.ndim - 1) if self.mode == "row" else [1] * x.ndim
        noise = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(keep)
        if keep > 0.0:
            noise.div_(keep)
        return x * noise


class ResidualNet(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.stem = nn.Linear(12, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(3)
        )
        self.depth = nn.ModuleList(StochasticDepth(p, mode) for p in (0.2, 0.4, 0.6))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        h = self.stem(x)
        for block, drop in zip(self.blocks, self.depth):
            h = h + drop(block(h))
        return self.head(h)


@smp.step
def train_step(model, x, y):
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    model.backward(loss)
    return logits, loss


@pytest.mark.parametrize("mode", ["row", "batch"])
def test_each_row_trains_as_pytorch_under_the_masks_jmp_drew(mode):
    smp.init({"sharded_data_parallel_degree": 8})
    torch.manual_seed(0)
    net = ResidualNet(mode).train()
    initial = copy.deepcopy(net)
    model = smp.DistributedModel(net)
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(ROWS, 12, generator=generator), torch.randint(0, CLASSES, (ROWS,), generator=generator)
    logits, loss = train_step(model, x, y)
    masks, match, nearest = drop_path_masks(initial, x, logits.concat().detach().numpy())
    assert match < 1e-5 and nearest > 100 * match, (match, nearest)
    kept = [sum(mask) for mask in masks]
    if mode == "batch":
        assert all(len(set(mask)) == 1 for mask in masks), masks
    else:
        assert len(set(zip(*masks))) > 1 and 0 < sum(kept) < len(masks) * ROWS, masks  # rows drew their own
    reference = copy.deepcopy(initial).double()
    with_masks(reference, masks)
    expected = F.cross_entropy(reference(x.double()), y)
    expected.backward()
    np.testing.assert_allclose(float(loss.reduce_mean()), expected.item(), rtol=1e-5)
    grads = named_grads(model.grads)
    for name, parameter in reference.named_parameters():
        assert_close(grads[name], parameter.grad, rtol=1e-4)
