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

from jmp.model.parameter_store import TreeStore
from jmp.runtime.mesh_state import DATA_AXES
from jmp.torch_bridge import concrete_run, replica_calls

_OFFERED: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("jmp_replica_copies_offered", default=None)


def replicated_axes(model: Any, signature: Any) -> tuple[str, ...]:
    """The data axes (of more than one device) that no parameter is split over, when this step keeps gradients per
    replica through its microbatch loop; () when it does not: one microbatch, a pipeline (its own schedule), fp8
    (its scales' gradients), several processes' shares (a vmap over them), a step run op by op, or parameters
    stored stacked."""
    if (
        signature.microbatches == 1
        or model.pipeline is not None
        or model.fp8_recipe is not None
        or signature.process_shares > 1
        or concrete_run.active()
        or not isinstance(model.store, TreeStore)
    ):
        return ()
    mesh = model.layout.mesh
    split = {axis for spec in model.layout.specs.values() for entry in spec if entry for axis in _names(entry)}
    return tuple(a for a in DATA_AXES if a in mesh.axis_names and mesh.shape[a] > 1 and a not in split)


def _names(entry: Any) -> tuple[str, ...]:
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def copy_shardings(model: Any, axes: tuple[str, ...]) -> Any:
    """Shardings of the copies: a leading replica axis split over ``axes``, then each parameter's own."""
    mesh = model.layout.mesh
    return jax.tree.map(lambda s: NamedSharding(mesh, PartitionSpec(axes, *s.spec)), model.layout.shardings)


def copies(params: Any, shardings: Any) -> Any:
    """Each parameter as [replicas, *shape], one identical copy per replica (no copying: each device's block is its
    own replica of the parameter)."""
    return jax.tree.map(
        lambda p, s: jax.lax.with_sharding_constraint(
            jnp.broadcast_to(p, (math.prod(s.mesh.shape[a] for a in _names(s.spec[0])),) + p.shape), s
        ),
        params,
        shardings,
    )


@contextlib.contextmanager
def offered(copies: Any, mesh: jax.sharding.Mesh, axes: tuple[str, ...], rows: frozenset[int]) -> Iterator[None]:
    """Within the block the step's forward, on microbatches of ``rows`` rows, reads ``copies`` (``reading``)."""
    token = _OFFERED.set((copies, mesh, axes, rows))
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


def merged(grads: Any, copy_grads: Any, shardings: Any) -> Any:
    """One microbatch's gradients as [replicas, *shape] per parameter: each replica's own part (``copy_grads``) plus
    an equal share of what the uses outside per-replica calls gave (``grads``, already summed over replicas)."""

    def merge(g, c, s):
        return jax.lax.with_sharding_constraint(c + (g / c.shape[0]).astype(c.dtype), s)

    return jax.tree.map(merge, grads, copy_grads, shardings)


def reduced(total: Any) -> Any:
    """Per-replica gradients summed over the replicas: the step's one reduction."""
    return jax.tree.map(lambda t: t.sum(0), total)
