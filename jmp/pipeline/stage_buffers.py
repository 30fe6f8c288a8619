"""Stage-local parameter storage: each stage's parameters packed into buffers split over ``pp``.

One XLA program runs every stage, so every array spans the whole mesh; an array that only stage *s*'s
devices hold must be a slice of a larger one split over ``pp``. Parameters are therefore packed per stage
into flat buffers ``[pp, *grid, length]`` split ``P("pp", *grid_axes, None)``: row *s* holds stage *s*'s
parameters and nothing else. ``grid`` keeps the parameter's own split over the other axes (sharded data
and tensor parallelism): each device's piece of a parameter sits in the grid cell of its coordinates, so
unpacking is a reshape and transpose that moves no data. Parameters with the same split, dtype and
optimizer param group share a buffer; a parameter used by two stages (tied weights) is stored in both and
its gradient pieces are summed (``sync_tied``), so the copies stay equal; a reduction over all parameters
counts it once (``counted_once``). A layer stack's weight is stored layer after layer (``groups``), so a stage
reads its layers' copies as one slice and a scan over them takes that slice as its stacked weight (``with_runs``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jmp.sharding.param_specs import without_axis
from jmp.stacks import storage as stacks_storage

# what follows a parameter's name or a buffer's key to name its per-replica copies
# (``jmp.compiled_step.replica_gradients``); torch names hold no "@"
COPIES = "@replicas"


def copies_name(name: str) -> str:
    return name + COPIES


@dataclasses.dataclass(frozen=True)
class Place:
    """Where one stage's copy of a parameter lives."""

    stage: int
    key: str  # buffer
    offset: int  # into the buffer's last dimension
    size: int  # elements of one grid cell's piece


@dataclasses.dataclass(frozen=True)
class Packing:
    """How one parameter's full array maps to grid cells: per dimension, the mesh axes splitting it."""

    shape: tuple[int, ...]
    dims: tuple[tuple[str, ...], ...]  # mesh axes of each dimension, major to minor
    grid_axes: tuple[str, ...]
    grid_sizes: tuple[int, ...]

    @property
    def piece_shape(self) -> tuple[int, ...]:
        return tuple(n // math.prod(self._sizes(axes)) for n, axes in zip(self.shape, self.dims))

    def _sizes(self, axes: tuple[str, ...]) -> list[int]:
        return [self.grid_sizes[self.grid_axes.index(a)] for a in axes]

    def _split_shape_and_order(self) -> tuple[list[int], list[int]]:
        """The full array viewed with each split dimension as (axes..., piece); the order putting grid first."""
        shape, grid_positions, piece_positions = [], {}, []
        for n, axes in zip(self.shape, self.dims):
            for axis, size in zip(axes, self._sizes(axes)):
                grid_positions[axis] = len(shape)
                shape.append(size)
            piece_positions.append(len(shape))
            shape.append(n // math.prod(self._sizes(axes)))
        return shape, [grid_positions[a] for a in self.grid_axes] + piece_positions

    def to_cells(self, full: jax.Array) -> jax.Array:
        """[*shape] -> [*grid_sizes, piece elements]."""
        split, order = self._split_shape_and_order()
        cells = jnp.transpose(full.reshape(split), order)
        return cells.reshape(self.grid_sizes + (-1,))

    def from_cells(self, cells: jax.Array) -> jax.Array:
        """[*grid_sizes, piece elements] -> [*shape]."""
        split, order = self._split_shape_and_order()
        viewed = cells.reshape([split[i] for i in order])
        return jnp.transpose(viewed, np.argsort(order)).reshape(self.shape)


@dataclasses.dataclass(frozen=True)
class Buffer:
    dtype: Any
    grid_axes: tuple[str, ...]
    grid_sizes: tuple[int, ...]
    length: int
    label: str  # the optimizer param group of its parameters

    @property
    def spec(self) -> PartitionSpec:
        return PartitionSpec("pp", *self.grid_axes, None)


class StageLayout:
    """Which stage holds which parameter, and where in the packed buffers."""

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        dtypes: Mapping[str, Any],
        specs: Mapping[str, PartitionSpec],
        stages: Mapping[str, tuple[int, ...]],
        labels: Mapping[str, str],
        mesh: Mesh,
        shard_optimizer_state: bool = False,
        groups: Sequence[Sequence[str]] = (),
    ):
        self.mesh = mesh
        # ZeRO-1: the optimizer state's buffers are split over dp along their length as well
        self.state_axis = "dp" if shard_optimizer_state and mesh.shape["dp"] > 1 else None
        multiple = math.lcm(128, mesh.shape["dp"]) if self.state_axis else 128
        self.stages = dict(stages)
        self.packing: dict[str, Packing] = {}
        self.places: dict[str, list[Place]] = {}
        lengths: dict[tuple[str, int], int] = {}
        signatures: dict[str, tuple] = {}
        self.groups = [tuple(g) for g in groups]  # a layer stack's weight, one name a layer: stored side by side
        self.runs: dict[str, tuple[str, ...]] = {}  # run key -> its layers' names (``with_runs``)
        self._run_places: dict[str, Place] = {}
        first_of = {g[0]: g for g in self.groups}
        grouped = {name for g in self.groups for name in g}
        order = [m for n in shapes if n not in grouped or n in first_of for m in first_of.get(n, (n,))]
        for name in order:
            shape = shapes[name]
            dims = tuple(_axes(entry) for entry in tuple(specs[name]) + (None,) * (len(shape) - len(specs[name])))
            grid_axes = tuple(a for axes in dims for a in axes)
            packing = Packing(tuple(shape), dims, grid_axes, tuple(mesh.shape[a] for a in grid_axes))
            self.packing[name] = packing
            key = f"stages:{labels[name]}:{jnp.dtype(dtypes[name]).name}:{'-'.join(grid_axes) or 'whole'}"
            signatures[key] = (jnp.dtype(dtypes[name]), grid_axes, packing.grid_sizes, labels[name])
            size = math.prod(packing.piece_shape)
            for stage in stages[name]:
                offset = lengths.get((key, stage), 0)
                self.places.setdefault(name, []).append(Place(stage, key, offset, size))
                lengths[(key, stage)] = offset + size
        longest = {key: max(n for (k, _), n in lengths.items() if k == key) for key in signatures}
        self.buffers = {
            key: Buffer(dtype, axes, sizes, _padded(longest[key], multiple), label)
            for key, (dtype, axes, sizes, label) in signatures.items()
        }
        self.shardings = {key: NamedSharding(mesh, b.spec) for key, b in self.buffers.items()}
        self.param_shardings = {name: NamedSharding(mesh, specs[name]) for name in shapes}
        self.pp = mesh.shape["pp"]

    # --- whole-mesh views (outside the pipeline program) ------------------------------------------------

    def pack(self, params: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """Full parameters (by torch name) -> the packed buffers, each stage's row holding its copies."""
        return self._packer(tuple(self.buffers))(dict(params), {})

    def unpack(self, buffers: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """The packed buffers (or anything laid out like them) -> full arrays by torch name (first copy).

        Each array is placed as its parameter is outside the pipeline (its ``PartitionSpec`` over the mesh).
        """
        return self.unpack_present(buffers)

    def unpack_present(self, tree: Mapping[str, Any]) -> dict[str, jax.Array]:
        """Like ``unpack`` for a tree holding only some buffers (an optimizer field of one param group)."""
        keys = tuple(k for k, v in tree.items() if isinstance(v, jax.Array))
        return self._unpacker(keys)({k: tree[k] for k in keys})

    def pack_present(self, named: Mapping[str, jax.Array], like: Mapping[str, Any]) -> dict[str, Any]:
        """The buffers of ``like`` that hold arrays, rebuilt from full arrays by name (others kept as they are)."""
        keys = tuple(k for k, v in like.items() if isinstance(v, jax.Array))
        needed = {n: named[n] for n, places in self.places.items() if places[0].key in keys}
        return {**like, **self._packer(keys)(needed, {k: like[k] for k in keys})}

    # one compiled program per set of buffers: these run on every state-dict or gradient read

    @functools.cache  # noqa: B019  (the layout lives as long as its model; its programs should too)
    def _unpacker(self, keys: tuple[str, ...]) -> Any:
        names = [n for n, places in self.places.items() if places[0].key in keys]

        def unpack(buffers):
            return {n: self._read(buffers[self.places[n][0].key], self.places[n][0], n) for n in names}

        return jax.jit(unpack, out_shardings={n: self.param_shardings[n] for n in names})

    @functools.cache  # noqa: B019
    def _packer(self, keys: tuple[str, ...]) -> Any:
        """(full arrays by name, arrays whose dtypes the buffers take (default: the parameters')) -> buffers."""

        def pack(named, like):
            rows: dict[tuple[str, int], list[tuple[Place, jax.Array]]] = {}
            for name, places in self.places.items():
                for place in places:
                    if place.key in keys:
                        rows.setdefault((place.key, place.stage), []).append(
                            (place, self.packing[name].to_cells(named[name]))
                        )
            out = {}
            for k in keys:
                buffer = self.buffers[k]
                dtype = like[k].dtype if k in like else buffer.dtype
                empty = jnp.zeros((*buffer.grid_sizes, buffer.length), dtype)
                out[k] = jnp.stack([_joined(rows.get((k, stage), []), empty) for stage in range(self.pp)])
            return out

        return jax.jit(pack, out_shardings={k: self.shardings[k] for k in keys})

    def _read(self, buffer: jax.Array, place: Place, name: str, row: int | None = None) -> jax.Array:
        row = place.stage if row is None else row
        cells = jax.lax.slice_in_dim(buffer[row], place.offset, place.offset + place.size, axis=-1)
        return self.packing[name].from_cells(cells)

    def sync_tied(self, grads: Mapping[str, jax.Array], read_as: Mapping[str, Any]) -> dict[str, jax.Array]:
        """Every copy of a parameter used by several stages gets the sum of the copies' gradients.

        The sum is taken in the dtype the forward reads the parameter in (``read_as``; default: its own), as one
        half-precision gradient of the tied weight would be: an fp16 overflow of the sum is then an overflow here.
        """
        grads = dict(grads)
        for name, places in self.places.items():
            if len(places) < 2:
                continue
            dtype = read_as.get(name, self.buffers[places[0].key].dtype)
            total = sum(self._read(grads[p.key], p, name).astype(dtype) for p in places)
            for place in places:
                grads[place.key] = _write(grads[place.key], place, self.packing[name].to_cells(total))
        return grads

    def counted_once(self, tree: Mapping[str, Any]) -> dict[str, Any]:
        """Buffers (or a tree holding some of them) with every copy of a tied parameter but the first zeroed: a
        reduction over them all (a global gradient norm) then counts each parameter once, as torch does.

        Masks built from iotas, so inside a jitted reduction XLA fuses them into it and writes no copy.
        """
        out = dict(tree)
        for key, places in self._later_copies.items():
            if isinstance(out.get(key), jax.Array):
                out[key] = _without(out[key], places)
        return out

    @functools.cached_property
    def _later_copies(self) -> dict[str, list[Place]]:
        """Per buffer, the places of the second and further copies of tied parameters."""
        later: dict[str, list[Place]] = {}
        for places in self.places.values():
            for place in places[1:]:
                later.setdefault(place.key, []).append(place)
        return later

    def state_shardings(self, state_shape: Any) -> Any:
        """Shardings of an optimizer state over the packed buffers: buffer-shaped leaves like their buffer (ZeRO-1:
        split over dp along the length too)."""
        replicated = NamedSharding(self.mesh, PartitionSpec())

        def place(path: tuple, leaf: Any) -> Any:
            for entry in path:
                key = getattr(entry, "key", None)
                if key in self.buffers and getattr(leaf, "ndim", 0) == len(self.buffers[key].grid_axes) + 2:
                    spec = PartitionSpec(*self.buffers[key].spec[:-1], self.state_axis)
                    return NamedSharding(self.mesh, spec)
            return replicated

        return jax.tree_util.tree_map_with_path(place, state_shape)

    # --- inside the pipeline program (one stage's row) --------------------------------------------------

    def stage_params(
        self, rows: Mapping[str, jax.Array], stage: int, names: list[str], copy_axes: tuple[str, ...] = ()
    ) -> dict[str, jax.Array]:
        """Parameters ``names`` of ``stage`` from this device's rows ``[1, *grid, length]``; a name of a parameter's
        per-replica copies (``copies_name``) from the copies of its buffer, ``[replicas, 1, *grid, length]``, the
        replicas split over ``copy_axes``. A stack weight's layers that the stage stores side by side are read as
        one slice, ``[layers, *shape]`` (copies: ``[layers, replicas, *shape]``), under their run's key (``runs``;
        ``layer_views`` hands each layer its row)."""
        gather = not jax.sharding.get_abstract_mesh().empty  # inside the pipeline's shard_map
        out = {}
        for name in self.with_runs(stage, names):
            param = name.removesuffix(COPIES)
            place, layers = self.place(param, stage), (None,) * (param in self.runs)
            if name == param:
                out[name], replicas = self._read(rows[place.key], place, name, row=0), ()
            else:
                read = functools.partial(self._read, place=place, name=param, row=0)
                out[name], replicas = jax.vmap(read, out_axes=len(layers))(rows[place.key + COPIES]), (copy_axes,)
            if gather:  # FSDP: the stage uses the whole weight, gathered over fsdp where it is used (a scan's: a
                # layer at a time, each layer's weight gathered in its turn)
                spec = self.param_shardings[self.members(param)[0]].spec
                whole = spec if layers else without_axis(spec, "fsdp")
                out[name] = jax.lax.with_sharding_constraint(out[name], PartitionSpec(*layers, *replicas, *whole))
        return out

    def with_runs(self, stage: int, names: Sequence[str]) -> list[str]:
        """``names`` with the layers of a stack weight that ``stage`` stores side by side (two or more) as one run:
        a key packed as their stacked array (each layer's cells in turn)."""
        out = list(names)
        for group in self.groups:
            for suffix in ("", COPIES):
                run = tuple(n for n in group if n + suffix in out)
                places = [self.place(n, stage) for n in run]
                if len(run) < 2 or any(
                    p.key != places[0].key or p.offset != places[0].offset + i * p.size for i, p in enumerate(places)
                ):
                    continue
                key, first = f"{run[0]}*{len(run)}", self.packing[run[0]]
                self.runs[key], self._run_places[key] = (
                    run,
                    dataclasses.replace(places[0], size=places[0].size * len(run)),
                )
                self.packing[key] = dataclasses.replace(first, shape=(len(run), *first.shape), dims=((), *first.dims))
                out = [n for n in out if n not in {m + suffix for m in run}] + [key + suffix]
        return out

    def layer_views(self, params: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """Parameters by name, each run (``with_runs``) as its layers' rows (inside ``stacks.storage.tracing_views``:
        a layer scan stacking them reads the run itself)."""
        out = {}
        for key, value in params.items():
            members = self.members(key)
            out.update(zip(members, stacks_storage.layer_views(value)) if len(members) > 1 else [(key, value)])
        return out

    def members(self, key: str) -> tuple[str, ...]:
        """The names a parameter's or a run's key (``with_runs``) stands for, copies' keys for copies' names."""
        suffix = COPIES if key.endswith(COPIES) else ""
        return tuple(n + suffix for n in self.runs.get(key.removesuffix(suffix), (key.removesuffix(suffix),)))

    def place(self, name: str, stage: int) -> Place:
        return self._run_places[name] if name in self.runs else next(p for p in self.places[name] if p.stage == stage)

    def add_to_copies(self, copies: jax.Array, stage: int, values: Mapping[str, jax.Array]) -> jax.Array:
        """``copies`` ``[replicas, 1, *grid, length]`` (a buffer's per-replica sums on this device) plus each
        replica's ``values`` of parameters by name ``[replicas, *shape]`` (runs: ``[layers, replicas, *shape]``), at
        their places on ``stage``: one concatenation of their cells (zeros between), which XLA fuses into the sum."""
        if not values:
            return copies
        cells = [
            (self.place(name, stage), jax.vmap(self.packing[name].to_cells, in_axes=int(name in self.runs))(v))
            for name, v in values.items()
        ]
        empty = jnp.zeros((copies.shape[0], *copies.shape[2:]), copies.dtype)
        return copies + _joined(cells, empty)[:, None]

    def stage_names(self, stage: int) -> list[str]:
        return [name for name, places in self.places.items() if any(p.stage == stage for p in places)]

    # --- accounting ------------------------------------------------------------------------------------

    def stage_bytes(self) -> list[int]:
        """Bytes of each stage's own parameters (full arrays, tied ones counted in every stage using them)."""
        totals = [0] * self.pp
        for name, places in self.places.items():
            nbytes = math.prod(self.packing[name].shape) * self.buffers[places[0].key].dtype.itemsize
            for place in places:
                totals[place.stage] += nbytes
        return totals

    def device_bytes(self) -> tuple[list[int], int]:
        """(per stage, the bytes of its parameters' pieces one of its devices holds; the bytes of the buffers' rows
        every device holds): one program runs every stage, so a row is as long as the longest stage's."""
        own = [0] * self.pp
        for places in self.places.values():
            for place in places:
                own[place.stage] += place.size * self.buffers[place.key].dtype.itemsize
        held = sum(b.length * b.dtype.itemsize for b in self.buffers.values())
        return own, held


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _padded(length: int, multiple: int = 128) -> int:
    return max(multiple, -(-length // multiple) * multiple)


def _without(buffer: jax.Array, places: list[Place]) -> jax.Array:
    """``buffer`` with the cells of ``places`` (in any grid cell) zeroed."""
    row = jax.lax.broadcasted_iota(jnp.int32, buffer.shape, 0)
    column = jax.lax.broadcasted_iota(jnp.int32, buffer.shape, buffer.ndim - 1)
    inside = functools.reduce(
        jnp.logical_or,
        [(row == p.stage) & (column >= p.offset) & (column < p.offset + p.size) for p in places],
    )
    return jnp.where(inside, jnp.zeros((), buffer.dtype), buffer)


def _joined(cells: Sequence[tuple[Place, jax.Array]], empty: jax.Array) -> jax.Array:
    """``empty`` (a stage row ``[..., length]``) with each piece of ``cells`` at its place: one concatenation of
    the pieces, zeros between them (one op for XLA, where a write per parameter is one op each)."""
    pieces, end = [], 0
    for place, piece in sorted(cells, key=lambda pair: pair[0].offset):
        if place.offset > end:
            pieces.append(jnp.zeros((*empty.shape[:-1], place.offset - end), empty.dtype))
        pieces.append(piece.astype(empty.dtype))
        end = place.offset + place.size
    if not pieces:
        return empty
    if empty.shape[-1] > end:
        pieces.append(jnp.zeros((*empty.shape[:-1], empty.shape[-1] - end), empty.dtype))
    return jnp.concatenate(pieces, axis=-1)


def _write(buffer: jax.Array, place: Place, cells: jax.Array) -> jax.Array:
    start = (place.stage,) + (0,) * (buffer.ndim - 2) + (place.offset,)
    return jax.lax.dynamic_update_slice(buffer, cells[None].astype(buffer.dtype), start)
