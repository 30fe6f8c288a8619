"""Shape and layout: views, reshapes, joins and splits."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jmp.torch_bridge.dtypes import to_jax_dtype
from jmp.torch_bridge.lowering.arguments import axis, dims, sizes
from jmp.torch_bridge.lowering.promotion import promoted
from jmp.torch_bridge.registry import getter, register_lowering

T = torch.Tensor


def _is_reshape(args, kwargs):
    return not (len(args) == 2 and isinstance(args[1], torch.dtype))  # a dtype view reinterprets bits


@register_lowering(T.view, view=_is_reshape)
def view(input, *shape):
    if len(shape) == 1 and isinstance(shape[0], torch.dtype):
        return _bitcast(input, to_jax_dtype(shape[0]))
    return jnp.reshape(input, sizes(shape))


def _bitcast(x, dtype):
    if jnp.dtype(dtype).itemsize != x.dtype.itemsize:
        raise ValueError(f"view({dtype}) needs a dtype of the same width as {x.dtype}")
    return jax.lax.bitcast_convert_type(x, dtype)


@register_lowering(torch.reshape, T.reshape, view=True)
def reshape(input, *shape):
    return jnp.reshape(input, sizes(shape))


@register_lowering(T.view_as, T.reshape_as, view=True)
def view_as(input, other):
    return jnp.reshape(input, other.shape)


@register_lowering(torch.flatten, T.flatten, view=True)
def flatten(input, start_dim=0, end_dim=-1):
    if input.ndim == 0:
        return input.reshape(1)
    start, end = axis(start_dim, input.ndim), axis(end_dim, input.ndim)
    shape = input.shape[:start] + (-1,) + input.shape[end + 1 :]
    return input.reshape(shape) if start <= end else input


@register_lowering(torch.ravel, T.ravel)
def ravel(input):
    return input.reshape(-1)


@register_lowering(torch.unflatten, T.unflatten, view=True)
def unflatten(input, dim, sizes):
    ax = axis(dim, input.ndim)
    return input.reshape(input.shape[:ax] + tuple(sizes) + input.shape[ax + 1 :])


@register_lowering(torch.squeeze, T.squeeze, view=True)
def squeeze(input, dim=None):
    if dim is None:
        return jnp.squeeze(input)
    axes = dims(dim, input.ndim) or ()
    return jnp.squeeze(input, tuple(a for a in axes if input.ndim and input.shape[a] == 1))


@register_lowering(torch.unsqueeze, T.unsqueeze, view=True)
def unsqueeze(input, dim):
    return jnp.expand_dims(input, axis(dim, input.ndim + 1))


@register_lowering(torch.permute, T.permute, view=True)
def permute(input, *dims_):
    return jnp.transpose(input, tuple(axis(d, input.ndim) for d in sizes(dims_)))


@register_lowering(torch.transpose, T.transpose, torch.swapaxes, T.swapaxes, torch.swapdims, T.swapdims, view=True)
def transpose(input, dim0, dim1):
    if input.ndim < 2:
        return input
    return jnp.swapaxes(input, axis(dim0, input.ndim), axis(dim1, input.ndim))


@register_lowering(torch.t, T.t, view=True)
def t(input):
    return input if input.ndim < 2 else input.T


@register_lowering(getter("T"), view=True)
def reverse_dims(input):
    return jnp.transpose(input)


@register_lowering(getter("mT"), torch.adjoint, view=True)
def matrix_transpose(input):
    return jnp.swapaxes(input, -1, -2)


@register_lowering(getter("mH"), getter("H"), T.adjoint, view=True)
def matrix_adjoint(input):
    return jnp.conj(jnp.swapaxes(input, -1, -2))


@register_lowering(torch.movedim, T.movedim, torch.moveaxis, T.moveaxis, view=True)
def movedim(input, source, destination):
    src = dims(source, input.ndim) if isinstance(source, (tuple, list)) else (axis(source, input.ndim),)
    dst = dims(destination, input.ndim) if isinstance(destination, (tuple, list)) else (axis(destination, input.ndim),)
    return jnp.moveaxis(input, src, dst)


@register_lowering(T.expand, view=True)
def expand(input, *shape, implicit=False):
    target = sizes(shape)
    lead = len(target) - input.ndim
    resolved = tuple(input.shape[i - lead] if s == -1 else s for i, s in enumerate(target))
    return jnp.broadcast_to(input, resolved)


@register_lowering(T.expand_as, view=True)
def expand_as(input, other):
    return jnp.broadcast_to(input, other.shape)


@register_lowering(torch.broadcast_to, T.broadcast_to, view=True)
def broadcast_to(input, size):
    return expand(input, size)


@register_lowering(torch.broadcast_tensors)
def broadcast_tensors(*tensors):
    return tuple(jnp.broadcast_arrays(*tensors))


def _atleast(jnp_fn, torch_fn):
    def lowering(*tensors):
        out = jnp_fn(*_varargs(tensors))
        return tuple(out) if isinstance(out, list) else out

    lowering.__name__ = jnp_fn.__name__
    register_lowering(torch_fn)(lowering)


for _n in (1, 2, 3):
    _atleast(getattr(jnp, f"atleast_{_n}d"), getattr(torch, f"atleast_{_n}d"))


def _varargs(tensors):
    return tuple(tensors[0]) if len(tensors) == 1 and isinstance(tensors[0], (tuple, list)) else tensors


@register_lowering(T.repeat)
def repeat(input, *repeats):
    reps = sizes(repeats)
    x = input.reshape((1,) * (len(reps) - input.ndim) + input.shape)
    return jnp.tile(x, reps)


@register_lowering(torch.tile, T.tile)
def tile(input, dims):
    return jnp.tile(input, tuple(dims))


@register_lowering(torch.repeat_interleave, T.repeat_interleave)
def repeat_interleave(input, repeats=None, dim=None, *, output_size=None):
    if repeats is None:  # repeat_interleave(repeats): indices
        counts = input
        return jnp.repeat(jnp.arange(counts.shape[0]), counts, total_repeat_length=output_size)
    x = input.reshape(-1) if dim is None else input
    ax = 0 if dim is None else axis(dim, input.ndim)
    if isinstance(repeats, jax.Array) and repeats.ndim == 0:
        repeats = int(repeats)
    return jnp.repeat(x, repeats, axis=ax, total_repeat_length=output_size)


def _joinable(tensors):
    tensors = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)] or list(tensors[:1])
    return promoted(*tensors) if len(tensors) > 1 else tensors


@register_lowering(torch.cat, torch.concat, torch.concatenate)
def cat(tensors, dim=0):
    parts = _joinable(tensors)
    return jnp.concatenate(parts, axis=axis(dim, parts[0].ndim))


@register_lowering(torch.stack)
def stack(tensors, dim=0):
    parts = promoted(*tensors) if len(tensors) > 1 else list(tensors)
    return jnp.stack(parts, axis=axis(dim, parts[0].ndim + 1))


def _stacking(jnp_fn, *torch_fns):
    def lowering(tensors):
        return jnp_fn(promoted(*tensors) if len(tensors) > 1 else tensors)

    lowering.__name__ = jnp_fn.__name__
    register_lowering(*torch_fns)(lowering)


_stacking(jnp.hstack, torch.hstack)
_stacking(jnp.vstack, torch.vstack, torch.row_stack)
_stacking(jnp.dstack, torch.dstack)
_stacking(jnp.column_stack, torch.column_stack)


def _split_at(input, ax, boundaries):
    return tuple(jnp.split(input, list(boundaries), axis=ax))


@register_lowering(torch.split, T.split, view=True)
def split(tensor, split_size_or_sections, dim=0):
    ax = axis(dim, tensor.ndim)
    n = tensor.shape[ax]
    if isinstance(split_size_or_sections, int):
        size = split_size_or_sections
        boundaries = list(range(size, n, size)) if size > 0 else []
    else:
        boundaries = np.cumsum(list(split_size_or_sections))[:-1].tolist()
    return _split_at(tensor, ax, boundaries)


@register_lowering(T.split_with_sizes, view=True)
def split_with_sizes(input, split_sizes, dim=0):
    return split(input, list(split_sizes), dim)


@register_lowering(torch.chunk, T.chunk, view=True)
def chunk(input, chunks, dim=0):
    ax = axis(dim, input.ndim)
    size = math.ceil(input.shape[ax] / chunks) if input.shape[ax] else 1
    return split(input, size, ax) if input.shape[ax] else (input,) * chunks


@register_lowering(torch.tensor_split, T.tensor_split, view=True)
def tensor_split(input, indices_or_sections, dim=0):
    ax = axis(dim, input.ndim)
    if isinstance(indices_or_sections, jax.Array):
        indices_or_sections = (
            int(indices_or_sections) if indices_or_sections.ndim == 0 else [int(i) for i in indices_or_sections]
        )
    if isinstance(indices_or_sections, int):
        return tuple(jnp.array_split(input, indices_or_sections, axis=ax))
    return _split_at(input, ax, [int(i) for i in indices_or_sections])


@register_lowering(torch.unbind, T.unbind, view=True)
def unbind(input, dim=0):
    ax = axis(dim, input.ndim)
    return tuple(jnp.squeeze(p, ax) for p in jnp.split(input, input.shape[ax], axis=ax)) if input.shape[ax] else ()


@register_lowering(T.__iter__, raw=True)
def iterate(input):
    """Iterating a tensor yields its rows, as views (torch: ``iter(self.unbind(0))``)."""
    if input.dim() == 0:
        raise TypeError("iteration over a 0-d tensor")
    return iter(input.unbind(0))


@register_lowering(torch.narrow, T.narrow, view=True)
def narrow(input, dim, start, length):
    ax = axis(dim, input.ndim)
    start = int(start) % input.shape[ax] if int(start) < 0 else int(start)
    return jax.lax.slice_in_dim(input, start, start + int(length), axis=ax)


@register_lowering(torch.select, T.select, view=True)
def select(input, dim, index):
    ax = axis(dim, input.ndim)
    return (
        jnp.take(input, index, axis=ax)
        if isinstance(index, jax.Array)
        else jax.lax.index_in_dim(input, int(index) % input.shape[ax], axis=ax, keepdims=False)
    )


@register_lowering(torch.flip, T.flip)
def flip(input, *dims_, dims=None):
    axes = dims if dims is not None else dims_[0] if len(dims_) == 1 and isinstance(dims_[0], (tuple, list)) else dims_
    return jnp.flip(input, tuple(axis(d, input.ndim) for d in axes))


@register_lowering(torch.fliplr, T.fliplr)
def fliplr(input):
    return jnp.fliplr(input)


@register_lowering(torch.flipud, T.flipud)
def flipud(input):
    return jnp.flipud(input)


@register_lowering(torch.roll, T.roll)
def roll(input, shifts, dims=None):
    if dims is None:
        return jnp.roll(input.reshape(-1), shifts).reshape(input.shape)
    return jnp.roll(input, shifts, axis=dims)


@register_lowering(torch.rot90, T.rot90)
def rot90(input, k=1, dims=(0, 1)):
    return jnp.rot90(input, k, axes=tuple(dims))


@register_lowering(torch.tril, T.tril, inplace=(T.tril_,))
def tril(input, diagonal=0):
    return jnp.tril(input, diagonal)


@register_lowering(torch.triu, T.triu, inplace=(T.triu_,))
def triu(input, diagonal=0):
    return jnp.triu(input, diagonal)


@register_lowering(torch.diag, T.diag)
def diag(input, diagonal=0):
    return jnp.diag(input, diagonal)


@register_lowering(torch.diagonal, T.diagonal, view=True)
def diagonal(input, offset=0, dim1=0, dim2=1):
    return jnp.diagonal(input, offset, axis(dim1, input.ndim), axis(dim2, input.ndim))


@register_lowering(torch.diag_embed, T.diag_embed)
def diag_embed(input, offset=0, dim1=-2, dim2=-1):
    n = input.shape[-1] + abs(offset)
    out = jnp.zeros(input.shape[:-1] + (n, n), input.dtype)
    rows = jnp.arange(input.shape[-1]) + max(-offset, 0)
    cols = jnp.arange(input.shape[-1]) + max(offset, 0)
    out = out.at[..., rows, cols].set(input)
    d1, d2 = axis(dim1, out.ndim), axis(dim2, out.ndim)
    return jnp.moveaxis(out, (-2, -1), (d1, d2))


@register_lowering(T.contiguous)
def contiguous(input, memory_format=None):
    return input


@register_lowering(torch.clone, T.clone)
def clone(input, *, memory_format=None):
    return jnp.copy(input)


@register_lowering(torch.detach, T.detach, getter("data"), view=True, inplace=(T.detach_,))
def detach(input):
    return jax.lax.stop_gradient(input)


@register_lowering(T.requires_grad_)
def requires_grad_(input, requires_grad=True):
    return input  # gradients are chosen by what jax.grad differentiates


@register_lowering(T.unfold, view=True)
def unfold(input, dimension, size, step):
    if input.ndim == 0:
        return input.reshape(1)
    ax = axis(dimension, input.ndim)
    count = (input.shape[ax] - size) // step + 1
    starts = np.arange(count) * step
    windows = jnp.stack([jax.lax.slice_in_dim(input, s, s + size, axis=ax) for s in starts], axis=ax)
    return jnp.moveaxis(windows, ax + 1, -1)


@register_lowering(torch.meshgrid)
def meshgrid(*tensors, indexing=None):
    return tuple(jnp.meshgrid(*(t.reshape(-1) for t in _varargs(tensors)), indexing=indexing or "ij"))


@register_lowering(torch.cartesian_prod)
def cartesian_prod(*tensors):
    grids = jnp.meshgrid(*tensors, indexing="ij")
    out = jnp.stack([g.reshape(-1) for g in grids], axis=1)
    return out[:, 0] if len(tensors) == 1 else out


@register_lowering(torch.block_diag)
def block_diag(*tensors):
    return jax.scipy.linalg.block_diag(*[t.reshape(1, -1) if t.ndim < 2 else t for t in tensors])
