"""Marks on torch modules (tensor parallelism, pipeline stage), kept beside them (weakly keyed).

``with marking_created(key, value):`` marks every module constructed inside, as ``smp.tensor_parallelism()``
and ``smp.partition(i)`` do; ``mark(module, key, value)`` marks one afterwards.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from torch import nn

_MARKS: weakref.WeakKeyDictionary[nn.Module, dict[str, Any]] = weakref.WeakKeyDictionary()
_CREATING: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "jmp_marks_for_new_modules", default=MappingProxyType({})
)
_original_init = nn.Module.__init__
_open_blocks = [0]


def mark(module: nn.Module, key: str, value: Any) -> None:
    _MARKS.setdefault(module, {})[key] = value


def mark_of(module: nn.Module, key: str, default: Any = None) -> Any:
    return _MARKS.get(module, {}).get(key, default)


def _marking_init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
    _original_init(self, *args, **kwargs)
    for key, value in _CREATING.get().items():
        mark(self, key, value)


@contextlib.contextmanager
def marking_created(key: str, value: Any) -> Iterator[None]:
    """Modules constructed inside the block get ``key = value`` (an inner block's value wins)."""
    token = _CREATING.set({**_CREATING.get(), key: value})
    if _open_blocks[0] == 0:
        nn.Module.__init__ = _marking_init  # every module's __init__ reaches this through super()
    _open_blocks[0] += 1
    try:
        yield
    finally:
        _open_blocks[0] -= 1
        if _open_blocks[0] == 0:
            nn.Module.__init__ = _original_init
        _CREATING.reset(token)


_TRACED_STAGES: contextvars.ContextVar[Mapping[str, int] | None] = contextvars.ContextVar(
    "jmp_traced_stages", default=None
)


@contextlib.contextmanager
def traced_stages(stages: Mapping[str, int] | None) -> Iterator[None]:
    """While a pipelined forward is traced: the manual stage of each module path (None: automatic cut)."""
    token = _TRACED_STAGES.set(stages)
    try:
        yield
    finally:
        _TRACED_STAGES.reset(token)


def stages_of(paths: Sequence[str]) -> set[int]:
    """The manual stages of the modules at ``paths`` and their submodules in the forward being traced."""
    stages = _TRACED_STAGES.get()
    if not stages:
        return set()
    return {stage for path, stage in stages.items() for p in paths if path == p or path.startswith(p + ".") or not p}
