"""Where a ``DistributedModel`` keeps its parameters between steps: one interface, three ways of storing.

- ``TreeStore``: the parameter tree itself (an ``nnx.State`` by torch name), each leaf sharded by its spec.
- ``StageStore``: a pipelined model's parameters packed into its stages' buffers (``jmp.pipeline.stage_buffers``),
  from its first step call, when the cut is decided.
- ``StackStore``: under ``scan_layers``, each weight of a layer stack kept as one ``[layers, ...]`` array
  (``jmp.stacks.storage``), the other parameters by name, from when the model is built.

Gradients, optimizer fields and checkpoints read and write through ``model.store``, so nothing else asks how the
model's parameters are stored.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jmp import sharding
from jmp.errors import OptimizerError
from jmp.pipeline.stage_buffers import StageLayout
from jmp.stacks import storage as stacks_storage
from jmp.wrapped_model.records import ParameterLayout, copy_tree


class ParameterStore(Protocol):
    """How parameters (and anything laid out like them: gradients, optimizer fields) are stored."""

    layout: ParameterLayout

    @property
    def shardings(self) -> Any:
        """Shardings of the stored parameters (a tree like them)."""

    def pack(self, named: Mapping[str, jax.Array]) -> Any:
        """Full arrays by torch name -> stored form."""

    def named(self, stored: Any) -> dict[str, jax.Array]:
        """Stored form -> full arrays by torch name (placed by each parameter's own spec)."""

    def as_tree(self, stored: Any) -> nnx.State:
        """Stored form (parameters, gradients) -> an ``nnx.State`` by torch name (the stored arrays themselves
        when they are kept that way)."""

    def in_trace(self, stored: Any, compute_dtypes: Mapping[str, Any] | None = None) -> nnx.State:
        """Stored form -> the parameter tree, inside a step's trace (no copy: differentiable views of it).
        ``compute_dtypes`` (by torch name, mixed precision): a store may cast its arrays to them first (the step
        casts each parameter to its compute dtype anyway; one cast per stored array keeps the views its rows)."""

    @property
    def packs_tensors(self) -> bool:
        """Whether several parameters share a stored array (an optimizer's per-tensor norm would mix them)."""

    def snapshot(self, stored: Any) -> nnx.State:
        """Stored form -> an ``nnx.State`` by torch name, in new buffers (safe across a donating update)."""

    def labels(self, by_name: Mapping[str, str]) -> Any:
        """Optimizer labels (param group names) by torch name -> a tree laid out like the stored parameters."""

    def state_shardings(self, state_shape: Any) -> Any:
        """Shardings of an optimizer state over the stored form (ZeRO-1: split over ``dp`` as well)."""

    def field_named(self, field: Any) -> Any:
        """A parameter-shaped optimizer field as stored -> the same by torch name (other fields unchanged)."""

    def field_from_named(self, named: Mapping[str, jax.Array], like: Any) -> Any:
        """The inverse of ``field_named`` for a field shaped like ``like``."""

    def is_parameter_shaped(self, node: Any) -> bool:
        """Whether a node of an optax state is one field laid out like the stored parameters."""

    def cast_grads(self, grads: Any, dtype_for: Callable[[list[str]], Any]) -> Any:
        """Gradients as stored, each cast to ``dtype_for(names it holds)``."""

    def leaf_mask(self, names: set[str]) -> tuple[bool, ...] | None:
        """Per stored leaf: whether it holds one of ``names`` (None: all of them)."""

    def counted_once(self, stored: Any) -> Any:
        """Stored form (gradients, parameters) holding each parameter once: for reductions over all of them."""

    def held_names(self, process: int) -> set[str]:
        """Torch names of the parameters with a piece on one of ``process``'s devices."""


class TreeStore:
    """The parameter tree as the converted module keeps it, each leaf sharded by its ``PartitionSpec``."""

    def __init__(self, layout: ParameterLayout):
        self.layout = layout

    @property
    def shardings(self) -> Any:
        return self.layout.shardings

    def pack(self, named: Mapping[str, jax.Array]) -> Any:
        return self.layout.tree(named)

    def named(self, stored: Any) -> dict[str, jax.Array]:
        return self.layout.by_name(stored)

    def as_tree(self, stored: Any) -> nnx.State:
        return stored

    def in_trace(self, stored: Any, compute_dtypes: Mapping[str, Any] | None = None) -> nnx.State:
        return stored

    packs_tensors = False

    def snapshot(self, stored: Any) -> nnx.State:
        return copy_tree(stored)

    def labels(self, by_name: Mapping[str, str]) -> Any:
        return self.layout.tree(by_name)

    def state_shardings(self, state_shape: Any) -> Any:
        layout = self.layout
        specs = sharding.optimizer_specs(layout.specs, layout.shapes, layout.mesh, layout.config.shard_optimizer_state)
        return sharding.state_shardings(state_shape, specs, layout.shapes, layout.mesh)

    def field_named(self, field: Any) -> Any:
        return field

    def field_from_named(self, named: Mapping[str, jax.Array], like: Any) -> Any:
        return named

    def is_parameter_shaped(self, node: Any) -> bool:
        return isinstance(node, nnx.State)

    def cast_grads(self, grads: Any, dtype_for: Callable[[list[str]], Any]) -> Any:
        leaves = [g.astype(dtype_for([n])) for n, g in zip(self.layout.names, jax.tree.leaves(grads))]
        return jax.tree_util.tree_unflatten(self.layout.treedef, leaves)

    def counted_once(self, stored: Any) -> Any:
        return stored  # a tied parameter is one leaf of the tree

    def leaf_mask(self, names: set[str]) -> tuple[bool, ...] | None:
        chosen = names & set(self.layout.names)
        if len(chosen) == len(self.layout.names):
            return None
        return tuple(name in chosen for name in self.layout.names)

    def held_names(self, process: int) -> set[str]:
        layout = self.layout
        return {n for n in layout.names if any(d.process_index == process for d in layout.sharding(n).device_set)}


class StageStore:
    """A pipelined model's parameters packed into its stages' buffers: stage *s*'s devices hold row *s*."""

    def __init__(self, layout: ParameterLayout, stages: StageLayout):
        self.layout = layout
        self.stages = stages

    @property
    def shardings(self) -> Any:
        return self.stages.shardings

    def pack(self, named: Mapping[str, jax.Array]) -> Any:
        return self.stages.pack(named)

    def named(self, stored: Any) -> dict[str, jax.Array]:
        return self.stages.unpack(stored)

    def as_tree(self, stored: Any) -> nnx.State:
        return self.layout.tree(self.stages.unpack(stored))

    def in_trace(self, stored: Any, compute_dtypes: Mapping[str, Any] | None = None) -> nnx.State:
        return self.as_tree(stored)

    packs_tensors = True

    def snapshot(self, stored: Any) -> nnx.State:
        return self.as_tree(stored)  # unpacking writes new buffers

    def labels(self, by_name: Mapping[str, str]) -> Any:
        wrong = [
            n for n, places in self.stages.places.items() if self.stages.buffers[places[0].key].label != by_name[n]
        ]
        if wrong:
            raise OptimizerError(
                "the model's pipeline stages were laid out before this optimizer's param groups were known "
                f"({', '.join(wrong[:4])} are in another group); create the smp.DistributedOptimizer before the "
                "first step call"
            )
        return {key: buffer.label for key, buffer in self.stages.buffers.items()}

    def state_shardings(self, state_shape: Any) -> Any:
        return self.stages.state_shardings(state_shape)

    def field_named(self, field: Any) -> Any:
        if not isinstance(field, dict):
            return field
        return nnx.State(self.stages.unpack_present(field))

    def field_from_named(self, named: Mapping[str, jax.Array], like: Any) -> Any:
        return self.stages.pack_present(dict(named.items()), like=like)

    def is_parameter_shaped(self, node: Any) -> bool:
        return isinstance(node, nnx.State) or (
            isinstance(node, dict) and bool(node) and set(node) <= set(self.stages.buffers)
        )

    def cast_grads(self, grads: Any, dtype_for: Callable[[list[str]], Any]) -> Any:
        names: dict[str, list[str]] = {}  # one dtype per buffer
        for name, places in self.stages.places.items():
            for key in {place.key for place in places}:
                names.setdefault(key, []).append(name)
        return {key: g.astype(dtype_for(names[key])) for key, g in grads.items()}

    def counted_once(self, stored: Any) -> Any:
        return self.stages.counted_once(stored)  # a tied parameter has a copy in each stage using it

    def leaf_mask(self, names: set[str]) -> tuple[bool, ...] | None:
        if set(self.layout.names) <= names:
            return None
        raise OptimizerError(
            "some of a pipelined model's parameters cannot be picked out on their own: its stages pack them into "
            "shared buffers; take all of model.parameters() (to clip: or optimizer.clip_master_grads)"
        )

    def held_names(self, process: int) -> set[str]:
        mesh = self.layout.mesh
        by_stage = np.moveaxis(mesh.devices, mesh.axis_names.index("pp"), 0)
        local = {
            stage for stage, devices in enumerate(by_stage) if any(d.process_index == process for d in devices.flat)
        }
        return {n for n, places in self.stages.places.items() if any(p.stage in local for p in places)}


class StackStore:
    """Under ``scan_layers``: each weight of a layer stack as one array ``[layers, ...]`` under a stacked key
    (``jmp.stacks.storage``), split as one layer's weight is; every other parameter by its torch name."""

    def __init__(self, layout: ParameterLayout, groups: Mapping[str, tuple[str, ...]]):
        self.layout = layout
        self.groups = dict(groups)  # stacked key -> its torch names, in layer order
        key_of = {name: key for key, names in self.groups.items() for name in names}
        self.keys = tuple(dict.fromkeys(key_of.get(name, name) for name in layout.names))
        self.shapes = {key: self._stored_shape(key) for key in self.keys}
        self.specs = {key: self._stored_spec(key) for key in self.keys}

    def _stored_shape(self, key: str) -> tuple[int, ...]:
        names = self.groups.get(key)
        return (len(names), *self.layout.shapes[names[0]]) if names else tuple(self.layout.shapes[key])

    def _stored_spec(self, key: str) -> PartitionSpec:
        names = self.groups.get(key)
        if not names:
            return self.layout.specs[key]
        spec = tuple(self.layout.specs[names[0]])
        return PartitionSpec(None, *spec, *(None,) * (len(self.layout.shapes[names[0]]) - len(spec)))

    @functools.cached_property
    def shardings(self) -> dict[str, NamedSharding]:
        return {key: NamedSharding(self.layout.mesh, self.specs[key]) for key in self.keys}

    @property
    def packs_tensors(self) -> bool:
        return bool(self.groups)

    def pack(self, named: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        return self._packer(dict(named))

    def named(self, stored: Any) -> dict[str, jax.Array]:
        return self.unpack_present(stored)

    def as_tree(self, stored: Any) -> nnx.State:
        return self.layout.tree(self.named(stored))

    def in_trace(self, stored: Any, compute_dtypes: Mapping[str, Any] | None = None) -> nnx.State:
        named: dict[str, Any] = {}
        for key, value in stored.items():
            if key in self.groups:
                if compute_dtypes is not None:  # cast whole, so that each layer's view is a row of one array
                    value = value.astype(compute_dtypes[self.groups[key][0]])
                named.update(zip(self.groups[key], stacks_storage.layer_views(value)))
            else:
                named[key] = value
        return self.layout.tree(named)

    def snapshot(self, stored: Any) -> nnx.State:
        return self.as_tree(stored)  # unstacking writes new buffers

    def split_stack(self, by_name: Mapping[str, str]) -> str | None:
        """The first stack weight whose layers are in different param groups or partly frozen (``by_name``: each
        torch name's label), which one array cannot hold; None if there is none."""
        return next((key for key, names in self.groups.items() if len({by_name[n] for n in names}) > 1), None)

    def labels(self, by_name: Mapping[str, str]) -> dict[str, str]:
        return {key: by_name[self.groups[key][0] if key in self.groups else key] for key in self.keys}

    def state_shardings(self, state_shape: Any) -> Any:
        layout = self.layout
        specs = sharding.optimizer_specs(self.specs, self.shapes, layout.mesh, layout.config.shard_optimizer_state)
        return sharding.state_shardings(state_shape, specs, self.shapes, layout.mesh)

    def field_named(self, field: Any) -> Any:
        if not isinstance(field, dict):
            return field
        return nnx.State(self.unpack_present(field))

    def field_from_named(self, named: Mapping[str, jax.Array], like: Any) -> Any:
        keys = [k for k, v in like.items() if isinstance(v, jax.Array)]
        needed = {n: named[n] for k in keys for n in self.groups.get(k, (k,))}
        return {**like, **{k: v.astype(like[k].dtype) for k, v in self._packer(needed).items() if k in keys}}

    def is_parameter_shaped(self, node: Any) -> bool:
        return isinstance(node, nnx.State) or (isinstance(node, dict) and bool(node) and set(node) <= set(self.keys))

    def cast_grads(self, grads: Any, dtype_for: Callable[[list[str]], Any]) -> Any:
        return {key: g.astype(dtype_for(list(self.groups.get(key, (key,))))) for key, g in grads.items()}

    def counted_once(self, stored: Any) -> Any:
        return stored  # a tied parameter is never stacked (stacked_groups)

    def leaf_mask(self, names: set[str]) -> tuple[bool, ...] | None:
        if set(self.layout.names) <= names:
            return None
        mask = []
        for key in self.keys:
            held = set(self.groups.get(key, (key,))) & names
            if held and len(held) < len(self.groups.get(key, (key,))):
                raise OptimizerError(
                    f"some layers of '{key}' (under scan_layers, stored as one array) cannot be picked out on "
                    "their own; take every layer's weight, or set the config key scan_layers=False"
                )
            mask.append(bool(held))
        return tuple(mask)

    held_names = TreeStore.held_names  # by each parameter's own sharding, which a stacked weight's layers keep

    def unpack_present(self, stored: Mapping[str, Any]) -> dict[str, jax.Array]:
        """Stored arrays (any of the keys) -> arrays by torch name in new buffers, each placed by its parameter's
        own spec."""
        keys = [k for k, v in stored.items() if isinstance(v, jax.Array)]
        out = dict(copy_tree({k: stored[k] for k in keys if k not in self.groups}))
        for key in keys:
            if key in self.groups:
                row = self._row_reader(key)
                out.update((name, row(stored[key], i)) for i, name in enumerate(self.groups[key]))
        return out

    @functools.cache  # noqa: B019  (the store lives as long as its model; its programs should too)
    def _row_reader(self, key: str) -> Any:
        """One layer's row of a stacked array, the row's index an argument: one small program per stack weight
        (a program slicing out every row would hold a kernel per layer, and compile for seconds at depth)."""
        sharding = self.layout.sharding(self.groups[key][0])
        return jax.jit(
            lambda stacked, i: jax.lax.dynamic_index_in_dim(stacked, i, keepdims=False), out_shardings=sharding
        )

    def _packer(self, named: dict[str, jax.Array]) -> dict[str, jax.Array]:
        keys = tuple(k for k in self.keys if all(n in named for n in self.groups.get(k, (k,))))
        return self._pack_program(keys)(named)

    @functools.cache  # noqa: B019
    def _pack_program(self, keys: tuple[str, ...]) -> Any:
        def pack(named):
            return {k: jnp.stack([named[n] for n in self.groups[k]]) if k in self.groups else named[k] for k in keys}

        return jax.jit(pack, out_shardings={k: self.shardings[k] for k in keys})
