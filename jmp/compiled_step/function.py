"""``@smp.step``: the user's step function traced into one compiled program per input signature.

The Python body runs only while it is traced, for each new ``StepSignature`` (input shapes and dtypes,
non-tensor arguments, train/eval mode, grad mode, microbatch settings), possibly more than once per trace; later
calls with the same signature run the compiled program. The pieces of ``jmp.compiled_step``: docs/compiled_step.md.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import torch
import torch.utils._pytree as torch_pytree
from jax.sharding import NamedSharding, PartitionSpec

from jmp.compiled_step import microbatches as batching
from jmp.compiled_step import pipeline_inputs, process_shares, uncompiled
from jmp.compiled_step import program as step_program
from jmp.compiled_step.outputs import ProcessShare, StepOutput, as_tensor_shape, results
from jmp.compiled_step.signature import StepSignature, place_arguments
from jmp.errors import StepError, TracedControlFlowError
from jmp.pipeline import engine
from jmp.runtime import compilation_cache as compilation
from jmp.runtime import host_memory, programs_in_flight
from jmp.runtime import live_models as model_registry
from jmp.runtime import mesh_state as state
from jmp.torch_bridge import index_checks
from jmp.wrapped_model.distributed_model import DistributedModel, current_trace

__all__ = ["StepFunction", "StepOutput", "is_tracing", "step"]


def _scale(model: DistributedModel, mesh) -> Any:
    """The loss scale the step runs with, read when it is needed (tracing may bind a GradScaler); an abstract model
    without loss scaling gets its shape only (its mesh may be of compile-only devices)."""
    if model.abstract and model.loss_scaling is None:
        return jax.ShapeDtypeStruct((), jax.numpy.float32, sharding=NamedSharding(mesh, PartitionSpec()))
    return model.loss_scale


@dataclasses.dataclass(frozen=True)
class _Call:
    """One call of a step function, ready to run: the model, the arrays on the devices, the program."""

    model: DistributedModel
    arrays: list[jax.Array]
    program: Any  # jax.jit of program.run
    traced: step_program.Traced
    shards: int  # the blocks the batch is fed in (one per data shard, or per feeding device)
    share: ProcessShare | None = None  # several processes feed the batch

    @property
    def arguments(self) -> tuple:
        return (self.model.training_state.params, self.model.training_state.rest, self.arrays)


class StepFunction:
    """A step function compiled per input signature; call it like the undecorated function."""

    def __init__(
        self,
        fn: Callable,
        non_split_inputs: Sequence[str] | None = None,
        input_split_axes: dict[str, int] | None = None,
        detach_outputs: bool = True,
    ):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.signature = inspect.signature(fn)
        self.non_split_inputs = set(non_split_inputs or ())
        self.input_split_axes = dict(input_split_axes or {})
        self.detach_outputs = bool(detach_outputs)  # outputs are values here, detached either way
        unknown = (self.non_split_inputs | set(self.input_split_axes)) - set(self.signature.parameters)
        if unknown:
            raise StepError(f"@smp.step of {fn.__name__}: {sorted(unknown)} are not arguments of the function")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with compilation.timed(self.__name__):  # logs only when this call compiled something
            call = self._prepare(args, kwargs)
            index_checks.raise_ready(call.model)  # an earlier step's bad indices, once its values are ready
            if call.model.pipeline is not None and not call.traced.checked:
                # XLA's collectives checked before they run (the call then loads the program from JAX's cache)
                engine.check_compiled(call.program.lower(*call.arguments).compile())
                call.traced.checked = True
            try:
                outputs, rest, grads, sown = call.program(*call.arguments)
            except jax.errors.UnexpectedTracerError:
                if not call.model.stacks:
                    raise
                # a value a layer computed was kept outside its call (a forward hook: Hugging Face's recorded router
                # logits), which cannot leave a scan's body: the layers run one by one, the step is traced again
                call.model.stop_scanning("a layer's value was kept outside its call (a forward hook)")
                return self(*args, **kwargs)
        if not call.traced.has_backward and outputs:  # a forward-only loop (evaluation) has no update to wait at
            programs_in_flight.admit(min(outputs, key=lambda output: output.size))
            host_memory.give_back_between_steps()
        sown, checks = index_checks.taken_from(sown, call.model)
        call.model.training_state.record_step(rest, grads if call.traced.has_backward else None, sown)
        returned = results(call.traced.output_leaves, outputs, call.shards, call.share, checks)
        call.model.run_post_step_hooks()
        return torch_pytree.tree_unflatten(returned, call.traced.output_spec)

    def output_shapes(self, *args: Any, **kwargs: Any) -> Any:
        """What this call would return, without running it: each tensor as a torch tensor on the ``meta`` device
        with the shape and dtype ``StepOutput.as_tensor()`` gives it; other values as they are."""
        call = self._prepare(args, kwargs)
        stacked = call.program.eval_shape(*call.arguments)[0]
        per_process = call.share is not None and call.share.count > 1
        shapes = iter(stacked)
        returned = [
            torch.empty(as_tensor_shape(next(shapes), per_process), dtype=leaf, device="meta")
            if isinstance(leaf, torch.dtype)
            else leaf.value
            for leaf in call.traced.output_leaves
        ]
        return torch_pytree.tree_unflatten(returned, call.traced.output_spec)

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """JAX's ahead-of-time ``Lowered`` of the program this call would run (``.compile().memory_analysis()``)."""
        call = self._prepare(args, kwargs)
        return call.program.lower(*call.arguments)

    def trace(self, *args: Any, **kwargs: Any) -> jax.stages.Traced:
        """JAX's ``Traced`` of the program this call would run (``.jaxpr``: what the step computes, before XLA)."""
        call = self._prepare(args, kwargs)
        return call.program.trace(*call.arguments)

    # --- inputs ---------------------------------------------------------------------------------------------

    def _prepare(self, args: tuple, kwargs: dict) -> _Call:
        bound = self.signature.bind(*args, **kwargs)
        flat, spec = torch_pytree.tree_flatten((bound.args, bound.kwargs))
        models = {id(v): v for v in flat if isinstance(v, DistributedModel)}
        if len(models) > 1:
            raise StepError("a step function takes one DistributedModel")
        model = (
            next(iter(models.values()))
            if models
            else model_registry.the_only(
                f"step function {self.__name__}", "pass the model as an argument of the step function"
            )
        )
        model.check_mesh()
        mesh = model.layout.mesh
        if model.pipeline is not None and jax.process_count() > 1:  # SMP feeds a pipeline from pp_rank() == 0
            flat = pipeline_inputs.from_first_stage(flat, mesh)
        microbatches = model.layout.config.microbatches
        # the processes passing different rows (SMP's data-parallel ranks): each feeds an equal share of the batch
        feeding, processes = state.feeding_share() if jax.process_count() > 1 else (0, 1)
        fed_over = state.feeding_axes() if processes > 1 else state.DATA_AXES
        placed = place_arguments(
            bound, flat, mesh, microbatches, self.non_split_inputs, self.input_split_axes, processes, fed_over,
            model.pipeline is not None, model.abstract,
        )  # fmt: skip
        scaling = model.loss_scaling
        signature = StepSignature(
            spec,
            placed.leaves,
            microbatches,
            batching.data_shards(mesh, placed.fed_over),
            scaling is not None and scaling.scales_in_step,
            torch.is_grad_enabled(),
            model.average_grads_across_microbatches,
            processes,
            model.graphdef,
        )
        if model.pipeline is not None and not model.pipeline.ready:
            self._partition(model, signature, [*placed.arrays, _scale(model, mesh)])
        model.run_post_partition_hooks()
        key = (self, signature)
        program, traced = model.programs.get(key, lambda: step_program.compile_step(self.fn, model, signature))
        if traced.output_spec is None and not isinstance(program, uncompiled.UncompiledProgram):
            # first call: trace before reading the scale (tracing may bind a GradScaler)
            training = model.training_state
            try:
                program.trace(training.params, training.rest, [*placed.arrays, _scale(model, mesh)])  # jax.jit keeps it
            except TracedControlFlowError as error:  # data-dependent shapes: the step runs op by op
                program, traced = model.programs.replace(key, uncompiled.fall_back(self.fn, model, signature, error))
        share = None
        if jax.process_count() > 1:
            share = ProcessShare(feeding, processes, NamedSharding(mesh, PartitionSpec()))
        return _Call(model, [*placed.arrays, _scale(model, mesh)], program, traced, signature.data_shards, share)

    def _partition(self, model: DistributedModel, signature: StepSignature, arrays: list) -> None:
        """Cut a pipelined model into stages from this call's forward (its first step), and move its parameters."""
        traced = step_program.Traced()
        forward = step_program.forward(self.fn, model, signature, traced)
        rest_leaves, rest_def = jax.tree.flatten(model.training_state.rest)
        count, shares = signature.microbatches, signature.process_shares
        mb_avals = []
        for a, axis in zip(arrays, signature.split_axes):
            shape = tuple(n // count if i == axis else n for i, n in enumerate(a.shape))
            shape = process_shares.block_shape(shape, axis, shares) if shares > 1 and axis is not None else shape
            mb_avals.append(jax.ShapeDtypeStruct(shape, a.dtype))
        flat = step_program.flat_forward(forward, model, rest_def, traced)
        jaxpr = model.pipeline.trace(flat, model.layout.avals(), rest_leaves, mb_avals)
        model.partition_into_stages(jaxpr, len(rest_leaves))


def step(
    fn: Callable | None = None,
    *,
    non_split_inputs: Sequence[str] | None = None,
    input_split_axes: dict[str, int] | None = None,
    detach_outputs: bool = True,
):
    """Decorator: ``@smp.step`` or ``@smp.step(non_split_inputs=[...], input_split_axes={name: axis})``.

    The decorated function (forward, loss, ``model.backward(loss)``) is traced into one compiled program
    per input signature, train/eval mode and grad mode; each call runs it on the whole batch, split into
    the config's ``microbatches`` and over the data-parallel devices. Gradients accumulate in the model
    until ``optimizer.zero_grad()``. An evaluation step leaves out ``model.backward`` (and may be called
    under ``torch.no_grad()``): it records no gradients.

    Args:
        fn: the step function; its tensor arguments (also inside lists, tuples and dicts) are split on
            their batch axis; other arguments (an ``argparse.Namespace``, a list of ints, an optimizer) are
            compile-time constants: hashable ones by value, others by identity, read when the step is traced
            (mutating such an object later does not retrace it; pass a new object).
        non_split_inputs: names of tensor arguments every microbatch gets whole.
        input_split_axes: tensor argument name -> the axis to split on (default 0).
        detach_outputs: SMP's option; accepted with no effect, as outputs here are values with no autograd
            graph (detached either way).

    Returns:
        A ``StepFunction``; calling it returns the function's results with each tensor as a
        ``StepOutput`` (its per-microbatch values: ``reduce_mean()``, ``concat()``, ...), in the same
        structure (a dict or ``ModelOutput`` gives ``out["logits"].outputs``); ``None`` and strings are
        returned as they are.

    Raises:
        StepError: names that are not arguments of ``fn``; at call time, a batch that does not divide
            into microbatches x data shards, or the model misused inside the function.
        ModelLookupError: at call time, no ``DistributedModel`` argument and not exactly one live model.
        ConfigError: at call time, ``smp.init`` was called again with another config since the model was built.
    """
    if fn is None:
        return lambda f: StepFunction(f, non_split_inputs, input_split_axes, detach_outputs)
    return StepFunction(fn, non_split_inputs, input_split_axes, detach_outputs)


def is_tracing() -> bool:
    """True while a step function is being traced (SMP: "in the tracing step").

    SMP runs the step function on every call and traces only the first; jmp runs its Python body only while
    tracing it (for each new ``StepSignature``, possibly more than once), so this is True whenever the body
    (or the model's forward inside it) runs, and False outside step functions.
    """
    return current_trace() is not None
