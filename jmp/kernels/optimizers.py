"""Fused optimizer updates: each a Pallas kernel over all of a param group's tensors, as an optax transformation.

``fused_adam``, ``fused_sgd`` and ``fused_adagrad`` compute what ``jmp.torch_optimizers``' optax chains for
``torch.optim.Adam`` / ``AdamW``, ``SGD`` and ``Adagrad`` compute, in the same order of operations, and keep
the same state types (so torch-format state dicts and checkpoints read them alike). One pass reads gradient,
parameter and state and writes the update and the new state; the tensors of each dtype go through one
``pallas_call`` (see ``jmp.kernels.multi_tensor``). Like any optax transformation, the result is an update to
add with ``optax.apply_updates``.

``interpret=True`` runs the kernels in Pallas' interpret mode: on a CPU (which Pallas does not compile for)
they then give the compiled kernels' numbers, slowly; this is how the tests check them without a GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jmp import torch_optimizers
from jmp.kernels import multi_tensor
from jmp.torch_optimizers import TorchAdagradState, TorchMomentumState


def _update_by_dtype(
    body: Callable[..., tuple[jax.Array, ...]],
    scalars: jax.Array,
    columns: Sequence[Sequence[jax.Array]],
    outputs: int,
    *,
    interpret: bool,
    name: str,
) -> list[list[jax.Array]]:
    """The first ``outputs`` of ``columns`` (lists of tensors, the parameters last) after ``body``: one kernel
    launch per parameter dtype."""
    count = len(columns[0])
    result: list[list[Any]] = [[None] * count for _ in range(outputs)]
    by_dtype: dict[jnp.dtype, list[int]] = {}
    for i, param in enumerate(columns[-1]):
        by_dtype.setdefault(jnp.dtype(param.dtype), []).append(i)
    for dtype, indices in by_dtype.items():
        buffers = [multi_tensor.pack([column[i] for i in indices], dtype) for column in columns]
        new = multi_tensor.elementwise(body, scalars, buffers, outputs, interpret=interpret, name=f"{name}_{dtype}")
        for k in range(outputs):
            for i, tensor in zip(indices, multi_tensor.unpack(new[k], [columns[k][i] for i in indices])):
                result[k][i] = tensor
    return result


def _leaves(*trees: Any) -> tuple[list[list[jax.Array]], Any]:
    """Each tree's leaves (masked entries of ``optax.multi_transform`` have none) and the first one's structure."""
    flat = [jax.tree.flatten(tree) for tree in trees]
    return [leaves for leaves, _ in flat], flat[0][1]


# --- Adam, AdamW ----------------------------------------------------------------------------------------------


def _adam_body(decoupled: bool, maximize: bool):
    def body(s, g, m, v, p):
        lr, b1, b2, eps, weight_decay, correction1, correction2, keep1, keep2 = (s[i] for i in range(9))
        if maximize:
            g = -1.0 * g
        if not decoupled:
            g = g + weight_decay * p  # L2: on the gradient, before the moments
        m = keep1 * g + b1 * m
        v = keep2 * (g * g) + b2 * v
        update = (m / correction1) / (jnp.sqrt(v / correction2 + 0.0) + eps)
        if decoupled:
            update = update + weight_decay * p
        return -lr * update, m, v

    return body


def fused_adam(
    lr, beta1, beta2, eps, weight_decay, *, amsgrad=False, maximize=False, decoupled=False, interpret=False
) -> optax.GradientTransformation:
    """torch's ``Adam`` (``decoupled=True``: ``AdamW``) in one kernel per dtype; state ``ScaleByAdamState``."""
    if amsgrad:
        raise ValueError("fused_adam has no AMSGrad; use jmp.torch_optimizers.adam(..., amsgrad=True)")
    body = _adam_body(decoupled, maximize)

    def init(params):
        zeros = optax.tree.zeros_like(params)
        return optax.ScaleByAdamState(jnp.zeros([], jnp.int32), zeros, optax.tree.zeros_like(params))

    def update(updates, state, params=None):
        count = optax.safe_increment(state.count)
        (grads, mu, nu, ps), treedef = _leaves(updates, state.mu, state.nu, params)
        if not grads:
            return updates, optax.ScaleByAdamState(count, state.mu, state.nu)
        scalars = multi_tensor.scalar_vector(
            lr, beta1, beta2, eps, weight_decay, 1 - beta1**count, 1 - beta2**count, 1 - beta1, 1 - beta2
        )
        new, mu, nu = _update_by_dtype(
            body, scalars, [grads, mu, nu, ps], 3, interpret=interpret, name="adamw" if decoupled else "adam"
        )
        new_state = optax.ScaleByAdamState(count, jax.tree.unflatten(treedef, mu), jax.tree.unflatten(treedef, nu))
        return jax.tree.unflatten(treedef, new), new_state

    return optax.GradientTransformation(init, update)


def fused_adamw(lr, beta1, beta2, eps, weight_decay, *, amsgrad=False, maximize=False, interpret=False):
    """torch's ``AdamW``: weight decay scaled by the learning rate, outside the moments."""
    return fused_adam(
        lr, beta1, beta2, eps, weight_decay, amsgrad=amsgrad, maximize=maximize, decoupled=True, interpret=interpret
    )


# --- SGD -------------------------------------------------------------------------------------------------------


def _sgd_body(nesterov: bool, maximize: bool, has_momentum: bool):
    def body(s, g, *rest):
        lr, momentum, keep, weight_decay, started = (s[i] for i in range(5))
        *buffer, p = rest
        if maximize:
            g = -1.0 * g
        g = g + weight_decay * p
        if not has_momentum:
            return (-lr * g,)
        b = jnp.where(started > 0.5, momentum * buffer[0] + keep * g, g)  # torch: the first buffer is the gradient
        direction = g + momentum * b if nesterov else b
        return -lr * direction, b

    return body


def fused_sgd(
    lr, momentum, dampening, weight_decay, *, nesterov, maximize, has_momentum, interpret=False
) -> optax.GradientTransformation:
    """torch's ``SGD`` (momentum, dampening, Nesterov) in one kernel per dtype; state ``TorchMomentumState``."""
    body = _sgd_body(nesterov, maximize, has_momentum)

    def init(params):
        if not has_momentum:
            return optax.EmptyState()
        return TorchMomentumState(optax.tree.zeros_like(params), jnp.zeros([], jnp.bool_))

    def update(updates, state, params=None):
        buffers = [state.momentum_buffer] if has_momentum else []
        (grads, *columns), treedef = _leaves(updates, *buffers, params)
        if grads:
            scalars = multi_tensor.scalar_vector(
                lr, momentum, 1 - dampening, weight_decay, state.started if has_momentum else 0.0
            )
            new = _update_by_dtype(body, scalars, [grads, *columns], 1 + has_momentum, interpret=interpret, name="sgd")
            updates = jax.tree.unflatten(treedef, new[0])
            if has_momentum:
                state = TorchMomentumState(jax.tree.unflatten(treedef, new[1]), jnp.ones([], jnp.bool_))
        return updates, state

    return optax.GradientTransformation(init, update)


# --- Adagrad ---------------------------------------------------------------------------------------------------


def _adagrad_body(maximize: bool):
    def body(s, g, total, p):
        lr, weight_decay, decay, eps = (s[i] for i in range(4))
        if maximize:
            g = -1.0 * g
        g = g + weight_decay * p
        total = total + g * g
        return -lr * (decay * g / (jnp.sqrt(total) + eps)), total

    return body


def fused_adagrad(
    lr, lr_decay, weight_decay, eps, *, initial_accumulator_value, maximize, interpret=False
) -> optax.GradientTransformation:
    """torch's ``Adagrad`` (``lr_decay``, eps outside the root) in one kernel per dtype; state
    ``TorchAdagradState``."""
    body = _adagrad_body(maximize)

    def init(params):
        return TorchAdagradState(jnp.zeros([], jnp.int32), optax.tree.full_like(params, initial_accumulator_value))

    def update(updates, state, params=None):
        count = state.count + 1
        (grads, total, ps), treedef = _leaves(updates, state.sum, params)
        if not grads:
            return updates, TorchAdagradState(count, state.sum)
        decay = 1.0 / (1.0 + (count - 1) * lr_decay)
        scalars = multi_tensor.scalar_vector(lr, weight_decay, decay, eps)
        new, total = _update_by_dtype(body, scalars, [grads, total, ps], 2, interpret=interpret, name="adagrad")
        return jax.tree.unflatten(treedef, new), TorchAdagradState(count, jax.tree.unflatten(treedef, total))

    return optax.GradientTransformation(init, update)


# --- which torch optimizers have a fused update ---------------------------------------------------------------

_FUSED = {
    torch_optimizers.adam: fused_adam,
    torch_optimizers.adamw: fused_adamw,
    torch_optimizers.sgd: fused_sgd,
    torch_optimizers.adagrad: fused_adagrad,
}


def fused_version(factory: Callable, static: dict[str, Any], *, interpret: bool) -> Callable | None:
    """The fused factory computing what ``factory`` (a ``jmp.torch_optimizers`` chain) computes with the options
    ``static``, None where there is none (Adadelta, RMSprop, AMSGrad)."""
    fused = _FUSED.get(factory)
    if fused is None or static.get("amsgrad"):
        return None
    return functools.partial(fused, interpret=interpret)
