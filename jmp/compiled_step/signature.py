"""What a step program is traced for (``StepSignature``), and the step function's arguments in and out of it.

The arguments are flattened as a torch pytree; each leaf enters the program as an array (a tensor, split on
its batch axis unless told otherwise), as the model, or as a compile-time constant (anything else).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Container, Mapping
from typing import Any

import jax
import numpy as np
import torch
import torch.utils._pytree as torch_pytree
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jmp.compiled_step import microbatches as batching
from jmp.runtime import mesh_state as state
from jmp.sharding.batch_spec import batch_spec
from jmp.torch_bridge import JaxTensor
from jmp.torch_bridge.dtypes import to_torch_dtype
from jmp.torch_bridge.interop import tensor_to_array
from jmp.wrapped_model.distributed_model import DistributedModel


class Static:
    """A non-tensor argument baked into the program, as a key: by type and value when hashable, else by identity.

    An unhashable argument (an ``argparse.Namespace``, an optimizer, a config object) is compared by
    identity and kept alive by the key, so its id is never reused by another object. Its contents are read
    when the step is traced: changing them later does not retrace (as SMP, which traces once); pass a new
    object, or a hashable value, to change what the step computes.
    """

    __slots__ = ("value", "by_value")

    def __init__(self, value: Any):
        self.value = value
        try:
            hash(value)
            self.by_value = True
        except Exception:  # unhashable (TypeError) or a __hash__ that raises something else
            self.by_value = False

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Static):
            return NotImplemented
        if self.value is other.value:
            return True
        if not (self.by_value and other.by_value) or type(self.value) is not type(other.value):
            return False  # by type too: 1, 1.0 and True give different programs
        try:
            return bool(self.value == other.value)
        except Exception:
            return False

    def __hash__(self) -> int:
        return hash((type(self.value), self.value)) if self.by_value else id(self.value)

    def __repr__(self) -> str:
        return f"Static({self.value!r})" if self.by_value else f"Static(<{type(self.value).__name__} by identity>)"


@dataclasses.dataclass(frozen=True)
class Leaf:
    """How one flattened argument enters the program."""

    kind: str  # "array" | "model" | "static"
    split_axis: int | None = None
    torch_dtype: torch.dtype | None = None
    static: Static | None = None


@dataclasses.dataclass(frozen=True)
class StepSignature:
    """What a step program is traced for; with the step function, the key of the model's program cache.

    ``graphdef`` is the model's train/eval configuration (compared by identity: the model keeps one object
    per configuration). The loss scale is the program's last array input (it changes without recompiling);
    ``scales_loss`` says whether the step multiplies the loss by it (an optimizer's loss scaling) or the
    step function does (``smp.amp.GradScaler.scale``). ``grad_enabled`` is torch's grad mode at the call
    (under ``torch.no_grad()`` every op is traced as not differentiable); ``average_grads`` is the model's
    ``average_grads_across_microbatches`` (False: gradients are summed over microbatches).
    """

    arguments: Any  # torch pytree spec of (args, kwargs)
    leaves: tuple[Leaf, ...]
    microbatches: int
    data_shards: int
    scales_loss: bool
    grad_enabled: bool
    average_grads: bool
    process_shares: int  # processes feeding equal shares of the batch; the step function runs once per share
    graphdef: nnx.GraphDef = dataclasses.field(compare=False)
    graphdef_id: int = dataclasses.field(init=False)  # the key's stand-in for graphdef (derived, cheap to hash)

    def __post_init__(self) -> None:
        object.__setattr__(self, "graphdef_id", id(self.graphdef))

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes a microbatch is laid out over inside the program: the data axes, or none when the batch is
        given whole to every device (``place_arguments``)."""
        return state.DATA_AXES if self.data_shards > 1 else ()

    @property
    def split_axes(self) -> list[int | None]:
        """The batch axis of each array input (None: given whole to every microbatch); the loss scale comes last."""
        return [leaf.split_axis for leaf in self.leaves if leaf.kind == "array"] + [None]


@dataclasses.dataclass(frozen=True)
class PlacedArguments:
    """A call's flattened arguments: how each leaf enters the program, and the array inputs on the devices."""

    leaves: tuple[Leaf, ...]
    arrays: list[jax.Array]
    fed_over: tuple[str, ...]  # the mesh axes the batch is sharded over; () when every device computes all of it


def place_arguments(
    bound: inspect.BoundArguments,
    flat: list[Any],
    mesh: jax.sharding.Mesh,
    microbatches: int,
    non_split: Container[str],
    split_axes: Mapping[str, int],
    processes: int,
    fed_over: tuple[str, ...],
    pipelined: bool = False,
    abstract: bool = False,
) -> PlacedArguments:
    """Sort the flattened arguments ``flat`` of ``bound`` into leaves; tensors go to the devices, those with a
    batch axis (``split_axes``, default 0, none for names in ``non_split``) sharded over the data axes.

    ``processes`` feed equal shares of the batch (1: this process feeds all of it), each to the devices of
    the process that feeds it: the batch is sharded over the mesh axes ``fed_over`` (the program lays it out
    over the data axes). One process's batch that its data-parallel devices cannot share equally is given whole
    to each (``microbatches.whole_on_every_device``), unless the model is ``pipelined``. For an ``abstract`` model
    the arrays are ``jax.ShapeDtypeStruct``s: nothing is placed.
    """
    names = _argument_names(bound)
    tensors = {
        i: _host_or_device_array(v) for i, v in enumerate(flat) if isinstance(v, (torch.Tensor, np.ndarray, jax.Array))
    }
    axes = {i: _batch_axis(array, names[i], non_split, split_axes) for i, (array, _) in tensors.items()}
    shapes = {
        i: batching.whole_batch_shape(tensors[i][0], axis, processes) for i, axis in axes.items() if axis is not None
    }
    rows = [shapes[i][axis] for i, axis in axes.items() if axis is not None and axis < len(shapes[i])]
    if (
        processes == 1
        and not pipelined
        and batching.whole_on_every_device(rows, microbatches, batching.data_shards(mesh))
    ):
        fed_over = ()
    shards = batching.data_shards(mesh, fed_over)
    leaves: list[Leaf] = []
    arrays: list[jax.Array] = []
    for i, value in enumerate(flat):
        if isinstance(value, DistributedModel):
            leaves.append(Leaf("model"))
        elif i in tensors:
            (array, dtype), axis = tensors[i], axes[i]
            if axis is not None:
                batching.check_divisible(names[i], shapes[i], axis, microbatches, shards, processes)
                sharding = NamedSharding(mesh, batch_spec(shapes[i], axis, fed_over, mesh))
                placed = None if abstract else batching.whole_batch(array, sharding, shapes[i])
            else:  # the same value on every process
                sharding = NamedSharding(mesh, PartitionSpec())
                placed = None if abstract else jax.device_put(array, sharding)
            shape = shapes[i] if axis is not None else array.shape
            arrays.append(jax.ShapeDtypeStruct(shape, array.dtype, sharding=sharding) if abstract else placed)
            leaves.append(Leaf("array", axis, dtype))
        else:
            leaves.append(Leaf("static", static=Static(value)))
    return PlacedArguments(tuple(leaves), arrays, fed_over)


def _batch_axis(array: Any, name: str, non_split: Container[str], split_axes: Mapping[str, int]) -> int | None:
    """The axis a step input is split on: None for a name in ``non_split`` or a scalar."""
    if name in non_split or array.ndim == 0:
        return None
    return split_axes.get(name, 0)


def rebuild(spec: Any, leaves: tuple[Leaf, ...], arrays: list[jax.Array], model: DistributedModel) -> Any:
    """The step function's (args, kwargs) inside the program: arrays as JaxTensors, constants as they were."""
    values = iter(arrays)
    flat = []
    for leaf in leaves:
        if leaf.kind == "array":
            flat.append(JaxTensor(next(values), leaf.torch_dtype))
        elif leaf.kind == "model":
            flat.append(model)
        else:
            flat.append(leaf.static.value)
    return torch_pytree.tree_unflatten(flat, spec)


def _argument_names(bound: inspect.BoundArguments) -> list[str]:
    """The step function's argument name for each flattened leaf."""
    names = []
    for name, value in bound.arguments.items():
        parameter = bound.signature.parameters[name]
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            names.extend([name] * sum(len(torch_pytree.tree_leaves(v)) for v in value))
        elif parameter.kind is inspect.Parameter.VAR_KEYWORD:
            names.extend([f"{name}.{k}" for k, v in value.items() for _ in torch_pytree.tree_leaves(v)])
        else:
            names.extend([name] * len(torch_pytree.tree_leaves(value)))
    return names


def _host_or_device_array(value: Any) -> tuple[Any, torch.dtype]:
    """The value to device_put (a numpy copy of a torch tensor goes to the devices in one transfer)."""
    if isinstance(value, JaxTensor):
        return value.value, value.dtype
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bfloat16:
            return tensor_to_array(value), value.dtype
        with torch._C.DisableTorchFunction():
            host = value.detach().cpu().numpy()
        # a copy: the devices may alias host memory, and the caller may reuse the tensor
        return host.astype(jax.dtypes.canonicalize_dtype(host.dtype), copy=True), value.dtype
    array = np.asarray(value) if not isinstance(value, jax.Array) else value
    return array, to_torch_dtype(jax.dtypes.canonicalize_dtype(array.dtype))
