"""A plain torch optimizer built on a ``DistributedModel``'s parameters is refused at ``step()``, with how to wrap
it: the gradients of a step jmp ran live on the devices, not in ``param.grad``, so torch's own ``step()`` would
skip every parameter and train nothing without a word.

Installed (a global optimizer step pre-hook, ``torch.optim.optimizer.register_optimizer_step_pre_hook``) by the
first implicit step, as such loops are where an unwrapped optimizer is written.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from jmp.errors import OptimizerError
from jmp.model import live_models

_installed: list[Any] = []


def install() -> None:
    if not _installed:
        _installed.append(register_optimizer_step_pre_hook(_refuse_model_parameters))


def _refuse_model_parameters(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in live_models.live():
        if any(id(p) in held for p in model.torch_module.parameters()):
            raise OptimizerError(
                f"{type(optimizer).__name__}.step() on the parameters of a smp.DistributedModel: their gradients "
                "are on the devices, so torch's step would update nothing. Wrap the optimizer once, after "
                "building it: optimizer = smp.DistributedOptimizer(optimizer), and call step() and zero_grad() on "
                "that (it takes the same param groups, schedulers and state_dict)."
            )
