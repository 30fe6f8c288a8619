"""Per-parameter layouts on the ``("pp", "dp", "fsdp", "ep", "tp")`` mesh: the sharding rules.

Rules are data keyed by torch parameter names: ``layout`` combines tensor-parallel, expert-parallel, user and
sharded-data rules into one ``PartitionSpec`` per parameter, and XLA inserts the collectives (the expert
dispatch is a ``shard_map``). Pipelines are ``jmp.pipeline``.
"""

from jmp.sharding.param_specs import (
    REPLICATED_BELOW,
    named_shardings,
    optimizer_specs,
    parameter_specs,
    spec_axes,
    splits_over,
    state_shardings,
    without_axis,
)
from jmp.sharding.tensor_parallel import set_tensor_parallelism, tensor_parallelism

__all__ = [
    "REPLICATED_BELOW",
    "named_shardings",
    "optimizer_specs",
    "parameter_specs",
    "set_tensor_parallelism",
    "spec_axes",
    "splits_over",
    "state_shardings",
    "tensor_parallelism",
    "without_axis",
]
