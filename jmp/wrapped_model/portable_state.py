"""A model's and an optimizer's state as flat, layout-independent dicts of arrays (what a partial checkpoint holds).

Keys name what a value is, not where it lives: parameters by torch name (a pipelined model's stage buffers
unpacked), buffers and the random stream by their path in the module, optimizer state by its path in the
optax state with each parameter-shaped field expanded by torch name. The same model and optimizer under
another mesh, parallelism or pipeline split give the same keys and shapes, so a checkpoint written under one
layout restores under another, each array read straight into its new sharding. Restoring builds the state to
hold and leaves the model and optimizer untouched: the caller assigns once everything has been read, so a failed
load changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from jmp.torch_bridge import torch_name

PARAMS = "params"
BUFFERS = "buffers"
OPTIMIZER = "optimizer"
LOSS_SCALE = "loss_scale"


def _path_name(path: tuple) -> str:
    parts = []
    for entry in path:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                parts.append(str(getattr(entry, attr)))
                break
    return "/".join(parts)


def _is_key(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def model_arrays(model: Any) -> dict[str, jax.Array]:
    """``params/<torch name>`` (float32 masters in mixed precision) and ``buffers/<path>`` (random keys as
    their raw key data)."""
    params = model.store.named(model.training_state.params)
    out = {f"{PARAMS}/{name}": value for name, value in params.items()}
    for path, leaf in jax.tree_util.tree_leaves_with_path(model.training_state.rest):
        if isinstance(leaf, jax.Array):
            out[f"{BUFFERS}/{_path_name(path)}"] = jax.random.key_data(leaf) if _is_key(leaf) else leaf
    return out


def targets(arrays: Mapping[str, jax.Array]) -> dict[str, jax.ShapeDtypeStruct]:
    """What each of ``arrays`` is restored into: its shape, dtype and sharding (under the current layout)."""
    return {key: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for key, v in arrays.items()}


def model_state_from(model: Any, arrays: Mapping[str, jax.Array]) -> tuple[Any, Any]:
    """(params as the model stores them, rest) with each value in ``arrays`` replacing the model's own."""
    current = model.store.named(model.training_state.params)
    named = {name: arrays.get(f"{PARAMS}/{name}", value) for name, value in current.items()}
    params = model.store.pack(named)

    def buffer(path: tuple, leaf: Any) -> Any:
        value = arrays.get(f"{BUFFERS}/{_path_name(path)}") if isinstance(leaf, jax.Array) else None
        if value is None:
            return leaf
        return jax.random.wrap_key_data(value, impl=jax.random.key_impl(leaf)) if _is_key(leaf) else value

    return params, jax.tree_util.tree_map_with_path(buffer, model.training_state.rest)


def _parameter_shaped(optimizer: Any) -> Any:
    """Whether a node of the optax state is one field laid out like the parameters (a tree by parameter
    path, or a pipelined model's stage buffers by buffer key)."""
    return optimizer.model.store.is_parameter_shaped


def _by_name(optimizer: Any, field: Any) -> dict[str, jax.Array]:
    if isinstance(field, nnx.State):
        leaves = jax.tree_util.tree_leaves_with_path(field)
        return {torch_name(path): leaf for path, leaf in leaves if isinstance(leaf, jax.Array)}
    return dict(optimizer.model.store.field_named(field).items())


def optimizer_arrays(optimizer: Any) -> dict[str, jax.Array]:
    """``optimizer/<path in the optax state>[/<torch name>]`` and ``loss_scale/<field>``."""
    out: dict[str, jax.Array] = {}
    is_field = _parameter_shaped(optimizer)
    for path, node in jax.tree_util.tree_leaves_with_path(optimizer.opt_state, is_leaf=is_field):
        prefix = f"{OPTIMIZER}/{_path_name(path)}"
        if is_field(node):
            out |= {f"{prefix}/{name}": value for name, value in _by_name(optimizer, node).items()}
        elif isinstance(node, jax.Array):
            out[prefix] = node
    if optimizer.scale_state is not None:
        for path, leaf in jax.tree_util.tree_leaves_with_path(optimizer.scale_state):
            out[f"{LOSS_SCALE}/{_path_name(path)}".rstrip("/")] = leaf
    return out


def optimizer_state_from(optimizer: Any, arrays: Mapping[str, jax.Array]) -> tuple[Any, Any]:
    """(optax state, loss-scale state) with each value in ``arrays`` replacing the optimizer's own."""
    is_field = _parameter_shaped(optimizer)

    def rebuild(path: tuple, node: Any) -> Any:
        prefix = f"{OPTIMIZER}/{_path_name(path)}"
        if not is_field(node):
            return arrays.get(prefix, node) if isinstance(node, jax.Array) else node
        if isinstance(node, nnx.State):
            return jax.tree_util.tree_map_with_path(
                lambda p, leaf: arrays.get(f"{prefix}/{torch_name(p)}", leaf) if isinstance(leaf, jax.Array) else leaf,
                node,
            )
        store = optimizer.model.store
        if not any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(node)):
            return node  # an abstract model's (smp.estimate_memory): no values to move
        names = list(jax.eval_shape(store.field_named, node))  # unpacked only for names ``arrays`` lacks
        current = store.field_named(node) if any(f"{prefix}/{n}" not in arrays for n in names) else {}
        named = {name: arrays[f"{prefix}/{name}"] if f"{prefix}/{name}" in arrays else current[name] for name in names}
        return store.field_from_named(named, like=node)

    opt_state = jax.tree_util.tree_map_with_path(rebuild, optimizer.opt_state, is_leaf=is_field)
    opt_state = jax.tree.map(  # packed fields come back laid out as the parameters; ZeRO-1 splits them further
        lambda leaf, sharding: jax.device_put(leaf, sharding) if isinstance(leaf, jax.Array) else leaf,
        opt_state,
        optimizer.state_shardings,
    )
    scale_state = optimizer.scale_state
    if scale_state is not None:
        scale_state = jax.tree_util.tree_map_with_path(
            lambda p, leaf: arrays.get(f"{LOSS_SCALE}/{_path_name(p)}".rstrip("/"), leaf), scale_state
        )
    return opt_state, scale_state
