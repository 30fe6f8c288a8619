"""What a step call returns: each returned tensor as a ``StepOutput`` of its per-microbatch values.

A step function may return tensors, Python numbers, None and strings, also inside lists, tuples, dicts and
Hugging Face ``ModelOutput``s; tensors and numbers come back as ``StepOutput``s, the rest as they are. A Hugging
Face key/value cache (``past_key_values``) comes back as None, with a note once.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import NamedSharding

from jmp.errors import StepError
from jmp.torch_bridge import JaxTensor
from jmp.torch_bridge.dtypes import to_torch_dtype
from jmp.torch_bridge.interop import array_to_tensor, local_piece, tensor_to_array

logger = logging.getLogger("jmp")


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

    Every reading (``outputs``, ``reduce_mean()``, ``reduce_sum()``, ``stack()``, ``concat()``) is a plain
    ``torch.Tensor`` in host memory, copied from the devices when it is asked for, as SMP's are ordinary
    tensors that scripts add up, save, log and hand to numpy.

    With several processes, each reads this process's microbatches, as each SMP rank does (scripts all-reduce
    across data-parallel ranks themselves): a value with a batch dimension holds only the rows this process
    fed. A value the step computed over the whole batch (a loss, a count) is the same on every process: the
    program computes it once over every process's rows; return per-row values (``reduction="none"``) to
    reduce this process's rows. Reading one is a collective (every process makes the same calls, as SMP
    scripts do).
    """

    def __init__(
        self, stacked: jax.Array, torch_dtype: torch.dtype, data_shards: int, share: ProcessShare | None = None
    ):
        self._stacked = stacked  # [microbatches, ...]
        self._torch_dtype = torch_dtype
        self._data_shards = data_shards
        self._share = share

    def _tensor(
        self, value: jax.Array, dtype: torch.dtype | None = None, rows_axis: int | None = None, rows: int = 0
    ) -> torch.Tensor:
        """``value`` (this process's rows of it, along ``rows_axis`` when that axis has ``rows`` entries) as a
        torch tensor of ``dtype`` (the returned tensor's own dtype by default)."""
        share = self._share
        if share is not None and not value.is_fully_addressable:
            if not value.is_fully_replicated:  # a loss is already on every device
                value = _replicate(value, share.replicated)
            value = local_piece(value)  # replicated: this process's copy of the whole value
            if rows_axis is not None and value.ndim > rows_axis and rows and value.shape[rows_axis] == rows:
                block = rows // share.count
                value = jax.lax.slice_in_dim(value, share.index * block, (share.index + 1) * block, axis=rows_axis)
        return array_to_tensor(value, dtype or self._torch_dtype)

    @property
    def _rows(self) -> int:
        return 0 if self._share is None or self._share.rows is None else self._share.rows

    @property
    def outputs(self) -> list[torch.Tensor]:
        """The value of each microbatch, in order."""
        stacked = self._tensor(self._stacked, rows_axis=1, rows=self._rows)
        return [value.clone() for value in stacked.unbind(0)]  # each its own storage, as torch.save keeps it

    def reduce_mean(self) -> torch.Tensor:
        """The mean over microbatches (elementwise); integer and boolean values give floats, as torch's
        ``sum / count`` does."""
        dtype = self._torch_dtype if self._torch_dtype.is_floating_point else torch.get_default_dtype()
        return self._tensor(_mean_over_microbatches(self._stacked), dtype, 0, self._rows)

    def reduce_sum(self) -> torch.Tensor:
        """The sum over microbatches (elementwise); booleans and integers sum to int64, as in torch."""
        floating = self._torch_dtype.is_floating_point or self._torch_dtype.is_complex
        dtype = self._torch_dtype if floating else torch.int64
        return self._tensor(_sum_over_microbatches(self._stacked), dtype, 0, self._rows)

    def stack(self) -> torch.Tensor:
        """The microbatches' values stacked on a new dim 0."""
        return self._tensor(self._stacked, rows_axis=1, rows=self._rows)

    def concat(self) -> torch.Tensor:
        """Microbatch values joined along dim 0, rows back in the order of the input batch."""
        stacked, shards = self._stacked, self._data_shards
        if stacked.ndim < 2:
            raise StepError("concat() needs per-microbatch tensors with a batch dimension; use stack()")
        microbatches, rows = stacked.shape[:2]
        if rows % shards:
            return self._tensor(stacked.reshape((microbatches * rows,) + stacked.shape[2:]))
        # each microbatch holds an equal slice of every data shard (see microbatches.split)
        return self._tensor(_in_batch_order(stacked, shards), rows_axis=0, rows=microbatches * self._rows)

    def detach(self) -> StepOutput:
        """This StepOutput: its values carry no autograd graph (as SMP's with ``detach_outputs=True``)."""
        return self

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


@functools.partial(jax.jit, static_argnums=1)
def _in_batch_order(stacked: jax.Array, shards: int) -> jax.Array:
    """[microbatches, rows, ...] -> [microbatches * rows, ...] in the order of the rows of the input batch."""
    microbatches, rows = stacked.shape[:2]
    per_shard = stacked.reshape((microbatches, shards, rows // shards) + stacked.shape[2:])
    return jnp.swapaxes(per_shard, 0, 1).reshape((microbatches * rows,) + stacked.shape[2:])


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
    if _is_key_value_cache(value):
        _note_dropped_cache(type(value).__name__)
        return Returned(None)
    if isinstance(value, (bool, int, float, complex, np.ndarray, np.generic, jax.Array)):
        return to_torch_dtype(jnp.asarray(value).dtype)
    raise StepError(
        f"the step function returned a value of type {type(value).__name__} (leaf {index} of its result); a step "
        "returns tensors, Python numbers, None or strings, also inside lists, tuples, dicts and ModelOutputs. "
        "Return its tensors instead."
    )


def _is_key_value_cache(value: Any) -> bool:
    """A Hugging Face cache (``DynamicCache``, ...): eval-mode forwards of causal LMs return one by default."""
    cache_utils = sys.modules.get("transformers.cache_utils")  # never imports transformers itself
    return cache_utils is not None and isinstance(value, cache_utils.Cache)


def _note_dropped_cache(kind: str) -> None:
    if kind not in _noted_caches:
        _noted_caches.add(kind)
        logger.info(
            "a step returned a %s (past_key_values); it comes back as None. A cache of microbatch pieces cannot "
            "be fed to a later step, which splits its own batch; pass use_cache=False to the model to skip "
            "building it.",
            kind,
        )


_noted_caches: set[str] = set()


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
