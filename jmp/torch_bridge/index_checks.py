"""Out-of-range indices raise as PyTorch raises them, not a silent nan or zero loss (JAX fills or clamps them).

``F.embedding`` and the class targets of ``F.cross_entropy`` / ``F.nll_loss`` check where they read: on concrete
values at once; inside a step, the largest offending index is a side output (``side_outputs.sow``) handed to the
step's outputs as ``Pending``, so reading the step's values (or the next step call) raises torch's error naming
the module, with no added host sync. ``JMP_INDEX_CHECKS=0`` turns the checks off.
"""

from __future__ import annotations

import dataclasses
import math
import os
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F

from jmp.torch_bridge import side_outputs

PREFIX = "index_check"  # side outputs under this name's prefix are checks, not values a user reads
NONE_BAD = np.iinfo(np.int32).min  # the largest offending index when none is (the "max" reduction's identity)
# side output name -> (torch's exception type, its message with "{index}" for the offending index, where)
_MESSAGES: dict[str, tuple[type[Exception], str, str]] = {}


def enabled() -> bool:
    return os.environ.get("JMP_INDEX_CHECKS", "1") != "0"


def check(
    indices: Any,
    low: int,
    high: int,
    message: str,
    where: str,
    ignore_index: int | None = None,
    error: type[Exception] = IndexError,
) -> None:
    """Raise ``error(message)`` (``{index}``: the offending index, ``where``: the module) for an entry of ``indices``
    outside ``[low, high)`` and not ``ignore_index``: now if concrete, else when the step's values are read."""
    if not enabled() or indices is None:
        return
    collected = side_outputs.in_collecting_trace()
    if isinstance(indices, jax.core.Tracer):
        if not collected:  # no step collecting it, or in a transform's body: unchecked
            return
    elif not collected:  # concrete values outside a step: checked now, in numpy (nothing staged into a trace)
        values = np.asarray(indices)
        if np.issubdtype(values.dtype, np.integer) and values.size:
            bad = _bad(values, low, high, ignore_index)
            if bad.any():
                raise error(message.format(index=int(values[bad].max())) + where)
        return
    indices = jnp.asarray(indices)
    if not jnp.issubdtype(indices.dtype, jnp.integer) or indices.size == 0:
        return
    largest = _largest_by_block(jnp.where(_bad(indices, low, high, ignore_index), indices.astype(jnp.int32), NONE_BAD))
    name = f"{PREFIX}{where}: {message}"
    _MESSAGES[name] = (error, message, where)
    side_outputs.sow(name, largest, reduce="max")


def _largest_by_block(marked: jax.Array) -> jax.Array:
    """The largest of ``marked`` in each of ``jax.device_count()`` blocks of its leading axis (a name's sows all
    have this shape): split over devices along that axis, as a batch is, no collective computes it. A scalar
    maximum is an all-reduce, which XLA:CPU runs beside a layer scan's collectives: GPT-2 at tp2 x fsdp4 hung in
    5 of 10 runs of ``benchmarks.estimate_peak``'s worker with it, 0 of 8 without."""
    devices = jax.device_count()
    if marked.ndim == 0:
        return jnp.broadcast_to(marked, (devices,))
    rows = jnp.max(marked.reshape(marked.shape[0], -1), axis=1)
    blocks = math.gcd(rows.shape[0], devices)  # a multiple of the shards of the leading axis
    return jnp.repeat(jnp.max(rows.reshape(blocks, -1), axis=1), devices // blocks)


def _bad(indices: Any, low: int, high: int, ignore_index: int | None) -> Any:
    bad = (indices < low) | (indices >= high)
    return bad if ignore_index is None else bad & (indices != ignore_index)


# --- the torch functions checked, by their arguments (the dispatcher calls these before the lowering) ----------
# The messages are torch 2.13's on CPU.

_IN_SELF = "index out of range in self"
_TARGET = "Target {index} is out of bounds."
_DIMENSION = "index {index} is out of bounds for dimension {dim} with size {size}"


def _embedding(where: str, input: Any, weight: Any, *args: Any, **kwargs: Any) -> None:
    if jnp.ndim(weight):  # else the lowering's error
        check(input, 0, jnp.shape(weight)[0], _IN_SELF, where)


def _target(where: str, input: Any, target: Any, weight: Any = None, *args: Any, **kwargs: Any) -> None:
    ignore_index = kwargs.get("ignore_index", args[1] if len(args) > 1 else -100)
    if jnp.ndim(input) == 0 or jnp.issubdtype(jnp.asarray(target).dtype, jnp.floating):  # probabilities: no index
        return
    classes = jnp.shape(input)[1 if jnp.ndim(input) > 1 else 0]
    check(target, 0, classes, _TARGET, where, ignore_index)


def _index_select(where: str, input: Any, dim: int, index: Any) -> None:
    ndim = max(jnp.ndim(input), 1)
    dim = dim % ndim
    size = jnp.shape(input)[dim] if jnp.ndim(input) else 1
    if dim == 0:
        check(index, 0, size, _IN_SELF, where)
    else:
        message = f"INDICES element is out of DATA bounds, id={{index}} axis_dim={size}"
        check(index, 0, size, message, where, error=RuntimeError)


def _gather(where: str, input: Any, dim: int, index: Any, **kwargs: Any) -> None:
    if jnp.ndim(input) == 0:
        return
    dim = dim % jnp.ndim(input)
    size = jnp.shape(input)[dim]
    check(index, 0, size, _DIMENSION.format(index="{index}", dim=dim, size=size), where, error=RuntimeError)


def _take(where: str, input: Any, index: Any) -> None:
    size = int(np.prod(jnp.shape(input)))
    message = f"out of range: tried to access index {{index}} on a tensor of {size} elements."
    check(index, -size, size, message, where)


def _one_hot(where: str, tensor: Any, num_classes: int = -1) -> None:
    big = np.iinfo(np.int32).max
    check(tensor, 0, big, "Class values must be non-negative.", where, error=RuntimeError)
    if num_classes >= 0:
        check(tensor, -big, num_classes, "Class values must be smaller than num_classes.", where, error=RuntimeError)


def _getitem(where: str, input: Any, index: Any) -> None:
    """``x[i]``: each integer tensor or list in the index, against the dimension it indexes (torch numbers the
    dimension among the tensor indices)."""
    parts = index if isinstance(index, tuple) else (index,)
    consumed = sum(_dims_taken(part) for part in parts if part is not None and part is not Ellipsis)
    dim, tensors = 0, 0
    for part in parts:
        if part is Ellipsis:
            dim += jnp.ndim(input) - consumed
            continue
        if part is None:
            continue
        if isinstance(part, (list, jax.Array, np.ndarray)) and dim < jnp.ndim(input):
            part = np.asarray(part) if isinstance(part, list) else part  # a list: concrete, nothing staged
            if np.issubdtype(part.dtype, np.integer):
                size = jnp.shape(input)[dim]
                check(part, -size, size, _DIMENSION.format(index="{index}", dim=tensors, size=size), where)
                tensors += 1
        dim += _dims_taken(part)


def _dims_taken(part: Any) -> int:
    if isinstance(part, (jax.Array, np.ndarray)) and part.dtype == np.bool_:
        return part.ndim
    return 1


CHECKED: dict[Any, Callable[..., None]] = {
    F.embedding: _embedding,
    F.cross_entropy: _target,
    F.nll_loss: _target,
    torch.index_select: _index_select,
    torch.Tensor.index_select: _index_select,
    torch.gather: _gather,
    torch.Tensor.gather: _gather,
    torch.take: _take,
    torch.Tensor.take: _take,
    F.one_hot: _one_hot,
    torch.Tensor.__getitem__: _getitem,
}


def run(checked: Callable[..., None], where: str, args: tuple, kwargs: dict) -> None:
    """The dispatcher's call of a check (arguments the check cannot bind are the lowering's to reject)."""
    try:
        checked(where, *args, **kwargs)
    except TypeError:
        return


def embedding_check(input: Any, num_embeddings: int, where: str) -> None:
    """The check of an ``nn.Embedding`` layer's call (the layer runs its lookup without the dispatcher)."""
    check(input, 0, num_embeddings, _IN_SELF, where)


# --- the step's side -----------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Pending:
    """One step's index checks, read when one of its values is (``raise_if_failed``)."""

    largest: dict[str, jax.Array]  # side output name -> the largest offending index, NONE_BAD when none
    unread: list[Pending]  # the list of its owner's unread checks it is on until read
    read: bool = False

    def is_ready(self) -> bool:
        return all(value.is_ready() for value in self.largest.values())

    def raise_if_failed(self, later: bool = False) -> None:
        """Raise the torch error of the first failed check (``later``: found at a later step call)."""
        if self.read:
            return
        values = [_local_largest(value) for value in self.largest.values()]
        self.read = True
        if self in self.unread:
            self.unread.remove(self)
        for name, value in zip(self.largest, values):
            if value != NONE_BAD:
                error, message, where = _MESSAGES[name]
                later_note = " (in the data of an earlier step call)" if later else ""
                raise error(message.format(index=value) + where + later_note)


_unread: weakref.WeakKeyDictionary[Any, list[Pending]] = weakref.WeakKeyDictionary()  # by model: steps not read


def taken_from(sown: dict[str, jax.Array], owner: Any) -> tuple[dict[str, jax.Array], Pending | None]:
    """A step's side outputs -> (those the model records, the step's index checks or None). ``owner`` (the
    model) is whose next step call raises them if no value of the step was read by then."""
    checks = {name: value for name, value in sown.items() if name.startswith(PREFIX)}
    if not checks:
        return sown, None
    unread = _unread.setdefault(owner, [])
    pending = Pending(checks, unread)
    unread.append(pending)
    return {name: value for name, value in sown.items() if name not in checks}, pending


def raise_ready(owner: Any) -> None:
    """At a step call on ``owner``: its earlier steps' checks whose values are ready (no wait) raise if failed."""
    for pending in list(_unread.get(owner, ())):
        if pending.is_ready():
            pending.raise_if_failed(later=True)


def _local_largest(value: jax.Array) -> int:
    """The largest of a check's blocks this process holds (each process raises for the rows it fed, as each torch
    rank raises for its own batch)."""
    shards = jax.device_get([shard.data for shard in value.addressable_shards])
    return int(max(np.max(shard) for shard in shards))
