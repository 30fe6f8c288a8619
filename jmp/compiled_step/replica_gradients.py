"""One gradient reduction per step under microbatches, as DDP's ``no_sync`` does (docs/compiled_step.md).

GSPMD all-reduces a replicated parameter's gradient inside the loop over microbatches, once per microbatch (XLA
does not move it out of the loop). So the forward's row-local calls (``jmp.torch_bridge.replica_calls``) read one
identical copy of the parameters per data-parallel replica, made before the loop: each copy's gradient stays on
its replica's devices, and one sum over the replicas after the loop gives the gradients. Every call still sees the
whole batch, so batch norm statistics and a loss's mean are those of the plain loop.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jmp.runtime import mesh_state
from jmp.runtime.mesh_state import DATA_AXES
from jmp.torch_bridge import concrete_run, replica_calls
from jmp.torch_bridge.context_vars import set_within
from jmp.wrapped_model.parameter_store import StackStore

_OFFERED: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("jmp_replica_copies_offered", default=None)


def replicated_axes(model: Any, signature: Any) -> tuple[str, ...]:
    """The data axes (of more than one device) that no parameter is split over, when this step keeps gradients per
    replica through its microbatch loop (a pipeline's schedule too); () when it does not: one microbatch, a step run
    op by op, or several processes' shares unless each process's rows are whole replicas' (``by_process``) or each
    replica's rows a run of whole processes' (a tensor-parallel group's processes, feeding rows of their own:
    ``process_grouped``), the replicated axes leading the axes the processes feed over; in a pipeline only one
    replica per process, whose forward reads its own copy."""
    if signature.microbatches == 1 or concrete_run.active():
        return ()
    mesh = model.layout.mesh
    split = split_axes(model)
    axes = tuple(a for a in DATA_AXES if a in mesh.axis_names and mesh.shape[a] > 1 and a not in split)
    shares = signature.process_shares
    if shares > 1:
        replicas = math.prod(mesh.shape[a] for a in axes)
        if model.pipeline is not None:  # each process one replica, feeding it alone
            return axes if replicas == shares == signature.data_shards else ()
        fed = tuple(a for a in mesh_state.feeding_axes() if mesh.shape[a] > 1)
        if fed[: len(axes)] != axes or (replicas % shares and shares % replicas):
            return ()  # a process's rows are not whole replicas', nor a replica's a run of whole processes'
        if replicas > shares and by_process(mesh, axes, shares) is None:
            return ()
    return axes


PROCESSES, LOCAL = "jmp_processes", "jmp_local_replicas"  # ``by_process``'s mesh axes


def by_process(mesh: jax.sharding.Mesh, axes: tuple[str, ...], shares: int) -> jax.sharding.Mesh | None:
    """``mesh`` with its data-parallel ``axes`` (the replicas) as two axes: PROCESSES, one entry per process feeding
    the batch (``shares``), and LOCAL, the replicas within each, in the order the batch's rows are laid out over
    ``axes`` (process-major), over the same devices in the same order (so one program can use both meshes); None
    when ``axes`` are not adjacent in ``mesh`` but for axes of one device."""
    names = [a for a in mesh.axis_names if a not in axes or a == axes[0]]
    order = [mesh.axis_names.index(a) for a in names]
    first = names.index(axes[0])
    order[first : first + 1] = [mesh.axis_names.index(a) for a in axes]
    grid = np.transpose(mesh.devices, order)
    if list(grid.flat) != list(mesh.devices.flat):
        return None
    sizes = [mesh.shape[a] for a in names]
    replicas = math.prod(mesh.shape[a] for a in axes)
    sizes[first : first + 1] = [shares, replicas // shares]
    names[first : first + 1] = [PROCESSES, LOCAL]
    return jax.sharding.Mesh(grid.reshape(sizes), tuple(names), axis_types=(AxisType.Auto,) * len(names))


def split_axes(model: Any) -> set[str]:
    """The mesh axes some parameter is split over."""
    return {axis for spec in model.layout.specs.values() for entry in spec if entry for axis in _names(entry)}


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


def copy_shardings(model: Any, axes: tuple[str, ...], positions: Any) -> Any:
    """Shardings of the copies: the replica axis split over ``axes`` at its position, each parameter's own spec
    around it."""
    return _with_replica_dims(model.store.shardings, positions, (axes,))


def process_copy_shardings(model: Any, mesh: jax.sharding.Mesh, positions: Any) -> Any:
    """Shardings of per-process copies on ``mesh`` (``by_process``): [processes, replicas within] at each
    parameter's position, split over PROCESSES and LOCAL, its own spec around them."""
    return _with_replica_dims(model.store.shardings, positions, (PROCESSES, LOCAL), mesh)


def process_shardings(model: Any, mesh: jax.sharding.Mesh, positions: Any) -> Any:
    """Shardings of per-process gradients on ``mesh`` (``by_process``): [processes] at each parameter's position,
    split over PROCESSES, its own spec around it."""
    return _with_replica_dims(model.store.shardings, positions, (PROCESSES,), mesh)


def _with_replica_dims(shardings: Any, positions: Any, entries: tuple, mesh: Any = None) -> Any:
    def of(s, at):
        spec = tuple(s.spec) + (None,) * max(0, at - len(s.spec))
        return NamedSharding(mesh or s.mesh, PartitionSpec(*spec[:at], *entries, *spec[at:]))

    return jax.tree.map(of, shardings, positions, is_leaf=_is_sharding)


def copies(params: Any, shardings: Any, positions: Any, dims: int = 1) -> Any:
    """Each stored parameter with ``dims`` replica axes at its position (as ``shardings`` split them), one identical
    copy per replica (no copying: each device's block is its own replica of the parameter)."""

    def of(p, s, at):
        sizes = tuple(math.prod(s.mesh.shape[a] for a in _names(s.spec[at + i])) for i in range(dims))
        shape = p.shape[:at] + sizes + p.shape[at:]
        expanded = jnp.expand_dims(p, tuple(range(at, at + dims)))
        return jax.lax.with_sharding_constraint(jnp.broadcast_to(expanded, shape), s)

    return jax.tree.map(of, params, shardings, positions)


@contextlib.contextmanager
def offered(copies: Any, mesh: jax.sharding.Mesh, axes: tuple[str, ...], rows: frozenset[int]) -> Iterator[None]:
    """Within the block the step's forward, on microbatches of ``rows`` rows, reads ``copies`` (``reading``)."""
    with set_within(_OFFERED, (copies, mesh, axes, rows)):
        yield


@contextlib.contextmanager
def viewed(view: Any) -> Iterator[None]:
    """Within the block the offered copies are as ``view`` makes stored parameters for a trace (the store's
    ``in_trace``: a layer stack's weight as one view per layer); nothing offered, nothing changes."""
    offer = _OFFERED.get()
    if offer is None:
        yield
        return
    with set_within(_OFFERED, (view(offer[0]), *offer[1:])):
        yield


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


def process_merged(grads: Any, copy_grads: Any, shardings: Any, positions: Any) -> Any:
    """One microbatch's gradients per process and replica within it ([processes, replicas] at each parameter's
    position, ``process_copy_shardings``): each replica's own part (``copy_grads``, laid out so) plus an equal
    share of what its process's uses outside per-replica calls gave (``grads``, [processes, *shape])."""

    def merge(g, c, s, at):
        g = jnp.expand_dims(jnp.moveaxis(g, 0, at), at + 1)
        return jax.lax.with_sharding_constraint(c + (g / s.mesh.shape[LOCAL]).astype(c.dtype), s)

    return jax.tree.map(merge, grads, copy_grads, shardings, positions)


def process_grouped(grads: Any, shardings: Any, positions: Any) -> Any:
    """One microbatch's per-process gradients ([processes, *shape]) summed in consecutive groups, one per entry of
    ``shardings``' axis at each parameter's position: per replica (``copy_shardings``: a replica's processes are
    consecutive) or per process (``process_shardings``)."""

    def group(g, s, at):
        groups = math.prod(s.mesh.shape[a] for a in _names(s.spec[at]))
        summed = g.reshape(groups, g.shape[0] // groups, *g.shape[1:]).sum(1)
        return jax.lax.with_sharding_constraint(jnp.moveaxis(summed, 0, at), s)

    return jax.tree.map(group, grads, shardings, positions)


def reduced(total: Any, positions: Any, dims: int = 1) -> Any:
    """Per-replica gradients summed over the replicas (``dims`` axes at each position): the step's one reduction."""
    return jax.tree.map(lambda t, at: t.sum(tuple(range(at, at + dims))), total, positions)
