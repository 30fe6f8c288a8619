"""``convert``: a torch ``nn.Module`` tree -> a Flax NNX module tree with the same names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import torch
from flax import nnx
from torch.nn.utils import parametrize

from jmp.errors import ConversionError
from jmp.torch_bridge.dtypes import to_jax_dtype
from jmp.torch_bridge.interop import tensor_to_array
from jmp.torch_bridge.module import GenericModule, TorchModule, join

# torch module class -> NNX class that replaces it (standard layers, see layers/)
LAYERS: dict[type, type[TorchModule]] = {}


def register_layer(*torch_types: type) -> Callable[[type[TorchModule]], type[TorchModule]]:
    """Class decorator: convert instances of ``torch_types`` (whose forward is not overridden) to the class."""

    def decorate(cls: type[TorchModule]) -> type[TorchModule]:
        for torch_type in torch_types:
            LAYERS[torch_type] = cls
        return cls

    return decorate


def layer_class(torch_module: torch.nn.Module) -> type[TorchModule]:
    """The NNX class for a torch module: its standard layer if forward is the standard one, else generic.

    A parametrized module (``torch.nn.utils.parametrize``: ``weight_norm``, ``spectral_norm``, ...) is generic:
    its forward reads the computed weight, which the parametrizations (converted children) compute from their
    ``original`` parameters on every call, under torch's names (``parametrizations.weight.original0``).
    """
    if "forward" not in torch_module.__dict__ and not parametrize.is_parametrized(torch_module):
        for klass in type(torch_module).__mro__:
            if klass in LAYERS:
                if type(torch_module).forward is klass.forward:
                    return LAYERS[klass]
                break
    return GenericModule


class Converter:
    """One conversion: shares Variables between tied torch tensors and one random stream."""

    def __init__(self, rngs: nnx.Rngs, allow_meta: bool = False):
        self.rngs = rngs
        self.allow_meta = allow_meta
        self._variables: dict[int, nnx.Variable] = {}
        self._first_names: dict[int, str] = {}  # tensor -> the torch name it was converted under first
        self._ties: list[tuple[str, str]] = []  # (later name, first name) of tied tensors, not yet claimed

    def first_name(self, tensor: torch.Tensor) -> str | None:
        """The torch name a tensor was already converted under (it is tied), or None.

        Modules are converted in torch's order (own tensors, then children in registration order), so this
        is the name ``named_parameters()`` / ``named_buffers()`` report.
        """
        return self._first_names.get(id(tensor))

    def tie(self, name: str, first_name: str) -> None:
        """Record that the tensor at torch name ``name`` is the one converted under ``first_name``."""
        self._ties.append((name, first_name))

    def claim_ties(self, path: str) -> tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]:
        """The recorded ties whose innermost common module is the one at ``path``, as name parts relative to it."""
        prefix = path.split(".") if path else []
        claimed, pending = [], []
        for name, first in self._ties:
            later_parts, first_parts = name.split("."), first.split(".")
            common = 0
            while common < min(len(later_parts), len(first_parts)) - 1 and later_parts[common] == first_parts[common]:
                common += 1
            if later_parts[:common] == prefix:
                claimed.append((tuple(later_parts[common:]), tuple(first_parts[common:])))
            else:
                pending.append((name, first))
        self._ties = pending
        return tuple(claimed)

    def module(self, torch_module: torch.nn.Module, path: str) -> TorchModule:
        _check_convertible(torch_module, path)
        return layer_class(torch_module)(torch_module, path, self)

    def variable(self, tensor: torch.Tensor, kind: type, path: str, name: str, **metadata: Any) -> nnx.Variable:
        """The Variable for a torch tensor; the same tensor (tied weights) gives the same Variable."""
        existing = self._variables.get(id(tensor))
        if existing is not None:
            return existing
        if tensor.is_meta and not self.allow_meta:
            raise ConversionError(
                f"'{join(path, name)}' is on the meta device (no values). Materialise the module "
                "(e.g. module.to_empty(device='cpu') and initialise it) before converting, or wrap it in "
                "smp.DistributedModel, which initialises it directly into its shards."
            )
        if kind is nnx.Param:
            metadata["requires_grad"] = tensor.requires_grad
        if tensor.is_meta:
            value = jax.ShapeDtypeStruct(tuple(tensor.shape), to_jax_dtype(tensor.dtype))
        else:
            value = tensor_to_array(tensor)
        variable = kind(value, torch_dtype=tensor.dtype, **metadata)
        self._variables[id(tensor)] = variable
        self._first_names[id(tensor)] = join(path, name)
        return variable

    @staticmethod
    def check_name(module: TorchModule, name: str, path: str) -> None:
        if name in _RESERVED or hasattr(type(module), name):
            raise ConversionError(
                f"'{join(path, name)}': the name '{name}' is used by the converted module itself "
                f"({type(module).__name__}.{name}); rename the torch attribute to convert it."
            )


_RESERVED = {"rngs", "deterministic", "use_running_average"}


def _check_convertible(torch_module: Any, path: str) -> None:
    where = f"'{path}'" if path else "the root module"
    if not isinstance(torch_module, torch.nn.Module):
        raise ConversionError(f"{where} is a {type(torch_module).__name__}, not a torch.nn.Module")
    if isinstance(torch_module, torch.jit.ScriptModule):
        raise ConversionError(
            f"{where} is a TorchScript module; TorchScript is not supported. Convert the Python module instead."
        )
    if isinstance(torch_module, torch.nn.parallel.DistributedDataParallel):
        raise ConversionError(
            f"{where} is wrapped in PyTorch's DistributedDataParallel; pass the inner module (ddp.module): jmp does "
            "data parallelism itself (jmp.fsdp.DistributedDataParallel, what a script's torch DDP is under "
            "python -m jmp.launch)."
        )


def convert(module: torch.nn.Module, *, rngs: nnx.Rngs | int | None = None, allow_meta: bool = False) -> TorchModule:
    """Convert a torch module tree to Flax NNX, parameters and buffers copied exactly.

    The result mirrors the torch tree (parameter paths equal ``state_dict`` keys; tied tensors stay tied)
    and is called like the torch module, with ``jax.Array``s for tensors.

    Args:
        rngs: seeds dropout and ``torch.rand*`` inside the model: an ``nnx.Rngs`` or an int seed. By
            default it follows torch's seed (``torch.manual_seed``), so a seeded torch script is
            reproducible here too.
        allow_meta: tensors on the meta device become Variables holding ``jax.ShapeDtypeStruct``s, for
            ``jmp.wrapped_model.delayed_init`` to fill by running the module's initialisation code (else an error).

    Raises:
        ConversionError: a submodule is not a ``torch.nn.Module``, is a TorchScript module or is wrapped in
            ``DistributedDataParallel``; a tensor is on the meta device (without ``allow_meta``); an
            attribute's name clashes with the converted module's own; an ``nn.Embedding`` uses ``max_norm``
            or ``scale_grad_by_freq``. Unsupported torch ops are found when the converted module runs
            (``UnsupportedOpError``).
    """
    if not isinstance(rngs, nnx.Rngs):
        rngs = nnx.Rngs(torch.initial_seed() % 2**32 if rngs is None else rngs)
    return Converter(rngs, allow_meta).module(module, "")
