"""What a checkpointed module returns comes back out of its checkpoint as it was, ``None``s included."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

import jmp as smp
from tests.front_end.helpers import named_grads
from tests.helpers import assert_close


class WithNone(nn.Module):
    """Returns a tuple holding a ``None``, as T5's blocks return ``(hidden, position_bias, None)``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        return torch.tanh(self.fc(x)), None, x * 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = WithNone()
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        hidden, nothing, doubled = self.block(x)
        assert nothing is None
        return self.head(hidden + doubled)


@smp.step
def train_step(model, x, y):
    loss = F.mse_loss(model(x), y)
    model.backward(loss)
    return loss


def test_a_none_in_a_checkpointed_modules_output_tuple_comes_back_and_gradients_match_torch():
    smp.init()
    net = Net()
    reference = copy.deepcopy(net)
    model = smp.DistributedModel(net)
    smp.set_activation_checkpointing(model.module.block)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    loss = train_step(model, x, y)
    expected = F.mse_loss(reference(x), y)
    expected.backward()
    assert_close(float(loss.reduce_mean()), float(expected), 1e-6)
    grads = named_grads(model.grads)
    for name, parameter in reference.named_parameters():
        assert_close(grads[name], parameter.grad.numpy(), 1e-5, floor=1e-6)
