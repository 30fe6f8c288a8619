"""A pipelined step's inputs come from the process of the first pipeline stage, as under SMP.

SMP feeds a pipeline from ``pp_rank() == 0``; the later stages' processes pass placeholders (AWS's gpt2 example: a
``DummyDataset`` of empty float tensors). jmp builds a step's batch from every process's own rows
(``microbatches.whole_batch``), so before that each later stage's process takes its pipeline group's rank 0's
tensors: one ``torch.distributed`` broadcast over SMP's pipeline group, on the host.

The later stages must learn the inputs' shapes and dtypes from rank 0 in any case (the program is traced and
cached by them, and the global array is built from them), so a host exchange per step cannot be avoided; the
tensors travel in the same message. What moves is one process's share of the batch (token ids, images),
small beside the activations the pipeline moves on the devices.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import torch
import torch.distributed as dist
from jax.sharding import Mesh

from jmp.errors import StepError
from jmp.runtime import mesh_state as state
from jmp.runtime import process_groups
from jmp.torch_bridge import JaxTensor
from jmp.torch_bridge.interop import array_to_tensor


def from_first_stage(flat: list[Any], mesh: Mesh) -> list[Any]:
    """``flat`` (a step call's flattened arguments) with every tensor replaced by the one the first stage's
    process passed in its place; ``flat`` itself on that process, and wherever one process holds every stage
    of its model slice. Every process of a pipeline group must call it, once per step call.

    Raises:
        StepError: on a later stage's process, when its call has another number of arguments than the first
            stage's, or a tensor where the first stage's call has none.
    """
    members = process_groups.members("PP_GROUP")
    if len(members) == 1:
        return flat
    source = first_stage_process(mesh)
    mine = jax.process_index() == source
    message = [_message(flat) if mine else None]
    dist.broadcast_object_list(message, src=source, group=process_groups.process_group("PP_GROUP"))
    if mine:
        return flat
    count, tensors = message[0]
    extra = [i for i, value in enumerate(flat) if _is_tensor(value) and i not in tensors]
    if count != len(flat) or extra:
        raise StepError(
            f"process {jax.process_index()} (pipeline rank {state.pp_rank()}) called the step with {len(flat)} "
            f"argument leaves{f', tensors at {extra}' if extra else ''}, where pipeline rank 0 "
            f"(process {source}) passed {count} with tensors at {sorted(tensors)}. As under SMP, a pipeline's "
            "inputs come from pp_rank() == 0 and the other ranks' tensors are ignored, whatever their values and "
            "shapes; but every rank must call the step with arguments of the same structure (placeholder "
            "tensors where rank 0 passes tensors, the same non-tensor arguments)."
        )
    return [tensors.get(i, value) for i, value in enumerate(flat)]


def first_stage_process(mesh: Mesh) -> int:
    """The process holding pipeline stage 0 of this process's model slice: the device at ``pp`` 0 with the
    coordinates of this process's first device on the other axes (SMP's ``pp_rank() == 0`` of its group)."""
    pp = mesh.axis_names.index("pp")
    mine = next(
        position for position, device in np.ndenumerate(mesh.devices) if device.process_index == jax.process_index()
    )
    return int(mesh.devices[(*mine[:pp], 0, *mine[pp + 1 :])].process_index)


def _message(flat: list[Any]) -> tuple[int, dict[int, Any]]:
    """What the first stage's process sends: the number of leaves and each tensor leaf, in host memory."""
    return len(flat), {i: _on_host(value) for i, value in enumerate(flat) if _is_tensor(value)}


def _is_tensor(value: Any) -> bool:
    """A value the step takes as an array input (``signature.place_arguments``'s test); a global array, which
    every process already holds alike, is left as it is."""
    if isinstance(value, jax.Array):
        return value.is_fully_addressable
    return isinstance(value, (torch.Tensor, np.ndarray))


def _on_host(value: Any) -> Any:
    """A copy in host memory (a CUDA tensor would unpickle on the receiver's device of the same index)."""
    if isinstance(value, JaxTensor):
        return array_to_tensor(value.value, value.dtype)
    if isinstance(value, torch.Tensor):
        with torch._C.DisableTorchFunction():  # a plain copy, never a lowered op
            return value.detach().cpu()
    return np.asarray(value)
