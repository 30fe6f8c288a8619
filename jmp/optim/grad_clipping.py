"""``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` on a ``DistributedModel``'s parameters.

``import jmp`` replaces torch's functions with these, which clip a DistributedModel's gradients on the devices
inside the compiled update (a global norm, of the unscaled gradients) and hand other tensors to torch's. A
script that bound torch's function before importing jmp keeps torch's: import jmp first.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

from jmp.errors import OptimizerError
from jmp.optim import update_steps
from jmp.runtime import live_models as model_registry
from jmp.torch_bridge.device_values import DeviceArray
from jmp.wrapped_model.module_surface import ModelParameters

_TORCH_NORM = torch.nn.utils.clip_grad.clip_grad_norm_
_TORCH_VALUE = torch.nn.utils.clip_grad.clip_grad_value_


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """torch's ``clip_grad_norm_``: scale the gradients to a total norm of at most ``max_norm``; the norm before."""
    tensors = _listed(parameters)
    owner = _owner(tensors, "clip_grad_norm_")
    if owner is None:
        return _TORCH_NORM(tensors, max_norm, norm_type, error_if_nonfinite, foreach)
    model, names = owner
    training = model.training_state
    if training.grads is None:
        return torch.zeros(())
    mask = _mask(model, names)
    norm, factor = _norm_and_factor(
        training.grads, mask, float(max_norm), float(norm_type), _scale(model), model.store.counted_once
    )
    if mask is None:  # all of them: the optimizer multiplies the factor in as it reads the gradients
        training.scale_grads_later(factor)
    else:
        training.grads = _scaled_some(training.grads, mask, factor)
    norm = DeviceArray(norm)  # read (a wait for the devices) only if the loop reads it
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
            "set `error_if_nonfinite=False`"
        )
    return norm


def clip_grad_value_(
    parameters: torch.Tensor | Iterable[torch.Tensor], clip_value: float, foreach: bool | None = None
) -> None:
    """torch's ``clip_grad_value_``: clamp each gradient element to ``[-clip_value, clip_value]``."""
    tensors = _listed(parameters)
    owner = _owner(tensors, "clip_grad_value_")
    if owner is None:
        return _TORCH_VALUE(tensors, clip_value, foreach)
    model, names = owner
    training = model.training_state
    if training.grads is not None:
        training.grads = _clip_value(training.grads, _mask(model, names), float(clip_value), _scale(model))
    return None


clip_grad_norm = clip_grad_norm_  # torch's deprecated spelling


def install() -> None:
    """Put these in ``torch.nn.utils`` (and ``torch.nn.utils.clip_grad``), where scripts look them up."""
    for namespace in (torch.nn.utils, torch.nn.utils.clip_grad):
        namespace.clip_grad_norm_ = clip_grad_norm_
        namespace.clip_grad_value_ = clip_grad_value_
        namespace.clip_grad_norm = clip_grad_norm


# --- which model, which gradients ---------------------------------------------------------------------------


def _listed(parameters: Any) -> list:
    if isinstance(parameters, ModelParameters):  # model.parameters(): which tensors, without copying their values
        return parameters.objects()
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _owner(tensors: list, call: str) -> tuple[Any, list[str]] | None:
    """(the DistributedModel these are parameters of, their names), or None for other tensors."""
    ids = {id(t) for t in tensors}
    owners = _owners(model_registry.live(collect=False), ids)  # clipping runs every step: no collection
    if len(owners) > 1:  # unless a dropped model, not yet collected, holds the same parameters
        owners = _owners(model_registry.live(), ids)
    if not owners:
        return None
    if len(owners) > 1:
        raise OptimizerError(f"torch.nn.utils.{call} got parameters of {len(owners)} DistributedModels; clip each")
    model, names = owners[0]
    held = {id(p) for p in model.torch_module.parameters()}
    strangers = sum(id(t) not in held for t in tensors)
    if strangers:
        raise OptimizerError(
            f"torch.nn.utils.{call} got {strangers} tensor(s) that are not parameters of the DistributedModel "
            "beside its parameters; clip the model's parameters and other tensors in separate calls"
        )
    return model, names


def _owners(models: list, ids: set[int]) -> list[tuple[Any, list[str]]]:
    owners = []
    for model in models:
        names = [n for n, p in model.torch_module.named_parameters(remove_duplicate=False) if id(p) in ids]
        if names:
            owners.append((model, names))
    return owners


def _mask(model: Any, names: list[str]) -> tuple[bool, ...] | None:
    """Per gradient leaf (the layout's name order): whether it is one of ``names``' (None: all of them)."""
    return model.store.leaf_mask(set(names))


def _scale(model: Any) -> jax.Array:
    """What the gradients are multiplied by: the loss scale, unless a GradScaler has unscaled them."""
    optimizer = model.attached_optimizer
    if optimizer is not None and optimizer.grads_unscaled:
        return jnp.ones((), jnp.float32)
    return model.loss_scale


def _selected(grads: Any, mask: tuple[bool, ...] | None) -> list:
    leaves = jax.tree.leaves(grads)
    return leaves if mask is None else [g for g, m in zip(leaves, mask) if m]


def _apply(grads: Any, mask: tuple[bool, ...] | None, fn) -> Any:
    leaves, treedef = jax.tree.flatten(grads)
    chosen = mask or (True,) * len(leaves)
    return jax.tree.unflatten(treedef, [fn(g) if m else g for g, m in zip(leaves, chosen)])


@functools.partial(jax.jit, static_argnums=(1, 3, 5))
def _norm_and_factor(grads: Any, mask: Any, max_norm: float, norm_type: float, scale: jax.Array, counted_once):
    """(total norm, clipping factor), torch's rule (``update_steps.torch_clip_factor``) on the unscaled gradients,
    each parameter's counted once (``counted_once``: the model store's; a pipeline stores tied ones per stage)."""
    unscaled = [g.astype(jnp.float32) / scale for g in _selected(counted_once(grads), mask)]
    if not unscaled:
        return jnp.zeros((), jnp.float32), jnp.ones((), jnp.float32)
    if math.isinf(norm_type):
        norm = jnp.max(jnp.stack([jnp.max(jnp.abs(g)) for g in unscaled]))
    else:
        norm = sum(jnp.sum(jnp.abs(g) ** norm_type) for g in unscaled) ** (1.0 / norm_type)
    return norm, update_steps.torch_clip_factor(norm, max_norm)


@functools.partial(jax.jit, static_argnums=(1,))
def _scaled_some(grads: Any, mask: Any, factor: jax.Array) -> Any:
    """The gradients of ``mask`` multiplied by ``factor``, keeping their scale and dtype."""
    return _apply(grads, mask, lambda g: (g.astype(jnp.float32) * factor).astype(g.dtype))


@functools.partial(jax.jit, static_argnums=(1,))
def _clip_value(grads: Any, mask: Any, clip_value: float, scale: jax.Array) -> Any:
    bound = clip_value * scale
    return _apply(grads, mask, lambda g: jnp.clip(g.astype(jnp.float32), -bound, bound).astype(g.dtype))
