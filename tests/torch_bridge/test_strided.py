"""``as_strided`` (Longformer's overlapping chunks) and factories' ``size=`` keyword, against PyTorch."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch import nn

import jmp
from jmp.errors import LoweringError
from tests.helpers import assert_grad_parity, to_jax


class OverlappingChunks(nn.Module):
    """Longformer's ``_chunk``: windows of 2w rows overlapping by w, read through strides; then a score per chunk."""

    def __init__(self, width=4, window=2):
        super().__init__()
        self.window = window
        self.project = nn.Linear(width, width)

    def forward(self, x):
        hidden = self.project(x)
        hidden = hidden.view(hidden.size(0), hidden.size(1) // (2 * self.window), 2 * self.window, hidden.size(2))
        size = list(hidden.size())
        size[1] = size[1] * 2 - 1
        stride = list(hidden.stride())
        stride[1] = stride[1] // 2
        chunks = hidden.as_strided(size=size, stride=stride)
        scores = chunks * chunks.new_ones(size=(3,)).sum()  # factories' keyword form: 3, not a 0-d 1
        return (scores.sum(-1) ** 2).mean() + torch.ones(size=(2, 2)).sum()


def test_overlapping_chunks_equal_torch_with_gradients_under_jit():
    module = OverlappingChunks()
    x = torch.randn(2, 8, 4)
    converted = jmp.torch_bridge.convert(module)
    assert_grad_parity(module, converted, lambda m: m(x), lambda m: m(to_jax(x)))


def test_writing_through_a_strided_view_reaches_its_base():
    def fill(base):
        base.as_strided((2, 2), (3, 1), 1).mul_(10)
        return base

    expected = fill(torch.arange(9.0))
    with jmp.torch_bridge.dispatch.session():
        got = fill(jmp.torch_bridge.JaxTensor(jnp.arange(9.0)))
    np.testing.assert_array_equal(np.asarray(got.value), expected.numpy())


def test_a_view_past_the_storage_is_an_error_naming_it():
    with jmp.torch_bridge.dispatch.session(), pytest.raises(LoweringError, match="as_strided"):
        jmp.torch_bridge.JaxTensor(jnp.arange(6.0)).as_strided((3, 3), (2, 1))
