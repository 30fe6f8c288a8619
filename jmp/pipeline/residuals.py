"""Keeping a stage's backward residuals from its forward tick to its backward tick.

A stage's ``jax.vjp`` is traced once (``trace_vjp``): its forward tick evaluates the forward and stores, in a shared
*pool*, the pullback's leaves that depend on the microbatch (its activations); its backward tick evaluates the
forward again with those swapped in, and XLA drops the computation that made them. Leaves computed from the
weights alone (a transposed, cast or gathered weight: FSDP's backward gathers again), the stage's own inputs and
random keys (derived again from the step's key and the microbatch index) are not stored. The pool has one array
``[depth, *shape]`` per residual shape, as many of each as the stage needing most needs: equal stages share entries.
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
class TracedVjp:
    """A stage's ``jax.vjp`` traced once, as two jaxprs the ticks evaluate: the forward (its output and the
    pullback's array leaves, the residuals) and the pullback (from those leaves and the output cotangents)."""

    forward: core.ClosedJaxpr
    pullback: core.ClosedJaxpr
    out_tree: Any  # the forward's output (``jax.vjp``'s aux)
    grads_tree: Any
    weights: int  # how many of the forward's inputs are weights (the first)

    def run_forward(self, *args) -> tuple[Any, list[jax.Array]]:
        """(the output, the residuals) of the forward on ``args``."""
        flat = core.jaxpr_as_fun(self.forward)(*jax.tree.leaves(args))
        outputs = self.out_tree.num_leaves
        return jax.tree.unflatten(self.out_tree, flat[:outputs]), list(flat[outputs:])

    def run_pullback(self, residuals: Sequence[jax.Array], cotangents: Any) -> Any:
        return jax.tree.unflatten(
            self.grads_tree, core.jaxpr_as_fun(self.pullback)(*residuals, *jax.tree.leaves(cotangents))
        )


def trace_vjp(vjp: Callable[..., tuple[Any, Any, Any]], weights: Any, *data: Any) -> TracedVjp:
    """``vjp(weights, *data)`` (returning ``jax.vjp``'s (primal output, pullback, aux)) traced once."""
    found: dict[str, Any] = {}

    def forward(weights, *data):
        primal, pullback, aux = vjp(weights, *data)
        leaves, found["pullback_tree"] = jax.tree.flatten(pullback)
        found["leaves"] = tuple(None if isinstance(leaf, jax.Array) else leaf for leaf in leaves)
        found["cotangents"] = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), primal)
        return aux, [leaf for leaf in leaves if isinstance(leaf, jax.Array)]

    closed, (aux, residual_shapes) = jax.make_jaxpr(forward, return_shape=True)(weights, *data)

    def pullback(residuals, cotangents):
        given = iter(residuals)
        leaves = [next(given) if leaf is None else leaf for leaf in found["leaves"]]
        return jax.tree.unflatten(found["pullback_tree"], leaves)(cotangents)

    backward, grads = jax.make_jaxpr(pullback, return_shape=True)(residual_shapes, found["cotangents"])
    return TracedVjp(
        closed,
        backward,
        jax.tree.structure(aux),
        jax.tree.structure(grads),
        len(jax.tree.leaves(weights)),
    )


@dataclasses.dataclass(frozen=True)
class ResidualPlan:
    """Which residuals each stage stores, and where in the shared pool."""

    stored: tuple[tuple[tuple[int, int], ...], ...]  # per stage: (residual index, pool entry)
    pool: tuple[jax.ShapeDtypeStruct, ...]  # each entry's shape (one microbatch's)

    def empty(self, depth: int) -> tuple[jax.Array, ...]:
        return tuple(jnp.zeros((depth,) + e.shape, e.dtype) for e in self.pool)

    def zeros(self) -> tuple[jax.Array, ...]:
        return tuple(jnp.zeros(e.shape, e.dtype) for e in self.pool)

    def pack(self, stage: int, residuals: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        """One microbatch's pool entries holding ``stage``'s stored residuals (zeros elsewhere)."""
        entries = list(self.zeros())
        for leaf, entry in self.stored[stage]:
            entries[entry] = residuals[leaf]
        return tuple(entries)

    def unpack(self, stage: int, residuals: Sequence[jax.Array], entries: Sequence[jax.Array]) -> list[jax.Array]:
        """``residuals`` (computed again on the backward tick) with the stored ones swapped in."""
        residuals = list(residuals)
        for leaf, entry in self.stored[stage]:
            residuals[leaf] = entries[entry]
        return residuals


def plan(stages: Sequence[TracedVjp]) -> ResidualPlan:
    """Which residuals of each stage's traced ``jax.vjp`` its forward tick stores.

    A residual computed from the weights alone, or equal to an input, is computed again on the backward
    tick; any other is stored.
    """
    stored_shapes = []
    for stage in stages:
        outputs = stage.out_tree.num_leaves
        kept = _data_dependent(stage.forward.jaxpr, stage.weights)[outputs:]
        avals = stage.forward.out_avals[outputs:]
        stored_shapes.append(
            [(i, aval) for i, (aval, keep) in enumerate(zip(avals, kept)) if keep and not _is_key(aval)]
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
