"""What a step call returns: each returned tensor as a ``StepOutput`` of its per-microbatch values.

A step function may return tensors, Python numbers, None and strings, also inside lists, tuples, dicts and
Hugging Face ``ModelOutput``s; tensors and numbers come back as ``StepOutput``s, the rest as they are. A Hugging
Face key/value cache (``past_key_values``) comes back as None, with a note once.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import NamedSharding

from jmp.errors import StepError
from jmp.stacks.scan import is_cache
from jmp.torch_bridge import JaxTensor
from jmp.torch_bridge.dtypes import to_torch_dtype
from jmp.torch_bridge.index_checks import Pending
from jmp.torch_bridge.interop import array_to_tensor, local_piece, tensor_to_array

logger = logging.getLogger("jmp")


@dataclasses.dataclass(frozen=True)
class ProcessShare:
    """Which share of a step's batch this process fed, when several processes run the step: ``smp.dp_rank()``
    of ``smp.dp_size()`` equal shares. With more than one share the step function ran once per share
    (``process_shares``) and every returned value has a process axis after the microbatch axis."""

    index: int
    count: int
    replicated: NamedSharding  # every device of the mesh holds the whole value


class StepOutput:
    """One returned value of a step function: its value for each microbatch.

    Every reading (``outputs``, ``reduce_mean()``, ``reduce_sum()``, ``stack()``, ``concat()``) is a plain
    ``torch.Tensor`` in host memory, copied from the devices when it is asked for, as SMP's are ordinary
    tensors that scripts add up, save, log and hand to numpy.

    With several processes, each reads what the step function computed on its own rows, as each SMP rank
    does: a loss is this process's loss, ``outputs`` are this process's rows, and ``reduce_mean()`` is over
    this process's microbatches (scripts all-reduce across data-parallel ranks themselves). The first reading
    of a value whose pieces live on several processes is a collective (every process makes the same calls,
    as SMP scripts do).
    """

    def __init__(
        self,
        stacked: jax.Array,
        torch_dtype: torch.dtype,
        data_shards: int,
        share: ProcessShare | None = None,
        checks: Pending | None = None,
    ):
        self._checks = checks  # the step's index checks: reading a value raises torch's IndexError if one failed
        self._stacked = stacked  # [microbatches, ...], or [microbatches, processes, ...] with several shares
        self._torch_dtype = torch_dtype
        self._data_shards = data_shards
        self._share = share
        self._own: jax.Array | None = None

    def _mine(self) -> jax.Array:
        """[microbatches, ...]: this process's values, on one of its devices."""
        if self._checks is not None:
            self._checks.raise_if_failed()
        if self._own is None:
            value, share = self._stacked, self._share
            if share is not None and not value.is_fully_addressable:
                if not value.is_fully_replicated:  # a loss is already on every device
                    value = _replicate(value, share.replicated)
                value = local_piece(value)  # replicated: this process's copy of the whole value
            if self._per_process:
                value = _entry(value, share.index)
            self._own = value
        return self._own

    def _tensor(self, value: jax.Array, dtype: torch.dtype | None = None) -> torch.Tensor:
        return array_to_tensor(value, dtype or self._torch_dtype)

    @property
    def outputs(self) -> list[torch.Tensor]:
        """The value of each microbatch, in order."""
        return [value.clone() for value in self.stack().unbind(0)]  # each its own storage, as torch.save keeps it

    def reduce_mean(self) -> torch.Tensor:
        """The mean over microbatches (elementwise); integer and boolean values give floats, as torch's
        ``sum / count`` does."""
        dtype = self._torch_dtype if self._torch_dtype.is_floating_point else torch.get_default_dtype()
        return self._tensor(_mean_over_microbatches(self._mine()), dtype)

    def reduce_sum(self) -> torch.Tensor:
        """The sum over microbatches (elementwise); booleans and integers sum to int64, as in torch."""
        floating = self._torch_dtype.is_floating_point or self._torch_dtype.is_complex
        dtype = self._torch_dtype if floating else torch.int64
        return self._tensor(_sum_over_microbatches(self._mine()), dtype)

    def stack(self) -> torch.Tensor:
        """The microbatches' values stacked on a new dim 0."""
        return self._tensor(self._mine())

    def concat(self) -> torch.Tensor:
        """Microbatch values joined along dim 0, rows back in the order of the input batch."""
        stacked = self._mine()
        shards = self._data_shards // (self._share.count if self._share is not None else 1)
        if stacked.ndim < 2:
            raise StepError("concat() needs per-microbatch tensors with a batch dimension; use stack()")
        microbatches, rows = stacked.shape[:2]
        if rows % shards:
            return self._tensor(stacked.reshape((microbatches * rows,) + stacked.shape[2:]))
        # each microbatch holds an equal slice of every data shard (see microbatches.split)
        return self._tensor(_in_batch_order(stacked, shards))

    def as_tensor(self) -> torch.Tensor:
        """The value as a call of the undecorated function on the whole batch gives it (what an implicit step
        hands back): a scalar per microbatch is their mean (a loss), anything else the microbatches joined in
        batch order."""
        return self.reduce_mean() if self._value_ndim == 0 else self.concat()

    @property
    def _per_process(self) -> bool:
        """Whether the stacked values carry a process axis (several processes ran the step function)."""
        return self._share is not None and self._share.count > 1

    @property
    def _value_ndim(self) -> int:
        return self._stacked.ndim - (2 if self._per_process else 1)

    def detach(self) -> StepOutput:
        """This StepOutput: its values carry no autograd graph (as SMP's with ``detach_outputs=True``)."""
        return self

    def __len__(self) -> int:
        return self._stacked.shape[0]

    def __repr__(self) -> str:
        shape = tuple(self._stacked.shape[2 if self._per_process else 1 :])
        return f"StepOutput({len(self)} microbatches of shape {shape})"


# one compiled program each instead of op-by-op dispatch: these run after every step
_mean_over_microbatches = jax.jit(functools.partial(jnp.mean, axis=0))
_sum_over_microbatches = jax.jit(functools.partial(jnp.sum, axis=0))


@functools.partial(jax.jit, static_argnums=1)
def _entry(stacked: jax.Array, index: int) -> jax.Array:
    """[microbatches, processes, ...] -> [microbatches, ...] of one process."""
    return stacked[:, index]


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
    if is_cache(value):
        _note_dropped_cache(type(value).__name__)
        return Returned(None)
    if isinstance(value, (bool, int, float, complex, np.ndarray, np.generic, jax.Array)):
        return to_torch_dtype(jnp.asarray(value).dtype)
    raise StepError(
        f"the step function returned a value of type {type(value).__name__} (leaf {index} of its result); a step "
        "returns tensors, Python numbers, None or strings, also inside lists, tuples, dicts and ModelOutputs. "
        "Return its tensors instead."
    )


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


def as_tensor_shape(stacked: jax.ShapeDtypeStruct, per_process: bool) -> tuple[int, ...]:
    """The shape ``StepOutput.as_tensor()`` gives a program output of shape ``stacked``."""
    microbatches, *value = stacked.shape[:1] + stacked.shape[2 if per_process else 1 :]
    return () if not value else (microbatches * value[0], *value[1:])


def results(
    leaves: tuple, arrays: list[jax.Array], data_shards: int, share: ProcessShare | None, checks: Pending | None = None
) -> list[Any]:
    """The returned leaves of a call: a ``StepOutput`` for each tensor leaf (from ``arrays``, in order), the
    other values as they are; reading one first reads the step's index ``checks``."""
    values = iter(arrays)
    return [
        StepOutput(next(values), leaf, data_shards, share, checks) if isinstance(leaf, torch.dtype) else leaf.value
        for leaf in leaves
    ]
