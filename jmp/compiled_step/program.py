"""What a step program computes: the step function on one microbatch (``forward``), then on the whole batch
(``run``): a loop over microbatches accumulating gradients, or the pipeline's schedule.

Side outputs (``jmp.torch_bridge.side_outputs``) sown by the forward come out of every path as one dict,
combined over microbatches and reported once per step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch
import torch.utils._pytree as torch_pytree
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jmp.compiled_step import microbatches as batching
from jmp.compiled_step import process_shares, replica_gradients
from jmp.compiled_step.outputs import output_array, output_leaf
from jmp.compiled_step.signature import StepSignature, rebuild
from jmp.pipeline.engine import StepInputs
from jmp.pipeline.stage_buffers import copies_name
from jmp.precision import fp8_state
from jmp.remat import xla as remat_xla
from jmp.runtime import mesh_state
from jmp.stacks import storage as stacks_storage
from jmp.torch_bridge import autocast, call_hooks, concrete_run, dispatch, side_outputs
from jmp.torch_bridge.lowering import ring_attention
from jmp.torch_bridge.tensor import unwrap
from jmp.wrapped_model.distributed_model import DistributedModel


@dataclasses.dataclass
class Traced:
    """What tracing a step function revealed (kept per compiled variant)."""

    has_backward: bool = False
    output_count: int = 0  # the returned values that are tensors (the program's outputs)
    output_spec: Any = None
    output_leaves: tuple = ()  # per returned leaf: its torch dtype (a tensor), or outputs.Returned (a value as is)
    side_outputs: Any = None  # the tree structure of the forward's side outputs (a pipeline passes them flat)
    checked: bool = False  # a pipelined program's compiled collectives were checked (engine.check_compiled)


def forward(fn: Callable, model: DistributedModel, signature: StepSignature, traced: Traced) -> Callable:
    """``fn`` on one microbatch: (params, rest, arrays) -> (loss, (outputs, new rest, side outputs)).

    ``params`` are as kept (float32 masters in mixed precision) and cast for compute here, so gradients
    flow back through the cast; the last of ``arrays`` is the loss scale. When several processes feed the
    batch, ``fn`` runs once per process on its rows (``process_shares``) and each output has a leading
    process axis.
    """
    run_forward = forward_on_rows(fn, model, signature, traced)
    if signature.process_shares > 1:
        return process_shares.per_process(run_forward, signature.split_axes, fp8=model.fp8_recipe is not None)
    return run_forward


def forward_on_rows(fn: Callable, model: DistributedModel, signature: StepSignature, traced: Traced) -> Callable:
    """``forward`` on the rows it is given, without a process axis."""
    policy = model.precision

    def run_forward(params, rest, mb_arrays):
        *mb_arrays, loss_scale = mb_arrays
        as_computed = functools.partial(policy.for_compute, model.layout.names) if policy.mixed else lambda x: x
        if policy.mixed:
            params = jax.tree_util.tree_unflatten(model.layout.treedef, as_computed(jax.tree.leaves(params)))
        module = nnx.merge(signature.graphdef, params, rest, copy=True)  # Variables of this trace level
        call_args, call_kwargs = rebuild(signature.arguments, signature.leaves, mb_arrays, model)
        with (
            model.tracing(module, loss_scale) as trace,
            dispatch.session(getattr(module, "rngs", None)),
            call_hooks(model.call_hooks),
            side_outputs.collecting() as sown,
            autocast.forced(policy.autocast, half_results=True) if policy.autocast else contextlib.nullcontext(),
            _sequences_split(model.layout.mesh),
            replica_gradients.reading(jax.tree.leaves(params), as_computed),
        ):
            returned = fn(*call_args, **call_kwargs)
        flat, out_spec = torch_pytree.tree_flatten(returned)
        traced.output_spec = out_spec
        traced.output_leaves = tuple(output_leaf(v, i) for i, v in enumerate(flat))
        traced.has_backward = trace.loss is not None
        outputs = [output_array(v) for v, leaf in zip(flat, traced.output_leaves) if isinstance(leaf, torch.dtype)]
        loss = unwrap(trace.loss).astype(jnp.float32) if trace.loss is not None else jnp.zeros((), jnp.float32)
        loss = loss * loss_scale if signature.scales_loss else loss
        return loss, (outputs, nnx.split(module, nnx.Param, ...)[2], dict(sown))

    return run_forward


def _placed(grads: Any, shardings: Any) -> Any:
    """``grads`` laid out as ``shardings``: a constraint in a traced program; on concrete values (a step run op by
    op) a ``device_put``, which leaves arrays already placed so as they are (a constraint would copy each)."""
    if concrete_run.active():
        return jax.device_put(grads, shardings)
    return jax.lax.with_sharding_constraint(grads, shardings)


def _sequences_split(mesh) -> contextlib.AbstractContextManager:
    """Under context parallelism the inputs' sequences are split over "cp" (``jmp.sharding.batch_spec``): attention
    can take the ring over it."""
    if mesh_state.CONTEXT_AXIS not in mesh.axis_names:
        return contextlib.nullcontext()
    return ring_attention.sequences_split_over(mesh, mesh_state.CONTEXT_AXIS)


def run(fn: Callable, model: DistributedModel, signature: StepSignature, traced: Traced, params, rest, arrays):
    """The whole step on the batch: (stacked outputs, new rest, gradients or None, side outputs by name).

    Gradients are the mean over processes and microbatches, or, when ``signature.average_grads`` is False,
    their sum over microbatches.
    """
    microbatches, split = signature.microbatches, signature.split_axes
    mesh = model.layout.mesh
    pieces = [
        batching.over_data_axes(
            batching.split(a, axis, microbatches, signature.data_shards), axis + 1, mesh, signature.batch_axes
        )
        if axis is not None
        else a
        for a, axis in zip(arrays, split)
    ]
    if signature.process_shares > 1:  # each process's rows on their own axis: fn runs once per process
        pieces = [
            process_shares.blocks(p, axis + 1, signature.process_shares, mesh, model.pipeline is not None)
            if axis is not None
            else p
            for p, axis in zip(pieces, split)
        ]
    if model.pipeline is not None:
        return _run_pipeline(fn, model, signature, traced, params, rest, pieces)
    step_forward = _on_stored(forward(fn, model, signature, traced), model)
    shardings = model.store.shardings
    fp8_recipe = model.fp8_recipe

    def arrays_of(mb):
        return [m if axis is not None else p for m, p, axis in zip(mb, pieces, split)]

    def with_grads(rest, mb_arrays):
        (outputs, rest, sown), (grads,) = _differentiated(step_forward, (params,), rest, mb_arrays, fp8_recipe)
        # gradients live where their parameters do (sharded data parallel: reduce-scattered)
        return outputs, rest, _placed(grads, shardings), sown

    if microbatches == 1:
        first = [p[0] if axis is not None else p for p, axis in zip(pieces, split)]
        outputs, rest, grads, sown = with_grads(rest, first)
        grads = _as_kept(model, _averaged(grads, signature, 1)) if traced.has_backward else None
        return [o[None] for o in outputs], rest, grads, side_outputs.reported(sown)

    mb_stack = [p if axis is not None else None for p, axis in zip(pieces, split)]
    if concrete_run.active():  # op by op: the loop in Python (a scan would trace the forward)
        return _unrolled(signature, traced, model, with_grads, step_forward, params, rest, mb_stack, arrays_of)
    shapes = jax.eval_shape(step_forward, params, rest, arrays_of([p[0] if p is not None else None for p in mb_stack]))
    no_side_outputs = side_outputs.identity(shapes[1][2])
    replicated = replica_gradients.replicated_axes(model, signature) if traced.has_backward else ()
    if replicated and signature.process_shares > 1:
        per_rows = _on_stored(forward_on_rows(fn, model, signature, traced), model)
        return _process_loop(model, signature, replicated, per_rows, params, rest, mb_stack, arrays_of, no_side_outputs)
    if replicated:
        return _replica_loop(
            model, signature, replicated, step_forward, params, rest, mb_stack, arrays_of, no_side_outputs
        )
    if traced.has_backward:  # learnt from the shape evaluation above

        def body(carry, mb):
            rest, total, sown = carry
            outputs, rest, grads, mb_sown = with_grads(rest, arrays_of(mb))
            return (rest, jax.tree.map(jnp.add, total, grads), side_outputs.combine_all(sown, mb_sown)), outputs

        zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params), shardings)
        (rest, total, sown), stacked = jax.lax.scan(body, (rest, zeros, no_side_outputs), mb_stack)
        return stacked, rest, _as_kept(model, _averaged(total, signature, microbatches)), side_outputs.reported(sown)

    def eval_body(carry, mb):
        rest, sown = carry
        _, (outputs, rest, mb_sown) = step_forward(params, rest, arrays_of(mb))
        return (rest, side_outputs.combine_all(sown, mb_sown)), outputs

    (rest, sown), stacked = jax.lax.scan(eval_body, (rest, no_side_outputs), mb_stack)
    return stacked, rest, None, side_outputs.reported(sown)


def _replica_loop(model, signature, axes, step_forward, params, rest, mb_stack, arrays_of, no_side_outputs):
    """``run``'s microbatch loop keeping gradients per data-parallel replica (over the mesh ``axes``), reduced once
    after it (``replica_gradients``)."""
    mesh = model.layout.mesh
    positions = replica_gradients.replica_positions(model.store)
    copy_shardings = replica_gradients.copy_shardings(model, axes, positions)
    copies = replica_gradients.copies(params, copy_shardings, positions)
    rows = frozenset(p.shape[axis + 1] for p, axis in zip(mb_stack, signature.split_axes) if p is not None)

    def on_copies(params, copies, rest, mb_arrays):
        with replica_gradients.offered(copies, mesh, axes, rows):
            return step_forward(params, rest, mb_arrays)

    def body(carry, mb):
        rest, total, sown = carry
        differentiated = _differentiated(on_copies, (params, copies), rest, arrays_of(mb), model.fp8_recipe)
        (outputs, rest, mb_sown), (grads, copy_grads) = differentiated
        total = jax.tree.map(jnp.add, total, replica_gradients.merged(grads, copy_grads, copy_shardings, positions))
        return (rest, total, side_outputs.combine_all(sown, mb_sown)), outputs

    zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, copies), copy_shardings)
    (rest, total, sown), stacked = jax.lax.scan(body, (rest, zeros, no_side_outputs), mb_stack)
    grads = _placed(replica_gradients.reduced(total, positions), model.store.shardings)
    grads = _as_kept(model, _averaged(grads, signature, signature.microbatches))
    return stacked, rest, grads, side_outputs.reported(sown)


def _differentiated(fn: Callable, diff_args: tuple, rest: Any, mb_arrays: list, fp8_recipe: Any) -> tuple:
    """((outputs, new rest, side outputs), the gradients of ``diff_args``) of ``fn(*diff_args, rest, mb_arrays)``.

    In fp8 the loss is differentiated with respect to the output gradients' scales too: their cotangents are the
    gradients' amaxes (``jmp.precision.fp8_matmul``), recorded in the new rest after each microbatch's backward.
    """
    count = len(diff_args)
    if fp8_recipe is None:
        grad_of = jax.value_and_grad(fn, argnums=tuple(range(count)), has_aux=True)
        (_, aux), grads = grad_of(*diff_args, rest, mb_arrays)
        return aux, grads

    def on_scales(*args):
        *diff, scales, others, mb = args
        return fn(*diff, nnx.merge_state(others, scales), mb)

    scales, others = fp8_state.split_gradient_scales(rest)
    grad_of = jax.value_and_grad(on_scales, argnums=tuple(range(count + 1)), has_aux=True)
    (_, (outputs, rest, sown)), (*grads, amaxes) = grad_of(*diff_args, scales, others, mb_arrays)
    scales, others = fp8_state.split_gradient_scales(rest)
    rest = fp8_state.record_gradient_amaxes(fp8_recipe, scales, amaxes, others)
    return (outputs, rest, sown), tuple(grads)


def _process_loop(model, signature, axes, per_rows, params, rest, mb_stack, arrays_of, no_side_outputs):
    """``run``'s microbatch loop when the processes feeding the batch each feed whole data-parallel replicas (over
    the mesh ``axes``) or a replica is fed by several processes (a tensor-parallel group's, each passing rows of its
    own): each process's gradients (``per_rows`` differentiated once per process) stay on its devices through the
    loop, and are summed over the processes and replicas once after it. A process holding several replicas reads
    per-replica copies of its own (``replica_gradients``), so that their gradients stay apart too, unless a
    parameter is split (tensor parallelism): copies of those abort XLA's SPMD partitioner ("Check failed:
    partition_group_list.num_replica_groups() * ...", GPT-2 at dp4 x tp2 on 2 processes x 4 devices), and each
    microbatch sums its replicas' gradients within the process."""
    positions = replica_gradients.replica_positions(model.store)
    split = signature.split_axes
    grad_of = process_shares.per_process_gradients(per_rows, split, None, model.fp8_recipe)
    copies, dims = None, 1
    within_a_replica = signature.process_shares >= math.prod(model.layout.mesh.shape[a] for a in axes)
    if within_a_replica:  # each process feeds one replica or part of one
        shardings = replica_gradients.copy_shardings(model, axes, positions)  # a replica's processes consecutive
    else:
        mesh = replica_gradients.by_process(model.layout.mesh, axes, signature.process_shares)
        shardings = replica_gradients.process_shardings(model, mesh, positions)
        if not any(model.layout.mesh.shape[a] > 1 for a in replica_gradients.split_axes(model)):
            shardings, dims = replica_gradients.process_copy_shardings(model, mesh, positions), 2
            copies = replica_gradients.copies(params, shardings, positions, dims=2)
            rows = frozenset(p.shape[axis + 2] for p, axis in zip(mb_stack, split) if p is not None)  # a process's

            def on_copies(params, copies, rest, mb_arrays):
                with replica_gradients.offered(copies, mesh, (replica_gradients.LOCAL,), rows):
                    return per_rows(params, rest, mb_arrays)

            grad_of = process_shares.per_process_gradients(on_copies, split, positions, model.fp8_recipe)

    def body(carry, mb):
        rest, total, sown = carry
        if copies is None:
            (_, (outputs, rest, mb_sown)), grads = grad_of(params, rest, arrays_of(mb))
            grads = replica_gradients.process_grouped(grads, shardings, positions)
        else:
            (_, (outputs, rest, mb_sown)), (grads, copy_grads) = grad_of(params, copies, rest, arrays_of(mb))
            grads = replica_gradients.process_merged(grads, copy_grads, shardings, positions)
        return (rest, jax.tree.map(jnp.add, total, grads), side_outputs.combine_all(sown, mb_sown)), outputs

    zeros = replica_gradients.copies(jax.tree.map(jnp.zeros_like, params), shardings, positions, dims=dims)
    (rest, total, sown), stacked = jax.lax.scan(body, (rest, zeros, no_side_outputs), mb_stack)
    # [microbatches, processes, ...]: each process's outputs on its replica's devices when it feeds one replica or
    # part of one; else whole on every device (left free, XLA splits the process axis as ``mesh`` does, which the
    # program's mesh cannot name)
    spec = PartitionSpec(None, axes) if within_a_replica else PartitionSpec()
    stacked = jax.lax.with_sharding_constraint(stacked, NamedSharding(model.layout.mesh, spec))
    grads = _placed(replica_gradients.reduced(total, positions, dims=dims), model.store.shardings)
    grads = _as_kept(model, _averaged(grads, signature, signature.microbatches))
    return stacked, rest, grads, side_outputs.reported(sown)


def _on_stored(step_forward: Callable, model: DistributedModel) -> Callable:
    """``step_forward`` on the parameters as stored (stacked layers: one array per stack weight, so that the
    program's arguments and gradients do not grow with depth)."""

    compute_dtypes = model.precision.compute if model.precision.mixed else None

    def in_trace(stored):
        return model.store.in_trace(stored, compute_dtypes)

    def on_stored(params, rest, mb_arrays):
        with stacks_storage.tracing_views(), replica_gradients.viewed(in_trace):  # per-replica copies alike
            return step_forward(in_trace(params), rest, mb_arrays)

    return on_stored


def _unrolled(signature, traced, model, with_grads, step_forward, params, rest, mb_stack, arrays_of):
    """``run``'s microbatch loop, one microbatch after another on concrete values (``concrete_run``)."""
    total, sown, stacked = None, None, []
    for index in range(signature.microbatches):
        mb = arrays_of([p[index] if p is not None else None for p in mb_stack])
        if index == 0 or traced.has_backward:
            outputs, rest, grads, mb_sown = with_grads(rest, mb)
            total = grads if total is None else _summed(total, grads)
        else:  # an evaluation step: learnt from the first microbatch
            _, (outputs, rest, mb_sown) = step_forward(params, rest, mb)
        sown = mb_sown if sown is None else side_outputs.combine_all(sown, mb_sown)
        stacked.append(outputs)
    outputs = [jnp.stack(per_microbatch) for per_microbatch in zip(*stacked)]
    grads = None
    if traced.has_backward:
        grads = _as_kept(model, _averaged_at_once(total, signature, signature.microbatches))
    return outputs, rest, grads, side_outputs.reported(sown)


def _run_pipeline(fn, model: DistributedModel, signature: StepSignature, traced: Traced, rows, rest, pieces):
    """The step as a pipeline over ``pp`` (see jmp.pipeline): forward cut into stages, both passes scheduled."""
    pipeline, split, microbatches = model.pipeline, signature.split_axes, signature.microbatches
    rest_leaves, rest_def = jax.tree.flatten(rest)
    whole = [None if axis is not None else p for p, axis in zip(pieces, split)]
    split_pieces = [p if axis is not None else None for p, axis in zip(pieces, split)]
    mb_avals = [
        jax.ShapeDtypeStruct(p.shape[1:] if axis is not None else p.shape, p.dtype) for p, axis in zip(pieces, split)
    ]
    param_avals, names = model.layout.avals(), list(model.layout.names)
    axes = replica_gradients.replicated_axes(model, signature)
    if not axes:
        flat = flat_forward(forward(fn, model, signature, traced), model, rest_def, traced)
    else:
        replicas = math.prod(model.layout.mesh.shape[a] for a in axes)
        copy_avals = [jax.ShapeDtypeStruct((replicas, *a.shape), a.dtype) for a in param_avals]
        if signature.process_shares > 1:  # one replica per process: each process's forward reads its copy
            per_process = process_shares.per_process(forward_on_rows(fn, model, signature, traced), split, 0)
            flat = flat_forward(per_process, model, rest_def, traced)
            param_avals, names = copy_avals, [copies_name(n) for n in names]
        else:  # the forward also takes the copies, after the parameters, for its row-local calls
            sizes = frozenset(p.shape[axis + 1] for p, axis in zip(pieces, split) if axis is not None)
            flat = _with_copies(
                flat_forward(forward(fn, model, signature, traced), model, rest_def, traced), model, axes, sizes
            )
            param_avals, names = param_avals + copy_avals, names + [copies_name(n) for n in names]
    jaxpr = pipeline.trace(flat, param_avals, rest_leaves, mb_avals)
    programs = pipeline.programs(jaxpr, names, len(rest_leaves))
    inputs = StepInputs(rows, rest, tuple(split_pieces), tuple(whole), microbatches, traced.has_backward, axes)
    result = pipeline.step(programs, inputs)
    outputs = result.finals[1 : 1 + traced.output_count]  # finals: [loss, *outputs, *side outputs]
    stacked = jax.tree.unflatten(traced.side_outputs, result.finals[1 + traced.output_count :])
    grads = result.grads  # summed over microbatches
    grads = _as_kept(model, _averaged(grads, signature, microbatches)) if grads is not None else None
    return outputs, result.rest, grads, side_outputs.reported(side_outputs.reduce_stacked(stacked))


def _with_copies(flat: Callable, model: DistributedModel, axes: tuple[str, ...], rows: frozenset[int]) -> Callable:
    """``flat`` whose parameter list also holds each parameter's per-replica copies, after the parameters, offered to
    the forward's row-local calls (``replica_gradients``): in the pipeline their gradients stay per replica through
    the schedule's loop."""
    count = len(model.layout.names)

    def on_copies(param_list, rest_list, mb_arrays):
        copies = jax.tree_util.tree_unflatten(model.layout.treedef, param_list[count:])
        with replica_gradients.offered(copies, model.layout.mesh, axes, rows):
            return flat(param_list[:count], rest_list, mb_arrays)

    return on_copies


def flat_forward(step_forward: Callable, model: DistributedModel, rest_def: Any, traced: Traced) -> Callable:
    """``step_forward`` on flat lists: (parameters in name order, rest, inputs) -> [loss, *outputs, *side outputs,
    *rest].

    The new rest comes last, as ``jmp.pipeline.split`` expects of the forward it cuts.
    """

    def flat(param_list, rest_list, mb_arrays):
        params = jax.tree_util.tree_unflatten(model.layout.treedef, param_list)
        rest = jax.tree_util.tree_unflatten(rest_def, rest_list)
        loss, (outputs, new_rest, sown) = step_forward(params, rest, mb_arrays)
        traced.output_count = len(outputs)
        sown_leaves, traced.side_outputs = jax.tree.flatten(sown)
        return [loss, *outputs, *sown_leaves, *jax.tree.leaves(new_rest)]

    return flat


def compile_step(fn: Callable, model: DistributedModel, signature: StepSignature) -> tuple[Any, Traced]:
    """The program for ``signature`` (compiled at its first call) and the record its tracing fills in."""
    traced = Traced()
    step_program = functools.partial(run, fn, model, signature, traced)
    platform = model.layout.mesh.devices.flat[0].platform
    options = remat_xla.compiler_options(platform, fp8=model.fp8_recipe is not None)
    return jax.jit(step_program, donate_argnums=(1,), compiler_options=options), traced


def _averaged(grads: Any, signature: StepSignature, microbatches: int) -> Any:
    """Gradients summed over microbatches and processes -> their mean over processes (SMP's data-parallel
    average) and, with ``average_grads``, over microbatches."""
    count = signature.process_shares * (microbatches if signature.average_grads else 1)
    return grads if count == 1 else jax.tree.map(lambda g: g / count, grads)


# on concrete values (``_unrolled``) one program each, not one dispatch per gradient
_summed = jax.jit(lambda total, grads: jax.tree.map(jnp.add, total, grads))
_averaged_at_once = jax.jit(_averaged, static_argnums=(1, 2))


def _as_kept(model: DistributedModel, grads: Any) -> Any:
    """Gradients (float32, laid out as the parameters are stored) in the dtype they are kept in between calls."""
    policy = model.precision
    if not policy.mixed:
        return grads
    return model.store.cast_grads(grads, policy.grad_dtype)
