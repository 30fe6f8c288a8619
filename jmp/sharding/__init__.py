"""Per-parameter layouts on the ``("pp", "dp", "fsdp", "ep", "tp")`` mesh: the sharding rules.

Pipeline stages and schedules are not here: they are ``jmp.pipeline``.

Rules are data keyed by torch parameter names (the converted modules' paths
equal torch ``state_dict`` keys): ``layout`` combines tensor-parallel
(``tensor_parallel``), expert-parallel (``experts``), user and sharded-data rules
into one ``PartitionSpec`` per parameter; XLA's SPMD partitioner inserts the
collectives, except the expert dispatch, which ``experts`` writes with ``shard_map``.
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
