"""Stacked parameter storage: a layer stack's weights kept as one ``[layers, ...]`` array each, so that a step
program takes (and returns the gradient of) one array per stack weight, whatever the depth.

``stacked_groups`` says which parameters stack: per stack and per weight of its first layer, the same weight of
every layer, when all have one shape, dtype and ``PartitionSpec``. Inside a step's trace ``layer_views`` gives
each layer its slice of the stacked array and remembers where each slice came from; when a layer scan stacks the
slices of consecutive layers again (``jmp.stacks.scan``), ``stacked_source`` hands it the stacked array's rows
instead, so the program holds no per-layer stack and no per-layer gradient slice: the slices nothing else reads
are left out of the program by JAX and XLA.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import jax

from jmp.stacks.detection import LayerStack
from jmp.torch_bridge.context_vars import set_within

# id(layer slice) -> (the slice, its stacked array, its row), for the trace under way (and ``converted_row``'s)
_ORIGINS: contextvars.ContextVar[dict[Any, Any] | None] = contextvars.ContextVar("jmp_stacked_origins", default=None)


def stacked_key(container: str, suffix: str) -> str:
    """The stored name of weight ``suffix`` of every layer of ``container`` (never a torch name: ``*`` marks it)."""
    return f"{container}.*.{suffix}"


def stacked_groups(
    stacks: Sequence[LayerStack],
    names: Sequence[str],
    shapes: Mapping[str, tuple[int, ...]],
    dtypes: Mapping[str, Any],
    specs: Mapping[str, Any],
) -> dict[str, tuple[str, ...]]:
    """Stored key -> the torch names it stacks, in layer order: each weight of a stack's first layer with the same
    weight of every other layer, when they all exist (no tied alias) and share shape, dtype and spec."""
    present = set(names)
    groups: dict[str, tuple[str, ...]] = {}
    for stack in stacks:
        first = f"{stack.paths[0]}."
        for name in names:
            if not name.startswith(first):
                continue
            suffix = name[len(first) :]
            members = tuple(f"{path}.{suffix}" for path in stack.paths)
            if all(m in present for m in members) and all(
                (shapes[m], dtypes[m], tuple(specs[m])) == (shapes[name], dtypes[name], tuple(specs[name]))
                for m in members
            ):
                groups[stacked_key(stack.container, suffix)] = members
    return groups


@contextlib.contextmanager
def tracing_views() -> Iterator[None]:
    """The extent of one step trace: slices made by ``layer_views`` inside it are known to ``stacked_source``."""
    with set_within(_ORIGINS, {}):
        yield


def layer_views(stacked: Any) -> list[Any]:
    """The rows of a stacked array, one per layer, each remembered as a row of it (inside ``tracing_views``)."""
    rows = [jax.lax.squeeze(row, (0,)) for row in jax.lax.split(stacked, [1] * stacked.shape[0])]  # one split
    origins = _ORIGINS.get()
    if origins is not None:
        for i, row in enumerate(rows):
            origins[id(row)] = (row, stacked, i)
    return rows


def converted_row(row: Any, convert: Callable[[Any], Any], how: Hashable) -> Any | None:
    """``convert(row)`` (elementwise, named by ``how``) of a layer view ``row``, as that row of ``convert`` of its
    whole stacked array, converted once in this trace: so a scan stacking the converted rows reads one array
    (``stacked_source``); None if ``row`` is no view."""
    origins = _ORIGINS.get()
    found = origins.get(id(row)) if origins else None
    if found is None or found[0] is not row:
        return None
    _, stacked, index = found
    key = (id(stacked), how)  # the converted rows, beside the views' ids in the trace's record
    if key not in origins:
        origins[key] = layer_views(convert(stacked))
    return origins[key][index]


def stacked_source(layers: Sequence[Any]) -> Any | None:
    """The rows of one stacked array that ``layers`` are, as one array (a slice of it, or all of it), when they
    are rows ``start, start + step, ...`` of it (``layer_views``); None otherwise."""
    origins = _ORIGINS.get()
    if not origins:
        return None
    found = [origins.get(id(layer)) for layer in layers]
    if any(f is None or f[0] is not layer for f, layer in zip(found, layers)):
        return None
    sources = {id(f[1]) for f in found}
    if len(sources) != 1:
        return None
    stacked, rows = found[0][1], [f[2] for f in found]
    start = rows[0]
    step = rows[1] - rows[0] if len(rows) > 1 else 1
    if step < 1 or rows != list(range(start, start + step * len(rows), step)):
        return None
    if start == 0 and step == 1 and len(rows) == stacked.shape[0]:
        return stacked
    return jax.lax.slice_in_dim(stacked, start, start + step * (len(rows) - 1) + 1, stride=step)
