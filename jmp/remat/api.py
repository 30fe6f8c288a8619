"""The smp activation-checkpointing functions, on ``jax.checkpoint``.

A checkpoint keeps its inputs (and what its policy keeps) and replays the random stream in the recomputation.
Every tensor in any argument structure is an input, so SMP's ``pack_args_as_tuple`` changes nothing. What a
checkpointed module leaves behind must come out through its outputs, buffers or in-place argument writes (call
Hugging Face models with ``use_cache=False``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

from torch import nn

from jmp.errors import ArgumentTypeError, ConfigError, ModelLookupError
from jmp.remat import context, region
from jmp.remat.groups import LayerGroups
from jmp.remat.policies import KEEP_MATMULS, Resolved, resolve
from jmp.remat.strategies import groups, parse_strategy
from jmp.runtime import live_models as model_registry
from jmp.runtime import mesh_state as state
from jmp.runtime.config import Config
from jmp.runtime.policy_syntax import Policy, parse_policy
from jmp.torch_bridge.module import TorchModule, call_hooks


@dataclasses.dataclass(frozen=True)
class _Annotation:
    strategy: str
    policy: Policy | None  # None: the config's activation_checkpointing_policy


_ANNOTATIONS: weakref.WeakKeyDictionary[nn.Module, _Annotation] = weakref.WeakKeyDictionary()


def set_activation_checkpointing(
    module: nn.Module,
    preserve_rng_state: bool = True,
    pack_args_as_tuple: bool = False,
    strategy: str = "each",
    policy: Policy | str | None = None,
) -> None:
    """Checkpoint every call of ``module`` (a container: its layers, grouped by ``strategy``) from the next step on.

    ``module`` is part of a model wrapped in ``smp.DistributedModel``; ``strategy`` is "each", "group_N" or
    "contiguous" (``strategies``; the last two need an ``nn.Sequential`` / ``nn.ModuleList``); ``policy`` a preset
    ("full", "save_matmuls", "save_names:a,b", "offload_names:a,b"), a ``RematPolicy`` or a ``jax.checkpoint_policies``
    policy (default: the config's). ``preserve_rng_state`` and ``pack_args_as_tuple`` are SMP's, with no effect.
    Raises ``ArgumentTypeError`` / ``ModelLookupError`` / ``ConfigError`` for a bad module, model or option; a
    grouped container whose layers do not chain raises ``ActivationCheckpointingError`` while a step traces.
    """
    where = "smp.set_activation_checkpointing"
    _check_flags(where, preserve_rng_state, pack_args_as_tuple)
    strategy = parse_strategy(strategy, where)
    parsed = None if policy is None else parse_policy(policy, where)
    if not isinstance(module, nn.Module):
        raise ArgumentTypeError(f"{where} takes a torch.nn.Module of the model, not a {type(module).__name__}")
    owners = model_registry.owners_of(module)
    if not owners:
        raise ModelLookupError(
            f"{where}: the {_describe(module)} is not part of a model wrapped in smp.DistributedModel. Wrap the "
            "model first, then pass one of its submodules, reached through model.module (e.g. "
            "model.module.transformer.h)."
        )
    if strategy != "each" and not _is_container(module):
        raise ConfigError(
            f"{where}: strategy '{strategy}' groups the layers of an nn.Sequential or nn.ModuleList, but the "
            f"{_describe(module, owners[0].torch_module)} is not one; use strategy='each' "
            "(the module is one checkpoint)."
        )
    _ANNOTATIONS[module] = _Annotation(strategy, parsed)
    for model in owners:
        model.programs.clear()  # programs traced before the annotation do not checkpoint


@contextlib.contextmanager
def planned(root: nn.Module, strategies: dict[str, str]) -> Iterator[None]:
    """Within the block, the submodules of ``root`` at these torch paths are checkpointed with these strategies,
    as ``smp.set_activation_checkpointing`` would mark them (for a model not wrapped yet: a memory estimate)."""
    where = "smp.estimate_memory(activation_checkpointing=...)"
    modules = dict(root.named_modules())
    saved = {}
    for path, strategy in strategies.items():
        if path not in modules:
            raise ArgumentTypeError(f"{where}: the model has no submodule '{path}'")
        module = modules[path]
        saved[module] = _ANNOTATIONS.get(module)
        _ANNOTATIONS[module] = _Annotation(parse_strategy(strategy, where), None)
    try:
        yield
    finally:
        for module, previous in saved.items():
            if previous is None:
                _ANNOTATIONS.pop(module, None)
            else:
                _ANNOTATIONS[module] = previous


def checkpoint(module: nn.Module, *args: Any, preserve_rng_state: bool = True, policy: Any = None, **kwargs: Any):
    """``module(*args, **kwargs)`` as one checkpoint (inside a forward); outside a step, just the call."""
    where = "smp.checkpoint"
    _check_flags(where, preserve_rng_state, False)
    parsed = None if policy is None else parse_policy(policy, where)
    if not isinstance(module, nn.Module):
        raise ArgumentTypeError(
            f"{where} takes a torch.nn.Module of the model, not a {type(module).__name__}; put the computation "
            "in a submodule of the model and checkpoint that."
        )
    twin = _twin(module, where)
    if twin is None:
        return module(*args, **kwargs)
    return region.run([twin], [None], args, kwargs, _resolve(parsed))[0]


def checkpoint_sequential(
    sequential_module: nn.Sequential,
    input: Any,
    strategy: str = "each",
    preserve_rng_state: bool = True,
    pack_args_as_tuple: bool = False,
    policy: Any = None,
) -> Any:
    """Run an ``nn.Sequential`` (each layer fed the previous output) in checkpoints grouped by ``strategy``."""
    where = "smp.checkpoint_sequential"
    _check_flags(where, preserve_rng_state, pack_args_as_tuple)
    strategy = parse_strategy(strategy, where)
    parsed = None if policy is None else parse_policy(policy, where)
    if not isinstance(sequential_module, nn.Sequential):
        raise ArgumentTypeError(f"{where} takes an nn.Sequential, not a {type(sequential_module).__name__}")
    twin = _twin(sequential_module, where)
    if twin is None:
        return sequential_module(input)
    layers = [child for _, child in twin.children_items()]
    resolved = _resolve(parsed)
    for group in groups(strategy, len(layers)):
        units = [layers[i] for i in group]
        input = region.run(units, [None] * len(units), (input,), {}, resolved, "whole")[-1]
    return input


@contextlib.contextmanager
def tracing(
    torch_root: nn.Module, twin_root: TorchModule, gathered: tuple[tuple[str, Any], ...] = ()
) -> Iterator[None]:
    """While a step traces a model: its annotated modules are checkpointed, and ``checkpoint`` finds its twins.

    ``gathered`` (torch name -> (sharding without fsdp, stored sharding)): every layer of the model's layer lists
    gathers its fsdp-split weights inside a checkpoint that keeps matmul outputs but not the weights (FSDP's reshard
    after forward), and hands their gradients back split as stored.
    """
    with context.tracing(torch_root, twin_root) as trace:
        hooks = _reshard_hooks(trace.modules, gathered) if gathered else {}
        with call_hooks(hooks | _annotation_hooks(trace, gathered)):
            yield


def _reshard_hooks(modules: dict[str, nn.Module], gathered: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    """One checkpoint per layer of the outermost layer lists holding parameters split over fsdp."""
    names = [name for name, _ in gathered]
    policy = KEEP_MATMULS.with_gathered(gathered)
    hooks: dict[str, Any] = {}
    for path, module in modules.items():
        if not _is_container(module) or any(path.startswith(f"{p}.") for p in hooks):
            continue
        paths = [f"{path}.{name}" if path else name for name, child in module.named_children() if child is not None]
        paths = [p for p in paths if any(n.startswith(f"{p}.") for n in names)]
        if paths:
            hook = LayerGroups(paths, groups("each", len(paths)), policy, "first", "each")
            hooks.update({p: hook for p in paths})
    return hooks


def _annotation_hooks(trace: context.Trace, gathered: tuple[tuple[str, Any], ...] = ()) -> dict[str, Any]:
    hooks: dict[str, Any] = {}
    for path, module in trace.modules.items():
        annotation = _ANNOTATIONS.get(module)
        if annotation is None:
            continue
        if _is_container(module):
            names = [name for name, child in module.named_children() if child is not None]
            paths = [f"{path}.{name}" if path else name for name in names]
            chain = "whole" if isinstance(module, nn.Sequential) else "first"
        else:
            paths, chain = [path], "whole"
        resolved = _resolve(annotation.policy).with_gathered(gathered)
        alike = None if _is_container(module) else annotation  # layers annotated one by one with one policy
        hook = LayerGroups(paths, groups(annotation.strategy, len(paths)), resolved, chain, annotation.strategy, alike)
        hooks.update({p: hook for p in paths})
    return hooks


def _twin(module: nn.Module, where: str) -> TorchModule | None:
    """``module``'s converted twin when a converted forward or a step is running; None in plain PyTorch."""
    twin = context.twin_for(module)
    if twin is None and context.current() is not None:
        raise ModelLookupError(
            f"{where}: the {_describe(module)} is not part of the model this step runs; checkpoint a "
            "submodule of the model (e.g. self.fc1 in its forward)."
        )
    return twin


def _resolve(policy: Policy | None) -> Resolved:
    config = state.get_config() if state.is_initialized() else None
    if policy is None:
        policy = parse_policy(config.activation_checkpointing_policy if config else "full", "config")
    offload = bool(config and config.offload_activations)
    if offload and config.activation_loading_horizon != Config.activation_loading_horizon:
        warnings.warn(
            "activation_loading_horizon has no effect: XLA schedules the copies of offloaded activations back "
            "to the device itself, overlapping them with the backward pass.",
            stacklevel=3,
        )
    return resolve(policy, offload)


def _check_flags(where: str, preserve_rng_state: Any, pack_args_as_tuple: Any) -> None:
    for name, value in (("preserve_rng_state", preserve_rng_state), ("pack_args_as_tuple", pack_args_as_tuple)):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {name} must be True or False, not {value!r}")


def _is_container(module: nn.Module) -> bool:
    return isinstance(module, (nn.Sequential, nn.ModuleList))


def _describe(module: nn.Module, root: nn.Module | None = None) -> str:
    """'module 'a.b' (Type(...))': its path in ``root`` (else in the traced model) and its summary."""
    path = context.path_of(module) if root is None else next((p for p, m in root.named_modules() if m is module), None)
    summary = repr(module).splitlines()[0].rstrip("(")
    return f"module '{path or '<root>'}' ({summary})" if path is not None else f"module {summary}"
