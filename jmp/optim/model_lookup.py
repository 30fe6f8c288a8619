"""The ``DistributedModel`` a ``DistributedOptimizer`` updates: given, else the one holding its parameters."""

from __future__ import annotations

import torch

from jmp.errors import ArgumentTypeError, ModelLookupError
from jmp.runtime import live_models as model_registry
from jmp.wrapped_model.distributed_model import DistributedModel


def model_updated_by(torch_optimizer: torch.optim.Optimizer | None, given: DistributedModel | None) -> DistributedModel:
    """The model ``torch_optimizer`` (None: an optax transformation) updates; ``given`` is the ``model=`` argument."""
    if given is not None:
        if not isinstance(given, DistributedModel):
            raise ArgumentTypeError(f"model= takes a smp.DistributedModel, not {type(given).__name__}")
        return given
    if torch_optimizer is None:
        return model_registry.the_only(
            "smp.DistributedOptimizer(<optax transformation>)", "pass model= to say which one it updates"
        )
    owners = owners_of(torch_optimizer)
    if len(owners) == 1:
        return owners[0]
    if not owners:
        raise ModelLookupError(
            f"the {type(torch_optimizer).__name__} optimizer's parameters belong to no "
            "smp.DistributedModel; wrap the model first, then build the optimizer on model.module.parameters()"
        )
    raise ModelLookupError(
        f"the {type(torch_optimizer).__name__} optimizer's parameters belong to {len(owners)} "
        "smp.DistributedModels (one torch module wrapped twice?); pass model= to say which one it updates"
    )


def owners_of(torch_optimizer: torch.optim.Optimizer) -> list[DistributedModel]:
    """The live models holding any of ``torch_optimizer``'s parameters."""
    held = {id(p) for g in torch_optimizer.param_groups for p in g["params"]}
    return [m for m in model_registry.live() if any(id(p) in held for p in m.torch_module.parameters())]
