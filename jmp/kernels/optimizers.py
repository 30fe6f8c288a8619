"""Fused optimizer updates: each a Pallas kernel over all of a param group's tensors, as an optax transformation.

``fused_adam``, ``fused_sgd``, ``fused_adagrad`` and ``fused_lamb`` compute what ``jmp.torch_optimizers``'
optax chains for ``torch.optim.Adam`` / ``AdamW``, ``SGD``, ``Adagrad`` and apex's ``FusedLAMB``
(``smp.optimizers``) compute, in the same order of operations, and keep the chains' own state, tree for tree
(torch-format state dicts and checkpoints are the same on both paths).
One pass reads gradient, parameter and state and writes the update and the new state; the tensors of each
dtype go through one ``pallas_call`` (see ``jmp.kernels.multi_tensor``). Like any optax transformation, the
result is an update to add with ``optax.apply_updates``.

``interpret=True`` runs the kernels in Pallas' interpret mode: on a CPU (which Pallas does not compile for)
they then give the compiled kernels' numbers, slowly; this is how the tests check them without a GPU.
"""

from __future__ import annotations

import dataclasses
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


def _position(chain_state: tuple, state_type: type) -> int:
    """Where in an ``optax.chain``'s state tuple the piece of ``state_type`` keeps its state."""
    return next(i for i, piece in enumerate(chain_state) if isinstance(piece, state_type))


def _replaced(chain_state: tuple, position: int, piece: Any) -> tuple:
    return chain_state[:position] + (piece,) + chain_state[position + 1 :]


@dataclasses.dataclass(frozen=True)
class _Moments:
    """An Adam-state chain's moments for one update: leaves in the gradients' order, the step count one on."""

    at: int  # where the chain keeps its ``ScaleByAdamState``
    count: jax.Array
    grads: list[jax.Array]
    mu: list[jax.Array]
    nu: list[jax.Array]
    params: list[jax.Array]
    treedef: Any

    @classmethod
    def of(cls, state: tuple, updates: Any, params: Any) -> _Moments:
        at = _position(state, optax.ScaleByAdamState)
        (grads, mu, nu, ps), treedef = _leaves(updates, state[at].mu, state[at].nu, params)
        return cls(at, optax.safe_increment(state[at].count), grads, mu, nu, ps, treedef)

    def counted(self, state: tuple) -> tuple:
        return _replaced(state, self.at, state[self.at]._replace(count=self.count))

    def updated(self, state: tuple, mu: list[jax.Array], nu: list[jax.Array]) -> tuple:
        unflatten = functools.partial(jax.tree.unflatten, self.treedef)
        return _replaced(state, self.at, optax.ScaleByAdamState(self.count, unflatten(mu), unflatten(nu)))


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
    """torch's ``Adam`` (``decoupled=True``: ``AdamW``) in one kernel per dtype.

    Its state is the optax chain's (``jmp.torch_optimizers.adam`` / ``adamw``), tree for tree, so a checkpoint
    of either path resumes on the other.
    """
    if amsgrad:
        raise ValueError("fused_adam has no AMSGrad; use jmp.torch_optimizers.adam(..., amsgrad=True)")
    chain = (torch_optimizers.adamw if decoupled else torch_optimizers.adam)(
        lr, beta1, beta2, eps, weight_decay, amsgrad=False, maximize=maximize
    )
    body = _adam_body(decoupled, maximize)

    def update(updates, state, params=None):
        moments = _Moments.of(state, updates, params)
        if not moments.grads:
            return updates, moments.counted(state)
        count = moments.count
        scalars = multi_tensor.scalar_vector(
            lr, beta1, beta2, eps, weight_decay, 1 - beta1**count, 1 - beta2**count, 1 - beta1, 1 - beta2
        )
        columns = [moments.grads, moments.mu, moments.nu, moments.params]
        new, mu, nu = _update_by_dtype(
            body, scalars, columns, 3, interpret=interpret, name="adamw" if decoupled else "adam"
        )
        return jax.tree.unflatten(moments.treedef, new), moments.updated(state, mu, nu)

    return optax.GradientTransformation(chain.init, update)


def fused_adamw(lr, beta1, beta2, eps, weight_decay, *, amsgrad=False, maximize=False, interpret=False):
    """torch's ``AdamW``: weight decay scaled by the learning rate, outside the moments."""
    return fused_adam(
        lr, beta1, beta2, eps, weight_decay, amsgrad=amsgrad, maximize=maximize, decoupled=True, interpret=interpret
    )


def fused_apex_adam(lr, beta1, beta2, eps, weight_decay, *, adam_w_mode, bias_correction, interpret=False):
    """apex's ``FusedAdam`` (``smp.optimizers``): ``fused_adamw`` (``adam_w_mode``) or ``fused_adam``."""
    if not bias_correction:
        raise ValueError("fused_apex_adam corrects the moments' bias; use jmp.torch_optimizers.apex_adam without")
    return fused_adam(lr, beta1, beta2, eps, weight_decay, decoupled=adam_w_mode, interpret=interpret)


# --- LAMB ------------------------------------------------------------------------------------------------------


def _lamb_body(adam_w_mode: bool):
    def body(s, g, m, v, p):
        b1, b2, eps, weight_decay, correction1, correction2, keep1, keep2 = (s[i] for i in range(8))
        if not adam_w_mode:
            g = g + weight_decay * p  # L2: on the gradient, before the moments
        m = keep1 * g + b1 * m
        v = keep2 * (g * g) + b2 * v
        direction = (m / correction1) / (jnp.sqrt(v / correction2) + eps)
        if adam_w_mode:
            direction = direction + weight_decay * p
        return direction, m, v

    return body


def fused_lamb(
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    *,
    adam_w_mode,
    bias_correction,
    grad_averaging,
    use_nvlamb,
    interpret=False,
) -> optax.GradientTransformation:
    """apex's LAMB (``jmp.torch_optimizers.lamb``): moments and direction in one kernel per dtype, then each
    tensor's trust ratio ``||p|| / ||direction||`` from its whole norms (its shards' sums added over the
    devices holding them, ``multi_tensor.split_over``) scaling its step. State: the optax chain's."""
    chain = torch_optimizers.lamb(
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        adam_w_mode=adam_w_mode,
        bias_correction=bias_correction,
        grad_averaging=grad_averaging,
        use_nvlamb=use_nvlamb,
    )
    body = _lamb_body(adam_w_mode)

    def update(updates, state, params=None):
        moments = _Moments.of(state, updates, params)
        if not moments.grads:
            return updates, moments.counted(state)
        count, ps = moments.count, moments.params
        corrections = (1 - beta1**count, 1 - beta2**count) if bias_correction else (1.0, 1.0)
        keep1 = 1 - beta1 if grad_averaging else 1.0
        scalars = multi_tensor.scalar_vector(beta1, beta2, eps, weight_decay, *corrections, keep1, 1 - beta2)
        columns = [moments.grads, moments.mu, moments.nu, ps]
        directions, mu, nu = _update_by_dtype(body, scalars, columns, 3, interpret=interpret, name="lamb")
        paths = multi_tensor.tree_paths(params)
        p_norms = [jnp.sqrt(x) for x in multi_tensor.whole_sums(paths, [jnp.sum(p * p) for p in ps])]
        d_norms = [jnp.sqrt(x) for x in multi_tensor.whole_sums(paths, [jnp.sum(d * d) for d in directions])]
        active = jnp.logical_or(use_nvlamb, weight_decay != 0)
        steps = []
        for d, p, p_norm, d_norm in zip(directions, ps, p_norms, d_norms):
            ratio = jnp.where((p_norm == 0.0) | (d_norm == 0.0), jnp.array(1.0, p.dtype), 1.0 * p_norm / (d_norm + 0.0))
            steps.append(-lr * jnp.where(active, d * ratio, d))
        return jax.tree.unflatten(moments.treedef, steps), moments.updated(state, mu, nu)

    return optax.GradientTransformation(chain.init, update)


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
    """torch's ``SGD`` (momentum, dampening, Nesterov) in one kernel per dtype; state: the optax chain's."""
    chain = torch_optimizers.sgd(
        lr, momentum, dampening, weight_decay, nesterov=nesterov, maximize=maximize, has_momentum=has_momentum
    )
    body = _sgd_body(nesterov, maximize, has_momentum)

    def update(updates, state, params=None):
        at = _position(state, TorchMomentumState) if has_momentum else None
        buffers = [state[at].momentum_buffer] if has_momentum else []
        (grads, *columns), treedef = _leaves(updates, *buffers, params)
        if not grads:
            return updates, state
        started = state[at].started if has_momentum else 0.0
        scalars = multi_tensor.scalar_vector(lr, momentum, 1 - dampening, weight_decay, started)
        new = _update_by_dtype(body, scalars, [grads, *columns], 1 + has_momentum, interpret=interpret, name="sgd")
        if has_momentum:
            buffer = TorchMomentumState(jax.tree.unflatten(treedef, new[1]), jnp.ones([], jnp.bool_))
            state = _replaced(state, at, buffer)
        return jax.tree.unflatten(treedef, new[0]), state

    return optax.GradientTransformation(chain.init, update)


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
    """torch's ``Adagrad`` (``lr_decay``, eps outside the root) in one kernel per dtype; state: the optax
    chain's."""
    chain = torch_optimizers.adagrad(
        lr, lr_decay, weight_decay, eps, initial_accumulator_value=initial_accumulator_value, maximize=maximize
    )
    body = _adagrad_body(maximize)

    def update(updates, state, params=None):
        at = _position(state, TorchAdagradState)
        count = state[at].count + 1
        (grads, total, ps), treedef = _leaves(updates, state[at].sum, params)
        if not grads:
            return updates, _replaced(state, at, state[at]._replace(count=count))
        decay = 1.0 / (1.0 + (count - 1) * lr_decay)
        scalars = multi_tensor.scalar_vector(lr, weight_decay, decay, eps)
        new, total = _update_by_dtype(body, scalars, [grads, total, ps], 2, interpret=interpret, name="adagrad")
        adagrad = TorchAdagradState(count, jax.tree.unflatten(treedef, total))
        return jax.tree.unflatten(treedef, new), _replaced(state, at, adagrad)

    return optax.GradientTransformation(chain.init, update)


# --- which torch optimizers have a fused update ---------------------------------------------------------------

_FUSED = {
    torch_optimizers.adam: fused_adam,
    torch_optimizers.adamw: fused_adamw,
    torch_optimizers.sgd: fused_sgd,
    torch_optimizers.adagrad: fused_adagrad,
    torch_optimizers.apex_adam: fused_apex_adam,
    torch_optimizers.lamb: fused_lamb,
}


def fused_version(factory: Callable, static: dict[str, Any], *, interpret: bool) -> Callable | None:
    """The fused factory computing what ``factory`` (a ``jmp.torch_optimizers`` chain) computes with the options
    ``static``, None where there is none (Adadelta, RMSprop, AMSGrad, apex Adam without bias correction)."""
    fused = _FUSED.get(factory)
    if (
        fused is None
        or static.get("amsgrad")
        or (factory is torch_optimizers.apex_adam and not static["bias_correction"])
    ):
        return None
    return functools.partial(fused, interpret=interpret)
