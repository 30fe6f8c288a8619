"""``DistributedDataParallel``: PyTorch's DDP wrapper as a ``DistributedModel`` with every parameter replicated.

DDP is FSDP's ``NO_SHARD`` layout (``jmp.fsdp.layout``); what a torchrun DDP script gets under
``python -m jmp.launch``: docs/running_scripts.md. Arguments that tune DDP's reducer have nothing to tune in one
compiled XLA program: they are accepted, and a non-default value is logged once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import jax
from torch import nn

from jmp.errors import ArgumentTypeError
from jmp.fsdp import layout, materialise
from jmp.fsdp.options import MixedPrecision, ShardingStrategy
from jmp.runtime import mesh_state
from jmp.wrapped_model.distributed_model import DistributedModel

WHERE = "DistributedDataParallel"
PREFIX = "module."  # PyTorch DDP's state_dict keys are its child's, under "module."

_DEFAULTS = {  # argument -> the value that needs no notice
    "device_ids": None,
    "output_device": None,
    "dim": 0,
    "bucket_cap_mb": None,
    "find_unused_parameters": False,
    "check_reduction": False,
    "gradient_as_bucket_view": False,
    "static_graph": False,
    "delay_all_reduce_named_params": None,
    "param_to_hook_all_reduce": None,
    "device_mesh": None,
    "skip_all_reduce_unused_params": False,
    "bucket_cap_mb_list": None,
    "batched_grad_copy": False,
    "forward_sync_buffers": None,
}
_XLA = "XLA schedules the gradients' reduction inside the compiled step"
_QUIET = {"device_ids", "output_device"}  # what torchrun scripts pass routinely


class DistributedDataParallel(DistributedModel):
    """PyTorch's ``DistributedDataParallel`` (torch 2.13's signature) on jmp: the module replicated on every
    data-parallel device, its gradients averaged over the processes.

    Args:
        module: the model; ``.module`` gives it back holding the current values.
        process_group: accepted; the data-parallel processes are the mesh's (every process by default).
        init_sync: process 0's parameters and buffers are sent to every process (DDP's constructor).
        mixed_precision: DDP's ``_MixedPrecision``: its ``param_dtype`` bf16 / fp16 computes in it with float32
            master parameters, as FSDP's ``MixedPrecision``.
        device_ids, output_device, dim, broadcast_buffers, bucket_cap_mb, find_unused_parameters and the other
            reducer settings: accepted, no effect (buffers are process 0's after each step, as DDP broadcasts them).

    Raises:
        ArgumentTypeError: ``module`` is not a torch module, or already laid out by jmp.
        ConfigError: what ``DistributedModel`` refuses.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Any = None,
        output_device: Any = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: Any = None,
        mixed_precision: Any = None,
        **reducer: Any,
    ):
        if isinstance(module, DistributedModel) or not isinstance(module, nn.Module):
            laid_out = " already laid out by jmp; wrap the module itself, once" if isinstance(module, nn.Module) else ""
            raise ArgumentTypeError(f"{WHERE} takes a torch.nn.Module, not a {type(module).__name__}{laid_out}")
        unknown = sorted(set(reducer) - set(_DEFAULTS))
        if unknown:
            raise ArgumentTypeError(f"{WHERE} got unexpected keyword arguments {unknown}")
        given = {"device_ids": device_ids, "output_device": output_device, "dim": dim, **reducer}
        for name, value in given.items():
            if name not in _QUIET and value != _DEFAULTS[name]:
                layout.log_once("%s(%s=%r): has no effect in jmp: %s", WHERE, name, value, _XLA)
        if broadcast_buffers is False:
            layout.log_once("%s(broadcast_buffers=False): buffers are process 0's after each step", WHERE)
        if not mesh_state.is_initialized():
            mesh_state.init()  # as smp.init(): the config from SM_HP_MP_PARAMETERS, else the defaults
        if mixed_precision is not None:
            mixed_precision = MixedPrecision(
                param_dtype=mixed_precision.param_dtype,
                reduce_dtype=mixed_precision.reduce_dtype,
                buffer_dtype=mixed_precision.buffer_dtype,
            )
        wanted = layout.request(ShardingStrategy.NO_SHARD, None, None, mixed_precision, WHERE)
        if init_sync and jax.process_count() > 1:
            materialise.sync_from_process_zero(module)
        layout.apply(wanted, WHERE)
        super().__init__(module)
        self.process_group = layout.shard_group(ShardingStrategy.NO_SHARD) if process_group is None else process_group
        self.device_ids = device_ids
        self.require_backward_grad_sync = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's gradient accumulation without synchronisation. The gradients accumulate on the devices until
        ``zero_grad()`` either way; the mean over processes is linear, so the step after the block updates with
        what DDP's synchronising backward gives."""
        before = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Load a state dict under the module's names, or under PyTorch DDP's (``module.`` first); ``state_dict()``
        gives the module's names, as jmp's FSDP and SMP's ``DistributedModel``."""
        own = set(self.layout.names)  # a module whose own child is named "module" keeps its keys
        if state_dict and all(key.startswith(PREFIX) for key in state_dict) and not own & set(state_dict):
            state_dict = {key.removeprefix(PREFIX): value for key, value in state_dict.items()}
        DistributedModel.load_state_dict(self, dict(state_dict), strict)
