"""``DistributedOptimizer``: the user's ``torch.optim`` optimizer (or an optax transformation), run by optax.

The torch optimizer stays the source of hyper-parameters: param groups, their
learning rates and whatever LR schedulers write into ``param_groups`` are read
at every ``step()`` and fed to the compiled update as values, so a changed
learning rate needs no recompilation. The optimizer state is an optax state
laid out like the parameters on the mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx
from jax.sharding import PartitionSpec

from jmp import kernels, sharding
from jmp.errors import ArgumentTypeError, ModelLookupError, OptimizerError
from jmp.model import live_models as model_registry
from jmp.model import portable_state
from jmp.model.distributed_model import PARTIAL_MARK, DistributedModel, with_shardings
from jmp.optim import torch_rules as torch_optimizers
from jmp.precision import loss_scaling
from jmp.precision import policy as precision
from jmp.torch_bridge import torch_name as _name_of
from jmp.torch_bridge.interop import array_to_tensor, host_array, local_piece, tensor_to_array

logger = logging.getLogger(__name__)

_FROZEN = "frozen"  # label of parameters the torch optimizer does not own
_DYNAMIC_KEYS = tuple(field.name for field in dataclasses.fields(loss_scaling.DynamicLossScaleArgs))


def _label(group: int) -> str:
    return f"group{group}"


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps a ``torch.optim.Optimizer`` built on the original module's parameters, or an optax transformation.

    It is a ``torch.optim.Optimizer`` to torch's LR schedulers (which read and write ``param_groups``), but
    the update runs in JAX: ``torch.optim``'s own machinery (``__init__``, hooks, ``state``) is not used.

    Args:
        optimizer: a torch optimizer over ``model.module``'s parameters (its model is found by them), or an
            optax transformation (applied to all parameters).
        static_loss_scale: the loss is multiplied by it in the step and gradients divided by it here
            (None: 1.0).
        dynamic_loss_scale: fp16 training: scale the loss by a factor that halves on every overflow (the
            update is then skipped) and grows after ``scale_window`` clean steps; SMP's (Megatron's) rule.
        dynamic_loss_args: the dynamic scaler's settings (``init_scale``, ``scale_factor``, ``scale_window``,
            ``min_scale``, ``delayed_shift``, ``consecutive_hysteresis``); also accepted as keywords.
        model: (a jmp extension) the ``DistributedModel`` to update; needed for an optax transformation
            when several models are alive.

    In mixed precision (``bf16`` / ``fp16``, or a half-precision module) the optimizer updates the model's
    float32 master parameters from the half-precision gradients, unscaled into float32 inside its update.

    Raises:
        ArgumentTypeError: ``optimizer`` is neither a torch optimizer nor an optax transformation.
        ModelLookupError: no model (or several) holds the optimizer's parameters.
        OptimizerError: an unsupported optimizer class or option.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | optax.GradientTransformation,
        static_loss_scale: float | None = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: dict | None = None,
        *,
        model: DistributedModel | None = None,
        **smp_options: Any,
    ):
        loose_args = {k: smp_options.pop(k) for k in list(smp_options) if k in _DYNAMIC_KEYS}
        static = 1.0 if static_loss_scale is None else static_loss_scale
        if isinstance(static, bool) or not isinstance(static, (int, float)) or not static > 0:
            raise OptimizerError(f"static_loss_scale must be a positive number (or None), not {static_loss_scale!r}")
        if dynamic_loss_args is not None and not isinstance(dynamic_loss_args, dict):
            raise OptimizerError(f"dynamic_loss_args must be a dict, not {type(dynamic_loss_args).__name__}")
        self.torch_optimizer: torch.optim.Optimizer | None = None
        self._clip_before = 0.0  # a global gradient-norm clip the torch optimizer's rule applies first (apex LAMB)
        self._kernels_failed = False  # the compiled kernels failed to build on this device: the optax update runs
        self._kernels_ran = False
        self._last_hyperparams: tuple[dict, dict] = ({}, {})
        if isinstance(optimizer, optax.GradientTransformation):
            self._optax = optimizer
        elif isinstance(optimizer, torch.optim.Optimizer):
            self.torch_optimizer = optimizer
            self.rule = torch_optimizers.rule_for(optimizer)
            self._check_torch_options(optimizer)
            if self.rule.clip_before is not None:
                self._clip_before = float(optimizer.defaults[self.rule.clip_before])
        else:
            raise ArgumentTypeError(
                f"DistributedOptimizer takes a torch.optim.Optimizer or an optax.GradientTransformation, "
                f"not {type(optimizer).__name__}"
            )
        self.model: DistributedModel = self._find_model(model)
        self._replicated = self.model.layout.replicated
        self.scaling = _scaling_for(self.model.precision, static, dynamic_loss_scale, dynamic_loss_args, loose_args)
        self.scale_state = None if self.scaling.kind is None else self._place(self.scaling.initial)
        self._found_inf: jax.Array | None = None
        self.grads_unscaled = False  # set by GradScaler.unscale_: the kept gradients are float32, unscaled
        self._no_inf = self._place(np.bool_(False))
        self._one = self._place(np.float32(1.0))
        self._build()
        self.model.attach_optimizer(self)

    # --- loss scaling ------------------------------------------------------------------------------------

    scales_in_step = True  # the step multiplies the loss by current_scale itself (SMP's DistributedOptimizer)

    @property
    def current_scale(self) -> jax.Array | None:
        """The loss scale as a device scalar, None when this optimizer does not scale the loss."""
        if self.scaling.kind == "dynamic":
            return self.scale_state.scale
        return self.scale_state

    @property
    def loss_scale(self) -> float:
        """The loss scale as a number (1.0 without scaling); reading it waits for the last update."""
        scale = self.current_scale
        return 1.0 if scale is None else float(scale)

    @property
    def overflow(self) -> bool:
        """Whether the last ``step()`` found an inf/nan gradient and skipped its update (fp16 loss scaling)."""
        return False if self._found_inf is None else bool(self._found_inf)

    def _place(self, tree: Any) -> Any:
        return jax.device_put(tree, self._replicated)

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
        owners = [m for m in model_registry.live() if any(id(p) in held for p in m.torch_module.parameters())]
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
        self.fused = None
        if self.torch_optimizer is None:
            self.tx = self._optax
        else:
            groups = self.torch_optimizer.param_groups
            labels = model.store.labels(self.param_labels())
            self.fused = self._fused_mode(groups)
            fused = (
                None
                if self.fused is None
                else functools.partial(kernels.fused_version, interpret=self.fused == "interpret")
            )
            self.tx = optax.multi_transform(
                {_label(i): torch_optimizers.group_transform(self.rule, g, fused) for i, g in enumerate(groups)}
                | {_FROZEN: optax.set_to_zero()},
                labels,
            )
            self._frozen = jax.tree.map(lambda label: label == _FROZEN, labels)
        if model.pipeline is not None and self.torch_optimizer is not None and self.rule.per_tensor:
            raise OptimizerError(
                f"{type(self.torch_optimizer).__name__} takes a norm per parameter tensor, and a pipelined model's "
                "optimizer updates each stage's parameters packed into a few buffers; use it without "
                "pipeline_parallel_degree, or use Adam / AdamW (smp.optimizers.FusedAdam)"
            )
        self._state_shardings = self._like_state(jax.eval_shape(self.tx.init, params))
        if model.abstract:  # shapes and shardings only (jmp.model.memory_estimate)
            self.opt_state = with_shardings(jax.eval_shape(self.tx.init, params), self._state_shardings)
        else:
            self.opt_state = jax.jit(self.tx.init, out_shardings=self._state_shardings)(params)
        # a new function per build: jit caches traces by function, and this build's bound method equals the last
        # build's, whose trace may hold another transformation
        self._update = jax.jit(
            functools.partial(self._apply),
            static_argnames=("checked", "dynamic", "clip"),
            donate_argnums=(0, 2),
            out_shardings=(model.store.shardings, self._state_shardings, self._replicated, self._replicated),
        )

    @property
    def state_shardings(self) -> Any:
        """Where each leaf of ``opt_state`` lives (ZeRO-1: split over ``dp`` as well)."""
        return self._state_shardings

    def _fused_mode(self, groups: list[dict]) -> str | None:
        """How the update runs: "compiled" Pallas kernels, "interpret"ed ones, or None (the optax chain).

        The config's ``fused_optimizer``: None (the default) takes the kernels on a GPU and the optax chain
        elsewhere; True takes them everywhere (interpreted off a GPU: the GPU's numbers, slowly); False never.
        """
        asked = self.model.layout.config.fused_optimizer
        on_gpu = jax.default_backend() == "gpu"
        if asked is False or (asked is None and not on_gpu) or self._kernels_failed:
            return None
        say = logger.warning if asked else logger.info
        unfused = [
            i
            for i, group in enumerate(groups)
            if kernels.fused_version(self.rule.factory, self.rule.hyperparams(group)[1], interpret=False) is None
        ]
        if unfused:
            say(
                "fused_optimizer: %s with param group %d's options has no fused kernel (jmp.kernels); the optax "
                "update runs",
                type(self.torch_optimizer).__name__,
                unfused[0],
            )
            return None
        if on_gpu:
            return "compiled"
        logger.warning(
            "fused_optimizer on %s: the Pallas kernels run in interpret mode (the GPU kernels' numbers, slowly)",
            jax.default_backend(),
        )
        return "interpret"

    def _fused_update(self, grads: Any, opt_state: Any, params: Any, **extra: Any) -> tuple[Any, Any]:
        """The new parameters and state from the kernels (``jmp.kernels``' extra arguments ``extra``), each
        device updating its own shards (``shard_map``) in place. Under ZeRO-1 a device updates the slice of the
        parameters its state covers, and the new parameters are gathered over ``dp`` afterwards."""
        param_specs = jax.tree.map(lambda s: s.spec, self._like_state(jax.eval_shape(lambda p: p, params)))
        state_specs = jax.tree.map(lambda s: s.spec, self._state_shardings)
        split = {
            path: sharding.spec_axes(spec)
            for path, spec in jax.tree_util.tree_flatten_with_path(
                param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
            )[0]
        }

        def update(grads, opt_state, params, extra):
            with kernels.split_over(split):  # whole-tensor norms (LAMB's trust ratio) add up the shards
                return self.tx.update(grads, opt_state, params, return_params=True, **extra)

        local = jax.shard_map(
            update,
            mesh=self.model.layout.mesh,
            in_specs=(param_specs, state_specs, param_specs, PartitionSpec()),
            out_specs=(param_specs, state_specs),
            check_vma=False,
        )
        new, new_state = local(grads, opt_state, params, extra)
        # the frozen parameters' "new parameters" are optax.set_to_zero's zeros: they keep their values
        new_params = jax.tree.map(lambda frozen, p, n: p if frozen else n, self._frozen, params, new)
        return new_params, new_state

    def parameters_moved(self) -> None:
        """Called by the model when a pipelined model moves its parameters into the stages' buffers (first step):
        the state moves with them (a loaded or resumed state survives)."""
        arrays = portable_state.optimizer_arrays(self)
        self._build()
        self.opt_state, self.scale_state = portable_state.optimizer_state_from(self, arrays)

    def param_labels(self) -> dict[str, str]:
        """Each parameter's optimizer label (its torch param group, or frozen) by torch name."""
        names = self.model.layout.names
        if self.torch_optimizer is None:
            return {name: "all" for name in names}
        group_of = {id(p): i for i, g in enumerate(self.torch_optimizer.param_groups) for p in g["params"]}
        by_name = dict(self.model.torch_module.named_parameters(remove_duplicate=False))
        known = {id(p) for p in by_name.values()}
        unknown = [p for g in self.torch_optimizer.param_groups for p in g["params"] if id(p) not in known]
        if unknown:
            raise OptimizerError(
                f"the torch optimizer holds {len(unknown)} tensor(s) that are not parameters of the "
                "DistributedModel's module; build the optimizer on model.module.parameters()"
            )
        groups = {name: group_of.get(id(by_name[name])) for name in names}
        return {name: _FROZEN if group is None else _label(group) for name, group in groups.items()}

    def _like_state(self, tree: Any) -> Any:
        """Shardings of an optimizer state, or of a tree of parameter-shaped leaves as the state holds them: like
        the parameters, or split over ``dp`` too (shard_optimizer_state, ZeRO-1)."""
        return self.model.store.state_shardings(tree)

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

    def _apply(
        self,
        params,
        grads,
        opt_state,
        hyperparams,
        scaling,
        known_inf,
        grad_factor,
        *,
        checked: bool,
        dynamic: bool,
        clip=0.0,
    ):
        """One update of the (master) parameters from gradients multiplied by the loss scale.

        ``scaling`` is the loss scale (a scalar, or the dynamic scaler's state). ``checked``: an update with an
        inf/nan gradient (or ``known_inf``) is skipped, on the device, and the dynamic scale adjusted.
        ``grad_factor``: a clipping factor still to multiply the gradients by (``TrainingState.kept_grads``).
        ``clip``: the unscaled gradients are then scaled down to this global norm when above it.
        """
        scale = scaling.scale if dynamic else scaling
        opt_state = _set_hyperparams(opt_state, hyperparams)
        inv_scale = 1.0 / scale * grad_factor
        if clip:  # torch's clip_grad_norm_ factor, applied as the gradients are unscaled
            inv_scale = inv_scale * _clip_factor(grads, clip, inv_scale)[1]
        if self.fused is not None:
            return self._apply_fused(params, grads, opt_state, inv_scale, scaling, known_inf, checked, dynamic)
        grads = loss_scaling.unscaled(grads, inv_scale)  # float32, whatever the gradients are kept in
        if self._clip_before:  # the rule's own clipping over every group's gradients (apex LAMB)
            grads = torch_optimizers.apex_clip(grads, self._clip_before)
        updates, new_state = self.tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if not checked:
            return new_params, new_state, scaling, known_inf
        found_inf = jnp.logical_or(known_inf, jnp.logical_not(loss_scaling.all_finite(grads)))
        new_params, new_state = jax.tree.map(
            lambda new, old: jnp.where(found_inf, old, new), (new_params, new_state), (params, opt_state)
        )
        if dynamic:
            scaling = loss_scaling.updated(scaling, found_inf, self.scaling.args)
        return new_params, new_state, scaling, found_inf

    def _apply_fused(self, params, grads, opt_state, inv_scale, scaling, known_inf, checked, dynamic):
        """``_apply`` in one pass of the kernels: they read the gradients as the backward left them, unscale
        (and clip) them, and skip the update on an overflow, which a reduction over the gradients finds first."""
        found_inf = known_inf
        if checked:
            found_inf = jnp.logical_or(known_inf, jnp.logical_not(loss_scaling.all_finite(grads)))
        divisor = jnp.ones((), jnp.float32)
        if self._clip_before:
            divisor = torch_optimizers.apex_clip_divisor(loss_scaling.unscaled(grads, inv_scale), self._clip_before)
        extra = dict(grad_scale=inv_scale, grad_divisor=divisor, skip=found_inf)
        new_params, new_state = self._fused_update(grads, opt_state, params, **extra)
        if checked:  # the kernels kept their tensors; the scalars (step counts, hyper-parameters) are kept here
            new_state = jax.tree.map(
                lambda new, old: jnp.where(found_inf, old, new) if jnp.ndim(new) == 0 else new, new_state, opt_state
            )
            if dynamic:
                scaling = loss_scaling.updated(scaling, found_inf, self.scaling.args)
        return new_params, new_state, scaling, found_inf

    def step(self, closure: Any = None) -> None:
        """Apply the gradients accumulated since ``zero_grad()`` (none: no update, as in torch).

        With dynamic loss scaling an inf/nan gradient skips the update and lowers the scale (``overflow``
        says so afterwards); nothing waits for the devices. Under sharded data parallelism with the config's
        ``sdp_gradient_clipping``, the gradients' global norm is first clipped to it, as SMP does (as they
        are unscaled, in the update's pass).
        """
        if closure is not None:
            raise OptimizerError("optimizer.step(closure) is not supported: run the step function, then call step()")
        if not self.model.training_state.has_grads:
            return  # as in torch: no gradients, no update
        clip = self.model.layout.config.sdp_gradient_clipping
        if not clip or self.model.layout.mesh.shape["fsdp"] == 1:  # SMP's sharded-data-parallel clipping
            clip = 0.0
        dynamic = self.scaling.kind == "dynamic"
        scaling = self.scale_state if self.scale_state is not None else self._one
        scaling = self._run_update(scaling, self._no_inf, checked=dynamic, dynamic=dynamic, clip=float(clip))
        if dynamic:
            self.scale_state = scaling

    def update_master_grads(self) -> None:
        """SMP's fp16 call between backward and step: here it only checks the gradients for inf/nan
        (``overflow`` then answers before ``step()``); the unscaling into float32 happens inside the update."""
        grads, _ = self.model.training_state.kept_grads()  # a pending clipping factor keeps them finite or not
        if grads is not None and self.scaling.kind == "dynamic":
            self._found_inf = _has_inf(grads)

    def scaled_step(self, scale: jax.Array | None = None, known_inf: jax.Array | None = None) -> jax.Array:
        """``smp.amp.GradScaler.step``: update from gradients multiplied by ``scale`` (None: unscaled already),
        unless one is inf/nan or ``known_inf``; returns whether the update was skipped (a device bool)."""
        known_inf = self._no_inf if known_inf is None else known_inf
        if not self.model.training_state.has_grads:
            return known_inf
        self._run_update(self._one if scale is None else scale, known_inf, checked=True, dynamic=False)
        return self._found_inf

    def _run_update(
        self, scaling: Any, known_inf: jax.Array, *, checked: bool, dynamic: bool, clip: float = 0.0
    ) -> Any:
        training = self.model.training_state
        grads, factor = training.kept_grads()
        factor = self._one if factor is None else factor
        args = (training.params, grads, self.opt_state, self._hyperparams(), scaling, known_inf, factor)
        options = dict(checked=checked, dynamic=dynamic, clip=clip)
        try:
            result = self._update(*args, **options)
        except Exception as error:  # Pallas' lowering and XLA's Triton compiler raise errors of their own types
            if not self._falls_back_from_kernels(error, args[:3]):
                raise
            result = self._update(*args, **options)
        training.params, self.opt_state, scaling, found_inf = result
        self._kernels_ran = self.fused is not None
        self._found_inf = found_inf if checked else None
        self.grads_unscaled = False
        if self.torch_optimizer is not None:
            self.torch_optimizer._opt_called = True  # what torch's LR schedulers check before stepping
        return scaling

    def _falls_back_from_kernels(self, error: Exception, donated: tuple) -> bool:
        """After the first compiled-kernel update failed to build, before it consumed its inputs: switch to
        the optax update (the same state tree, so the state carries over) and say so."""
        if self.fused != "compiled" or self._kernels_ran:
            return False
        if any(leaf.is_deleted() for leaf in jax.tree.leaves(donated) if isinstance(leaf, jax.Array)):
            return False
        logger.warning(
            "fused_optimizer: the Pallas kernels did not build on this %s (%s: %s); the optax update runs instead "
            "(set fused_optimizer: False to skip trying)",
            jax.default_backend(),
            type(error).__name__,
            str(error).splitlines()[0] if str(error) else "",
        )
        self._kernels_failed = True
        state = self.opt_state
        self._build()
        self.opt_state = state
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.training_state.grads = None
        self.grads_unscaled = False

    def clip_master_grads(self, max_norm: float) -> jax.Array:
        """Scale the current gradients so their global norm is at most ``max_norm``; returns the norm before.

        Like ``torch.nn.utils.clip_grad_norm_`` over all parameters (the norm is global across devices).
        """
        training = self.model.training_state
        if not training.has_grads:
            return jnp.zeros((), jnp.float32)
        scale = self._one if self.grads_unscaled else self.model.loss_scale
        norm, factor = _reported_norm_and_factor(training.grads, float(max_norm), scale)
        training.scale_grads_later(factor)  # multiplied in by the update, as it unscales them
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
        """torch's format for a torch optimizer ({"state": {index: {...}}, "param_groups": [...]}).

        With loss scaling or a half-precision module it also holds what SMP's fp16 optimizer keeps:
        ``loss_scaler`` (the scale and the dynamic scaler's counters), ``dynamic_loss_scale``, ``overflow``,
        and ``fp32_from_fp16`` (the float32 master parameters, per param group, when the module's own
        parameters are half precision: ``model.state_dict()`` then holds them rounded).
        """
        return self._state_dict(lambda array: array)

    def local_state_dict(self) -> dict:
        """``state_dict()`` with this process's piece of each array (all of it on one host), as SMP's; it
        holds ``"_smp_is_partial": True`` and ``load_state_dict`` takes it back."""
        return self._state_dict(local_piece) | {PARTIAL_MARK: True}

    def _state_dict(self, piece: Any) -> dict:
        """``state_dict()`` of ``piece(array)`` of each array (the whole array, or this process's piece)."""
        to_tensor = lambda array: array_to_tensor(piece(array))  # noqa: E731
        if self.torch_optimizer is None:
            optax_state = jax.tree.map(lambda array: host_array(piece(array)), self.opt_state)
            return {"optax_state": optax_state} | self._mixed_precision_state(to_tensor)
        saved = self.torch_optimizer.state_dict() | self._mixed_precision_state(to_tensor)
        index = self._param_index()
        per_param: dict[int, dict[str, torch.Tensor]] = {}
        for group, inject_state in _group_states(self.opt_state):
            for state_type, fields in self.rule.state_fields.items():
                for found in _find_states(inject_state.inner_state, state_type):
                    for field, torch_name in fields.items():
                        if torch_name != "step":
                            field_state = self._by_name(getattr(found, field))
                            _collect_field(field_state, torch_name, index, per_param, to_tensor)
            if self.rule.factory is not torch_optimizers.sgd:  # torch's SGD keeps no step count
                step = torch.tensor(float(inject_state.count), dtype=torch.float32)
                for i in self._group_indices(group):
                    per_param.setdefault(i, {})["step"] = step.clone()
        saved["state"] = per_param
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        self._load_mixed_precision_state(state_dict)
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

    def _mixed_precision_state(self, to_tensor: Any) -> dict:
        saved: dict[str, Any] = {}
        if self.scaling.kind is not None:
            saved["dynamic_loss_scale"] = self.scaling.kind == "dynamic"
            saved["loss_scaler"] = {"cur_scale": self.loss_scale}
            if self.scaling.kind == "dynamic":
                held = jax.device_get(self.scale_state)
                saved["loss_scaler"] |= {
                    "cur_iter": int(held.iteration),
                    "last_overflow_iter": int(held.last_overflow),
                    "cur_hysteresis": int(held.hysteresis),
                } | dataclasses.asdict(self.scaling.args)
            saved["overflow"] = self.overflow
        if self._module_is_half():
            params = self.model.layout.by_name(self.model.params)
            names = self._names_by_position()
            saved["fp32_from_fp16"] = [
                [to_tensor(params[names[i]]) for i in self._group_indices(g)] for g in range(len(self.param_groups))
            ]
        return saved

    def _load_mixed_precision_state(self, state_dict: dict) -> None:
        scaler = state_dict.get("loss_scaler")
        if scaler is not None and self.scaling.kind == "dynamic":
            self.scale_state = self._place(
                loss_scaling.LossScaleState(
                    np.float32(scaler["cur_scale"]),
                    np.int32(scaler.get("cur_iter", 0)),
                    np.int32(scaler.get("last_overflow_iter", -1)),
                    np.int32(scaler.get("cur_hysteresis", self.scaling.args.delayed_shift)),
                )
            )
        elif scaler is not None and self.scaling.kind == "static":
            self.scale_state = self._place(np.float32(scaler["cur_scale"]))
        masters = state_dict.get("fp32_from_fp16")
        if masters is not None and self.torch_optimizer is not None:
            names = self._names_by_position()
            loaded = {
                names[i]: tensor
                for g, tensors in enumerate(masters)
                for i, tensor in zip(self._group_indices(g), tensors)
            }
            self.model.load_state_dict(loaded, strict=False)

    def _module_is_half(self) -> bool:
        """Whether the user's module holds half-precision parameters (jmp keeps float32 masters for them)."""
        if self.torch_optimizer is None:
            return False
        return any(p.dtype in precision.HALF for p in self.model.torch_module.parameters())

    def _names_by_position(self) -> dict[int, str]:
        """Index in torch's optimizer state_dict -> the parameter's torch name (the first of tied names)."""
        names: dict[int, str] = {}
        for name, position in self._param_index().items():
            names.setdefault(position, name)
        return names

    def _by_name(self, field: Any) -> Any:
        """A params-shaped state field keyed by torch name (a pipelined model's stage buffers unpacked)."""
        return self.model.store.field_named(field)

    def _load_field(self, field: Any, torch_name: str, index: dict, tensors: dict) -> Any:
        """``_loaded_field`` through the stage buffers of a pipelined model (unpacked, loaded, packed again)."""
        store = self.model.store
        if not store.is_parameter_shaped(field):
            return field
        named = _loaded_field(store.field_named(field), torch_name, index, tensors)
        return store.field_from_named(named, like=field)

    def _positions(self) -> dict[int, int]:
        """id(torch parameter) -> its index in torch's optimizer state_dict (param_groups order)."""
        order = (p for g in self.torch_optimizer.param_groups for p in g["params"])
        return {id(p): i for i, p in enumerate(order)}

    def _param_index(self) -> dict[str, int]:
        """torch parameter name (tied names too) -> its index in torch's optimizer state_dict."""
        positions = self._positions()
        named = self.model.torch_module.named_parameters(remove_duplicate=False)
        return {name: positions[id(p)] for name, p in named if id(p) in positions}

    def _group_indices(self, group: int) -> list[int]:
        positions = self._positions()
        return [positions[id(p)] for p in self.torch_optimizer.param_groups[group]["params"]]


@dataclasses.dataclass(frozen=True)
class _Scaling:
    """How an optimizer scales the loss: not at all, by a constant, or dynamically (fp16)."""

    kind: str | None  # None | "static" | "dynamic"
    initial: Any = None  # the scale (static) or the scaler's first state (dynamic)
    args: loss_scaling.DynamicLossScaleArgs | None = None


def _scaling_for(policy: Any, static: float, dynamic: bool, args: dict | None, loose_args: dict) -> _Scaling:
    """SMP's loss-scaling options, checked against what the model computes in."""
    given = {**(args or {}), **loose_args}
    if given and not dynamic:
        raise OptimizerError(
            f"dynamic loss scaling settings {sorted(given)} were given with dynamic_loss_scale=False; "
            "pass dynamic_loss_scale=True to use them"
        )
    if dynamic and static != 1.0:
        raise OptimizerError(
            f"static_loss_scale={static} and dynamic_loss_scale=True both ask to scale the loss; choose one "
            "(SMP's scripts pass static_loss_scale=None with dynamic scaling)"
        )
    computes_in = "bfloat16" if policy.half_dtype == jnp.dtype(jnp.bfloat16) else "float32"
    if dynamic:
        parsed = loss_scaling.DynamicLossScaleArgs.from_dict(given)
        if policy.is_fp16:
            return _Scaling("dynamic", loss_scaling.initial_state(parsed), parsed)
        precision.warn_once(
            f"dynamic-{computes_in}",
            f"dynamic_loss_scale=True is for fp16 training; this model computes in {computes_in}, whose "
            "exponent range keeps gradients from underflowing, so jmp does not scale the loss",
        )
        return _Scaling(None)
    if static != 1.0:
        if policy.half_dtype == jnp.dtype(jnp.bfloat16):
            precision.warn_once(
                "static-bf16",
                f"static_loss_scale={static} with bf16 training: bf16 does not underflow like fp16, so the "
                "scale changes nothing but rounding; it is applied as given",
            )
        return _Scaling("static", np.float32(static))
    if policy.is_fp16:
        precision.warn_once(
            "fp16-unscaled",
            "fp16 training without loss scaling: gradients below float16's range (~6e-8) become zero; "
            "pass dynamic_loss_scale=True (or a static_loss_scale) to smp.DistributedOptimizer",
        )
    return _Scaling(None)


@jax.jit
def _has_inf(grads: Any) -> jax.Array:
    return jnp.logical_not(loss_scaling.all_finite(grads))


@jax.jit
def _reported_norm_and_factor(grads: Any, max_norm: jax.Array, loss_scale: jax.Array) -> tuple[jax.Array, Any]:
    """(norm, factor) of torch's ``clip_grad_norm_`` rule on the unscaled float32 gradients; an inf/nan norm
    (an fp16 overflow) is reported as -1, as SMP does (the gradients then stay non-finite and the update is
    skipped)."""
    norm, factor = _clip_factor(grads, max_norm, 1.0 / loss_scale)
    return jnp.where(jnp.isfinite(norm), norm, -1.0), factor


def _clip_factor(grads: Any, max_norm: float, inv_scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(norm, factor): the global norm of the gradients multiplied by ``inv_scale`` (unscaled), and what torch's
    ``clip_grad_norm_`` multiplies them by (at most 1)."""
    norm = optax.global_norm(loss_scaling.unscaled(grads, inv_scale))
    return norm, jnp.minimum(1.0, max_norm / (norm + 1e-6))


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
        return jax.device_put(tensor_to_array(entry[torch_name]).astype(leaf.dtype), leaf.sharding)

    return jax.tree_util.tree_map_with_path(load, field)


def _set_counts(tree: Any, count: jax.Array) -> Any:
    """Give every step counter inside a group's state the loaded step (Adam's bias correction uses it)."""
    if hasattr(tree, "_fields") and "count" in tree._fields:
        return tree._replace(count=jnp.array(count, tree.count.dtype))  # own buffer: the state is donated
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(_set_counts(item, count) for item in tree)
    return tree
