"""The lowering table: torch callable -> JAX function taking arrays, with flags for in-place and view results."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class Lowering:
    fn: Callable[..., Any]
    inplace: bool = False
    inplace_flag: str | None = None
    view: bool | Callable[[tuple, dict], bool] = False
    raw: bool = False  # receives JaxTensors (to update arguments in place itself)

    def is_inplace_call(self, args: tuple, kwargs: dict) -> bool:
        if self.inplace:
            return True
        if self.inplace_flag is None:
            return False
        bound = _signature(self.fn).bind_partial(*args, **kwargs)
        return bool(bound.arguments.get(self.inplace_flag, False))

    def is_view_call(self, args: tuple, kwargs: dict) -> bool:
        return self.view(args, kwargs) if callable(self.view) else self.view


LOWERINGS: dict[Any, Lowering] = {}
_SITES: dict[Any, str] = {}  # torch callable -> "file:line" of the registration that made its lowering
_SIGNATURES: dict[Callable, inspect.Signature] = {}


def _signature(fn: Callable) -> inspect.Signature:
    if fn not in _SIGNATURES:
        _SIGNATURES[fn] = inspect.signature(fn)
    return _SIGNATURES[fn]


def register_lowering(
    *torch_fns: Any,
    inplace: tuple = (),
    inplace_flag: str | None = None,
    view: bool | Callable[[tuple, dict], bool] = False,
    raw: bool = False,
    replace: bool = False,
) -> Callable:
    """Decorator: lower each of ``torch_fns`` (and in-place ``inplace`` variants) to the function.

    The function takes the call's arguments with tensors as ``jax.Array``s (the bridge's tensors with ``raw``)
    and returns arrays, tuples of them or Python values. Users extend the bridge the same way::

        @jmp.torch_bridge.register_lowering(torch.special.erfcx)
        def erfcx(input):
            return jax.scipy.special.erfcx(input)

    ``torch_fns`` may name a custom op as "namespace::name" before it is loaded; None entries are skipped.
    ``inplace_flag`` names a boolean argument that makes the call in place; ``view`` (bool or predicate on
    ``(args, kwargs)``) marks a result aliasing the first argument. Registering a callable again warns unless
    ``replace=True``. A lowering that raises is reported as a ``LoweringError`` naming the op and call site.
    """

    site = _caller_site()

    def decorate(fn: Callable) -> Callable:
        entries = [(f, Lowering(fn, inplace_flag=inplace_flag, view=view, raw=raw)) for f in torch_fns]
        entries += [(f, Lowering(fn, inplace=True)) for f in inplace]
        this_call: set = set()  # one call may name a callable twice through an alias (F.relu_ is torch.relu_)
        for torch_fn, entry in entries:
            if torch_fn is None:
                continue
            if torch_fn in LOWERINGS and torch_fn not in this_call and not replace:
                _warn_replaced(torch_fn, site)
            LOWERINGS[torch_fn] = entry
            _SITES[torch_fn] = site
            this_call.add(torch_fn)
        return fn

    return decorate


def _warn_replaced(torch_fn: Any, site: str) -> None:
    message = (
        f"{_describe(torch_fn)} already has a lowering, registered at {_SITES.get(torch_fn, '<unknown>')}; "
        f"the registration at {site} replaces it (pass replace=True to register_lowering if that is meant)"
    )
    warnings.warn(message, stacklevel=3)


def _caller_site() -> str:
    """``file:line`` of the code that called ``register_lowering``."""
    frame = inspect.currentframe()
    caller = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
    return "<unknown>" if caller is None else f"{caller.f_code.co_filename}:{caller.f_lineno}"


def _describe(torch_fn: Any) -> str:
    if isinstance(torch_fn, str):
        return repr(torch_fn)
    name = getattr(torch_fn, "__qualname__", None) or getattr(torch_fn, "__name__", None)
    module = getattr(torch_fn, "__module__", None)
    return f"{module}.{name}" if module and name else repr(torch_fn)


def lookup(torch_fn: Any) -> Lowering | None:
    """The lowering of a torch callable; custom ops (``torch.ops.ns.name``) also match "ns::name"."""
    entry = LOWERINGS.get(torch_fn)
    if entry is None and isinstance(torch_fn, torch._ops.OpOverload):
        torch_fn = torch_fn.overloadpacket
        entry = LOWERINGS.get(torch_fn)
    if entry is None and isinstance(torch_fn, torch._ops.OpOverloadPacket):
        entry = LOWERINGS.get(torch_fn._qualified_op_name)
    return entry


def method(name: str) -> Any:
    """``torch.Tensor.<name>`` if this torch build has it (None otherwise, which registration skips)."""
    return getattr(torch.Tensor, name, None)


def getter(name: str) -> Any:
    """The function torch reports for reading the ``torch.Tensor.<name>`` property."""
    prop = getattr(torch.Tensor, name, None)
    return None if prop is None else prop.__get__
