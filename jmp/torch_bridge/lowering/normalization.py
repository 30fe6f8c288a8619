"""Layer, RMS, group, batch and instance norm; statistics in float32 (or wider), results in the input's dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F

from jmp.torch_bridge.registry import register_lowering
from jmp.torch_bridge.tensor import unwrap


def _compute_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def _affine(y, weight, bias, shape):
    if weight is not None:
        y = y * weight.astype(y.dtype).reshape(shape)
    if bias is not None:
        y = y + bias.astype(y.dtype).reshape(shape)
    return y


@register_lowering(F.layer_norm, torch.layer_norm)
def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    axes = tuple(range(input.ndim - len(tuple(normalized_shape)), input.ndim))
    x = input.astype(_compute_dtype(input.dtype))
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps)
    return _affine(y, weight, bias, tuple(normalized_shape)).astype(input.dtype)


@register_lowering(F.rms_norm, getattr(torch, "rms_norm", None))
def rms_norm(input, normalized_shape, weight=None, eps=None):
    axes = tuple(range(input.ndim - len(tuple(normalized_shape)), input.ndim))
    if eps is None:
        eps = float(jnp.finfo(input.dtype).eps)
    x = input.astype(_compute_dtype(input.dtype))
    y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=axes, keepdims=True) + eps)
    return _affine(y, weight, None, tuple(normalized_shape)).astype(input.dtype)


@register_lowering(F.group_norm, torch.group_norm)
def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5, cudnn_enabled=True):
    n, c = input.shape[:2]
    x = input.astype(_compute_dtype(input.dtype)).reshape((n, num_groups, -1))
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    y = ((x - mean) * jax.lax.rsqrt(var + eps)).reshape(input.shape)
    return _affine(y, weight, bias, (1, c) + (1,) * (input.ndim - 2)).astype(input.dtype)


def batch_statistics(x, axes):
    """Mean and biased variance over ``axes`` (the normalisation statistics)."""
    mean = jnp.mean(x, axis=axes)
    var = jnp.mean(jnp.square(x - jnp.expand_dims(mean, axes)), axis=axes)
    return mean, var


def batch_norm_apply(input, mean, var, weight, bias, eps):
    """Normalise channel axis 1 of ``input`` with the given per-channel statistics."""
    shape = (1, -1) + (1,) * (input.ndim - 2)
    x = input.astype(_compute_dtype(input.dtype))
    y = (x - mean.reshape(shape)) * jax.lax.rsqrt(var.reshape(shape) + eps)
    return _affine(y, weight, bias, shape).astype(input.dtype)


def updated_running_stats(running_mean, running_var, mean, var, count, momentum):
    """Torch's running-stat update: momentum-weighted, with the unbiased batch variance (no gradient flows)."""
    mean, var = jax.lax.stop_gradient((mean, var))
    unbiased = var * (count / max(count - 1, 1))
    new_mean = (1 - momentum) * running_mean + momentum * mean.astype(running_mean.dtype)
    new_var = (1 - momentum) * running_var + momentum * unbiased.astype(running_var.dtype)
    return new_mean, new_var


@register_lowering(F.batch_norm, torch.batch_norm, raw=True)
def batch_norm(
    input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5, cudnn_enabled=True
):
    x = unwrap(input)
    weight, bias = unwrap(weight), unwrap(bias)
    if not training:
        return batch_norm_apply(x, unwrap(running_mean), unwrap(running_var), weight, bias, eps)
    axes = (0,) + tuple(range(2, x.ndim))
    mean, var = batch_statistics(x.astype(_compute_dtype(x.dtype)), axes)
    if running_mean is not None and running_var is not None:
        count = x.size // x.shape[1]
        new_mean, new_var = updated_running_stats(unwrap(running_mean), unwrap(running_var), mean, var, count, momentum)
        running_mean.set_value(new_mean)
        running_var.set_value(new_var)
    return batch_norm_apply(x, mean, var, weight, bias, eps)


@register_lowering(F.instance_norm, torch.instance_norm, raw=True)
def instance_norm(
    input,
    running_mean=None,
    running_var=None,
    weight=None,
    bias=None,
    use_input_stats=True,
    momentum=0.1,
    eps=1e-5,
    cudnn_enabled=True,
):
    x = unwrap(input)
    weight, bias = unwrap(weight), unwrap(bias)
    if not use_input_stats:
        return batch_norm_apply(x, unwrap(running_mean), unwrap(running_var), weight, bias, eps)
    axes = tuple(range(2, x.ndim))
    stats_dtype = _compute_dtype(x.dtype)
    mean = jnp.mean(x.astype(stats_dtype), axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x.astype(stats_dtype) - mean), axis=axes, keepdims=True)
    if running_mean is not None and running_var is not None:
        # torch: one batch-norm update per instance, averaged over the batch
        count = max(x.size // (x.shape[0] * x.shape[1]), 1)
        per_instance = (mean.reshape(x.shape[:2]), var.reshape(x.shape[:2]))
        running = (unwrap(running_mean), unwrap(running_var))
        new_mean, new_var = updated_running_stats(*running, *per_instance, count, momentum)
        running_mean.set_value(jnp.mean(new_mean, axis=0))
        running_var.set_value(jnp.mean(new_var, axis=0))
    y = (x.astype(stats_dtype) - mean) * jax.lax.rsqrt(var + eps)
    return _affine(y, weight, bias, (1, -1) + (1,) * (x.ndim - 2)).astype(x.dtype)


@register_lowering(F.local_response_norm)
def local_response_norm(input, size, alpha=1e-4, beta=0.75, k=1.0):
    sq = jnp.square(input)
    pad = [(0, 0), (size // 2, (size - 1) // 2)] + [(0, 0)] * (input.ndim - 2)
    summed = jax.lax.reduce_window(
        jnp.pad(sq, pad), 0.0, jax.lax.add, (1, size) + (1,) * (input.ndim - 2), (1,) * input.ndim, "VALID"
    )
    return input / (k + alpha / size * summed) ** beta


def _norm_except_dim(v, pow, dim):
    if dim == -1:
        return jnp.sum(jnp.abs(v) ** pow) ** (1.0 / pow)
    dim = dim % v.ndim
    axes = tuple(a for a in range(v.ndim) if a != dim)
    return jnp.sum(jnp.abs(v) ** pow, axis=axes, keepdims=True) ** (1.0 / pow)


@register_lowering(torch.norm_except_dim)
def norm_except_dim(v, pow=2, dim=0):
    return _norm_except_dim(v, pow, dim)


@register_lowering(torch._weight_norm)
def weight_norm(v, g, dim=0):
    """``g * v / ||v||`` with the norm over every dimension but ``dim`` (``weight_norm``'s parametrization)."""
    compute = _compute_dtype(v.dtype)
    norm = _norm_except_dim(v.astype(compute), 2, dim)
    return (v.astype(compute) * (g.astype(compute) / norm)).astype(v.dtype)
