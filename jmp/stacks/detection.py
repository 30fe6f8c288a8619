"""Which layer lists of a model are stacks of identical layers: same classes, parameter shapes, dtypes and static
configuration, so that one compiled layer body can run all of them (``jmp.stacks.scan``)."""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Hashable
from typing import Any

import torch
from torch import nn

# attributes that number a layer (Hugging Face's ``layer_idx`` keys the key/value cache); a layer that computes
# with its number is told apart when the scanned body is traced (``jmp.stacks.scan``), not here
_LAYER_NUMBERS = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "layer_num", "block_idx", "idx"})
MAX_PERIOD = 4  # kinds of layer in turn (Gemma-2's sliding and global attention: 2)
_TORCH_STATE = frozenset({"_parameters", "_buffers", "_modules", "training", "_non_persistent_buffers_set"})


@dataclasses.dataclass(frozen=True)
class LayerStack:
    """The layers of one ``nn.ModuleList`` / ``nn.Sequential``, by torch path, with each layer's signature: runs of
    layers repeating with a period (each layer's signature equal to that of the layer ``period`` before it) can be
    scanned as one."""

    container: str
    paths: tuple[str, ...]
    signatures: tuple[Hashable, ...]

    def index(self, path: str) -> int:
        return self.paths.index(path)


def find_stacks(root: nn.Module) -> list[LayerStack]:
    """The layer lists of ``root`` holding layers with equal signatures at most ``MAX_PERIOD`` apart (outermost lists
    only: a list inside a stacked layer is part of its body)."""
    stacks: list[LayerStack] = []
    for path, module in root.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        if any(path.startswith(f"{s.container}.") or path == s.container for s in stacks):
            continue
        children = [(name, child) for name, child in module.named_children() if child is not None]
        if len(children) < 2:
            continue
        signatures = tuple(signature(child) for _, child in children)
        if any(signatures[i] == signatures[i - p] for p in range(1, MAX_PERIOD + 1) for i in range(p, len(signatures))):
            paths = tuple(f"{path}.{name}" if path else name for name, _ in children)
            stacks.append(LayerStack(path, paths, signatures))
    return stacks


def signature(layer: nn.Module) -> Hashable:
    """What must be equal for two layers to be one scanned body: the module tree's classes, parameter and buffer
    shapes, dtypes and flags, and every other attribute's value (layer numbers aside)."""
    parts = []
    within = {id(module): path for path, module in layer.named_modules(remove_duplicate=False)}
    for path, module in layer.named_modules():
        tensors = tuple(
            (name, tuple(t.shape), t.dtype, bool(t.requires_grad), kind)
            for kind, table in (("param", module._parameters), ("buffer", module._buffers))
            for name, t in table.items()
            if t is not None
        )
        attributes = tuple(
            (name, _value_key(value, within))
            for name, value in sorted(module.__dict__.items())
            if name not in _TORCH_STATE
            and name not in _LAYER_NUMBERS
            and not name.startswith("_forward")
            and not name.startswith("_backward")
            and not name.startswith("_state_dict")
            and not name.startswith("_load_state_dict")
        )
        parts.append((path, type(module), module.training, tensors, attributes))
    return tuple(parts)


def _value_key(value: Any, within: dict[int, str]) -> Hashable:
    if isinstance(value, nn.Module) and id(value) in within:
        return (
            "submodule",
            within[id(value)],
        )  # an alias of one of the layer's own modules (jmp.wrapped_model.smp_paths)
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.dtype, torch.device, type)):
        return (type(value), value)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_value_key(v, within) for v in value))
    if isinstance(value, dict):
        try:
            return (dict, tuple(sorted((k, _value_key(v, within)) for k, v in value.items())))
        except TypeError:
            return (dict, id(value))
    if isinstance(value, (set, frozenset)):
        return (type(value), frozenset(_value_key(v, within) for v in value))
    if isinstance(value, functools.partial):  # an activation bound to its arguments, made anew in each layer
        return (
            functools.partial,
            _value_key(value.func, within),
            _value_key(value.args, within),
            _value_key(value.keywords, within),
        )
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        return ("function", value.__module__, value.__qualname__)
    return ("object", id(value))  # a shared config object is the same object in every layer
