"""What a ``DistributedModel`` holds, as the three records the step and the optimizer work with.

``ParameterLayout`` (frozen: names, shapes, dtypes, ``PartitionSpec``s, the mesh and config), ``TrainingState``
(mutable: the values that change every step) and ``ProgramCache`` (the compiled programs of the model's step
functions, with explicit invalidation: activation checkpointing annotations change what a program computes).
``jmp.compiled_step`` and ``jmp.optim.distributed_optimizer`` read and write these through the model's
public attributes (``model.layout``, ``model.training_state``, ``model.programs``); nothing else of the model is shared.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jmp.runtime.config import Config


@dataclasses.dataclass(frozen=True, eq=False)
class ParameterLayout:
    """The parameters' names, shapes, dtypes and placement: fixed when the model is built."""

    names: tuple[str, ...]  # torch names, in the order of the converted module's parameter tree
    shapes: Mapping[str, tuple[int, ...]]
    dtypes: Mapping[str, Any]
    specs: Mapping[str, PartitionSpec]
    treedef: Any  # the parameter tree's structure (an nnx.State)
    mesh: jax.sharding.Mesh
    config: Config

    def sharding(self, name: str) -> NamedSharding:
        return NamedSharding(self.mesh, self.specs[name])

    @functools.cached_property
    def shardings(self) -> Any:
        """A tree like the parameters holding each one's ``NamedSharding``."""
        return self.tree({name: self.sharding(name) for name in self.names})

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def avals(self) -> list[jax.ShapeDtypeStruct]:
        """Shapes and dtypes of the full parameters, in ``names`` order (what a forward trace takes)."""
        return [jax.ShapeDtypeStruct(self.shapes[n], self.dtypes[n]) for n in self.names]

    def tree(self, by_name: Mapping[str, Any]) -> Any:
        """Values keyed by torch name -> a tree laid out like the parameters."""
        return jax.tree_util.tree_unflatten(self.treedef, [by_name[n] for n in self.names])

    def by_name(self, tree: Any) -> dict[str, Any]:
        """A tree laid out like the parameters -> its leaves keyed by torch name."""
        return dict(zip(self.names, jax.tree_util.tree_leaves(tree)))

    def parameter_count(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes.values())


@dataclasses.dataclass
class TrainingState:
    """The model's values between steps.

    ``params`` are as stored: the parameter tree, or (pipelined, after the first step) the stages'
    packed buffers. ``grads`` are laid out like ``params``, accumulated over step calls until the
    optimizer's ``zero_grad()`` (torch semantics), still multiplied by the loss scale. A clipping factor
    may be pending on them (``scale_grads_later``): reading ``grads`` multiplies it in, while the optimizer
    takes it into its own pass over the gradients (``kept_grads``) and writes no clipped copy.
    ``side_outputs`` are the values the last step's forward sowed besides its outputs, by name, each the
    step's total (``jmp.torch_bridge.side_outputs``).
    """

    params: Any
    rest: Any
    side_outputs: dict[str, jax.Array] = dataclasses.field(default_factory=dict)
    version: int = 0  # counts changes of ``params`` and ``rest`` (what a copy of them is checked against)
    _grads: Any = None
    _grad_factor: jax.Array | None = None
    # the parameters' ``p.grad`` (jmp.wrapped_model.param_grads.ParamGrads): told when the gradients change, and asked
    # for the host's edits of them before the gradients are read
    grad_views: Any = None

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("params", "rest"):
            object.__setattr__(self, "version", getattr(self, "version", 0) + 1)
        object.__setattr__(self, name, value)

    @property
    def grads(self) -> Any:
        self._take_host_edits()
        if self._grad_factor is not None:
            self.grads = _scaled(self._grads, self._grad_factor)
        return self._grads

    @grads.setter
    def grads(self, value: Any) -> None:
        object.__setattr__(self, "_grads", value)
        object.__setattr__(self, "_grad_factor", None)
        self._changed()

    def replace_grads(self, value: Any) -> None:
        """New gradients that the parameters' ``p.grad`` already show (their edits, written back)."""
        object.__setattr__(self, "_grads", value)
        object.__setattr__(self, "_grad_factor", None)

    @property
    def has_grads(self) -> bool:
        return self._grads is not None

    def kept_grads(self) -> tuple[Any, jax.Array | None]:
        """(the gradients as kept, the factor still to multiply them by or None)."""
        self._take_host_edits()
        return self._grads, self._grad_factor

    def kept_grads_as_computed(self) -> tuple[Any, jax.Array | None]:
        """``kept_grads`` without the host's edits (what ``p.grad`` reads from)."""
        return self._grads, self._grad_factor

    def scale_grads_later(self, factor: jax.Array) -> None:
        """The gradients multiplied by ``factor`` (a device scalar; torch's clipping rounds each product to the
        gradient's dtype) when next read, or in the optimizer's update."""
        self._take_host_edits()
        if self._grad_factor is not None:  # a factor already pending is multiplied in first
            self.grads = _scaled(self._grads, self._grad_factor)
        object.__setattr__(self, "_grad_factor", factor)
        self._changed()

    def _take_host_edits(self) -> None:
        if self.grad_views is not None:
            self.grad_views.write_back(self)

    def _changed(self) -> None:
        if self.grad_views is not None:
            self.grad_views.publish(self._grads is not None)

    @property
    def dropped_tokens(self) -> jax.Array | None:
        """Token-expert assignments the last step's expert dispatches dropped (None: it dropped none, by design)."""
        return self.side_outputs.get("dropped_tokens")  # jmp.sharding.experts.DROPPED_TOKENS

    def record_step(self, rest: Any, grads: Any, side_outputs: dict[str, jax.Array]) -> None:
        """Take a step program's results: new module state, gradients to add (None: no backward), side outputs."""
        self.rest = rest
        self.side_outputs = side_outputs
        if grads is not None:
            self.grads = grads if self.grads is None else _add_trees(self.grads, grads)


@jax.jit
def _scaled(grads: Any, factor: jax.Array) -> Any:
    return jax.tree.map(lambda g: (g.astype(jnp.float32) * factor).astype(g.dtype), grads)


_add_trees = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))  # no donation: model.grads handed out stay valid


class ProgramCache:
    """Compiled step programs of one model, by key; cleared when something they baked in changes."""

    def __init__(self) -> None:
        self._programs: dict[Hashable, Any] = {}

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        if key not in self._programs:
            self._programs[key] = build()
        return self._programs[key]

    def replace(self, key: Hashable, program: Any) -> Any:
        self._programs[key] = program
        return program

    def clear(self) -> None:
        self._programs.clear()

    def __len__(self) -> int:
        return len(self._programs)

    def __iter__(self) -> Iterator[Any]:
        """The programs held (as built: a step's program with its trace record)."""
        return iter(list(self._programs.values()))


def copy_tree(tree: Any) -> Any:
    """New buffers holding the same values, placed alike (safe to keep across a donating update)."""
    return _copy(tree)


_copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))
