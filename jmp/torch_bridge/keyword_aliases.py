"""Torch's NumPy-style keyword aliases (``axis``, ``keepdims``, ...) renamed before lowering, where torch takes them."""

from __future__ import annotations

import inspect
from typing import Any

# NumPy's name -> torch's, as torch's argument parser maps them.
TORCH_NAME = {"axis": "dim", "keepdims": "keepdim", "x": "input", "a": "input", "x1": "input", "x2": "other"}


def takes_numpy_aliases(func: Any) -> bool:
    """Whether torch parses ``func``'s arguments in C++, where the aliases apply (builtins and method descriptors)."""
    return not (inspect.isfunction(func) or inspect.ismethod(func))


def with_torch_names(func: Any, lowering: Any, kwargs: dict) -> dict:
    """``kwargs`` with the NumPy aliases torch accepts on ``func`` renamed, unless the lowering takes them."""
    if not kwargs or not any(name in TORCH_NAME for name in kwargs) or not takes_numpy_aliases(func):
        return kwargs
    accepted = _parameter_names(lowering)
    renamed = {}
    for name, value in kwargs.items():
        torch_name = TORCH_NAME.get(name)
        if torch_name is not None and name not in accepted and torch_name not in kwargs:
            renamed[torch_name] = value
        else:
            renamed[name] = value
    return renamed


_NAMES: dict[Any, frozenset] = {}


def _parameter_names(fn: Any) -> frozenset:
    if fn not in _NAMES:
        try:
            parameters = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            parameters = ()
        _NAMES[fn] = frozenset(p.name for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD)
    return _NAMES[fn]
