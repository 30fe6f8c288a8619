"""``torch.nn.init``: a module's own initialisation code, run on the bridge's tensors.

Each ``torch.nn.init.*_`` fills its tensor in place with draws from the random stream of the running
session (JAX's counter-based generator, so a sharded draw equals the whole draw; torch's global generator
has no place in a compiled program). Fans, gains and bounds follow torch's formulas. Half-precision
tensors are drawn in float32 and rounded, as torch samples them at higher precision.

These functions dispatch to the bridge themselves (``handle_torch_function`` with the tensor as a keyword),
so their lowerings take the bridge's tensors (``raw``) and write into them.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch

from jmp.errors import LoweringError
from jmp.torch_bridge.lowering.random import next_key
from jmp.torch_bridge.registry import LOWERINGS, register_lowering
from jmp.torch_bridge.tensor import JaxTensor

init = torch.nn.init
_LOWERED: dict[str, Callable] = {}  # torch.nn.init function name -> its torch function


def lower_like_torch(namespace: Any) -> None:
    """Lower the functions of ``namespace`` named as ``torch.nn.init``'s as torch's.

    For libraries that install their own wrappers into ``torch.nn.init`` while their initialisation code runs
    (Hugging Face's ``guard_torch_init_functions``): torch's functions then dispatch under the wrapper's name.
    """
    for name, torch_fn in _LOWERED.items():
        own = getattr(namespace, name, None)
        if own is not None and own is not torch_fn:
            LOWERINGS[own] = LOWERINGS[torch_fn]


def _in_place(torch_fn: Callable) -> Callable:
    """Register ``fill(shape, dtype, **arguments) -> array`` as the in-place lowering of ``torch_fn``."""
    signature = inspect.signature(torch_fn)
    _LOWERED[torch_fn.__name__] = torch_fn

    def decorate(fill: Callable) -> Callable:
        @register_lowering(torch_fn, raw=True)
        def lowering(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = dict(bound.arguments)
            tensor = arguments.pop("tensor")
            arguments.pop("generator", None)
            if not isinstance(tensor, JaxTensor):
                raise LoweringError(f"torch.nn.init.{torch_fn.__name__} got a {type(tensor).__name__}, not a tensor")
            value = fill(tuple(tensor.shape), tensor.value.dtype, **arguments)
            tensor.set_value(value)
            return tensor

        return fill

    return decorate


def _draw_dtype(dtype: jnp.dtype) -> jnp.dtype:
    return jnp.float32 if jnp.finfo(dtype).bits < 32 else dtype


def _fans(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) < 2:
        raise ValueError("fan in and fan out can not be computed for a tensor with fewer than 2 dimensions")
    receptive = math.prod(shape[2:])
    return shape[1] * receptive, shape[0] * receptive


def _uniform(shape, dtype, low, high):
    return jax.random.uniform(next_key(), shape, _draw_dtype(dtype), low, high).astype(dtype)


def _normal(shape, dtype, mean, std):
    return (mean + std * jax.random.normal(next_key(), shape, _draw_dtype(dtype))).astype(dtype)


@_in_place(init.uniform_)
def uniform_(shape, dtype, a, b):
    return _uniform(shape, dtype, a, b)


@_in_place(init.normal_)
def normal_(shape, dtype, mean, std):
    return _normal(shape, dtype, mean, std)


@_in_place(init.trunc_normal_)
def trunc_normal_(shape, dtype, mean, std, a, b):
    lower, upper = (a - mean) / std, (b - mean) / std
    draw = jax.random.truncated_normal(next_key(), lower, upper, shape, _draw_dtype(dtype))
    return jnp.clip(mean + std * draw, a, b).astype(dtype)


@_in_place(init.constant_)
def constant_(shape, dtype, val):
    return jnp.full(shape, val, dtype)


@_in_place(init.ones_)
def ones_(shape, dtype):
    return jnp.ones(shape, dtype)


@_in_place(init.zeros_)
def zeros_(shape, dtype):
    return jnp.zeros(shape, dtype)


@_in_place(init.eye_)
def eye_(shape, dtype):
    if len(shape) != 2:
        raise ValueError("Only tensors with 2 dimensions are supported")
    return jnp.eye(*shape, dtype=dtype)


@_in_place(init.dirac_)
def dirac_(shape, dtype, groups):
    if len(shape) not in (3, 4, 5):
        raise ValueError("Only tensors with 3, 4, or 5 dimensions are supported")
    if shape[0] % groups:
        raise ValueError("dim 0 must be divisible by groups")
    out_per_group = shape[0] // groups
    value = jnp.zeros(shape, dtype)
    centre = tuple(size // 2 for size in shape[2:])
    for group in range(groups):
        for d in range(min(out_per_group, shape[1])):
            value = value.at[(group * out_per_group + d, d) + centre].set(1)
    return value


@_in_place(init.xavier_uniform_)
def xavier_uniform_(shape, dtype, gain):
    fan_in, fan_out = _fans(shape)
    bound = math.sqrt(3.0) * gain * math.sqrt(2.0 / float(fan_in + fan_out))
    return _uniform(shape, dtype, -bound, bound)


@_in_place(init.xavier_normal_)
def xavier_normal_(shape, dtype, gain):
    fan_in, fan_out = _fans(shape)
    return _normal(shape, dtype, 0.0, gain * math.sqrt(2.0 / float(fan_in + fan_out)))


def _kaiming_std(shape, a, mode, nonlinearity) -> float:
    if 0 in shape:
        return 0.0
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"Mode {mode} not supported, please use one of fan_in, fan_out")
    fan_in, fan_out = _fans(shape)
    return init.calculate_gain(nonlinearity, a) / math.sqrt(fan_in if mode == "fan_in" else fan_out)


@_in_place(init.kaiming_uniform_)
def kaiming_uniform_(shape, dtype, a, mode, nonlinearity):
    bound = math.sqrt(3.0) * _kaiming_std(shape, a, mode, nonlinearity)
    return _uniform(shape, dtype, -bound, bound)


@_in_place(init.kaiming_normal_)
def kaiming_normal_(shape, dtype, a, mode, nonlinearity):
    return _normal(shape, dtype, 0.0, _kaiming_std(shape, a, mode, nonlinearity))


@_in_place(init.orthogonal_)
def orthogonal_(shape, dtype, gain):
    if len(shape) < 2:
        raise ValueError("Only tensors with 2 or more dimensions are supported")
    if 0 in shape:
        return jnp.zeros(shape, dtype)
    rows, cols = shape[0], math.prod(shape[1:])
    flat = jax.random.normal(next_key(), (rows, cols), _draw_dtype(dtype))
    if rows < cols:
        flat = flat.T
    q, r = jnp.linalg.qr(flat)
    q = q * jnp.sign(jnp.diagonal(r))  # uniform over the orthogonal group, as torch makes it
    if rows < cols:
        q = q.T
    return (gain * q).reshape(shape).astype(dtype)


@_in_place(init.sparse_)
def sparse_(shape, dtype, sparsity, std):
    if len(shape) != 2:
        raise ValueError("Only tensors with 2 dimensions are supported")
    rows, cols = shape
    zeros_per_column = math.ceil(sparsity * rows)
    value = _normal(shape, dtype, 0.0, std)
    keys = jax.random.split(next_key(), cols)
    order = jax.vmap(lambda key: jax.random.permutation(key, rows))(keys).T  # (rows, cols)
    return jnp.where(order < zeros_per_column, jnp.zeros((), dtype), value)
