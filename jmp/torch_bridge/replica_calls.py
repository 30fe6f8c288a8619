"""Calls on parameters run once per data-parallel replica, each on its own copy of the parameters, so that their
gradients stay on the replica (``jmp.compiled_step.replica_gradients`` reduces them once per step).

A call qualifies when it is *row-local* in one of its arrays: each row (first-axis entry) of its result depends
only on the same row of that array and on parameters. ``Linear``, a convolution over a batch, an embedding lookup,
a layer / group / RMS norm, and a parameter added to, subtracted from, multiplying or dividing an array it
broadcasts along that array's rows are. Running such a call on a block of rows with an identical copy of the
parameters gives those rows of the result exactly, so the result is the whole call's; what changes is the
gradient: each replica's copy receives the gradient of its rows only, a partial sum that needs no communication
until the step adds the replicas'. Any other call (batch norm's statistics, a reduction over the batch, a
parameter read through a view) runs as before, on the whole batch.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import torch
import torch.nn.functional as F
from jax.sharding import PartitionSpec

T = torch.Tensor


@dataclasses.dataclass(frozen=True)
class Copies:
    """The copies of the parameters a trace reads: ``copies[id(parameter)]`` is [replicas, *shape], split over
    ``axes`` of ``mesh``."""

    copies: dict[int, jax.Array]
    held: tuple[jax.Array, ...]  # the parameters themselves, so that their ids stay theirs meanwhile
    mesh: jax.sharding.Mesh
    axes: tuple[str, ...]
    replicas: int


_COPIES: contextvars.ContextVar[Copies | None] = contextvars.ContextVar("jmp_replica_copies", default=None)


@contextlib.contextmanager
def reading(
    parameters: Sequence[jax.Array], copies: Sequence[jax.Array], mesh: jax.sharding.Mesh, axes: tuple[str, ...]
) -> Iterator[None]:
    """Within the block, qualifying calls on ``parameters`` run per replica on ``copies`` (one per parameter,
    [replicas, *its shape], split over ``axes``)."""
    replicas = copies[0].shape[0] if copies else 1
    table = Copies({id(p): c for p, c in zip(parameters, copies)}, tuple(parameters), mesh, axes, replicas)
    token = _COPIES.set(table)
    try:
        yield
    finally:
        _COPIES.reset(token)


@contextlib.contextmanager
def rebound(outer: Sequence[jax.Array], inner: Sequence[jax.Array]) -> Iterator[None]:
    """Within the block ``inner``, the parameters ``outer`` as a traced sub-function (an activation checkpoint) takes
    them, read the copies of ``outer``."""
    table = _COPIES.get()
    if table is None:
        yield
        return
    extra = {id(i): table.copies[id(o)] for o, i in zip(outer, inner) if id(o) in table.copies}
    token = _COPIES.set(dataclasses.replace(table, copies={**table.copies, **extra}, held=table.held + tuple(inner)))
    try:
        yield
    finally:
        _COPIES.reset(token)


def active() -> bool:
    return _COPIES.get() is not None


# --- which calls are row-local, and in which argument -------------------------------------------------------


def _first(args, kwargs) -> int | None:
    return 0


def _batched_first(args, kwargs) -> int | None:
    """``Linear`` / ``matmul``: rows are the first axis of an input with at least two (a vector's entries are
    its features)."""
    return 0 if _ndim(args[0]) >= 2 and (len(args) < 2 or _ndim(args[1]) <= 2) else None


def _convolved(args, kwargs) -> int | None:
    """A convolution's rows are its batch: the input has the weight's rank (an unbatched input does not)."""
    weight = args[1] if len(args) > 1 else kwargs.get("weight")
    return 0 if weight is not None and _ndim(args[0]) == _ndim(weight) else None


def _normalized(args, kwargs) -> int | None:
    shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape")
    count = len(shape) if isinstance(shape, (tuple, list, torch.Size)) else 1
    return 0 if _ndim(args[0]) > count else None


def _grouped(args, kwargs) -> int | None:
    return 0 if _ndim(args[0]) >= 2 else None


def _addmm(args, kwargs) -> int | None:
    """``addmm(bias, rows, weight)`` (Hugging Face's ``Conv1D``): rows of ``mat1``, a bias broadcast over them."""
    if len(args) < 3 or _ndim(args[1]) != 2:
        return None
    return 1 if _ndim(args[0]) <= 1 or args[0].shape[0] == 1 else None


def _broadcast_operand(args, kwargs) -> int | None:
    """``x op p`` / ``p op x``: rows of ``x``, with ``p`` (the parameter) broadcast along them."""
    if len(args) < 2:
        return None
    for rows, other in ((0, 1), (1, 0)):
        x, p = args[rows], args[other]
        if _parameter(p) and not _parameter(x) and isinstance(x, jax.Array) and x.ndim >= 1:
            if p.ndim < x.ndim or (p.ndim == x.ndim and p.shape[0] == 1):
                return rows
    return None


_RULES: dict[Any, Callable[[tuple, dict], int | None]] = {
    F.linear: _batched_first,
    torch.matmul: _batched_first,
    T.matmul: _batched_first,
    T.__matmul__: _batched_first,
    torch.mm: _batched_first,
    T.mm: _batched_first,
    torch.addmm: _addmm,
    T.addmm: _addmm,
    F.embedding: _first,
    F.layer_norm: _normalized,
    torch.layer_norm: _normalized,
    F.rms_norm: _normalized,
    F.group_norm: _grouped,
    torch.group_norm: _grouped,
    **dict.fromkeys((F.conv1d, F.conv2d, F.conv3d, torch.conv1d, torch.conv2d, torch.conv3d), _convolved),
    **dict.fromkeys(
        (
            torch.add,
            T.add,
            T.__add__,
            T.__radd__,
            torch.sub,
            T.sub,
            T.__sub__,
            torch.mul,
            T.mul,
            T.__mul__,
            T.__rmul__,
            torch.div,
            T.div,
            T.__truediv__,
        ),
        _broadcast_operand,
    ),
}


def _ndim(value: Any) -> int:
    return value.ndim if isinstance(value, jax.Array) else 0


def _parameter(value: Any) -> bool:
    table = _COPIES.get()
    return isinstance(value, jax.Array) and table is not None and id(value) in table.copies


def call(func: Any, fn: Callable, args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` (a lowering of ``func`` on arrays): per replica when ``func`` is row-local in one
    argument and every other array it takes is a parameter with copies; as it is otherwise."""
    table = _COPIES.get()
    rule = _RULES.get(func) if table is not None else None
    rows = rule(args, kwargs) if rule is not None else None
    x = args[rows] if rows is not None else None
    if not isinstance(x, jax.Array) or x.ndim == 0 or jax.sharding.get_abstract_mesh().manual_axes:
        return fn(*args, **kwargs)
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    row_leaf = next(i for i, leaf in enumerate(leaves) if leaf is x)
    arrays = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array) and i != row_leaf]
    if (
        not arrays
        or any(id(leaves[i]) not in table.copies for i in arrays)
        or _parameter(x)
        or x.shape[0] % table.replicas
    ):
        return fn(*args, **kwargs)

    def per_replica(x_rows, *copies):
        local = list(leaves)
        local[row_leaf] = x_rows
        for i, copy in zip(arrays, copies):
            local[i] = copy[0]
        call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, local)
        return fn(*call_args, **call_kwargs)

    split = PartitionSpec(table.axes)
    run = jax.shard_map(
        per_replica,
        mesh=table.mesh,
        in_specs=(split,) * (1 + len(arrays)),
        out_specs=split,
        axis_names=frozenset(table.axes),
    )
    return run(x, *(table.copies[id(leaves[i])] for i in arrays))
