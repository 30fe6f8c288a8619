"""A parameter split over fsdp gathered for its use, its gradient handed back split as the parameter is stored."""

from __future__ import annotations

import functools
from typing import Any

import jax


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def gathered_for_use(value: jax.Array, used: Any, stored: Any) -> jax.Array:
    """``value`` gathered to the sharding ``used``; its gradient leaves split as the parameter is ``stored``.

    The constraint's own transpose would gather the gradient too, which with tp beside fsdp made XLA compute weight
    gradients whole from all-gathered activations; the stored split makes it reduce-scatter, as FSDP does.
    """
    return jax.lax.with_sharding_constraint(value, used)


def _gather_forward(value, used, stored):
    return gathered_for_use(value, used, stored), None


def _gather_backward(used, stored, _, cotangent):
    return (jax.lax.with_sharding_constraint(cotangent, stored),)


gathered_for_use.defvjp(_gather_forward, _gather_backward)
