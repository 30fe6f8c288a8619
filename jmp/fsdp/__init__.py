"""PyTorch's FSDP API on jmp: an FSDP (or FSDP2) training script runs with its import line changed.

    from jmp.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy, fully_shard
    # instead of: from torch.distributed.fsdp import ...

The modules, one concept each, are listed in docs/code_map.md; under ``jmp.launch`` a script reaches them by
torch's names.
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
