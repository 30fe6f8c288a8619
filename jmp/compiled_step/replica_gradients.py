"""One gradient reduction per step under microbatches, as DDP's ``no_sync`` does.

A replicated parameter's gradient is a sum over the batch's rows, which data parallelism splits over devices.
GSPMD sums it where each use's backward makes it: inside the loop over microbatches, so the all-reduce runs
once per microbatch (and XLA does not move it out of the loop). Here the step also hands the forward a stack of
identical copies of the parameters, one per data-parallel replica, split over the data axes the parameters are
replicated over (made once, before the loop). The forward's row-local calls read them
(``jmp.torch_bridge.replica_calls``): each replica's copy gets the gradient of its own rows, which stays on its
devices. The loop adds those partial gradients on each device; after it, one sum over the replicas (one
all-reduce) gives the gradients. What the forward computes is unchanged: every call still sees the whole batch,
so batch norm statistics and a loss's mean are those of the plain loop.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jmp.model.parameter_store import StackStore
from jmp.runtime.mesh_state import DATA_AXES
from jmp.torch_bridge import concrete_run, replica_calls

_OFFERED: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("jmp_replica_copies_offered", default=None)


def replicated_axes(model: Any, signature: Any) -> tuple[str, ...]:
    """The data axes (of more than one device) that no parameter is split over, when this step keeps gradients per
    replica through its microbatch loop (a pipeline's schedule too); () when it does not: one microbatch, a step run
    op by op, or several processes' shares, unless each process has one replica of its own (then the gradients are
    kept per process, ``process_shares.per_process_gradients``, or, in a pipeline, each process's forward reads its
    own copy) and the step is not in fp8 (that loop does not differentiate the fp8 scales)."""
    if signature.microbatches == 1 or concrete_run.active():
        return ()
    mesh = model.layout.mesh
    split = {axis for spec in model.layout.specs.values() for entry in spec if entry for axis in _names(entry)}
    axes = tuple(a for a in DATA_AXES if a in mesh.axis_names and mesh.shape[a] > 1 and a not in split)
    if signature.process_shares > 1:
        if model.fp8_recipe is not None:
            return ()
        replicas = math.prod(mesh.shape[a] for a in axes)
        return axes if replicas == signature.process_shares == signature.data_shards else ()
    return axes


def _names(entry: Any) -> tuple[str, ...]:
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def replica_positions(store: Any) -> Any:
    """Per stored parameter, where its copies' replica axis goes: first, or after the layer axis of a layer stack's
    weight stored as one array (``StackStore``), so that each layer's view of the copies is [replicas, *shape]."""
    stacked = store.groups if isinstance(store, StackStore) else {}
    return jax.tree_util.tree_map_with_path(
        lambda path, _: 1 if _key(path) in stacked else 0, store.shardings, is_leaf=_is_sharding
    )


def _key(path: tuple) -> Any:
    return path[0].key if len(path) == 1 and isinstance(path[0], jax.tree_util.DictKey) else None


def _is_sharding(node: Any) -> bool:
    return isinstance(node, NamedSharding)


def leading(store: Any) -> Any:
    """Every stored parameter's replica axis first (per-process gradients: ``jax.vmap`` puts its axis there)."""
    return jax.tree.map(lambda _: 0, store.shardings)


def copy_shardings(model: Any, axes: tuple[str, ...], positions: Any) -> Any:
    """Shardings of the copies: the replica axis split over ``axes`` at its position, each parameter's own spec
    around it."""

    def of(s, at):
        spec = tuple(s.spec) + (None,) * max(0, at - len(s.spec))
        return NamedSharding(s.mesh, PartitionSpec(*spec[:at], axes, *spec[at:]))

    return jax.tree.map(of, model.store.shardings, positions, is_leaf=_is_sharding)


def copies(params: Any, shardings: Any, positions: Any) -> Any:
    """Each stored parameter with a replica axis at its position, one identical copy per replica (no copying:
    each device's block is its own replica of the parameter)."""

    def of(p, s, at):
        replicas = math.prod(s.mesh.shape[a] for a in _names(s.spec[at]))
        shape = p.shape[:at] + (replicas,) + p.shape[at:]
        return jax.lax.with_sharding_constraint(jnp.broadcast_to(jnp.expand_dims(p, at), shape), s)

    return jax.tree.map(of, params, shardings, positions)


@contextlib.contextmanager
def offered(copies: Any, mesh: jax.sharding.Mesh, axes: tuple[str, ...], rows: frozenset[int]) -> Iterator[None]:
    """Within the block the step's forward, on microbatches of ``rows`` rows, reads ``copies`` (``reading``)."""
    token = _OFFERED.set((copies, mesh, axes, rows))
    try:
        yield
    finally:
        _OFFERED.reset(token)


@contextlib.contextmanager
def viewed(view: Any) -> Iterator[None]:
    """Within the block the offered copies are as ``view`` makes stored parameters for a trace (the store's
    ``in_trace``: a layer stack's weight as one view per layer); nothing offered, nothing changes."""
    offer = _OFFERED.get()
    if offer is None:
        yield
        return
    token = _OFFERED.set((view(offer[0]), *offer[1:]))
    try:
        yield
    finally:
        _OFFERED.reset(token)


def reading(parameters: list[jax.Array], as_computed: Any) -> contextlib.AbstractContextManager:
    """Row-local calls on ``parameters`` (the arrays the module reads, in tree order) run per replica on the offered
    copies, cast as the parameters were (``as_computed``: stored leaves -> computed leaves); nothing offered,
    nothing changes."""
    offer = _OFFERED.get()
    if offer is None:
        return contextlib.nullcontext()
    copy_tree, mesh, axes, rows = offer
    return replica_calls.reading(parameters, as_computed(jax.tree.leaves(copy_tree)), mesh, axes, rows)


def merged(grads: Any, copy_grads: Any, shardings: Any, positions: Any) -> Any:
    """One microbatch's gradients with a replica axis per parameter: each replica's own part (``copy_grads``) plus
    an equal share of what the uses outside per-replica calls gave (``grads``, already summed over replicas)."""

    def merge(g, c, s, at):
        return jax.lax.with_sharding_constraint(c + jnp.expand_dims(g / c.shape[at], at).astype(c.dtype), s)

    return jax.tree.map(merge, grads, copy_grads, shardings, positions)


def reduced(total: Any, positions: Any) -> Any:
    """Per-replica gradients summed over the replicas: the step's one reduction."""
    return jax.tree.map(lambda t, at: t.sum(at), total, positions)
