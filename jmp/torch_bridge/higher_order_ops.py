"""Torch's higher-order ops (``torch.cond``, ``while_loop``, ``scan``, ``associative_scan``, ``map``, ``vmap``) lowered.

Below the torch-function protocol their eager fallbacks call ATen directly; while a session runs, each is
replaced at every import path by a router that sends calls made inside the session to the dispatcher
(``lowering/control_flow.py``; for ``vmap``, its ``vmap_impl``: ``lowering/vmap.py``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

# (module whose global the router replaces, name); the package torch._higher_order_ops re-exports the control
# flow ops under the same names; torch.vmap's wrapper looks vmap_impl up in torch._functorch.apis
_DEFINED_IN = (
    ("torch._higher_order_ops.cond", "cond"),
    ("torch._higher_order_ops.while_loop", "while_loop"),
    ("torch._higher_order_ops.scan", "scan"),
    ("torch._higher_order_ops.associative_scan", "associative_scan"),
    ("torch._higher_order_ops.map", "map"),
    ("torch._functorch.apis", "vmap_impl"),
)


def _load() -> dict[str, Callable]:
    functions = {}
    for module_name, name in _DEFINED_IN:
        try:
            functions[name] = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):  # not in this torch build
            continue
    return functions


FUNCTIONS: dict[str, Callable] = _load()


def replacements(route: Callable[[Callable], Callable]) -> list[tuple[Any, str, Any]]:
    """(target, name, router) for every place torch offers a higher-order op; ``route(original)`` makes the router."""
    package = importlib.import_module("torch._higher_order_ops")
    triples = []
    for module_name, name in _DEFINED_IN:
        original = FUNCTIONS.get(name)
        if original is None:
            continue
        router = route(original)
        for target in (importlib.import_module(module_name), package, torch):
            if vars(target).get(name) is original:
                triples.append((target, name, router))
    return triples
