"""PyTorch's FSDP API on jmp: an FSDP (or FSDP2) training script runs with its import line changed.

    from jmp.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy, fully_shard
    # instead of: from torch.distributed.fsdp import ...

- ``FullyShardedDataParallel`` (``fully_sharded``): a ``DistributedModel`` laid out as FSDP's arguments ask
  (``layout``), with FSDP's methods and class-level API (``state_dict_type``, ``optim_state_dict``,
  ``summon_full_params``, ``clip_grad_norm_``, ...; ``state_dicts``).
- ``DistributedDataParallel`` (``data_parallel``): PyTorch's DDP as FSDP's ``NO_SHARD`` layout.
- ``fully_shard`` (FSDP2, ``fully_shard``): marks modules and swaps their class in place; the root runs a
  ``FullyShardedDataParallel`` from its first call.
- ``init_device_mesh`` (``device_mesh``): named meshes counting devices; ``parallelize_module``
  (``tensor_parallel_plans``): PyTorch's tensor-parallel plans as jmp's per-parameter splits over ``tp``.
- ``apply_activation_checkpointing``, ``checkpoint_wrapper``, ``offload_wrapper`` (``activation_checkpointing``):
  jmp's remat and activation offloading.
- The option types and wrap policies are torch's own objects (``options``).
- ``torch.distributed.checkpoint`` for these models: ``get_state_dict`` / ``set_state_dict`` with jmp's sharded
  arrays (``dcp_state_dicts``), ``save`` / ``async_save`` / ``load`` of them on Orbax (``dcp_orbax``), SMP v2's
  ``process_group`` / ``coordinator_rank`` arguments (``distributed_checkpoint``); a script reaches them under
  ``jmp.launch`` by torch's names.
"""

from jmp.fsdp import options
from jmp.fsdp.activation_checkpointing import apply_activation_checkpointing, checkpoint_wrapper, offload_wrapper
from jmp.fsdp.data_parallel import DistributedDataParallel
from jmp.fsdp.device_mesh import DeviceMesh, init_device_mesh
from jmp.fsdp.fully_shard import FSDPModule, fully_shard
from jmp.fsdp.fully_sharded import FullyShardedDataParallel
from jmp.fsdp.options import *  # noqa: F403  (torch's option types and wrap policies, as options.__all__ lists)
from jmp.fsdp.tensor_parallel_plans import parallelize_module

FSDP = FullyShardedDataParallel

__all__ = [
    "FSDP",
    "DeviceMesh",
    "DistributedDataParallel",
    "FSDPModule",
    "FullyShardedDataParallel",
    "apply_activation_checkpointing",
    "checkpoint_wrapper",
    "fully_shard",
    "init_device_mesh",
    "offload_wrapper",
    "parallelize_module",
    *options.__all__,
]
