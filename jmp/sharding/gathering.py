"""A parameter split over fsdp gathered for its use, its gradient handed back split as the parameter is stored."""

from __future__ import annotations

import functools
from typing import Any

import jax


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def gathered_for_use(value: jax.Array, used: Any, stored: Any) -> jax.Array:
    """``value`` gathered to the sharding ``used``; its gradient leaves split as the parameter is ``stored``.

    The transpose of the gathering constraint would ask for the weight's gradient gathered too: with tensor
    parallelism beside fsdp, XLA's partitioner then computed each Linear's weight gradient whole on every device
    from the whole global batch's activations, all-gathered (14 gathers a step for a 2-layer Llama at tp2 x fsdp2).
    Asked for the stored split, it reduce-scatters partial products, as FSDP does.
    """
    return jax.lax.with_sharding_constraint(value, used)


def _gather_forward(value, used, stored):
    return gathered_for_use(value, used, stored), None


def _gather_backward(used, stored, _, cotangent):
    return (jax.lax.with_sharding_constraint(cotangent, stored),)


gathered_for_use.defvjp(_gather_forward, _gather_backward)
