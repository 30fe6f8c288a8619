"""Per-parameter layouts on the mesh: rule tables keyed by torch parameter names give each a ``PartitionSpec``."""

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
