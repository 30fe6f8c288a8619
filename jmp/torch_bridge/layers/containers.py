"""Sequential, ModuleList and ModuleDict."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn

from jmp.torch_bridge.convert import register_layer
from jmp.torch_bridge.module import TorchModule


class _ChildList(TorchModule):
    """Children under "0", "1", ... (torch's keys), indexable like the torch container."""

    def __getitem__(self, index: int | slice) -> Any:
        names = self._torch_children
        if isinstance(index, slice):
            return [getattr(self, n) for n in names[index]]
        return getattr(self, names[index])

    def __len__(self) -> int:
        return len(self._torch_children)

    def __iter__(self) -> Iterator[TorchModule]:
        return (child for _, child in self.children_items())


@register_layer(nn.Sequential)
class Sequential(_ChildList):
    """Calls its children in order; each child's own call path (JAX or torch) is kept."""

    def __call__(self, input: Any) -> Any:
        for _, child in self.children_items():
            input = child(input)
        return input

    def _torch_forward(self, input: Any) -> Any:
        for _, child in self.children_items():
            input = child.torch_call(input)
        return input


@register_layer(nn.ModuleList)
class ModuleList(_ChildList):
    """No forward of its own: torch code iterates the torch list, whose calls reach these children."""


@register_layer(nn.ModuleDict)
class ModuleDict(TorchModule):
    def __getitem__(self, key: str) -> TorchModule:
        if key not in self._torch_children:
            raise KeyError(key)
        return getattr(self, key)

    def __len__(self) -> int:
        return len(self._torch_children)

    def __iter__(self) -> Iterator[str]:
        return iter(self._torch_children)

    def keys(self) -> tuple[str, ...]:
        return self._torch_children

    def items(self) -> Iterator[tuple[str, TorchModule]]:
        return self.children_items()
