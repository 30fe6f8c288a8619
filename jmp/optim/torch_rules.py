"""``torch.optim`` optimizers (and apex's, ``jmp.optimizers``) as optax chains with their exact update rules.

optax's pieces where they compute what torch does, torch-specific ones where it differs (undamped first
momentum step, AMSGrad on the raw second moment, Adagrad's ``lr_decay``). Numeric hyper-parameters are
injected, so LR schedulers' writes take effect without recompiling; structural settings are fixed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
import torch

from jmp import optimizers
from jmp.errors import OptimizerError

# --- torch-specific pieces --------------------------------------------------------------------------------


class TorchMomentumState(NamedTuple):
    momentum_buffer: Any
    started: jax.Array  # torch creates the buffer from the first gradient, undamped


def torch_momentum(momentum: float, dampening: float, nesterov: bool) -> optax.GradientTransformation:
    def init(params):
        return TorchMomentumState(optax.tree.zeros_like(params), jnp.zeros([], jnp.bool_))

    def update(updates, state, params=None):
        buffer = jax.tree.map(
            lambda g, b: jnp.where(state.started, momentum * b + (1 - dampening) * g, g),
            updates,
            state.momentum_buffer,
        )
        if nesterov:
            updates = jax.tree.map(lambda g, b: g + momentum * b, updates, buffer)
        else:
            updates = buffer
        return updates, TorchMomentumState(buffer, jnp.ones([], jnp.bool_))

    return optax.GradientTransformation(init, update)


class TorchAMSGradState(NamedTuple):
    count: jax.Array
    exp_avg: Any
    exp_avg_sq: Any
    max_exp_avg_sq: Any


def torch_amsgrad(beta1: float, beta2: float, eps: float) -> optax.GradientTransformation:
    """Adam with AMSGrad as torch computes it: the maximum of the raw second moments, then bias correction."""

    def init(params):
        zeros = optax.tree.zeros_like(params)
        return TorchAMSGradState(jnp.zeros([], jnp.int32), zeros, zeros, zeros)

    def update(updates, state, params=None):
        count = state.count + 1
        mu = optax.tree.update_moment(updates, state.exp_avg, beta1, 1)
        nu = optax.tree.update_moment_per_elem_norm(updates, state.exp_avg_sq, beta2, 2)
        nu_max = jax.tree.map(jnp.maximum, state.max_exp_avg_sq, nu)
        correction1 = 1 - beta1**count
        correction2_sqrt = jnp.sqrt(1 - beta2**count)
        updates = jax.tree.map(lambda m, v: (m / correction1) / (jnp.sqrt(v) / correction2_sqrt + eps), mu, nu_max)
        return updates, TorchAMSGradState(count, mu, nu, nu_max)

    return optax.GradientTransformation(init, update)


class TorchAdagradState(NamedTuple):
    count: jax.Array
    sum: Any


def torch_adagrad(lr_decay: float, eps: float, initial_accumulator_value: float) -> optax.GradientTransformation:
    """Adagrad as torch computes it; the step size decay ``1 / (1 + (step - 1) * lr_decay)`` is folded in."""

    def init(params):
        return TorchAdagradState(jnp.zeros([], jnp.int32), optax.tree.full_like(params, initial_accumulator_value))

    def update(updates, state, params=None):
        count = state.count + 1
        total = jax.tree.map(lambda s, g: s + g * g, state.sum, updates)
        decay = 1.0 / (1.0 + (count - 1) * lr_decay)
        updates = jax.tree.map(lambda g, s: decay * g / (jnp.sqrt(s) + eps), updates, total)
        return updates, TorchAdagradState(count, total)

    return optax.GradientTransformation(init, update)


def _steps(*pieces: optax.GradientTransformation | None) -> optax.GradientTransformation:
    return optax.chain(*(p for p in pieces if p is not None))


def _ascent(maximize: bool) -> optax.GradientTransformation | None:
    return optax.scale(-1.0) if maximize else None


def sgd(lr, momentum, dampening, weight_decay, *, nesterov, maximize, has_momentum):
    return _steps(
        _ascent(maximize),
        optax.add_decayed_weights(weight_decay),
        torch_momentum(momentum, dampening, nesterov) if has_momentum else None,
        optax.scale(-lr),
    )


def _adam_direction(beta1, beta2, eps, amsgrad):
    return torch_amsgrad(beta1, beta2, eps) if amsgrad else optax.scale_by_adam(beta1, beta2, eps)


def adam(lr, beta1, beta2, eps, weight_decay, *, amsgrad, maximize):
    return _steps(
        _ascent(maximize),
        optax.add_decayed_weights(weight_decay),  # L2 on the gradient
        _adam_direction(beta1, beta2, eps, amsgrad),
        optax.scale(-lr),
    )


def adamw(lr, beta1, beta2, eps, weight_decay, *, amsgrad, maximize):
    return _steps(
        _ascent(maximize),
        _adam_direction(beta1, beta2, eps, amsgrad),
        optax.add_decayed_weights(weight_decay),  # decoupled: scaled by lr with the update
        optax.scale(-lr),
    )


def apex_moments(beta1: float, beta2: float, eps: float, *, bias_correction: bool, grad_averaging: bool):
    """apex's Adam direction ``m / (sqrt(v) + eps)``: bias correction optional, and without ``grad_averaging``
    the first moment adds the whole gradient (weight 1, not ``1 - beta1``). State as ``optax.scale_by_adam``."""

    def init(params):
        return optax.ScaleByAdamState(
            jnp.zeros([], jnp.int32), optax.tree.zeros_like(params), optax.tree.zeros_like(params)
        )

    def update(updates, state, params=None):
        count = optax.safe_increment(state.count)
        keep1 = 1 - beta1 if grad_averaging else 1.0
        mu = jax.tree.map(lambda g, m: keep1 * g + beta1 * m, updates, state.mu)
        nu = jax.tree.map(lambda g, v: (1 - beta2) * (g * g) + beta2 * v, updates, state.nu)
        correction1 = 1 - beta1**count if bias_correction else 1.0
        correction2 = 1 - beta2**count if bias_correction else 1.0
        direction = jax.tree.map(lambda m, v: (m / correction1) / (jnp.sqrt(v / correction2) + eps), mu, nu)
        return direction, optax.ScaleByAdamState(count, mu, nu)

    return optax.GradientTransformation(init, update)


def lamb_trust_ratio(weight_decay, use_nvlamb: bool) -> optax.GradientTransformation:
    """Each tensor's update times ``||p|| / ||update||`` (1 where either is 0), when the group decays weights
    or ``use_nvlamb`` (``weight_decay`` may change per step, so the choice is made on the device)."""
    ratio = optax.scale_by_trust_ratio()

    def update(updates, state, params=None):
        scaled, state = ratio.update(updates, state, params)
        active = jnp.logical_or(use_nvlamb, weight_decay != 0)
        return jax.tree.map(lambda s, u: jnp.where(active, s, u), scaled, updates), state

    return optax.GradientTransformation(ratio.init, update)


def apex_adam(lr, beta1, beta2, eps, weight_decay, *, adam_w_mode, bias_correction):
    """apex's ``FusedAdam`` (``jmp.optimizers``): torch's AdamW (``adam_w_mode``) or Adam."""
    if bias_correction:
        factory = adamw if adam_w_mode else adam
        return factory(lr, beta1, beta2, eps, weight_decay, amsgrad=False, maximize=False)
    return _steps(
        None if adam_w_mode else optax.add_decayed_weights(weight_decay),
        apex_moments(beta1, beta2, eps, bias_correction=False, grad_averaging=True),
        optax.add_decayed_weights(weight_decay) if adam_w_mode else None,
        optax.scale(-lr),
    )


def lamb(lr, beta1, beta2, eps, weight_decay, *, adam_w_mode, bias_correction, grad_averaging, use_nvlamb):
    """apex's ``FusedLAMB`` per param group (its global clipping over all groups is ``apex_clip_divisor``)."""
    return _steps(
        None if adam_w_mode else optax.add_decayed_weights(weight_decay),
        apex_moments(beta1, beta2, eps, bias_correction=bias_correction, grad_averaging=grad_averaging),
        optax.add_decayed_weights(weight_decay) if adam_w_mode else None,
        lamb_trust_ratio(weight_decay, use_nvlamb),
        optax.scale(-lr),
    )


class NovoGradState(NamedTuple):
    count: jax.Array
    mu: Any  # the first moment
    nu: Any  # per tensor, one float32 scalar: the running gradient norm


def novograd_direction(beta1, beta2, eps, weight_decay, *, bias_correction, grad_averaging, reg_inside_moment,
                       norm_type, init_zero) -> optax.GradientTransformation:  # fmt: skip
    """apex NovoGrad's step before the learning rate (``jmp.optimizers.FusedNovoGrad``): per tensor a running
    gradient norm, started at the first gradient's (or 0), normalising Adam's first moment."""

    def init(params):
        norms = jax.tree.map(lambda _: jnp.zeros([], jnp.float32), params)
        return NovoGradState(jnp.zeros([], jnp.int32), optax.tree.zeros_like(params), norms)

    def norm_of(g):
        return jnp.max(jnp.abs(g)) if norm_type == 0 else jnp.sqrt(jnp.sum(g * g))

    def blended(average, g, first):
        norm = norm_of(g)
        average = jnp.where(first, 0.0 if init_zero else norm, average)  # the first blend keeps the first norm
        if norm_type == 0:
            return beta2 * average + (1 - beta2) * norm
        return jnp.sqrt(beta2 * average * average + (1 - beta2) * norm * norm)

    def update(updates, state, params=None):
        count = optax.safe_increment(state.count)
        nu = jax.tree.map(lambda v, g: blended(v, g, state.count == 0), state.nu, updates)
        correction1 = 1 - beta1**count if bias_correction else 1.0
        correction2 = jnp.sqrt(1 - beta2**count) if bias_correction else 1.0
        keep = 1 - beta1 if grad_averaging else 1.0

        def moment(g, m, v, p):
            denominator = v / correction2 + eps
            if reg_inside_moment:
                return beta1 * m + keep * (g / denominator + weight_decay * p)
            return beta1 * m + keep * g

        def step(m, v, p):
            if reg_inside_moment:
                return m / correction1
            return (m / correction1) / (v / correction2 + eps) + weight_decay * p

        mu = jax.tree.map(moment, updates, state.mu, nu, params)
        return jax.tree.map(step, mu, nu, params), NovoGradState(count, mu, nu)

    return optax.GradientTransformation(init, update)


def novograd(lr, beta1, beta2, eps, weight_decay, *, bias_correction, grad_averaging, reg_inside_moment, norm_type,
             init_zero):  # fmt: skip
    """apex's ``FusedNovoGrad`` (``jmp.optimizers``)."""
    direction = novograd_direction(
        beta1, beta2, eps, weight_decay, bias_correction=bias_correction, grad_averaging=grad_averaging,
        reg_inside_moment=reg_inside_moment, norm_type=norm_type, init_zero=init_zero,
    )  # fmt: skip
    return _steps(direction, optax.scale(-lr))


def apex_clip_divisor(grads: Any, max_norm: float) -> jax.Array:
    """What apex LAMB divides the gradients by: ``norm / max_norm`` when their global norm is above it, else 1."""
    norm = optax.global_norm(grads)
    return jnp.where(norm > max_norm, norm / max_norm, 1.0)


def adadelta(lr, rho, eps, weight_decay, *, maximize):
    return _steps(
        _ascent(maximize),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_adadelta(rho, eps),
        optax.scale(-lr),
    )


def adagrad(lr, lr_decay, weight_decay, eps, *, initial_accumulator_value, maximize):
    return _steps(
        _ascent(maximize),
        optax.add_decayed_weights(weight_decay),
        torch_adagrad(lr_decay, eps, initial_accumulator_value),
        optax.scale(-lr),
    )


def rmsprop(lr, alpha, eps, weight_decay, momentum, *, centered, maximize, has_momentum):
    scale = optax.scale_by_stddev if centered else optax.scale_by_rms
    return _steps(
        _ascent(maximize),
        optax.add_decayed_weights(weight_decay),
        scale(decay=alpha, eps=eps, eps_in_sqrt=False),
        optax.trace(decay=momentum) if has_momentum else None,
        optax.scale(-lr),
    )


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one torch optimizer class maps to optax."""

    factory: Callable[..., optax.GradientTransformation]
    numeric: tuple[str, ...]  # injected hyper-parameters (factory names)
    static: tuple[str, ...]  # structure-setting ones
    # torch state name for each optax state field, by state type
    state_fields: dict = dataclasses.field(default_factory=dict)
    clip_before: str | None = None  # the optimizer default holding a global clipping norm applied first (apex)
    per_tensor: bool = False  # takes norms per tensor (LAMB, NovoGrad): not on a pipeline's packed buffers

    def hyperparams(self, group: dict) -> tuple[dict[str, float], dict[str, Any]]:
        values = dict(group)
        if "betas" in values:
            values["beta1"], values["beta2"] = values["betas"]
        values["has_momentum"] = bool(values.get("momentum", 0))
        numeric = {name: float(values[name]) for name in self.numeric}
        static = {name: values.get(name, False) for name in self.static}
        return numeric, static


_ADAM_NUMERIC = ("lr", "beta1", "beta2", "eps", "weight_decay")
_ADAM_FIELDS = {
    optax.ScaleByAdamState: {"count": "step", "mu": "exp_avg", "nu": "exp_avg_sq"},
    TorchAMSGradState: {
        "count": "step",
        "exp_avg": "exp_avg",
        "exp_avg_sq": "exp_avg_sq",
        "max_exp_avg_sq": "max_exp_avg_sq",
    },
}
RULES: dict[type, Rule] = {
    torch.optim.SGD: Rule(
        sgd,
        ("lr", "momentum", "dampening", "weight_decay"),
        ("nesterov", "maximize", "has_momentum"),
        {TorchMomentumState: {"momentum_buffer": "momentum_buffer"}},
    ),
    torch.optim.Adam: Rule(adam, _ADAM_NUMERIC, ("amsgrad", "maximize"), _ADAM_FIELDS),
    torch.optim.AdamW: Rule(adamw, _ADAM_NUMERIC, ("amsgrad", "maximize"), _ADAM_FIELDS),
    torch.optim.Adadelta: Rule(
        adadelta,
        ("lr", "rho", "eps", "weight_decay"),
        ("maximize",),
        {optax.ScaleByAdaDeltaState: {"e_g": "square_avg", "e_x": "acc_delta"}},
    ),
    torch.optim.Adagrad: Rule(
        adagrad,
        ("lr", "lr_decay", "weight_decay", "eps"),
        ("initial_accumulator_value", "maximize"),
        {TorchAdagradState: {"count": "step", "sum": "sum"}},
    ),
    torch.optim.RMSprop: Rule(
        rmsprop,
        ("lr", "alpha", "eps", "weight_decay", "momentum"),
        ("centered", "maximize", "has_momentum"),
        {
            optax.ScaleByRmsState: {"nu": "square_avg"},
            optax.ScaleByRStdDevState: {"mu": "grad_avg", "nu": "square_avg"},
            optax.TraceState: {"trace": "momentum_buffer"},
        },
    ),
}
RULES[optimizers.FusedAdam] = Rule(apex_adam, _ADAM_NUMERIC, ("adam_w_mode", "bias_correction"), _ADAM_FIELDS)
RULES[optimizers.FusedLAMB] = Rule(
    lamb,
    _ADAM_NUMERIC,
    ("adam_w_mode", "bias_correction", "grad_averaging", "use_nvlamb"),
    _ADAM_FIELDS,
    clip_before="max_grad_norm",
    per_tensor=True,
)
RULES[optimizers.FusedNovoGrad] = Rule(
    novograd,
    _ADAM_NUMERIC,
    ("bias_correction", "grad_averaging", "reg_inside_moment", "norm_type", "init_zero"),
    {NovoGradState: {"count": "step", "mu": "exp_avg", "nu": "exp_avg_sq"}},
    per_tensor=True,
)


def rule_for(optimizer: torch.optim.Optimizer) -> Rule:
    """How ``optimizer`` maps to optax, once its class and its param groups' options are known to be supported."""
    rule = RULES.get(type(optimizer))
    if rule is None:
        supported = ", ".join(
            f"{'torch.optim' if cls.__module__.startswith('torch') else 'smp.optimizers'}.{cls.__name__}"
            for cls in RULES
        )
        raise OptimizerError(
            f"{type(optimizer).__module__}.{type(optimizer).__name__} is not supported by DistributedOptimizer. "
            f"Supported: {supported}, or pass an optax.GradientTransformation."
        )
    for group in optimizer.param_groups:
        if group.get("decoupled_weight_decay"):  # torch's Adam(decoupled_weight_decay=True) is AdamW
            rule = RULES[torch.optim.AdamW]
        # foreach / fused (one kernel over many tensors: Hugging Face's default) and capturable (step counts on
        # the device, for CUDA graphs) say how torch runs the update, not what it computes: they are taken as they
        # are, jmp's update being one compiled program with its step counts on the devices anyway
        if group.get("differentiable"):
            raise OptimizerError(
                f"{type(optimizer).__name__}(differentiable=True) lets torch's autograd differentiate through "
                "optimizer.step() (meta-learning); DistributedOptimizer updates outside autograd. Remove the option"
            )
    return rule


def group_transform(
    rule: Rule, group: dict, fused: Callable[[Callable, dict], Callable | None] | None = None
) -> optax.GradientTransformation:
    """One param group's transformation, hyper-parameters injected; ``fused`` may give a kernel computing the same."""
    numeric, static = rule.hyperparams(group)
    factory = (fused(rule.factory, static) if fused is not None else None) or rule.factory
    injected = optax.inject_hyperparams(factory, static_args=tuple(static))
    return injected(**numeric, **static)
