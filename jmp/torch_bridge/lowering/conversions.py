"""Dtype and device conversions (devices are sharding's business: ``.to(device)`` keeps the value), Python values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jmp.torch_bridge.dtypes import to_jax_dtype
from jmp.torch_bridge.registry import getter, method, register_lowering

T = torch.Tensor


def _astype(x, dtype):
    dtype = to_jax_dtype(dtype)
    return x if x.dtype == dtype else x.astype(dtype)


@register_lowering(T.to)
def to(input, *args, **kwargs):
    dtype = kwargs.get("dtype")
    for arg in args:
        if isinstance(arg, torch.dtype):
            dtype = arg
        elif hasattr(arg, "dtype") and hasattr(arg, "shape"):  # .to(other_tensor)
            return _astype(input, arg.dtype)
    return input if dtype is None else _astype(input, dtype)


@register_lowering(T.type)
def type(input, dtype=None, non_blocking=False, **kwargs):
    if dtype is None:
        raise TypeError("tensor.type() without a dtype returns a type name, which has no JAX meaning")
    if isinstance(dtype, str):
        dtype = _LEGACY_TYPE_NAMES[dtype.rsplit(".", 1)[-1]]
    return _astype(input, dtype)


_LEGACY_TYPE_NAMES = {
    "FloatTensor": torch.float32,
    "DoubleTensor": torch.float64,
    "HalfTensor": torch.float16,
    "BFloat16Tensor": torch.bfloat16,
    "LongTensor": torch.int64,
    "IntTensor": torch.int32,
    "ShortTensor": torch.int16,
    "CharTensor": torch.int8,
    "ByteTensor": torch.uint8,
    "BoolTensor": torch.bool,
}


@register_lowering(T.type_as)
def type_as(input, other):
    return _astype(input, other.dtype)


def _cast_method(dtype):
    def lowering(input, memory_format=None):
        return _astype(input, dtype)

    return lowering


for _name, _dtype in {
    "float": torch.float32,
    "double": torch.float64,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "int": torch.int32,
    "long": torch.int64,
    "short": torch.int16,
    "char": torch.int8,
    "byte": torch.uint8,
    "bool": torch.bool,
    "cfloat": torch.complex64,
    "cdouble": torch.complex128,
}.items():
    register_lowering(method(_name))(_cast_method(_dtype))


@register_lowering(T.cpu, method("cuda"), method("pin_memory"))
def same_place(input, *args, **kwargs):
    return input


@register_lowering(torch.real, getter("real"))
def real(input):
    return jnp.real(input)


@register_lowering(torch.imag, getter("imag"))
def imag(input):
    return jnp.imag(input)


@register_lowering(T.item)
def item(input):
    """A Python number; under ``jit`` the traced 0-d value itself, so arithmetic and comparisons on it go on
    (``assert x.max().item() <= n`` becomes a value check) and only a use that needs the number fails."""
    if input.size != 1:
        raise ValueError(f"item() needs a tensor with one element, not {input.size}")
    if isinstance(input, jax.core.Tracer):
        return input.reshape(())
    return np.asarray(input).reshape(()).item()


@register_lowering(T.__array__, method("numpy"))
def to_numpy(input, dtype=None, *args, **kwargs):
    """A host copy (concrete values only: under jit this raises a TracedControlFlowError)."""
    return np.asarray(input, dtype=dtype)


@register_lowering(T.tolist)
def tolist(input):
    return np.asarray(input).tolist()


def _python_conversion(convert):
    """``bool(x)``, ``int(x)``, ...: concrete values only (under jit they raise a TracedControlFlowError)."""

    def lowering(input):
        return convert(input)

    return lowering


_PYTHON_CONVERSIONS = {T.__bool__: bool, T.__int__: int, T.__index__: int, T.__float__: float, T.__complex__: complex}
for _method, _convert in _PYTHON_CONVERSIONS.items():
    register_lowering(_method)(_python_conversion(_convert))


@register_lowering(T.__format__)
def format_(input, format_spec):
    if isinstance(input, jax.core.Tracer):
        return f"JaxTensor(shape={tuple(input.shape)}, dtype={input.dtype}, traced)"
    value = np.asarray(input)
    return format(value.item() if value.size == 1 and value.ndim == 0 else value, format_spec)
