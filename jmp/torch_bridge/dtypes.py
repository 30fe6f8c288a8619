"""Torch <-> JAX dtypes; without ``jax_enable_x64``, int64 / float64 are int32 / float32 (int32 reported as int64)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

# the dtypes torch and JAX both have, which they name alike
_SHARED = "float32 float64 float16 bfloat16 int64 int32 int16 int8 uint8 uint16 uint32 uint64 bool complex64 complex128"
_TORCH_TO_JAX = {getattr(torch, name): jnp.dtype(name) for name in _SHARED.split()}
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
