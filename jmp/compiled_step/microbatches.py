"""The batch of a step: assembled whole across processes, checked to divide, and split into microbatches.

The batch is one array sharded over the axes along which processes feed it (the data-parallel mesh axes, and
tensor parallelism when its processes load different rows); inside the program it is split into
``microbatches``, each an equal slice of every shard (as in SMP, where every data-parallel rank splits its
own part of the batch), and laid out over the data axes, so every device stays busy on every microbatch.

Context parallelism splits each input's sequence too (``jmp.sharding.batch_spec``; docs/parallelism.md).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jmp.errors import StepError
from jmp.runtime import mesh_state as state
from jmp.runtime import notices
from jmp.sharding.batch_spec import batch_spec


def data_shards(mesh: jax.sharding.Mesh, axes: tuple[str, ...] = state.DATA_AXES) -> int:
    """How many parts the mesh ``axes`` (by default the data-parallel ones) split the batch into."""
    return int(np.prod([mesh.shape[a] for a in axes]))


def over_data_axes(
    x: jax.Array, axis: int, mesh: jax.sharding.Mesh, axes: tuple[str, ...] = state.DATA_AXES
) -> jax.Array:
    """The batch laid out over the data axes alone: processes of a tensor-parallel group feed different rows
    (SMP's rule without ``prescaled_batch``), and the group computes on all of them. The sequence stays split
    over "cp" (``batch_spec``)."""
    spec = batch_spec(x.shape, axis, axes, mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def split(x: jax.Array, axis: int, microbatches: int, shards: int) -> jax.Array:
    """[.., B, ..] -> [microbatches, .., B / microbatches, ..], each microbatch an equal slice of every shard."""
    size = x.shape[axis]
    per = size // (shards * microbatches)
    x = x.reshape(x.shape[:axis] + (shards, microbatches, per) + x.shape[axis + 1 :])
    x = jnp.moveaxis(x, axis + 1, 0)
    return x.reshape((microbatches,) + x.shape[1 : axis + 1] + (shards * per,) + x.shape[axis + 3 :])


def whole_batch_shape(array: Any, axis: int, processes: int) -> tuple[int, ...]:
    """The shape of the whole batch when each of ``processes`` passes an equal share (its own rows)."""
    shape = tuple(array.shape)
    if processes == 1 or axis >= len(shape) or (isinstance(array, jax.Array) and not array.is_fully_addressable):
        return shape  # one process, or already a global array
    return shape[:axis] + (shape[axis] * processes,) + shape[axis + 1 :]


def whole_batch(array: Any, sharding: NamedSharding, shape: tuple[int, ...]) -> jax.Array:
    """The batch as one array over the mesh; with several processes, built from each one's rows."""
    if jax.process_count() == 1 or (isinstance(array, jax.Array) and not array.is_fully_addressable):
        return jax.device_put(array, sharding)
    return jax.make_array_from_process_local_data(sharding, np.asarray(array), shape)


def whole_on_every_device(rows: list[int], microbatches: int, shards: int) -> bool:
    """Whether one process's batch (of ``rows`` in each split input) is given whole to every device: its ``shards``
    data-parallel devices cannot share it equally (a validation batch smaller than their number, a short last
    batch), but it divides into the microbatches. Every device then computes all of it, as a one-process PyTorch
    run does; said once."""
    parts = microbatches * shards
    if shards == 1 or all(n % parts == 0 for n in rows) or any(n % microbatches for n in rows):
        return False
    notices.info_once(
        "step:whole-batch",
        "a step's batch of %d rows does not divide into %d microbatches x %d data-parallel shards: every device "
        "computes the whole batch (a multiple of %d rows is split over them). This one process is one rank; under "
        "SMP a script's batch size is per process: python -m jmp.launch -n %d script.py runs one per device",
        *(next(n for n in rows if n % parts), microbatches, shards, parts, shards),
    )
    return True


def check_divisible(name: str, shape: tuple, axis: int, microbatches: int, shards: int, processes: int = 1) -> None:
    """Refuse a batch that does not divide into ``microbatches`` x ``shards`` (or lacks the axis)."""
    if axis >= len(shape):
        raise StepError(f"step input '{name}' has {len(shape)} dimensions; it cannot be split on axis {axis}")
    if shape[axis] % (microbatches * shards):
        if processes > 1:
            raise StepError(
                f"step input '{name}': the {processes} processes' shares of {shape[axis] // processes} rows make a "
                f"batch of {shape[axis]} (axis {axis}), which does not divide into {microbatches} microbatches x "
                f"{shards} data-parallel shards = {microbatches * shards}. Give each process a multiple of "
                f"{max(1, microbatches * shards // processes)} rows (DataLoader(..., drop_last=True) drops the "
                "short last batch)."
            )
        parts, rows = microbatches * shards, shape[axis]
        raise StepError(
            f"step input '{name}' has batch size {rows} (axis {axis}), which does not divide into {microbatches} "
            f"microbatches x {shards} data-parallel shards = {parts}. Pad the batch to {-(-rows // parts) * parts} "
            f"rows and keep the first {rows} rows of what it returns, drop the short last batch (DataLoader(..., "
            "drop_last=True)), or list the argument in non_split_inputs. (Outside a pipeline, one process's batch "
            f"of a multiple of {microbatches} rows runs whole on every device.)"
        )
