"""``torch.nn.functional``: linear, embedding, dropout, padding, distances, interpolation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F

from jmp.torch_bridge.lowering.arguments import axis
from jmp.torch_bridge.lowering.convolution import adaptive_avg_pool
from jmp.torch_bridge.lowering.random import next_key
from jmp.torch_bridge.lowering.reductions import vector_norm
from jmp.torch_bridge.registry import register_lowering


@register_lowering(F.linear)
def linear(input, weight, bias=None):
    """``input @ weight.T + bias`` with torch's [out, in] weight, contracted without a transpose."""
    out = jax.lax.dot_general(input, weight.astype(input.dtype), (((input.ndim - 1,), (weight.ndim - 1,)), ((), ())))
    if bias is not None:
        out = out + bias.astype(out.dtype)
    return out


@register_lowering(F.bilinear)
def bilinear(input1, input2, weight, bias=None):
    out = jnp.einsum("...i,oij,...j->...o", input1, weight, input2)
    return out if bias is None else out + bias


def embedding_lookup(input, weight, padding_idx=None):
    """Rows of ``weight``; the ``padding_idx`` row gets no gradient, as in torch."""
    if padding_idx is not None:
        row = padding_idx % weight.shape[0]
        is_pad = (jnp.arange(weight.shape[0]) == row)[:, None]
        weight = jnp.where(is_pad, jax.lax.stop_gradient(weight), weight)
    return jnp.take(weight, input, axis=0)


@register_lowering(F.embedding)
def embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False):
    if max_norm is not None:
        raise ValueError("embedding with max_norm renormalises weights in place; it is not supported")
    if scale_grad_by_freq:
        raise ValueError("embedding with scale_grad_by_freq=True is not supported")
    return embedding_lookup(input, weight, padding_idx)


_ALPHA = -1.7580993408473766  # alpha dropout's value for a dropped entry: SELU's -scale * alpha


def dropped(input, rate: float, key, mask_shape=None, alpha: bool = False):
    """Inverted dropout of ``input`` at ``rate`` (below 1) with ``key``; ``alpha``: alpha dropout (SELU's)."""
    keep = 1.0 - rate
    mask = jax.random.bernoulli(key, keep, mask_shape or input.shape)
    if alpha:
        a = (keep + _ALPHA * _ALPHA * keep * rate) ** -0.5
        return a * jnp.where(mask, input, _ALPHA) + (-a * _ALPHA * rate)
    return jnp.where(mask, input / keep, jnp.zeros((), input.dtype))


def channel_mask_shape(shape, spatial_dims: int) -> tuple:
    """A channel dropout's mask shape: one draw per (sample,) channel."""
    batched = len(shape) == spatial_dims + 2
    return tuple(shape[: 2 if batched else 1]) + (1,) * spatial_dims


def apply_dropout(input, p: float, training: bool, mask_shape=None):
    """Inverted dropout with a key from the running module's ``dropout`` stream."""
    if not training or p == 0.0:
        return input
    if p == 1.0:
        return jnp.zeros_like(input)
    return dropped(input, p, next_key("dropout"), mask_shape)


@register_lowering(F.dropout, torch.dropout, inplace_flag="inplace", inplace=(torch.dropout_,))
def dropout(input, p=0.5, training=True, inplace=False):
    return apply_dropout(input, p, training)


def _channel_dropout(spatial_dims):
    def lowering(input, p=0.5, training=True, inplace=False):
        return apply_dropout(input, p, training, channel_mask_shape(input.shape, spatial_dims))

    return lowering


register_lowering(F.dropout1d, inplace_flag="inplace")(_channel_dropout(1))
register_lowering(F.dropout2d, inplace_flag="inplace")(_channel_dropout(2))
register_lowering(F.dropout3d, inplace_flag="inplace")(_channel_dropout(3))


@register_lowering(F.alpha_dropout, inplace_flag="inplace")
def alpha_dropout(input, p=0.5, training=False, inplace=False):
    if not training or p == 0.0:
        return input
    return dropped(input, p, next_key("dropout"), alpha=True)


@register_lowering(F.pad)
def pad(input, pad, mode="constant", value=None):
    pairs = [(0, 0)] * input.ndim
    for i in range(len(pad) // 2):
        pairs[input.ndim - 1 - i] = (int(pad[2 * i]), int(pad[2 * i + 1]))
    if mode == "constant":
        fill = jnp.asarray(0 if value is None else value, input.dtype)
        return jax.lax.pad(input, fill, [(lo, hi, 0) for lo, hi in pairs])
    if mode not in ("reflect", "replicate", "circular"):
        raise ValueError(f"pad mode must be constant, reflect, replicate or circular, not {mode!r}")
    if input.size == 0:
        return jnp.zeros(tuple(n + lo + hi for n, (lo, hi) in zip(input.shape, pairs)), input.dtype)
    out = input
    for ax, (low, high) in enumerate(pairs):
        if low or high:
            out = jnp.take(out, _pad_source_positions(input.shape[ax], low, high, mode), axis=ax)
    return out


def _pad_source_positions(size: int, low: int, high: int, mode: str) -> np.ndarray:
    """For each output position along one axis, the input position it copies (negative pads crop).

    Circular padding, as in torch, wraps what is left after cropping.
    """
    if mode == "circular":
        kept = np.arange(max(-low, 0), size - max(-high, 0))
        return kept[np.arange(-max(low, 0), len(kept) + max(high, 0)) % len(kept)]
    positions = np.arange(-low, size + high)
    if mode == "replicate":
        return np.clip(positions, 0, size - 1)
    period = 2 * (size - 1)  # reflect: mirror about the edges without repeating them
    folded = np.abs(positions) % period if period else np.zeros_like(positions)
    return np.where(folded >= size, period - folded, folded)


@register_lowering(F.normalize)
def normalize(input, p=2.0, dim=1, eps=1e-12, out=None):
    norm = vector_norm(input, p, dim, keepdim=True)
    return input / jnp.maximum(norm, eps)


@register_lowering(F.cosine_similarity, torch.cosine_similarity)
def cosine_similarity(x1, x2, dim=1, eps=1e-8):
    x1, x2 = jnp.broadcast_arrays(x1, x2)
    if x1.ndim == 0:
        return cosine_similarity(x1.reshape(1), x2.reshape(1), 0, eps).reshape(())
    ax = axis(dim, x1.ndim)
    norm1 = _clamped_norm(x1, ax, eps)
    norm2 = _clamped_norm(x2, ax, eps)
    return jnp.sum((x1 / norm1) * (x2 / norm2), axis=ax)


def _clamped_norm(x, ax, eps):
    """Torch clamps the norm under no_grad: the value is clamped, the gradient is the norm's."""
    norm = jnp.linalg.norm(x, axis=ax, keepdims=True)
    return norm + jax.lax.stop_gradient(jnp.maximum(norm, eps) - norm)


@register_lowering(F.pairwise_distance, torch.pairwise_distance)
def pairwise_distance(x1, x2, p=2.0, eps=1e-6, keepdim=False):
    diff = x1 - x2 + eps
    if p == 2.0:
        return jnp.sqrt(jnp.sum(jnp.square(diff), axis=-1, keepdims=keepdim))
    return jnp.sum(jnp.abs(diff) ** p, axis=-1, keepdims=keepdim) ** (1.0 / p)


def _cubic_weights(t: float, a: float = -0.75) -> list[float]:
    """Torch's cubic convolution weights for the 4 taps around a source position."""

    def near(x):
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


def _interpolation_matrix(size_in, size_out, scale, mode, align_corners):
    matrix = np.zeros((size_out, size_in), np.float32)
    for o in range(size_out):
        if mode == "cubic":
            if align_corners:
                src = o * (size_in - 1) / (size_out - 1) if size_out > 1 else 0.0
            else:
                src = (o + 0.5) * scale - 0.5
            base = int(np.floor(src))
            for tap, weight in enumerate(_cubic_weights(src - base)):
                matrix[o, min(max(base - 1 + tap, 0), size_in - 1)] += weight
            continue
        if mode == "nearest":
            matrix[o, min(int(np.floor(o * scale)), size_in - 1)] = 1.0
        elif mode == "nearest-exact":
            matrix[o, min(int(np.floor((o + 0.5) * scale)), size_in - 1)] = 1.0
        else:  # linear
            if align_corners:
                src = o * (size_in - 1) / (size_out - 1) if size_out > 1 else 0.0
            else:
                src = max((o + 0.5) * scale - 0.5, 0.0)
            i0 = min(int(np.floor(src)), size_in - 1)
            i1 = min(i0 + 1, size_in - 1)
            frac = src - i0
            matrix[o, i0] += 1.0 - frac
            matrix[o, i1] += frac
    return matrix


def _per_dim(value, nd):
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * nd


@register_lowering(F.interpolate, F.upsample)
def interpolate(
    input,
    size=None,
    scale_factor=None,
    mode="nearest",
    align_corners=None,
    recompute_scale_factor=None,
    antialias=False,
):
    nd = input.ndim - 2
    if mode in ("bilinear", "trilinear"):
        mode = "linear"
    if mode == "bicubic":
        mode = "cubic"
    if mode == "area" and not antialias:
        target = (
            size
            if size is not None
            else tuple(int(np.floor(s * f)) for s, f in zip(input.shape[2:], _per_dim(scale_factor, nd)))
        )
        return adaptive_avg_pool(input, target, nd)
    if mode not in ("nearest", "nearest-exact", "linear", "cubic") or antialias:
        raise ValueError(f"interpolate mode {mode!r} (antialias={antialias}) is not supported by the JAX lowering")
    spatial = input.shape[2:]
    factors = None
    if size is None:
        factors = _per_dim(scale_factor, nd)
        outs = [int(np.floor(s * f)) for s, f in zip(spatial, factors)]
    else:
        outs = list(size) if isinstance(size, (tuple, list)) else [size] * nd
    x = input
    for i, (size_in, size_out) in enumerate(zip(spatial, outs)):
        use_factor = factors is not None and not recompute_scale_factor
        scale = 1.0 / factors[i] if use_factor else size_in / size_out
        matrix = jnp.asarray(_interpolation_matrix(size_in, size_out, scale, mode, align_corners), x.dtype)
        x = jnp.moveaxis(jnp.tensordot(jnp.moveaxis(x, 2 + i, -1), matrix, axes=[[-1], [1]]), -1, 2 + i)
    return x
