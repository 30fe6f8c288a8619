"""torch's activation-checkpointing wrappers (``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``) as
jmp's remat: ``apply_activation_checkpointing``, ``checkpoint_wrapper``, ``offload_wrapper``.

A chosen module is marked, as ``smp.set_activation_checkpointing`` marks it, instead of wrapped: the module tree and
state-dict names stay the script's (torch's wrappers change the names and strip them again in their state-dict
hooks), and every wrapper function returns the module it was given. ``offload_wrapper`` puts what the checkpointed
modules inside it keep (their inputs) in host memory, or makes a module with none inside one checkpoint whose inputs
go there: jmp offloads what checkpoints keep and recomputes the rest, where torch's ``save_on_cpu`` keeps every
saved activation. A module marked before its model is wrapped is checkpointed once the FSDP wrapper lays it out.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as torch_wrappers
from torch import nn

from jmp.errors import ArgumentTypeError
from jmp.fsdp.layout import log_once
from jmp.fsdp.options import CheckpointImpl, lambda_auto_wrap_policy
from jmp.remat.api import set_activation_checkpointing
from jmp.runtime import live_models
from jmp.wrapped_model.distributed_model import DistributedModel

OFFLOADED_INPUTS = "offload_names:input"  # the remat policy: a checkpoint's inputs go to host memory

# module -> whether what it keeps goes to the host: marked in a live model (_applied) or waiting for one (_pending)
_applied: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
_pending: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
_offloading: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # modules given to offload_wrapper


def checkpoint_wrapper(
    module: nn.Module,
    checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
    checkpoint_fn: Callable[..., Any] | None = None,
    **checkpoint_fn_kwargs: Any,
) -> nn.Module:
    """Checkpoint every call of ``module`` (torch's ``checkpoint_wrapper``); returns ``module`` itself.

    ``checkpoint_impl`` (reentrant or not) computes the same here: both are ``jax.checkpoint``. A
    ``checkpoint_fn`` (Transformer Engine's, ...) and its keyword arguments are not called: jmp recomputes with
    ``jax.checkpoint``, and says so once.
    """
    if not isinstance(checkpoint_impl, CheckpointImpl):
        raise ArgumentTypeError(f"checkpoint_wrapper: checkpoint_impl takes a CheckpointImpl, not {checkpoint_impl!r}")
    if checkpoint_fn is not None or checkpoint_fn_kwargs:
        log_once(
            "checkpoint_wrapper(checkpoint_fn=%r, %s): jmp checkpoints with jax.checkpoint; the function is not called",
            checkpoint_fn,
            ", ".join(f"{k}=..." for k in checkpoint_fn_kwargs),
        )
    root = _tree(module, "checkpoint_wrapper")
    _mark(root, offload=any(_contains(outer, root) for outer in _offloading))
    return module


def offload_wrapper(module: nn.Module) -> nn.Module:
    """What ``module`` keeps for the backward goes to host memory (torch's ``offload_wrapper``); returns ``module``.

    The checkpointed modules inside it offload their inputs; without any, ``module`` itself becomes one checkpoint
    whose inputs are offloaded (its forward runs again in the backward).
    """
    root = _tree(module, "offload_wrapper")
    _offloading.add(root)
    marked = [m for m in root.modules() if m in _applied or m in _pending]
    if not marked:
        log_once(
            "offload_wrapper(%s): no module inside is checkpointed, so the whole module becomes one checkpoint whose "
            "inputs go to host memory (its forward runs again in the backward). Apply activation checkpointing to "
            "its layers first to offload each layer's input instead.",
            type(root).__name__,
        )
        marked = [root]
    for submodule in marked:
        _mark(submodule, offload=True)
    return module


def apply_activation_checkpointing(
    model: nn.Module,
    checkpoint_wrapper_fn: Callable[[nn.Module], nn.Module] = checkpoint_wrapper,
    check_fn: Callable[[nn.Module], bool] = lambda _: True,
    auto_wrap_policy: Callable[..., bool] | None = None,
) -> None:
    """Checkpoint (or offload) each submodule of ``model`` that ``check_fn`` (or ``auto_wrap_policy``) selects, as
    torch's ``apply_activation_checkpointing`` wraps them: children first, never ``model`` itself.

    ``model``: the FSDP-wrapped model (or any ``smp.DistributedModel``), or the module before it is wrapped.
    ``checkpoint_wrapper_fn``: ``checkpoint_wrapper`` or ``offload_wrapper``, torch's or jmp's, or a
    ``functools.partial`` of one (``checkpoint_impl=...``).
    """
    wrap = _wrapper(checkpoint_wrapper_fn)
    root = _tree(model, "apply_activation_checkpointing")
    if auto_wrap_policy is None:
        if not callable(check_fn):
            raise ArgumentTypeError(f"apply_activation_checkpointing: check_fn must be callable, not {check_fn!r}")
        policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=check_fn)
    elif callable(auto_wrap_policy):
        policy = auto_wrap_policy
    else:
        raise ArgumentTypeError(
            f"apply_activation_checkpointing: auto_wrap_policy must be a callable policy, not {auto_wrap_policy!r}"
        )
    chosen, _ = _chosen(root, policy, is_root=True)
    for submodule in chosen:
        wrap(submodule)


def apply_pending(model: DistributedModel) -> None:
    """Checkpoint the modules of ``model`` marked before it was wrapped."""
    for submodule in model.torch_module.modules():
        if submodule in _pending:
            _mark(submodule, _pending[submodule])


def _mark(module: nn.Module, offload: bool) -> None:
    if live_models.owners_of(module):
        set_activation_checkpointing(module, policy=OFFLOADED_INPUTS if offload else None)
        _applied[module] = offload
        _pending.pop(module, None)
    else:
        _pending[module] = offload


def _chosen(module: nn.Module, policy: Callable[..., bool], is_root: bool) -> tuple[list[nn.Module], int]:
    """The modules ``policy`` wraps, in torch's order (``_recursive_wrap``: children first), and their parameters'
    count."""
    total = sum(p.numel() for p in module.parameters())
    if not policy(module=module, recurse=True, nonwrapped_numel=total):
        return [], 0
    chosen, wrapped = [], 0
    for child in module.children():
        below, count = _chosen(child, policy, is_root=False)
        chosen += below
        wrapped += count
    if not is_root and policy(module=module, recurse=False, nonwrapped_numel=total - wrapped):
        return [*chosen, module], total
    return chosen, wrapped


def _wrapper(fn: Callable[..., Any]) -> Callable[[nn.Module], Any]:
    target, keywords = (fn.func, fn.keywords) if isinstance(fn, functools.partial) else (fn, {})
    if target in (checkpoint_wrapper, torch_wrappers.checkpoint_wrapper):
        return lambda module: checkpoint_wrapper(module, **keywords)
    if target in (offload_wrapper, torch_wrappers.offload_wrapper):
        return offload_wrapper
    raise ArgumentTypeError(
        f"apply_activation_checkpointing: checkpoint_wrapper_fn {fn!r} is not one jmp knows; give checkpoint_wrapper "
        "or offload_wrapper (torch's or jmp.fsdp's), or a functools.partial of one"
    )


def _tree(module: Any, where: str) -> nn.Module:
    """The torch module tree of ``module`` (a ``DistributedModel``'s wrapped module)."""
    if isinstance(module, DistributedModel):
        return module.torch_module
    if not isinstance(module, nn.Module):
        raise ArgumentTypeError(f"{where} takes a torch.nn.Module, not {type(module).__name__}")
    return module


def _contains(outer: nn.Module, module: nn.Module) -> bool:
    return any(m is module for m in outer.modules())
