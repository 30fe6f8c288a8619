"""``torch.unique`` / ``unique_consecutive`` on concrete values equal torch's, with every option; under ``jit``
they are a ``TracedControlFlowError`` (which a step answers by running op by op)."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jmp
from jmp.errors import TracedControlFlowError

_VALUES = torch.tensor([[3, 3, 1, 1], [3, 3, 1, 1], [2, 0, 0, 2], [3, 3, 1, 1]])


def _bridged(call, values):
    with jmp.torch_bridge.dispatch.session():
        result = call(jmp.torch_bridge.JaxTensor(jnp.asarray(values.numpy())))
    return tuple(np.asarray(r.value) for r in result) if isinstance(result, tuple) else (np.asarray(result.value),)


@pytest.mark.parametrize("name", ["unique", "unique_consecutive"])
@pytest.mark.parametrize("dim", [None, 0, 1])
def test_every_option_equals_torch(name, dim):
    for inverse, counts in itertools.product((False, True), repeat=2):
        call = functools.partial(getattr(torch, name), return_inverse=inverse, return_counts=counts, dim=dim)
        expected = call(_VALUES)
        expected = expected if isinstance(expected, tuple) else (expected,)
        got = _bridged(call, _VALUES)
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            np.testing.assert_array_equal(g, e.numpy())


def test_the_tensor_methods_and_an_empty_tensor_equal_torch():
    empty = torch.zeros((0,), dtype=torch.long)
    for values, call in [
        (_VALUES, lambda t: t.unique_consecutive(return_counts=True)),
        (_VALUES, lambda t: t.unique(return_inverse=True)),
        (empty, lambda t: torch.unique_consecutive(t, return_inverse=True, return_counts=True)),
    ]:
        for g, e in zip(_bridged(call, values), call(values)):
            np.testing.assert_array_equal(g, e.numpy())


def test_under_jit_it_names_the_call():
    def count(x):
        with jmp.torch_bridge.dispatch.session():
            return torch.unique_consecutive(jmp.torch_bridge.JaxTensor(x)).numel()

    with pytest.raises(TracedControlFlowError, match="unique_consecutive"):
        jax.jit(count)(jnp.asarray([1, 1, 2]))
