"""Around the optimizer's rule: unscale the gradients, clip them (torch's or apex LAMB's rule), skip inf/nan steps.

``step_scalars`` gives both update paths the same three scalars (``grad_scale``, ``grad_divisor``, ``skip``);
the kernels take them as arguments and ``taking_step_scalars`` makes an optax chain read them. optax's own
pieces differ: ``clip_by_global_norm`` has no torch ``1e-6``, ``scale`` keeps a half dtype, and
``apply_if_finite`` changes the state tree and returns zero updates instead of keeping the parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jmp.optim import torch_rules
from jmp.precision import loss_scaling


def torch_clip_factor(norm: jax.Array, max_norm: float | jax.Array) -> jax.Array:
    """What torch's ``clip_grad_norm_`` multiplies gradients of total norm ``norm`` by: at most 1."""
    return jnp.minimum(1.0, max_norm / (norm + 1e-6))


def torch_norm_and_factor(grads: Any, max_norm: float | jax.Array, inv_scale: jax.Array) -> tuple[jax.Array, Any]:
    """(norm, factor): the global 2-norm of the gradients times ``inv_scale`` (float32), and torch's clipping factor."""
    norm = optax.global_norm(loss_scaling.unscaled(grads, inv_scale))
    return norm, torch_clip_factor(norm, max_norm)


@jax.jit
def has_inf(grads: Any) -> jax.Array:
    """A device bool: whether a gradient holds an inf/nan (in its own dtype)."""
    return jnp.logical_not(loss_scaling.all_finite(grads))


@functools.partial(jax.jit, static_argnames=("counted_once",))
def reported_norm_and_factor(
    grads: Any, max_norm: jax.Array, loss_scale: jax.Array, *, counted_once: Callable[[Any], Any]
) -> tuple[jax.Array, Any]:
    """(norm, factor) of torch's ``clip_grad_norm_`` on the unscaled float32 ``counted_once`` gradients; an inf/nan norm
    is -1, as SMP reports it (the gradients stay non-finite and the update is skipped)."""
    norm, factor = torch_norm_and_factor(counted_once(grads), max_norm, 1.0 / loss_scale)
    return jnp.where(jnp.isfinite(norm), norm, -1.0), factor


def prepared(grads: Any, grad_scale: jax.Array, grad_divisor: jax.Array | None = None) -> Any:
    """The gradients as the rule takes them: float32, times ``grad_scale``, over ``grad_divisor`` (if given)."""
    grads = loss_scaling.unscaled(grads, grad_scale)
    if grad_divisor is None:
        return grads
    return jax.tree.map(lambda g: g / grad_divisor, grads)


def unscale(grad_scale: jax.Array, grad_divisor: jax.Array | None = None) -> optax.GradientTransformation:
    """:func:`prepared` as a (stateless) optax transformation."""
    return optax.stateless(lambda updates, params: prepared(updates, grad_scale, grad_divisor))


class StepScalars(NamedTuple):
    """What this step does to the gradients besides the optimizer's rule (the fused kernels' extra arguments)."""

    grad_scale: jax.Array  # 1 / loss scale, times torch's clipping factor
    grad_divisor: jax.Array | None  # apex LAMB's clipping: norm / max_norm above it (None: no such clipping)
    skip: jax.Array  # the update is skipped: an inf/nan gradient (when checked) or one known before


def step_scalars(
    grads: Any,
    inv_scale: jax.Array,
    known_inf: jax.Array,
    *,
    clip: float,
    clip_before: float,
    checked: bool,
    counted_once: Callable[[Any], Any],
) -> StepScalars:
    """This step's scalars, from gradients multiplied by ``1 / inv_scale``.

    ``clip``: torch's ``clip_grad_norm_`` to this norm (0: none); ``clip_before``: apex LAMB's, after it.
    ``checked``: an inf/nan gradient skips the update. ``counted_once``: the gradients with each parameter once,
    for the norms (a pipeline copies tied parameters).
    """
    if clip:
        inv_scale = inv_scale * torch_norm_and_factor(counted_once(grads), clip, inv_scale)[1]
    divisor = None
    if clip_before > 0:
        divisor = torch_rules.apex_clip_divisor(loss_scaling.unscaled(counted_once(grads), inv_scale), clip_before)
    skip = known_inf
    if checked:
        skip = jnp.logical_or(known_inf, jnp.logical_not(loss_scaling.all_finite(prepared(grads, inv_scale, divisor))))
    return StepScalars(inv_scale, divisor, skip)


def kept_on_skip(skip: jax.Array, new: Any, old: Any, *, scalars_only: bool = False) -> Any:
    """``new``, or ``old`` where ``skip``; with ``scalars_only`` only the 0-d leaves (kernels keep their tensors)."""

    def keep(new_leaf, old_leaf):
        if scalars_only and jnp.ndim(new_leaf) != 0:
            return new_leaf
        return jnp.where(skip, old_leaf, new_leaf)

    return jax.tree.map(keep, new, old)


def taking_step_scalars(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``inner``, taking the fused kernels' extra arguments (``StepScalars``' fields, ``return_params``) with their
    meaning; its state is ``inner``'s. ``skip=None``: nothing is checked."""

    def update(updates, state, params=None, *, grad_scale=1.0, grad_divisor=None, skip=None, return_params=False):
        grads, _ = unscale(grad_scale, grad_divisor).update(updates, optax.EmptyState())
        steps, new_state = inner.update(grads, state, params)
        new = optax.apply_updates(params, steps) if return_params else steps
        if skip is None:
            return new, new_state
        old = params if return_params else jax.tree.map(jnp.zeros_like, steps)
        return kept_on_skip(skip, (new, new_state), (old, state))

    return optax.GradientTransformationExtraArgs(inner.init, update)
