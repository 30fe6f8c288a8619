"""One Pallas launch over many tensors: they are packed into one ``[rows, 128]`` buffer per role.

apex's ``multi_tensor_apply`` walks a list of pointers; Pallas blocks index one array each, so the tensors of a
role (all parameters, all gradients, all first moments, ...) are flattened into one buffer, padded to whole
blocks, updated by one ``pallas_call`` whose grid runs over the blocks, and split back. A block is
``BLOCK_ROWS x LANES`` elements: lane-dense for TPU's (8, 128) tiles, a power of two for Triton.

Scalars (learning rate, bias corrections, ...) reach the kernel as one small float32 vector, read whole by
every block.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton

LANES = 128
BLOCK_ROWS = 64  # 8192 elements: 32 KiB per float32 operand and block
_SCALAR_SLOTS = (
    32  # the scalar vector's length: 128 bytes (Mosaic GPU copies whole warpgroups; Triton wants a power of two)
)


def packed_rows(tensors: Sequence[jax.Array]) -> int:
    """Rows of the buffer holding ``tensors``: their elements, rounded up to whole blocks."""
    elements = sum(math.prod(t.shape) for t in tensors)
    block = BLOCK_ROWS * LANES
    return max(1, -(-elements // block)) * BLOCK_ROWS


def pack(tensors: Sequence[jax.Array], dtype: jnp.dtype) -> jax.Array:
    """``tensors`` flattened one after the other into a zero-padded ``[rows, LANES]`` buffer of ``dtype``."""
    flat = [jnp.ravel(t).astype(dtype) for t in tensors]
    rows = packed_rows(tensors)
    padding = rows * LANES - sum(f.shape[0] for f in flat)
    return jnp.concatenate([*flat, jnp.zeros((padding,), dtype)]).reshape(rows, LANES)


def unpack(buffer: jax.Array, like: Sequence[jax.Array]) -> list[jax.Array]:
    """The tensors ``pack`` put into ``buffer``, shaped and typed as ``like``."""
    flat = buffer.reshape(-1)
    out, offset = [], 0
    for t in like:
        size = math.prod(t.shape)
        out.append(flat[offset : offset + size].reshape(t.shape).astype(t.dtype))
        offset += size
    return out


def scalar_vector(*values: jax.Array | float) -> jax.Array:
    """The kernel's scalars as one float32 vector (read with ``scalars[i]`` in the kernel)."""
    if len(values) > _SCALAR_SLOTS:
        raise ValueError(f"at most {_SCALAR_SLOTS} scalars per kernel, not {len(values)}")
    parts = [jnp.asarray(v, jnp.float32).reshape(()) for v in values]
    parts += [jnp.zeros((), jnp.float32)] * (_SCALAR_SLOTS - len(parts))
    return jnp.stack(parts)


def elementwise(
    body: Callable[..., tuple[jax.Array, ...]],
    scalars: jax.Array,
    buffers: Sequence[jax.Array],
    outputs: int,
    *,
    interpret: bool,
    name: str,
) -> tuple[jax.Array, ...]:
    """``body(scalars, *blocks) -> output blocks`` applied block by block over equally shaped ``buffers``.

    One ``pallas_call``; the first ``outputs`` buffers are updated in place (``input_output_aliases``), so the
    kernel holds no second copy of the state it rewrites.
    """
    rows = buffers[0].shape[0]
    block = pl.BlockSpec((BLOCK_ROWS, LANES), lambda i: (i, 0))
    whole = pl.BlockSpec((_SCALAR_SLOTS,), lambda i: (0,))

    def kernel(scalar_ref, *refs):
        in_refs, out_refs = refs[: len(buffers)], refs[len(buffers) :]
        results = body(scalar_ref, *(r[...] for r in in_refs))
        for ref, value in zip(out_refs, results, strict=True):
            ref[...] = value.astype(ref.dtype)

    call = pl.pallas_call(
        kernel,
        out_shape=tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in buffers[:outputs]),
        grid=(rows // BLOCK_ROWS,),
        in_specs=[whole] + [block] * len(buffers),
        out_specs=tuple([block] * outputs),
        input_output_aliases={1 + i: i for i in range(outputs)},
        interpret=interpret,
        name=name,
        compiler_params=pallas_triton.CompilerParams(num_warps=4, num_stages=1),  # on GPU: Triton
    )
    return tuple(call(scalars, *buffers))


# --- whole-tensor reductions over per-device shards --------------------------------------------------------------

_SPLIT_OVER: contextvars.ContextVar[dict | None] = contextvars.ContextVar("jmp_kernels_split_over", default=None)


@contextlib.contextmanager
def split_over(axes_by_path: dict[tuple, tuple[str, ...]]) -> Iterator[None]:
    """Within the block (inside a ``shard_map``), each parameter at a tree path is a shard, split over the
    mesh axes named for that path: ``whole_sums`` then adds the shards' sums over those axes."""
    token = _SPLIT_OVER.set(axes_by_path)
    try:
        yield
    finally:
        _SPLIT_OVER.reset(token)


def whole_sums(paths: Sequence[tuple], local: Sequence[jax.Array]) -> list[jax.Array]:
    """Each tensor's sum from its shard's ``local`` sum: added over the axes splitting the tensor at its path
    (``split_over``), or as given outside such a block."""
    axes_by_path = _SPLIT_OVER.get()
    if axes_by_path is None:
        return list(local)
    return [jax.lax.psum(x, axes) if (axes := axes_by_path.get(path, ())) else x for path, x in zip(paths, local)]


def tree_paths(tree: Any) -> list[tuple]:
    """The tree paths of ``tree``'s leaves, in leaf order."""
    return [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
