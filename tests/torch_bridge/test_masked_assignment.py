"""``x[mask] = value`` under ``jit`` (T5Gemma2 writes a learned embedding at its end-of-image tokens): a select
instead of a data-dependent scatter, with values and gradients equal to PyTorch's for a scalar, one element
broadcast to every selected row, and one row per selected entry."""

import jax.numpy as jnp
import torch
from torch import nn

import jmp
from tests.helpers import assert_grad_parity, to_jax


class MarkedTokens(nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.embed = nn.Embedding(6, width)
        self.marker = nn.Parameter(torch.randn(width))
        self.rows = nn.Parameter(torch.randn(3, width))

    def forward(self, ids):
        h = self.embed(ids)
        h[ids == 5] = self.marker  # one element, broadcast to every selected row
        h[ids == 2] = self.rows  # one row per selected entry, in order
        h[(ids == 1)[..., None] & (h > 0)] = 0.5  # a scalar
        return h


def test_masked_assignments_match_torch_with_gradients_under_jit():
    torch.manual_seed(0)
    module = MarkedTokens()
    ids = torch.tensor([[5, 2, 1, 3], [2, 5, 2, 1]])
    converted = jmp.torch_bridge.convert(module)
    weights = torch.randn(2, 4, 4)
    assert_grad_parity(
        module,
        converted,
        lambda m: (m(ids) * weights).sum(),
        lambda m: (m(to_jax(ids)) * jnp.asarray(weights.numpy())).sum(),
    )
