"""Torch's type promotion (operand ranks before categories), computed by torch on meta tensors, memoised."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as Kind
from torch._prims_common import elementwise_dtypes

from jmp.torch_bridge.dtypes import to_jax_dtype, to_torch_dtype

_SCALAR_EXAMPLES = {bool: True, int: 1, float: 1.0, complex: 1j}


def _signature(operand: Any) -> Any:
    if isinstance(operand, (jax.Array, np.ndarray)):
        return (to_torch_dtype(operand.dtype), operand.ndim > 0)
    for kind in (bool, int, float, complex):
        if isinstance(operand, kind):
            return kind
    return None


@functools.cache
def _promote(signatures: tuple, kind: Kind) -> Any:
    examples = []
    for sig in signatures:
        if isinstance(sig, tuple):
            dtype, has_dims = sig
            examples.append(torch.empty((1,) if has_dims else (), dtype=dtype, device="meta"))
        elif sig is not None:
            examples.append(_SCALAR_EXAMPLES[sig])
    _, result = elementwise_dtypes(*examples, type_promotion_kind=kind)
    return to_jax_dtype(result)


def result_dtype(*operands: Any, kind: Kind = Kind.DEFAULT) -> Any:
    """The JAX dtype torch would give an elementwise op on ``operands``."""
    return _promote(tuple(_signature(o) for o in operands), kind)


def cast(value: Any, dtype: Any) -> Any:
    if isinstance(value, jax.Array):
        return value if value.dtype == dtype else value.astype(dtype)
    return jnp.asarray(value, dtype=dtype)


def promoted(*operands: Any, kind: Kind = Kind.DEFAULT) -> list:
    """``operands`` cast to their torch-promoted dtype."""
    dtype = result_dtype(*operands, kind=kind)
    return [cast(o, dtype) for o in operands]


INT_TO_FLOAT = Kind.INT_TO_FLOAT
ALWAYS_BOOL = Kind.ALWAYS_BOOL
DEFAULT = Kind.DEFAULT
