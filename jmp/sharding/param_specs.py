"""Where each parameter, gradient and optimizer-state array lives: one ``PartitionSpec`` per parameter.

Expert, tensor-parallel and user rules (regex on the torch name, used as given) come first; sharded data
parallelism then splits each parameter's largest free dimension over ``fsdp`` (ZeRO-3) and
``shard_optimizer_state`` the optimizer state over ``dp`` (ZeRO-1). Parameters under
``sdp_param_persistence_threshold`` elements stay whole. A grouped convolution's weight stays whole over
``fsdp`` unless the degree divides its ``groups`` (XLA's partitioner aborts on a finer gradient split).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from torch import nn

from jmp.errors import ConfigError
from jmp.runtime import mesh_state as state
from jmp.sharding.experts import expert_specs
from jmp.sharding.tensor_parallel import tensor_parallel_specs
from jmp.torch_bridge import torch_name

CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
REPLICATED_BELOW = 1024  # elements; the persistence threshold before smp.init, and ZeRO-1's

Spec = tuple  # one entry per dimension: None, an axis name, or a tuple of axis names


def parameter_specs(
    module: nn.Module,
    shapes: Mapping[str, tuple[int, ...]],
    mesh: Mesh,
    rules: Mapping[str, Any] | None = None,
    *,
    persist_below: int | None = None,
) -> dict[str, PartitionSpec]:
    """Torch parameter name -> its ``PartitionSpec`` on ``mesh`` (under ``persist_below`` elements: not over fsdp)."""
    below = persistence_threshold() if persist_below is None else persist_below
    model_specs = {
        **tensor_parallel_specs(module, mesh.shape["tp"]),
        **expert_specs(module, mesh.shape["ep"], mesh.shape["tp"]),
    }
    compiled = [(re.compile(pattern), spec) for pattern, spec in (rules or {}).items()]
    whole = {
        f"{path}.weight".lstrip(".")
        for path, conv in module.named_modules()  # grouped convolutions
        if isinstance(conv, CONVOLUTIONS) and conv.groups > 1 and conv.groups % mesh.shape["fsdp"]
    }
    specs = {}
    for name, shape in shapes.items():
        user = next((spec for pattern, spec in compiled if pattern.search(name)), None)
        if user is not None:
            specs[name] = _checked_user_spec(name, shape, user, mesh)
            continue
        spec = _padded(model_specs.get(name, ()), len(shape))
        specs[name] = PartitionSpec(*(spec if name in whole else add_axis(spec, shape, ("fsdp",), mesh, below)))
    return specs


def optimizer_specs(specs: Mapping[str, PartitionSpec], shapes: Mapping[str, tuple], mesh: Mesh, shard: bool):
    """The optimizer state's spec for each parameter: the parameter's, split once more over ``dp`` for ZeRO-1."""
    if not shard:
        return dict(specs)
    return {name: PartitionSpec(*add_axis(_padded(tuple(specs[name]), len(shapes[name])), shapes[name], ("dp",), mesh))
            for name in specs}  # fmt: skip


def persistence_threshold() -> int:
    """The config's ``sdp_param_persistence_threshold`` (``REPLICATED_BELOW`` before ``smp.init``)."""
    return state.get_config().sdp_param_persistence_threshold if state.is_initialized() else REPLICATED_BELOW


def add_axis(
    spec: Spec, shape: tuple[int, ...], axes: tuple[str, ...], mesh: Mesh, below: int = REPLICATED_BELOW
) -> Spec:
    """``spec`` with ``axes`` on the largest dimension they divide (a free one first), if ``below`` elements or more."""
    size = math.prod(mesh.shape[a] for a in axes)
    if size == 1 or math.prod(shape) < below:
        return spec
    spec = list(spec)
    by_size = sorted(range(len(shape)), key=lambda d: -shape[d])
    for dim in by_size:
        if spec[dim] is None and shape[dim] % size == 0:
            spec[dim] = axes[0] if len(axes) == 1 else axes
            return tuple(spec)
    for dim in by_size:
        present = _axes_of(spec[dim])
        if present and shape[dim] % (size * math.prod(mesh.shape[a] for a in present)) == 0:
            spec[dim] = present + axes
            return tuple(spec)
    return tuple(spec)  # nothing divides: stays whole along these axes


def without_axis(spec: PartitionSpec, axis: str) -> PartitionSpec:
    """``spec`` with ``axis`` removed from every dimension (a parameter split over fsdp, gathered over it)."""
    kept = [tuple(a for a in _axes_of(entry) if a != axis) for entry in spec]
    return PartitionSpec(*(None if not axes else axes[0] if len(axes) == 1 else axes for axes in kept))


def splits_over(spec: PartitionSpec, axis: str) -> bool:
    return any(axis in _axes_of(entry) for entry in spec)


def spec_axes(spec: PartitionSpec) -> tuple[str, ...]:
    """The mesh axes splitting a parameter laid out by ``spec``, in order."""
    return tuple(axis for entry in spec for axis in _axes_of(entry))


def named_shardings(tree: Any, specs: Mapping[str, PartitionSpec], mesh: Mesh) -> Any:
    """A tree like ``tree`` (an ``nnx.State`` of parameters) of ``NamedSharding``s, by torch name."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: NamedSharding(mesh, specs.get(torch_name(path), PartitionSpec())), tree
    )


def state_shardings(state: Any, specs: Mapping[str, PartitionSpec], shapes: Mapping[str, tuple], mesh: Mesh) -> Any:
    """Shardings for an optimizer state: a leaf shaped like a parameter, under its name, gets that parameter's spec.

    A leaf's parameter is the longest tail of its dict keys that names one; the rest is replicated.
    """

    def placed(path: tuple, leaf: Any) -> NamedSharding:
        keys = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
        for start in range(len(keys)):
            name = ".".join(keys[start:])
            if name in specs and tuple(shapes[name]) == tuple(leaf.shape):
                return NamedSharding(mesh, specs[name])
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree_util.tree_map_with_path(placed, state)


def _padded(spec: Spec, rank: int) -> Spec:
    return tuple(spec) + (None,) * (rank - len(spec))


def _axes_of(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _checked_user_spec(name: str, shape: tuple, spec: Any, mesh: Mesh) -> PartitionSpec:
    spec = PartitionSpec(*spec) if not isinstance(spec, PartitionSpec) else spec
    if len(spec) > len(shape):
        raise ConfigError(
            f"sharding rule for '{name}': {spec} has {len(spec)} entries; the parameter has shape {shape}"
        )
    for dim, entry in enumerate(spec):
        axes = _axes_of(entry)
        unknown = [a for a in axes if a not in mesh.shape]
        if unknown:
            raise ConfigError(
                f"sharding rule for '{name}': unknown mesh axis {unknown[0]!r}; the axes are {tuple(mesh.shape)}"
            )
        degree = math.prod(mesh.shape[a] for a in axes)
        if shape[dim] % degree:
            raise ConfigError(
                f"sharding rule for '{name}': dimension {dim} ({shape[dim]}) does not divide over {entry!r} "
                f"(degree {degree}); change the rule or the degree"
            )
    return spec
