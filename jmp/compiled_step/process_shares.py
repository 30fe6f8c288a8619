"""SMP's ranks inside one program: when several processes feed a step's batch, the step function runs once per
process, on that process's rows.

jmp compiles one program over the whole batch; to keep SMP's per-rank meanings (docs/running_scripts.md: a mean
loss is the rank's mean, ``x.size(0)`` its microbatch size, a batch norm sees its rows), the microbatch is cut into
one block per process (its rows; see ``microbatches.split``), given a process axis, and the forward is
``jax.vmap``-ped over it. The gradient is the mean of the processes' gradients; every returned value carries a
leading process axis and each process reads its own entry (``outputs.StepOutput``); buffers a forward updates
(batch-norm running statistics) come from process 0, as DDP broadcasts rank 0's buffers before each forward.
Random draws fold the process index into their key, so processes draw different dropout masks, as SMP's ranks do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jmp.compiled_step import microbatches as batching
from jmp.precision import fp8_state
from jmp.runtime.mesh_state import DATA_AXES
from jmp.torch_bridge import dispatch, replica_calls, side_outputs

PROCESS_AXIS = "jmp_process"


def per_process(
    run_forward: Callable, split_axes: Sequence[int | None], params_axis: int | None = None, fp8: bool = False
) -> Callable:
    """``run_forward`` (params, rest, microbatch arrays) -> (loss, (outputs, rest, side outputs)) run on each
    process's block of the split arrays (cut by ``blocks``: the process axis at each split axis): the sum of
    the processes' losses, outputs with a leading process axis, process 0's rest, side outputs combined over
    processes. ``params_axis`` 0: the parameters have a leading process axis too, each process reading its own
    copy (``jmp.compiled_step.replica_gradients``), whose gradients then stay per process.

    In fp8 (``fp8``) each process reads its own copy of the output gradients' scales, whose cotangents (the processes'
    gradient amaxes) combine by their maximum, as TE reduces amaxes over the data-parallel group."""

    def run(params, rest, mb_arrays):
        copies, others = {}, rest
        if fp8:
            scales, others = fp8_state.split_gradient_scales(rest)
            count = next(a.shape[axis] for a, axis in zip(mb_arrays, split_axes) if axis is not None)
            copies = jax.tree.map(lambda scale: replica_calls.copied_for_maximum(scale, count), scales)

        def on_scales(params, scales, others, mb_arrays):
            return run_forward(params, nnx.merge_state(others, scales) if fp8 else others, mb_arrays)

        in_axes = (params_axis, 0, None, list(split_axes))
        batched = jax.vmap(on_scales, in_axes=in_axes, axis_name=PROCESS_AXIS)
        with dispatch.batched_over(PROCESS_AXIS):
            losses, (outputs, new_rest, sown) = batched(params, copies, others, mb_arrays)
        first_process = jax.tree.map(lambda leaf: leaf[0], new_rest)
        # each process's backward starts from its own (scaled) loss, as each SMP rank's does, so a half-precision
        # gradient overflows where it would on that rank; the caller divides the summed gradients by the count
        return losses.sum(), (outputs, first_process, side_outputs.reduce_stacked(sown))

    return run


def per_process_gradients(
    run_forward: Callable, split_axes: Sequence[int | None], copy_positions: Any = None, fp8_recipe: Any = None
) -> Callable:
    """``run_forward`` differentiated on each process's block (the process axis at each split axis): (the sum of
    the processes' losses, (outputs with a leading process axis, process 0's rest, side outputs combined)),
    and each process's own gradients, [processes, *shape] per parameter. Summed over processes after the
    microbatch loop, they are ``per_process``'s gradients, which each microbatch's backward sums over the
    processes (an all-reduce per microbatch).

    With ``copy_positions`` ``run_forward`` takes (params, copies, rest, arrays): per-replica copies of the
    parameters, a process axis at each copy's position (``copy_positions``, a tree) and each process's own after
    it; the gradients are then (the parameters', the copies' laid out as the copies are). In fp8 (``fp8_recipe``)
    each process's gradient amaxes (the cotangents of the gradient scales) are taken too, and their maximum over
    the processes recorded in the rest, as TE reduces amaxes over the data-parallel group."""
    copied = copy_positions is not None
    diff_axes = (None, copy_positions) if copied else (None,)

    def on_scales(*args):
        *diff, scales, others, mb_arrays = args
        return run_forward(*diff, nnx.merge_state(others, scales) if fp8_recipe is not None else others, mb_arrays)

    argnums = tuple(range(len(diff_axes) + 1))  # the scales' cotangents too (none outside fp8)
    grad_of = jax.value_and_grad(on_scales, argnums=argnums, has_aux=True)
    grad_axes = (0, copy_positions, 0) if copied else (0, 0)

    def run(*args):
        *diff, rest, mb_arrays = args
        scales, others = fp8_state.split_gradient_scales(rest) if fp8_recipe is not None else ({}, rest)
        in_axes = (*diff_axes, None, None, list(split_axes))
        batched = jax.vmap(grad_of, in_axes=in_axes, out_axes=(0, grad_axes), axis_name=PROCESS_AXIS)
        with dispatch.batched_over(PROCESS_AXIS):
            (losses, (outputs, new_rest, sown)), (*grads, amaxes) = batched(*diff, scales, others, mb_arrays)
        first_process = jax.tree.map(lambda leaf: leaf[0], new_rest)
        if fp8_recipe is not None:
            scales, others = fp8_state.split_gradient_scales(first_process)
            amaxes = jax.tree.map(lambda a: a.max(axis=0), amaxes)
            first_process = fp8_state.record_gradient_amaxes(fp8_recipe, scales, amaxes, others)
        aux = (outputs, first_process, side_outputs.reduce_stacked(sown))
        return (losses.sum(), aux), tuple(grads) if copied else grads[0]

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
