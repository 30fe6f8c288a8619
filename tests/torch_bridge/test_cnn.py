"""The seed documents' CNNs, converted: forward outputs and gradients equal PyTorch's."""

import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jmp
from jmp.examples.models import GroupedNet
from tests.helpers import assert_close, assert_grad_parity, to_jax


class SeedCheckpointNet(nn.Module):
    """Seed 000, example 1 (without the checkpoint call)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = self.conv2(x)
        x = F.max_pool2d(x, 2)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = self.fc2(x)
        return F.log_softmax(x, 1)


class SeedSequentialNet(nn.Module):
    """Seed 000, example 2: an nn.Sequential CNN."""

    def __init__(self):
        super().__init__()
        self.seq = nn.Sequential(nn.Conv2d(1, 20, 5), nn.ReLU(), nn.Conv2d(20, 64, 5), nn.ReLU())

    def forward(self, x):
        return F.log_softmax(self.seq(x), 1)


def _images(batch=4):
    return torch.randn(batch, 1, 28, 28)


@pytest.mark.parametrize("model_class", [GroupedNet, SeedCheckpointNet, SeedSequentialNet])
def test_forward_and_gradients_match_torch(model_class):
    model = model_class().eval()  # GroupedNet's dropout off: deterministic parity
    images = _images()
    targets = torch.randint(0, 10, (4,))
    converted = jmp.torch_bridge.convert(model)

    assert_close(converted(to_jax(images)), model(images))

    def torch_loss(m):
        per_class = m(images).flatten(2).mean(-1) if model_class is SeedSequentialNet else m(images)
        return F.nll_loss(per_class, targets)

    def jax_loss(m):
        out = m(to_jax(images))
        per_class = out.reshape(out.shape[0], out.shape[1], -1).mean(-1)
        return -jnp.mean(jnp.take_along_axis(per_class, to_jax(targets)[:, None], axis=1))

    assert_grad_parity(model, converted, torch_loss, jax_loss)


def test_converted_tree_mirrors_torch_names():
    model = GroupedNet()
    converted = jmp.torch_bridge.convert(model)
    names = [name for name, _ in jmp.torch_bridge.named_variables(converted)]
    assert names == list(model.state_dict().keys())
    assert isinstance(converted.net1.conv1, jmp.torch_bridge.TorchModule)
    assert converted.net2.fc1.weight[...].shape == (128, 9216)  # torch's [out, in], not transposed
