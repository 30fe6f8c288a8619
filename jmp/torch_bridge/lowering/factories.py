"""Tensor factories (``arange``, ``zeros``, ``full``, ``tensor``, ``*_like``, ``new_*``); memory options are ignored."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jmp.torch_bridge.dtypes import default_float, to_jax_dtype
from jmp.torch_bridge.lowering.arguments import size_arguments, sizes
from jmp.torch_bridge.registry import register_lowering

T = torch.Tensor


def _scalar_dtype(value):
    """Torch's dtype for a tensor made from a Python scalar."""
    if isinstance(value, bool):
        return jnp.bool_
    if isinstance(value, int):
        return to_jax_dtype(torch.int64)
    if isinstance(value, complex):
        return jnp.complex64
    if isinstance(value, jax.Array):
        return value.dtype
    return default_float()


def _dtype(dtype, fallback):
    return to_jax_dtype(dtype) if dtype is not None else fallback


@register_lowering(torch.arange)
def arange(start, end=None, step=1, *, dtype=None, **placement):
    if end is None:
        start, end = 0, start
    values = [start, end, step]
    if dtype is None:
        integral = all(
            isinstance(v, int) or (isinstance(v, jax.Array) and jnp.issubdtype(v.dtype, jnp.integer)) for v in values
        )
        dtype = to_jax_dtype(torch.int64) if integral else default_float()
    else:
        dtype = to_jax_dtype(dtype)
    start, end, step = (v.item() if isinstance(v, jax.Array) else v for v in values)
    return jnp.arange(start, end, step, dtype=dtype)


@register_lowering(torch.range)
def range_(start, end, step=1, *, dtype=None, **placement):
    count = int(np.floor((end - start) / step)) + 1
    return (start + jnp.arange(count) * step).astype(_dtype(dtype, default_float()))


@register_lowering(torch.linspace)
def linspace(start, end, steps, *, dtype=None, **placement):
    return jnp.linspace(start, end, steps, dtype=_dtype(dtype, default_float()))


@register_lowering(torch.logspace)
def logspace(start, end, steps, base=10.0, *, dtype=None, **placement):
    return jnp.logspace(start, end, steps, base=base, dtype=_dtype(dtype, default_float()))


@register_lowering(torch.zeros, torch.empty)
def zeros(*size, dtype=None, **placement):
    placement.pop("names", None)
    return jnp.zeros(size_arguments(size, placement), _dtype(dtype, default_float()))


@register_lowering(torch.ones)
def ones(*size, dtype=None, **placement):
    return jnp.ones(size_arguments(size, placement), _dtype(dtype, default_float()))


@register_lowering(torch.full)
def full(size, fill_value, *, dtype=None, **placement):
    return jnp.full(sizes((size,)), fill_value, _dtype(dtype, _scalar_dtype(fill_value)))


@register_lowering(torch.eye)
def eye(n, m=None, *, dtype=None, **placement):
    return jnp.eye(n, m, dtype=_dtype(dtype, default_float()))


@register_lowering(torch.zeros_like, torch.empty_like)
def zeros_like(input, *, dtype=None, **placement):
    return jnp.zeros(input.shape, _dtype(dtype, input.dtype))


@register_lowering(torch.ones_like)
def ones_like(input, *, dtype=None, **placement):
    return jnp.ones(input.shape, _dtype(dtype, input.dtype))


@register_lowering(torch.full_like)
def full_like(input, fill_value, *, dtype=None, **placement):
    return jnp.full(input.shape, fill_value, _dtype(dtype, input.dtype))


@register_lowering(T.new_zeros, T.new_empty)
def new_zeros(input, *size, dtype=None, **placement):
    return jnp.zeros(size_arguments(size, placement), _dtype(dtype, input.dtype))


@register_lowering(T.new)
def new(input, *args, **placement):
    """The legacy ``x.new(*sizes)`` (uninitialised in torch: zeros here) or ``x.new(data)``."""
    if len(args) == 1 and not isinstance(args[0], (int, torch.Size)):
        return jnp.asarray(args[0], _dtype(None, input.dtype))
    return new_zeros(input, *args, **placement)


@register_lowering(T.new_ones)
def new_ones(input, *size, dtype=None, **placement):
    return jnp.ones(size_arguments(size, placement), _dtype(dtype, input.dtype))


@register_lowering(T.new_full)
def new_full(input, size, fill_value, *, dtype=None, **placement):
    return jnp.full(sizes((size,)), fill_value, _dtype(dtype, input.dtype))


@register_lowering(T.new_tensor)
def new_tensor(input, data, *, dtype=None, **placement):
    return jnp.asarray(data, _dtype(dtype, input.dtype))


def _infer_data_dtype(data):
    leaves = jax.tree.leaves(data)
    if any(isinstance(v, (jax.Array, np.ndarray)) for v in leaves):
        return None
    if leaves and all(isinstance(v, bool) for v in leaves):
        return jnp.bool_
    if leaves and all(isinstance(v, int) for v in leaves):
        return to_jax_dtype(torch.int64)
    if any(isinstance(v, complex) for v in leaves):
        return jnp.complex64
    return default_float()


@register_lowering(torch.tensor, torch.as_tensor, torch.asarray)
def tensor(data, *, dtype=None, **placement):
    if isinstance(data, (list, tuple)) and any(isinstance(v, jax.Array) for v in jax.tree.leaves(data)):
        data = jnp.stack([jnp.asarray(v) for v in data])
    return jnp.asarray(data, _dtype(dtype, _infer_data_dtype(data)))


@register_lowering(torch.scalar_tensor)
def scalar_tensor(s, *, dtype=None, **placement):
    return jnp.asarray(s, _dtype(dtype, default_float()))


@register_lowering(torch.tril_indices)
def tril_indices(row, col, offset=0, *, dtype=None, **placement):
    return jnp.stack(jnp.tril_indices(row, offset, col)).astype(_dtype(dtype, to_jax_dtype(torch.int64)))


@register_lowering(torch.triu_indices)
def triu_indices(row, col, offset=0, *, dtype=None, **placement):
    return jnp.stack(jnp.triu_indices(row, offset, col)).astype(_dtype(dtype, to_jax_dtype(torch.int64)))


@register_lowering(torch.fill, inplace=(T.fill_,))
def fill(input, value):
    return jnp.full(input.shape, value, input.dtype)


@register_lowering(inplace=(T.zero_,))
def zero(input):
    return jnp.zeros_like(input)


@register_lowering(inplace=(T.copy_,))
def copy(input, src, non_blocking=False):
    return jnp.broadcast_to(src, input.shape).astype(input.dtype)
