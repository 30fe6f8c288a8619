"""Activation functions (``F.*``, ``torch.*`` and Tensor methods)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F

from jmp.torch_bridge.lowering.arguments import axis
from jmp.torch_bridge.registry import register_lowering

T = torch.Tensor


@register_lowering(F.relu, torch.relu, T.relu, inplace_flag="inplace", inplace=(torch.relu_, T.relu_, F.relu_))
def relu(input, inplace=False):
    return jax.nn.relu(input)


@register_lowering(F.relu6, inplace_flag="inplace")
def relu6(input, inplace=False):
    return hardtanh(input, 0.0, 6.0)


@register_lowering(F.gelu)
def gelu(input, approximate="none"):
    return jax.nn.gelu(input, approximate=approximate == "tanh")


@register_lowering(F.silu, inplace_flag="inplace")
def silu(input, inplace=False):
    return jax.nn.silu(input)


@register_lowering(F.mish, inplace_flag="inplace")
def mish(input, inplace=False):
    return input * jnp.tanh(jax.nn.softplus(input))


@register_lowering(F.elu, inplace_flag="inplace", inplace=(F.elu_,))
def elu(input, alpha=1.0, inplace=False):
    return jnp.where(input > 0, input, alpha * jnp.expm1(input))


@register_lowering(F.selu, torch.selu, inplace_flag="inplace", inplace=(torch.selu_, F.selu_))
def selu(input, inplace=False):
    return jax.nn.selu(input)


@register_lowering(F.celu, torch.celu, inplace_flag="inplace", inplace=(torch.celu_, F.celu_))
def celu(input, alpha=1.0, inplace=False):
    return jnp.maximum(input, 0) + jnp.minimum(0, alpha * jnp.expm1(input / alpha))


@register_lowering(F.leaky_relu, inplace_flag="inplace", inplace=(F.leaky_relu_,))
def leaky_relu(input, negative_slope=0.01, inplace=False):
    return jnp.where(input >= 0, input, negative_slope * input)


@register_lowering(F.prelu, torch.prelu, T.prelu)
def prelu(input, weight):
    if weight.size == 1:
        w = weight.reshape(())
    else:
        w = weight.reshape((-1,) + (1,) * (input.ndim - 2))
    return jnp.where(input >= 0, input, w * input)


@register_lowering(F.rrelu, inplace_flag="inplace", inplace=(F.rrelu_,))
def rrelu(input, lower=1.0 / 8, upper=1.0 / 3, training=False, inplace=False):
    if training:
        from jmp.torch_bridge.lowering.random import next_key

        slope = jax.random.uniform(next_key(), input.shape, input.dtype, lower, upper)
    else:
        slope = (lower + upper) / 2
    return jnp.where(input >= 0, input, slope * input)


@register_lowering(F.softplus)
def softplus(input, beta=1.0, threshold=20.0):
    scaled = input * beta
    return jnp.where(scaled > threshold, input, jnp.logaddexp(scaled, 0.0) / beta)


@register_lowering(F.softsign)
def softsign(input):
    return input / (1 + jnp.abs(input))


@register_lowering(F.hardtanh, inplace_flag="inplace", inplace=(F.hardtanh_,))
def hardtanh(input, min_val=-1.0, max_val=1.0, inplace=False):
    inside = (input > min_val) & (input < max_val)  # torch: no gradient at the bounds
    return jnp.where(inside, input, jax.lax.stop_gradient(jnp.clip(input, min_val, max_val)))


@register_lowering(F.hardswish, inplace_flag="inplace")
def hardswish(input, inplace=False):
    return input * jnp.clip(input + 3, 0, 6) / 6


@register_lowering(F.hardsigmoid, inplace_flag="inplace")
def hardsigmoid(input, inplace=False):
    return jnp.clip(input + 3, 0, 6) / 6


@register_lowering(F.sigmoid)
def sigmoid(input):
    return jax.nn.sigmoid(input)


@register_lowering(F.tanh)
def tanh(input):
    return jnp.tanh(input)


@register_lowering(F.logsigmoid)
def logsigmoid(input):
    return jax.nn.log_sigmoid(input)


@register_lowering(F.tanhshrink)
def tanhshrink(input):
    return input - jnp.tanh(input)


@register_lowering(F.softshrink)
def softshrink(input, lambd=0.5):
    return jnp.where(input > lambd, input - lambd, jnp.where(input < -lambd, input + lambd, 0.0))


@register_lowering(F.hardshrink, torch.hardshrink, T.hardshrink)
def hardshrink(input, lambd=0.5):
    return jnp.where(jnp.abs(input) > lambd, input, 0.0)


@register_lowering(F.threshold, torch.threshold, inplace_flag="inplace", inplace=(F.threshold_, torch.threshold_))
def threshold(input, threshold, value, inplace=False):
    return jnp.where(input > threshold, input, value)


@register_lowering(F.glu)
def glu(input, dim=-1):
    a, b = jnp.split(input, 2, axis=axis(dim, input.ndim))
    return a * jax.nn.sigmoid(b)


@register_lowering(torch.special.erfcx)
def erfcx(input):
    return jnp.exp(input * input) * jax.scipy.special.erfc(input)
