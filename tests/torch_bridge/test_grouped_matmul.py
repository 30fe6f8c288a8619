"""A mixture-of-experts grouped matmul under ``jax.vmap`` (a step run once per process): each batch entry's
tokens meet the same experts, values and gradients as one ``ragged_dot`` per entry."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jmp.torch_bridge import dispatch
from jmp.torch_bridge.lowering.grouped_matmul import ragged_dot

ENTRIES, ROWS, DIM, OUT, GROUPS = 2, 6, 4, 3, 3


def test_vmapped_tokens_with_shared_experts_equal_one_ragged_dot_per_entry():
    lhs = jax.random.normal(jax.random.key(0), (ENTRIES, ROWS, DIM))
    rhs = jax.random.normal(jax.random.key(1), (GROUPS, DIM, OUT))
    sizes = jnp.array([[2, 2, 2], [1, 2, 3]], jnp.int32)

    def vmapped(lhs, rhs):
        with dispatch.batched_over("process"):  # as a step run once per process
            batched = jax.vmap(lambda tokens, counts: ragged_dot(tokens, rhs, counts), axis_name="process")
            return batched(lhs, sizes).sum()

    def per_entry(lhs, rhs):
        return sum(jax.lax.ragged_dot(lhs[i], rhs, sizes[i]).sum() for i in range(ENTRIES))

    np.testing.assert_allclose(vmapped(lhs, rhs), per_entry(lhs, rhs), rtol=1e-6)
    for got, expected in zip(jax.grad(vmapped, (0, 1))(lhs, rhs), jax.grad(per_entry, (0, 1))(lhs, rhs)):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    # outside a per-process vmap it is JAX's own, differentiable as always
    np.testing.assert_allclose(jax.grad(lambda r: ragged_dot(lhs[0], r, sizes[0]).sum())(rhs).shape, rhs.shape)
