"""Keeping a stage's backward residuals from its forward tick to its backward tick.

``jax.vjp`` returns its pullback as a pytree whose array leaves are the residuals the backward reads. A
stage's forward tick stores the residuals that depend on the microbatch (its activations) in a
*pool*; its backward tick traces the same ``jax.vjp`` again, swaps the stored residuals in, and XLA drops
the forward computation that produced them. Residuals computed from the parameters alone (a transposed,
cast or gathered weight) and residuals that are the stage's own inputs are not stored: the backward tick
computes them again, so a kept residual never holds a copy of a weight (under sharded data parallelism the
backward gathers weights again, as FSDP does). Random keys (a checkpointed region keeps its key to draw its
dropout again) are derived again too: from the step's key folded with the microbatch index, as the forward
tick derived them.

Every device runs one stage but the loop's state has one type for all, so the pool is shared: one array of
``[depth, *shape]`` per residual shape, as many of each shape as the stage needing most of them needs.
Homogeneous stages (a transformer's layers) share every entry; a device holds one stage's residuals per
microbatch in flight, not every stage's.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core


@dataclasses.dataclass(frozen=True)
class ResidualPlan:
    """Which pullback leaves each stage stores, and where in the shared pool."""

    stored: tuple[tuple[tuple[int, int], ...], ...]  # per stage: (pullback leaf index, pool entry)
    pool: tuple[jax.ShapeDtypeStruct, ...]  # each entry's shape (one microbatch's)

    def empty(self, depth: int) -> tuple[jax.Array, ...]:
        return tuple(jnp.zeros((depth,) + e.shape, e.dtype) for e in self.pool)

    def zeros(self) -> tuple[jax.Array, ...]:
        return tuple(jnp.zeros(e.shape, e.dtype) for e in self.pool)

    def pack(self, stage: int, pullback: Any) -> tuple[jax.Array, ...]:
        """One microbatch's pool entries holding ``stage``'s stored residuals (zeros elsewhere)."""
        leaves = jax.tree.leaves(pullback)
        entries = list(self.zeros())
        for leaf, entry in self.stored[stage]:
            entries[entry] = leaves[leaf]
        return tuple(entries)

    def unpack(self, stage: int, pullback: Any, entries: Sequence[jax.Array]) -> Any:
        """``pullback`` (traced again on the backward tick) with the stored residuals swapped in."""
        leaves, treedef = jax.tree.flatten(pullback)
        for leaf, entry in self.stored[stage]:
            leaves[leaf] = entries[entry]
        return jax.tree.unflatten(treedef, leaves)


def plan(pullbacks: Sequence[Callable[..., Any]], weights: Any, data: Any) -> ResidualPlan:
    """The residual plan of stages whose ``pullbacks[s](weights, data)`` returns stage *s*'s pullback.

    A residual computed from ``weights`` alone, or equal to an input, is computed again on the backward
    tick; any other is stored.
    """
    stored_shapes = []
    for pullback in pullbacks:
        positions: list[int] = []

        def residuals(w, d, pullback=pullback, positions=positions):
            leaves = jax.tree.leaves(pullback(w, d))
            positions[:] = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
            return [leaves[i] for i in positions]

        closed = jax.make_jaxpr(residuals)(weights, data)
        kept = _data_dependent(closed.jaxpr, len(jax.tree.leaves(weights)))
        stored_shapes.append(
            [(i, aval) for i, aval, keep in zip(positions, closed.out_avals, kept) if keep and not _is_key(aval)]
        )
    pool: list[jax.ShapeDtypeStruct] = []
    entries_of: dict[tuple, list[int]] = collections.defaultdict(list)
    stored = []
    for stage_shapes in stored_shapes:
        used: collections.Counter = collections.Counter()
        mapping = []
        for leaf, shape in stage_shapes:
            key = (shape.shape, jnp.dtype(shape.dtype))
            if used[key] == len(entries_of[key]):
                entries_of[key].append(len(pool))
                pool.append(jax.ShapeDtypeStruct(shape.shape, shape.dtype))
            mapping.append((leaf, entries_of[key][used[key]]))
            used[key] += 1
        stored.append(tuple(mapping))
    return ResidualPlan(tuple(stored), tuple(pool))


def _is_key(aval: Any) -> bool:
    """A random key: derived again on the backward tick (from the step's key and the microbatch index)."""
    return jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended)


def _data_dependent(jaxpr: core.Jaxpr, n_weights: int) -> list[bool]:
    """Per output: whether it is computed from an input past the first ``n_weights`` (not merely equal to one)."""
    inputs = set(jaxpr.invars)
    reached = _reached(jaxpr, [i >= n_weights for i in range(len(jaxpr.invars))])
    return [r and v not in inputs for v, r in zip(jaxpr.outvars, reached)]


def _reached(jaxpr: core.Jaxpr, from_data: Sequence[bool]) -> list[bool]:
    """Per output of ``jaxpr``: whether it depends on an input marked in ``from_data``.

    Calls of inner jaxprs (``jit``, checkpoint, custom derivatives) are followed output by output, since
    ``jax.vjp`` computes a layer's weight-only residuals inside the same call as its activations.
    """
    data = {v for v, d in zip(jaxpr.invars, from_data) if d}
    for eqn in jaxpr.eqns:
        marked = [isinstance(v, core.Var) and v in data for v in eqn.invars]
        if not any(marked):
            continue
        inner = _inner_jaxpr(eqn)
        if inner is not None and len(inner.invars) == len(eqn.invars) and len(inner.outvars) == len(eqn.outvars):
            data.update(v for v, r in zip(eqn.outvars, _reached(inner, marked)) if r)
        else:
            data.update(eqn.outvars)
    return [isinstance(v, core.Var) and v in data for v in jaxpr.outvars]


def _inner_jaxpr(eqn: core.JaxprEqn) -> core.Jaxpr | None:
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = eqn.params.get(name)
        if isinstance(inner, core.ClosedJaxpr):
            return inner.jaxpr
        if isinstance(inner, core.Jaxpr):
            return inner
    return None
