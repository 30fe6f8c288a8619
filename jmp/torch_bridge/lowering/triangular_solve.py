"""Triangular solves on CPU as blocked substitution: slices and matrix products, no LAPACK call.

jaxlib's CPU ``trsm`` blocks a thread of XLA:CPU's pool while its pieces run, so two concurrent calls (Qwen3-Next's
gated delta rule) can deadlock a small pool. Halving ``L11 X1 = B1``, ``L22 X2 = B2 - L21 X1`` down to ``BASE``
rows gives XLA ops that cannot block and differentiate by JAX's rules. Systems over ``LARGEST`` keep LAPACK.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BASE = 8  # rows solved one by one
LARGEST = 512  # larger systems are solved by LAPACK


def solve(a: jax.Array, b: jax.Array, *, left: bool, lower: bool, unit_diagonal: bool) -> jax.Array:
    """``X`` with ``a @ X = b`` (``X @ a = b`` unless ``left``), ``a`` triangular; batch dimensions equal."""
    if a.shape[-1] > LARGEST:
        return jax.lax.linalg.triangular_solve(a, b, left_side=left, lower=lower, unit_diagonal=unit_diagonal)
    if not left:  # X a = b  <=>  a^T X^T = b^T, and a^T is triangular the other way
        solved = solve(_transposed(a), _transposed(b), left=True, lower=not lower, unit_diagonal=unit_diagonal)
        return _transposed(solved)
    if lower:
        return _lower(a, b, unit_diagonal)
    # U X = b  <=>  (J U J)(J X) = J b with J the row reversal, and J U J is lower triangular
    flipped = jnp.flip(a, (-2, -1))
    return jnp.flip(_lower(flipped, jnp.flip(b, -2), unit_diagonal), -2)


def _transposed(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, -1, -2)


def _lower(a: jax.Array, b: jax.Array, unit_diagonal: bool) -> jax.Array:
    """``X`` with ``a @ X = b``, ``a`` lower triangular."""
    n = a.shape[-1]
    if n <= BASE:
        rows: list[jax.Array] = []
        for i in range(n):
            row = b[..., i, :]
            if i:
                row = row - jnp.einsum("...j,...jk->...k", a[..., i, :i], jnp.stack(rows, -2))
            rows.append(row if unit_diagonal else row / a[..., i, i, None])
        return jnp.stack(rows, -2)
    half = n // 2
    top = _lower(a[..., :half, :half], b[..., :half, :], unit_diagonal)
    rest = b[..., half:, :] - jnp.matmul(a[..., half:, :half], top)
    return jnp.concatenate([top, _lower(a[..., half:, half:], rest, unit_diagonal)], axis=-2)
