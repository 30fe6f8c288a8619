"""Max pooling whose windows tile the input (stride = kernel): torch's values and gradients, without the
general path's variadic reduce_window or scatter in the compiled program."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch import nn

import jmp
from tests.helpers import to_jax

# (pooling layer, input shape); odd sizes leave a remainder that torch's floor mode drops (the gradient there: 0)
CASES = {
    "2d 2x3": (lambda: nn.MaxPool2d((2, 3)), (2, 2, 6, 9)),
    "1d": (lambda: nn.MaxPool1d(3), (2, 3, 10)),
    "3d": (lambda: nn.MaxPool3d(2), (1, 2, 4, 5, 6)),
    "unbatched": (lambda: nn.MaxPool2d(2), (3, 5, 6)),
}


def _tied(shape, seed):
    """Small integers: most windows hold their maximum more than once, and torch picks the first."""
    return torch.randint(0, 3, shape, generator=torch.Generator().manual_seed(seed)).float()


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_tiled_max_pool_values_and_gradients_equal_torch(case):
    make_pool, shape = CASES[case]
    pool = make_pool()
    x = _tied(shape, 0).requires_grad_(True)
    out = pool(x)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * weights).sum().backward()

    converted = jmp.torch_bridge.convert(pool)
    np.testing.assert_array_equal(converted(to_jax(x.detach())), out.detach().numpy())
    grad = jax.grad(lambda a: jnp.sum(converted(a) * to_jax(weights)))(to_jax(x.detach()))
    np.testing.assert_array_equal(grad, x.grad.numpy())


def test_tiled_max_pool_gradient_compiles_to_elementwise_loops():
    x = jnp.asarray(_tied((4, 8, 12, 12), 2).numpy())
    converted = jmp.torch_bridge.convert(nn.MaxPool2d(2))
    hlo = jax.jit(jax.grad(lambda a: jnp.sum(converted(a) ** 2))).lower(x).compile().as_text()
    assert not re.search(r"\b(reduce-window|scatter|select-and-scatter)\(", hlo), hlo
