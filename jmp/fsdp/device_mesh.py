"""``init_device_mesh`` on jmp: named sizes for ``parallelize_module`` (tp) and ``fully_shard`` (the shard group),
from which the model's ``smp.init`` mesh is laid out (``jmp.fsdp.layout``). Sizes count devices. It has the
surface of torch's ``DeviceMesh`` that scripts and torchtitan's ``ParallelDims`` use.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jmp.errors import ArgumentTypeError, ConfigError
from jmp.runtime import mesh_state, process_groups


class DeviceMesh:
    """A view of the job's devices as named dimensions (a C-order layout ``view`` of the world, of which this mesh
    spans the dimensions ``dims``: each a tuple of view indices, more than one once flattened). ``world``: the
    dimensions the meshes of one ``init_device_mesh`` call know by name, name -> (view, its indices)."""

    counts_devices = True  # its sizes count devices, not processes (jmp.fsdp.layout)

    def __init__(self, device_type: str, world: dict, view: tuple[int, ...], dims: tuple, names: tuple | None):
        self.device_type, self._world, self._view, self._dims = device_type, world, view, dims
        self.mesh_dim_names = names

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(math.prod(self._view[i] for i in dim) for dim in self._dims)

    @property
    def ndim(self) -> int:
        return len(self._dims)

    def size(self, mesh_dim: int | str | None = None) -> int:
        return math.prod(self.shape) if mesh_dim is None else self.shape[self._index(mesh_dim)]

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        names = (names,) if isinstance(names, str) else tuple(names)
        own = dict(zip(self.mesh_dim_names or (), self._dims, strict=True))
        found = [(self._view, own[n]) if n in own else self._world.get(n) for n in names]
        if any(f is None for f in found) or len({view for view, _ in found}) > 1:
            raise KeyError(f"DeviceMesh{self.mesh_dim_names}: no dimension(s) {names} on one layout")
        return DeviceMesh(self.device_type, self._world, found[0][0], tuple(d for _, d in found), names)

    def _flatten(self, mesh_dim_name: str | None = None, backend_override: Any = None) -> DeviceMesh:
        name = mesh_dim_name or "_".join(self.mesh_dim_names or ())
        flat = (tuple(i for dim in self._dims for i in dim),)
        self._world[name] = (self._view, flat[0])
        return DeviceMesh(self.device_type, self._world, self._view, flat, (name,))

    def _unflatten(self, dim: int | str, mesh_sizes: tuple[int, ...], mesh_dim_names: tuple[str, ...],
                   backend_override: Any = None) -> DeviceMesh:  # fmt: skip
        """This mesh with dimension ``dim`` split into ``mesh_sizes`` named ``mesh_dim_names`` (torch's)."""
        index = self._index(dim)
        if math.prod(mesh_sizes) != self.shape[index] or len(mesh_sizes) != len(mesh_dim_names):
            raise ArgumentTypeError(f"DeviceMesh._unflatten: {mesh_sizes} do not make the {self.shape[index]} of {dim}")
        if self.ndim != 1 or self.size() != jax.device_count():
            raise ArgumentTypeError("DeviceMesh._unflatten: jmp unflattens a 1-D mesh of all the job's devices")
        view = tuple(mesh_sizes)
        names = tuple(mesh_dim_names)
        for i, name in enumerate(names):
            self._world[name] = (view, (i,))
        return DeviceMesh(self.device_type, self._world, view, tuple((i,) for i in range(len(view))), names)

    def get_coordinate(self) -> list[int]:
        """This process's place on each dimension (its first device's: one process is one rank)."""
        first = min(d.id for d in jax.local_devices())
        place = np.unravel_index(first, self._view)
        return [int(np.ravel_multi_index([place[i] for i in dim], [self._view[i] for i in dim])) for dim in self._dims]

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        if mesh_dim is None and self.ndim != 1:
            raise ArgumentTypeError("DeviceMesh.get_local_rank: name the dimension of a mesh of more than one")
        return self.get_coordinate()[0 if mesh_dim is None else self._index(mesh_dim)]

    def get_group(self, mesh_dim: int | str | None = None) -> Any:
        """The ``torch.distributed`` group of the processes whose devices differ only along ``mesh_dim`` (devices
        laid out in id order)."""
        from jmp.fsdp import layout

        along = self._dims[0 if mesh_dim is None else self._index(mesh_dim)]
        names = tuple(f"view{i}" for i in range(len(self._view)))
        devices = np.array(sorted(jax.devices(), key=lambda d: d.id)).reshape(self._view)
        return layout.group_in(process_groups.partition_of(Mesh(devices, names), tuple(names[i] for i in along)))

    def _index(self, dim: int | str) -> int:
        if isinstance(dim, int):
            return dim
        if dim not in (self.mesh_dim_names or ()):
            raise KeyError(f"DeviceMesh{self.mesh_dim_names} has no dimension {dim!r}")
        return self.mesh_dim_names.index(dim)


def init_device_mesh(
    device_type: str, mesh_shape: tuple[int, ...], *, mesh_dim_names: tuple[str, ...] | None = None, **_: Any
) -> DeviceMesh:
    """torch's ``init_device_mesh`` over the job's devices (``smp.init()`` first when the script has not run it).

    Raises:
        ConfigError: the sizes do not multiply to the job's devices.
    """
    if not mesh_state.is_initialized():
        mesh_state.init()
    devices = jax.device_count()
    shape = tuple(int(size) for size in mesh_shape)
    if math.prod(shape) != devices:
        raise ConfigError(
            f"init_device_mesh({shape}): jmp's meshes count devices, and the job has {devices}; give sizes that "
            "multiply to them (one process per device, as under torchrun, makes processes and devices the same)"
        )
    if mesh_dim_names is not None and len(mesh_dim_names) != len(shape):
        raise ArgumentTypeError(f"init_device_mesh: {len(shape)} sizes but the names {mesh_dim_names}")
    world: dict = {}
    mesh = DeviceMesh(device_type, world, shape, tuple((i,) for i in range(len(shape))), mesh_dim_names)
    for i, name in enumerate(mesh_dim_names or ()):
        world[name] = (shape, (i,))
    return mesh
