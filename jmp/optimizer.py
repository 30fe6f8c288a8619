"""``DistributedOptimizer``: the user's ``torch.optim`` optimizer (or an optax transformation), run by optax.

The torch optimizer stays the source of hyper-parameters: param groups, their
learning rates and whatever LR schedulers write into ``param_groups`` are read
at every ``step()`` and fed to the compiled update as values, so a changed
learning rate needs no recompilation. The optimizer state is an optax state
laid out like the parameters on the mesh.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx

from jmp import model_registry, sharding, torch_optimizers
from jmp.errors import ArgumentTypeError, ModelLookupError, OptimizerError
from jmp.model import DistributedModel
from jmp.torch_bridge import torch_name as _name_of
from jmp.torch_bridge.interop import array_to_tensor, tensor_to_array

_FROZEN = "frozen"  # label of parameters the torch optimizer does not own


def _label(group: int) -> str:
    return f"group{group}"


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps a ``torch.optim.Optimizer`` built on the original module's parameters, or an optax transformation.

    It is a ``torch.optim.Optimizer`` to torch's LR schedulers (which read and write ``param_groups``), but
    the update runs in JAX: ``torch.optim``'s own machinery (``__init__``, hooks, ``state``) is not used.

    Args:
        optimizer: a torch optimizer over ``model.module``'s parameters (its model is found by them), or an
            optax transformation (applied to all parameters).
        static_loss_scale: the loss is multiplied by it in the step and gradients divided by it here.
        dynamic_loss_scale: not offered yet (fp16 training); must be False.
        model: (a jmp extension) the ``DistributedModel`` to update; needed for an optax transformation
            when several models are alive.

    Raises:
        ArgumentTypeError: ``optimizer`` is neither a torch optimizer nor an optax transformation.
        ModelLookupError: no model (or several) holds the optimizer's parameters.
        OptimizerError: an unsupported optimizer class or option.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | optax.GradientTransformation,
        static_loss_scale: float = 1.0,
        dynamic_loss_scale: bool = False,
        *,
        model: DistributedModel | None = None,
        **unused_smp_options: Any,
    ):
        if dynamic_loss_scale:
            raise OptimizerError(
                "dynamic_loss_scale is for fp16 training, which jmp does not offer yet; "
                "train in float32 (or use static_loss_scale)"
            )
        if static_loss_scale <= 0:
            raise OptimizerError(f"static_loss_scale must be positive, not {static_loss_scale}")
        self.loss_scale = float(static_loss_scale)
        self.torch_optimizer: torch.optim.Optimizer | None = None
        self._last_hyperparams: tuple[dict, dict] = ({}, {})
        if isinstance(optimizer, optax.GradientTransformation):
            self._optax = optimizer
        elif isinstance(optimizer, torch.optim.Optimizer):
            self.torch_optimizer = optimizer
            self.rule = torch_optimizers.rule_for(optimizer)
            self._check_torch_options(optimizer)
        else:
            raise ArgumentTypeError(
                f"DistributedOptimizer takes a torch.optim.Optimizer or an optax.GradientTransformation, "
                f"not {type(optimizer).__name__}"
            )
        self.model: DistributedModel = self._find_model(model)
        self._replicated = self.model.layout.replicated
        self._build()
        self.model.attach_optimizer(self)

    def _find_model(self, given: DistributedModel | None) -> DistributedModel:
        """The model this optimizer updates: given, else the one holding the torch optimizer's parameters."""
        if given is not None:
            if not isinstance(given, DistributedModel):
                raise ArgumentTypeError(f"model= takes a smp.DistributedModel, not {type(given).__name__}")
            return given
        if self.torch_optimizer is None:
            return model_registry.the_only(
                "smp.DistributedOptimizer(<optax transformation>)", "pass model= to say which one it updates"
            )
        held = {id(p) for g in self.torch_optimizer.param_groups for p in g["params"]}
        owners = [m for m in model_registry.live() if any(id(p) in held for p in m.module.parameters())]
        if len(owners) == 1:
            return owners[0]
        if not owners:
            raise ModelLookupError(
                f"the {type(self.torch_optimizer).__name__} optimizer's parameters belong to no "
                "smp.DistributedModel; wrap the model first, then build the optimizer on model.module.parameters()"
            )
        raise ModelLookupError(
            f"the {type(self.torch_optimizer).__name__} optimizer's parameters belong to {len(owners)} "
            "smp.DistributedModels (one torch module wrapped twice?); pass model= to say which one it updates"
        )

    def _build(self) -> None:
        """The optax transformation, its state and the compiled update, for the model's current parameter layout."""
        model = self.model
        params = model.training_state.params
        pipeline = model.pipeline
        packed = pipeline is not None and pipeline.ready
        if self.torch_optimizer is None:
            self.tx = self._optax
        else:
            groups = self.torch_optimizer.param_groups
            if packed:
                labels = {key: buffer.label for key, buffer in pipeline.layout.buffers.items()}
                self._check_buffer_labels(pipeline.layout)
            else:
                labels = model.layout.tree(self.param_labels())
            self.tx = optax.multi_transform(
                {_label(i): torch_optimizers.group_transform(self.rule, g) for i, g in enumerate(groups)}
                | {_FROZEN: optax.set_to_zero()},
                labels,
            )
        if packed:
            self._state_shardings = pipeline.layout.state_shardings(jax.eval_shape(self.tx.init, params))
        else:
            self._state_shardings = self._layout(params)
        self.opt_state = jax.jit(self.tx.init, out_shardings=self._state_shardings)(params)
        # the loss scale is a setting, not data: baked in
        self._update = jax.jit(
            self._apply,
            static_argnames=("loss_scale",),
            donate_argnums=(0, 2),
            out_shardings=(model.stored_shardings, self._state_shardings),
        )

    def parameters_moved(self) -> None:
        """Called by the model when a pipelined model moves its parameters into the stages' buffers (first step)."""
        self._build()

    def param_labels(self) -> dict[str, str]:
        """Each parameter's optimizer label (its torch param group, or frozen) by torch name."""
        names = self.model.layout.names
        if self.torch_optimizer is None:
            return {name: "all" for name in names}
        group_of = {id(p): i for i, g in enumerate(self.torch_optimizer.param_groups) for p in g["params"]}
        by_name = dict(self.model.module.named_parameters(remove_duplicate=False))
        known = {id(p) for p in by_name.values()}
        unknown = [p for g in self.torch_optimizer.param_groups for p in g["params"] if id(p) not in known]
        if unknown:
            raise OptimizerError(
                f"the torch optimizer holds {len(unknown)} tensor(s) that are not parameters of the "
                "DistributedModel's module; build the optimizer on model.module.parameters()"
            )
        groups = {name: group_of.get(id(by_name[name])) for name in names}
        return {name: _FROZEN if group is None else _label(group) for name, group in groups.items()}

    def _check_buffer_labels(self, layout: Any) -> None:
        by_name = self.param_labels()
        wrong = [n for n, places in layout.places.items() if layout.buffers[places[0].key].label != by_name[n]]
        if wrong:
            raise OptimizerError(
                "the model's pipeline stages were laid out before this optimizer's param groups were known "
                f"({', '.join(wrong[:4])} are in another group); create the smp.DistributedOptimizer before the "
                "first step call"
            )

    def _layout(self, params: nnx.State) -> Any:
        """Shardings of the optimizer state: like the parameters, or split over ``dp`` too (shard_optimizer_state)."""
        layout = self.model.layout
        specs = sharding.optimizer_specs(layout.specs, layout.shapes, layout.mesh, layout.config.shard_optimizer_state)
        return sharding.state_shardings(jax.eval_shape(self.tx.init, params), specs, layout.shapes, layout.mesh)

    # --- torch mapping ---------------------------------------------------------------------------------------

    def _check_torch_options(self, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            if group.get("decoupled_weight_decay"):
                self.rule = torch_optimizers.RULES[torch.optim.AdamW]
            for option in ("fused", "capturable", "differentiable"):
                if group.get(option):
                    raise OptimizerError(f"{type(optimizer).__name__}({option}=True) is a CUDA option; remove it")

    def _hyperparams(self) -> dict:
        """Each group's numeric hyper-parameters as read from torch's param_groups right now."""
        if self.torch_optimizer is None:
            return {}
        values = {i: self.rule.hyperparams(g)[0] for i, g in enumerate(self.torch_optimizer.param_groups)}
        if values != self._last_hyperparams[0]:  # new values (a scheduler stepped): new device scalars
            arrays = jax.device_put(  # placed where the update runs, so no call re-copies them
                {i: {k: np.float32(v) for k, v in group.items()} for i, group in values.items()}, self._replicated
            )
            self._last_hyperparams = (values, arrays)
        return self._last_hyperparams[1]

    # --- the update --------------------------------------------------------------------------------------------

    def _apply(self, params, grads, opt_state, hyperparams, loss_scale):
        if loss_scale != 1.0:
            grads = jax.tree.map(lambda g: g / loss_scale, grads)
        opt_state = _set_hyperparams(opt_state, hyperparams)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def step(self, closure: Any = None) -> None:
        """Apply the gradients accumulated since ``zero_grad()`` (none: no update, as in torch)."""
        if closure is not None:
            raise OptimizerError("optimizer.step(closure) is not supported: run the step function, then call step()")
        training = self.model.training_state
        if training.grads is None:
            return  # as in torch: no gradients, no update
        training.params, self.opt_state = self._update(
            training.params, training.grads, self.opt_state, self._hyperparams(), loss_scale=self.loss_scale
        )
        if self.torch_optimizer is not None:
            self.torch_optimizer._opt_called = True  # what torch's LR schedulers check before stepping

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.training_state.grads = None

    def clip_master_grads(self, max_norm: float) -> jax.Array:
        """Scale the current gradients so their global norm is at most ``max_norm``; returns the norm before.

        Like ``torch.nn.utils.clip_grad_norm_`` over all parameters (the norm is global across devices).
        """
        training = self.model.training_state
        if training.grads is None:
            return jnp.zeros((), jnp.float32)
        norm, training.grads = _clip_by_global_norm(training.grads, max_norm, self.loss_scale)
        return norm

    @property
    def param_groups(self) -> list[dict]:
        return self.torch_optimizer.param_groups if self.torch_optimizer is not None else []

    @property
    def defaults(self) -> dict:
        return self.torch_optimizer.defaults if self.torch_optimizer is not None else {}

    @property
    def state(self) -> dict:
        """Per-parameter state in torch's format (as ``state_dict()["state"]``, keyed by index)."""
        return self.state_dict().get("state", {})

    def __repr__(self) -> str:
        inner = type(self.torch_optimizer).__name__ if self.torch_optimizer is not None else "optax"
        return f"DistributedOptimizer({inner}, {len(self.param_groups)} param group(s))"

    # --- state ---------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """torch's format for a torch optimizer ({"state": {index: {...}}, "param_groups": [...]})."""
        if self.torch_optimizer is None:
            return {"optax_state": jax.tree.map(np.asarray, self.opt_state)}
        saved = self.torch_optimizer.state_dict()
        index = self._param_index()
        per_param: dict[int, dict[str, torch.Tensor]] = {}
        for group, inject_state in _group_states(self.opt_state):
            for state_type, fields in self.rule.state_fields.items():
                for found in _find_states(inject_state.inner_state, state_type):
                    for field, torch_name in fields.items():
                        if torch_name != "step":
                            _collect_field(self._by_name(getattr(found, field)), torch_name, index, per_param)
            if self.rule.factory is not torch_optimizers.sgd:  # torch's SGD keeps no step count
                step = torch.tensor(float(inject_state.count), dtype=torch.float32)
                for i in self._group_indices(group):
                    per_param.setdefault(i, {})["step"] = step.clone()
        saved["state"] = per_param
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        if self.torch_optimizer is None:
            self.opt_state = jax.tree.map(
                lambda old, new: jax.device_put(jnp.asarray(new, old.dtype), old.sharding),
                self.opt_state,
                state_dict["optax_state"],
            )
            return
        self.torch_optimizer.load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        index = self._param_index()
        tensors = state_dict["state"]
        replaced = {}
        for group, inject_state in _group_states(self.opt_state):
            inner = inject_state.inner_state
            for state_type, fields in self.rule.state_fields.items():
                inner = _replace_states(inner, state_type, fields, index, tensors, self._load_field)
            steps = [float(tensors[i]["step"]) for i in self._group_indices(group) if "step" in tensors.get(i, {})]
            count = jnp.asarray(int(steps[0]) if steps else 0, jnp.int32)
            inner = _set_counts(inner, count)
            replaced[group] = inject_state._replace(inner_state=inner, count=jnp.array(count))
        self.opt_state = _with_group_states(self.opt_state, replaced)

    def _by_name(self, field: Any) -> Any:
        """A params-shaped state field keyed by torch name (a pipelined model's stage buffers unpacked)."""
        pipeline = self.model.pipeline
        if pipeline is None or not pipeline.ready or not isinstance(field, dict):
            return field
        return nnx.State(pipeline.layout.unpack_present(field))

    def _load_field(self, field: Any, torch_name: str, index: dict, tensors: dict) -> Any:
        """``_loaded_field`` through the stage buffers of a pipelined model (unpacked, loaded, packed again)."""
        pipeline = self.model.pipeline
        if pipeline is None or not pipeline.ready or not isinstance(field, dict):
            return _loaded_field(field, torch_name, index, tensors)
        named = _loaded_field(nnx.State(pipeline.layout.unpack_present(field)), torch_name, index, tensors)
        return pipeline.layout.pack_present(dict(named.items()), like=field)

    def _positions(self) -> dict[int, int]:
        """id(torch parameter) -> its index in torch's optimizer state_dict (param_groups order)."""
        order = (p for g in self.torch_optimizer.param_groups for p in g["params"])
        return {id(p): i for i, p in enumerate(order)}

    def _param_index(self) -> dict[str, int]:
        """torch parameter name (tied names too) -> its index in torch's optimizer state_dict."""
        positions = self._positions()
        named = self.model.module.named_parameters(remove_duplicate=False)
        return {name: positions[id(p)] for name, p in named if id(p) in positions}

    def _group_indices(self, group: int) -> list[int]:
        positions = self._positions()
        return [positions[id(p)] for p in self.torch_optimizer.param_groups[group]["params"]]


@functools.partial(jax.jit, static_argnames=("loss_scale",))
def _clip_by_global_norm(grads: Any, max_norm: float, loss_scale: float) -> tuple[jax.Array, Any]:
    """(norm, clipped grads), torch's ``clip_grad_norm_`` rule; gradients are kept multiplied by the loss scale."""
    norm = optax.global_norm(grads) / loss_scale
    factor = jnp.minimum(1.0, max_norm / (norm + 1e-6))
    return norm, jax.tree.map(lambda g: g * factor, grads)


def _set_hyperparams(opt_state: Any, hyperparams: dict) -> Any:
    if not hyperparams:
        return opt_state
    return _with_group_states(
        opt_state,
        {
            group: inject._replace(hyperparams={**inject.hyperparams, **hyperparams[group]})
            for group, inject in _group_states(opt_state)
        },
    )


def _group_states(opt_state: Any):
    """(group index, InjectStatefulHyperparamsState) of each torch param group in a multi_transform state."""
    for label, masked in opt_state.inner_states.items():
        if label != _FROZEN:
            yield int(label.removeprefix("group")), masked.inner_state


def _with_group_states(opt_state: Any, replaced: dict) -> Any:
    inner = dict(opt_state.inner_states)
    for group, inject in replaced.items():
        inner[_label(group)] = inner[_label(group)]._replace(inner_state=inject)
    return opt_state._replace(inner_states=inner)


def _find_states(tree: Any, state_type: type) -> list:
    if isinstance(tree, state_type):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [found for item in tree for found in _find_states(item, state_type)]
    return []


def _replace_states(tree: Any, state_type: type, fields: dict, index: dict, tensors: dict, load: Any) -> Any:
    if isinstance(tree, state_type):
        updates = {}
        for field, torch_name in fields.items():
            updates[field] = load(getattr(tree, field), torch_name, index, tensors)
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


def _collect_field(field: Any, torch_name: str, index: dict, per_param: dict) -> None:
    if not hasattr(field, "items") and not isinstance(field, nnx.State):
        return  # a scalar field such as count: handled as "step"
    for name, leaf in _per_param_leaves(field):
        if name in index and isinstance(leaf, jax.Array):
            per_param.setdefault(index[name], {})[torch_name] = array_to_tensor(leaf)


def _loaded_field(field: Any, torch_name: str, index: dict, tensors: dict) -> Any:
    if not isinstance(field, nnx.State):
        return field

    def load(path, leaf):
        entry = tensors.get(index.get(_name_of(path)), {})
        if torch_name not in entry or not isinstance(leaf, jax.Array):
            return leaf
        return jax.device_put(tensor_to_array(entry[torch_name]).astype(leaf.dtype), leaf.sharding)

    return jax.tree_util.tree_map_with_path(load, field)


def _set_counts(tree: Any, count: jax.Array) -> Any:
    """Give every step counter inside a group's state the loaded step (Adam's bias correction uses it)."""
    if hasattr(tree, "_fields") and "count" in tree._fields:
        return tree._replace(count=jnp.array(count, tree.count.dtype))  # own buffer: the state is donated
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(_set_counts(item, count) for item in tree)
    return tree
