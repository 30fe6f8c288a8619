"""``JaxTensor``: a torch tensor whose value is a ``jax.Array``, its torch calls lowered by the dispatcher.

It carries torch's shape, dtype and device; views follow torch's aliasing (writes reach the base, a view
re-reads an updated base). ``dispatch.py`` installs itself as the handler with ``JaxTensor.route_to``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import torch
import torch.utils._pytree as torch_pytree

from jmp.errors import JmpError
from jmp.torch_bridge.dtypes import to_torch_dtype
from jmp.torch_bridge.interop import tensor_to_array


@dataclasses.dataclass
class _ViewLink:
    base: JaxTensor
    read: Callable[[jax.Array], jax.Array]  # base value -> view value
    base_version: int


def _no_dispatcher(func: Any, *rest: Any) -> Any:
    raise JmpError(
        f"a torch call ({func}) reached a JaxTensor before the bridge's dispatcher was loaded; "
        "import jmp.torch_bridge (not only jmp.torch_bridge.tensor) before running torch code on JaxTensors."
    )


class JaxTensor(torch.Tensor):
    """A torch.Tensor wrapping a jax.Array; torch ops on it lower to JAX."""

    _value: jax.Array
    _jmp_version: int
    _view_link: _ViewLink | None
    # The handlers of torch calls on JaxTensors, installed by the dispatcher (see the module docstring).
    _torch_function_handler: ClassVar[Callable[[Any, tuple, dict], Any]] = staticmethod(_no_dispatcher)
    _aten_handler: ClassVar[Callable[[Any], Any]] = staticmethod(_no_dispatcher)

    @classmethod
    def route_to(cls, torch_function: Callable[[Any, tuple, dict], Any], aten: Callable[[Any], Any]) -> None:
        """Send torch function calls to ``torch_function(func, args, kwargs)``, ATen ops to ``aten(func)``."""
        cls._torch_function_handler = staticmethod(torch_function)
        cls._aten_handler = staticmethod(aten)

    @staticmethod
    def __new__(cls, value: jax.Array, torch_dtype: torch.dtype | None = None):
        dtype = torch_dtype if torch_dtype is not None else to_torch_dtype(value.dtype)
        tensor = torch.Tensor._make_wrapper_subclass(
            cls, tuple(value.shape), dtype=dtype, device="cpu", requires_grad=False
        )
        tensor._value = value
        tensor._jmp_version = 0
        tensor._view_link = None
        return tensor

    def __init__(self, value: jax.Array, torch_dtype: torch.dtype | None = None):
        super().__init__()

    @property
    def value(self) -> jax.Array:
        """The current value, re-read from the base if this view's base changed."""
        link = self._view_link
        if link is not None and link.base_version != link.base._jmp_version:
            self._value = link.read(link.base.value)
            link.base_version = link.base._jmp_version
        return self._value

    def set_value(self, new: jax.Array) -> None:
        """In-place update (torch semantics: keeps shape and dtype, writes through views)."""
        new = jnp.asarray(new)
        if new.shape != self._value.shape:
            new = jnp.broadcast_to(new, self._value.shape)
        new = new.astype(self._value.dtype)
        self._value = new
        self._jmp_version += 1
        link = self._view_link
        if link is not None:
            base = link.base
            base_value = base.value
            positions = link.read(jnp.arange(base_value.size).reshape(base_value.shape))
            flat = base_value.reshape(-1).at[positions.reshape(-1)].set(new.reshape(-1))
            base.set_value(flat.reshape(base_value.shape))
            link.base_version = base._jmp_version

    @property
    def write_count(self) -> int:
        """How many times this tensor was written in place since it was made (0: never)."""
        return self._jmp_version

    def rebind(self, value: jax.Array) -> None:
        """Point at ``value`` without counting a write: the value moved (out of a JAX transform), it did not change."""
        self._value = value

    def record_write(self, value: jax.Array) -> None:
        """Take ``value`` as written in place (counted), as is: no broadcast, cast or write through views."""
        self._value = value
        self._jmp_version += 1

    def make_view_of(self, base: JaxTensor, read: Callable[[jax.Array], jax.Array]) -> None:
        self._view_link = _ViewLink(base, read, base._jmp_version)

    def __repr__(self) -> str:
        return f"JaxTensor({self._value!r}, torch_dtype={self.dtype})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return JaxTensor._torch_function_handler(func, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Reached only when torch calls an ATen op directly, bypassing
        # __torch_function__; that op has no lowering.
        return JaxTensor._aten_handler(func)


def wrap(value: Any, torch_dtype: torch.dtype | None = None) -> Any:
    """A JaxTensor for a jax.Array (other values are returned unchanged)."""
    if isinstance(value, jax.Array):
        return JaxTensor(value, torch_dtype)
    return value


def unwrap(value: Any) -> Any:
    """The jax.Array behind a JaxTensor; a plain torch tensor becomes a constant array."""
    if isinstance(value, JaxTensor):
        return value.value
    if isinstance(value, torch.Tensor):
        return tensor_to_array(value)
    return value


def wrap_tree(tree: Any) -> Any:
    return torch_pytree.tree_map(wrap, tree)


def unwrap_tree(tree: Any) -> Any:
    return torch_pytree.tree_map(unwrap, tree)


def contains_tensor(tree: Any, kind: type = torch.Tensor) -> bool:
    return any(isinstance(leaf, kind) for leaf in torch_pytree.tree_leaves(tree))
