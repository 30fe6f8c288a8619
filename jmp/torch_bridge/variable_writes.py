"""Writing a traced value into an NNX Variable in time that does not grow with the trace.

``variable[...] = value`` compares ``value.sharding`` with the Variable's. On a tracer, ``.sharding`` raises, and
JAX first builds its error message, which walks the trace so far: 32 ms a write into a 6,000-equation trace, each
write slower than the last (a Llama's fp8 step at 8 layers spent 3.2 of its 5.4 s of tracing there, its Linears
recording their amaxes). A traced value is a new value for the whole Variable, so it replaces it outright, cast
and broadcast as ``variable[...] = value`` would.
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
