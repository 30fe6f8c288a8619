"""One ``jax.checkpoint`` around a run of converted modules: ``(state, inputs) -> (outputs, new state)``.

The modules' NNX state enters as inputs and is merged into copies (Variables cannot cross trace levels), so
buffer updates and random-stream counts come out as outputs and the recomputation replays the same keys.
Parameters are read-only inside.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import torch
import torch.utils._pytree as torch_pytree
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jmp.errors import ActivationCheckpointingError, ConfigError
from jmp.remat import context
from jmp.remat.policies import GATHERED, Resolved, without_weights
from jmp.runtime import marks as module_marks
from jmp.runtime import notices
from jmp.runtime.policy_syntax import INPUT
from jmp.sharding.gathering import gathered_for_use
from jmp.torch_bridge import concrete_run, dispatch, replica_calls, side_outputs
from jmp.torch_bridge.module import (
    CallHook,
    TorchModule,
    binding_versions,
    call_hooks,
    hooked_call,
    refresh_bindings,
    walk,
)
from jmp.torch_bridge.state_dict import torch_name
from jmp.torch_bridge.tensor import JaxTensor

_TENSOR = object()  # stands for an output tensor among a region's output leaves (a leaf may itself be None)


def _spans_stages(paths: Sequence[str]) -> bool:
    """Whether modules at ``paths`` span pipeline stages (then run without a checkpoint); warns once."""
    inside = module_marks.stages_of(paths)
    if len(inside) < 2:
        return False
    where = ", ".join(f"'{p or '<root>'}'" for p in paths)
    notices.warn_once(
        f"remat-spans-stages:{where}",
        "activation checkpointing of %s is skipped: its modules are on pipeline stages %s, and a checkpoint "
        "cannot span stages; checkpoint modules inside one stage instead",
        where,
        sorted(inside),
    )
    return True


def run(
    units: Sequence[TorchModule],
    inside: Sequence[CallHook | None],
    args: tuple,
    kwargs: dict,
    policy: Resolved,
    chain: str = "whole",
) -> list[Any]:
    """Run ``units`` in order as one checkpoint; returns each unit's output (JaxTensors).

    Each later unit takes the previous output (``chain``: "whole", or its "first" element) and the same other
    arguments. ``inside[k]``: the hook ``units[k]`` is called from, or None (all hooks on its path apply).
    """
    if concrete_run.active() or _spans_stages([u.torch_path for u in units]):  # op by op: nothing to trace apart
        return _run_plain(units, inside, args, kwargs, chain)
    rngs = dispatch.current_rngs()
    graph = (tuple(units), rngs)
    graphdef, params, rest = nnx.split(graph, nnx.Param, ...)
    flat, spec = torch_pytree.tree_flatten((args, kwargs))
    dynamic = [i for i, leaf in enumerate(flat) if isinstance(leaf, JaxTensor)]
    inputs = [flat[i] for i in dynamic]
    versions = binding_versions(units)
    traced: dict[str, Any] = {}

    outer_params = jax.tree.leaves(params)

    def region(params: nnx.State, rest: nnx.State, arrays: list[jax.Array]):
        if policy.gathered:
            params = _gathered(params, [u.torch_path for u in units], dict(policy.gathered))
        rebound = replica_calls.rebound(outer_params, jax.tree.leaves(params))
        copies, inner_rngs = nnx.merge(graphdef, params, rest, copy=True)
        if policy.names:
            _check_names(copies, policy.names)
        if policy.tag_inputs:
            arrays = [checkpoint_name(a, INPUT) for a in arrays]
        wrapped = [JaxTensor(a, t.dtype) for a, t in zip(arrays, inputs)]
        leaves = list(flat)
        for i, tensor in zip(dynamic, wrapped):
            leaves[i] = tensor
        call_args, call_kwargs = torch_pytree.tree_unflatten(leaves, spec)
        outputs = []
        with context.copies(copies), dispatch.session(inner_rngs), side_outputs.collecting() as sown, rebound:
            for k, copy in enumerate(copies):
                with call_hooks(_naming_hooks(copy, policy.names)):
                    out = hooked_call(copy, inside[k])(*call_args, **call_kwargs)
                outputs.append(out)
                if k + 1 < len(copies):
                    call_args = (next_input(out, chain, copy.torch_path),) + tuple(call_args[1:])
        out_flat, traced["spec"] = torch_pytree.tree_flatten(outputs)
        traced["leaves"] = [_TENSOR if isinstance(v, JaxTensor) else v for v in out_flat]
        traced["dtypes"] = [v.dtype for v in out_flat if isinstance(v, JaxTensor)]
        traced["mutated"] = [i for i, t in enumerate(wrapped) if t.write_count > 0]
        mutated = [wrapped[i].value for i in traced["mutated"]]
        new_rest = nnx.split((copies, inner_rngs), nnx.Param, ...)[2]
        values = [v.value for v in out_flat if isinstance(v, JaxTensor)]
        return values, mutated, new_rest, dict(sown)  # side outputs leave the checkpoint as outputs

    jax_policy = policy.jax_policy
    if policy.gathered:
        gathered = dict(policy.gathered)
        shapes = {
            tuple(value.shape)
            for path, value in jax.tree_util.tree_leaves_with_path(params)
            if _unit_name(path, [u.torch_path for u in units]) in gathered
        }
        jax_policy = without_weights(jax_policy, frozenset(shapes))
    checkpointed = jax.checkpoint(region, policy=jax_policy)
    values = [t.value for t in inputs]
    if policy.gathered:
        params, values = _reduced_before_earlier_layers(params, values)
    out_arrays, mutated, new_rest, sown = checkpointed(params, rest, values)
    side_outputs.sow_all(sown)
    # a random key leaves the region unchanged: keeping the one that went in means the region's output key
    # is not read later (in a pipeline, a key cannot travel between stages; the stream's count does)
    new_rest = jax.tree.map(lambda new, old: old if is_key(old) else new, new_rest, rest)
    nnx.update(graph, new_rest)
    refresh_bindings(units, versions)
    for i, value in zip(traced["mutated"], mutated):
        inputs[i].set_value(value)  # an in-place change of an input shows outside, as in torch
    arrays = iter(zip(out_arrays, traced["dtypes"]))
    leaves = [JaxTensor(*next(arrays)) if leaf is _TENSOR else leaf for leaf in traced["leaves"]]
    return torch_pytree.tree_unflatten(leaves, traced["spec"])


def _gathered(params: nnx.State, paths: list[str], specs: dict[str, Any]) -> nnx.State:
    """The units' fsdp-split parameters gathered to their used sharding (``specs``: name -> (used, stored)) and tagged
    ``GATHERED``, so a policy can leave them out of what the backward keeps (FSDP's reshard after forward)."""

    def gather(path: tuple, value: Any) -> Any:
        name = _unit_name(path, paths)
        if name not in specs:
            return value
        used, stored = specs[name]
        return checkpoint_name(gathered_for_use(value, used, stored), GATHERED)

    return jax.tree_util.tree_map_with_path(gather, params)


@jax.custom_vjp
def _reduced_before_earlier_layers(params: Any, values: Any) -> tuple[Any, Any]:
    """The identity, whose backward makes the inputs' cotangent wait for the weights' gradients.

    So each layer's gradient reduction runs before earlier layers' backward, and XLA cannot merge all the
    reductions at the end (keeping every whole gradient alive).
    """
    return params, values


def _tie_forward(params: Any, values: Any) -> tuple[tuple[Any, Any], None]:
    return (params, values), None


def _tie_backward(_: None, cotangents: tuple[Any, Any]) -> tuple[Any, Any]:
    return jax.lax.optimization_barrier(cotangents)


_reduced_before_earlier_layers.defvjp(_tie_forward, _tie_backward)


def _unit_name(path: tuple, paths: list[str]) -> str:
    """The torch name of a leaf of the (units, random stream) state (its path: 0, the unit's index, ...)."""
    keys = [k for k in path if isinstance(k, jax.tree_util.DictKey)]
    return ".".join(filter(None, [paths[keys[1].key], torch_name(tuple(keys[2:]))]))


def is_key(value: Any) -> bool:
    return isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)


def _run_plain(units, inside, args: tuple, kwargs: dict, chain: str) -> list[Any]:
    """The units called one after another, without a checkpoint."""
    outputs = []
    for k, unit in enumerate(units):
        out = hooked_call(unit, inside[k])(*args, **kwargs)
        outputs.append(out)
        if k + 1 < len(units):
            args = (next_input(out, chain, unit.torch_path),) + tuple(args[1:])
    return outputs


def next_input(out: Any, chain: str, path: str) -> Any:
    """What the layer after the one at ``path`` takes as its first argument, given that layer's output."""
    if chain == "whole" or isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise ActivationCheckpointingError(
        f"checkpointing layers in groups needs each layer to return a tensor or a tuple starting with one "
        f"(the next layer's input); '{path}' returned {type(out).__name__}. Use strategy='each'."
    )


def _naming_hooks(unit: TorchModule, names: frozenset[str]) -> dict[str, CallHook]:
    """Hooks naming the outputs of ``unit``'s submodules listed in ``names`` (by path relative to ``unit``)."""
    prefix = unit.torch_path + "." if unit.torch_path else ""
    hooks = {}
    for module in walk(unit):
        relative = module.torch_path.removeprefix(prefix)
        if module is not unit and relative in names:
            hooks[module.torch_path] = _naming_hook(relative)
    return hooks


def _naming_hook(name: str) -> CallHook:
    def hook(module: TorchModule, call: Any, *args: Any, **kwargs: Any) -> Any:
        out = call(*args, **kwargs)
        return torch_pytree.tree_map(
            lambda v: JaxTensor(checkpoint_name(v.value, name), v.dtype) if isinstance(v, JaxTensor) else v, out
        )

    return hook


def _check_names(units: Sequence[TorchModule], names: frozenset[str]) -> None:
    valid = set()
    for unit in units:
        prefix = unit.torch_path + "." if unit.torch_path else ""
        valid.update(m.torch_path.removeprefix(prefix) for m in walk(unit) if m is not unit)
    unknown = sorted(names - valid)
    if unknown:
        where = ", ".join(f"'{u.torch_path or '<root>'}'" for u in units)
        raise ConfigError(
            f"remat policy names {unknown} are not submodules of the checkpointed module {where}. Valid names "
            f"(torch paths relative to the checkpointed module, or '{INPUT}'): {', '.join(sorted(valid))}."
        )
