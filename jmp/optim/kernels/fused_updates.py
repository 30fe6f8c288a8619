"""Fused optimizer updates: each a Pallas kernel over all of a param group's tensors, as an optax transformation.

``fused_adam``, ``fused_sgd``, ``fused_adagrad`` and ``fused_lamb`` compute what ``jmp.optim.torch_rules``'
chains compute, in the same order, with the chains' own state tree; one ``pallas_call`` per dtype
(``multi_tensor``) updates in place. ``update`` also takes, as extra arguments: ``grad_scale`` (gradients cast
to float32 and multiplied by it), ``grad_divisor`` (then divided by it), ``skip`` (a device bool: keep
parameters and state) and ``return_params`` (return the new parameters instead of an update). ``interpret=True``
runs Pallas' interpret mode, which gives the compiled numbers on a CPU.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jmp.optim import torch_rules as torch_optimizers
from jmp.optim.kernels import multi_tensor
from jmp.optim.torch_rules import TorchAdagradState, TorchMomentumState

_GRAD_SCALE, _GRAD_DIVISOR, _SKIP = 0, 1, 2  # the scalar slots every kernel reads; an optimizer's own follow


@dataclasses.dataclass(frozen=True)
class _Pass:
    """The extra arguments of one ``update`` (see the module docstring)."""

    grad_scale: Any = 1.0
    grad_divisor: Any = 1.0
    skip: Any = False
    return_params: bool = False

    def scalars(self, *own: Any) -> jax.Array:
        return multi_tensor.scalar_vector(self.grad_scale, self.grad_divisor, jnp.asarray(self.skip), *own)

    def counted(self, old: jax.Array, new: jax.Array) -> jax.Array:
        """A step count (or flag) after this update: unchanged when it is skipped."""
        return jnp.where(self.skip, old, new)

    def result(self, params: list[jax.Array], steps: list[jax.Array]) -> list[jax.Array]:
        """What ``update`` returns from steps computed outside a kernel (LAMB's): updates, or new parameters."""
        if self.return_params:
            return [jnp.where(self.skip, p, optax.apply_updates(p, s)) for p, s in zip(params, steps)]
        return [jnp.where(self.skip, jnp.zeros_like(s), s) for s in steps]


def _extra(grad_scale=1.0, grad_divisor=1.0, skip=False, return_params=False, **ignored) -> _Pass:
    return _Pass(grad_scale, grad_divisor, skip, return_params)


class _Own:
    """An optimizer's own scalars: the kernel's scalar vector after the slots every kernel reads."""

    def __init__(self, ref: Any):
        self.ref = ref

    def __getitem__(self, i: int) -> jax.Array:
        return self.ref[_SKIP + 1 + i]


def _kernel_body(step: Callable[..., tuple[jax.Array, ...]], first: str) -> Callable[..., tuple[jax.Array, ...]]:
    """The kernel body around ``step(own scalars, g, *state, p) -> (update, *state)``: ``g`` unscaled (and clipped), the
    state kept on a skipped step, the first result ``first`` ("update", "param" with it added, or "direction")."""

    def body(s, p, g, *state):
        g = ((g.astype(jnp.float32) * s[_GRAD_SCALE]) / s[_GRAD_DIVISOR]).astype(p.dtype)
        update, *new_state = step(_Own(s), g, *state, p)
        skip = s[_SKIP] > 0.5
        new_state = [jnp.where(skip, old, new.astype(old.dtype)) for old, new in zip(state, new_state)]
        if first == "param":
            update = jnp.where(skip, p, (p + update).astype(p.dtype))  # optax.apply_updates' arithmetic
        elif first == "update":
            update = jnp.where(skip, jnp.zeros_like(update), update)
        return update, *new_state

    return body


def _update_by_dtype(
    step: Callable[..., tuple[jax.Array, ...]],
    scalars: jax.Array,
    params: list[jax.Array],
    grads: list[jax.Array],
    state: Sequence[list[jax.Array]],
    *,
    first: str,
    interpret: bool,
    name: str,
) -> tuple[list[jax.Array], ...]:
    """``step`` over every tensor, one kernel launch per parameter dtype (or a few); the first result's tensors
    (written over the parameters when ``first`` is "param") and the new state's."""
    columns = [params, grads, *state]
    outputs = [0, *range(2, len(columns))]
    in_place = set(range(1, len(outputs))) | ({0} if first == "param" else set())  # the state; the parameters
    body = _kernel_body(step, first)
    result: list[list[Any]] = [[None] * len(params) for _ in outputs]
    by_dtype: dict[jnp.dtype, list[int]] = {}
    for i, param in enumerate(params):
        by_dtype.setdefault(jnp.dtype(param.dtype), []).append(i)
    for dtype, indices in by_dtype.items():
        for chunk in multi_tensor.launches(indices, operands=len(columns) + len(outputs)):
            chunk_columns = [[column[i] for i in chunk] for column in columns]
            new = multi_tensor.elementwise(
                body, scalars, chunk_columns, outputs, in_place=in_place, interpret=interpret, name=f"{name}_{dtype}"
            )
            for j, tensors in enumerate(new):
                for i, tensor in zip(chunk, tensors):
                    result[j][i] = tensor
    return tuple(result)


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
    kept_count: jax.Array  # the count stored afterwards: not advanced by a skipped update
    grads: list[jax.Array]
    mu: list[jax.Array]
    nu: list[jax.Array]
    params: list[jax.Array]
    treedef: Any

    @classmethod
    def of(cls, state: tuple, updates: Any, params: Any, extra: _Pass) -> _Moments:
        at = _position(state, optax.ScaleByAdamState)
        (grads, mu, nu, ps), treedef = _leaves(updates, state[at].mu, state[at].nu, params)
        old = state[at].count
        count = optax.safe_increment(old)
        return cls(at, count, extra.counted(old, count), grads, mu, nu, ps, treedef)

    def counted(self, state: tuple) -> tuple:
        return _replaced(state, self.at, state[self.at]._replace(count=self.kept_count))

    def stepped(self, step: Callable, scalars: jax.Array, first: str, interpret: bool, name: str) -> tuple:
        """``step`` over these tensors and moments (``_update_by_dtype``): (first results, new mu, new nu)."""
        columns = (self.params, self.grads, [self.mu, self.nu])
        return _update_by_dtype(step, scalars, *columns, first=first, interpret=interpret, name=name)

    def updated(self, state: tuple, mu: list[jax.Array], nu: list[jax.Array]) -> tuple:
        unflatten = functools.partial(jax.tree.unflatten, self.treedef)
        return _replaced(state, self.at, optax.ScaleByAdamState(self.kept_count, unflatten(mu), unflatten(nu)))


def _first(extra: _Pass) -> str:
    return "param" if extra.return_params else "update"


def _adam_step(decoupled: bool, maximize: bool):
    def step(s, g, m, v, p):
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

    return step


def fused_adam(
    lr, beta1, beta2, eps, weight_decay, *, amsgrad=False, maximize=False, decoupled=False, interpret=False
) -> optax.GradientTransformationExtraArgs:
    """torch's ``Adam`` (``decoupled=True``: ``AdamW``) in one kernel per dtype, with the optax chain's state tree."""
    if amsgrad:
        raise ValueError("fused_adam has no AMSGrad; use jmp.optim.torch_rules.adam(..., amsgrad=True)")
    chain = (torch_optimizers.adamw if decoupled else torch_optimizers.adam)(
        lr, beta1, beta2, eps, weight_decay, amsgrad=False, maximize=maximize
    )
    step = _adam_step(decoupled, maximize)

    def update(updates, state, params=None, **extra_args):
        extra = _extra(**extra_args)
        moments = _Moments.of(state, updates, params, extra)
        if not moments.grads:
            return updates, moments.counted(state)
        count = moments.count
        scalars = extra.scalars(
            lr, beta1, beta2, eps, weight_decay, 1 - beta1**count, 1 - beta2**count, 1 - beta1, 1 - beta2
        )
        first, mu, nu = moments.stepped(step, scalars, _first(extra), interpret, "adamw" if decoupled else "adam")
        return jax.tree.unflatten(moments.treedef, first), moments.updated(state, mu, nu)

    return optax.GradientTransformationExtraArgs(chain.init, update)


def fused_adamw(lr, beta1, beta2, eps, weight_decay, *, amsgrad=False, maximize=False, interpret=False):
    """torch's ``AdamW``: weight decay scaled by the learning rate, outside the moments."""
    return fused_adam(
        lr, beta1, beta2, eps, weight_decay, amsgrad=amsgrad, maximize=maximize, decoupled=True, interpret=interpret
    )


def fused_apex_adam(lr, beta1, beta2, eps, weight_decay, *, adam_w_mode, bias_correction, interpret=False):
    """apex's ``FusedAdam`` (``smp.optimizers``): ``fused_adamw`` (``adam_w_mode``) or ``fused_adam``."""
    if not bias_correction:
        raise ValueError("fused_apex_adam corrects the moments' bias; use jmp.optim.torch_rules.apex_adam without")
    return fused_adam(lr, beta1, beta2, eps, weight_decay, decoupled=adam_w_mode, interpret=interpret)


def _lamb_step(adam_w_mode: bool):
    def step(s, g, m, v, p):
        b1, b2, eps, weight_decay, correction1, correction2, keep1, keep2 = (s[i] for i in range(8))
        if not adam_w_mode:
            g = g + weight_decay * p  # L2: on the gradient, before the moments
        m = keep1 * g + b1 * m
        v = keep2 * (g * g) + b2 * v
        direction = (m / correction1) / (jnp.sqrt(v / correction2) + eps)
        if adam_w_mode:
            direction = direction + weight_decay * p
        return direction, m, v

    return step


def fused_lamb(
    lr, beta1, beta2, eps, weight_decay, *, adam_w_mode, bias_correction, grad_averaging, use_nvlamb, interpret=False
) -> optax.GradientTransformationExtraArgs:
    """apex's LAMB (``torch_rules.lamb``): moments and direction in one kernel per dtype, then each tensor's step scaled
    by its trust ratio from whole norms (shard sums added over devices, ``multi_tensor.split_over``)."""
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
    step = _lamb_step(adam_w_mode)

    def update(updates, state, params=None, **extra_args):
        extra = _extra(**extra_args)
        moments = _Moments.of(state, updates, params, extra)
        if not moments.grads:
            return updates, moments.counted(state)
        count, ps = moments.count, moments.params
        corrections = (1 - beta1**count, 1 - beta2**count) if bias_correction else (1.0, 1.0)
        keep1 = 1 - beta1 if grad_averaging else 1.0
        scalars = extra.scalars(beta1, beta2, eps, weight_decay, *corrections, keep1, 1 - beta2)
        directions, mu, nu = moments.stepped(step, scalars, "direction", interpret, "lamb")
        paths = multi_tensor.tree_paths(params)
        p_norms = [jnp.sqrt(x) for x in multi_tensor.whole_sums(paths, [jnp.sum(p * p) for p in ps])]
        d_norms = [jnp.sqrt(x) for x in multi_tensor.whole_sums(paths, [jnp.sum(d * d) for d in directions])]
        active = jnp.logical_or(use_nvlamb, weight_decay != 0)
        steps = []
        for d, p, p_norm, d_norm in zip(directions, ps, p_norms, d_norms):
            ratio = jnp.where((p_norm == 0.0) | (d_norm == 0.0), jnp.array(1.0, p.dtype), 1.0 * p_norm / (d_norm + 0.0))
            steps.append(-lr * jnp.where(active, d * ratio, d))
        result = extra.result(ps, steps)
        return jax.tree.unflatten(moments.treedef, result), moments.updated(state, mu, nu)

    return optax.GradientTransformationExtraArgs(chain.init, update)


def _sgd_step(nesterov: bool, maximize: bool, has_momentum: bool):
    def step(s, g, *rest):
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

    return step


def fused_sgd(
    lr, momentum, dampening, weight_decay, *, nesterov, maximize, has_momentum, interpret=False
) -> optax.GradientTransformationExtraArgs:
    """torch's ``SGD`` (momentum, dampening, Nesterov) in one kernel per dtype; state: the optax chain's."""
    chain = torch_optimizers.sgd(
        lr, momentum, dampening, weight_decay, nesterov=nesterov, maximize=maximize, has_momentum=has_momentum
    )
    step = _sgd_step(nesterov, maximize, has_momentum)

    def update(updates, state, params=None, **extra_args):
        extra = _extra(**extra_args)
        at = _position(state, TorchMomentumState) if has_momentum else None
        buffers = [state[at].momentum_buffer] if has_momentum else []
        (grads, *buffer, ps), treedef = _leaves(updates, *buffers, params)
        if not grads:
            return updates, state
        started = state[at].started if has_momentum else False
        scalars = extra.scalars(lr, momentum, 1 - dampening, weight_decay, started)
        first, *new_buffer = _update_by_dtype(
            step, scalars, ps, grads, buffer, first=_first(extra), interpret=interpret, name="sgd"
        )
        if has_momentum:
            kept = extra.counted(started, jnp.ones([], jnp.bool_))
            state = _replaced(state, at, TorchMomentumState(jax.tree.unflatten(treedef, new_buffer[0]), kept))
        return jax.tree.unflatten(treedef, first), state

    return optax.GradientTransformationExtraArgs(chain.init, update)


def _adagrad_step(maximize: bool):
    def step(s, g, total, p):
        lr, weight_decay, decay, eps = (s[i] for i in range(4))
        if maximize:
            g = -1.0 * g
        g = g + weight_decay * p
        total = total + g * g
        return -lr * (decay * g / (jnp.sqrt(total) + eps)), total

    return step


def fused_adagrad(
    lr, lr_decay, weight_decay, eps, *, initial_accumulator_value, maximize, interpret=False
) -> optax.GradientTransformationExtraArgs:
    """torch's ``Adagrad`` (``lr_decay``, eps outside the root) in one kernel per dtype; state: the optax chain's."""
    chain = torch_optimizers.adagrad(
        lr, lr_decay, weight_decay, eps, initial_accumulator_value=initial_accumulator_value, maximize=maximize
    )
    step = _adagrad_step(maximize)

    def update(updates, state, params=None, **extra_args):
        extra = _extra(**extra_args)
        at = _position(state, TorchAdagradState)
        old = state[at].count
        count = old + 1
        (grads, total, ps), treedef = _leaves(updates, state[at].sum, params)
        if not grads:
            return updates, _replaced(state, at, state[at]._replace(count=extra.counted(old, count)))
        decay = 1.0 / (1.0 + (count - 1) * lr_decay)
        scalars = extra.scalars(lr, weight_decay, decay, eps)
        first, total = _update_by_dtype(
            step, scalars, ps, grads, [total], first=_first(extra), interpret=interpret, name="adagrad"
        )
        adagrad = TorchAdagradState(extra.counted(old, count), jax.tree.unflatten(treedef, total))
        return jax.tree.unflatten(treedef, first), _replaced(state, at, adagrad)

    return optax.GradientTransformationExtraArgs(chain.init, update)


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
    """The fused factory computing what ``factory`` (a ``jmp.optim.torch_rules`` chain) computes with the options
    ``static``, None where there is none (Adadelta, RMSprop, AMSGrad, apex Adam without bias correction)."""
    fused = _FUSED.get(factory)
    unfused_option = static.get("amsgrad") or (factory is torch_optimizers.apex_adam and not static["bias_correction"])
    return None if fused is None or unfused_option else functools.partial(fused, interpret=interpret)
