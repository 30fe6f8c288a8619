"""``load_sharded_optimizer_state_dict`` with SMP v2's ``process_group=``: an FSDP optimizer state read back from a
``torch.distributed.checkpoint`` (DCP) checkpoint, for jmp's FSDP wrapper.

SMP v2's scripts call ``load_sharded_optimizer_state_dict(model_state_dict=, optimizer_key=, storage_reader=,
process_group=model.process_group)``; PyTorch's function has no ``process_group`` (SMP's container adds it) and
lays the state out as ``ShardedTensor`` chunks over the ranks, which FSDP's ``optim_state_dict_to_load`` takes.
jmp's FSDP state dicts hold full tensors (``jmp.fsdp.state_dicts``), DCP writes them once (it de-duplicates a
tensor every rank holds whole) and reads them back on any layout, so here each optimizer tensor is read whole
by every rank of ``process_group``: what ``FSDP.optim_state_dict_to_load`` of jmp's wrapper takes. Under
``python -m jmp.launch`` a script's ``torch.distributed.checkpoint.optimizer.load_sharded_optimizer_state_dict``
is this function (the launcher's ``sitecustomize``); a model state dict holding torch's own sharded tensors
(``ShardedTensor`` / ``DTensor``: a torch FSDP model's) goes to PyTorch's function.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict as torch_load
from torch.distributed.tensor import DTensor

from jmp.errors import StateDictError


def load_sharded_optimizer_state_dict(
    model_state_dict: dict[str, Any],
    optimizer_key: str,
    storage_reader: dcp.StorageReader,
    planner: dcp.LoadPlanner | None = None,
    process_group: Any = None,
) -> dict[str, Any]:
    """The entries of the checkpoint under ``optimizer_key``, nested as saved (``{optimizer_key: {"state": {name:
    {...}}, "param_groups": [...]}}``), each tensor whole; read by the ranks of ``process_group`` (default: all)."""
    if any(isinstance(value, (ShardedTensor, DTensor)) for value in model_state_dict.values()):
        if process_group is not None:
            raise StateDictError(
                "load_sharded_optimizer_state_dict(process_group=...): the model state dict holds PyTorch's sharded "
                "tensors (a torch FSDP model's), whose layout PyTorch's function reads without a process group; "
                "pass none"
            )
        return torch_load(model_state_dict, optimizer_key, storage_reader, planner)
    metadata = storage_reader.read_metadata()
    state: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if metadata.planner_data[key][0] != optimizer_key:
            continue
        if isinstance(entry, BytesStorageMetadata):
            state[key] = "<bytes_io>"  # replaced by the saved object (DefaultLoadPlanner.load_bytes)
        else:
            state[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
    if not state:
        raise StateDictError(
            f"load_sharded_optimizer_state_dict: the checkpoint has no entries under {optimizer_key!r} (its keys "
            f"start with {sorted({metadata.planner_data[k][0] for k in metadata.state_dict_metadata})})"
        )
    dcp.load(state, storage_reader=storage_reader, planner=planner, process_group=process_group)
    return unflatten_state_dict(state, metadata.planner_data)
