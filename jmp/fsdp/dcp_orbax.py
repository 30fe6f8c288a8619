"""``torch.distributed.checkpoint``'s ``save`` / ``async_save`` / ``load`` on Orbax, for state dicts of jmp's arrays.

A state dict with a ``jax.Array`` anywhere in it (``get_state_dict`` of a jmp FSDP model, ``jmp.fsdp.dcp_state_dicts``)
is written as an Orbax checkpoint in the ``checkpoint_id`` directory: every process writes the shards it owns (no
array is gathered), torch tensors are written whole by process 0, and other Python objects are pickled (loaded back
under ``jmp.saving.user_content``'s rule: plain data, no code run), beside a JSON ``meta`` item describing each value.
Crash safety is jmp's partial checkpoints' (``jmp.saving.partial``): a save killed half way leaves the previous
checkpoint loadable. ``load`` reads each ``jax.Array`` straight into the sharding of the array it replaces (so a
checkpoint saved at one layout or process count loads at another) and copies into torch tensors in place, as
torch's ``load`` does. A state dict without jmp's arrays, and a directory torch wrote, go to torch's own functions.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint import state_dict_loader as torch_loader
from torch.distributed.checkpoint import state_dict_saver as torch_saver

from jmp.errors import CheckpointError, StateDictError
from jmp.runtime import comm
from jmp.saving import partial, user_content
from jmp.saving.orbax_import import orbax_checkpoint, root_logging_kept
from jmp.torch_bridge.interop import array_to_tensor, tensor_to_array

logger = logging.getLogger("jmp")

FORMAT = "jmp.distributed_checkpoint"
VALUES, META, OBJECTS = "values", "meta", "objects"
ARRAY, TENSOR = "array", "tensor"  # a jmp array, written by its owners; a torch tensor, written by process 0

_writes = partial.BackgroundWrites("jmp-dcp")
wait_for_saves = _writes.wait


def holds_jmp_arrays(state_dict: Mapping) -> bool:
    return any(isinstance(value, jax.Array) for _, value in _leaves(state_dict))


def save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | Path | None = None,
    storage_writer: Any = None,
    planner: Any = None,
    process_group: Any = None,
    no_dist: bool = False,
    use_collectives: bool = True,
) -> Any:
    """torch's ``save``; for a state dict holding jmp's arrays the Orbax checkpoint described above (returns None
    once it is complete: torch's ``Metadata`` describes torch's own files)."""
    if not holds_jmp_arrays(state_dict):
        given = dict(checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner, no_dist=no_dist)
        return torch_saver.save(state_dict, process_group=process_group, use_collectives=use_collectives, **given)
    _start(state_dict, _directory(checkpoint_id, storage_writer, "save"), planner, process_group).result()
    return None


def async_save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | Path | None = None,
    storage_writer: Any = None,
    planner: Any = None,
    process_group: Any = None,
    **torch_options: Any,
) -> concurrent.futures.Future:
    """torch's ``async_save``; for a state dict holding jmp's arrays it returns once the values are copied off the
    devices (training may go on), and the Future's ``result()`` waits until the checkpoint is in place."""
    if not holds_jmp_arrays(state_dict):
        given = dict(checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner, **torch_options)
        return torch_saver.async_save(state_dict, process_group=process_group, **given)
    return _start(state_dict, _directory(checkpoint_id, storage_writer, "async_save"), planner, process_group)


def load(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | Path | None = None,
    storage_reader: Any = None,
    planner: Any = None,
    process_group: Any = None,
    no_dist: bool = False,
) -> None:
    """torch's ``load``; a checkpoint ``save`` wrote with jmp's arrays is read into ``state_dict`` as described above.

    Raises:
        StateDictError: a key of ``state_dict`` the checkpoint lacks (unless the planner is
            ``DefaultLoadPlanner(allow_partial_load=True)``), a shape that differs, or jmp's arrays to read from
            a checkpoint torch wrote.
    """
    root = _directory(checkpoint_id, storage_reader, "load")
    wait_for_saves()
    if jax.process_count() > 1:
        comm.barrier()  # process 0 has put its last save in place (the swap of a re-saved checkpoint_id)
    meta = _meta(root)
    if meta is None:
        if holds_jmp_arrays(state_dict):
            raise StateDictError(
                f"torch.distributed.checkpoint.load: {root} is not a checkpoint jmp wrote (torch's files, or none), "
                "and the state dict holds jmp's arrays (get_state_dict of a jmp FSDP model); load it into "
                "get_state_dict(..., options=StateDictOptions(full_state_dict=True))'s tensors instead"
            )
        return torch_loader.load(
            state_dict,
            checkpoint_id=checkpoint_id,
            storage_reader=storage_reader,
            planner=planner,
            process_group=process_group,
            no_dist=no_dist,
        )
    _check_group(process_group, "load")
    partial = _allows_partial_load(planner)
    saved = meta["entries"]
    wanted = {}
    for path, target in _leaves(state_dict):
        key = _key(path)
        if key not in saved:
            if partial:
                continue
            raise StateDictError(
                f"torch.distributed.checkpoint.load: {root} has no value for {'.'.join(map(str, path))} (it holds "
                f"{len(saved)} values); pass planner=DefaultLoadPlanner(allow_partial_load=True) to load the rest"
            )
        shape = saved[key].get("shape")
        if isinstance(target, (jax.Array, torch.Tensor)) and shape is not None and list(target.shape) != shape:
            raise StateDictError(
                f"torch.distributed.checkpoint.load: {'.'.join(map(str, path))} is {tuple(shape)} in {root}, "
                f"{tuple(target.shape)} in the state dict to load; build the same model"
            )
        wanted[key] = (path, target)
    values = _restore(root, saved, wanted)
    for key, (path, target) in wanted.items():
        value = values[key]
        if isinstance(target, torch.Tensor):
            with torch.no_grad():
                target.copy_(array_to_tensor(value) if isinstance(value, (np.ndarray, jax.Array)) else value)
        else:
            _parent(state_dict, path)[path[-1]] = value


def _start(state_dict: Mapping, target: Path, planner: Any, process_group: Any) -> concurrent.futures.Future:
    if planner is not None and type(planner) is not DefaultSavePlanner:
        raise StateDictError(
            f"torch.distributed.checkpoint.save: a state dict holding jmp's arrays is written by jmp's Orbax writer, "
            f"which takes no {type(planner).__name__}; pass no planner"
        )
    _check_group(process_group, "save")
    values, objects, entries = {}, {}, {}
    for index, (path, value) in enumerate(_leaves(state_dict)):
        key = _key(path)
        if isinstance(value, jax.Array):
            values[f"v{index}"] = value
            entries[key] = {"kind": ARRAY, "item": f"v{index}", "shape": list(value.shape), "dtype": str(value.dtype)}
        elif isinstance(value, torch.Tensor):
            host = np.asarray(tensor_to_array(value))  # a copy: the run may change the tensor while this writes
            values[f"v{index}"] = host
            entries[key] = {"kind": TENSOR, "item": f"v{index}", "shape": list(host.shape), "dtype": str(host.dtype)}
        else:
            objects[key] = value
            entries[key] = {"kind": OBJECTS}
    if objects:
        blob = user_content.to_bytes(objects, call="torch.distributed.checkpoint.save")
        values[OBJECTS] = np.frombuffer(blob, np.uint8)
    meta = {"format": FORMAT, "entries": entries}
    return _writes.start(target, (VALUES, META), values, meta, "torch.distributed.checkpoint.save")


def _meta(root: Path) -> dict | None:
    """The checkpoint's description, None where jmp did not write one (read from its file: no collective)."""
    try:
        meta = json.loads((root / META / "metadata").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else None


def _restore(root: Path, saved: dict, wanted: dict) -> dict[str, Any]:
    """The values ``wanted`` asks for by key: jmp's arrays in their targets' shardings, the rest on the host."""
    item, restore_args = {}, {}
    ocp = orbax_checkpoint()
    objects_wanted = False
    for key, (_, target) in wanted.items():
        entry = saved[key]
        if entry["kind"] == OBJECTS:
            objects_wanted = True
        elif isinstance(target, jax.Array) and entry["kind"] == ARRAY:
            item[entry["item"]] = jax.ShapeDtypeStruct(target.shape, target.dtype, sharding=target.sharding)
            restore_args[entry["item"]] = ocp.ArrayRestoreArgs(sharding=target.sharding, dtype=target.dtype)
        else:
            item[entry["item"]] = np.zeros(0, np.uint8)
            restore_args[entry["item"]] = ocp.RestoreArgs(restore_type=np.ndarray)
    if objects_wanted:
        item[OBJECTS] = np.zeros(0, np.uint8)
        restore_args[OBJECTS] = ocp.RestoreArgs(restore_type=np.ndarray)
    try:
        with root_logging_kept():
            restored = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(
                root.absolute(),
                args=ocp.args.Composite(
                    **{VALUES: ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)}
                ),
            )[VALUES]
    except Exception as error:
        raise CheckpointError(
            f"torch.distributed.checkpoint.load: reading {root} failed (a truncated or corrupted checkpoint?): "
            f"{type(error).__name__}: {error}"
        ) from error
    objects = user_content.from_bytes(np.asarray(restored[OBJECTS]).tobytes(), str(root)) if objects_wanted else {}
    out = {}
    for key, (_, target) in wanted.items():
        entry = saved[key]
        value = objects[key] if entry["kind"] == OBJECTS else restored[entry["item"]]
        if isinstance(target, jax.Array) and entry["kind"] == TENSOR:  # a tensor saved whole, loaded into shards
            value = jax.device_put(np.asarray(value).astype(target.dtype), target.sharding)
        out[key] = value
    return out


def _leaves(tree: Mapping, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(key path, value) of each value in the nested dicts of ``tree`` (an empty dict is a value)."""
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, (*path, key))
        else:
            yield (*path, key), value


def _key(path: tuple) -> str:
    return json.dumps(list(path))


def _parent(tree: dict, path: tuple) -> dict:
    for key in path[:-1]:
        tree = tree[key]
    return tree


def _directory(checkpoint_id: Any, storage: Any, call: str) -> Path:
    """The directory ``checkpoint_id`` or a ``FileSystemWriter`` / ``FileSystemReader`` names."""
    if checkpoint_id is not None:
        return Path(checkpoint_id)
    path = getattr(storage, "path", None)
    if storage is None or path is None:
        raise StateDictError(
            f"torch.distributed.checkpoint.{call}: give checkpoint_id=<directory> or a FileSystemWriter / "
            f"FileSystemReader (got {type(storage).__name__}): jmp's arrays are written to a directory by Orbax"
        )
    return Path(str(path))


def _allows_partial_load(planner: Any) -> bool:
    if planner is None:
        return False
    if not isinstance(planner, DefaultLoadPlanner):
        raise StateDictError(
            f"torch.distributed.checkpoint.load: jmp's checkpoints are read by jmp, which takes no "
            f"{type(planner).__name__}; pass no planner or a DefaultLoadPlanner"
        )
    return bool(getattr(planner, "allow_partial_load", False))


def _check_group(process_group: Any, call: str) -> None:
    """jmp's arrays span every process, so every process writes and reads them: a group must hold them all."""
    if process_group is None or not dist.is_initialized():
        return
    size = dist.get_world_size(process_group)
    if size != jax.process_count():
        raise StateDictError(
            f"torch.distributed.checkpoint.{call}: the process group has {size} of the {jax.process_count()} "
            "processes, and jmp's arrays are held by all of them; pass process_group=None (every process calls it)"
        )
