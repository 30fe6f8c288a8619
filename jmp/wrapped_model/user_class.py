"""The wrapped model is the module: a ``DistributedModel`` takes a subclass of the user's module class.

As PyTorch's FSDP2 ``fully_shard`` does, ``smp.DistributedModel(module)`` swaps the new instance's class for one made
once per user class, ``Distributed<Name>(DistributedModel, Name)``, whose user methods run with ``self`` the
distributed model; what scripts get from it: docs/training.md. What cannot follow the distributed model is said at
the call, not refused in advance: a user method that changes the wrapped module's tensors' names, shapes or dtypes
raises ``ConfigError`` when it returns (one that replaces a tensor by one of the same shape has the new values
loaded), and the methods of torch's own classes (``nn.Sequential``'s ``__getitem__``, ...) read the instance's
``_modules``, which on the distributed model hold the wrapped module itself: they run on the wrapped module.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from jmp.errors import ConfigError
from jmp.runtime import notices

_CLASSES: dict[tuple[type, type], type] = {}
_KEEP = frozenset({"__init__", "__new__", "__init_subclass__", "__class_getitem__", "__subclasshook__"})
# DistributedModel names that run the module's own when it has one (jmp.eager's generate): not hidden
_DEFERS = frozenset({"generate"})


def adopt(model: Any, base: type) -> None:
    """Give ``model`` (a ``base`` instance, built) the class ``Distributed<Name>(base, Name)`` of its module's
    class; with no such class possible (a metaclass or layout conflict), it stays a ``base``, said once."""
    user = type(model.torch_module)
    try:
        cls = _CLASSES.get((base, user)) or _make(base, user)
        model.__class__ = cls
    except TypeError as error:
        notices.warn_once(
            f"user-class:{user.__qualname__}",
            "smp.DistributedModel(%s): the model cannot take a subclass of %s (%s), so %s's own methods are "
            "reachable as model.module.<method>() only and isinstance(model, %s) is False",
            user.__name__,
            user.__name__,
            error,
            user.__name__,
            user.__name__,
        )
        return
    for name in vars(model):  # the model's own records win over a user property of the same name
        owner = next((c for c in cls.__mro__ if name in vars(c)), None)
        if owner is not None and owner not in base.__mro__ and _is_data_descriptor(vars(owner)[name]):
            setattr(cls, name, _Record(name))


def _make(base: type, user: type) -> type:
    user_classes = [c for c in user.__mro__ if c not in nn.Module.__mro__]
    own = {n for c in base.__mro__ if c not in nn.Module.__mro__ for n in vars(c)}  # DistributedModel's: they win
    namespace: dict[str, Any] = {"__module__": user.__module__, "__qualname__": f"Distributed{user.__qualname__}"}
    hidden = []
    for name in dict.fromkeys(n for c in user_classes for n in vars(c)):
        owner = next(c for c in user_classes if name in vars(c))
        value = vars(owner)[name]
        if name in own:
            if not hasattr(nn.Module, name) and not _is_dunder(name) and name not in _DEFERS:
                hidden.append(name)
            continue
        if not inspect.isfunction(value) or name in _KEEP:
            continue
        if owner.__module__.startswith("torch."):  # torch's classes read their own _modules: run on the module
            namespace[name] = _checked(_on_module(value), owner, name)
        elif not _is_dunder(name):
            namespace[name] = _checked(value, owner, name)
    if hidden:
        notices.info_once(
            f"user-class-hidden:{user.__qualname__}",
            "smp.DistributedModel(%s): model.%s %s DistributedModel's; the %s's own is model.module.<name>",
            user.__name__,
            ", model.".join(hidden),
            "is" if len(hidden) == 1 else "are",
            user.__name__,
        )
    cls = type(base)(f"Distributed{user.__name__}", (base, user), namespace)
    _CLASSES[(base, user)] = cls
    return cls


def _on_module(function: Any) -> Any:
    @functools.wraps(function)
    def on_module(self: Any, *args: Any, **kwargs: Any) -> Any:
        return function(self.current_module, *args, **kwargs)

    return on_module


def _checked(function: Any, owner: type, name: str) -> Any:
    """``function`` as a method of the distributed model that says, when it returns, if it changed the wrapped
    module's tensors in a way the model cannot follow."""

    @functools.wraps(function)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = _tensors(self.torch_module)
        result = function(self, *args, **kwargs)
        after = _tensors(self.torch_module)
        if after != before:
            _follow(self, before, after, f"{owner.__name__}.{name}()")
        return result

    return method


def _tensors(module: nn.Module) -> dict[str, tuple[int, tuple[int, ...], torch.dtype]]:
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return {name: (id(tensor), tuple(tensor.shape), tensor.dtype) for name, tensor in tensors}


def _follow(model: Any, before: dict, after: dict, call: str) -> None:
    """Load the tensors ``call`` replaced by ones of the same shape and dtype; refuse any other change."""
    changes = [f"{n} added {after[n][1]}" for n in after if n not in before]
    changes += [f"{n} removed" for n in before if n not in after]
    changes += [
        f"{n}: {before[n][1]} {before[n][2]} -> {after[n][1]} {after[n][2]}"
        for n in before
        if n in after and before[n][1:] != after[n][1:]
    ]
    if changes:
        shown = "; ".join(changes[:4]) + ("; ..." if len(changes) > 4 else "")
        raise ConfigError(
            f"{call} changed the tensors of the wrapped {type(model.torch_module).__name__} ({shown}) on the "
            "distributed model, which is laid out for the tensors it was built with: the change reached "
            "model.module only. Call it on the module before wrapping it (module.<method>(...); "
            "model = smp.DistributedModel(module)), then build the optimizer."
        )
    state = model.torch_module.state_dict()
    replaced = {n: state[n] for n in after if after[n][0] != before[n][0] and n in state}
    if replaced:
        model.load_state_dict(replaced, strict=False)


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _is_data_descriptor(value: Any) -> bool:
    return hasattr(type(value), "__set__") or hasattr(type(value), "__delete__")


class _Record:
    """A name the model keeps in its own ``__dict__`` (one of its records), over a user property of that name."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, instance: Any, owner: type) -> Any:
        if instance is None:
            return self
        try:
            return instance.__dict__[self.name]
        except KeyError:
            raise AttributeError(self.name) from None

    def __set__(self, instance: Any, value: Any) -> None:
        instance.__dict__[self.name] = value

    def __delete__(self, instance: Any) -> None:
        instance.__dict__.pop(self.name, None)
