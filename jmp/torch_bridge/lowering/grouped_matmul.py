"""``jax.lax.ragged_dot`` (a mixture-of-experts layer's grouped matmul) that also runs under ``jax.vmap``.

JAX batches ``ragged_dot`` only when all three operands carry the batch axis first; a step run once per process
(``jmp.compiled_step.process_shares``) batches the tokens and their group sizes but not the expert weights.
The rule here gives every operand the batch axis, so each process's tokens meet the same experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmp.torch_bridge import dispatch


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot(lhs, rhs, group_sizes)``: rows of ``lhs`` in groups, group i times ``rhs[i]``.

    Under a step's per-process ``vmap`` (``dispatch.batched_over``) with the batching rule below; elsewhere
    JAX's own (a ``custom_vmap`` function is not differentiable outside ``vmap``)."""
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
