"""``torch.distributed.checkpoint.state_dict``'s API (``get_state_dict`` / ``set_state_dict`` and the model / optimizer
halves) for jmp's FSDP models: a ``FullyShardedDataParallel`` or a ``fully_shard`` root, and its torch optimizer.

Keys are torch's (the optimizer's ``state`` and ``param_groups`` by parameter name). Values follow
``StateDictOptions``: with ``full_state_dict=False`` (torch's default, where FSDP gives ``DTensor``s) they are jmp's
sharded ``jax.Array``s as the run holds them, which ``jmp.fsdp.dcp_orbax`` saves from their owners and loads into
the run's layout of the moment (with ``cpu_offload``, in the devices' host memory where they have one);
``full_state_dict=True`` gives full torch tensors on the host (with ``cpu_offload``, on rank 0 only, as torch does).
``set_*`` takes either kind (and a mix). A model or optimizer that is not jmp's goes to torch's own functions.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import torch
import torch.distributed.checkpoint.state_dict as torch_state_dict
from flax import nnx
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.nn.modules.module import _IncompatibleKeys

from jmp.eager import plain_optimizers
from jmp.errors import StateDictError
from jmp.fsdp import state_dicts
from jmp.fsdp.fully_shard import MARK, root_model
from jmp.fsdp.fully_sharded import FullyShardedDataParallel, model_of
from jmp.optim.distributed_optimizer import DistributedOptimizer
from jmp.torch_bridge import named_variables
from jmp.torch_bridge.interop import tensor_to_array
from jmp.wrapped_model.distributed_model import DistributedModel
from jmp.wrapped_model.records import copy_tree

__all__ = [
    "StateDictOptions",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]


def get_model_state_dict(
    model: nn.Module, *, submodules: set[nn.Module] | None = None, options: StateDictOptions | None = None
) -> dict[str, Any]:
    """The model's parameters and persistent buffers by fully qualified name (see the module's docstring)."""
    wrapper = _jmp_model(model)
    if wrapper is None:
        return torch_state_dict.get_model_state_dict(model, submodules=submodules, options=options)
    options = _checked(options, submodules, "get_model_state_dict")
    frozen = {n for n, p in wrapper.torch_module.named_parameters() if not p.requires_grad}
    if options.full_state_dict:
        values = DistributedModel.state_dict(wrapper)  # gathered: every process takes part
        if options.cpu_offload and wrapper.rank != 0:
            return {}
        return {k: v for k, v in values.items() if not (options.ignore_frozen_params and k in frozen)}
    values = {}
    for name, variable in named_variables(wrapper.flax_module):
        if not variable.get_metadata("persistent", True) or (options.ignore_frozen_params and name in frozen):
            continue
        values[name] = _offloaded(variable[...]) if options.cpu_offload else variable[...]
    return values


def get_optimizer_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """The optimizer's state in torch's format with parameters by name (see the module's docstring)."""
    wrapper = _jmp_model(model)
    if wrapper is None:
        return torch_state_dict.get_optimizer_state_dict(model, optimizers, submodules=submodules, options=options)
    options = _checked(options, submodules, "get_optimizer_state_dict")
    distributed = _distributed_optimizer(wrapper, optimizers, "get_optimizer_state_dict")
    torch_optimizer = distributed.torch_optimizer
    if options.full_state_dict:
        state = distributed.state_dict()  # gathered: every process takes part
        if options.cpu_offload and wrapper.rank != 0:
            return {}
    else:
        per_param = distributed.state_arrays()
        arrays = copy_tree({i: {k: v for k, v in e.items() if isinstance(v, jax.Array)} for i, e in per_param.items()})
        per_param = {i: entry | arrays[i] for i, entry in per_param.items()}  # new buffers: the next step donates
        if options.cpu_offload:
            per_param = jax.tree.map(lambda v: _offloaded(v) if isinstance(v, jax.Array) else v, per_param)
        state = torch.optim.Optimizer.state_dict(torch_optimizer) | {"state": per_param}
    return state_dicts.optimizer_by_names(wrapper.torch_module, torch_optimizer, state)


def get_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``get_model_state_dict``, ``get_optimizer_state_dict``)."""
    if _jmp_model(model) is None:
        return torch_state_dict.get_state_dict(model, optimizers, submodules=submodules, options=options)
    return (
        get_model_state_dict(model, submodules=submodules, options=options),
        get_optimizer_state_dict(model, optimizers, submodules=submodules, options=options),
    )


def set_model_state_dict(
    model: nn.Module, model_state_dict: dict[str, Any], *, options: StateDictOptions | None = None
) -> _IncompatibleKeys:
    """Load ``model_state_dict`` (jmp's arrays, torch tensors, or both) into the model, each value put in its
    parameter's current sharding; returns the missing and unexpected keys (an error for them with ``strict``)."""
    wrapper = _jmp_model(model)
    if wrapper is None:
        return torch_state_dict.set_model_state_dict(model, model_state_dict, options=options)
    options = _checked(options, None, "set_model_state_dict")
    module = wrapper.flax_module
    variables = {n: v for n, v in named_variables(module) if v.get_metadata("persistent", True)}
    frozen = {n for n, p in wrapper.torch_module.named_parameters() if not p.requires_grad}
    expected = set(variables) - (frozen if options.ignore_frozen_params else set())
    missing = sorted(expected - set(model_state_dict))
    unexpected = sorted(set(model_state_dict) - set(variables))
    mismatched = [
        f"{name}: given {tuple(value.shape)}, model {tuple(variables[name][...].shape)}"
        for name, value in model_state_dict.items()
        if name in variables and tuple(value.shape) != tuple(variables[name][...].shape)
    ]
    if mismatched or (options.strict and (missing or unexpected)):
        raise StateDictError(
            "set_model_state_dict: the state dict does not fit the model ("
            + "; ".join(
                f"{what}: {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}"
                for what, names in (("shapes differ", mismatched), ("missing", missing), ("unexpected", unexpected))
                if names
            )
            + ")"
            + ("" if mismatched else "; pass StateDictOptions(strict=False) to load the matching part")
        )
    for name, value in model_state_dict.items():
        if name in variables:
            current = variables[name][...]
            array = value if isinstance(value, jax.Array) else tensor_to_array(value)
            variables[name][...] = jax.device_put(array.astype(current.dtype), current.sharding)
    _, params, rest = nnx.split(module, nnx.Param, ...)
    wrapper.training_state.params = wrapper.store.pack(wrapper.layout.by_name(params))
    wrapper.training_state.rest = rest
    return _IncompatibleKeys(missing, unexpected)


def set_optimizer_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    optim_state_dict: dict[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> None:
    """Load ``optim_state_dict`` (parameters by name; jmp's arrays or torch tensors) into the optimizer."""
    wrapper = _jmp_model(model)
    if wrapper is None:
        return torch_state_dict.set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    _checked(options, None, "set_optimizer_state_dict")
    distributed = _distributed_optimizer(wrapper, optimizers, "set_optimizer_state_dict")
    by_index = state_dicts.optimizer_by_indices(wrapper.torch_module, distributed.torch_optimizer, optim_state_dict)
    distributed.load_state_dict(by_index)
    return None


def set_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    model_state_dict: dict[str, Any],
    optim_state_dict: dict[str, Any],
    options: StateDictOptions | None = None,
) -> _IncompatibleKeys:
    """``set_model_state_dict`` then ``set_optimizer_state_dict`` (an empty one of either is skipped)."""
    if _jmp_model(model) is None:
        return torch_state_dict.set_state_dict(
            model, optimizers, model_state_dict=model_state_dict, optim_state_dict=optim_state_dict, options=options
        )
    keys = _IncompatibleKeys([], [])
    if model_state_dict:
        keys = set_model_state_dict(model, model_state_dict, options=options)
    if optim_state_dict:
        set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return keys


def _jmp_model(model: nn.Module) -> FullyShardedDataParallel | None:
    """The jmp FSDP model that runs ``model`` (a ``fully_shard`` root's is built now if it has not run yet)."""
    found = model_of(model)
    if found is None and MARK in getattr(model, "__dict__", {}):
        found = root_model(model)
    return found


def _distributed_optimizer(wrapper: FullyShardedDataParallel, optimizers: Any, where: str) -> DistributedOptimizer:
    given = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
    if len(given) != 1:
        raise StateDictError(
            f"torch.distributed.checkpoint.state_dict.{where}: jmp's FSDP model takes one optimizer, not "
            f"{len(given)}; build a single optimizer with several param groups"
        )
    optimizer = given[0]
    distributed = (
        optimizer
        if isinstance(optimizer, DistributedOptimizer)
        else plain_optimizers.distributed_optimizer_of(optimizer)
    )
    if distributed is None or distributed.model is not wrapper or distributed.torch_optimizer is None:
        raise StateDictError(
            f"torch.distributed.checkpoint.state_dict.{where}: the {type(optimizer).__name__} does not update this "
            "model's parameters; build it on model.parameters() after wrapping the model"
        )
    return distributed


def _checked(options: StateDictOptions | None, submodules: Any, where: str) -> StateDictOptions:
    """``options`` (torch's defaults if None), refusing what jmp's FSDP state dicts do not give."""
    options = options or StateDictOptions()
    refused = []
    if submodules:
        refused.append("submodules= (a part of the model; take the whole state dict and pick its keys)")
    if options.broadcast_from_rank0:
        refused.append("broadcast_from_rank0=True (every process loads the full state dict it is given)")
    if options.flatten_optimizer_state_dict:
        refused.append("flatten_optimizer_state_dict=True (the optimizer's state stays nested, as torch's default)")
    if refused:
        raise StateDictError(
            f"torch.distributed.checkpoint.state_dict.{where} on a jmp FSDP model does not take " + "; ".join(refused)
        )
    return options


def _offloaded(array: jax.Array) -> jax.Array:
    """``array`` in its devices' pinned host memory, where that is not the memory it is in already."""
    sharding = array.sharding
    kinds = {memory.kind for memory in next(iter(sharding.device_set)).addressable_memories()}
    if "pinned_host" not in kinds or sharding.memory_kind in ("pinned_host", "unpinned_host"):
        return array
    if jax.devices()[0].platform == "cpu":  # a CPU device's own memory is the host's
        return array
    return jax.device_put(array, sharding.with_memory_kind("pinned_host"))
