"""Token embeddings under sharded data parallelism: the table gathered for the lookup, the output laid out as the
step's inputs are.

ZeRO-3 may split a table's features over fsdp; the lookup's output would then carry that layout down the
residual stream and every layer would all-gather the whole batch. Constrained to the batch's layout, the lookup
gathers the table instead (explicitly under ``reshard_after_forward``: ``gathering.gathered_for_use``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from torch import nn

from jmp.runtime import mesh_state as state
from jmp.sharding.batch_spec import batch_spec
from jmp.sharding.gathering import gathered_for_use
from jmp.sharding.param_specs import splits_over
from jmp.torch_bridge import JaxTensor, dispatch
from jmp.torch_bridge.module import CallHook
from jmp.torch_bridge.variable_writes import write

Gathered = Mapping[str, tuple[NamedSharding, NamedSharding]]  # parameter name -> (used, stored) shardings


def hooks(model: nn.Module, specs: Mapping[str, PartitionSpec], mesh: Mesh, gathered: Gathered) -> dict[str, CallHook]:
    """Call hooks (by torch path) for the embeddings of ``model`` whose tables ``specs`` split over fsdp;
    ``gathered``: the parameters gathered for use (empty without ``reshard_after_forward``)."""
    found = {}
    for path, module in model.named_modules():
        name = f"{path}.weight"
        if isinstance(module, nn.Embedding) and splits_over(specs.get(name, PartitionSpec()), "fsdp"):
            found[path] = functools.partial(_embedding_call, mesh, gathered.get(name))
    return found


def _embedding_call(
    mesh: Mesh, shardings: tuple[NamedSharding, NamedSharding] | None, module: Any, call, *args, **kwargs
):
    if dispatch.batch_axis() is not None or jax.sharding.get_abstract_mesh().manual_axes:
        return call(*args, **kwargs)  # inside a per-process vmap, or a shard_map: not the global batch
    if shardings is None:
        return _laid_out_as_batch(mesh, call(*args, **kwargs))
    table = module.weight.get_value()
    write(module.weight, gathered_for_use(table, *shardings))
    try:
        out = call(*args, **kwargs)
    finally:
        write(module.weight, table)
    return _laid_out_as_batch(mesh, out)


def _laid_out_as_batch(mesh: Mesh, out: Any) -> Any:
    if not isinstance(out, JaxTensor):
        return out
    value = out.value
    rows = math.prod(mesh.shape[axis] for axis in state.DATA_AXES)
    if value.ndim < 2 or value.shape[0] % rows:
        return out  # not batch-first rows (a position table's [1, S] lookup)
    spec = batch_spec(value.shape[:-1], 0, state.DATA_AXES, mesh)
    spec = PartitionSpec(*spec, *[PartitionSpec.UNCONSTRAINED] * (value.ndim - len(spec)))
    return JaxTensor(jax.lax.with_sharding_constraint(value, NamedSharding(mesh, spec)), out.dtype)
