"""Shapes torch rejects raise torch's error, naming the module, before JAX's own error would.

``F.linear`` / ``Linear``, ``matmul`` / ``mm`` / ``bmm`` / ``@`` and the convolutions compare shapes while
traced and raise ``ShapeMismatchError`` (a ``RuntimeError`` and a ``LoweringError``) with torch's message.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import torch
import torch.nn.functional as F

from jmp.errors import ShapeMismatchError

Where = Callable[[], str]  # the dispatcher's where(): " (in module ..., at file:line: code)", made only to raise


def _mm(rows: int, inner: int, other_inner: int, columns: int, where: Where) -> None:
    if inner != other_inner:
        raise ShapeMismatchError(
            f"mat1 and mat2 shapes cannot be multiplied ({rows}x{inner} and {other_inner}x{columns}){where()}"
        )


def linear(where: Where, input: Any, weight: Any, bias: Any = None) -> None:
    shape, (out, features) = jnp.shape(input), jnp.shape(weight)
    if not shape:
        return
    _mm(math.prod(shape[:-1]), shape[-1], features, out, where)


def matmul(where: Where, input: Any, other: Any) -> None:
    a, b = jnp.shape(input), jnp.shape(other)
    if not a or len(b) < 2:  # dot products and matrix-vector products: JAX's error
        return
    if len(b) == 2:
        _mm(math.prod(a[:-1]), a[-1], b[0], b[1], where)
    elif len(a) >= 2 and a[:-2] == b[:-2] and a[-1] != b[-2]:
        batch = math.prod(a[:-2])
        raise ShapeMismatchError(
            "Expected size for first two dimensions of batch2 tensor to be: "
            f"[{batch}, {a[-1]}] but got: [{batch}, {b[-2]}].{where()}"
        )


def convolution(where: Where, input: Any, weight: Any, bias: Any = None, *args: Any, **kwargs: Any) -> None:
    groups = kwargs.get("groups", args[3] if len(args) > 3 else 1)  # after stride, padding, dilation
    shape, kernel = jnp.shape(input), jnp.shape(weight)
    if len(shape) == len(kernel) - 1:  # unbatched: torch names the input with a batch of 1
        shape = (1,) + tuple(shape)
    if len(shape) != len(kernel) or shape[1] == kernel[1] * groups:
        return
    raise ShapeMismatchError(
        f"Given groups={groups}, weight of size {list(kernel)}, expected input{list(shape)} to have "
        f"{kernel[1] * groups} channels, but got {shape[1]} channels instead{where()}"
    )


T = torch.Tensor
CHECKED: dict[Any, Callable[..., None]] = {
    F.linear: linear,
    **dict.fromkeys((torch.matmul, T.matmul, T.__matmul__, torch.mm, T.mm, torch.bmm, T.bmm), matmul),
    **dict.fromkeys((F.conv1d, F.conv2d, F.conv3d, torch.conv1d, torch.conv2d, torch.conv3d), convolution),
}


def run(checked: Callable[..., None], where: Where, args: tuple, kwargs: dict) -> None:
    """The dispatcher's call of a check (arguments the check cannot bind are the lowering's to reject)."""
    try:
        checked(where, *args, **kwargs)
    except (TypeError, ValueError):
        return
