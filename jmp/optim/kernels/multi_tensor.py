"""One Pallas launch over many tensors, each its own operand: nothing is copied into a packed buffer.

The grid runs over every tensor's blocks in turn (tensor ``k`` owns steps ``start[k] .. start[k] + blocks[k]``;
other tensors' block indices are clamped) and the body runs under ``pl.when`` for the owner. Tensors are viewed
flat in ``BLOCK``-element blocks, the last masked; outputs alias their inputs. Scalars come as one small
float32 vector.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton

from jmp.torch_bridge.context_vars import set_within

BLOCK = 8192  # elements per block: 32 KiB per float32 operand, a power of two for Triton
ARGUMENT_BYTES = 4096  # what a CUDA kernel's arguments may take (apex's multi_tensor_apply chunks for it too)
_SCALAR_SLOTS = (
    32  # the scalar vector's length: 128 bytes (Mosaic GPU copies whole warpgroups; Triton wants a power of two)
)


def scalar_vector(*values: jax.Array | float) -> jax.Array:
    """The kernel's scalars as one float32 vector (read with ``scalars[i]`` in the kernel)."""
    if len(values) > _SCALAR_SLOTS:
        raise ValueError(f"at most {_SCALAR_SLOTS} scalars per kernel, not {len(values)}")
    parts = [jnp.asarray(v, jnp.float32).reshape(()) for v in values]
    parts += [jnp.zeros((), jnp.float32)] * (_SCALAR_SLOTS - len(parts))
    return jnp.stack(parts)


def launches(tensors: Sequence[int], operands: int) -> list[Sequence[int]]:
    """``tensors`` cut into as few launches as a kernel's pointer arguments allow (73 tensors for Adam's 7 operands)."""
    per_launch = max(1, (ARGUMENT_BYTES // 8 - 1) // operands)
    return [tensors[i : i + per_launch] for i in range(0, len(tensors), per_launch)]


def elementwise(
    body: Callable[..., tuple[jax.Array, ...]],
    scalars: jax.Array,
    columns: Sequence[Sequence[jax.Array]],
    outputs: Sequence[int],
    *,
    in_place: Collection[int] = (),
    interpret: bool,
    name: str,
) -> list[list[jax.Array]]:
    """``body(scalar_ref, *values) -> results`` over every element of the ``columns`` tensors, in one ``pallas_call``.

    ``columns[r][k]`` is tensor ``k`` of role ``r`` (a tensor's roles share a shape); output ``j`` is shaped and typed
    like column ``outputs[j]`` and overwrites it where ``j`` is in ``in_place``. Returns ``[output][tensor]``.
    """
    count = len(columns[0])
    sizes = [math.prod(t.shape) for t in columns[0]]
    live = [k for k in range(count) if sizes[k] > 0]  # an empty tensor has no block: it comes back as it was
    result = [[columns[c][k] for k in range(count)] for c in outputs]
    if not live:
        return result
    blocks = [-(-sizes[k] // BLOCK) for k in live]
    starts = [sum(blocks[:i]) for i in range(len(live))]
    specs = [
        pl.BlockSpec((BLOCK,), lambda i, s=start, n=n: (jnp.clip(i - s, 0, n - 1),)) for start, n in zip(starts, blocks)
    ]
    operands = [jnp.ravel(column[k]) for column in columns for k in live]  # role-major
    width = len(live)

    def kernel(scalar_ref, *refs):
        in_refs, out_refs = refs[: len(columns) * width], refs[len(columns) * width :]
        step = pl.program_id(0)
        for t, (start, n) in enumerate(zip(starts, blocks)):
            size = sizes[live[t]]

            @pl.when((step >= start) & (step < start + n))
            def _(t=t, start=start, size=size):
                mask = None
                if size % BLOCK:  # the tensor's last block runs past its end
                    mask = (step - start) * BLOCK + jax.lax.iota(jnp.int32, BLOCK) < size
                values = [pallas_triton.load(in_refs[r * width + t], mask=mask) for r in range(len(columns))]
                results = body(scalar_ref, *values)
                for j, value in enumerate(results):
                    ref = out_refs[j * width + t]
                    pallas_triton.store(ref, value.astype(ref.dtype), mask=mask)

    out_shape = [jax.ShapeDtypeStruct((sizes[k],), columns[c][k].dtype) for c in outputs for k in live]
    call = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(sum(blocks),),
        in_specs=[pl.BlockSpec((_SCALAR_SLOTS,), lambda i: (0,))] + specs * len(columns),
        out_specs=specs * len(outputs),
        input_output_aliases={
            1 + outputs[j] * width + t: j * width + t for j in sorted(in_place) for t in range(width)
        },
        interpret=interpret,
        name=name,
        compiler_params=pallas_triton.CompilerParams(num_warps=4, num_stages=1),  # on GPU: Triton
    )
    flat = call(scalars, *operands)
    for j, c in enumerate(outputs):
        for t, k in enumerate(live):
            result[j][k] = flat[j * width + t].reshape(columns[c][k].shape)
    return result


# --- whole-tensor reductions over per-device shards --------------------------------------------------------------

_SPLIT_OVER: contextvars.ContextVar[dict | None] = contextvars.ContextVar("jmp_kernels_split_over", default=None)


@contextlib.contextmanager
def split_over(axes_by_path: dict[tuple, tuple[str, ...]]) -> Iterator[None]:
    """Within the block (inside a ``shard_map``), each parameter at a tree path is a shard, split over the
    mesh axes named for that path: ``whole_sums`` then adds the shards' sums over those axes."""
    with set_within(_SPLIT_OVER, axes_by_path):
        yield


def whole_sums(paths: Sequence[tuple], local: Sequence[jax.Array]) -> list[jax.Array]:
    """Each tensor's sum from its shard's ``local`` sum, added over the axes ``split_over`` names for its path."""
    axes_by_path = _SPLIT_OVER.get()
    if axes_by_path is None:
        return list(local)
    return [jax.lax.psum(x, axes) if (axes := axes_by_path.get(path, ())) else x for path, x in zip(paths, local)]


def tree_paths(tree: Any) -> list[tuple]:
    """The tree paths of ``tree``'s leaves, in leaf order."""
    return [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
