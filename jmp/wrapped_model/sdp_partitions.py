"""SMP's sharded data parallelism as DeepSpeed's ZeRO-3 shows it to scripts: each parameter's flat partition.

SMP's sharded-data-parallel optimizer is DeepSpeed's: a parameter ``p`` carries ``p.ds_tensor``, this rank's
slice of the flattened parameter padded to a multiple of the degree (``ds_tensor.ds_numel`` its length), and the
optimizer ``fp32_partitioned_groups_flat``, per param group those slices of the float32 master parameters one
after the other. AWS's GPT-2 example reads them to log parameter norms. jmp splits parameters by
``PartitionSpec`` instead, so these are views computed from the current parameters when read. A process holding
the devices of several sharded-data-parallel ranks (one process driving many devices) holds their slices one
after the other, so norms summed over the processes are the parameters' norms either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import numpy as np
import torch
from jax.experimental import multihost_utils


class PartitionView:
    """``p.ds_tensor``: this process's slices of the flattened, padded parameter (read when asked for)."""

    def __init__(self, read: Callable[[], jax.Array], numel: int, degree: int, ranks: tuple[int, ...]):
        self._read, self._numel, self._degree, self._ranks = read, numel, degree, ranks

    @property
    def ds_numel(self) -> int:
        return math.ceil(self._numel / self._degree) * len(self._ranks)

    @property
    def data(self) -> torch.Tensor:
        flat = _host(self._read()).astype(np.float32).reshape(-1)
        size = math.ceil(self._numel / self._degree)
        padded = np.zeros(size * self._degree, np.float32)
        padded[: flat.size] = flat
        return torch.from_numpy(np.concatenate([padded[r * size : (r + 1) * size] for r in self._ranks]))

    def __repr__(self) -> str:
        return f"PartitionView(ds_numel={self.ds_numel}, ranks={list(self._ranks)} of {self._degree})"


def attach(model) -> None:
    """Give the parameters of ``model.module`` their ``ds_tensor`` (sharded data parallelism only)."""
    mesh = model.layout.mesh
    degree = mesh.shape["fsdp"]
    if degree == 1:
        return
    ranks = process_ranks(mesh)
    for name, parameter in model.torch_module.named_parameters():  # a tied parameter: under its first name
        if name in model.layout.shapes:
            numel = math.prod(model.layout.shapes[name])
            parameter.ds_tensor = PartitionView(_reader(model, name), numel, degree, ranks)


def flat_groups(param_groups: list[dict]) -> list[torch.Tensor]:
    """``fp32_partitioned_groups_flat``: per param group, its parameters' ``ds_tensor`` data one after the other."""
    return [torch.cat([p.ds_tensor.data for p in group["params"]]) for group in param_groups]


def process_ranks(mesh: jax.sharding.Mesh) -> tuple[int, ...]:
    """The sharded-data-parallel (``fsdp``) coordinates of this process's devices."""
    axis = mesh.axis_names.index("fsdp")
    mine = jax.process_index()
    return tuple(
        sorted({index[axis] for index, device in np.ndenumerate(mesh.devices) if device.process_index == mine})
    )


def _reader(model, name: str) -> Callable[[], jax.Array]:
    return lambda: model.store.named(model.training_state.params)[name]


def _host(array: jax.Array) -> np.ndarray:
    """The whole array on this host (gathered from the other processes when they hold pieces of it)."""
    if array.is_fully_addressable:
        return np.asarray(jax.device_get(array))
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))
