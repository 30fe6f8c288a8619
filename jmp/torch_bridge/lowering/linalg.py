"""Matrix products: matmul, mm, bmm, addmm, baddbmm, einsum, dot, outer; triangular solves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from jmp.torch_bridge.lowering import triangular_solve
from jmp.torch_bridge.lowering.promotion import promoted
from jmp.torch_bridge.registry import register_lowering

T = torch.Tensor


@register_lowering(torch.matmul, T.matmul, T.__matmul__)
def matmul(input, other):
    return jnp.matmul(*promoted(input, other))


@register_lowering(T.__rmatmul__)
def rmatmul(input, other):
    return matmul(other, input)


@register_lowering(torch.mm, T.mm, torch.bmm, T.bmm, torch.mv, T.mv)
def mm(input, mat2):
    return jnp.matmul(*promoted(input, mat2))


@register_lowering(torch.dot, T.dot, torch.inner, T.inner)
def dot(input, other):
    return jnp.inner(*promoted(input, other))


@register_lowering(torch.vdot, T.vdot)
def vdot(input, other):
    return jnp.vdot(*promoted(input, other))


@register_lowering(torch.outer, T.outer, torch.ger, T.ger)
def outer(input, vec2):
    return jnp.outer(*promoted(input, vec2))


def _scaled_sum(input, product, beta, alpha):
    out = product if alpha == 1 else alpha * product
    if beta == 0:  # torch ignores input (even NaN) when beta is 0
        return out
    return out + (input if beta == 1 else beta * input)


@register_lowering(torch.addmm, T.addmm, inplace=(T.addmm_,))
def addmm(input, mat1, mat2, *, beta=1, alpha=1):
    a, b, c = promoted(input, mat1, mat2)
    return _scaled_sum(a, jnp.matmul(b, c), beta, alpha)


@register_lowering(torch.addmv, T.addmv, inplace=(T.addmv_,))
def addmv(input, mat, vec, *, beta=1, alpha=1):
    a, b, c = promoted(input, mat, vec)
    return _scaled_sum(a, jnp.matmul(b, c), beta, alpha)


@register_lowering(torch.baddbmm, T.baddbmm, inplace=(T.baddbmm_,))
def baddbmm(input, batch1, batch2, *, beta=1, alpha=1):
    a, b, c = promoted(input, batch1, batch2)
    return _scaled_sum(a, jnp.matmul(b, c), beta, alpha)


@register_lowering(torch.addbmm, T.addbmm, inplace=(T.addbmm_,))
def addbmm(input, batch1, batch2, *, beta=1, alpha=1):
    a, b, c = promoted(input, batch1, batch2)
    return _scaled_sum(a, jnp.einsum("bij,bjk->ik", b, c), beta, alpha)


@register_lowering(torch.addr, T.addr, inplace=(T.addr_,))
def addr(input, vec1, vec2, *, beta=1, alpha=1):
    a, b, c = promoted(input, vec1, vec2)
    return _scaled_sum(a, jnp.outer(b, c), beta, alpha)


@register_lowering(torch.einsum)
def einsum(equation, *operands):
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    return jnp.einsum(equation, *promoted(*operands))


@register_lowering(torch.tensordot)
def tensordot(a, b, dims=2, out=None):
    a, b = promoted(a, b)
    if isinstance(dims, (list, tuple)) and len(dims) == 2 and isinstance(dims[0], (list, tuple)):
        dims = (tuple(dims[0]), tuple(dims[1]))
    return jnp.tensordot(a, b, axes=dims)


@register_lowering(torch.kron, T.kron)
def kron(input, other):
    return jnp.kron(*promoted(input, other))


@register_lowering(torch.cross, T.cross, torch.linalg.cross)
def cross(input, other, dim=None):
    a, b = promoted(input, other)
    if dim is None:
        dim = next(i for i, n in enumerate(jnp.broadcast_shapes(a.shape, b.shape)) if n == 3)
    return jnp.cross(a, b, axis=dim)


@register_lowering(torch.trace, T.trace)
def trace(input):
    return jnp.trace(input)


@register_lowering(torch.linalg.matrix_norm)
def matrix_norm(A, ord="fro", dim=(-2, -1), keepdim=False, *, dtype=None):
    return jnp.linalg.norm(A, ord=ord, axis=tuple(dim), keepdims=keepdim)


@register_lowering(torch.cdist)
def cdist(x1, x2, p=2.0, compute_mode=None):
    diff = x1[..., :, None, :] - x2[..., None, :, :]
    if p == 2.0:
        return jnp.sqrt(jnp.sum(diff * diff, axis=-1))
    if p == float("inf"):
        return jnp.max(jnp.abs(diff), axis=-1)
    if p == 0:
        return jnp.sum((diff != 0).astype(diff.dtype), axis=-1)
    return jnp.sum(jnp.abs(diff) ** p, axis=-1) ** (1.0 / p)


@register_lowering(torch.linalg.solve_triangular)
def solve_triangular(A, B, *, upper, left=True, unitriangular=False):
    """``X`` with ``A @ X = B`` (``X @ A = B`` when not ``left``), ``A`` triangular (OLMo-hybrid's delta rule)."""
    a, b = promoted(A, B)
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = jnp.broadcast_to(a, batch + a.shape[-2:])
    b = jnp.broadcast_to(b, batch + b.shape[-2:])
    if jax.default_backend() == "cpu":  # LAPACK's batched kernel can hang XLA:CPU's thread pool
        return triangular_solve.solve(a, b, left=left, lower=not upper, unit_diagonal=unitriangular)
    return jax.lax.linalg.triangular_solve(a, b, left_side=left, lower=not upper, unit_diagonal=unitriangular)
