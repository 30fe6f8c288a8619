"""``torch.sagemaker.delayed_param.DelayedParamIniter``: SMP v2's delayed parameter initialisation, over jmp's.

A meta-device model wrapped by ``smp.DistributedModel`` is initialised straight into its shards by its own code
(``jmp.wrapped_model.delayed_init``). ``get_param_init_fn()`` runs the same code module by module on the CPU,
ties kept, as FSDP calls it; ``initer_of`` lets a wrapper recognise it and keep the model on meta instead.
The constructor moves the buffers ``init_empty_weights()`` left with values to meta, so the same code fills them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from jmp.errors import ArgumentTypeError, ConfigError
from jmp.runtime import live_models
from jmp.wrapped_model import delayed_init

logger = logging.getLogger("jmp")


class DelayedParamIniter:
    """SMP v2's ``DelayedParamIniter(model)``: the functions PyTorch FSDP takes to initialise a meta-device model."""

    def __init__(self, model: nn.Module, init_method_using_config: Callable | None = None, verbose: bool = False):
        if not isinstance(model, nn.Module):
            raise ArgumentTypeError(f"DelayedParamIniter takes a torch nn.Module, not {type(model).__name__}")
        if init_method_using_config is not None:
            raise ConfigError(
                "DelayedParamIniter(init_method_using_config=...) is not supported: jmp initialises a meta-device "
                "model with its own initialisation code (a Hugging Face model's _init_weights, else each module's "
                "reset_parameters()); give the modules that need it a reset_parameters() instead"
            )
        self.model = model
        self.verbose = verbose
        self.replacements: dict[int, torch.Tensor] = {}  # meta tensor id -> the tensor given storage (ties)
        meta, real = delayed_init.meta_names(model)
        if not meta:
            logger.info("DelayedParamIniter: %s has values already; there is nothing to initialise", _name(model))
        elif real:
            moved = _buffers_to_meta(model)
            logger.info(
                "DelayedParamIniter: %d buffers of %s (%s) go to the meta device too; its initialisation code "
                "fills them with its parameters",
                len(moved),
                _name(model),
                ", ".join(moved[:3]) + (", ..." if len(moved) > 3 else ""),
            )

    def get_param_init_fn(self) -> Callable[[nn.Module], None]:
        """FSDP's ``param_init_fn``: initialises one module's own tensors (see the module's docstring)."""
        return self.param_init_fn

    def get_post_param_init_fn(self) -> Callable[[nn.Module], None]:
        """SMP's ``post_param_init_fn``, run once every module is initialised: ties the model's weights again."""
        return self.post_param_init_fn

    def param_init_fn(self, module: nn.Module) -> None:
        """Give ``module``'s own meta-device tensors CPU storage and fill them with the model's initialisation code."""
        slots = [(s, n) for s in (module._parameters, module._buffers) for n, t in s.items() if _meta(t)]
        if not slots:
            return
        fresh = False
        for table, name in slots:
            tensor = table[name]
            if id(tensor) not in self.replacements:  # else tied to a tensor another module was given
                empty = torch.empty_like(tensor, device="cpu")
                if isinstance(tensor, nn.Parameter):
                    empty = nn.Parameter(empty, requires_grad=tensor.requires_grad)
                self.replacements[id(tensor)] = empty
                fresh = True
            table[name] = self.replacements[id(tensor)]
        if fresh:
            _initialise(self.model, module)
        if self.verbose:
            logger.info("DelayedParamIniter: initialised %s", ", ".join(n for _, n in slots))

    def post_param_init_fn(self, module: nn.Module) -> None:
        """Tie the weights again (a Hugging Face model's ``tie_weights``) once nothing is on the meta device."""
        tie = getattr(self.model, "tie_weights", None)
        if callable(tie) and not delayed_init.meta_names(self.model)[0]:
            tie()

    @contextlib.contextmanager
    def validate_params_and_buffers_inited(self, enabled: bool = True) -> Iterator[None]:
        """Around wrapping the model: on leaving, every tensor must have a value (else ``ConfigError``)."""
        yield
        if not enabled or live_models.owners_of(self.model):
            return
        meta, _ = delayed_init.meta_names(self.model)
        if meta:
            shown = ", ".join(meta[:5]) + (f" and {len(meta) - 5} more" if len(meta) > 5 else "")
            raise ConfigError(
                f"DelayedParamIniter: {len(meta)} tensors of {_name(self.model)} are still on the meta device "
                f"({shown}): wrap the model (jmp's FSDP or smp.DistributedModel) inside this block, or call the "
                "param_init_fn on each module"
            )


def initer_of(function: Any) -> DelayedParamIniter | None:
    """The ``DelayedParamIniter`` whose ``get_param_init_fn()`` ``function`` is, else None (for an FSDP wrapper)."""
    owner = getattr(function, "__self__", None)
    return owner if isinstance(owner, DelayedParamIniter) else None


def _meta(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.is_meta


def _name(model: nn.Module) -> str:
    return type(model).__name__


def _buffers_to_meta(model: nn.Module) -> list[str]:
    """Move the buffers with values to the meta device (shared ones stay shared); their names."""
    moved, replaced = [], {}
    for path, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if isinstance(buffer, torch.Tensor) and not buffer.is_meta:
                replaced.setdefault(id(buffer), buffer.to("meta"))
                module._buffers[name] = replaced[id(buffer)]
                moved.append(f"{path}.{name}" if path else name)
    return moved


def _initialise(model: nn.Module, module: nn.Module) -> None:
    """Run the model's initialisation code on ``module`` alone (its own tensors), on the CPU."""
    with torch.no_grad():
        hugging_face = getattr(model, "_init_weights", None)
        if callable(hugging_face):
            hugging_face(module)
            return
        reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
        if callable(reset):
            reset()
