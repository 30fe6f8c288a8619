"""Copying values between torch tensors and JAX arrays."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch
from jax.experimental import multihost_utils

from jmp.torch_bridge.dtypes import to_jax_dtype


def tensor_to_array(tensor: torch.Tensor) -> jax.Array:
    """A JAX array holding a copy of a CPU-readable torch tensor."""
    with torch._C.DisableTorchFunction():  # a plain copy, never a lowered op
        # the lazy conjugate / negative bits (torch.fft.ifft's results, x.conj()) materialised: numpy() refuses them
        tensor = tensor.detach().cpu().resolve_conj().resolve_neg()
    if tensor.dtype == torch.bfloat16:
        host = tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
        host = tensor.numpy()
    # Copy: JAX may alias host memory, and torch may later update the tensor in place.
    return jnp.asarray(host.copy(), dtype=to_jax_dtype(tensor.dtype))


def array_to_tensor(array, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A torch tensor holding a copy of a JAX array (cast to ``dtype``); a multi-process array is gathered."""
    host = host_array(array)
    if host.dtype == ml_dtypes.bfloat16:
        tensor = torch.from_numpy(host.view(np.int16).copy()).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(host.copy())
    return tensor if dtype is None else tensor.to(dtype)


def host_array(array: Any) -> np.ndarray:
    """A JAX array's value in host memory; gathered when spread over several processes (a collective)."""
    if isinstance(array, jax.Array) and not array.is_fully_addressable and not array.is_fully_replicated:
        array = multihost_utils.process_allgather(array, tiled=True)
    return np.asarray(jax.device_get(array))


def local_piece(array: Any) -> Any:
    """This process's piece of an array spread over several processes (the array itself otherwise)."""
    if isinstance(array, jax.Array) and not array.is_fully_addressable:
        return array.addressable_shards[0].data
    return array
