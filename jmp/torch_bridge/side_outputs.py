"""Side outputs: values a forward produces besides its outputs (Flax NNX's ``sow``), collected by the step.

The step opens ``collecting()`` around its forward and combines each name by its reduction over microbatches
and stages; a JAX transform inside the forward returns its body's and sows them again (``sow_all``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp

from jmp.torch_bridge.context_vars import set_within

# reduction -> (combine two values, the identity of that combination for a value of this shape and dtype)
_REDUCTIONS: dict[str, tuple[Callable, Callable]] = {
    "sum": (jnp.add, lambda s: jnp.zeros(s.shape, s.dtype)),
    "max": (jnp.maximum, lambda s: jnp.full(s.shape, _extreme(s.dtype, low=True), s.dtype)),
    "min": (jnp.minimum, lambda s: jnp.full(s.shape, _extreme(s.dtype, low=False), s.dtype)),
}

SideOutputs = dict[str, "Sown"]  # name -> what the forward sowed under it, combined


@dataclasses.dataclass(frozen=True)
class Sown:
    """One side output: its value and how values of its name combine; ``report`` gets the step's total on the host."""

    value: jax.Array
    reduce: str = "sum"
    report: Callable[[Any], None] | None = None


jax.tree_util.register_dataclass(Sown, data_fields=["value"], meta_fields=["reduce", "report"])

_COLLECTOR: contextvars.ContextVar[SideOutputs | None] = contextvars.ContextVar("jmp_side_outputs", default=None)
_TRACE: contextvars.ContextVar[Any] = contextvars.ContextVar("jmp_side_outputs_trace", default=None)


def sow(name: str, value: Any, reduce: str = "sum", report: Callable[[Any], None] | None = None) -> None:
    """Add ``value`` to side output ``name`` of the innermost ``collecting()`` block (ignored outside one).

    Every ``sow`` of a name gives the same ``reduce`` ("sum", "max", "min"), ``report`` and value shape.
    """
    if reduce not in _REDUCTIONS:
        raise ValueError(f"side output '{name}': reduce is one of {sorted(_REDUCTIONS)}, not '{reduce}'")
    collected = _COLLECTOR.get()
    if collected is None:
        return
    value = jnp.asarray(value)
    sown = Sown(jnp.asarray(value, value.dtype), reduce, report)  # not weakly typed: a loop carry's type is fixed
    collected[name] = combine(collected[name], sown) if name in collected else sown


def sow_all(side_outputs: SideOutputs) -> None:
    """Sow every entry of ``side_outputs`` (those a transform collected inside and returned) in the block here."""
    for name, sown in side_outputs.items():
        sow(name, sown.value, sown.reduce, sown.report)


@contextlib.contextmanager
def collecting() -> Iterator[SideOutputs]:
    """Collects the side outputs sown inside the block (not those of blocks nested in it) into the dict yielded."""
    collected: SideOutputs = {}
    with set_within(_COLLECTOR, collected), set_within(_TRACE, jax.extend.core.get_opaque_trace_state()):
        yield collected


def in_collecting_trace() -> bool:
    """Whether a value traced here can be sown: a ``collecting()`` block is open and JAX traces what it was opened
    in, not a transform's body entered since (``vmap``'s, ``torch.cond``'s), whose values cannot leave it."""
    return _COLLECTOR.get() is not None and _TRACE.get() == jax.extend.core.get_opaque_trace_state()


def idempotent(side_outputs: SideOutputs) -> bool:
    """Whether sowing these again changes nothing: each is combined by its maximum or minimum."""
    return all(sown.reduce in ("max", "min") for sown in side_outputs.values())


def combine(a: Sown, b: Sown) -> Sown:
    if (a.reduce, a.report) != (b.reduce, b.report):
        raise ValueError(f"side outputs combined with different reductions or reports: {a} and {b}")
    return Sown(_REDUCTIONS[a.reduce][0](a.value, b.value), a.reduce, a.report)


def combine_all(a: SideOutputs, b: SideOutputs) -> SideOutputs:
    """Two dicts of side outputs (two microbatches' of one forward: the same names) combined name by name."""
    return {name: combine(a[name], b[name]) for name in a}


def identity(shapes: SideOutputs) -> SideOutputs:
    """Side outputs like ``shapes`` (values may be ``jax.ShapeDtypeStruct``) holding each reduction's identity."""
    return {name: Sown(_REDUCTIONS[s.reduce][1](s.value), s.reduce, s.report) for name, s in shapes.items()}


def reduce_stacked(stacked: SideOutputs) -> SideOutputs:
    """Side outputs whose values are stacked on a leading microbatch axis -> combined over it."""
    reducers = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}
    return {name: Sown(reducers[s.reduce](s.value, axis=0), s.reduce, s.report) for name, s in stacked.items()}


def reported(side_outputs: SideOutputs) -> dict[str, jax.Array]:
    """The step's totals by name, each with a ``report`` handed to it on the host (without waiting for the step)."""
    for sown in side_outputs.values():
        if sown.report is not None:
            jax.debug.callback(sown.report, sown.value)
    return {name: sown.value for name, sown in side_outputs.items()}


def _extreme(dtype: Any, low: bool) -> Any:
    if dtype == jnp.bool_:
        return not low
    if jnp.issubdtype(dtype, jnp.floating):
        return -jnp.inf if low else jnp.inf
    info = jnp.iinfo(dtype)
    return info.min if low else info.max
