"""What a step call returns: each returned tensor as a ``StepOutput`` of its per-microbatch values.

A step function may return tensors, Python numbers, None and strings, also inside lists, tuples, dicts and
Hugging Face ``ModelOutput``s; tensors and numbers come back as ``StepOutput``s, the rest as they are.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import NamedSharding

from jmp.errors import StepError
from jmp.torch_bridge import JaxTensor
from jmp.torch_bridge.dtypes import to_torch_dtype
from jmp.torch_bridge.interop import tensor_to_array


@dataclasses.dataclass(frozen=True)
class ProcessShare:
    """Which rows of a step's batch this process fed, when several processes feed it (``smp.dp_rank()`` of
    ``smp.dp_size()`` equal shares): as in SMP, its step outputs are its own rows."""

    index: int
    count: int
    rows: int | None  # rows of one microbatch in the whole batch (None: no input was split)
    replicated: NamedSharding  # every device of the mesh holds the whole value


class StepOutput:
    """One returned value of a step function: its value for each microbatch.

    With several processes, every process reads the same values, except that outputs with a batch dimension
    (``outputs``, ``stack()``, ``concat()``) hold only the rows this process fed; reading one is a collective
    (every process makes the same calls, as SMP scripts do).
    """

    def __init__(
        self, stacked: jax.Array, torch_dtype: torch.dtype, data_shards: int, share: ProcessShare | None = None
    ):
        self._stacked = stacked  # [microbatches, ...]
        self._torch_dtype = torch_dtype
        self._data_shards = data_shards
        self._share = share

    def _wrap(self, value: jax.Array, rows_axis: int | None = None, rows: int = 0) -> JaxTensor:
        share = self._share
        if share is not None and not value.is_fully_addressable:
            if not value.is_fully_replicated:  # a loss is already on every device
                value = _replicate(value, share.replicated)
            if rows_axis is not None and value.ndim > rows_axis and rows and value.shape[rows_axis] == rows:
                block = rows // share.count
                value = jax.lax.slice_in_dim(value, share.index * block, (share.index + 1) * block, axis=rows_axis)
        return JaxTensor(value, self._torch_dtype)

    @property
    def _rows(self) -> int:
        return 0 if self._share is None or self._share.rows is None else self._share.rows

    @property
    def outputs(self) -> list[JaxTensor]:
        """The value of each microbatch, in order."""
        return [self._wrap(v, 0, self._rows) for v in self._stacked]

    def reduce_mean(self) -> JaxTensor:
        return self._wrap(_mean_over_microbatches(self._stacked))

    def reduce_sum(self) -> JaxTensor:
        return self._wrap(_sum_over_microbatches(self._stacked))

    def stack(self) -> JaxTensor:
        return self._wrap(self._stacked, 1, self._rows)

    def concat(self) -> JaxTensor:
        """Microbatch values joined along dim 0, rows back in the order of the input batch."""
        stacked, shards = self._stacked, self._data_shards
        if stacked.ndim < 2:
            raise StepError("concat() needs per-microbatch tensors with a batch dimension; use stack()")
        microbatches, rows = stacked.shape[:2]
        if rows % shards:
            return self._wrap(stacked.reshape((microbatches * rows,) + stacked.shape[2:]))
        # each microbatch holds an equal slice of every data shard (see microbatches.split)
        per_shard = stacked.reshape((microbatches, shards, rows // shards) + stacked.shape[2:])
        ordered = jnp.swapaxes(per_shard, 0, 1).reshape((microbatches * rows,) + stacked.shape[2:])
        return self._wrap(ordered, 0, microbatches * self._rows)

    def __len__(self) -> int:
        return self._stacked.shape[0]

    def __repr__(self) -> str:
        return f"StepOutput({len(self)} microbatches of shape {tuple(self._stacked.shape[1:])})"


# one compiled program each instead of op-by-op dispatch: these run after every step
_mean_over_microbatches = jax.jit(functools.partial(jnp.mean, axis=0))
_sum_over_microbatches = jax.jit(functools.partial(jnp.sum, axis=0))


@functools.partial(jax.jit, static_argnums=1)
def _replicate(value: jax.Array, sharding: NamedSharding) -> jax.Array:
    return jax.lax.with_sharding_constraint(value, sharding)


@dataclasses.dataclass(frozen=True)
class Returned:
    """A returned value that is not a tensor (None, a string), given back as it is."""

    value: Any


def output_leaf(value: Any, index: int) -> torch.dtype | Returned:
    """How one returned leaf comes back: a StepOutput of this torch dtype, or the value itself."""
    if isinstance(value, torch.Tensor):
        return value.dtype
    if value is None or isinstance(value, (str, bytes)):
        return Returned(value)
    if isinstance(value, (bool, int, float, complex, np.ndarray, np.generic, jax.Array)):
        return to_torch_dtype(jnp.asarray(value).dtype)
    raise StepError(
        f"the step function returned a value of type {type(value).__name__} (leaf {index} of its result); a step "
        "returns tensors, Python numbers, None or strings, also inside lists, tuples, dicts and ModelOutputs. "
        "Return its tensors instead."
    )


def output_array(value: Any) -> jax.Array:
    """A returned tensor or number as the program's output array."""
    if isinstance(value, JaxTensor):
        return value.value
    if isinstance(value, torch.Tensor):
        return tensor_to_array(value)
    return jnp.asarray(value)


def results(leaves: tuple, arrays: list[jax.Array], data_shards: int, share: ProcessShare | None) -> list[Any]:
    """The returned leaves of a call: a ``StepOutput`` for each tensor leaf (from ``arrays``, in order), the
    other values as they are."""
    values = iter(arrays)
    return [
        StepOutput(next(values), leaf, data_shards, share) if isinstance(leaf, torch.dtype) else leaf.value
        for leaf in leaves
    ]
