"""The option types of PyTorch's FSDP API, torch's own objects: a script's ``ShardingStrategy.HYBRID_SHARD`` or
``MixedPrecision(...)`` is the same whether it imports them from ``torch.distributed.fsdp`` or from ``jmp.fsdp``,
so ``isinstance`` and equality with torch's hold. The wrap policies are torch's too: jmp lays out the whole
wrapped model as one unit, and takes a policy only as the script's statement of where its layers are.
"""

from __future__ import annotations

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl  # noqa: F401
from torch.distributed.fsdp import (  # noqa: F401 (re-exported: __all__)
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from torch.distributed.fsdp.wrap import (  # noqa: F401 (re-exported: __all__)
    CustomPolicy,
    ModuleWrapPolicy,
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

__all__ = [name for name in dir() if not name.startswith("_") and name != "annotations"]  # the names imported above

# ShardingStrategy._HYBRID_SHARD_ZERO2 by its name (a private member: torch's own spelling of the enum)
HYBRID_ZERO2 = ShardingStrategy["_HYBRID_SHARD_ZERO2"]
HYBRID = (ShardingStrategy.HYBRID_SHARD, HYBRID_ZERO2)
KEEP_GATHERED = (ShardingStrategy.SHARD_GRAD_OP, HYBRID_ZERO2)  # parameters not resharded after the forward


def default_configs(kind: StateDictType) -> tuple[StateDictConfig, OptimStateDictConfig]:
    """torch's default model and optimizer state-dict configs for a state-dict type."""
    return {
        StateDictType.FULL_STATE_DICT: (FullStateDictConfig(), FullOptimStateDictConfig()),
        StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig(), ShardedOptimStateDictConfig()),
        StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig(), LocalOptimStateDictConfig()),
    }[kind]
