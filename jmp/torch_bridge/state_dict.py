"""Torch names for a converted module's values, and export as a torch ``state_dict``."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

import jax
import torch
from flax import nnx

from jmp.torch_bridge.interop import array_to_tensor
from jmp.torch_bridge.module import TorchModule


def named_variables(module: TorchModule, prefix: str = "") -> Iterator[tuple[str, nnx.Variable]]:
    """(torch key, Variable) for every parameter and buffer in ``state_dict`` order, a tied one under each name."""
    for name in module.torch_state_names:
        yield prefix + name, getattr(module, name)
    for name, child in module.children_items():
        yield from named_variables(child, f"{prefix}{name}.")


def to_state_dict(module: TorchModule, prefix: str = "") -> OrderedDict[str, torch.Tensor]:
    """Torch tensors under torch's keys and order (no non-persistent buffers), gathered to the host; ties share one."""
    tensors: dict[int, torch.Tensor] = {}
    out = OrderedDict()
    for key, variable in named_variables(module, prefix):
        if variable.get_metadata("persistent", True):
            if id(variable) not in tensors:
                tensors[id(variable)] = array_to_tensor(variable[...], variable.get_metadata("torch_dtype", None))
            out[key] = tensors[id(variable)]
    return out


def torch_name(key_path: tuple) -> str:
    """The torch name of a leaf of a flattened ``nnx.State`` (its dict keys joined; the Variable's own key dropped)."""
    return ".".join(str(k.key) for k in key_path if isinstance(k, jax.tree_util.DictKey))
