"""Which model a step is tracing, and the converted twin a torch module's calls reach (found by torch path).

Inside a checkpointed region the twins are the region's copies, so lookups never reach an enclosing trace's state.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterable, Iterator

import torch

from jmp.torch_bridge.context_vars import set_within
from jmp.torch_bridge.module import TorchModule, twin_of, walk


@dataclasses.dataclass(frozen=True)
class Trace:
    """A step's trace of one model: torch paths and the twins at them."""

    torch_root: torch.nn.Module
    paths: dict[int, str]  # id(torch module) -> its first torch path
    modules: dict[str, torch.nn.Module]  # torch path -> torch module
    twins: dict[str, TorchModule]  # torch path -> the twin calls reach now


_TRACE: contextvars.ContextVar[Trace | None] = contextvars.ContextVar("jmp_remat_trace", default=None)


@contextlib.contextmanager
def tracing(torch_root: torch.nn.Module, twin_root: TorchModule) -> Iterator[Trace]:
    """Within the block, a step traces the model ``torch_root`` converted as ``twin_root``."""
    modules = dict(torch_root.named_modules(remove_duplicate=False))
    paths: dict[int, str] = {}
    for path, module in modules.items():
        paths.setdefault(id(module), path)
    trace = Trace(torch_root, paths, modules, {twin.torch_path: twin for twin in walk(twin_root)})
    with set_within(_TRACE, trace):
        yield trace


def current() -> Trace | None:
    return _TRACE.get()


@contextlib.contextmanager
def copies(twins: Iterable[TorchModule]) -> Iterator[None]:
    """Within the block, the modules at these twins' paths (and their descendants') are these copies."""
    trace = _TRACE.get()
    if trace is None:
        yield
        return
    overlay = dict(trace.twins)
    for twin in twins:
        overlay.update({copy.torch_path: copy for copy in walk(twin)})
    with set_within(_TRACE, dataclasses.replace(trace, twins=overlay)):
        yield


def twin_for(torch_module: torch.nn.Module) -> TorchModule | None:
    """The twin that ``torch_module``'s calls reach now, or None when it is not part of the traced model."""
    twin = twin_of(torch_module)
    if twin is not None:
        return twin
    trace = _TRACE.get()
    if trace is None or id(torch_module) not in trace.paths:
        return None
    return trace.twins.get(trace.paths[id(torch_module)])


def path_of(torch_module: torch.nn.Module) -> str | None:
    """``torch_module``'s torch path in the traced model (None outside a trace or outside the model)."""
    trace = _TRACE.get()
    return None if trace is None else trace.paths.get(id(torch_module))
