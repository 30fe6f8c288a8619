"""Calls on parameters run once per data-parallel replica on its own parameter copy, so gradients stay local.

A call qualifies when it is *row-local* along a batch dimension of one of its arrays (``Linear``, a convolution,
an embedding, layer / group / RMS norm, a parameter broadcast in elementwise arithmetic): its result is the
whole call's exactly, and each copy's gradient is its rows' partial sum, reduced once per step
(``jmp.compiled_step.replica_gradients``). Any other call runs on the whole batch.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import torch
import torch.nn.functional as F
from jax.sharding import PartitionSpec

from jmp.torch_bridge.context_vars import set_within

T = torch.Tensor


@dataclasses.dataclass(frozen=True)
class Copies:
    """The copies of the parameters a trace reads: ``copies[id(parameter)]``, [replicas, *shape] split over ``axes``."""

    copies: dict[int, jax.Array]
    held: tuple[jax.Array, ...]  # the parameters themselves, so that their ids stay theirs meanwhile
    mesh: jax.sharding.Mesh
    axes: tuple[str, ...]
    replicas: int
    rows: frozenset[int]  # the microbatch's batch sizes (its split inputs')


_COPIES: contextvars.ContextVar[Copies | None] = contextvars.ContextVar("jmp_replica_copies", default=None)


@contextlib.contextmanager
def reading(
    parameters: Sequence[jax.Array],
    copies: Sequence[jax.Array],
    mesh: jax.sharding.Mesh,
    axes: tuple[str, ...],
    rows: frozenset[int],
) -> Iterator[None]:
    """Within the block, qualifying calls on ``parameters`` run per replica on ``copies`` (one per parameter,
    [replicas, *its shape], split over ``axes``) on a microbatch of ``rows`` rows."""
    replicas = copies[0].shape[0] if copies else 1
    table = Copies({id(p): c for p, c in zip(parameters, copies)}, tuple(parameters), mesh, axes, replicas, rows)
    with set_within(_COPIES, table):
        yield


@contextlib.contextmanager
def bound(parameters: Sequence[jax.Array], copies: Sequence[jax.Array | None]) -> Iterator[None]:
    """Within the block ``parameters`` (a scanned layer's, as its scan body takes them) read ``copies`` (None: none)."""
    table = _COPIES.get()
    if table is None:
        yield
        return
    extra = {id(p): c for p, c in zip(parameters, copies) if c is not None}
    with set_within(
        _COPIES, dataclasses.replace(table, copies={**table.copies, **extra}, held=table.held + tuple(parameters))
    ):
        yield


@contextlib.contextmanager
def maximum_copies(values: Sequence[jax.Array]) -> Iterator[None]:
    """Within ``reading``, ``values`` have one copy per replica whose cotangents combine by maximum, not sum: fp8
    scales, whose cotangent is an amax (``jmp.precision.fp8_matmul``), so per-replica calls get the batch's amax."""
    table = _COPIES.get()
    if table is None:
        yield
        return
    sharding = jax.sharding.NamedSharding(table.mesh, PartitionSpec(table.axes))
    with bound(values, [copied_for_maximum(v, table.replicas, sharding) for v in values]):
        yield


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def copied_for_maximum(value: jax.Array, replicas: int, sharding: jax.sharding.Sharding | None = None) -> jax.Array:
    """``value`` once per replica ([replicas, *shape], laid out as ``sharding``); cotangents combine by maximum."""
    copies = jax.numpy.broadcast_to(value[None], (replicas, *value.shape))
    return copies if sharding is None else jax.lax.with_sharding_constraint(copies, sharding)


def _copied_forward(value, replicas, sharding):
    return copied_for_maximum(value, replicas, sharding), None


def _copied_backward(replicas, sharding, _, cotangents):
    return (cotangents.max(axis=0),)


copied_for_maximum.defvjp(_copied_forward, _copied_backward)


def rebound(outer: Sequence[jax.Array], inner: Sequence[jax.Array]) -> contextlib.AbstractContextManager:
    """Within the block, ``inner`` (``outer`` as a traced sub-function takes them) read the copies of ``outer``."""
    return bound(inner, copies_of(outer))


def copies_of(parameters: Sequence[Any]) -> list[jax.Array | None]:
    """The copies of ``parameters`` (None for one without; all None outside ``reading``)."""
    table = _COPIES.get()
    known = table.copies if table is not None else {}
    return [known.get(id(p)) if isinstance(p, jax.Array) else None for p in parameters]


def copy_spec(spec: PartitionSpec) -> PartitionSpec:
    """The spec of copies of a parameter split by ``spec``: the replica axis first."""
    table = _COPIES.get()
    return PartitionSpec(table.axes if table is not None else None, *spec)


def active() -> bool:
    return _COPIES.get() is not None


# --- which calls are row-local, in which argument and along which of its dimensions ------------------------------

Rows = tuple[int, tuple[int, ...]] | None  # (the argument, its dimensions whose entries the result's follow)


def _all_dims(args, kwargs) -> Rows:
    """An embedding lookup: every dimension of the ids."""
    return 0, tuple(range(_ndim(args[0])))


def _leading(args, kwargs) -> Rows:
    """``Linear`` / ``matmul``: every dimension but the last of an input with at least two (the last is features)."""
    if _ndim(args[0]) < 2 or (len(args) > 1 and _ndim(args[1]) > 2):
        return None
    return 0, tuple(range(_ndim(args[0]) - 1))


def _convolved(args, kwargs) -> Rows:
    """A convolution's batch: the input has the weight's rank (an unbatched input does not)."""
    weight = args[1] if len(args) > 1 else kwargs.get("weight")
    return (0, (0,)) if weight is not None and _ndim(args[0]) == _ndim(weight) else None


def _normalized(args, kwargs) -> Rows:
    shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape")
    count = len(shape) if isinstance(shape, (tuple, list, torch.Size)) else 1
    return (0, tuple(range(_ndim(args[0]) - count))) if _ndim(args[0]) > count else None


def _grouped(args, kwargs) -> Rows:
    return (0, (0,)) if _ndim(args[0]) >= 2 else None


def _addmm(args, kwargs) -> Rows:
    """``addmm(bias, rows, weight)`` (Hugging Face's ``Conv1D``): rows of ``mat1``, a bias broadcast over them."""
    if len(args) < 3 or _ndim(args[1]) != 2:
        return None
    return (1, (0,)) if _ndim(args[0]) <= 1 or args[0].shape[0] == 1 else None


def _broadcast_operand(args, kwargs) -> Rows:
    """``x op p`` / ``p op x``: the dimensions of ``x`` along which ``p`` (the parameter) is broadcast."""
    if len(args) < 2:
        return None
    for rows, other in ((0, 1), (1, 0)):
        x, p = args[rows], args[other]
        if _parameter(p) and not _parameter(x) and isinstance(x, jax.Array) and p.ndim <= x.ndim:
            offset = x.ndim - p.ndim
            dims = tuple(d for d in range(x.ndim) if d < offset or p.shape[d - offset] == 1)
            return (rows, dims) if dims else None
    return None


_RULES: dict[Any, Callable[[tuple, dict], Rows]] = {
    F.linear: _leading,
    torch.matmul: _leading,
    T.matmul: _leading,
    T.__matmul__: _leading,
    torch.mm: _leading,
    T.mm: _leading,
    torch.addmm: _addmm,
    T.addmm: _addmm,
    F.embedding: _all_dims,
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
    """``fn(*args, **kwargs)`` (``func``'s lowering): per replica when ``func`` is row-local in one argument along a
    batch dimension and its other arrays are parameters with copies; else as it is."""
    table = _COPIES.get()
    rule = _RULES.get(func) if table is not None else None
    found = rule(args, kwargs) if rule is not None else None
    context = jax.sharding.get_abstract_mesh()
    if found is None or set(table.axes) & set(context.manual_axes):
        return fn(*args, **kwargs)
    x = args[found[0]]
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    row_leaf = next(i for i, leaf in enumerate(leaves) if leaf is x)
    arrays = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array) and i != row_leaf]
    dim = _batch_dim(x, found[1], table)
    if dim is None or not arrays or _parameter(x) or any(id(leaves[i]) not in table.copies for i in arrays):
        return fn(*args, **kwargs)

    def per_replica(x_rows, *copies):
        local = list(leaves)
        local[row_leaf] = x_rows
        for i, copy in zip(arrays, copies):
            local[i] = copy[0]
        call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, local)
        return fn(*call_args, **call_kwargs)

    rows = PartitionSpec(*([None] * dim), table.axes)
    run = jax.shard_map(
        per_replica,
        # inside a pipeline's shard_map (pp manual) the call's mesh is the one its types name
        mesh=context if context.manual_axes else table.mesh,
        in_specs=(rows,) + (PartitionSpec(table.axes),) * len(arrays),
        out_specs=rows,
        axis_names=frozenset(table.axes),
    )
    return run(x, *(table.copies[id(leaves[i])] for i in arrays))


def _batch_dim(x: Any, dims: tuple[int, ...], table: Copies) -> int | None:
    """Which of ``x``'s row-local ``dims`` to split over the replicas: one as long as the microbatch (no rows move),
    else the first that is a multiple of it (``x.view(-1, d)``); None when neither divides over the replicas."""
    if not isinstance(x, jax.Array):
        return None
    for dim in dims:
        if x.shape[dim] in table.rows and x.shape[dim] % table.replicas == 0:
            return dim
    if dims and dims[0] == 0 and x.ndim and x.shape[0] % table.replicas == 0:
        if any(x.shape[0] % rows == 0 for rows in table.rows):
            return 0
    return None
