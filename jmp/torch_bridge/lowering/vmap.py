"""``torch.vmap`` / ``torch.func.vmap`` lowered to ``jax.vmap`` (routed here by ``higher_order_ops.py``).

``func`` runs on the bridge's tensors inside ``jax.vmap``'s trace; ``in_dims`` / ``out_dims`` are checked with
torch's own functions and rules; ``chunk_size`` maps that many entries at a time. ``randomness``: "error" raises
on a random op; "same" / "different" give every entry a stream seeded from one key (folding in the index).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import torch
import torch.utils._pytree as torch_pytree
from flax import nnx

# torch's own checks of vmap's arguments, so that in_dims / out_dims mean (and fail) exactly as in torch
from torch._functorch.vmap import _check_out_dims_is_int_or_int_pytree, _process_batched_inputs
from torch.utils._pytree import _broadcast_to_and_flatten

from jmp.errors import UnsupportedOpError
from jmp.torch_bridge import dispatch, padded_nonzero
from jmp.torch_bridge.higher_order_ops import FUNCTIONS
from jmp.torch_bridge.lowering.random import draws_refused, next_key
from jmp.torch_bridge.registry import register_lowering
from jmp.torch_bridge.tensor import JaxTensor, unwrap


@dataclasses.dataclass
class _Outputs:
    """What tracing ``func`` once leaves behind: the output structure and what is not an array."""

    spec: torch_pytree.TreeSpec | None = None
    dims: list[int | None] = dataclasses.field(default_factory=list)  # per leaf; None: not mapped
    leaves: list[Any] = dataclasses.field(default_factory=list)  # None where an array goes
    dtypes: list[torch.dtype | None] = dataclasses.field(default_factory=list)


@register_lowering(FUNCTIONS.get("vmap_impl"), raw=True)
def vmap_impl(func: Callable, in_dims: Any, out_dims: Any, randomness: str, chunk_size: int | None, *args, **kwargs):
    _check_out_dims_is_int_or_int_pytree(out_dims, func)
    batch_size, flat_in_dims, flat_args, args_spec = _process_batched_inputs(in_dims, args, func)
    mapped = [i for i, dim in enumerate(flat_in_dims) if dim is not None]
    arrays = [jnp.moveaxis(unwrap(flat_args[i]), flat_in_dims[i], 0) for i in mapped]
    dtypes = [flat_args[i].dtype for i in mapped]
    outputs = _Outputs()
    base_key = next_key() if randomness != "error" and dispatch.current_rngs() is not None else None

    def entry(index: jax.Array, *entry_arrays: jax.Array) -> tuple[list, list]:
        """``func`` on one entry: (mapped output arrays, unmapped output arrays)."""
        leaves = list(flat_args)
        fresh = [JaxTensor(a, dtype) for a, dtype in zip(entry_arrays, dtypes)]
        for i, tensor in zip(mapped, fresh):
            leaves[i] = tensor
        with _entry_draws(randomness, base_key, index):
            result = func(*torch_pytree.tree_unflatten(leaves, args_spec), **kwargs)
        if any(t.write_count > 0 for t in fresh):
            raise UnsupportedOpError(
                f"vmap({_name(func)}) modified a mapped input in place{dispatch.where()}, which the bridge's vmap "
                "does not write back. Return the new value instead (out = x.clone(); out.add_(...))."
            )
        return _take_outputs(outputs, result, out_dims, func)

    mapped_fn = jax.vmap(entry, out_axes=(0, None))
    try:
        if chunk_size is None or chunk_size >= batch_size:
            stacked, unmapped = mapped_fn(jnp.arange(batch_size), *arrays)
        else:
            stacked, unmapped = _in_chunks(mapped_fn, batch_size, chunk_size, arrays)
    except ValueError as error:
        if "got axis spec None but output was batched" not in str(error):
            raise
        name = _name(func)  # torch's words
        raise ValueError(f"vmap({name}, ...): `{name}` can not return a BatchedTensor when out_dim is None") from None
    return _rebuild(outputs, stacked, unmapped)


@contextlib.contextmanager
def _entry_draws(randomness: str, base_key: jax.Array | None, index: jax.Array) -> Iterator[None]:
    """The random stream of one entry (see the module's docstring)."""
    if randomness == "error":
        with draws_refused():
            yield
    elif base_key is None:  # no stream outside either: a random op says so
        yield
    else:
        key = base_key if randomness == "same" else jax.random.fold_in(base_key, index)
        with dispatch.session(nnx.Rngs(key)):
            yield


def _in_chunks(mapped_fn: Callable, batch_size: int, chunk_size: int, arrays: list) -> tuple:
    """torch's chunked vmap: ``mapped_fn`` on ``chunk_size`` entries at a time, the mapped outputs concatenated
    (under ``randomness="same"`` every chunk draws what the first one drew, as torch restores its generator)."""
    chunks = []
    for start in range(0, batch_size, chunk_size):
        stop = min(start + chunk_size, batch_size)
        chunks.append(mapped_fn(jnp.arange(start, stop), *(a[start:stop] for a in arrays)))
    stacked = [jnp.concatenate(parts) for parts in zip(*(c[0] for c in chunks))]
    return stacked, chunks[0][1]


def _take_outputs(outputs: _Outputs, result: Any, out_dims: Any, func: Callable) -> tuple[list, list]:
    leaves, spec = torch_pytree.tree_flatten(padded_nonzero.refuse(result, "torch.vmap's output"))
    dims = _flat_out_dims(result, spec, out_dims, func)
    outputs.spec, outputs.dims = spec, dims
    outputs.leaves = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    outputs.dtypes = [leaf.dtype if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
    stacked, unmapped = [], []
    for leaf, dim in zip(leaves, dims):
        if dim is not None and not isinstance(leaf, torch.Tensor):
            raise ValueError(
                f"vmap({_name(func)}, ...): `{_name(func)}` must only return Tensors, got type {type(leaf)}. "
                "Did you mean to set out_dims= to None for output?"
            )
        if isinstance(leaf, torch.Tensor):
            (unmapped if dim is None else stacked).append(unwrap(leaf))
    return stacked, unmapped


def _flat_out_dims(result: Any, spec: torch_pytree.TreeSpec, out_dims: Any, func: Callable) -> list[int | None]:
    """One out_dim per output leaf, by torch's rules (a lone tensor also takes ``out_dims=(d,)``)."""
    if isinstance(result, torch.Tensor):
        if isinstance(out_dims, int) or out_dims is None:
            return [out_dims]
        if isinstance(out_dims, tuple) and len(out_dims) == 1:
            return list(out_dims)
        flat = None
    else:
        flat = _broadcast_to_and_flatten(out_dims, spec)
    if flat is None:
        raise ValueError(
            f"vmap({_name(func)}, ..., out_dims={out_dims})(<inputs>): out_dims is not compatible with the "
            f"structure of `outputs`. out_dims has structure {torch_pytree.tree_flatten(out_dims)[1]} but outputs "
            f"has structure {spec}."
        )
    return flat


def _rebuild(outputs: _Outputs, stacked: list, unmapped: list) -> Any:
    """The outputs as torch returns them: each mapped one with its entries along its out_dim."""
    stacked, unmapped = iter(stacked), iter(unmapped)
    leaves = []
    for leaf, dim, dtype in zip(outputs.leaves, outputs.dims, outputs.dtypes):
        if dtype is None:
            leaves.append(leaf)
        elif dim is None:
            leaves.append(JaxTensor(next(unmapped), dtype))
        else:
            leaves.append(JaxTensor(jnp.moveaxis(next(stacked), 0, dim), dtype))
    return torch_pytree.tree_unflatten(leaves, outputs.spec)


def _name(func: Callable) -> str:
    return getattr(func, "__name__", repr(func))
