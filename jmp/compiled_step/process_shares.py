"""SMP's ranks inside one program: when several processes feed a step's batch, the step function runs once per
process, on that process's rows.

Under SMP every data-parallel rank runs the step function on its own microbatch: a loss averaged over the
batch is that rank's average, ``x.size(0)`` is the rank's microbatch size, a batch norm sees the rank's rows,
and the gradients are the mean over ranks of each rank's gradients (DDP's all-reduce). jmp compiles one
program over the whole batch; to keep those meanings, the microbatch is cut into one block per process (its
rows; see ``microbatches.split``), given a process axis, and the forward is ``jax.vmap``-ped over it. The
gradient is the mean of the processes' gradients; every returned value carries a leading process axis
and each process reads its own entry (``outputs.StepOutput``); buffers a forward updates (batch-norm running
statistics) come from process 0, as DDP broadcasts rank 0's buffers before each forward. Random draws fold
the process index into their key, so processes draw different dropout masks, as SMP's ranks do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jmp.compiled_step import microbatches as batching
from jmp.compiled_step import side_outputs
from jmp.runtime.mesh_state import DATA_AXES
from jmp.torch_bridge import dispatch

PROCESS_AXIS = "jmp_process"


def per_process(run_forward: Callable, split_axes: Sequence[int | None], params_axis: int | None = None) -> Callable:
    """``run_forward`` (params, rest, microbatch arrays) -> (loss, (outputs, rest, side outputs)) run on each
    process's block of the split arrays (cut by ``blocks``: the process axis at each split axis): the sum of
    the processes' losses, outputs with a leading process axis, process 0's rest, side outputs combined over
    processes. ``params_axis`` 0: the parameters have a leading process axis too, each process reading its own
    copy (``jmp.compiled_step.replica_gradients``), whose gradients then stay per process."""

    def run(params, rest, mb_arrays):
        in_axes = (params_axis, None, list(split_axes))
        batched = jax.vmap(run_forward, in_axes=in_axes, axis_name=PROCESS_AXIS)
        with dispatch.batched_over(PROCESS_AXIS):
            losses, (outputs, new_rest, sown) = batched(params, rest, mb_arrays)
        first_process = jax.tree.map(lambda leaf: leaf[0], new_rest)
        # each process's backward starts from its own (scaled) loss, as each SMP rank's does, so a half-precision
        # gradient overflows where it would on that rank; the caller divides the summed gradients by the count
        return losses.sum(), (outputs, first_process, side_outputs.reduce_stacked(sown))

    return run


def per_process_gradients(
    run_forward: Callable, split_axes: Sequence[int | None], copy_positions: Any = None
) -> Callable:
    """``run_forward`` differentiated on each process's block (the process axis at each split axis): (the sum of
    the processes' losses, (outputs with a leading process axis, process 0's rest, side outputs combined)),
    and each process's own gradients, [processes, *shape] per parameter. Summed over processes after the
    microbatch loop, they are ``per_process``'s gradients, which each microbatch's backward sums over the
    processes (an all-reduce per microbatch).

    With ``copy_positions`` ``run_forward`` takes (params, copies, rest, arrays): per-replica copies of the
    parameters, a process axis at each copy's position (``copy_positions``, a tree) and each process's own after
    it; the gradients are then (the parameters', the copies' laid out as the copies are)."""
    if copy_positions is None:
        grad_of = jax.value_and_grad(run_forward, has_aux=True)
        in_axes, grad_axes = (None, None, list(split_axes)), 0
    else:
        grad_of = jax.value_and_grad(run_forward, argnums=(0, 1), has_aux=True)
        in_axes, grad_axes = (None, copy_positions, None, list(split_axes)), (0, copy_positions)

    def run(*args):
        batched = jax.vmap(grad_of, in_axes=in_axes, out_axes=(0, grad_axes), axis_name=PROCESS_AXIS)
        with dispatch.batched_over(PROCESS_AXIS):
            (losses, (outputs, new_rest, sown)), grads = batched(*args)
        first_process = jax.tree.map(lambda leaf: leaf[0], new_rest)
        return (losses.sum(), (outputs, first_process, side_outputs.reduce_stacked(sown))), grads

    return run


def blocks(array: jax.Array, axis: int, shares: int, mesh: jax.sharding.Mesh, pipelined: bool) -> jax.Array:
    """[.., B, ..] -> [.., shares, B / shares, ..]: the rows of each process, in process order, on the whole batch
    (before a pipeline's ``shard_map``).

    With one data shard per process, each shard's devices compute on that process's rows. With several, XLA
    places the process axis on part of the data axes, which its partitioner cannot do inside a pipeline's
    ``shard_map``: there each process's rows are spread over the data axes instead."""
    cut = array.reshape(block_shape(array.shape, axis, shares))
    before, data_shards = [None] * axis, batching.data_shards(mesh)
    if data_shards == shares:
        spec = PartitionSpec(*before, DATA_AXES)
    elif pipelined:  # rows that do not divide over the shards are computed whole (padded ones move in pieces)
        spec = PartitionSpec(*before, None, DATA_AXES if cut.shape[axis + 1] % data_shards == 0 else None)
    else:
        return cut
    return jax.lax.with_sharding_constraint(cut, NamedSharding(mesh, spec))


def block_shape(shape: tuple[int, ...], axis: int, shares: int) -> tuple[int, ...]:
    return tuple(shape[:axis]) + (shares, shape[axis] // shares) + tuple(shape[axis + 1 :])
