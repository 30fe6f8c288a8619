"""``load_sharded_optimizer_state_dict`` with SMP v2's ``process_group=``: an FSDP optimizer state read back from a
``torch.distributed.checkpoint`` (DCP) checkpoint, for jmp's FSDP wrapper.

PyTorch's function has no ``process_group`` (SMP's container adds it) and lays the state out as ``ShardedTensor``
chunks. jmp's FSDP state dicts hold full tensors (``jmp.fsdp.state_dicts``), which DCP writes once and reads back on
any layout, so here every rank of ``process_group`` reads each optimizer tensor whole: what jmp's
``FSDP.optim_state_dict_to_load`` takes. A model state dict holding torch's own sharded tensors (a torch FSDP
model's) goes to PyTorch's function.

``save_state_dict`` / ``load_state_dict`` take SMP v2's ``coordinator_rank``, the lowest *global* rank of
``process_group`` in its scripts, as SMP's containers' PyTorch read it; the PyTorch here reads a rank *in* the
group, so a group without global rank 0 (hybrid sharding's second replica) would fail (``group_coordinator``).

``save`` / ``async_save`` / ``load`` are ``jmp.fsdp.dcp_orbax``'s: Orbax for state dicts holding jmp's arrays
(``get_state_dict`` of a jmp FSDP model: ``jmp.fsdp.dcp_state_dicts``), torch's own for the rest.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict as torch_load
from torch.distributed.tensor import DTensor

from jmp.errors import StateDictError
from jmp.fsdp.dcp_orbax import async_save, load, save

__all__ = ["async_save", "load", "load_sharded_optimizer_state_dict", "load_state_dict", "save", "save_state_dict"]


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


def save_state_dict(
    state_dict: dict[str, Any],
    storage_writer: dcp.StorageWriter,
    process_group: Any = None,
    coordinator_rank: int = 0,
    no_dist: bool = False,
    planner: dcp.SavePlanner | None = None,
) -> dcp.metadata.Metadata:
    """PyTorch's ``save_state_dict``, its ``coordinator_rank`` a global rank of the group or a rank in it."""
    coordinator = group_coordinator(process_group, coordinator_rank, "save_state_dict", no_dist)
    return dcp.save_state_dict(state_dict, storage_writer, process_group, coordinator, no_dist, planner)


def load_state_dict(
    state_dict: dict[str, Any],
    storage_reader: dcp.StorageReader,
    process_group: Any = None,
    coordinator_rank: int = 0,
    no_dist: bool = False,
    planner: dcp.LoadPlanner | None = None,
) -> None:
    """PyTorch's ``load_state_dict``, its ``coordinator_rank`` a global rank of the group or a rank in it."""
    coordinator = group_coordinator(process_group, coordinator_rank, "load_state_dict", no_dist)
    dcp.load_state_dict(state_dict, storage_reader, process_group, coordinator, no_dist, planner)


def group_coordinator(process_group: Any, coordinator_rank: int, where: str, no_dist: bool = False) -> int:
    """The rank in ``process_group`` of the coordinator SMP v2's ``coordinator_rank`` names: the member with that
    global rank, else (no member has it) the group rank itself, as PyTorch reads it; a ``StateDictError`` when it is
    neither a member's global rank nor a rank in the group.
    """
    if process_group is None or no_dist or not dist.is_initialized():
        return coordinator_rank
    members = dist.get_process_group_ranks(process_group)
    if coordinator_rank in members:
        return members.index(coordinator_rank)
    if 0 <= coordinator_rank < len(members):
        return coordinator_rank
    raise StateDictError(
        f"torch.distributed.checkpoint.{where}(coordinator_rank={coordinator_rank}): the process group's global "
        f"ranks are {members}; pass one of them (SMP v2's scripts pass the lowest) or a rank in the group "
        f"(0 to {len(members) - 1})"
    )
