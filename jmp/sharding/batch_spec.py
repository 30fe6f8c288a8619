"""The layout of a split input: its batch over the data axes, its sequence (next dimension) over "cp" if it divides."""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec

from jmp.runtime import mesh_state as state


def batch_spec(
    shape: tuple[int, ...], axis: int, batch_axes: tuple[str, ...], mesh: jax.sharding.Mesh
) -> PartitionSpec:
    """A split input's layout: batch ``axis`` over ``batch_axes``, the next dimension over "cp" where it divides."""
    spec = [None] * axis + [batch_axes]
    cp = state.CONTEXT_AXIS
    if cp in mesh.axis_names and len(shape) > axis + 1 and shape[axis + 1] % mesh.shape[cp] == 0:
        spec.append(cp)
    return PartitionSpec(*spec)
