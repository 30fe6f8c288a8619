"""Writing a traced value into an NNX Variable by replacing it, cast and broadcast as ``variable[...] =`` would.

``variable[...] = tracer`` builds an error message that walks the whole trace, so each write is slower than the last.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


def write(variable: nnx.Variable, value: Any) -> None:
    """``variable[...] = value``."""
    if not isinstance(value, jax.core.Tracer):
        variable[...] = value  # a concrete array keeps the Variable's sharding
        return
    current = variable.get_value()
    variable.set_value(jnp.broadcast_to(value.astype(current.dtype), current.shape))
