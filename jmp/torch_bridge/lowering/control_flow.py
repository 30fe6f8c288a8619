"""Torch's higher-order ops lowered to their ``jax.lax`` counterparts (routed here by ``higher_order_ops.py``).

The user's torch functions run on the bridge's tensors inside the primitive's trace; gradients are the primitives'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jmp.torch_bridge import padded_nonzero
from jmp.torch_bridge.higher_order_ops import FUNCTIONS
from jmp.torch_bridge.registry import register_lowering
from jmp.torch_bridge.tensor import unwrap_tree, wrap_tree


def _on_arrays(fn: Callable) -> Callable:
    """``fn`` (torch code) as a function of arrays: arguments wrapped as tensors, results unwrapped."""

    def call(*arrays: Any) -> Any:
        return unwrap_tree(padded_nonzero.refuse(fn(*wrap_tree(arrays)), "a traced branch or loop body's output"))

    return call


def _concrete_bool(pred: Any) -> bool | None:
    """``pred`` as a Python bool when its value is known at trace time, else None."""
    if isinstance(pred, (bool, int, float)):
        return bool(pred)
    try:
        return bool(pred)
    except jax.errors.ConcretizationTypeError:
        return None


@register_lowering(FUNCTIONS.get("cond"))
def cond(pred, true_fn, false_fn, operands=()):
    operands = tuple(operands)
    known = _concrete_bool(pred)
    if known is not None:  # torch runs the one branch too when the predicate is a Python value
        return unwrap_tree((true_fn if known else false_fn)(*wrap_tree(operands)))
    return jax.lax.cond(jnp.reshape(pred, ()), _on_arrays(true_fn), _on_arrays(false_fn), *operands)


@register_lowering(FUNCTIONS.get("while_loop"))
def while_loop(cond_fn, body_fn, carried_inputs):
    carried = tuple(carried_inputs)

    def keep_going(state):
        return jnp.reshape(jnp.asarray(_on_arrays(cond_fn)(*state)), ())

    def step(state):
        return tuple(jnp.asarray(new, old.dtype) for new, old in zip(_on_arrays(body_fn)(*state), state, strict=True))

    return jax.lax.while_loop(keep_going, step, tuple(jnp.asarray(c) for c in carried))


@register_lowering(FUNCTIONS.get("scan"))
def scan(combine_fn, init, xs, *, dim=0, reverse=False):
    leading = jax.tree.map(lambda x: jnp.moveaxis(x, dim, 0), xs)
    carry, ys = jax.lax.scan(_on_arrays(combine_fn), init, leading, reverse=reverse)
    return carry, jax.tree.map(lambda y: jnp.moveaxis(y, 0, dim), ys)


@register_lowering(FUNCTIONS.get("associative_scan"))
def associative_scan(combine_fn, xs, dim, reverse=False, combine_mode="pointwise"):
    # both of torch's combine modes compute the same scan; "generic" only allows non-pointwise combine_fns,
    # which lax.associative_scan takes too (it calls combine_fn on whole slices along dim)
    axis = dim % jax.tree.leaves(xs)[0].ndim
    return jax.lax.associative_scan(_on_arrays(combine_fn), xs, reverse=reverse, axis=axis)


@register_lowering(FUNCTIONS.get("map"))
def map_(f, xs, *args):
    return jax.lax.map(lambda x: _on_arrays(f)(x, *args), xs)
