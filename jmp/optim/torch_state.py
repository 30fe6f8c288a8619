"""torch's optimizer ``state_dict`` format <-> ``DistributedOptimizer``'s optax state.

The state is an ``optax.multi_transform`` (built here, ``optimizer_transform``) with one ``group<i>`` entry per
param group and one ``frozen``; torch keys state by parameter index in ``param_groups`` order, and a ``Rule``'s
``state_fields`` name each field's torch entry. Parameter-shaped fields go through ``model.store``, so packed
pipeline buffers need no branch. Also SMP's fp16 optimizer entries (loss scaler, float32 masters).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx

from jmp.errors import OptimizerError
from jmp.optim import torch_rules
from jmp.precision import loss_scaling
from jmp.precision import policy as precision
from jmp.torch_bridge import torch_name as _name_of
from jmp.torch_bridge.interop import array_to_tensor, host_array, tensor_to_array

FROZEN = "frozen"  # label of parameters the torch optimizer does not own


def group_label(group: int) -> str:
    """The ``multi_transform`` label of torch param group ``group``."""
    return f"group{group}"


def optimizer_transform(
    rule: torch_rules.Rule,
    groups: list[dict],
    labels: Any,
    fused: Callable[[Callable, dict], Callable | None] | None = None,
) -> optax.GradientTransformation:
    """The whole torch optimizer: each param group's transformation (``group_transform``, ``fused`` passed on) on
    the parameters ``labels`` (a tree like them) gives its ``group_label``, zero updates on the ``FROZEN`` ones."""
    transforms = {group_label(i): torch_rules.group_transform(rule, g, fused) for i, g in enumerate(groups)}
    return optax.multi_transform(transforms | {FROZEN: optax.set_to_zero()}, labels)


def group_states(opt_state: Any) -> Iterator[tuple[int, Any]]:
    """(group index, InjectStatefulHyperparamsState) of each torch param group in a multi_transform state."""
    for label, masked in opt_state.inner_states.items():
        if label != FROZEN:
            yield int(label.removeprefix("group")), masked.inner_state


def with_group_states(opt_state: Any, replaced: dict) -> Any:
    """``opt_state`` with the inject_hyperparams states of the groups in ``replaced`` (by index) swapped in."""
    inner = dict(opt_state.inner_states)
    for group, inject in replaced.items():
        inner[group_label(group)] = inner[group_label(group)]._replace(inner_state=inject)
    return opt_state._replace(inner_states=inner)


def with_hyperparams(opt_state: Any, hyperparams: dict) -> Any:
    """``opt_state`` with each group's injected hyper-parameters set to ``hyperparams[group]`` (torch's values)."""
    if not hyperparams:
        return opt_state
    return with_group_states(
        opt_state,
        {
            group: inject._replace(hyperparams={**inject.hyperparams, **hyperparams[group]})
            for group, inject in group_states(opt_state)
        },
    )


def param_labels(torch_optimizer: torch.optim.Optimizer, model: Any) -> dict[str, str]:
    """Each of ``model``'s parameters' ``multi_transform`` label (its torch param group, or frozen) by torch name."""
    group_of = {id(p): i for i, g in enumerate(torch_optimizer.param_groups) for p in g["params"]}
    by_name = dict(model.torch_module.named_parameters(remove_duplicate=False))
    known = {id(p) for p in by_name.values()}
    unknown = [p for g in torch_optimizer.param_groups for p in g["params"] if id(p) not in known]
    if unknown:
        raise OptimizerError(
            f"the torch optimizer holds {len(unknown)} tensor(s) that are not parameters of the "
            "DistributedModel's module; build the optimizer on model.module.parameters()"
        )
    groups = {name: group_of.get(id(by_name[name])) for name in model.layout.names}
    return {name: FROZEN if group is None else group_label(group) for name, group in groups.items()}


# --- torch's per-parameter state ------------------------------------------------------------------------------


class TorchStateAdapter:
    """Converts a ``DistributedOptimizer``'s optax state to torch's ``state_dict`` format and back.

    ``torch_optimizer`` None: an optax transformation's state, kept as is under ``"optax_state"``. Assumes the
    state was built by ``rule`` over ``model.store``'s layout.
    """

    def __init__(self, torch_optimizer: torch.optim.Optimizer | None, rule: torch_rules.Rule | None, model: Any):
        self.torch_optimizer = torch_optimizer
        self.rule = rule
        self.model = model

    def to_torch(self, opt_state: Any, piece: Callable[[jax.Array], jax.Array], scaler: dict) -> dict:
        """torch's ``{"state": {index: {...}}, "param_groups": [...]}`` of ``piece(array)`` of each array, with the
        loss ``scaler``'s entries and (a half-precision module) the float32 masters, as SMP's fp16 optimizer."""
        if self.torch_optimizer is None:
            return {"optax_state": jax.tree.map(lambda array: host_array(piece(array)), opt_state)} | scaler
        to_tensor = lambda array: array_to_tensor(piece(array))  # noqa: E731
        # torch's own methods on the wrapped object: a loop's plain optimizer routes its state_dict to the
        # DistributedOptimizer (jmp.eager.plain_optimizers), which would lead back here
        saved = torch.optim.Optimizer.state_dict(self.torch_optimizer) | scaler
        saved["state"] = self._per_param(opt_state, to_tensor)
        if self.module_is_half():
            saved["fp32_from_fp16"] = self.masters(to_tensor)
        return saved

    def from_torch(self, opt_state: Any, state_dict: dict) -> Any:
        """``opt_state`` holding ``state_dict``'s (``param_groups`` to the torch optimizer, masters to the model)."""
        if self.torch_optimizer is None:
            return jax.tree.map(
                lambda old, new: jax.device_put(jnp.asarray(new, old.dtype), old.sharding),
                opt_state,
                state_dict["optax_state"],
            )
        if state_dict.get("fp32_from_fp16") is not None:
            self.load_masters(state_dict["fp32_from_fp16"])
        torch.optim.Optimizer.load_state_dict(
            self.torch_optimizer, {"state": {}, "param_groups": state_dict["param_groups"]}
        )
        index = self.param_index()
        tensors = state_dict["state"]
        replaced = {}
        for group, inject_state in group_states(opt_state):
            inner = inject_state.inner_state
            for state_type, fields in self.rule.state_fields.items():
                inner = _replace_states(inner, state_type, fields, index, tensors, self._load_field)
            steps = [float(tensors[i]["step"]) for i in self.group_indices(group) if "step" in tensors.get(i, {})]
            count = jnp.asarray(int(steps[0]) if steps else 0, jnp.int32)
            inner = _set_counts(inner, count)
            replaced[group] = inject_state._replace(inner_state=inner, count=_placed_like(count, inject_state.count))
        return with_group_states(opt_state, replaced)

    def per_param_arrays(self, opt_state: Any) -> dict:
        """torch's ``state`` with each parameter's entries the optax state's own (sharded) arrays; ``step`` a tensor."""
        return self._per_param(opt_state, lambda array: array)

    def _per_param(self, opt_state: Any, to_tensor: Callable[[jax.Array], torch.Tensor]) -> dict:
        """torch's ``state``: each parameter's state entries by its index, arrays made tensors by ``to_tensor``."""
        index = self.param_index()
        per_param: dict[int, dict[str, torch.Tensor]] = {}
        for group, inject_state in group_states(opt_state):
            for state_type, fields in self.rule.state_fields.items():
                for found in _find_states(inject_state.inner_state, state_type):
                    for field, torch_name in fields.items():
                        if torch_name != "step":
                            field_state = self.model.store.field_named(getattr(found, field))
                            _collect_field(field_state, torch_name, index, per_param, to_tensor)
            if self.rule.factory is not torch_rules.sgd:  # torch's SGD keeps no step count
                step = torch.tensor(float(inject_state.count), dtype=torch.float32)
                for i in self.group_indices(group):
                    per_param.setdefault(i, {})["step"] = step.clone()
        return per_param

    def module_is_half(self) -> bool:
        """Whether the user's module holds half-precision parameters (jmp keeps float32 masters for them)."""
        return any(p.dtype in precision.HALF for p in self.model.torch_module.parameters())

    def masters(self, to_tensor: Callable[[jax.Array], torch.Tensor]) -> list[list[torch.Tensor]]:
        """SMP's ``fp32_from_fp16``: the float32 master parameters, per param group."""
        params = self.model.layout.by_name(self.model.params)
        names = self.names_by_position()
        groups = range(len(self.torch_optimizer.param_groups))
        return [[to_tensor(params[names[i]]) for i in self.group_indices(g)] for g in groups]

    def load_masters(self, masters: list[list[torch.Tensor]]) -> None:
        """Load SMP's ``fp32_from_fp16`` into the model's master parameters."""
        names = self.names_by_position()
        loaded = {
            names[i]: tensor for g, tensors in enumerate(masters) for i, tensor in zip(self.group_indices(g), tensors)
        }
        self.model.load_state_dict(loaded, strict=False)

    def positions(self) -> dict[int, int]:
        """id(torch parameter) -> its index in torch's optimizer state_dict (param_groups order)."""
        order = (p for g in self.torch_optimizer.param_groups for p in g["params"])
        return {id(p): i for i, p in enumerate(order)}

    def param_index(self) -> dict[str, int]:
        """torch parameter name (tied names too) -> its index in torch's optimizer state_dict."""
        positions = self.positions()
        named = self.model.torch_module.named_parameters(remove_duplicate=False)
        return {name: positions[id(p)] for name, p in named if id(p) in positions}

    def group_indices(self, group: int) -> list[int]:
        """The state_dict indices of param group ``group``'s parameters."""
        positions = self.positions()
        return [positions[id(p)] for p in self.torch_optimizer.param_groups[group]["params"]]

    def names_by_position(self) -> dict[int, str]:
        """Index in torch's optimizer state_dict -> the parameter's torch name (the first of tied names)."""
        names: dict[int, str] = {}
        for name, position in self.param_index().items():
            names.setdefault(position, name)
        return names

    def _load_field(self, field: Any, torch_name: str, index: dict, tensors: dict) -> Any:
        """``_loaded_field`` through the parameter store (a pipeline's buffers unpacked, loaded, packed again)."""
        store = self.model.store
        if not store.is_parameter_shaped(field):
            return field
        named = _loaded_field(store.field_named(field), torch_name, index, tensors)
        return store.field_from_named(named, like=field)


def scaler_to_torch(scaling: loss_scaling.LossScaling, scale_state: Any, loss_scale: float, overflow: bool) -> dict:
    """SMP's fp16 optimizer entries (``dynamic_loss_scale``, ``loss_scaler``, ``overflow``); none if not scaling."""
    if scaling.kind is None:
        return {}
    saved: dict[str, Any] = {"dynamic_loss_scale": scaling.kind == "dynamic", "loss_scaler": {"cur_scale": loss_scale}}
    if scaling.kind == "dynamic":
        held = jax.device_get(scale_state)
        saved["loss_scaler"] |= {
            "cur_iter": int(held.iteration),
            "last_overflow_iter": int(held.last_overflow),
            "cur_hysteresis": int(held.hysteresis),
        } | dataclasses.asdict(scaling.args)
    saved["overflow"] = overflow
    return saved


def scaler_from_torch(scaling: loss_scaling.LossScaling, state_dict: dict) -> Any:
    """The loss scaler's state (host values) from SMP's ``loss_scaler`` entry; None when there is none to load."""
    scaler = state_dict.get("loss_scaler")
    if scaler is not None and scaling.kind == "dynamic":
        return loss_scaling.LossScaleState(
            np.float32(scaler["cur_scale"]),
            np.int32(scaler.get("cur_iter", 0)),
            np.int32(scaler.get("last_overflow_iter", -1)),
            np.int32(scaler.get("cur_hysteresis", scaling.args.delayed_shift)),
        )
    if scaler is not None and scaling.kind == "static":
        return np.float32(scaler["cur_scale"])
    return None


def _find_states(tree: Any, state_type: type) -> list:
    if isinstance(tree, state_type):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [found for item in tree for found in _find_states(item, state_type)]
    return []


def _replace_states(tree: Any, state_type: type, fields: dict, index: dict, tensors: dict, load: Any) -> Any:
    if isinstance(tree, state_type):
        updates = {field: load(getattr(tree, field), name, index, tensors) for field, name in fields.items()}
        if "started" in tree._fields:  # a loaded momentum buffer is a started one
            updates["started"] = jnp.ones([], jnp.bool_)
        return tree._replace(**updates)
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(_replace_states(item, state_type, fields, index, tensors, load) for item in tree)
    return tree


def _per_param_leaves(field: Any):
    """(torch name, array) for each parameter leaf of a params-shaped state field (masked-out ones skipped)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(field)[0]:
        yield _name_of(path), leaf


def _collect_field(field: Any, torch_name: str, index: dict, per_param: dict, to_tensor: Any) -> None:
    if not hasattr(field, "items") and not isinstance(field, nnx.State):
        return  # a scalar field such as count: handled as "step"
    for name, leaf in _per_param_leaves(field):
        if name in index and isinstance(leaf, jax.Array):
            per_param.setdefault(index[name], {})[torch_name] = to_tensor(leaf)


def _loaded_field(field: Any, torch_name: str, index: dict, tensors: dict) -> Any:
    if not isinstance(field, nnx.State):
        return field

    def load(path, leaf):
        entry = tensors.get(index.get(_name_of(path)), {})
        if torch_name not in entry or not isinstance(leaf, jax.Array):
            return leaf
        value = entry[torch_name]  # a tensor, or a jax.Array in any sharding (a DCP checkpoint's, read back)
        array = value if isinstance(value, jax.Array) else tensor_to_array(value)
        return jax.device_put(array.astype(leaf.dtype), leaf.sharding)

    return jax.tree_util.tree_map_with_path(load, field)


def _placed_like(value: jax.Array, like: jax.Array) -> jax.Array:
    """``value`` in a buffer of its own (the state is donated), of ``like``'s dtype and where ``like`` lives: the update
    program was compiled for the state's shardings, and a count on one device would compile another."""
    return jax.device_put(jnp.array(value, like.dtype), like.sharding)


def _set_counts(tree: Any, count: jax.Array) -> Any:
    """Give every step counter inside a group's state the loaded step (Adam's bias correction uses it)."""
    if hasattr(tree, "_fields") and "count" in tree._fields:
        return tree._replace(count=_placed_like(count, tree.count))
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(_set_counts(item, count) for item in tree)
    return tree
