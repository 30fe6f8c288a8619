"""FSDP2's ``fully_shard`` on jmp: torchtitan's ``for block in model.layers: fully_shard(block)`` then
``fully_shard(model)``, and a loop that keeps calling the original ``model``.

As FSDP2 does, each call swaps the module's class in place for ``FSDP<ClassName>`` (``FSDPModule`` first in its
MRO). The first call of such a module from the script (not from inside a jmp forward) makes it the root, as FSDP2's
lazy initialisation does: its ``FullyShardedDataParallel`` is built then, laid out as the calls asked, so a
meta-device model the script materialised after ``fully_shard`` (``model.to_empty(...)``; ``init_weights()``) is
built with the script's values. From then on the root's ``__call__`` / ``forward`` run the jmp model; its
parameters and module tree stay the module's own (what the torch optimizer and ``p.grad`` are read through), and
``state_dict()``, ``load_state_dict``, ``train()`` / ``eval()`` act on both.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from jmp.errors import ArgumentTypeError
from jmp.fsdp.fully_sharded import JMP_MODEL, WRITING_BACK, FullyShardedDataParallel, model_of, writing_back
from jmp.fsdp.layout import log_once
from jmp.fsdp.options import (
    HYBRID_ZERO2,
    CPUOffload,
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
)
from jmp.torch_bridge import dispatch

MARK = "_jmp_fully_shard"  # the options of the fully_shard call on a module
_classes: dict[type, type] = {}


@dataclasses.dataclass(frozen=True)
class ShardOptions:
    """What one ``fully_shard`` call asked for its module."""

    mesh: Any
    reshard_after_forward: bool | int | None
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy
    ignored_params: frozenset


class FSDPModule:
    """What ``fully_shard`` adds to a module's class (the ``FSDP<ClassName>`` classes: this first in the MRO)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if dispatch.current_scope() is not None:  # called by the jmp model's own forward: the module's code runs
            return nn.Module.__call__(self, *args, **kwargs)
        return root_model(self)(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if dispatch.current_scope() is not None:
            return super().forward(*args, **kwargs)
        return root_model(self)(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``state_dict``, with the model's current values written into it first."""
        built = model_of(self)
        if built is not None and WRITING_BACK not in self.__dict__:
            built.module  # noqa: B018 (reading it writes the current values into this module)
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load into the module and, once it has run, into its jmp model."""
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        built = model_of(self)
        if built is not None:
            built.load_state_dict(state_dict, strict=strict)
        return result

    def train(self, mode: bool = True) -> Any:
        built = model_of(self)
        if built is None or WRITING_BACK in self.__dict__:
            return super().train(mode)
        with writing_back(self):
            built.train(mode)  # switches this module too
        return self

    def reshard(self) -> None:
        """Accepted: jmp's step program gathers and frees the parameters itself."""
        _no_effect("reshard()")

    def unshard(self, async_op: bool = False) -> None:
        """Accepted: jmp's step program gathers and frees the parameters itself."""
        _no_effect("unshard()")

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Accepted: gradients accumulate on the devices either way, and the step after sees the same sum."""
        _no_effect("set_requires_gradient_sync()")

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Accepted before the first call (it sets what the root's layout uses); after, the layout is fixed."""
        if model_of(self) is not None:
            _no_effect("set_reshard_after_forward() after the model's first call")
            return
        for module in self.modules() if recurse else [self]:
            options = module.__dict__.get(MARK)
            if options is not None:
                module.__dict__[MARK] = dataclasses.replace(options, reshard_after_forward=reshard_after_forward)


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: Any = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Any = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
) -> Any:
    """Mark ``module`` (or each of a list) for FSDP2 and give it its ``FSDP<ClassName>`` class; returns it.

    Raises:
        ArgumentTypeError: an argument of the wrong type, ``dp_mesh_dims`` (an SPMD mesh), or a module whose model
            has already run.
    """
    modules = list(module) if isinstance(module, list) else [module]
    for each in modules:
        if not isinstance(each, nn.Module):
            raise ArgumentTypeError(f"fully_shard takes a torch.nn.Module (or a list), not {type(each).__name__}")
        if model_of(each) is not None:
            raise ArgumentTypeError(
                f"fully_shard({type(each).__name__}): its model has already run; call fully_shard on every module "
                "before the model's first call"
            )
    if not isinstance(mp_policy, MixedPrecisionPolicy) or not isinstance(offload_policy, OffloadPolicy):
        raise ArgumentTypeError("fully_shard: mp_policy takes a MixedPrecisionPolicy, offload_policy an OffloadPolicy")
    if dp_mesh_dims is not None:
        raise ArgumentTypeError(
            "fully_shard(dp_mesh_dims=...): jmp lays out data parallelism on its own mesh; pass the data-parallel "
            "DeviceMesh as mesh= (1-D: sharded; 2-D: replicate x shard) and tensor parallelism through smp.init"
        )
    if shard_placement_fn is not None:
        log_once("fully_shard(shard_placement_fn=...): has no effect in jmp: its sharding rules place each parameter")
    options = ShardOptions(mesh, reshard_after_forward, mp_policy, offload_policy, frozenset(ignored_params or ()))
    for each in modules:
        each.__dict__[MARK] = options
        each.__class__ = _fsdp_class(type(each))
    return module


def _fsdp_class(cls: type) -> type:
    if issubclass(cls, FSDPModule):
        return cls
    if cls not in _classes:
        _classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})
    return _classes[cls]


def root_model(root: nn.Module) -> FullyShardedDataParallel:
    """The jmp model that runs ``root``, built at its first call from the script."""
    built = model_of(root)
    if built is not None:
        return built
    options: ShardOptions = root.__dict__[MARK]
    blocks = [m.__dict__[MARK] for m in root.modules() if m is not root and MARK in m.__dict__]
    if blocks:  # FSDP2's default: the blocks reshard after their forward, the root does not
        reshard = all(b.reshard_after_forward is not False for b in blocks)
    else:
        reshard = bool(options.reshard_after_forward)
    if any(isinstance(o.reshard_after_forward, int) and not isinstance(o.reshard_after_forward, bool)
           for o in (options, *blocks)):  # fmt: skip
        log_once("fully_shard(reshard_after_forward=<int>): jmp gathers layers over the whole shard group")
    policy = options.mp_policy
    if {_compute_dtype(b.mp_policy) for b in blocks} - {_compute_dtype(policy)}:
        log_once("fully_shard: the blocks' mp_policy differs from the root's; jmp computes the model in the root's")
    hybrid = options.mesh is not None and options.mesh.ndim == 2
    if hybrid:
        strategy = ShardingStrategy.HYBRID_SHARD if reshard else HYBRID_ZERO2
    else:
        strategy = ShardingStrategy.FULL_SHARD if reshard else ShardingStrategy.SHARD_GRAD_OP
    offload = isinstance(options.offload_policy, CPUOffloadPolicy)
    built = FullyShardedDataParallel(
        root,
        process_group=None,
        sharding_strategy=strategy,
        cpu_offload=CPUOffload(offload_params=True) if offload else None,
        mixed_precision=MixedPrecision(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype),
        device_mesh=options.mesh,
        ignored_states=list(options.ignored_params) or None,
    )
    root.__dict__[JMP_MODEL] = built
    log_once(
        "fully_shard: %s runs as one jmp model from its first call (%s, %d blocks marked); calling it, forward(), "
        "state_dict(), load_state_dict() and train() reach that model",
        type(root).__name__,
        strategy.name,
        len(blocks),
    )
    return built


def _compute_dtype(policy: MixedPrecisionPolicy) -> torch.dtype | None:
    return None if policy.param_dtype in (None, torch.float32) else policy.param_dtype


def _no_effect(call: str) -> None:
    log_once("FSDPModule.%s: has no effect in jmp: XLA schedules the step's gathers and reductions", call)
