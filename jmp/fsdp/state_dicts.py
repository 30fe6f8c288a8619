"""FSDP's state dicts on jmp: what ``model.state_dict()`` gives under each ``StateDictType``, and the optimizer's
state keyed by parameter name (``FSDP.optim_state_dict`` / ``FSDP.optim_state_dict_to_load``).

- ``FULL_STATE_DICT``: the full tensors under torch's names, gathered on the host; with
  ``FullStateDictConfig(rank0_only=True)`` processes other than rank 0 of the FSDP group get ``{}``.
- ``SHARDED_STATE_DICT``: the same full tensors, not FSDP's ``ShardedTensor`` / ``DTensor`` pieces: a full tensor is
  what ``torch.distributed.checkpoint`` and ``load_state_dict`` read back on any layout (jmp's own reshardable
  checkpoints are ``smp.save_checkpoint(partial=True)``).
- ``LOCAL_STATE_DICT``: this process's pieces (``local_state_dict()``), loadable on the same layout.
"""

from __future__ import annotations

import torch
from torch import nn

from jmp.errors import StateDictError
from jmp.fsdp.options import OptimStateDictConfig, StateDictConfig, StateDictSettings, StateDictType, default_configs


def settings(
    kind: StateDictType, model_config: StateDictConfig | None, optim_config: OptimStateDictConfig | None
) -> StateDictSettings:
    """The settings ``FSDP.set_state_dict_type`` records (torch's defaults for the configs not given)."""
    if not isinstance(kind, StateDictType):
        raise StateDictError(f"FSDP.state_dict_type takes a StateDictType, not {kind!r}")
    default_model, default_optim = default_configs(kind)
    return StateDictSettings(kind, model_config or default_model, optim_config or default_optim)


def rank0_only(config: StateDictConfig | OptimStateDictConfig) -> bool:
    return bool(getattr(config, "rank0_only", False))


def optimizer_by_names(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """``state`` (torch's format, parameters by index in ``optimizer``'s groups) with each index replaced by the
    parameter's name in ``module``."""
    names = _names(module)
    order = [p for group in optimizer.param_groups for p in group["params"]]
    unknown = [i for i, p in enumerate(order) if id(p) not in names]
    if unknown:
        raise StateDictError(
            f"FSDP.optim_state_dict: {len(unknown)} parameter(s) of the optimizer (indices {unknown[:4]}) are not "
            "parameters of the model; build the optimizer on model.parameters()"
        )
    name_of = [names[id(p)] for p in order]
    groups = state.get("param_groups", [])
    return {
        **state,
        "state": {name_of[int(i)]: entry for i, entry in state.get("state", {}).items()},
        "param_groups": [{**g, "params": [name_of[int(i)] for i in g["params"]]} for g in groups],
    }


def optimizer_by_indices(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """The inverse of ``optimizer_by_names`` for ``optimizer``: parameter names -> its indices."""
    names = _names(module)
    order = [names.get(id(p)) for group in optimizer.param_groups for p in group["params"]]
    index_of = {name: i for i, name in enumerate(order) if name is not None}
    saved = [name for group in state.get("param_groups", []) for name in group["params"]]
    missing = sorted(set(saved) - set(index_of))
    if missing:
        raise StateDictError(
            f"FSDP.optim_state_dict_to_load: the saved optimizer state names parameters this optimizer does not "
            f"update ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); build the optimizer on the "
            "same model's parameters, in the same param groups"
        )
    return {
        **state,
        "state": {index_of[name]: entry for name, entry in state.get("state", {}).items()},
        "param_groups": [{**g, "params": [index_of[n] for n in g["params"]]} for g in state.get("param_groups", [])],
    }


def _names(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name (the first, for tied parameters), as ``named_parameters()`` gives them."""
    return {id(p): name for name, p in module.named_parameters()}
