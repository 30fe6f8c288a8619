"""``PendingTensor``: a layer's output whose value is computed when something first reads it.

A stacked layer's call returns one instead of running the layer: when the next layer of the stack is called on it,
the call joins the same scan (``jmp.stacks.scan``); anything else that reads it (a torch op, the step's outputs)
runs the scan of the layers joined so far first.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import torch

from jmp.torch_bridge.tensor import JaxTensor


class PendingTensor(JaxTensor):
    """A JaxTensor whose value ``compute(tensor)`` gives at its first read; shape and dtype are known before."""

    _compute: Callable[[PendingTensor], jax.Array] | None

    @staticmethod
    def __new__(
        cls, like: jax.ShapeDtypeStruct, torch_dtype: torch.dtype, compute: Callable[[PendingTensor], jax.Array]
    ):
        tensor = JaxTensor.__new__(cls, like, torch_dtype)
        tensor._compute = compute
        return tensor

    def __init__(
        self, like: jax.ShapeDtypeStruct, torch_dtype: torch.dtype, compute: Callable[[PendingTensor], jax.Array]
    ):
        super().__init__(like, torch_dtype)

    @property
    def aval(self) -> jax.ShapeDtypeStruct | jax.Array:
        """Its shape and dtype, without computing it (its value, once computed)."""
        return self._value

    @property
    def value(self) -> jax.Array:
        compute = self._compute
        if compute is not None:
            self._compute = None
            self._value = compute(self)
        return super().value

    def resolve(self, value: jax.Array) -> None:
        """Take ``value`` as the computed value (a scan computed several pending tensors at once)."""
        self._compute = None
        self._value = value

    def set_value(self, new: jax.Array) -> None:
        self.value  # noqa: B018 (computed first: an in-place write replaces a value that existed)
        super().set_value(new)

    def rebind(self, value: jax.Array) -> None:
        self._compute = None
        super().rebind(value)

    def record_write(self, value: jax.Array) -> None:
        self._compute = None
        super().record_write(value)

    def __repr__(self) -> str:
        if self._compute is not None:
            return f"PendingTensor(shape={tuple(self.shape)}, dtype={self.dtype})"
        return super().__repr__()
