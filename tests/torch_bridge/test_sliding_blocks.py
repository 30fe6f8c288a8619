"""``F.unfold`` / ``F.fold`` (ConvBERT's span-based convolution unfolds its keys) against PyTorch: values and
gradients, with dilation, padding, stride and overlapping blocks, batched and unbatched."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jmp
from jmp.errors import LoweringError
from tests.helpers import assert_grad_parity, to_jax

BLOCKS = {"kernel_size": (3, 2), "dilation": (1, 2), "padding": (1, 0), "stride": (2, 1)}


class UnfoldThenFold(nn.Module):
    """Columns of overlapping blocks, weighted, then summed back into an image."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(2, 1, 1))
        self.column_weight = nn.Parameter(torch.randn(2 * 6, 1))

    def forward(self, x):
        h = x * self.scale
        columns = F.unfold(h, **BLOCKS) * self.column_weight
        return F.fold(columns, output_size=h.shape[-2:], **BLOCKS) + columns.mean()


def test_unfold_and_fold_match_torch_with_gradients_under_jit():
    torch.manual_seed(0)
    module = UnfoldThenFold()
    x = torch.randn(2, 2, 7, 6)
    converted = jmp.torch_bridge.convert(module)
    assert_grad_parity(module, converted, lambda m: m(x).square().sum(), lambda m: (m(to_jax(x)) ** 2).sum())


@pytest.mark.parametrize("shape", [(2, 5, 4), (1, 2, 5, 4)])
def test_unfold_values_match_torch_batched_and_unbatched(shape):
    x = torch.randn(shape)
    with jmp.torch_bridge.dispatch.session():
        actual = F.unfold(jmp.torch_bridge.JaxTensor(to_jax(x)), kernel_size=2, padding=1)
    np.testing.assert_array_equal(np.asarray(actual.value), F.unfold(x, kernel_size=2, padding=1).numpy())


def test_unfold_without_a_whole_block_says_which_sizes_do_not_fit():
    x = jmp.torch_bridge.JaxTensor(to_jax(torch.randn(1, 1, 2, 2)))
    with jmp.torch_bridge.dispatch.session(), pytest.raises(LoweringError, match="fits no block in a 2x2 input"):
        F.unfold(x, kernel_size=3)
