"""Torch tensors whose values live on the JAX devices and are copied to the host at their first read.

``p.grad`` and ``clip_grad_norm_``'s result answer shape, dtype and device without a copy, so a loop that logs
every N steps waits for the devices every N steps.
"""

from __future__ import annotations

from typing import Any

import jax
import torch
import torch.utils._pytree as torch_pytree

from jmp.torch_bridge.dtypes import to_torch_dtype
from jmp.torch_bridge.interop import array_to_tensor


class DeviceValue(torch.Tensor):
    """A tensor of ``shape`` and ``dtype`` whose value a subclass's ``fetch()`` copies from the devices, once."""

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], dtype: torch.dtype, device: Any = "cpu", *_: Any):
        return torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device)

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: Any = "cpu", *_: Any):
        super().__init__()
        self.host_value: torch.Tensor | None = None

    def fetch(self) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} defines fetch()")

    def materialized(self) -> torch.Tensor:
        if self.host_value is None:
            self.host_value = self.fetch()
        return self.host_value

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) == "__get__":  # .shape, .dtype, .device: the wrapper's own
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        return func(*_materialized(args), **_materialized(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return func(*_materialized(args), **_materialized(kwargs or {}))

    def __repr__(self) -> str:
        return repr(self.materialized())


class DeviceArray(DeviceValue):
    """A JAX array as a torch tensor, copied to the host (gathered across processes: a collective) at its first read."""

    @staticmethod
    def __new__(cls, array: jax.Array):
        return DeviceValue.__new__(cls, tuple(array.shape), to_torch_dtype(array.dtype))

    def __init__(self, array: jax.Array):
        super().__init__(tuple(array.shape), to_torch_dtype(array.dtype))
        self.array = array

    def fetch(self) -> torch.Tensor:
        return array_to_tensor(self.array, self.dtype)


def _materialized(tree: Any) -> Any:
    return torch_pytree.tree_map_only(DeviceValue, DeviceValue.materialized, tree)
