"""Convolutions and pooling in torch's NC... layout (``lax.conv_general_dilated``)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
from jax import lax

from jmp.torch_bridge.dtypes import to_jax_dtype
from jmp.torch_bridge.lowering import cpu_convolution
from jmp.torch_bridge.registry import register_lowering

_INDEX = to_jax_dtype(torch.int64)

_LAYOUTS = {1: ("NCH", "OIH", "NCH"), 2: ("NCHW", "OIHW", "NCHW"), 3: ("NCDHW", "OIDHW", "NCDHW")}


def ntuple(value, n: int) -> tuple[int, ...]:
    if isinstance(value, (tuple, list)):
        return tuple(int(v) for v in value) if len(value) == n else tuple(int(value[0]) for _ in range(n))
    return (int(value),) * n


def _batched(input, nd):
    """Torch accepts unbatched inputs (C, *spatial); JAX convolutions want a batch axis."""
    return (input[None], True) if input.ndim == nd + 1 else (input, False)


def conv(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """Torch's convNd: weight [out, in/groups, *kernel], input [N, C, *spatial]."""
    nd = weight.ndim - 2
    x, unbatched = _batched(input, nd)
    stride, dilation = ntuple(stride, nd), ntuple(dilation, nd)
    kernel = weight.shape[2:]
    if isinstance(padding, str):
        if padding == "valid":
            pads = [(0, 0)] * nd
        elif padding == "same":
            totals = [d * (k - 1) for d, k in zip(dilation, kernel)]
            pads = [(t // 2, t - t // 2) for t in totals]
        else:
            raise ValueError(f"padding must be 'valid', 'same' or numbers, not {padding!r}")
    else:
        pads = [(p, p) for p in ntuple(padding, nd)]
    out = _convolve(
        x, weight, bias, window_strides=stride, padding=pads, rhs_dilation=dilation, feature_group_count=groups
    )
    return out[0] if unbatched else out


def _convolve(x, weight, bias, **conv_args):
    """``lax.conv_general_dilated`` in torch's layout, plus the per-channel bias."""
    nd = weight.ndim - 2
    convolve = cpu_convolution.conv_general_dilated if jax.default_backend() == "cpu" else jax.lax.conv_general_dilated
    out = convolve(x, weight.astype(x.dtype), dimension_numbers=_LAYOUTS[nd], **conv_args)
    if bias is not None:
        out = out + bias.astype(out.dtype).reshape((1, -1) + (1,) * nd)
    return out


register_lowering(F.conv1d, F.conv2d, F.conv3d, torch.conv1d, torch.conv2d, torch.conv3d)(conv)


def conv_transpose(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    """Torch's conv_transposeNd: weight [in, out/groups, *kernel], as a dilated convolution."""
    nd = weight.ndim - 2
    x, unbatched = _batched(input, nd)
    stride, padding = ntuple(stride, nd), ntuple(padding, nd)
    output_padding, dilation = ntuple(output_padding, nd), ntuple(dilation, nd)
    c_in, c_out_group = weight.shape[:2]
    kernel = weight.shape[2:]
    w = weight.reshape((groups, c_in // groups, c_out_group) + kernel)
    w = jnp.swapaxes(w, 1, 2).reshape((groups * c_out_group, c_in // groups) + kernel)
    w = jnp.flip(w, axis=tuple(range(2, 2 + nd)))
    pads = [(d * (k - 1) - p, d * (k - 1) - p + op) for d, k, p, op in zip(dilation, kernel, padding, output_padding)]
    out = _convolve(
        x,
        w,
        bias,
        window_strides=(1,) * nd,
        padding=pads,
        lhs_dilation=stride,
        rhs_dilation=dilation,
        feature_group_count=groups,
    )
    return out[0] if unbatched else out


register_lowering(
    F.conv_transpose1d,
    F.conv_transpose2d,
    F.conv_transpose3d,
    torch.conv_transpose1d,
    torch.conv_transpose2d,
    torch.conv_transpose3d,
)(conv_transpose)


def _pool_geometry(spatial, kernel, stride, padding, dilation, ceil_mode):
    """Per-dimension (low, high) padding that yields torch's output size (ceil_mode included)."""
    pads = []
    for size, k, s, p, d in zip(spatial, kernel, stride, padding, dilation):
        span = size + 2 * p - d * (k - 1) - 1
        out = (math.ceil(span / s) if ceil_mode else span // s) + 1
        if ceil_mode and (out - 1) * s >= size + p:
            out -= 1  # the last window must start inside the input or left padding
        high = max((out - 1) * s + d * (k - 1) + 1 - size - p, 0)
        pads.append((p, high))
    return pads


def _pool_args(input, kernel_size, stride, padding, dilation, nd):
    kernel = ntuple(kernel_size, nd)
    stride = kernel if stride is None or (isinstance(stride, (list, tuple)) and not stride) else ntuple(stride, nd)
    return kernel, stride, ntuple(padding, nd), ntuple(dilation, nd)


def max_pool(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False, nd=2):
    x, unbatched = _batched(input, nd)
    kernel, stride, padding, dilation = _pool_args(x, kernel_size, stride, padding, dilation, nd)
    pads = _pool_geometry(x.shape[2:], kernel, stride, padding, dilation, ceil_mode)
    window = ((1, 1) + kernel, (1, 1) + stride, tuple([(0, 0), (0, 0)] + pads), (1, 1) + dilation)
    tiles = stride == kernel and set(dilation) == {1} and all(p == (0, 0) for p in pads)
    out = _max_pool_tiles(x, kernel) if tiles and math.prod(kernel) <= _MAX_TILE else _max_pool_first(x, window)
    if not return_indices:
        return out[0] if unbatched else out
    indices = _argmax_window(jax.lax.stop_gradient(x), window).astype(_INDEX)
    return (out[0], indices[0]) if unbatched else (out, indices)


def _lowest(dtype):
    return -jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min


def _window_kwargs(window):
    dimensions, strides, padding, dilation = window
    return dict(window_dimensions=dimensions, window_strides=strides, padding=padding, window_dilation=dilation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _max_pool_first(x, window):
    """Max pooling whose gradient goes to each window's first maximum, as torch's does (XLA's picks any tie)."""
    return jax.lax.reduce_window(x, np.asarray(_lowest(x.dtype), x.dtype), jax.lax.max, **_window_kwargs(window))


def _max_pool_first_forward(x, window):
    return _max_pool_first(x, window), (_argmax_window(x, window), x.shape)


def _max_pool_first_backward(window, residuals, grad):
    indices, shape = residuals
    spatial = int(np.prod(shape[2:]))

    def one_plane(positions, values):  # one (sample, channel) plane: each window's gradient to its maximum
        return jnp.zeros((spatial,), grad.dtype).at[positions].add(values)

    # vmapped over samples and channels, the scatter has them as batch dimensions: XLA's partitioner keeps it
    # on each device's own rows (a scatter indexed by row numbers instead gathered every row to every device)
    planes = jax.vmap(jax.vmap(one_plane))(indices.reshape(*shape[:2], -1), grad.reshape(*shape[:2], -1))
    return (planes.reshape(shape),)


_max_pool_first.defvjp(_max_pool_first_forward, _max_pool_first_backward)


# windows of up to this many elements take the tiled path: its gradient unrolls one select per element
_MAX_TILE = 64


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _max_pool_tiles(x, kernel):
    """``_max_pool_first`` for windows that tile the input (stride = kernel, no padding or dilation).

    A reshape and a reduction over the kernel axes, with a select per element for the gradient: both fuse, where
    the general form's variadic ``reduce_window`` and scatter are slow loops on CPU.
    """
    return jnp.max(_as_tiles(x, kernel), axis=tuple(range(3, 3 + 2 * len(kernel), 2)))


def _as_tiles(x, kernel):
    """x cropped to whole windows (torch's floor mode drops the rest), as (N, C, out_1, k_1, out_2, k_2, ...)."""
    outs = [size // k for size, k in zip(x.shape[2:], kernel)]
    cropped = x[(slice(None), slice(None), *(slice(0, o * k) for o, k in zip(outs, kernel)))]
    return cropped.reshape(x.shape[:2] + tuple(d for o, k in zip(outs, kernel) for d in (o, k)))


def _max_pool_tiles_forward(x, kernel):
    return _max_pool_tiles(x, kernel), x


def _max_pool_tiles_backward(kernel, x, grad):
    nd = len(kernel)
    tiles = _as_tiles(x, kernel)
    window_last = (0, 1, *range(2, 2 + 2 * nd, 2), *range(3, 3 + 2 * nd, 2))
    elements = lax.transpose(tiles, window_last).reshape(grad.shape + (-1,))
    out = jnp.max(elements, axis=-1)
    taken = jnp.zeros(grad.shape, bool)
    pieces = []
    for i in range(elements.shape[-1]):  # each window's first maximum takes the gradient, as in torch
        first = (elements[..., i] == out) & ~taken
        pieces.append(jnp.where(first, grad, jnp.zeros((), grad.dtype)))
        taken = taken | first
    placed = lax.transpose(jnp.stack(pieces, -1).reshape(grad.shape + kernel), tuple(np.argsort(window_last)))
    placed = placed.reshape(tiles.shape[:2] + tuple(o * k for o, k in zip(grad.shape[2:], kernel)))
    dropped = [(0, size - kept, 0) for size, kept in zip(x.shape[2:], placed.shape[2:])]
    return (lax.pad(placed, jnp.zeros((), grad.dtype), [(0, 0, 0), (0, 0, 0), *dropped]),)


_max_pool_tiles.defvjp(_max_pool_tiles_forward, _max_pool_tiles_backward)


def _argmax_window(x, window):
    """Torch's pooling indices: the flat spatial position of each window's first maximum."""
    spatial = x.shape[2:]
    positions = jnp.broadcast_to(jnp.arange(int(np.prod(spatial)), dtype=jnp.int32).reshape(spatial), x.shape)

    def first_max(a, b):
        (va, ia), (vb, ib) = a, b
        take_b = (vb > va) | ((vb == va) & (ib < ia))
        return jnp.where(take_b, vb, va), jnp.where(take_b, ib, ia)

    init = (jnp.asarray(_lowest(x.dtype), x.dtype), jnp.asarray(np.iinfo(np.int32).max, jnp.int32))
    _, indices = jax.lax.reduce_window((x, positions), init, first_max, **_window_kwargs(window))
    return indices


def _max_pool_nd(nd, with_indices=False):
    def lowering(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=with_indices):
        return max_pool(input, kernel_size, stride, padding, dilation, ceil_mode, with_indices or return_indices, nd)

    return lowering


register_lowering(F.max_pool1d, torch.max_pool1d)(_max_pool_nd(1))
register_lowering(F.max_pool2d, torch.max_pool2d)(_max_pool_nd(2))
register_lowering(F.max_pool3d, torch.max_pool3d)(_max_pool_nd(3))
register_lowering(F.max_pool1d_with_indices)(_max_pool_nd(1, with_indices=True))
register_lowering(F.max_pool2d_with_indices)(_max_pool_nd(2, with_indices=True))
register_lowering(F.max_pool3d_with_indices)(_max_pool_nd(3, with_indices=True))


def avg_pool(
    input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None, nd=2
):
    x, unbatched = _batched(input, nd)
    kernel, stride, padding, _ = _pool_args(x, kernel_size, stride, padding, 1, nd)
    pads = _pool_geometry(x.shape[2:], kernel, stride, padding, (1,) * nd, ceil_mode)
    window = dict(window_dimensions=(1, 1) + kernel, window_strides=(1, 1) + stride)
    all_pads = [(0, 0), (0, 0)] + pads
    total = jax.lax.reduce_window(x, np.asarray(0, x.dtype), jax.lax.add, padding=all_pads, **window)
    if divisor_override:
        divisor = divisor_override
    else:
        # torch's divisor: the window clipped to the input (plus explicit padding if counted)
        ones = np.ones(x.shape[2:], np.float32)
        if count_include_pad:
            ones = np.pad(ones, [(p, p) for p in padding], constant_values=1.0)
            extra = [(0, high - low) for (low, high) in pads]
        else:
            extra = pads
        counts = jax.lax.reduce_window(
            jnp.asarray(ones, x.dtype), jnp.asarray(0, x.dtype), jax.lax.add, kernel, stride, extra
        )
        divisor = counts
    out = total / divisor
    return out[0] if unbatched else out


def _avg_pool_nd(nd):
    def lowering(
        input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None
    ):
        return avg_pool(input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, nd)

    return lowering


register_lowering(F.avg_pool1d, torch.avg_pool1d)(_avg_pool_nd(1))
register_lowering(F.avg_pool2d)(_avg_pool_nd(2))
register_lowering(F.avg_pool3d)(_avg_pool_nd(3))


def _adaptive_bins(size: int, out: int) -> list[tuple[int, int]]:
    return [((i * size) // out, -(-((i + 1) * size) // out)) for i in range(out)]


def _averaging_matrix(size: int, out: int) -> np.ndarray:
    matrix = np.zeros((out, size), np.float32)
    for i, (start, end) in enumerate(_adaptive_bins(size, out)):
        matrix[i, start:end] = 1.0 / (end - start)
    return matrix


def adaptive_avg_pool(input, output_size, nd):
    spatial = input.shape[-nd:]
    outs = [s if o is None else int(o) for s, o in zip(spatial, ntuple_optional(output_size, nd))]
    x = input
    for i, (size, out) in enumerate(zip(spatial, outs)):
        ax = input.ndim - nd + i
        matrix = jnp.asarray(_averaging_matrix(size, out), x.dtype)
        x = jnp.moveaxis(jnp.tensordot(jnp.moveaxis(x, ax, -1), matrix, axes=[[-1], [1]]), -1, ax)
    return x


def adaptive_max_pool(input, output_size, nd, return_indices=False):
    """Max over torch's adaptive bins, gathered per dimension into padded windows."""
    spatial = input.shape[-nd:]
    outs = [s if o is None else int(o) for s, o in zip(spatial, ntuple_optional(output_size, nd))]
    lead = input.shape[:-nd]
    lowest = _lowest(input.dtype)
    windows = input
    positions = np.arange(int(np.prod(spatial))).reshape(spatial)
    for i, (size, out) in enumerate(zip(spatial, outs)):
        bins = _adaptive_bins(size, out)
        width = max(end - start for start, end in bins)
        gather = np.array([[min(start + j, end - 1) for j in range(width)] for start, end in bins])
        valid = np.array([[start + j < end for j in range(width)] for start, end in bins])
        ax = len(lead) + 2 * i  # each earlier dimension became (out, width)
        windows = jnp.take(windows, gather.reshape(-1), axis=ax).reshape(
            windows.shape[:ax] + (out, width) + windows.shape[ax + 1 :]
        )
        shape = [1] * windows.ndim
        shape[ax], shape[ax + 1] = out, width
        windows = jnp.where(valid.reshape(shape), windows, lowest)
        positions = np.take(positions, gather.reshape(-1), axis=2 * i).reshape(
            positions.shape[: 2 * i] + (out, width) + positions.shape[2 * i + 1 :]
        )
    order = (
        tuple(range(len(lead)))
        + tuple(len(lead) + 2 * i for i in range(nd))
        + tuple(len(lead) + 2 * i + 1 for i in range(nd))
    )
    windows = jnp.transpose(windows, order).reshape(lead + tuple(outs) + (-1,))
    best = jnp.argmax(jax.lax.stop_gradient(windows), axis=-1)  # first maximum: torch's gradient target
    values = jnp.take_along_axis(windows, best[..., None], axis=-1)[..., 0]
    if not return_indices:
        return values
    flat_positions = np.transpose(positions, tuple(range(0, 2 * nd, 2)) + tuple(range(1, 2 * nd, 2)))
    flat_positions = jnp.asarray(flat_positions.reshape(tuple(outs) + (-1,)))
    indices = jnp.take_along_axis(jnp.broadcast_to(flat_positions, windows.shape), best[..., None], axis=-1)
    return values, indices[..., 0].astype(_INDEX)


def ntuple_optional(value, n):
    if isinstance(value, (tuple, list)):
        return tuple(value)
    return (value,) * n


def _adaptive(fn, nd):
    def lowering(input, output_size, *args, **kwargs):
        return fn(input, output_size, nd, *args, **kwargs)

    return lowering


register_lowering(F.adaptive_avg_pool1d, torch.adaptive_avg_pool1d)(_adaptive(adaptive_avg_pool, 1))
register_lowering(F.adaptive_avg_pool2d)(_adaptive(adaptive_avg_pool, 2))
register_lowering(F.adaptive_avg_pool3d)(_adaptive(adaptive_avg_pool, 3))
register_lowering(F.adaptive_max_pool1d, torch.adaptive_max_pool1d)(_adaptive(adaptive_max_pool, 1))
register_lowering(F.adaptive_max_pool2d)(_adaptive(adaptive_max_pool, 2))
register_lowering(F.adaptive_max_pool3d)(_adaptive(adaptive_max_pool, 3))


def _adaptive_max_with_indices(nd):
    def lowering(input, output_size, return_indices=True):
        return adaptive_max_pool(input, output_size, nd, True)

    return lowering


register_lowering(F.adaptive_max_pool1d_with_indices)(_adaptive_max_with_indices(1))
register_lowering(F.adaptive_max_pool2d_with_indices)(_adaptive_max_with_indices(2))
register_lowering(F.adaptive_max_pool3d_with_indices)(_adaptive_max_with_indices(3))


@register_lowering(F.pixel_shuffle, torch.pixel_shuffle)
def pixel_shuffle(input, upscale_factor):
    r = upscale_factor
    *lead, c, h, w = input.shape
    x = input.reshape(tuple(lead) + (c // (r * r), r, r, h, w))
    n = len(lead)
    x = jnp.transpose(x, tuple(range(n)) + (n, n + 3, n + 1, n + 4, n + 2))
    return x.reshape(tuple(lead) + (c // (r * r), h * r, w * r))


@register_lowering(F.pixel_unshuffle, torch.pixel_unshuffle)
def pixel_unshuffle(input, downscale_factor):
    r = downscale_factor
    *lead, c, h, w = input.shape
    x = input.reshape(tuple(lead) + (c, h // r, r, w // r, r))
    n = len(lead)
    x = jnp.transpose(x, tuple(range(n)) + (n, n + 2, n + 4, n + 1, n + 3))
    return x.reshape(tuple(lead) + (c * r * r, h // r, w // r))
