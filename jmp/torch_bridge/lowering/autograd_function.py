"""Custom ``torch.autograd.Function``s: their own ``forward`` and ``backward``, as a ``jax.custom_vjp``.

Differentiating the forward's ops would ignore the Function's backward (a straight-through estimator's
gradient would be zero), so ``SomeFunction.apply(*args)`` becomes a ``jax.custom_vjp`` whose primal runs
the Function's ``forward`` (under ``no_grad``, as in torch) and whose VJP runs its ``backward``, both as
torch code on JaxTensors. What the forward keeps on ``ctx`` (saved tensors, attributes) crosses to the
backward: tensors as residuals, everything else as Python values. The backward runs when JAX
differentiates, after the forward's bridge session has ended, so it opens a session of its own.
A forward that reads differentiated tensors it is not given (a reversible layer's modules, whose backward
recomputes them and calls ``.backward()``) is traced once as a probe and differentiated instead, said once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import torch
import torch.utils._pytree as torch_pytree
from flax import nnx
from jax.custom_derivatives import SymbolicZero
from jax.interpreters.partial_eval import DynamicJaxprTracer
from torch.autograd.function import FunctionCtx, NestedIOFunction, once_differentiable
from torch.utils.checkpoint import CheckpointFunction

from jmp.errors import JmpError, LoweringError, UnsupportedOpError
from jmp.runtime import notices
from jmp.torch_bridge import dispatch, padded_nonzero
from jmp.torch_bridge.registry import register_lowering
from jmp.torch_bridge.tensor import JaxTensor, unwrap

_BASE = torch.autograd.Function
_ONCE_DIFFERENTIABLE = once_differentiable(lambda ctx: None).__code__
_INTERNAL_CTX = ("non_differentiable", "dirty_tensors")


def _reentrant_checkpoint(run_function: Callable, preserve_rng_state: bool, *args: Any) -> Any:
    # torch's reentrant checkpoint recomputes run_function in its backward and differentiates that: its
    # gradient is run_function's, which JAX takes directly (rematerialisation is jmp.remat's business).
    return run_function(*args)


# Functions whose meaning is a plain call: their backward runs torch autograd itself, which JAX replaces.
_AS_CALLS: dict[type, Callable[..., Any]] = {CheckpointFunction: _reentrant_checkpoint}


class FunctionContext(FunctionCtx):
    """The ``ctx`` a custom Function's ``forward`` / ``setup_context`` / ``backward`` receives here."""

    def __init__(self, function: type, needs_input_grad: tuple[bool, ...]):
        self.needs_input_grad = needs_input_grad
        self.materialize_grads = True
        self._function_name = function.__qualname__

    @property
    def saved_tensors(self) -> tuple:
        return tuple(self.__dict__.get("to_save", ()))

    def mark_dirty(self, *args: torch.Tensor) -> None:
        raise UnsupportedOpError(
            f"{self._function_name}.forward calls ctx.mark_dirty: a custom autograd.Function that modifies "
            f"its inputs in place is not supported{dispatch.where()}. Return a new tensor instead "
            "(out = x.clone(); out.add_(...)) and assign the result where the input was used."
        )


@dataclasses.dataclass
class _Call:
    """One ``apply`` call, taken apart: the tensors that cross into JAX and what stays Python."""

    leaves: list[Any]  # the flattened (inputs, kwargs), JaxTensors among them
    spec: torch_pytree.TreeSpec
    tensors: list[JaxTensor]  # the JaxTensor leaves, in order
    positions: list[int]  # where each of ``tensors`` sits in ``leaves``
    input_tensor: list[int | None]  # per positional input: its index in ``tensors`` if it is a JaxTensor
    differentiable: list[bool]  # per positional input: a floating JaxTensor (torch tracks its gradient)

    def arguments(self, arrays: list[jax.Array]) -> tuple[tuple, dict]:
        """The call's (inputs, kwargs) with fresh JaxTensors holding ``arrays``."""
        leaves = list(self.leaves)
        for position, tensor, array in zip(self.positions, self.tensors, arrays):
            leaves[position] = JaxTensor(array, tensor.dtype)
        inputs, kwargs = torch_pytree.tree_unflatten(leaves, self.spec)
        return tuple(inputs), kwargs


@dataclasses.dataclass
class _Traced:
    """What a run of the forward leaves for the code after it (static: Python values, dtypes, structure)."""

    out_leaves: list[Any] = dataclasses.field(default_factory=list)  # None where a tensor goes
    out_spec: torch_pytree.TreeSpec | None = None
    out_dtypes: list[torch.dtype] = dataclasses.field(default_factory=list)
    out_avals: list[jax.ShapeDtypeStruct] = dataclasses.field(default_factory=list)
    output_tensor: list[int | None] = dataclasses.field(default_factory=list)  # per output, as _Call.input_tensor
    # per output tensor: the last position of the same tensor object. Torch hands a tensor returned twice
    # back as one object, attached to its last position, so that one carries the gradient of every use.
    same_as: list[int] = dataclasses.field(default_factory=list)
    stopped: list[bool] = dataclasses.field(default_factory=list)  # per output tensor: carries no gradient
    ctx_leaves: list[Any] = dataclasses.field(default_factory=list)  # None where a residual goes
    ctx_spec: torch_pytree.TreeSpec | None = None
    ctx_dtypes: list[torch.dtype] = dataclasses.field(default_factory=list)


@register_lowering(dispatch.FUNCTION_APPLY, raw=True)
def function_apply(function: type, *args: Any, **kwargs: Any) -> Any:
    """``function.apply(*args, **kwargs)`` as a ``jax.custom_vjp`` of its own forward and backward."""
    if function in _AS_CALLS:
        return _AS_CALLS[function](*args, **kwargs)
    _check_supported(function)
    bound = _bind(function, args, kwargs)
    call = _take_apart(*bound)
    rngs = dispatch.current_rngs()
    rng_graph, rng_state = nnx.split(rngs) if rngs is not None else (None, None)
    rng_leaves, rng_def = jax.tree.flatten(rng_state)
    traced = _Traced()
    scope = dispatch.current_scope()
    where = dispatch.where()

    def run(arrays: list[jax.Array], needs_input_grad: tuple[bool, ...], grad: bool = False) -> tuple[list, list, Any]:
        rng_arrays, tensor_arrays = arrays[: len(rng_leaves)], arrays[len(rng_leaves) :]
        inner_rngs = None if rngs is None else nnx.merge(rng_graph, jax.tree.unflatten(rng_def, rng_arrays))
        inputs, call_kwargs = call.arguments(tensor_arrays)
        ctx = FunctionContext(function, needs_input_grad)
        with (
            dispatch.session(inner_rngs),
            dispatch.rngs_stand_in(rngs, inner_rngs),  # the modules the forward calls draw from it too
            dispatch.no_grad_ignored() if grad else torch.no_grad(),
        ):
            output = _forward(function, ctx, inputs, call_kwargs)
        if any(isinstance(t, JaxTensor) and t.write_count > 0 for t in _tensor_leaves(inputs, call_kwargs)):
            raise UnsupportedOpError(
                f"{function.__qualname__}.forward modified an input in place, which a custom autograd.Function "
                "here does not support. Return a new tensor instead (out = x.clone(); out.add_(...))."
            )
        out_arrays = _trace_output(traced, output, ctx)
        new_rng = [] if rngs is None else jax.tree.leaves(nnx.state(inner_rngs))
        # Only a forward that drew random numbers hands a new stream state back.
        return out_arrays, [] if all(a is b for a, b in zip(new_rng, rng_arrays)) else new_rng, ctx

    @jax.custom_vjp
    def primal(*arrays: jax.Array) -> tuple[list, list]:
        out_arrays, new_rng, _ = run(list(arrays), (False,) * len(call.input_tensor))
        return out_arrays, new_rng

    def forward(*primals: Any) -> tuple[tuple[list, list], list]:
        arrays = [p.value for p in primals]
        perturbed = [p.perturbed for p in primals[len(rng_leaves) :]]
        needs = tuple(
            index is not None and differentiable and perturbed[index]
            for index, differentiable in zip(call.input_tensor, call.differentiable)
        )
        out_arrays, new_rng, ctx = run(arrays, needs)
        return (out_arrays, new_rng), _residuals(traced, ctx)

    def backward(residuals: list, cotangents: tuple[list, list]) -> tuple:
        with dispatch.scope(*scope) if scope else contextlib.nullcontext(), _errors_named(function, where):
            grads = _run_backward(function, call, traced, residuals, cotangents[0])
        return (None,) * len(rng_leaves) + tuple(grads)

    primal.defvjp(forward, backward, symbolic_zeros=True)
    arrays = [*rng_leaves, *(t.value for t in call.tensors)]
    backward_runs = []

    def probe(*arrays: jax.Array) -> tuple[list, list]:  # the forward, differentiable; then its backward, tried
        out_arrays, new_rng, ctx = run(list(arrays), tuple(call.differentiable), grad=True)
        cotangents = [jnp.zeros_like(a) for a in out_arrays]
        backward = functools.partial(_run_backward, function, call, traced, _residuals(traced, ctx), cotangents)
        backward_runs.append(_runs_traced(backward))
        return out_arrays, new_rng

    closure = _closure_probe(probe, arrays)
    try:
        if closure is not None:
            out_arrays, new_rng = _forward_differentiated(function, closure, arrays, backward_runs[0])
        else:
            out_arrays, new_rng = primal(*arrays)
    except jax.errors.UnexpectedTracerError:  # op by op, where a forward needing concrete values shows it only now
        _say_forward_differentiated(function)
        with dispatch.no_grad_ignored():
            return _forward(function, FunctionContext(function, tuple(call.differentiable)), *bound)
    if new_rng:
        nnx.update(rngs, jax.tree.unflatten(rng_def, new_rng))
    return _rebuild_output(traced, out_arrays, grad_enabled=torch.is_grad_enabled())


def _closure_probe(probe: Callable, arrays: list[jax.Array]) -> tuple[Any, Any] | None:
    """(jaxpr, output structure) of ``probe(*arrays)`` where it reads a value being differentiated (not staged by
    ``jit`` alone) that is not among ``arrays``: a module's parameter; else None (also where it needs values)."""
    try:
        closed, shapes = jax.make_jaxpr(probe, return_shape=True)(*arrays)
    except Exception:  # noqa: BLE001 - the call itself raises it where it says more
        return None
    if any(isinstance(c, jax.core.Tracer) and not isinstance(c, DynamicJaxprTracer) for c in closed.consts):
        return closed, jax.tree.structure(shapes)
    return None


def _runs_traced(fn: Callable[[], Any]) -> bool:
    """Whether ``fn`` traces: a Function's backward that calls torch autograd itself (``.backward()``,
    ``torch.autograd.grad``), as a reversible layer's does to give module parameters their gradients, does not."""
    try:
        jax.make_jaxpr(fn)()
    except Exception:  # noqa: BLE001 - any failure: the backward cannot be the gradient rule here
        return False
    return True


def _forward_differentiated(function: type, closure: tuple[Any, Any], arrays: list, backward_runs: bool) -> Any:
    """The (outputs, random stream) of the probed forward, for JAX to differentiate: its backward can give the
    values it reads only by running torch autograd itself (a reversible layer's), or gives them none (an error)."""
    if backward_runs:
        raise LoweringError(
            f"{function.__qualname__}.forward uses a traced tensor that is not an argument of apply (a module's "
            "parameter or buffer, or a tensor from an enclosing scope), and its backward gives that tensor no "
            "gradient, which JAX cannot express. Pass that tensor to apply as an argument (and return its "
            "gradient from backward, or None)."
        )
    _say_forward_differentiated(function)
    closed, structure = closure
    return jax.tree.unflatten(structure, jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *arrays))


def _say_forward_differentiated(function: type) -> None:
    notices.warn_once(
        f"torch_bridge.autograd_function.{function.__qualname__}",
        "%s.forward reads tensors that JAX differentiates but are not arguments of apply (module parameters), "
        "and its backward gives them gradients by running torch autograd: jmp differentiates its forward "
        "instead, which gives the same gradients without the backward's memory saving (a reversible layer's).",
        function.__qualname__,
    )


def _check_supported(function: type) -> None:
    if issubclass(function, NestedIOFunction):
        raise UnsupportedOpError(
            f"{function.__qualname__} is a legacy NestedIOFunction, which is not supported{dispatch.where()}. "
            "Write it as a torch.autograd.Function with static forward and backward methods."
        )


def _bind(function: type, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The positional inputs torch sees (keyword arguments bound to their positions), and keyword-only ones."""
    if not kwargs and not _has_setup_context(function):
        return args, kwargs
    signature = inspect.signature(function.forward)
    if not _has_setup_context(function):  # forward(ctx, ...): bind without the ctx
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    bound = signature.bind(*args, **kwargs)
    if _has_setup_context(function):
        bound.apply_defaults()  # as torch does before setup_context sees the inputs
    return bound.args, bound.kwargs


def _has_setup_context(function: type) -> bool:
    return function.setup_context is not _BASE.setup_context


def _take_apart(inputs: tuple, kwargs: dict) -> _Call:
    leaves, spec = torch_pytree.tree_flatten((list(inputs), kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, JaxTensor)]
    tensors = [leaves[i] for i in positions]
    input_tensor = _top_level_tensors(inputs, positions)
    differentiable = [isinstance(x, JaxTensor) and (x.is_floating_point() or x.is_complex()) for x in inputs]
    return _Call(leaves, spec, tensors, positions, input_tensor, differentiable)


def _top_level_tensors(items: tuple, positions: list[int]) -> list[int | None]:
    """Per item of ``items``: the index in ``positions`` of its leaf if it is a JaxTensor itself, else None.

    ``positions`` are the JaxTensor leaves of the flattened ``items`` (leading any later leaves); a tensor
    passed twice has two positions, so each of its uses keeps its own gradient.
    """
    tensor_at = {position: k for k, position in enumerate(positions)}
    found, start = [], 0
    for item in items:
        found.append(tensor_at[start] if isinstance(item, JaxTensor) else None)
        start += len(torch_pytree.tree_leaves(item))
    return found


def _tensor_leaves(*trees: Any) -> list[Any]:
    return [leaf for leaf in torch_pytree.tree_leaves(trees) if isinstance(leaf, torch.Tensor)]


def _forward(function: type, ctx: FunctionContext, inputs: tuple, kwargs: dict) -> Any:
    if _has_setup_context(function):
        output = function.forward(*inputs, **kwargs)
        function.setup_context(ctx, inputs, output)
        return output
    return function.forward(ctx, *inputs, **kwargs)


def _trace_output(traced: _Traced, output: Any, ctx: FunctionContext) -> list[jax.Array]:
    """Record the output's structure in ``traced``; its tensors' arrays, in order."""
    outputs = output if isinstance(output, tuple) else (output,)
    leaves, traced.out_spec = torch_pytree.tree_flatten(padded_nonzero.refuse(output, "a custom Function's output"))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, JaxTensor)]
    tensors = [leaves[i] for i in positions]
    traced.out_leaves = [None if isinstance(leaf, JaxTensor) else leaf for leaf in leaves]
    traced.out_dtypes = [t.dtype for t in tensors]
    traced.output_tensor = _top_level_tensors(outputs, positions)
    last = {id(t): k for k, t in enumerate(tensors)}
    traced.same_as = [last[id(t)] for t in tensors]
    marked = {id(t) for t in ctx.__dict__.get("non_differentiable", ())}
    top_level = {k for k in traced.output_tensor if k is not None}
    traced.stopped = [
        k not in top_level or id(t) in marked or not (t.is_floating_point() or t.is_complex())
        for k, t in enumerate(tensors)
    ]
    arrays = [unwrap(t) for t in tensors]
    traced.out_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    return arrays


def _residuals(traced: _Traced, ctx: FunctionContext) -> list[jax.Array]:
    """The arrays the backward needs from ``ctx``; the rest of ``ctx`` is recorded in ``traced``."""
    state = {k: v for k, v in ctx.__dict__.items() if k not in _INTERNAL_CTX}
    leaves, traced.ctx_spec = torch_pytree.tree_flatten(state)
    tensors = [leaf for leaf in leaves if isinstance(leaf, JaxTensor)]
    traced.ctx_leaves = [None if isinstance(leaf, JaxTensor) else leaf for leaf in leaves]
    traced.ctx_dtypes = [t.dtype for t in tensors]
    return [unwrap(t) for t in tensors]


def _rebuild_ctx(traced: _Traced, residuals: list[jax.Array]) -> FunctionContext:
    tensors = iter(JaxTensor(a, d) for a, d in zip(residuals, traced.ctx_dtypes))
    leaves = [next(tensors) if leaf is None else leaf for leaf in traced.ctx_leaves]
    ctx = FunctionContext.__new__(FunctionContext)
    ctx.__dict__.update(torch_pytree.tree_unflatten(leaves, traced.ctx_spec))
    return ctx


def _rebuild_output(traced: _Traced, arrays: list[jax.Array], grad_enabled: bool) -> Any:
    made = [
        JaxTensor(jax.lax.stop_gradient(a) if stopped or not grad_enabled else a, dtype)
        for a, dtype, stopped in zip(arrays, traced.out_dtypes, traced.stopped)
    ]
    tensors = iter(made[k] for k in traced.same_as)
    leaves = [next(tensors) if leaf is None else leaf for leaf in traced.out_leaves]
    return torch_pytree.tree_unflatten(leaves, traced.out_spec)


def _run_backward(
    function: type, call: _Call, traced: _Traced, residuals: list[jax.Array], cotangents: list[Any]
) -> list[jax.Array | None]:
    """The Function's backward on the output cotangents; one gradient (or None) per tensor of the call."""
    ctx = _rebuild_ctx(traced, residuals)
    grad_outputs = [
        None if k is None else _grad_output(cotangents[k], traced.out_avals[k], traced.out_dtypes[k], ctx)
        for k in traced.output_tensor
    ]
    backward, first_order_only = _backward_of(function)
    with dispatch.session(None), torch.enable_grad():
        grads = backward(ctx, *grad_outputs)
    grads = _one_per_input(function, grads, len(call.input_tensor))
    out: list[jax.Array | None] = [None] * len(call.tensors)
    for i, (grad, index) in enumerate(zip(grads, call.input_tensor)):
        if grad is None:
            continue
        if index is None:
            raise LoweringError(
                f"{function.__qualname__}.backward returned a gradient for input {i}, which is not a tensor; "
                "return None there."
            )
        if not call.differentiable[i]:
            continue
        value = _fit_gradient(function, i, unwrap(grad), call.tensors[index].value)
        out[index] = _no_second_derivative(function.__qualname__, value) if first_order_only else value
    return out


def _grad_output(cotangent: Any, aval: jax.ShapeDtypeStruct, dtype: torch.dtype, ctx: FunctionContext) -> Any:
    """The gradient torch passes to backward for one output: zeros (or None) where JAX has none."""
    if isinstance(cotangent, SymbolicZero) or cotangent.dtype == jax.dtypes.float0:
        if not ctx.__dict__.get("materialize_grads", True):
            return None
        cotangent = jnp.zeros(aval.shape, aval.dtype)
    return JaxTensor(cotangent, dtype)


def _backward_of(function: type) -> tuple[Callable, bool]:
    """The Function's ``backward`` (or ``vjp``) without ``@once_differentiable``, and whether it had it."""
    has_backward, has_vjp = function.backward is not _BASE.backward, function.vjp is not _BASE.vjp
    if has_backward and has_vjp:
        raise LoweringError(
            f"{function.__qualname__} defines both backward and vjp; define only one (as torch requires)."
        )
    if not (has_backward or has_vjp):
        raise UnsupportedOpError(
            f"{function.__qualname__} has no backward, but JAX is differentiating through it. "
            "Define its backward (staticmethod backward(ctx, *grad_outputs)), or stop the gradient before it."
        )
    backward = function.vjp if has_vjp else function.backward
    if getattr(backward, "__code__", None) is _ONCE_DIFFERENTIABLE:
        return backward.__wrapped__, True
    return backward, False


def _one_per_input(function: type, grads: Any, count: int) -> tuple:
    grads = tuple(grads) if isinstance(grads, (tuple, list)) else (grads,)
    if len(grads) > count and all(g is None for g in grads[count:]):
        grads = grads[:count]  # torch allows trailing Nones
    if len(grads) != count:
        raise LoweringError(
            f"{function.__qualname__}.backward returned {len(grads)} gradients, but apply had {count} inputs; "
            "return one gradient (or None) per input of forward."
        )
    return grads


def _fit_gradient(function: type, index: int, grad: jax.Array, value: jax.Array) -> jax.Array:
    """The gradient in the input's shape and dtype; a broadcast one is summed to the input's shape, as torch does."""
    grad = jnp.asarray(grad)
    if grad.shape != value.shape:
        if not _expandable(value.shape, grad.shape):
            raise LoweringError(
                f"{function.__qualname__}.backward returned a gradient of shape {tuple(grad.shape)} for input "
                f"{index} of shape {tuple(value.shape)}; return one of the input's shape."
            )
        lead = grad.ndim - value.ndim
        grad = grad.sum(axis=tuple(range(lead)))
        grad = grad.sum(axis=tuple(a for a, (n, m) in enumerate(zip(value.shape, grad.shape)) if n == 1 and m != 1))
        grad = grad.reshape(value.shape)
    return grad.astype(value.dtype)


def _expandable(shape: tuple, target: tuple) -> bool:
    """Whether ``shape`` broadcasts to ``target`` (torch's ``is_expandable_to``)."""
    if len(shape) > len(target):
        return False
    return all(n in (1, m) for n, m in zip(reversed(shape), reversed(target)))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _no_second_derivative(name: str, value: jax.Array) -> jax.Array:
    """The identity, for a ``@once_differentiable`` backward's gradients: differentiating them is an error."""
    return value


@_no_second_derivative.defjvp
def _no_second_derivative_jvp(name: str, primals: tuple, tangents: tuple) -> tuple:
    raise UnsupportedOpError(
        f"{name}.backward is marked @once_differentiable, but JAX is differentiating it (a second derivative). "
        "Remove @once_differentiable if the backward's own ops may be differentiated, or take one derivative."
    )


@contextlib.contextmanager
def _errors_named(function: type, where: str) -> Iterator[None]:
    """Errors in a backward, which JAX runs after the call: say which Function and where it was applied."""
    try:
        yield
    except JmpError:
        raise
    except Exception as error:
        raise LoweringError(
            f"{function.__qualname__}.backward failed while JAX differentiated it (applied{where}): "
            f"{type(error).__name__}: {error}"
        ) from error
