"""``F.unfold`` / ``F.fold``: one strided slice per kernel offset; ``fold`` is its ``jax.linear_transpose``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch.nn.functional as F

from jmp.torch_bridge.lowering.convolution import ntuple
from jmp.torch_bridge.registry import register_lowering


def _blocks(size, kernel, dilation, padding, stride):
    """The number of block positions along one spatial axis, as torch's unfold counts them."""
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _unfold_batched(x, kernel, dilation, padding, stride):
    n, c, h, w = x.shape
    rows, cols = (_blocks(s, k, d, p, st) for s, k, d, p, st in zip((h, w), kernel, dilation, padding, stride))
    if rows < 1 or cols < 1:
        raise ValueError(
            f"F.unfold: kernel {kernel} with dilation {dilation}, padding {padding} and stride {stride} fits no "
            f"block in a {h}x{w} input; use a smaller kernel or more padding"
        )
    x = jnp.pad(x, ((0, 0), (0, 0), (padding[0], padding[0]), (padding[1], padding[1])))
    columns = []
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            top, left = i * dilation[0], j * dilation[1]
            window = x[
                :,
                :,
                top : top + stride[0] * (rows - 1) + 1 : stride[0],
                left : left + stride[1] * (cols - 1) + 1 : stride[1],
            ]
            columns.append(window.reshape(n, c, rows * cols))
    # (N, C, kh * kw, L) -> (N, C * kh * kw, L): torch's column order is channel, then kernel row, then column
    return jnp.stack(columns, axis=2).reshape(n, c * kernel[0] * kernel[1], rows * cols)


def _four_dimensional(input, name, ndim):
    if input.ndim != ndim and input.ndim != ndim - 1:
        raise ValueError(f"F.{name} takes a {ndim - 1}-d (unbatched) or {ndim}-d (batched) input, not {input.ndim}-d")
    return (input[None], True) if input.ndim == ndim - 1 else (input, False)


@register_lowering(F.unfold)
def unfold(input, kernel_size, dilation=1, padding=0, stride=1):
    x, unbatched = _four_dimensional(input, "unfold", 4)
    args = [ntuple(v, 2) for v in (kernel_size, dilation, padding, stride)]
    out = _unfold_batched(x, *args)
    return out[0] if unbatched else out


@register_lowering(F.fold)
def fold(input, output_size, kernel_size, dilation=1, padding=0, stride=1):
    x, unbatched = _four_dimensional(input, "fold", 3)
    kernel = ntuple(kernel_size, 2)
    channels, remainder = divmod(x.shape[1], kernel[0] * kernel[1])
    if remainder:
        raise ValueError(f"F.fold: the input's {x.shape[1]} rows are not a multiple of the kernel's {kernel} size")
    image = jax.ShapeDtypeStruct((x.shape[0], channels) + ntuple(output_size, 2), x.dtype)
    args = [kernel] + [ntuple(v, 2) for v in (dilation, padding, stride)]
    (out,) = jax.linear_transpose(lambda image: _unfold_batched(image, *args), image)(x)
    return out[0] if unbatched else out
