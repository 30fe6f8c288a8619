"""Torch <-> JAX dtypes; without ``jax_enable_x64``, int64 / float64 are int32 / float32 (int32 reported as int64)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

_TORCH_TO_JAX = {
    torch.float32: jnp.float32,
    torch.float64: jnp.float64,
    torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16,
    torch.int64: jnp.int64,
    torch.int32: jnp.int32,
    torch.int16: jnp.int16,
    torch.int8: jnp.int8,
    torch.uint8: jnp.uint8,
    torch.uint16: jnp.uint16,
    torch.uint32: jnp.uint32,
    torch.uint64: jnp.uint64,
    torch.bool: jnp.bool_,
    torch.complex64: jnp.complex64,
    torch.complex128: jnp.complex128,
}
_JAX_TO_TORCH = {np.dtype(v): k for k, v in _TORCH_TO_JAX.items()}


def x64_enabled() -> bool:
    return bool(jax.config.jax_enable_x64)


def to_jax_dtype(dtype: torch.dtype | None):
    """The JAX dtype that carries values of torch ``dtype`` (None stays None)."""
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype):
        return jnp.dtype(dtype)
    try:
        return jax.dtypes.canonicalize_dtype(_TORCH_TO_JAX[dtype])
    except KeyError:
        raise TypeError(f"torch dtype {dtype} has no JAX equivalent") from None


def to_torch_dtype(dtype) -> torch.dtype:
    """The torch dtype reported for a JAX array of ``dtype``."""
    dtype = np.dtype(dtype)
    if not x64_enabled() and dtype == np.int32:
        return torch.int64
    try:
        return _JAX_TO_TORCH[dtype]
    except KeyError:
        raise TypeError(f"JAX dtype {dtype} has no torch equivalent") from None


def default_float():
    """JAX dtype of torch's current default floating dtype."""
    return to_jax_dtype(torch.get_default_dtype())


def is_floating(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)
