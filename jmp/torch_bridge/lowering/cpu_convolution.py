"""Convolutions that keep XLA:CPU's fast (Eigen) path inside loops and branches (used on CPU only).

XLA:CPU uses Eigen only for NHWC / HWIO operands, and its ``ConvCanonicalization`` pass transposes torch's
NCHW / OIHW to that in the entry computation only: a convolution in a ``lax.scan`` body or ``lax.switch``
branch falls back to a slow loop nest. ``conv_general_dilated`` here transposes in the program itself, for
the forward convolution and the two of its gradient (a ``custom_vjp``, so no forward-mode rule).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.extend
import numpy as np
from jax import lax

# operands + result of one convolution piece (see _in_pieces); on this 32 MiB-L3 x86 CPU 7.5 MiB ran at
# full speed and 12 MiB at half
PIECE_BYTES = 8 * 2**20


def conv_general_dilated(lhs, rhs, *, dimension_numbers, **params):
    """``lax.conv_general_dilated`` (explicit padding, no group batching), every convolution in canonical layout."""
    numbers = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    options = tuple(sorted((k, _hashable(v)) for k, v in params.items()))
    return _canonical_conv(lhs, rhs, numbers, options)


def _hashable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    return value


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _canonical_conv(lhs, rhs, numbers: lax.ConvDimensionNumbers, options: tuple):
    return canonical(lhs, rhs, numbers, dict(options))


def _forward(lhs, rhs, numbers, options):
    return _canonical_conv(lhs, rhs, numbers, options), (lhs, rhs)


def _backward(numbers, options, residuals, cotangent):
    """JAX's own transpose rules, with each convolution they emit made canonical."""
    lhs, rhs = residuals
    params = dict(options)
    _, pullback = jax.vjp(lambda a, b: lax.conv_general_dilated(a, b, dimension_numbers=numbers, **params), lhs, rhs)
    closed = jax.make_jaxpr(pullback)(cotangent)
    return tuple(_evaluate_canonically(closed.jaxpr, closed.consts, [cotangent]))


_forward.__name__ = "canonical_conv_forward"
_canonical_conv.defvjp(_forward, _backward)


def _evaluate_canonically(jaxpr, consts, args):
    """Evaluate a flat jaxpr, emitting each ``conv_general_dilated`` equation canonically."""
    env: dict = {}

    def read(atom):
        return atom.val if isinstance(atom, jax.extend.core.Literal) else env[atom]

    for var, value in zip(jaxpr.constvars, consts):
        env[var] = value
    for var, value in zip(jaxpr.invars, args):
        env[var] = value
    for eqn in jaxpr.eqns:
        inputs = [read(v) for v in eqn.invars]
        if eqn.primitive is lax.conv_general_dilated_p:
            params = dict(eqn.params)
            numbers = params.pop("dimension_numbers")
            params.pop("lhs_shape", None)
            params.pop("rhs_shape", None)
            outputs = [canonical(*inputs, numbers, params)]
        else:
            result = eqn.primitive.bind(*inputs, **eqn.params)
            outputs = result if eqn.primitive.multiple_results else [result]
        for var, value in zip(eqn.outvars, outputs):
            env[var] = value
    return [read(v) for v in jaxpr.outvars]


def canonical(lhs, rhs, numbers: lax.ConvDimensionNumbers, params: dict):
    """The convolution with operands transposed to NHWC / HWIO (grouped filter gradients have no Eigen form)."""
    if params.get("batch_group_count", 1) != 1:
        return lax.conv_general_dilated(lhs, rhs, dimension_numbers=numbers, **params)
    lhs_spec, rhs_spec, out_spec = numbers
    nd = len(lhs_spec) - 2
    lhs_order = (lhs_spec[0], *lhs_spec[2:], lhs_spec[1])
    rhs_order = (*rhs_spec[2:], rhs_spec[1], rhs_spec[0])
    out_order = (out_spec[0], *out_spec[2:], out_spec[1])
    spatial = tuple(range(1, nd + 1))
    canonical_numbers = lax.ConvDimensionNumbers(
        lhs_spec=(0, nd + 1, *spatial), rhs_spec=(nd + 1, nd, *range(nd)), out_spec=(0, nd + 1, *spatial)
    )
    out = _in_pieces(lax.transpose(lhs, lhs_order), lax.transpose(rhs, rhs_order), canonical_numbers, params)
    return lax.transpose(out, tuple(int(i) for i in np.argsort(out_order)))


def _in_pieces(lhs, rhs, numbers: lax.ConvDimensionNumbers, params: dict):
    """A canonical convolution cut into pieces whose operands and result fit in a CPU's cache.

    A piece is a slice of the batch (results concatenated) or, for the filter gradient, of the input features
    (results summed), whichever shrinks more. Inside a ``shard_map`` each piece takes the same rows of every
    device's block (``_take``): a slice across blocks would need collective permutes, which hang inside a
    pipeline stage.
    """
    itemsize = np.dtype(lhs.dtype).itemsize
    out_shape = jax.eval_shape(
        lambda a, b: lax.conv_general_dilated(a, b, dimension_numbers=numbers, **params), lhs, rhs
    ).shape
    lhs_bytes, rhs_bytes = lhs.size * itemsize, rhs.size * itemsize
    out_bytes = int(np.prod(out_shape)) * itemsize
    total = lhs_bytes + rhs_bytes + out_bytes
    by_batch = lhs_bytes + out_bytes  # what a batch slice shrinks
    by_feature = lhs_bytes + rhs_bytes if params.get("feature_group_count", 1) == 1 else 0
    axis = 0 if by_batch >= by_feature else lhs.ndim - 1
    sliced = max(by_batch, by_feature)
    fixed = total - sliced
    blocks = _device_blocks()
    length = lhs.shape[axis] // blocks  # entries of one block
    sliced //= blocks
    uneven = lhs.shape[axis] % blocks != 0  # blocks that would not line up with the devices' rows: not cut
    if uneven or fixed + sliced <= PIECE_BYTES:
        return lax.conv_general_dilated(lhs, rhs, dimension_numbers=numbers, **params)
    pieces = min(length, max(1, -(-sliced // max(PIECE_BYTES - fixed, 1))))
    if pieces == 1:
        return lax.conv_general_dilated(lhs, rhs, dimension_numbers=numbers, **params)
    bounds = [length * i // pieces for i in range(pieces + 1)]
    results = []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        lhs_piece = _take(lhs, axis, blocks, start, stop)
        rhs_piece = rhs if axis == 0 else _take(rhs, rhs.ndim - 2, blocks, start, stop)
        results.append(lax.conv_general_dilated(lhs_piece, rhs_piece, dimension_numbers=numbers, **params))
    if axis != 0:
        return functools.reduce(lax.add, results)
    if blocks == 1:
        return lax.concatenate(results, 0)
    # each result holds rows [start, stop) of every block: interleave them back into the blocks' order
    split = [r.reshape((blocks, r.shape[0] // blocks) + r.shape[1:]) for r in results]
    joined = lax.concatenate(split, 1)
    return joined.reshape((joined.shape[0] * joined.shape[1],) + joined.shape[2:])


def _device_blocks() -> int:
    """How many devices' blocks a batch dimension may be split into: the product of the traced mesh's automatic
    axes (1 outside a ``shard_map``), a multiple of the data-parallel split, so a block is one device's rows."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    return int(np.prod([mesh.shape[a] for a in mesh.auto_axes], dtype=int))


def _take(x, axis: int, blocks: int, start: int, stop: int):
    """Entries [start, stop) of each of ``blocks`` equal blocks of ``x`` along ``axis``, the blocks kept in order."""
    if blocks == 1:
        return lax.slice_in_dim(x, start, stop, axis=axis)
    shape = x.shape
    grouped = x.reshape(shape[:axis] + (blocks, shape[axis] // blocks) + shape[axis + 1 :])
    piece = lax.slice_in_dim(grouped, start, stop, axis=axis + 1)
    return piece.reshape(shape[:axis] + (blocks * (stop - start),) + shape[axis + 1 :])
