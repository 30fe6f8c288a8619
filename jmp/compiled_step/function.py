"""``@smp.step``: the user's step function traced into one compiled program per input shape.

Inside the program the batch is split into ``microbatches``; each microbatch runs
the user's function (forward, loss, ``model.backward(loss)``) on JaxTensors,
gradients are averaged over microbatches (summed when the model's
``average_grads_across_microbatches`` is False), and the batch is sharded over the
data-parallel mesh axes, so XLA inserts the cross-device gradient reduction.
Every tensor the function returns (also inside lists, dicts and Hugging Face
``ModelOutput``s) comes back as a ``StepOutput`` holding the per-microbatch values.

The Python body of a step function runs only while it is traced, for each new
``StepSignature`` (input shapes and dtypes, non-tensor arguments, train/eval mode,
grad mode, microbatch settings), possibly more than once per trace. Later calls with
the same signature run the compiled program without running the body;
``smp.is_tracing()`` is True inside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.utils._pytree as torch_pytree
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jmp.errors import StepError
from jmp.model import live_models as model_registry
from jmp.model.distributed_model import DistributedModel, current_trace
from jmp.pipeline import engine
from jmp.pipeline.engine import StepInputs
from jmp.remat import xla as remat_xla
from jmp.runtime import compilation_cache as compilation
from jmp.runtime import mesh_state as state
from jmp.sharding import experts
from jmp.torch_bridge import JaxTensor, autocast, call_hooks, dispatch
from jmp.torch_bridge.dtypes import to_torch_dtype
from jmp.torch_bridge.interop import tensor_to_array
from jmp.torch_bridge.tensor import unwrap

logger = logging.getLogger("jmp")

_MODEL = object()  # marks the DistributedModel among the flattened arguments


@dataclasses.dataclass(frozen=True)
class ProcessShare:
    """Which rows of a step's batch this process fed, when several processes feed it (``smp.dp_rank()`` of
    ``smp.dp_size()`` equal shares): as in SMP, its step outputs are its own rows."""

    index: int
    count: int
    rows: int | None  # rows of one microbatch in the whole batch (None: no input was split)
    replicated: NamedSharding  # every device of the mesh holds the whole value


class StepOutput:
    """One returned value of a step function: its value for each microbatch.

    With several processes, every process reads the same values, except that outputs with a batch dimension
    (``outputs``, ``stack()``, ``concat()``) hold only the rows this process fed; reading one is a collective
    (every process makes the same calls, as SMP scripts do).
    """

    def __init__(
        self, stacked: jax.Array, torch_dtype: torch.dtype, data_shards: int, share: ProcessShare | None = None
    ):
        self._stacked = stacked  # [microbatches, ...]
        self._torch_dtype = torch_dtype
        self._data_shards = data_shards
        self._share = share

    def _wrap(self, value: jax.Array, rows_axis: int | None = None, rows: int = 0) -> JaxTensor:
        share = self._share
        if share is not None and not value.is_fully_addressable:
            if not value.is_fully_replicated:  # a loss is already on every device
                value = _replicate(value, share.replicated)
            if rows_axis is not None and value.ndim > rows_axis and rows and value.shape[rows_axis] == rows:
                block = rows // share.count
                value = jax.lax.slice_in_dim(value, share.index * block, (share.index + 1) * block, axis=rows_axis)
        return JaxTensor(value, self._torch_dtype)

    @property
    def _rows(self) -> int:
        return 0 if self._share is None or self._share.rows is None else self._share.rows

    @property
    def outputs(self) -> list[JaxTensor]:
        """The value of each microbatch, in order."""
        return [self._wrap(v, 0, self._rows) for v in self._stacked]

    def reduce_mean(self) -> JaxTensor:
        return self._wrap(_mean_over_microbatches(self._stacked))

    def reduce_sum(self) -> JaxTensor:
        return self._wrap(_sum_over_microbatches(self._stacked))

    def stack(self) -> JaxTensor:
        return self._wrap(self._stacked, 1, self._rows)

    def concat(self) -> JaxTensor:
        """Microbatch values joined along dim 0, rows back in the order of the input batch."""
        stacked, shards = self._stacked, self._data_shards
        if stacked.ndim < 2:
            raise StepError("concat() needs per-microbatch tensors with a batch dimension; use stack()")
        microbatches, rows = stacked.shape[:2]
        if rows % shards:
            return self._wrap(stacked.reshape((microbatches * rows,) + stacked.shape[2:]))
        # each microbatch holds an equal slice of every data shard (see _split_microbatches)
        per_shard = stacked.reshape((microbatches, shards, rows // shards) + stacked.shape[2:])
        ordered = jnp.swapaxes(per_shard, 0, 1).reshape((microbatches * rows,) + stacked.shape[2:])
        return self._wrap(ordered, 0, microbatches * self._rows)

    def __len__(self) -> int:
        return self._stacked.shape[0]

    def __repr__(self) -> str:
        return f"StepOutput({len(self)} microbatches of shape {tuple(self._stacked.shape[1:])})"


# one compiled program each instead of op-by-op dispatch: these run after every step
_mean_over_microbatches = jax.jit(functools.partial(jnp.mean, axis=0))
_sum_over_microbatches = jax.jit(functools.partial(jnp.sum, axis=0))


@functools.partial(jax.jit, static_argnums=1)
def _replicate(value: jax.Array, sharding: NamedSharding) -> jax.Array:
    return jax.lax.with_sharding_constraint(value, sharding)


class _Static:
    """A non-tensor argument baked into the program, as a key: by type and value when hashable, else by identity.

    An unhashable argument (an ``argparse.Namespace``, an optimizer, a config object) is compared by
    identity and kept alive by the key, so its id is never reused by another object. Its contents are read
    when the step is traced: changing them later does not retrace (as SMP, which traces once); pass a new
    object, or a hashable value, to change what the step computes.
    """

    __slots__ = ("value", "by_value")

    def __init__(self, value: Any):
        self.value = value
        try:
            hash(value)
            self.by_value = True
        except Exception:  # unhashable (TypeError) or a __hash__ that raises something else
            self.by_value = False

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Static):
            return NotImplemented
        if self.value is other.value:
            return True
        if not (self.by_value and other.by_value) or type(self.value) is not type(other.value):
            return False  # by type too: 1, 1.0 and True give different programs
        try:
            return bool(self.value == other.value)
        except Exception:
            return False

    def __hash__(self) -> int:
        return hash((type(self.value), self.value)) if self.by_value else id(self.value)

    def __repr__(self) -> str:
        return f"_Static({self.value!r})" if self.by_value else f"_Static(<{type(self.value).__name__} by identity>)"


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """How one flattened argument enters the program."""

    kind: str  # "array" | "model" | "static"
    split_axis: int | None = None
    torch_dtype: torch.dtype | None = None
    static: _Static | None = None


@dataclasses.dataclass(frozen=True)
class StepSignature:
    """What a step program is traced for; with the step function, the key of the model's program cache.

    ``graphdef`` is the model's train/eval configuration (compared by identity: the model keeps one object
    per configuration). The loss scale is the program's last array input (it changes without recompiling);
    ``scales_loss`` says whether the step multiplies the loss by it (an optimizer's loss scaling) or the
    step function does (``smp.amp.GradScaler.scale``). ``grad_enabled`` is torch's grad mode at the call
    (under ``torch.no_grad()`` every op is traced as not differentiable); ``average_grads`` is the model's
    ``average_grads_across_microbatches`` (False: gradients are summed over microbatches).
    """

    arguments: Any  # torch pytree spec of (args, kwargs)
    leaves: tuple[_Leaf, ...]
    microbatches: int
    data_shards: int
    scales_loss: bool
    grad_enabled: bool
    average_grads: bool
    graphdef: nnx.GraphDef = dataclasses.field(compare=False)
    graphdef_id: int = dataclasses.field(init=False)  # the key's stand-in for graphdef (derived, cheap to hash)

    def __post_init__(self) -> None:
        object.__setattr__(self, "graphdef_id", id(self.graphdef))

    @property
    def split_axes(self) -> list[int | None]:
        """The batch axis of each array input (None: given whole to every microbatch); the loss scale comes last."""
        return [leaf.split_axis for leaf in self.leaves if leaf.kind == "array"] + [None]


@dataclasses.dataclass
class _Traced:
    """What tracing a step function revealed (kept per compiled variant)."""

    has_backward: bool = False
    output_count: int = 0  # the returned values that are tensors (the program's outputs)
    output_spec: Any = None
    output_leaves: tuple = ()  # per returned leaf: its torch dtype (a tensor), or _Returned (a value as is)
    checked: bool = False  # a pipelined program's compiled collectives were checked (engine.check_compiled)


@dataclasses.dataclass(frozen=True)
class _Call:
    """One call of a step function, ready to run: the model, the arrays on the devices, the program."""

    model: DistributedModel
    arrays: list[jax.Array]
    program: Any  # jax.jit of StepFunction._run
    traced: _Traced
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
            if call.model.pipeline is not None and not call.traced.checked:
                # XLA's collectives checked before they run (the call then loads the program from JAX's cache)
                engine.check_compiled(call.program.lower(*call.arguments).compile())
                call.traced.checked = True
            outputs, rest, grads, dropped = call.program(*call.arguments)
        call.model.training_state.record_step(rest, grads if call.traced.has_backward else None, dropped)
        shards = _data_shards(call.model.layout.mesh)
        arrays = iter(outputs)
        results = [
            StepOutput(next(arrays), leaf, shards, call.share) if isinstance(leaf, torch.dtype) else leaf.value
            for leaf in call.traced.output_leaves
        ]
        return torch_pytree.tree_unflatten(results, call.traced.output_spec)

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
        microbatches = model.layout.config.microbatches
        shards = _data_shards(mesh)
        processes = state.dp_size() if jax.process_count() > 1 else 1  # equal shares of the batch, one each
        rows = None
        leaves: list[_Leaf] = []
        arrays: list[jax.Array] = []
        for value, name in zip(flat, _argument_names(bound)):
            if isinstance(value, DistributedModel):
                leaves.append(_Leaf("model"))
            elif isinstance(value, (torch.Tensor, np.ndarray, jax.Array)):
                array, dtype = _host_or_device_array(value)
                axis = None if name in self.non_split_inputs else self.input_split_axes.get(name, 0)
                if axis is not None and array.ndim == 0:
                    axis = None  # a scalar has no batch to split
                if axis is not None:
                    shape = _whole_batch_shape(array, axis, processes)
                    _check_divisible(name, shape, axis, microbatches, shards, processes)
                    rows = shape[axis] // microbatches if rows is None else rows
                    sharding = NamedSharding(mesh, PartitionSpec(*([None] * axis), state.DATA_AXES))
                    arrays.append(_whole_batch(array, sharding, shape))
                else:  # the same value on every process
                    arrays.append(jax.device_put(array, NamedSharding(mesh, PartitionSpec())))
                leaves.append(_Leaf("array", axis, dtype))
            else:
                leaves.append(_Leaf("static", static=_Static(value)))
        scaling = model.loss_scaling
        signature = StepSignature(
            spec,
            tuple(leaves),
            microbatches,
            shards,
            scaling is not None and scaling.scales_in_step,
            torch.is_grad_enabled(),
            model.average_grads_across_microbatches,
            model.graphdef,
        )
        if model.pipeline is not None and not model.pipeline.ready:
            self._partition(model, signature, [*arrays, model.loss_scale])
        model.run_post_partition_hooks()
        program, traced = model.programs.get((self, signature), lambda: self._compile(model, signature))
        if traced.output_spec is None:  # first call: trace before reading the scale (tracing may bind a GradScaler)
            training = model.training_state
            program.trace(training.params, training.rest, [*arrays, model.loss_scale])  # jax.jit keeps the trace
        share = None
        if jax.process_count() > 1:
            share = ProcessShare(state.dp_rank(), processes, rows, NamedSharding(mesh, PartitionSpec()))
        return _Call(model, [*arrays, model.loss_scale], program, traced, share)

    def _partition(self, model: DistributedModel, signature: StepSignature, arrays: list) -> None:
        """Cut a pipelined model into stages from this call's forward (its first step), and move its parameters."""
        traced = _Traced()
        forward = self._forward(model, signature, traced)
        rest_leaves, rest_def = jax.tree.flatten(model.training_state.rest)
        count = signature.microbatches
        mb_avals = [
            jax.ShapeDtypeStruct(tuple(n // count if i == axis else n for i, n in enumerate(a.shape)), a.dtype)
            for a, axis in zip(arrays, signature.split_axes)
        ]
        flat = _flat_forward(forward, model, rest_def, traced)
        jaxpr = model.pipeline.trace(flat, model.layout.avals(), rest_leaves, mb_avals)
        model.partition_into_stages(jaxpr, len(rest_leaves))

    # --- the program ----------------------------------------------------------------------------------------

    def _compile(self, model: DistributedModel, signature: StepSignature) -> tuple[Any, _Traced]:
        """The program for ``signature`` (compiled at its first call) and the record its tracing fills in."""
        traced = _Traced()
        run = functools.partial(self._run, model, signature, traced)
        options = remat_xla.compiler_options(model.layout.mesh.devices.flat[0].platform)
        return jax.jit(run, donate_argnums=(1,), compiler_options=options), traced

    def _forward(self, model: DistributedModel, signature: StepSignature, traced: _Traced) -> Callable:
        """The step function on one microbatch: (params, rest, arrays) -> (loss, (outputs, new rest, dropped)).

        ``params`` are as kept (float32 masters in mixed precision) and cast for compute here, so gradients
        flow back through the cast; the last of ``arrays`` is the loss scale.
        """
        policy = model.precision

        def forward(params, rest, mb_arrays):
            *mb_arrays, loss_scale = mb_arrays
            if policy.mixed:
                leaves = policy.for_compute(model.layout.names, jax.tree.leaves(params))
                params = jax.tree_util.tree_unflatten(model.layout.treedef, leaves)
            module = nnx.merge(signature.graphdef, params, rest, copy=True)  # Variables of this trace level
            call_args, call_kwargs = _rebuild(signature.arguments, signature.leaves, mb_arrays, model)
            with (
                model.tracing(module, loss_scale) as trace,
                dispatch.session(getattr(module, "rngs", None)),
                call_hooks(model.call_hooks),
                experts.counting_dropped() as dropped,
                autocast.forced(policy.autocast, half_results=True) if policy.autocast else contextlib.nullcontext(),
            ):
                returned = self.fn(*call_args, **call_kwargs)
            flat, out_spec = torch_pytree.tree_flatten(returned)
            traced.output_spec = out_spec
            traced.output_leaves = tuple(_output_leaf(v, i) for i, v in enumerate(flat))
            traced.has_backward = trace.loss is not None
            outputs = [_output_array(v) for v, leaf in zip(flat, traced.output_leaves) if isinstance(leaf, torch.dtype)]
            loss = unwrap(trace.loss).astype(jnp.float32) if trace.loss is not None else jnp.zeros((), jnp.float32)
            loss = loss * loss_scale if signature.scales_loss else loss
            dropped = sum(dropped, jnp.zeros((), jnp.int32))
            return loss, (outputs, nnx.split(module, nnx.Param, ...)[2], dropped)

        return forward

    def _run(self, model: DistributedModel, signature: StepSignature, traced: _Traced, params, rest, arrays):
        """The whole step on the batch: (stacked outputs, new rest, gradients or None, dropped rows).

        Gradients are the mean over microbatches, or their sum when ``signature.average_grads`` is False.
        """
        microbatches, split = signature.microbatches, signature.split_axes
        pieces = [
            _split_microbatches(a, axis, microbatches, signature.data_shards) if axis is not None else a
            for a, axis in zip(arrays, split)
        ]
        if model.pipeline is not None:
            return self._run_pipeline(model, signature, traced, params, rest, pieces)
        forward = self._forward(model, signature, traced)
        shardings = model.store.shardings
        report = functools.partial(_reported, may_drop=model.may_drop_tokens)

        def arrays_of(mb):
            return [m if axis is not None else p for m, p, axis in zip(mb, pieces, split)]

        def with_grads(rest, mb_arrays):
            (_, (outputs, rest, dropped)), grads = jax.value_and_grad(forward, has_aux=True)(params, rest, mb_arrays)
            # gradients live where their parameters do (sharded data parallel: reduce-scattered)
            return outputs, rest, jax.lax.with_sharding_constraint(grads, shardings), dropped

        if microbatches == 1:
            first = [p[0] if axis is not None else p for p, axis in zip(pieces, split)]
            outputs, rest, grads, dropped = with_grads(rest, first)
            grads = _as_kept(model, grads) if traced.has_backward else None
            return [o[None] for o in outputs], rest, grads, report(dropped)

        mb_stack = [p if axis is not None else None for p, axis in zip(pieces, split)]
        jax.eval_shape(forward, params, rest, arrays_of([p[0] if p is not None else None for p in mb_stack]))
        if traced.has_backward:  # learnt from the shape evaluation above

            def body(carry, mb):
                rest, total, dropped = carry
                outputs, rest, grads, mb_dropped = with_grads(rest, arrays_of(mb))
                return (rest, jax.tree.map(jnp.add, total, grads), dropped + mb_dropped), outputs

            zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params), shardings)
            (rest, total, dropped), stacked = jax.lax.scan(body, (rest, zeros, jnp.zeros((), jnp.int32)), mb_stack)
            if signature.average_grads:
                total = jax.tree.map(lambda g: g / microbatches, total)
            return stacked, rest, _as_kept(model, total), report(dropped)

        def eval_body(carry, mb):
            rest, dropped = carry
            _, (outputs, rest, mb_dropped) = forward(params, rest, arrays_of(mb))
            return (rest, dropped + mb_dropped), outputs

        (rest, dropped), stacked = jax.lax.scan(eval_body, (rest, jnp.zeros((), jnp.int32)), mb_stack)
        return stacked, rest, None, report(dropped)

    def _run_pipeline(self, model: DistributedModel, signature: StepSignature, traced: _Traced, rows, rest, pieces):
        """The step as a pipeline over ``pp`` (see jmp.pipeline): forward cut into stages, both passes scheduled."""
        pipeline, split, microbatches = model.pipeline, signature.split_axes, signature.microbatches
        forward = self._forward(model, signature, traced)
        rest_leaves, rest_def = jax.tree.flatten(rest)
        whole = [None if axis is not None else p for p, axis in zip(pieces, split)]
        split_pieces = [p if axis is not None else None for p, axis in zip(pieces, split)]
        mb_avals = [
            jax.ShapeDtypeStruct(p.shape[1:] if axis is not None else p.shape, p.dtype)
            for p, axis in zip(pieces, split)
        ]
        param_avals = model.layout.avals()
        flat = _flat_forward(forward, model, rest_def, traced)
        jaxpr = pipeline.trace(flat, param_avals, rest_leaves, mb_avals)
        programs = pipeline.programs(jaxpr, list(model.layout.names), len(rest_leaves))
        inputs = StepInputs(rows, rest, tuple(split_pieces), tuple(whole), microbatches, traced.has_backward)
        result = pipeline.step(programs, inputs)
        outputs = result.finals[1 : 1 + traced.output_count]  # finals: [loss, *outputs, dropped]
        dropped = jnp.sum(result.finals[-1])
        grads = result.grads  # summed over microbatches
        if grads is not None and signature.average_grads:
            grads = jax.tree.map(lambda g: g / microbatches, grads)
        grads = _as_kept(model, grads) if grads is not None else None
        return outputs, result.rest, grads, _reported(dropped, model.may_drop_tokens)


def _flat_forward(forward: Callable, model: DistributedModel, rest_def: Any, traced: _Traced) -> Callable:
    """``forward`` on flat lists: (parameters in name order, rest, inputs) -> [loss, *outputs, dropped, *rest].

    The new rest comes last, as ``jmp.pipeline.split`` expects of the forward it cuts.
    """

    def flat(param_list, rest_list, mb_arrays):
        params = jax.tree_util.tree_unflatten(model.layout.treedef, param_list)
        rest = jax.tree_util.tree_unflatten(rest_def, rest_list)
        loss, (outputs, new_rest, dropped) = forward(params, rest, mb_arrays)
        traced.output_count = len(outputs)
        return [loss, *outputs, dropped, *jax.tree.leaves(new_rest)]

    return flat


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


# --- helpers -------------------------------------------------------------------------------------------------


def _as_kept(model: DistributedModel, grads: Any) -> Any:
    """Gradients (float32, laid out as the parameters are stored) in the dtype they are kept in between calls."""
    policy = model.precision
    if not policy.mixed:
        return grads
    return model.store.cast_grads(grads, policy.grad_dtype)


def _reported(dropped: jax.Array, may_drop: bool) -> jax.Array:
    """The step's dropped expert rows, logged (without waiting for the step) when there are any."""
    if may_drop:
        jax.debug.callback(_warn_if_dropped, dropped)
    return dropped


def _warn_if_dropped(dropped: Any) -> None:
    if int(dropped) > 0:
        logger.warning(
            "expert parallelism dropped %d token-expert assignments in this step (they add nothing to the "
            "output); raise expert_capacity_factor, or leave it unset so that none are dropped",
            int(dropped),
        )


def _data_shards(mesh: jax.sharding.Mesh) -> int:
    return int(np.prod([mesh.shape[a] for a in state.DATA_AXES]))


def _split_microbatches(x: jax.Array, axis: int, microbatches: int, shards: int) -> jax.Array:
    """[.., B, ..] -> [microbatches, .., B / microbatches, ..], each microbatch an equal slice of every shard.

    As in SMP, where every data-parallel rank splits its own part of the batch,
    so every device stays busy on every microbatch.
    """
    size = x.shape[axis]
    per = size // (shards * microbatches)
    x = x.reshape(x.shape[:axis] + (shards, microbatches, per) + x.shape[axis + 1 :])
    x = jnp.moveaxis(x, axis + 1, 0)
    return x.reshape((microbatches,) + x.shape[1 : axis + 1] + (shards * per,) + x.shape[axis + 3 :])


def _rebuild(spec, leaves, arrays, model):
    values = iter(arrays)
    flat = []
    for leaf in leaves:
        if leaf.kind == "array":
            flat.append(JaxTensor(next(values), leaf.torch_dtype))
        elif leaf.kind == "model":
            flat.append(model)
        else:
            flat.append(leaf.static.value)
    return torch_pytree.tree_unflatten(flat, spec)


def _argument_names(bound: inspect.BoundArguments) -> list[str]:
    """The step function's argument name for each flattened leaf."""
    names = []
    for name, value in bound.arguments.items():
        parameter = bound.signature.parameters[name]
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            names.extend([name] * sum(len(torch_pytree.tree_leaves(v)) for v in value))
        elif parameter.kind is inspect.Parameter.VAR_KEYWORD:
            names.extend([f"{name}.{k}" for k, v in value.items() for _ in torch_pytree.tree_leaves(v)])
        else:
            names.extend([name] * len(torch_pytree.tree_leaves(value)))
    return names


def _host_or_device_array(value: Any) -> tuple[Any, torch.dtype]:
    """The value to device_put (a numpy copy of a torch tensor goes to the devices in one transfer)."""
    if isinstance(value, JaxTensor):
        return value.value, value.dtype
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bfloat16:
            return tensor_to_array(value), value.dtype
        with torch._C.DisableTorchFunction():
            host = value.detach().cpu().numpy()
        # a copy: the devices may alias host memory, and the caller may reuse the tensor
        return host.astype(jax.dtypes.canonicalize_dtype(host.dtype), copy=True), value.dtype
    array = np.asarray(value) if not isinstance(value, jax.Array) else value
    return array, to_torch_dtype(jax.dtypes.canonicalize_dtype(array.dtype))


def _whole_batch_shape(array: Any, axis: int, processes: int) -> tuple[int, ...]:
    """The shape of the whole batch when each of ``processes`` passes an equal share (its own rows)."""
    shape = tuple(array.shape)
    if processes == 1 or axis >= len(shape) or (isinstance(array, jax.Array) and not array.is_fully_addressable):
        return shape  # one process, or already a global array
    return shape[:axis] + (shape[axis] * processes,) + shape[axis + 1 :]


def _whole_batch(array: Any, sharding: NamedSharding, shape: tuple[int, ...]) -> jax.Array:
    """The batch as one array over the mesh; with several processes, built from each one's rows."""
    if jax.process_count() == 1 or (isinstance(array, jax.Array) and not array.is_fully_addressable):
        return jax.device_put(array, sharding)
    return jax.make_array_from_process_local_data(sharding, np.asarray(array), shape)


def _check_divisible(name: str, shape: tuple, axis: int, microbatches: int, shards: int, processes: int = 1) -> None:
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
        raise StepError(
            f"step input '{name}' has batch size {shape[axis]} (axis {axis}), which does not divide into "
            f"{microbatches} microbatches x {shards} data-parallel shards = {microbatches * shards}. Use a batch "
            "size that is a multiple of that (DataLoader(..., drop_last=True) drops the short last batch), or "
            "list the argument in non_split_inputs."
        )


@dataclasses.dataclass(frozen=True)
class _Returned:
    """A returned value that is not a tensor (None, a string), given back as it is."""

    value: Any


def _output_leaf(value: Any, index: int) -> torch.dtype | _Returned:
    """How one returned leaf comes back: a StepOutput of this torch dtype, or the value itself."""
    if isinstance(value, torch.Tensor):
        return value.dtype
    if value is None or isinstance(value, (str, bytes)):
        return _Returned(value)
    if isinstance(value, (bool, int, float, complex, np.ndarray, np.generic, jax.Array)):
        return to_torch_dtype(jnp.asarray(value).dtype)
    raise StepError(
        f"the step function returned a value of type {type(value).__name__} (leaf {index} of its result); a step "
        "returns tensors, Python numbers, None or strings, also inside lists, tuples, dicts and ModelOutputs. "
        "Return its tensors instead."
    )


def _output_array(value: Any) -> jax.Array:
    if isinstance(value, JaxTensor):
        return value.value
    if isinstance(value, torch.Tensor):
        return tensor_to_array(value)
    return jnp.asarray(value)
