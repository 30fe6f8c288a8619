"""The interception layer: every torch call made by forward code on the bridge's tensors (or inside a bridge
session, for factories) is looked up in the lowering registry and run as JAX.

A *session* is active while a converted module runs torch code: its ``TorchFunctionMode`` sees factory functions
such as ``torch.arange`` too, ``torch.compiler.is_compiling()`` answers True (so Hugging Face models take their
trace-friendly branches), and it provides the random stream for dropout and ``torch.rand*``. A *scope* records
which module is running, for error messages. ``torch.autograd.Function.apply`` and torch's higher-order ops
(``torch.cond``, ``scan``, ...) do not go through the torch-function protocol, so while any session runs they are
routed to the dispatcher (``lowering/autograd_function.py``, ``higher_order_ops.py``); ``torch.autocast`` entered in
a session drives jmp's autocast state (``autocast.py``), by which the dispatcher casts a call's arguments.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import linecache
import os
import sys
from collections.abc import Iterator
from typing import Any

import jax
import torch
import torch.compiler
from torch.overrides import TorchFunctionMode, resolve_name

from jmp.errors import JmpError, LoweringError, TracedControlFlowError, UnsupportedOpError
from jmp.torch_bridge import (
    autocast,
    higher_order_ops,
    index_checks,
    keyword_aliases,
    padded_nonzero,
    registry,
    replica_calls,
    shape_checks,
    value_checks,
)
from jmp.torch_bridge.context_vars import set_within
from jmp.torch_bridge.patching import SharedPatch
from jmp.torch_bridge.tensor import JaxTensor, contains_tensor, unwrap_tree, wrap

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("jmp_bridge_active", default=False)
_RNGS: contextvars.ContextVar[Any] = contextvars.ContextVar("jmp_bridge_rngs", default=None)
_SCOPE: contextvars.ContextVar[tuple] = contextvars.ContextVar("jmp_bridge_scope", default=())
_BATCH_AXIS: contextvars.ContextVar[str | None] = contextvars.ContextVar("jmp_bridge_batch_axis", default=None)
_STAND_IN: contextvars.ContextVar[tuple] = contextvars.ContextVar("jmp_bridge_rngs_stand_in", default=(None, None))
_NO_GRAD_IGNORED: contextvars.ContextVar[bool] = contextvars.ContextVar("jmp_bridge_no_grad_ignored", default=False)

_T = torch.Tensor
# what JAX raises when Python asks a traced array for a value (a bool, an int, a host copy, a data-dependent shape)
_NEEDS_CONCRETE_VALUES = (
    jax.errors.ConcretizationTypeError,
    jax.errors.NonConcreteBooleanIndexError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
)
# Calls that only read metadata the wrapper already carries; torch answers them itself.
_PASSTHROUGH_NAMES = (
    "dim",
    "size",
    "numel",
    "nelement",
    "__len__",
    "is_floating_point",
    "is_complex",
    "element_size",
    "is_contiguous",
    "stride",
    "get_device",
    "__hash__",
    "is_signed",
    "storage_offset",
)
_PASSTHROUGH_PROPS = (
    "shape",
    "dtype",
    "device",
    "ndim",
    "requires_grad",
    "is_leaf",
    "grad_fn",
    "grad",
    "is_cuda",
    "is_cpu",
    "layout",
    "is_sparse",
    "is_quantized",
    "is_meta",
    "is_nested",
    "is_mkldnn",
    "itemsize",
    "nbytes",
    "names",
    "is_xpu",
    "is_mps",
    "_base",
    "output_nr",
    "_version",
)
PASSTHROUGH = (
    {getattr(_T, n) for n in _PASSTHROUGH_NAMES if hasattr(_T, n)}
    | {getattr(_T, n).__get__ for n in _PASSTHROUGH_PROPS if hasattr(_T, n)}
    | {torch.is_tensor, torch.is_floating_point, torch.is_complex, torch.numel, torch.result_type}
)


class BridgeMode(TorchFunctionMode):
    """Routes every torch function call to the dispatcher while a session is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return dispatch(func, args, kwargs or {})


@contextlib.contextmanager
def session(rngs: Any = None) -> Iterator[None]:
    """Run torch code on JaxTensors; nested sessions only replace the random stream."""
    rngs_token = _RNGS.set(rngs_for(rngs) if rngs is not None else _RNGS.get())
    if _ACTIVE.get():
        try:
            yield
        finally:
            _RNGS.reset(rngs_token)
        return
    active_token = _ACTIVE.set(True)
    was_compiling = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        with BridgeMode(), _FUNCTION_APPLY_ROUTE, _HIGHER_ORDER_ROUTE, autocast.Route():
            yield
    finally:
        torch.compiler._is_compiling_flag = was_compiling
        _ACTIVE.reset(active_token)
        _RNGS.reset(rngs_token)


_ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]
# The registry key of ``SomeFunction.apply(*args)``; its lowering receives ``(SomeFunction, *args)``.
FUNCTION_APPLY = _ORIGINAL_APPLY.__func__


def _routed_apply(function: type, *args: Any, **kwargs: Any) -> Any:
    """``Function.apply`` while sessions run: calls from bridge code go to the dispatcher, others to torch."""
    # Inside a session the bridge's mode is on, unless a lowering is running plain torch code itself (then
    # only calls on JaxTensors are the bridge's).
    if _ACTIVE.get() and (
        torch.overrides._is_torch_function_mode_enabled() or contains_tensor((args, kwargs), JaxTensor)
    ):
        return dispatch(FUNCTION_APPLY, (function, *args), kwargs)
    return FUNCTION_APPLY(function, *args, **kwargs)


# Installs ``_routed_apply`` as ``torch.autograd.Function.apply`` while at least one session (in any thread)
# runs. Outside sessions torch is left untouched; a thread without a session that calls ``apply`` meanwhile
# reaches torch's own ``apply`` through the check in ``_routed_apply``.
_FUNCTION_APPLY_ROUTE = SharedPatch((torch.autograd.Function, "apply", classmethod(_routed_apply)))


def _route_higher_order(original: Any) -> Any:
    """A router for one higher-order op: calls inside a session go to the dispatcher, others to torch."""

    @functools.wraps(original)
    def routed(*args: Any, **kwargs: Any) -> Any:
        if _ACTIVE.get() and (
            torch.overrides._is_torch_function_mode_enabled() or contains_tensor((args, kwargs), JaxTensor)
        ):
            return dispatch(original, args, kwargs)
        return original(*args, **kwargs)

    return routed


_HIGHER_ORDER_ROUTE = SharedPatch(*higher_order_ops.replacements(_route_higher_order))


@contextlib.contextmanager
def scope(path: str, type_name: str) -> Iterator[None]:
    """Mark that the module at ``path`` is running (for error messages)."""
    with set_within(_SCOPE, _SCOPE.get() + ((path, type_name),)):
        yield


def rngs_stand_in(replaced: Any, stand_in: Any) -> contextlib.AbstractContextManager[None]:
    """Within the block, sessions given the random stream ``replaced`` (a module's) draw from ``stand_in``: one
    threaded through a JAX transform the block runs in."""
    return set_within(_STAND_IN, (replaced, stand_in))


def rngs_for(rngs: Any) -> Any:
    """The random stream to draw from for a module's ``rngs``: its ``rngs_stand_in``, if any."""
    replaced, stand_in = _STAND_IN.get()
    return stand_in if rngs is replaced and replaced is not None else rngs


def no_grad_ignored() -> contextlib.AbstractContextManager[None]:
    """Within the block, tensors made under ``torch.no_grad()`` keep their gradient: for a custom Function's
    forward that JAX differentiates, whose ``no_grad`` blocks mean nothing in torch (it runs under no_grad)."""
    return set_within(_NO_GRAD_IGNORED, True)


def current_rngs() -> Any:
    return _RNGS.get()


@contextlib.contextmanager
def batched_over(axis_name: str) -> Iterator[None]:
    """Torch code traced meanwhile runs under ``jax.vmap(..., axis_name=axis_name)`` (once per process): each
    entry draws its own random numbers, and lowerings JAX cannot batch as they are take their batched form."""
    with set_within(_BATCH_AXIS, axis_name):
        yield


def batch_axis() -> str | None:
    """The ``batched_over`` axis name, or None."""
    return _BATCH_AXIS.get()


def salted(key: jax.Array) -> jax.Array:
    """``key`` with the ``batched_over`` entry's index folded in (the key itself outside one)."""
    axis = _BATCH_AXIS.get()
    return key if axis is None else jax.random.fold_in(key, jax.lax.axis_index(axis))


def current_scope() -> tuple[str, str] | None:
    """(module path, type name) of the innermost running module, or None outside modules."""
    scope_stack = _SCOPE.get()
    return scope_stack[-1] if scope_stack else None


def dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    if padded_nonzero.involved(func, args, kwargs):  # nonzero under jit: fixed size, padded (and what reads it)
        return padded_nonzero.dispatch(func, args, kwargs, _dispatch)
    return _dispatch(func, args, kwargs)


def _dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    entry = registry.lookup(func)
    if entry is None:
        return _not_lowered(func, args, kwargs)
    checked = index_checks.CHECKED.get(func)
    if checked is not None:  # indices out of range raise torch's IndexError (outside any per-replica shard_map)
        index_checks.run(checked, where(), unwrap_tree(args), unwrap_tree(kwargs))
    shaped = shape_checks.CHECKED.get(func)
    if shaped is not None:  # shapes torch rejects raise torch's RuntimeError, before JAX's wording would
        shape_checks.run(shaped, where, unwrap_tree(args), unwrap_tree(kwargs))
    try:
        casting = autocast.active()
        if casting is not None:  # torch.autocast: cast the arguments by func's policy
            return casting.run(func, lambda a, k: _apply(entry, func, a, k), args, kwargs)
        return _apply(entry, func, args, kwargs)
    except JmpError:
        raise
    except _NEEDS_CONCRETE_VALUES as error:
        if func is torch.Tensor.__bool__:  # ``if <traced condition>: raise``: checked as the program runs
            frame = user_frame()
            branch = value_checks.raising_branch(frame)
            if branch is not None:
                return value_checks.check_at_run_time(unwrap_tree(args[0]), frame, branch)
        raise TracedControlFlowError(
            f"{op_name(func)} needs a concrete value, but it got a traced array{where()}.\n"
            "Under jax.jit / jax.grad, Python control flow and shapes cannot depend on tensor "
            "values. Rewrite the branch with torch.where / masking, or compute the value from "
            f"shapes and Python numbers.\n(JAX said: {str(error).splitlines()[0]})"
        ) from None
    except Exception as error:  # a lowering rejected its inputs: say which op, where
        raise LoweringError(
            f"{op_name(func)} failed while lowering to JAX{where()}: {type(error).__name__}: {error}"
        ) from error


def _apply(entry: registry.Lowering, func: Any, args: tuple, kwargs: dict) -> Any:
    kwargs = keyword_aliases.with_torch_names(func, entry.fn, kwargs)
    out_target = None
    if "out" in kwargs:
        kwargs = dict(kwargs)
        out_target = kwargs.pop("out")
    if entry.raw:
        result = entry.fn(*args, **kwargs)
    elif replica_calls.active() and not entry.is_inplace_call(args, kwargs):  # per data-parallel replica, if it can
        result = replica_calls.call(func, entry.fn, unwrap_tree(args), unwrap_tree(kwargs))
    else:
        result = entry.fn(*unwrap_tree(args), **unwrap_tree(kwargs))
    if not (torch.is_grad_enabled() or _NO_GRAD_IGNORED.get()):  # tensors made under no_grad carry no gradient
        result = _map_arrays(jax.lax.stop_gradient, result)
    if entry.is_inplace_call(args, kwargs):
        target = args[0]
        target.set_value(result)
        return target
    if out_target is not None:
        out_target.set_value(result)
        return out_target
    if args and isinstance(args[0], JaxTensor) and isinstance(result, jax.Array) and result is args[0].value:
        return args[0]  # a no-op (``x.float()`` on float, ``x.contiguous()``) returns self, like torch
    wrapped = _map_arrays(wrap, result)
    if args and isinstance(args[0], JaxTensor) and entry.is_view_call(args, kwargs):
        _link_views(entry, args, kwargs, wrapped)
    return wrapped


def _map_arrays(fn: Any, result: Any) -> Any:
    """``fn`` on each jax.Array in a lowering's result (arrays, tuples, lists, torch.return_types)."""
    if isinstance(result, jax.Array):
        return fn(result)
    if isinstance(result, tuple) and hasattr(type(result), "n_fields"):  # torch.return_types.*
        return type(result)(tuple(_map_arrays(fn, r) for r in result))
    if isinstance(result, (tuple, list)):
        return type(result)(_map_arrays(fn, r) for r in result)
    return result


def _link_views(entry: registry.Lowering, args: tuple, kwargs: dict, wrapped: Any) -> None:
    base, rest = args[0], args[1:]
    rest_values, kwarg_values = unwrap_tree(rest), unwrap_tree(kwargs)

    def reader(index):
        def read(base_value):
            out = entry.fn(base_value, *rest_values, **kwarg_values)
            return out if index is None else out[index]

        return read

    if isinstance(wrapped, JaxTensor):
        wrapped.make_view_of(base, reader(None))
    elif isinstance(wrapped, (tuple, list)):
        for i, part in enumerate(wrapped):
            if isinstance(part, JaxTensor):
                part.make_view_of(base, reader(i))


def _not_lowered(func: Any, args: tuple, kwargs: dict) -> Any:
    if func in PASSTHROUGH:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if contains_tensor((args, kwargs), JaxTensor):
        raise unsupported(func)
    had_tensors = contains_tensor((args, kwargs))
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*args, **kwargs)
    if not had_tensors and contains_tensor(out):
        # A factory without a lowering would bake a constant into the program.
        raise unsupported(func)
    return out


def unsupported(func: Any) -> UnsupportedOpError:
    name = op_name(func)
    return UnsupportedOpError(
        f"torch op {name} has no JAX lowering{where()}.\n"
        f"Register one:\n    @jmp.torch_bridge.register_lowering({name})\n"
        "    def my_lowering(*args, **kwargs):  # tensors arrive as jax.Arrays\n"
        "        return ...  # jax.numpy / jax.lax computation"
    )


def unsupported_aten(func: Any) -> None:
    raise UnsupportedOpError(
        f"ATen op {func} was called on a JaxTensor below the torch-function level{where()}; "
        "it has no lowering. Lower the torch function that calls it with "
        "jmp.torch_bridge.register_lowering."
    )


JaxTensor.route_to(dispatch, unsupported_aten)


def op_name(func: Any) -> str:
    name = resolve_name(func)
    if name is None:
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
        module = getattr(func, "__module__", None)
        if module and not name.startswith(module):
            name = f"{module}.{name}"
    return name.removesuffix(".__get__")


_INTERNAL_DIRS = (os.path.dirname(__file__) + os.sep, os.path.dirname(torch.__file__) + os.sep)
_INTERNAL_FILES = {contextlib.__file__, functools.__file__}


def _is_internal(filename: str) -> bool:
    return filename.startswith(_INTERNAL_DIRS) or filename in _INTERNAL_FILES


def user_frame() -> Any:
    """The innermost frame outside the bridge and torch (the model's code), or None."""
    frame = sys._getframe(1)
    while frame is not None and _is_internal(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def where() -> str:
    """' (in module 'a.b' (Type), at file:line: code)' for the innermost user frame."""
    parts = []
    scope_stack = _SCOPE.get()
    if scope_stack:
        path, type_name = scope_stack[-1]
        parts.append(f"in module '{path or '<root>'}' ({type_name})")
    frame = user_frame()
    if frame is not None:
        filename, lineno = frame.f_code.co_filename, frame.f_lineno
        code = linecache.getline(filename, lineno).strip()
        parts.append(f"at {filename}:{lineno}: {code}")
    return f" ({', '.join(parts)})" if parts else ""
