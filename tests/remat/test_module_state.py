"""Module state through checkpoints: buffers update once per step, in-place input changes show, as in PyTorch."""

import copy

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import jmp as smp
from jmp.patches.checkpoint import checkpoint
from tests.front_end.helpers import named_grads
from tests.helpers import assert_close


class Counter(nn.Module):
    """A generic module (own forward) that updates a buffer in place."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return self.fc(x) * 1.5


class Doubler(nn.Module):
    def forward(self, x):
        x.mul_(2)  # changes the caller's tensor
        return x + 1


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.ReLU())
        self.counter = Counter()
        self.doubler = Doubler()

    def forward(self, x):
        h = self.stem(x)
        h = checkpoint(self.counter, h)
        doubled = checkpoint(self.doubler, h)
        return doubled + h  # h was doubled in place


@smp.step
def train_step(model, x, y):
    loss = F.mse_loss(model(x), y)
    model.backward(loss)
    return loss


def test_buffers_update_once_per_step_and_gradients_match_torch():
    smp.init()
    net = Net()
    reference = copy.deepcopy(net)
    model = smp.DistributedModel(net)
    smp.set_activation_checkpointing(model.module.stem)
    x, y = torch.randn(16, 6), torch.randn(16, 6)
    for _ in range(2):
        train_step(model, x, y)
    reference.zero_grad()
    for _ in range(2):
        F.mse_loss(reference(x), y).backward()  # plain PyTorch: checkpoint runs the modules
    state = model.state_dict()
    assert int(state["counter.calls"]) == 2
    assert int(state["stem.1.num_batches_tracked"]) == 2
    np.testing.assert_allclose(state["stem.1.running_var"], reference.stem[1].running_var, rtol=1e-5)
    grads = named_grads(model.grads)  # accumulated over the two steps, as torch's .grad
    largest = max(float(p.grad.abs().max()) for p in reference.parameters())
    for name, parameter in reference.named_parameters():  # (the bias before the norm has a zero gradient: noise)
        assert_close(grads[name], parameter.grad, 1e-5, floor=0.1 * largest)
