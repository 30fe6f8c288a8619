"""``jax.lax.ragged_dot`` (a mixture-of-experts grouped matmul) that also runs under the step's per-process ``vmap``.

JAX batches ``ragged_dot`` only when every operand carries the batch axis; the rule here gives it to the
expert weights too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmp.torch_bridge import dispatch


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot(lhs, rhs, group_sizes)``; under ``dispatch.batched_over`` with the batching rule below."""
    if dispatch.batch_axis() is None:
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)
    return _batchable(lhs, rhs, group_sizes)


@jax.custom_batching.custom_vmap
def _batchable(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)


@_batchable.def_vmap
def _batched(axis_size: int, in_batched: list[bool], lhs, rhs, group_sizes):
    operands = [
        x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
        for x, batched in zip((lhs, rhs, group_sizes), in_batched)
    ]
    return jax.vmap(jax.lax.ragged_dot)(*operands), True
