"""``torch.nn.init``: a module's own initialisation code, run on the bridge's tensors.

Most of it is tensor methods the bridge lowers one by one. Lowered here: the functions that dispatch to the
bridge as a whole (``uniform_``, ``normal_``, ``constant_``, ``kaiming_uniform_``), and, under
``jax_initialisers()``, ``trunc_normal_`` and ``orthogonal_`` (a loop on values, an in-place transpose).
Draws come from the session's random stream; half-precision tensors are drawn in float32 and rounded, as torch.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import torch

from jmp.errors import LoweringError
from jmp.torch_bridge.lowering.random import next_key
from jmp.torch_bridge.registry import LOWERINGS, register_lowering
from jmp.torch_bridge.tensor import JaxTensor

init = torch.nn.init
_LOWERED: dict[str, Callable] = {}  # torch.nn.init function name -> its torch function


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
            tensor.set_value(fill(tuple(tensor.shape), tensor.value.dtype, **arguments))
            return tensor

        return fill

    return decorate


def _draw_dtype(dtype: jnp.dtype) -> jnp.dtype:
    return jnp.float32 if jnp.finfo(dtype).bits < 32 else dtype


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


@_in_place(init.constant_)
def constant_(shape, dtype, val):
    return jnp.full(shape, val, dtype)


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


def _fans(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) < 2:
        raise ValueError("Fan in and fan out can not be computed for tensor with fewer than 2 dimensions")
    receptive = math.prod(shape[2:])
    return shape[1] * receptive, shape[0] * receptive


def _trunc_normal(tensor, mean, std, a, b, generator=None):
    lower, upper = (a - mean) / std, (b - mean) / std
    dtype = tensor.value.dtype
    draw = jax.random.truncated_normal(next_key(), lower, upper, tuple(tensor.shape), _draw_dtype(dtype))
    tensor.set_value(jnp.clip(mean + std * draw, a, b).astype(dtype))
    return tensor


def _orthogonal(tensor, gain=1, generator=None):
    if tensor.ndim < 2:
        raise ValueError("Only tensors with 2 or more dimensions are supported")
    if tensor.numel() == 0:
        return tensor
    rows, cols = tensor.shape[0], tensor.numel() // tensor.shape[0]
    dtype = tensor.value.dtype
    flat = jax.random.normal(next_key(), (rows, cols), _draw_dtype(dtype))
    if rows < cols:
        flat = flat.T
    q, r = jnp.linalg.qr(flat)
    q = q * jnp.sign(jnp.diagonal(r))  # uniform over the orthogonal group, as torch makes it
    if rows < cols:
        q = q.T
    tensor.set_value((gain * q).reshape(tuple(tensor.shape)).astype(dtype))
    return tensor


# torch.nn.init's name -> (its function, the JAX version for the bridge's tensors)
_REPLACED = {"_no_grad_trunc_normal_": _trunc_normal, "orthogonal_": _orthogonal}


def _for_bridge_tensors(jax_version: Callable, torch_version: Callable) -> Callable:
    def either(tensor, *args, **kwargs):
        chosen = jax_version if isinstance(tensor, JaxTensor) else torch_version
        return chosen(tensor, *args, **kwargs)

    return either


@contextlib.contextmanager
def jax_initialisers() -> Iterator[None]:
    """While inside, ``trunc_normal_`` and ``orthogonal_`` (also under Hugging Face's wrappers) are JAX draws."""
    hugging_face = sys.modules.get("transformers.initialization")
    targets = [(vars(init), name, jax_version) for name, jax_version in _REPLACED.items()]
    table = getattr(hugging_face, "TORCH_INIT_FUNCTIONS", None)
    if isinstance(table, dict) and "orthogonal_" in table:
        targets.append((table, "orthogonal_", _orthogonal))
    originals = [(namespace, name, namespace[name]) for namespace, name, _ in targets]
    for namespace, name, jax_version in targets:
        namespace[name] = _for_bridge_tensors(jax_version, namespace[name])
    aliases = []
    for name, torch_fn in _LOWERED.items():
        own = getattr(hugging_face, name, None)
        if own is not None and own is not torch_fn and own not in LOWERINGS:
            aliases.append(own)
            LOWERINGS[own] = LOWERINGS[torch_fn]
    try:
        yield
    finally:
        for namespace, name, original in reversed(originals):
            namespace[name] = original
        for own in aliases:
            LOWERINGS.pop(own, None)
