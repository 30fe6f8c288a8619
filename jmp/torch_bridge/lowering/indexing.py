"""Indexing: ``x[i]``, ``x[i] = v``, gather/scatter and the index_* family."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F

from jmp.torch_bridge.dtypes import to_jax_dtype
from jmp.torch_bridge.lowering.arguments import axis
from jmp.torch_bridge.lowering.promotion import cast
from jmp.torch_bridge.registry import register_lowering

T = torch.Tensor
_INT = to_jax_dtype(torch.int64)


def _static(bound):
    return None if bound is None else int(bound)


def _index_part(part):
    if isinstance(part, slice):
        return slice(_static(part.start), _static(part.stop), _static(part.step))
    if isinstance(part, list):
        return jnp.asarray(part)
    return part


def _index(index):
    if isinstance(index, tuple):
        return tuple(_index_part(p) for p in index)
    return _index_part(index)


def _is_basic(index) -> bool:
    """Basic indices (ints, slices, None, ...) give views in torch; tensors and lists give copies."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(p is None or p is Ellipsis or isinstance(p, (slice, int)) and not isinstance(p, bool) for p in parts)


def _getitem_is_view(args, kwargs):
    return len(args) > 1 and _is_basic(args[1])


@register_lowering(T.__getitem__, view=_getitem_is_view)
def getitem(input, index):
    return input[_index(index)]


@register_lowering(inplace=(T.__setitem__,))
def setitem(input, index, value):
    index = _index(index)
    if isinstance(index, jax.Array) and index.dtype == jnp.bool_:
        return _masked_assign(input, index, jnp.asarray(cast(value, input.dtype)))
    return input.at[index].set(cast(value, input.dtype))


def _masked_assign(input, mask, value):
    """``x[mask] = value`` as a select, which stays traceable (unlike gathering the masked elements): ``value``
    is one element of ``x[mask]`` (shape ``x.shape[mask.ndim:]``, broadcast), or one row per true entry of
    the mask in order (the k-th true entry takes row k, as torch assigns them)."""
    element = input.shape[mask.ndim :]
    if value.ndim <= len(element):
        rows = jnp.broadcast_to(value, input.shape)
    else:
        value = jnp.broadcast_to(value, value.shape[:1] + element)
        order = jnp.clip(jnp.cumsum(mask.reshape(-1)) - 1, 0, value.shape[0] - 1)
        rows = value[order].reshape(input.shape)
    return jnp.where(mask.reshape(mask.shape + (1,) * len(element)), rows, input)


def _along(dim_index, ax, ndim):
    """A full index tuple that puts ``dim_index`` at axis ``ax`` and aranges elsewhere."""
    grids = jnp.indices(dim_index.shape, sparse=True)
    return tuple(dim_index if d == ax else grids[d] for d in range(ndim))


@register_lowering(torch.gather, T.gather)
def gather(input, dim, index, *, sparse_grad=False):
    if input.ndim == 0:
        return input.reshape(index.shape)
    ax = axis(dim, input.ndim)
    return input[_along(index, ax, input.ndim)]


def _scatter_source(src, index, dtype):
    if isinstance(src, jax.Array) and src.ndim:
        src = src[tuple(slice(0, n) for n in index.shape)]
    return jnp.broadcast_to(cast(src, dtype), index.shape)


@register_lowering(torch.scatter, T.scatter, inplace=(T.scatter_,))
def scatter(input, dim, index, src=None, *, value=None, reduce=None):
    source = _scatter_source(value if src is None else src, index, input.dtype)
    where = input.at[_along(index, axis(dim, input.ndim), input.ndim)]
    if reduce is None:
        return where.set(source)
    if reduce == "add":
        return where.add(source)
    if reduce == "multiply":
        return where.multiply(source)
    raise ValueError(f"scatter reduce must be 'add' or 'multiply', not {reduce!r}")


@register_lowering(torch.scatter_add, T.scatter_add, inplace=(T.scatter_add_,))
def scatter_add(input, dim, index, src):
    return scatter(input, dim, index, src, reduce="add")


_REDUCE_IDENTITY = {"sum": 0, "mean": 0, "prod": 1}


@register_lowering(torch.scatter_reduce, T.scatter_reduce, inplace=(T.scatter_reduce_,))
def scatter_reduce(input, dim, index, src, reduce, *, include_self=True):
    source = _scatter_source(src, index, input.dtype)
    at = _along(index, axis(dim, input.ndim), input.ndim)
    touched = jnp.zeros(input.shape, bool).at[at].set(True)
    if reduce in ("amax", "amin"):
        info = jnp.finfo(input.dtype) if jnp.issubdtype(input.dtype, jnp.floating) else jnp.iinfo(input.dtype)
        identity = info.min if reduce == "amax" else info.max
    else:
        identity = _REDUCE_IDENTITY.get(reduce, 0)
    base = input if include_self else jnp.where(touched, jnp.asarray(identity, input.dtype), input)
    if reduce in ("sum", "mean"):
        out = base.at[at].add(source)
    elif reduce == "prod":
        out = base.at[at].multiply(source)
    elif reduce == "amax":
        out = base.at[at].max(source)
    elif reduce == "amin":
        out = base.at[at].min(source)
    else:
        raise ValueError(f"scatter_reduce reduce must be sum, prod, mean, amax or amin, not {reduce!r}")
    if reduce == "mean":
        count = jnp.zeros(input.shape, input.dtype).at[at].add(1) + (1 if include_self else 0)
        count = jnp.maximum(count, 1)
        out = out / count if jnp.issubdtype(input.dtype, jnp.floating) else jnp.floor_divide(out, count)
        out = jnp.where(touched, out, input)
    return out


def _dim_index(ax, index):
    return (slice(None),) * ax + (jnp.reshape(index, -1) if jnp.ndim(index) == 0 else index,)


def _scalar_safe_update(update):
    """index_* on a 0-d tensor act on it as on a 1-element vector."""

    def lowering(input, dim, index, *args, **kwargs):
        if input.ndim == 0:
            source = [a.reshape(1) if hasattr(a, "ndim") and a.ndim == 0 else a for a in args]
            return update(input.reshape(1), 0, jnp.reshape(index, -1), *source, **kwargs).reshape(())
        return update(input, dim, index, *args, **kwargs)

    return lowering


@register_lowering(torch.index_select, T.index_select)
def index_select(input, dim, index):
    if input.ndim == 0:
        return input.reshape(1)[index.reshape(-1)].reshape(())
    return jnp.take(input, index.reshape(-1), axis=axis(dim, input.ndim))


@register_lowering(torch.index_add, T.index_add, inplace=(T.index_add_,))
@_scalar_safe_update
def index_add(input, dim, index, source, *, alpha=1):
    ax = axis(dim, input.ndim)
    return input.at[_dim_index(ax, index)].add(cast(source * alpha if alpha != 1 else source, input.dtype))


@register_lowering(torch.index_copy, T.index_copy, inplace=(T.index_copy_,))
@_scalar_safe_update
def index_copy(input, dim, index, source):
    return input.at[_dim_index(axis(dim, input.ndim), index)].set(cast(source, input.dtype))


@register_lowering(torch.index_fill, T.index_fill, inplace=(T.index_fill_,))
@_scalar_safe_update
def index_fill(input, dim, index, value):
    return input.at[_dim_index(axis(dim, input.ndim), index)].set(cast(value, input.dtype))


@register_lowering(torch.index_put, T.index_put, inplace=(T.index_put_,))
def index_put(input, indices, values, accumulate=False):
    at = input.at[tuple(indices)]
    values = cast(values, input.dtype)
    return at.add(values) if accumulate else at.set(values)


@register_lowering(torch.take, T.take)
def take(input, index):
    return input.reshape(-1)[index]


@register_lowering(torch.take_along_dim, T.take_along_dim)
def take_along_dim(input, indices, dim=None):
    if dim is None:
        return jnp.take_along_axis(input.reshape(-1), indices.reshape(-1), axis=0)
    ax = axis(dim, input.ndim)
    shape = jnp.broadcast_shapes(
        input.shape[:ax] + (1,) + input.shape[ax + 1 :], indices.shape[:ax] + (1,) + indices.shape[ax + 1 :]
    )
    x = jnp.broadcast_to(input, shape[:ax] + (input.shape[ax],) + shape[ax + 1 :])
    i = jnp.broadcast_to(indices, shape[:ax] + (indices.shape[ax],) + shape[ax + 1 :])
    return jnp.take_along_axis(x, i, axis=ax)


@register_lowering(torch.masked_scatter, T.masked_scatter, inplace=(T.masked_scatter_,))
def masked_scatter(input, mask, source):
    input, mask = jnp.broadcast_arrays(input, mask)
    mask = mask.reshape(-1)
    position = jnp.cumsum(mask) - 1
    picked = source.reshape(-1)[jnp.clip(position, 0, source.size - 1)]
    return jnp.where(mask, cast(picked, input.dtype), input.reshape(-1)).reshape(input.shape)


@register_lowering(torch.nonzero, T.nonzero, torch.argwhere, T.argwhere)  # argwhere(x) is nonzero(x)
def nonzero(input, *, as_tuple=False):
    if input.ndim == 0:
        count = int(input != 0)  # data-dependent size: concrete values only
        return (jnp.zeros((count,), _INT),) if as_tuple else jnp.zeros((count, 0), _INT)
    found = jnp.nonzero(input)  # data-dependent size: concrete values only
    if as_tuple:
        return tuple(f.astype(_INT) for f in found)
    return jnp.stack(found, axis=1).astype(_INT) if found else jnp.zeros((0, 0), _INT)


@register_lowering(F.one_hot)
def one_hot(tensor, num_classes=-1):
    if num_classes < 0:
        num_classes = int(jnp.max(tensor)) + 1
    return jax.nn.one_hot(tensor, num_classes, dtype=_INT)


@register_lowering(torch.searchsorted)
def searchsorted(sorted_sequence, input, *, out_int32=False, right=False, side=None, sorter=None):
    side = side or ("right" if right else "left")
    seq = sorted_sequence if sorter is None else jnp.take_along_axis(sorted_sequence, sorter, axis=-1)
    if seq.ndim == 1:
        out = jnp.searchsorted(seq, input, side=side)
    else:
        out = jax.vmap(lambda s, v: jnp.searchsorted(s, v, side=side))(
            seq.reshape(-1, seq.shape[-1]), jnp.asarray(input).reshape(-1, jnp.shape(input)[-1])
        ).reshape(jnp.shape(input))
    return out.astype(jnp.int32 if out_int32 else _INT)


@register_lowering(torch.bucketize)
def bucketize(input, boundaries, *, out_int32=False, right=False):
    out = jnp.searchsorted(boundaries, input, side="right" if right else "left")
    return out.astype(jnp.int32 if out_int32 else _INT)


@register_lowering(torch.ops.aten.index, torch.ops.aten.index.Tensor)
def aten_index(input, indices):
    """ATen's advanced indexing (``x[i, j]`` with index tensors; None keeps a dimension whole), which
    ``torch.ops.aten.index`` reaches directly: Hugging Face's vmapped masks and flex attention's score
    functions index through torch's ``ModIndex``."""
    return input[tuple(slice(None) if index is None else index for index in indices)]


@register_lowering("flex_lib::zeros_and_scatter")
def zeros_and_scatter(shape, indices, values):
    """``ModIndex``'s backward: the gradient of ``aten.index``, ``values`` summed into zeros at ``indices``."""
    return jnp.zeros(tuple(shape), values.dtype).at[tuple(indices)].add(values)
