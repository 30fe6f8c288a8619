"""A plain torch optimizer on a ``DistributedModel``'s parameters becomes a ``DistributedOptimizer`` at its first step.

Torch's ``step()`` would update host copies, not the model. A global step pre-hook wraps the optimizer and runs
the wrapper's step before torch's (which then sees no ``param.grad`` and changes nothing); ``zero_grad`` and the
state-dict methods become the wrapper's, and a state loaded before the first step is taken over then.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from jmp.errors import OptimizerError
from jmp.optim import model_lookup
from jmp.optim.distributed_optimizer import DistributedOptimizer
from jmp.runtime import notices

ROUTED = ("zero_grad", "state_dict", "load_state_dict")  # step stays torch's (LR schedulers wrap it); the hook acts

_installed: list[Any] = []
# the wrapper lives on the torch optimizer it wraps (a cycle the collector frees with both); a WeakKeyDictionary
# would keep every such optimizer, and its model, alive, as its value holds its key
WRAPPER = "_jmp_distributed_optimizer"
HIDDEN = "_jmp_hidden_grads"  # the p.grad torch's own step must not see (it would update host copies)


def install() -> None:
    if not _installed:
        _installed.append(register_optimizer_step_pre_hook(_step_on_the_devices))
        _installed.append(register_optimizer_step_post_hook(_show_grads_again))


def distributed_optimizer_of(optimizer: torch.optim.Optimizer) -> DistributedOptimizer | None:
    """The ``DistributedOptimizer`` a plain torch optimizer on a model's parameters stands for (made now if its first
    ``step()`` has not come); None for an optimizer of other tensors."""
    distributed = getattr(optimizer, WRAPPER, None)
    if distributed is None:
        if not model_lookup.owners_of(optimizer):
            return None
        distributed = DistributedOptimizer(optimizer)
        setattr(optimizer, WRAPPER, distributed)
        for name in ROUTED:
            setattr(optimizer, name, getattr(distributed, name))
        _take_over_loaded_state(optimizer, distributed)
        notices.info_once(
            f"eager:wrapped:{type(optimizer).__name__}",
            "torch.optim.%s on a smp.DistributedModel's parameters: wrapped in smp.DistributedOptimizer at its "
            "first step(); each step() updates the model's sharded state, and its zero_grad and state_dict are "
            "the wrapper's",
            type(optimizer).__name__,
        )
    return distributed


def _step_on_the_devices(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    distributed = distributed_optimizer_of(optimizer)
    if distributed is None:
        return  # an optimizer of plain torch parameters: torch's own step
    distributed.step()
    # torch's step runs next: with no p.grad to see, it changes nothing; they are back after it
    hidden = [(p, p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    for parameter, _ in hidden:
        parameter.grad = None
    setattr(optimizer, HIDDEN, hidden)


def _show_grads_again(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    for parameter, grad in getattr(optimizer, HIDDEN, ()):
        parameter.grad = grad
    setattr(optimizer, HIDDEN, [])


def _take_over_loaded_state(optimizer: torch.optim.Optimizer, distributed: DistributedOptimizer) -> None:
    """Move what torch's ``load_state_dict`` put in ``optimizer.state`` before the first ``step()`` to the devices."""
    loaded = torch.optim.Optimizer.state_dict(optimizer)  # torch's own: state_dict is the wrapper's now
    if not loaded["state"]:
        return
    tensors = [v for entry in loaded["state"].values() for v in entry.values() if isinstance(v, torch.Tensor)]
    if any(t.is_meta for t in tensors):  # torch moved the loaded tensors to the parameters' device
        raise OptimizerError(
            f"the state loaded into torch.optim.{type(optimizer).__name__} before its first step() was moved to "
            "the meta device, where the parameters of a model built under smp.delay_param_initialization() live, "
            "and its values are lost. Wrap the optimizer first, smp.DistributedOptimizer(optimizer), then call "
            "its load_state_dict"
        )
    distributed.load_state_dict(loaded)
